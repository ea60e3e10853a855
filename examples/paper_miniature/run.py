"""The GSPO paper in miniature: one command trains GSPO, GSPO-token, SAPO, CISPO, GMPO, GRPO and GRPO + Routing
Replay on the tiny digit-reversal task with a dense and a MoE model over several seeds, then writes the report.

    python -m examples.paper_miniature.run --out runs/paper_miniature [--seeds 3] [--steps N] [--jobs 2]
        [--models dense moe] [--algos gspo gspo_token sapo cispo gmpo grpo grpo_rr] [key.path=value ...]

Each run is one single-process ``python -m gspo_mcore.train`` (OMP_NUM_THREADS=1), ``--jobs`` at a time,
writing ``<out>/<model>/<algo>/seed<k>/`` (metrics.jsonl, config.yaml, train.log, run.json). A run whose
metrics.jsonl already holds every step under the same configuration is skipped, so rerunning the command
resumes the matrix. ``key.path=value`` overrides apply to every run (after ``--`` when they follow
``--models`` or ``--algos``). Exits 1 if any run failed (the report is still written
from the runs that finished).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "examples", "paper_miniature", "config.yaml")
MODELS = ("dense", "moe")
ALGOS = {  # name -> (loss.variant, Routing Replay)
    "gspo": ("gspo", False),
    "gspo_token": ("gspo_token", False),
    "sapo": ("sapo", False),
    "cispo": ("cispo", False),
    "gmpo": ("gmpo", False),
    "grpo": ("grpo", False),
    "grpo_rr": ("grpo", True),
}
MEASURE_EVERY = 5  # MoE runs measure routing volatility every this many steps (one extra forward pass)


@dataclass(frozen=True)
class Run:
    """One training run of the matrix."""

    model: str
    algo: str
    seed: int
    out_dir: str
    overrides: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.model}/{self.algo}/seed{self.seed}"


def routing_supported() -> bool:
    """Whether this trainer has the ``routing`` config section (Routing Replay, volatility measurement)."""
    from gspo_mcore.trainer import TrainConfig

    return any(f.name == "routing" for f in dataclasses.fields(TrainConfig))


def build_matrix(
    out: str,
    *,
    models: list[str],
    algos: list[str],
    seeds: int,
    steps: int | None,
    routing: bool,
    measure_every: int = MEASURE_EVERY,
    extra: tuple[str, ...] = (),
) -> list[Run]:
    """The runs: every model x algorithm x seed, except GRPO + Routing Replay on a dense model (a no-op there)
    and, when the trainer lacks the ``routing`` section, GRPO + Routing Replay altogether."""
    out = os.path.abspath(out)
    data = os.path.join(out, "inputs", "prompts.jsonl")
    runs = []
    for model in models:
        hf_dir = os.path.join(out, "inputs", "model_moe" if model == "moe" else "model")
        for algo in algos:
            variant, replay = ALGOS[algo]
            if replay and (model != "moe" or not routing):
                continue
            for k in range(seeds):
                run_dir = os.path.join(out, model, algo, f"seed{k}")
                ov = [
                    f"model.hf_dir={hf_dir}",
                    f"data.paths=[{data}]",
                    f"loss.variant={variant}",
                    f"seed={k + 1}",
                    f"model.init_seed={k + 1}",
                    f"sampler.seed={k}",
                    f"log.output_dir={run_dir}",
                    "log.progress_bar=false",
                    "log.overwrite=true",  # an unfinished run starts again from scratch in its folder
                ]
                if steps is not None:
                    ov.append(f"steps={steps}")
                if model == "moe" and routing:
                    ov += [f"routing.replay={'learner' if replay else 'off'}", f"routing.measure_every={measure_every}"]
                runs.append(Run(model, algo, k, run_dir, tuple(ov) + tuple(extra)))
    return runs


def train_argv(run: Run, config: str = CONFIG) -> list[str]:
    return ["--config", config, *run.overrides]


def recorded_steps(run_dir: str) -> set[int]:
    """Steps recorded in ``<run_dir>/metrics.jsonl`` (a cut-off last line is ignored)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    seen: set[int] = set()
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    seen.add(int(json.loads(line)["step"]))
                except (ValueError, KeyError, TypeError):
                    pass
    return seen


