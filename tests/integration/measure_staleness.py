"""Synchronous against asynchronous GSPO on the real SGLang server (CPU, tiny model): the same tiny job for
``--steps`` steps under each ``--runs`` setting, ``MAX_STALENESS:OFF_POLICY_MODE[:partial]`` (for example
``0:none 0:tis 1:none 1:tis 1:tis:partial``; ``partial`` turns on ``rollout.partial_rollouts``), then a
markdown table and a JSON file of

- wall-clock per step (``time_step_s``; the learner's own phases),
- the learner's idle time per step: waiting for rollouts (``time_rollout_s`` + ``time_rollout_wait_s``),
- the engine's busy time per step (``time_generation_s``, the generation of the step's batch, in the
  background for a prefetched one) and its idle time (``time_step_s - time_generation_s``, on average),
- the clip fraction, KL(mu || pi_prox) (``kl_behaviour_prox``), the importance weights (``is_weight_*``),
  the train/inference log-prob mismatch, the staleness, and the reward per step.

Means are over steps 1..N-1 (step 0 is synchronous in every setting and carries the warm-up). A
measurement, not a test (nothing is asserted beyond the runs finishing). Run it from the repository root
with the main venv, under ``nice`` on a shared machine:

    GSPO_SGLANG_VENV=/path/to/sglang-venv PYTHONPATH=$PWD nice -n 19 python \\
        tests/integration/measure_staleness.py --steps 8 --out /tmp/staleness --runs 0:none 0:tis 1:none 1:tis

Writes ``<out>/results.json`` and ``<out>/table.md`` (and prints the table); ``--render`` prints the
table of an existing ``results.json`` again.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(os.path.dirname(_HERE))]  # sglang_cpu and the repository root
from sglang_cpu import ROOT, launch, server_config, write_tiny_checkpoint  # noqa: E402
from test_real_gspo_run import _run_tiny  # noqa: E402

# (column, metric key or a function of the row)
COLUMNS = (
    ("step s", "time_step_s"),
    ("step s (median)", ("median", "time_step_s")),
    ("learner idle s", lambda r: r.get("time_rollout_s", 0.0) + r.get("time_rollout_wait_s", 0.0)),
    ("engine busy s", "time_generation_s"),
    ("engine idle s", lambda r: max(r["time_step_s"] - r.get("time_generation_s", 0.0), 0.0)),
    ("clip frac", "clip_fraction"),
    ("KL(mu, prox)", "kl_behaviour_prox"),
    ("is_w mean", "is_weight_mean"),
    ("is_w min", "is_weight_min"),
    ("is_w max", "is_weight_max"),
    ("mismatch", "logprob_mismatch"),
    ("lag mean", "staleness_mean"),
    ("reward", "reward_mean"),
)


@dataclasses.dataclass(frozen=True)
class Setting:
    max_staleness: int
    mode: str
    partial: bool

    @property
    def name(self) -> str:
        return f"k{self.max_staleness}_{self.mode}" + ("_partial" if self.partial else "")

    def overrides(self) -> dict:
        rollout: dict = {"partial_rollouts": True} if self.partial else {}
        if self.partial:
            rollout["sglang"] = {"client": {"pause_mode": "retract"}}
        return {"loss": {"off_policy": {"mode": self.mode}}, "rollout": rollout}


def parse_setting(text: str) -> Setting:
    parts = text.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "partial"):
        raise argparse.ArgumentTypeError(f"--runs {text!r}: expected MAX_STALENESS:MODE[:partial]")
    return Setting(int(parts[0]), parts[1], len(parts) == 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", type=parse_setting, nargs="+", default=[parse_setting(t) for t in ("0:none", "1:none")])
    ap.add_argument("--render", action="store_true", help="only print the table of <out>/results.json again")
    args = ap.parse_args()
    out = Path(args.out)
    if args.render:
        saved = json.loads((out / "results.json").read_text())
        print(render(saved["runs"], saved["steps"], saved["server_start_s"]), end="")
        return
    out.mkdir(parents=True, exist_ok=True)
    base = write_tiny_checkpoint(str(out / "base"))
    config = dataclasses.replace(server_config(base, str(out / "sglang_logs")), startup_timeout_s=1800.0)
    procs, start_s = launch([config], str(out / "sglang_logs"))  # a loaded machine starts it slowly
    proc = procs[0]
    results = {}
    try:
        server = SimpleNamespace(url=proc.url, base_dir=base, holds_base=True, log_tail=proc.log_tail)
        for setting in args.runs:
            from gspo_mcore.rollout import SGLangClientConfig, SGLangEngine

            async def reload():
                async with SGLangEngine([proc.url], config=SGLangClientConfig()) as eng:
                    await eng.update_weights_from_disk(base, 0)

            asyncio.run(reload())  # every run starts from the test checkpoint, version 0
            run_dir = out / setting.name
            run_dir.mkdir(parents=True, exist_ok=True)
            figures: dict[str, float] = {}
            load_before, t0 = os.getloadavg(), time.monotonic()
            rows = _run_tiny(
                server,
                run_dir,
                lambda key, value: figures.__setitem__(key, value),
                "wall",
                "disk",
                setting.max_staleness,
                steps=args.steps,
                overrides=setting.overrides(),
            )
            results[setting.name] = {
                "setting": dataclasses.asdict(setting),
                "wall_s": time.monotonic() - t0,
                "loadavg_before": load_before,
                "loadavg_after": os.getloadavg(),
                "rows": rows,
            }
            print(f"{setting.name}: {len(rows)} steps in {results[setting.name]['wall_s']:.0f} s", flush=True)
            (out / "results.json").write_text(json.dumps(_meta(args, start_s) | {"runs": results}, indent=1))
    finally:
        proc.shutdown()
    table = render(results, args.steps, start_s)
    (out / "table.md").write_text(table)
    print(table)


def _meta(args, start_s: float) -> dict:
    return {"steps": args.steps, "cpu": _cpu(), "server_start_s": start_s, "command": " ".join(sys.argv)}


def render(results: dict, steps: int, start_s: float) -> str:
    lines = [
        f"{steps} steps of the tiny job (8 prompts x 4 samples, max_new_tokens 6), 2 learner ranks + 1 SGLang "
        f"server on {_cpu()}; server start {start_s:.0f} s. Means over steps 1..{steps - 1} (step 0 is "
        "synchronous in every setting).",
        "",
        "| setting | " + " | ".join(c for c, _ in COLUMNS) + " | run wall s | load avg (1 min) before/after |",
        "|---|" + "---|" * (len(COLUMNS) + 2),
    ]
    for name, res in results.items():
        later = res["rows"][1:] or res["rows"]
        cells = []
        for _, key in COLUMNS:
            stat, key = key if isinstance(key, tuple) else ("mean", key)
            vals = [key(r) if callable(key) else r.get(key) for r in later]
            vals = [v for v in vals if v is not None]
            cells.append(f"{getattr(statistics, stat)(vals):.4g}" if vals else "-")
        load = f"{res['loadavg_before'][0]:.1f} / {res['loadavg_after'][0]:.1f}"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {res['wall_s']:.0f} | {load} |")
    lines += ["", "Reward per step:", ""]
    for name, res in results.items():
        lines.append(f"- {name}: " + ", ".join(f"{r['reward_mean']:.3f}" for r in res["rows"]))
    return "\n".join(lines) + "\n"


def _cpu() -> str:
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return f"{names[0] if names else platform.machine()} x {len(names)}"


if __name__ == "__main__":
    os.chdir(ROOT)
    main()
