"""Synchronous against one-step-off GSPO on the real SGLang server (CPU, tiny model): the same tiny job for
``--steps`` steps with ``rollout.max_staleness`` 0 and 1 (``loss.off_policy`` none), then a table of
wall-clock per step, the learner's idle wait for the next batch, the clip fraction, the reward and the
train/inference log-prob mismatch. A measurement, not a test (nothing is asserted beyond the runs
finishing); run it from the repository root with the main venv:

    python tests/integration/measure_staleness.py --steps 8 --out /tmp/staleness
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import platform
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(os.path.dirname(_HERE))]  # sglang_cpu and the repository root
from sglang_cpu import ROOT, launch, server_config, write_tiny_checkpoint  # noqa: E402
from test_real_gspo_run import _run_tiny  # noqa: E402

KEYS = ("time_step_s", "time_rollout_s", "time_rollout_wait_s", "clip_fraction", "reward_mean", "logprob_mismatch")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", required=True)
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
    args = ap.parse_args()
    out = Path(args.out)
    base = write_tiny_checkpoint(str(out / "base"))
    config = dataclasses.replace(server_config(base, str(out / "sglang_logs")), startup_timeout_s=1800.0)
    procs, start_s = launch([config], str(out / "sglang_logs"))  # a loaded machine starts it slowly
    proc = procs[0]
    try:
        server = SimpleNamespace(url=proc.url, base_dir=base, holds_base=True, log_tail=proc.log_tail)
        results = {}
        for k in args.staleness:
            from gspo_mcore.rollout import SGLangClientConfig, SGLangEngine

            async def reload():
                async with SGLangEngine([proc.url], config=SGLangClientConfig()) as eng:
                    await eng.update_weights_from_disk(base, 0)

            asyncio.run(reload())  # every run starts from the test checkpoint, version 0
            (out / f"k{k}").mkdir(parents=True, exist_ok=True)
            rows = _run_tiny(server, out / f"k{k}", lambda *a, **kw: None, "", "disk", k, steps=args.steps)
            results[k] = rows
    finally:
        proc.shutdown()
    print(f"# {args.steps} steps of the tiny job, 2 learner ranks + 1 SGLang server, on {_cpu()}")
    print(f"# server start {start_s:.0f} s; means over steps 1..{args.steps - 1} (step 0 is synchronous in both)")
    print("| max_staleness | " + " | ".join(KEYS) + " |")
    print("|---|" + "---|" * len(KEYS))
    for k, rows in results.items():
        later = rows[1:]
        cells = [f"{statistics.mean(r.get(key, 0.0) for r in later):.4g}" for key in KEYS]
        print(f"| {k} | " + " | ".join(cells) + " |")


def _cpu() -> str:
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return f"{names[0] if names else platform.machine()} x {len(names)}"


if __name__ == "__main__":
    os.chdir(ROOT)
    main()
