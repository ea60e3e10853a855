"""examples/paper_miniature: the run matrix, the report, and one small end-to-end run.

- The matrix holds every model x algorithm x seed except GRPO + Routing Replay on the dense model; every
  run's overrides parse into a valid TrainConfig that says what the run is meant to be (the loss variant, the
  seeds, Routing Replay only where asked, routing measurement on the MoE runs).
- A run counts as done (and is skipped on a rerun) only with every step recorded under the same config.
- The report, fed synthetic metrics (a collapsing run, a stalled run, a run without routing keys, an
  incomplete run, a cut-off line), writes report.md and the PNGs, with the table rows the data imply and
  exactly the flagged runs flagged.
- run.py end to end: two 2-step MoE runs complete, the report names both, and a rerun starts nothing; a
  run that fails makes run.py exit 1 with the log's path, and the report still comes out.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from helpers import ROOT

from examples.paper_miniature import report, run
from gspo_mcore.train import parse_config

ALL_ALGOS = ["gspo", "gspo_token", "sapo", "cispo", "gmpo", "grpo", "grpo_rr"]


def _matrix(tmp_path, routing=True, **kw):
    args = dict(models=["dense", "moe"], algos=ALL_ALGOS, seeds=3, steps=None, routing=routing)
    args.update(kw)
    return run.build_matrix(str(tmp_path), **args)


def test_matrix_covers_models_algos_seeds_without_dense_routing_replay(tmp_path):
    runs = _matrix(tmp_path)
    names = {r.name for r in runs}
    assert len(runs) == len(names) == (6 + 7) * 3
    assert not any(r.model == "dense" and r.algo == "grpo_rr" for r in runs)
    assert {f"moe/grpo_rr/seed{k}" for k in range(3)} <= names
    assert len({r.out_dir for r in runs}) == len(runs)
    assert runs[0].out_dir == os.path.join(str(tmp_path), "dense", "gspo", "seed0")
    without = _matrix(tmp_path, routing=False)  # a trainer without the routing section: no GRPO + RR at all
    assert len(without) == 12 * 3 and not any(r.algo == "grpo_rr" for r in without)


@pytest.mark.skipif(not run.routing_supported(), reason="the trainer has no `routing` config section yet")
def test_every_run_parses_into_the_config_it_is_meant_to_be(tmp_path):
    runs = _matrix(tmp_path, steps=7, extra=("rollout.prompts_per_step=4",))
    base = parse_config(["--config", run.CONFIG, "model.hf_dir=x", "data.paths=[y.jsonl]"])
    for r in runs:
        cfg = parse_config(run.train_argv(r))
        assert cfg.loss.variant == run.ALGOS[r.algo][0]
        assert cfg.loss.eps_low is None and cfg.loss.eps_high is None  # each variant's paper default
        assert (cfg.seed, cfg.model.init_seed, cfg.sampler.seed) == (r.seed + 1, r.seed + 1, r.seed)
        assert cfg.steps == 7 and cfg.rollout.prompts_per_step == 4
        assert cfg.log.output_dir == r.out_dir and not cfg.log.progress_bar and not cfg.log.tensorboard
        assert cfg.checkpoint.save_every == 0
        assert cfg.model.hf_dir.endswith("model_moe" if r.model == "moe" else os.sep + "model")
        assert cfg.routing.replay == ("learner" if r.algo == "grpo_rr" else "off")
        assert cfg.routing.measure_every == (run.MEASURE_EVERY if r.model == "moe" else 0)
        # the algorithms share everything else
        assert (cfg.optim, cfg.batch, cfg.rollout.group_size) == (base.optim, base.batch, base.rollout.group_size)


def test_completeness_needs_every_step_under_the_same_config(tmp_path):
    r = _matrix(tmp_path, steps=3, models=["dense"], algos=["gspo"], seeds=1, routing=False)[0]
    os.makedirs(r.out_dir)
    from gspo_mcore.config import save_yaml
    from gspo_mcore.trainer import resolve

    cfg = resolve(parse_config(run.train_argv(r)))  # what the trainer saves

    save_yaml(cfg, os.path.join(r.out_dir, "config.yaml"))
    metrics = os.path.join(r.out_dir, "metrics.jsonl")
    with open(metrics, "w") as f:
        f.write('{"step": 0}\n{"step": 1}\n{"step": 2')  # cut off
    assert not run.is_complete(r, 3)
    with open(metrics, "a") as f:
        f.write('\n{"step": 2}\n')
    assert run.is_complete(r, 3)
    assert not run.is_complete(r, 4)
    other = _matrix(
        tmp_path, steps=3, models=["dense"], algos=["gspo"], seeds=1, routing=False, extra=("optim.lr=1e-3",)
    )[0]
    assert not run.is_complete(other, 3)  # same directory, different config: rerun


# ---- the report on synthetic runs ----------------------------------------------------------------------

STEPS = 40


def _write_run(
    out,
    model,
    algo,
    seed,
    rewards,
    *,
    clip,
    routing=None,
    zero_adv=0.0,
    nonfinite=0.0,
    cut=False,
    entropy=None,
    gate=None,
):
    d = out / model / algo / f"seed{seed}"
    d.mkdir(parents=True)
    with open(d / "metrics.jsonl", "w") as f:
        for step, reward in enumerate(rewards):
            row = {
                "step": step,
                "reward_mean": reward,
                "clip_fraction": clip,
                "clipped_sequence_fraction": clip * 2,
                "entropy": 1.0 if entropy is None else entropy[step],
                "zero_advantage_group_fraction": zero_adv,
                "time_step_s": 0.5,
                "nonfinite_tokens": nonfinite if step == 5 else 0.0,
            }
            if gate is not None:
                row["gate_mean"], row["gate_near_zero_fraction"] = gate[step]
            if routing is not None and step % 5 == 0:
                row["routing_changed_fraction"] = routing
                row["routing_expert_change_fraction"] = routing / 2
            f.write(json.dumps(row) + "\n")
        if cut:
            f.write('{"step": 40, "rew')
    (d / "config.yaml").write_text(f"steps: {len(rewards)}\n")
    return d


def _rising(seed):
    return [0.1 + 0.5 * s / (STEPS - 1) + 0.01 * seed for s in range(STEPS)]


@pytest.fixture()
def synthetic(tmp_path):
    out = tmp_path / "pm"
    for seed in range(3):
        _write_run(out, "dense", "gspo", seed, _rising(seed), clip=0.05)
        _write_run(out, "dense", "grpo", seed, [r - 0.1 for r in _rising(seed)], clip=0.0005)
        # MoE GRPO seed 1 collapses: rises to 0.6, then falls to 0.05
        rewards = _rising(seed) if seed != 1 else [0.6] * 20 + [0.05] * 20
        _write_run(out, "moe", "grpo", seed, rewards, clip=0.001, routing=0.1, cut=seed == 2)
        _write_run(out, "moe", "gspo", seed, _rising(seed), clip=0.1)  # no routing keys at all
    _write_run(out, "moe", "gspo_token", 0, _rising(0), clip=0.1, zero_adv=1.0)  # stalled at reward ~0.6
    _write_run(out, "moe", "gspo_token", 1, [0.95] * STEPS, clip=0.1, zero_adv=1.0)  # all equal, but solved
    _write_run(out, "moe", "grpo_rr", 0, _rising(0)[:10], clip=0.001, routing=0.05).joinpath("config.yaml").write_text(
        f"steps: {STEPS}\n"
    )  # incomplete: 10 of 40 steps
    return out


def _table_row(md, model, label):
    rows = [line for line in md.splitlines() if line.startswith(f"| {model} | {label} |")]
    assert len(rows) == 1, (model, label, rows)
    return [c.strip() for c in rows[0].strip("|").split("|")]


def test_report_tables_figures_and_collapse(synthetic):
    path = report.write_report(str(synthetic))
    md = open(path).read()
    results = md.split("## Spread, entropy and gates", 1)[0]  # the first table
    for png in ("reward_curves.png", "clip_fraction.png", "clip_fraction_bars.png", "routing_volatility.png"):
        assert (synthetic / png).stat().st_size > 5_000, png
        assert f"]({png})" in md

    # final reward = mean of the last 10% (4 steps) of each seed, then mean ± std over seeds
    finals = [sum(_rising(s)[-4:]) / 4 for s in range(3)]
    mean = sum(finals) / 3
    std = math.sqrt(sum((x - mean) ** 2 for x in finals) / 2)
    row = _table_row(results, "dense", "GSPO")
    assert row[2] == "3" and row[3] == f"{mean:.3f} ± {std:.3f}" and row[5] == "0.050"
    assert row[7] == "n/a" and row[8] == "none" and row[9] == "0.3 min"  # 40 steps x 0.5 s, no run.json
    row = _table_row(results, "dense", "GRPO")
    assert row[5] == "5.00e-04" and row[6] == "1.00e-03"
    assert "dense: GSPO clips 0.050 of tokens, GRPO 5.00e-04: ratio 100 (2.0 orders of magnitude)" in md

    row = _table_row(results, "moe", "GRPO")
    assert row[2] == "3" and row[8] == "seed1 (b)" and row[7] == "0.100 ± 0.000"
    assert _table_row(results, "moe", "GSPO-token")[8] == "seed0 (c)"
    assert _table_row(results, "moe", "GSPO")[7] == "n/a"  # the run without routing keys
    assert _table_row(results, "moe", "GRPO + Routing Replay")[2] == "0 (+1 incomplete, excluded)"
    assert "| moe/grpo_rr/seed0 | 10/40 |" in md

    collapse = md.split("## Collapse", 1)[1].split("## Every run", 1)[0]
    assert "- moe/grpo/seed1: (b) reward fell from a best window of 0.600 to 0.050" in collapse
    assert "- moe/gspo_token/seed0: (c) stalled: 100.0% of groups had all-equal rewards" in collapse
    assert collapse.count("\n- ") == 2  # nothing else flagged


def test_report_spread_entropy_and_sapo_gate(tmp_path):
    """The second table: final reward min..max over seeds, final entropy (mean and min..max), the first step
    each seed's entropy fell below ENTROPY_LOW, and SAPO's gate statistics averaged over steps and seeds."""
    out = tmp_path / "pm"
    falling = [4.0 * 0.8**s for s in range(STEPS)]  # below 0.1 first at step 17 (4 * 0.8**17 = 0.090)
    for seed in range(3):
        ent = falling if seed != 2 else [2.0] * STEPS  # seed 2 never collapses
        gate = [(0.9 + 0.1 * (s % 2), 0.01 * seed) for s in range(STEPS)]  # mean 0.95; near-zero 0, .01, .02
        _write_run(out, "dense", "sapo", seed, _rising(seed), clip=0.0, entropy=ent, gate=gate)
        _write_run(out, "dense", "gspo", seed, _rising(seed), clip=0.05)
    md = open(report.write_report(str(out))).read()
    assert (out / "entropy.png").stat().st_size > 5_000 and "](entropy.png)" in md
    table = md.split("## Spread, entropy and gates", 1)[1]
    row = _table_row(table, "dense", "SAPO")
    finals = [sum(_rising(s)[-4:]) / 4 for s in range(3)]
    assert row[2] == f"{min(finals):.3f}..{max(finals):.3f}"
    tail = sum(falling[-4:]) / 4
    assert row[3] == f"{(2 * tail + 2.0) / 3:.3f} ({tail:.2e}..2.000)"
    assert row[4] == "2/3 (step 17, 17)"
    assert row[6] == "0.950" and row[7] == "0.010"
    row = _table_row(table, "dense", "GSPO")
    assert row[3] == "1.000 (1.000..1.000)" and row[4] == "0/3" and row[6] == "n/a" and row[7] == "n/a"
    assert "| dense/sapo/seed0 | 40/40 |" in md and md.split("| dense/sapo/seed2 |", 1)[1].split("\n")[0].endswith(
        "| never |"
    )
    assert md.split("| dense/sapo/seed1 |", 1)[1].split("\n")[0].endswith("| 17 |")


def test_report_flags_nonfinite_tokens_and_handles_no_routing(tmp_path):
    out = tmp_path / "pm"
    for seed in range(2):
        _write_run(out, "dense", "grpo", seed, _rising(seed), clip=0.001, nonfinite=3.0 if seed else 0.0)
    md = open(report.write_report(str(out))).read()
    assert "- dense/grpo/seed1: (a) non-finite tokens (3 in total)" in md
    assert "- dense/grpo/seed0" not in md
    assert "routing volatility was not measured" in md and not (out / "routing_volatility.png").exists()


def test_report_cli_refuses_an_empty_directory(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "examples.paper_miniature.report", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and "no <model>/<algo>/seed<k>/metrics.jsonl" in proc.stderr


# ---- end to end ----------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_run_py_end_to_end_two_moe_runs(tmp_path):
    out = tmp_path / "pm"
    cmd = [
        sys.executable,
        "-m",
        "examples.paper_miniature.run",
        "--out",
        str(out),
        "--steps",
        "2",
        "--seeds",
        "1",
        "--models",
        "moe",
        "--algos",
        "grpo_rr",
        "gspo",
        "--jobs",
        "1",
        "rollout.prompts_per_step=8",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    expected = ["moe/gspo/seed0"] + (["moe/grpo_rr/seed0"] if run.routing_supported() else [])
    for name in expected:
        rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [0, 1]
        assert json.loads((out / name / "run.json").read_text())["ok"] is True
    md = (out / "report.md").read_text()
    assert "| moe | GSPO | 1 |" in md
    if run.routing_supported():
        assert "| moe | GRPO + Routing Replay | 1 |" in md
        assert "routing.replay=learner" in (out / "moe/grpo_rr/seed0/train.log").read_text().splitlines()[0]
        assert (out / "routing_volatility.png").exists()
    # a rerun finds the runs complete and starts none of them again
    stamps = {name: os.stat(out / name / "metrics.jsonl").st_mtime_ns for name in expected}
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{len(expected)}/{len(expected)} runs complete" in again.stdout
    assert stamps == {name: os.stat(out / name / "metrics.jsonl").st_mtime_ns for name in expected}


@pytest.mark.distributed
def test_run_py_reports_failed_runs_and_exits_nonzero(tmp_path):
    out = tmp_path / "pm"  # one rank cannot hold tensor parallelism 2: the run fails at start-up
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "examples.paper_miniature.run",
            "--out",
            str(out),
            "--steps",
            "2",
            "--seeds",
            "1",
            "--models",
            "dense",
            "--algos",
            "gspo",
            "--",
            "parallel.tensor=2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    log = out / "dense/gspo/seed0/train.log"
    assert f"FAILED dense/gspo/seed0: {log}" in proc.stderr
    assert "impossible parallel layout" in log.read_text()
    assert json.loads((out / "dense/gspo/seed0/run.json").read_text())["ok"] is False
    assert "Runs in the matrix with no metrics: dense/gspo/seed0." in (out / "report.md").read_text()
