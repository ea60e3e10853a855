"""Regenerate the golden trace of the tiny job: ``tests/golden/tiny_trace.json``.

Runs ``examples/tiny/config.yaml`` (its seeds, its data written by ``examples.tiny.prepare`` with the
defaults) for ``STEPS`` steps on 2 CPU ranks and records each step's ``loss`` and ``reward_mean``. Run from
the repository root, after an intended change of the tiny task, its config or the trainer's arithmetic
(see README.md here)::

    PYTHONPATH=$PWD python tests/golden/make_golden.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

from gspo_mcore.platform.launch import torchrun_prefix

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_trace.json")
CONFIG = "examples/tiny/config.yaml"
STEPS = 20
KEYS = ("loss", "reward_mean")


def run_trace(work_dir: str, *, steps: int = STEPS, timeout: float = 600) -> list[dict]:
    """The tiny job's first ``steps`` steps in ``work_dir``: ``[{"step", "loss", "reward_mean"}]``.

    Raises ``RuntimeError`` with the job's output when a command fails.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    data, out = os.path.join(work_dir, "data"), os.path.join(work_dir, "run")
    commands = [
        [sys.executable, "-m", "examples.tiny.prepare", "--out", data],
        [
            *torchrun_prefix(2),
            "-m",
            "gspo_mcore.train",
            "--config",
            CONFIG,
            f"steps={steps}",
            f"model.hf_dir={data}/model",
            f"data.paths=[{data}/prompts.jsonl]",
            f"log.output_dir={out}",
            "log.progress_bar=false",
            "log.tensorboard=false",
        ],
    ]
    for cmd in commands:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} failed (exit {proc.returncode})\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
            )
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [{"step": r["step"], **{k: r[k] for k in KEYS}} for r in rows]


def machine() -> str:
    """The CPU model and the instruction set the compiled kernels chose (the trace is exact only there)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        from gspo_mcore import _C

        isa = _C.set_cpu_isa("auto")
    except Exception as exc:  # noqa: BLE001 - recorded, not fatal: the trace is still valid
        isa = f"no extension ({type(exc).__name__})"
    return f"{cpu}, kernels {isa}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=GOLDEN, help="the trace file to write")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        steps = run_trace(d)
    import torch

    golden = {
        "config": CONFIG,
        "overrides": [f"steps={STEPS}"],
        "machine": machine(),
        "torch": torch.__version__,
        "steps": steps,
    }
    with open(args.out, "w") as f:
        json.dump(golden, f, indent=1)
        f.write("\n")
    sys.stdout.write(f"wrote {args.out}: {len(steps)} steps\n")


if __name__ == "__main__":
    main()