def is_complete(run: Run, steps: int, config: str = CONFIG) -> bool:
    """The run recorded exactly steps 0..steps-1 under the configuration it would be launched with now."""
    from gspo_mcore.config import load_yaml, to_dict
    from gspo_mcore.train import parse_config
    from gspo_mcore.trainer import resolve

    saved = os.path.join(run.out_dir, "config.yaml")
    if recorded_steps(run.out_dir) != set(range(steps)) or not os.path.exists(saved):
        return False
    # the trainer saves the resolved configuration (every derived default filled in)
    wanted = _flatten(json.loads(json.dumps(to_dict(resolve(parse_config(train_argv(run, config)))))))
    have = _flatten(json.loads(json.dumps(load_yaml(saved))))
    return all(key in wanted and wanted[key] == value for key, value in have.items())  # new fields: ignored


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _count_lines(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def _tail(path: str, lines: int = 3) -> str:
    with open(path, errors="replace") as f:
        return "".join("    " + line for line in f.readlines()[-lines:])


def _launch(run: Run, config: str) -> subprocess.Popen:
    os.makedirs(run.out_dir, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "gspo_mcore.train", *train_argv(run, config)]
    with open(os.path.join(run.out_dir, "train.log"), "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _record(run: Run, returncode: int, steps: int, wall_s: float) -> bool:
    done = len(recorded_steps(run.out_dir) & set(range(steps)))
    ok = returncode == 0 and done == steps
    with open(os.path.join(run.out_dir, "run.json"), "w") as f:
        json.dump(
            {
                "name": run.name,
                "returncode": returncode,
                "steps_done": done,
                "steps": steps,
                "wall_s": round(wall_s, 1),
                "ok": ok,
            },
            f,
        )
    return ok


def execute(runs: list[Run], *, steps: int, jobs: int, config: str = CONFIG) -> list[Run]:
    """Run the matrix ``jobs`` at a time, skipping complete runs; returns the runs that failed."""
    from tqdm import tqdm

    todo = [r for r in runs if not is_complete(r, steps, config)]
    failed: list[Run] = []
    running: dict[Run, tuple[subprocess.Popen, float]] = {}
    finished_steps = (len(runs) - len(todo)) * steps
    finished = len(runs) - len(todo)
    bar = tqdm(
        total=len(runs) * steps,
        initial=finished_steps,
        unit="step",
        dynamic_ncols=True,
        mininterval=1.0 if sys.stderr.isatty() else 60.0,
    )
    try:
        while todo or running:
            if todo and len(running) < jobs:  # one launch a second: starts are staggered
                run = todo.pop(0)
                running[run] = (_launch(run, config), time.time())
            time.sleep(1.0)
            for run, (proc, t0) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[run]
                finished += 1
                ok = _record(run, proc.returncode, steps, time.time() - t0)
                finished_steps += steps if ok else min(_count_lines(os.path.join(run.out_dir, "metrics.jsonl")), steps)
                if not ok:
                    failed.append(run)
                    log = os.path.join(run.out_dir, "train.log")
                    tqdm.write(f"FAILED {run.name} (exit {proc.returncode}): see {log}\n" + _tail(log))
            bar.set_description(f"{finished}/{len(runs)} runs, {len(failed)} failed", refresh=False)
            bar.update(
                finished_steps
                + sum(min(_count_lines(os.path.join(r.out_dir, "metrics.jsonl")), steps) for r in running)
                - bar.n
            )
    finally:
        for proc, _ in running.values():  # interrupted: stop the children this call started
            proc.terminate()
        for proc, _ in running.values():
            proc.wait()
        bar.close()
    return failed


def resolved_steps(config: str, steps: int | None, extra: tuple[str, ...]) -> int:
    from gspo_mcore.config import apply_overrides, load_yaml

    data = apply_overrides(load_yaml(config), list(extra) + ([f"steps={steps}"] if steps is not None else []))
    return int(data.get("steps", 100))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--out", default="runs/paper_miniature")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="default: the config's")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one CPU core each)")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--algos", nargs="+", choices=list(ALGOS), default=list(ALGOS))
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("overrides", nargs="*", help="key.path=value, applied to every run")
    args = parser.parse_args(argv)

    from examples.paper_miniature import report
    from examples.tiny.task import prepare
    from gspo_mcore.config import ConfigError
    from gspo_mcore.train import parse_config

    routing = routing_supported()
    if not routing:
        print(
            "run: this trainer has no `routing` config: GRPO + Routing Replay is skipped and routing volatility "
            "is not measured",
            file=sys.stderr,
        )
    extra = tuple(args.overrides)
    steps = resolved_steps(args.config, args.steps, extra)
    runs = build_matrix(
        args.out, models=args.models, algos=args.algos, seeds=args.seeds, steps=args.steps, routing=routing, extra=extra
    )
    for run in runs:  # refuse a bad matrix before anything starts
        try:
            parse_config(train_argv(run, args.config))
        except ConfigError as exc:
            print(f"run: {run.name}: config error: {exc}", file=sys.stderr)
            return 2
    inputs = os.path.join(os.path.abspath(args.out), "inputs")
    for model in args.models:
        prepare(inputs, moe=model == "moe")
    with open(os.path.join(args.out, "matrix.json"), "w") as f:
        json.dump(
            {
                "config": os.path.abspath(args.config),
                "steps": steps,
                "seeds": args.seeds,
                "routing_supported": routing,
                "measure_every": MEASURE_EVERY if routing else 0,
                "runs": [
                    {"name": r.name, "dir": os.path.relpath(r.out_dir, args.out), "overrides": r.overrides}
                    for r in runs
                ],
            },
            f,
            indent=1,
        )
    t0 = time.time()
    failed = execute(runs, steps=steps, jobs=args.jobs, config=args.config)
    print(f"run: {len(runs) - len(failed)}/{len(runs)} runs complete in {time.time() - t0:.0f} s")
    path = report.write_report(args.out)
    print(f"run: report in {path}")
    for run in failed:
        print(f"run: FAILED {run.name}: {os.path.join(run.out_dir, 'train.log')}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
