"""The paper miniature's report: ``python -m examples.paper_miniature.report runs/paper_miniature``.

Reads ``<out>/<model>/<algo>/seed<k>/metrics.jsonl`` (and, where present, the run's ``config.yaml``,
``run.json`` and ``<out>/matrix.json``) and writes ``<out>/report.md`` with PNGs beside it: reward curves
with seed bands, token clip fractions, routing volatility (MoE runs that measured it) and a collapse check.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field

import numpy as np

ALGO_ORDER = ("gspo", "gspo_token", "sapo", "cispo", "gmpo", "grpo", "grpo_rr")
MODEL_ORDER = ("dense", "moe")
LABELS = {
    "gspo": "GSPO",
    "gspo_token": "GSPO-token",
    "sapo": "SAPO",
    "cispo": "CISPO",
    "gmpo": "GMPO",
    "grpo": "GRPO",
    "grpo_rr": "GRPO + Routing Replay",
}
COLORS = {
    "gspo": "tab:blue",
    "gspo_token": "tab:cyan",
    "sapo": "tab:green",
    "cispo": "tab:purple",
    "gmpo": "tab:brown",
    "grpo": "tab:red",
    "grpo_rr": "tab:orange",
}
SMOOTH = 10  # plotted curves: trailing moving average over this many steps
COLLAPSE_DROP = 0.15  # reward collapse: final-window mean this far (absolute) below the best window
STALLED = 0.95  # stall: in the final window at least this fraction of groups has all-equal rewards ...
SOLVED = 0.9  # ... while the final-window reward is below this
ROUTING_KEYS = ("routing_changed_fraction", "routing_expert_change_fraction")
ENTROPY_LOW = 0.1  # entropy collapse: the first step whose entropy (nats/token) is below this


@dataclass
class RunData:
    """One run's metrics, one record per step in step order."""

    model: str
    algo: str
    seed: int
    path: str
    rows: list[dict]
    expected_steps: int | None = None
    wall_s: float | None = None
    config: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.model}/{self.algo}/seed{self.seed}"

    @property
    def complete(self) -> bool:
        return self.expected_steps is None or len(self.rows) >= self.expected_steps

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """``(steps, values)`` of the steps that report ``key`` with a finite value."""
        pts = [
            (r["step"], float(r[key]))
            for r in self.rows
            if isinstance(r.get(key), (int, float)) and math.isfinite(float(r[key]))
        ]
        if not pts:
            return np.zeros(0), np.zeros(0)
        steps, values = zip(*pts)
        return np.asarray(steps), np.asarray(values)


# ---- reading -------------------------------------------------------------------------------------------


def _read_jsonl(path: str) -> list[dict]:
    rows = {}
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
                rows[int(row["step"])] = row  # a resumed run may re-log a step: the last record wins
            except (ValueError, KeyError, TypeError):  # e.g. the cut-off last line of a killed run
                continue
    return [rows[s] for s in sorted(rows)]


def _order(value: str, known: tuple[str, ...]) -> tuple[int, str]:
    return (known.index(value), value) if value in known else (len(known), value)


def load_runs(out: str) -> list[RunData]:
    import yaml

    runs = []
    for path in glob.glob(os.path.join(out, "*", "*", "seed*", "metrics.jsonl")):
        run_dir = os.path.dirname(path)
        parts = os.path.relpath(run_dir, out).split(os.sep)
        match = re.fullmatch(r"seed(\d+)", parts[2])
        if not match:
            continue
        config, wall = {}, None
        if os.path.exists(os.path.join(run_dir, "config.yaml")):
            with open(os.path.join(run_dir, "config.yaml")) as f:
                config = yaml.safe_load(f) or {}
        if os.path.exists(os.path.join(run_dir, "run.json")):
            with open(os.path.join(run_dir, "run.json")) as f:
                wall = json.load(f).get("wall_s")
        rows = _read_jsonl(path)
        if wall is None and rows:
            wall = sum(float(r.get("time_step_s", 0.0)) for r in rows)  # steps only, start-up not counted
        runs.append(
            RunData(
                parts[0],
                parts[1],
                int(match.group(1)),
                run_dir,
                rows,
                expected_steps=config.get("steps"),
                wall_s=wall,
                config=config,
            )
        )
    runs.sort(key=lambda r: (_order(r.model, MODEL_ORDER), _order(r.algo, ALGO_ORDER), r.seed))
    return runs


# ---- per-run statistics --------------------------------------------------------------------------------


def window(n: int) -> int:
    """The final / best window: 10% of the run's steps (at least one)."""
    return max(1, round(n / 10))


def _sliding(values: np.ndarray, w: int) -> np.ndarray:
    c = np.cumsum(np.insert(values, 0, 0.0))
    return (c[w:] - c[:-w]) / w


def smooth(values: np.ndarray, w: int = SMOOTH) -> np.ndarray:
    """Trailing moving average; the first ``w - 1`` points average what is there so far."""
    c = np.cumsum(np.insert(values, 0, 0.0))
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(idx - w, 0)
    return (c[idx] - c[lo]) / (idx - lo)


@dataclass
class RunStats:
    final_reward: float
    best_reward: float
    token_clip: float
    seq_clip: float
    routing_changed: float | None
    final_entropy: float | None
    final_zero_adv: float | None
    collapse: list[tuple[str, str]]  # (rule letter, what happened)
    entropy_low_step: int | None = None  # first step with entropy < ENTROPY_LOW; None: never (or not logged)
    gate_mean: float = math.nan  # SAPO: mean gradient gate over steps; nan for the other variants
    gate_near_zero: float = math.nan  # SAPO: mean fraction of nearly shut gates over steps


def run_stats(run: RunData) -> RunStats:
    _, reward = run.series("reward_mean")
    w = window(len(reward))
    final = float(reward[-w:].mean()) if len(reward) else math.nan
    best = float(_sliding(reward, w).max()) if len(reward) else math.nan
    ent_steps, entropy = run.series("entropy")
    low = np.nonzero(entropy < ENTROPY_LOW)[0]
    entropy_low_step = int(ent_steps[low[0]]) if len(low) else None
    final_entropy = float(entropy[-window(len(entropy)) :].mean()) if len(entropy) else None
    _, zero = run.series("zero_advantage_group_fraction")
    final_zero = float(zero[-window(len(zero)) :].mean()) if len(zero) else None
    _, routing = run.series("routing_changed_fraction")
    nonfinite = sum(float(r.get("nonfinite_tokens", 0.0) or 0.0) for r in run.rows)
    reasons = []
    if nonfinite > 0:
        reasons.append(("a", f"non-finite tokens ({nonfinite:g} in total)"))
    if best - final > COLLAPSE_DROP:
        reasons.append(("b", f"reward fell from a best window of {best:.3f} to {final:.3f}"))
    if final_zero is not None and final_zero >= STALLED and final < SOLVED:
        entropy = f", entropy {final_entropy:.3g} nats/token" if final_entropy is not None else ""
        reasons.append(
            (
                "c",
                f"stalled: {final_zero:.1%} of groups had all-equal rewards in the final window, "
                f"at reward {final:.3f}{entropy}",
            )
        )
    return RunStats(
        final,
        best,
        _mean(run, "clip_fraction"),
        _mean(run, "clipped_sequence_fraction"),
        float(routing.mean()) if len(routing) else None,
        final_entropy,
        final_zero,
        reasons,
        entropy_low_step,
        _mean(run, "gate_mean"),
        _mean(run, "gate_near_zero_fraction"),
    )


def _mean(run: RunData, key: str) -> float:
    _, v = run.series(key)
    return float(v.mean()) if len(v) else math.nan


# ---- plots ---------------------------------------------------------------------------------------------


def _band(runs: list[RunData], key: str, smoothing: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Steps, and mean / min / max over the runs (each smoothed first) at each step any of them reports."""
    curves = {}
    for run in runs:
        steps, values = run.series(key)
        if len(values):
            curves[run.seed] = dict(zip(steps.tolist(), smooth(values, smoothing).tolist()))
    steps = np.asarray(sorted({s for c in curves.values() for s in c}))
    grid = np.full((len(curves), len(steps)), np.nan)
    for i, c in enumerate(curves.values()):
        grid[i] = [c.get(s, np.nan) for s in steps.tolist()]
    if not len(steps):
        return steps, steps, steps, steps
    return steps, np.nanmean(grid, 0), np.nanmin(grid, 0), np.nanmax(grid, 0)


def _groups(runs: list[RunData]) -> dict[tuple[str, str], list[RunData]]:
    out: dict[tuple[str, str], list[RunData]] = {}
    for run in runs:
        out.setdefault((run.model, run.algo), []).append(run)
    return out


def _panels(
    groups,
    keys: list[tuple[str, str]],
    path: str,
    *,
    ylabel: str,
    title: str,
    smoothing: int,
    log: bool = False,
    band: bool = True,
    models: list[str] | None = None,
) -> str | None:
    """One panel per model (or per key when several keys are given), one line per algorithm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = models or sorted({m for m, _ in groups}, key=lambda m: _order(m, MODEL_ORDER))
    panels = [(m, k, t) for k, t in keys for m in models]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    drawn = False
    for ax, (model, key, panel_title) in zip(axes[0], panels):
        for (m, algo), runs in sorted(groups.items(), key=lambda kv: _order(kv[0][1], ALGO_ORDER)):
            if m != model:
                continue
            steps, mean, lo, hi = _band(runs, key, smoothing)
            if not len(steps):
                continue
            drawn = True
            color = COLORS.get(algo)
            ax.plot(steps, mean, color=color, label=f"{LABELS.get(algo, algo)} (n={len(runs)})")
            if band and len(runs) > 1:
                ax.fill_between(steps, lo, hi, color=color, alpha=0.2, linewidth=0)
        ax.set_title(f"{model}: {panel_title}" if panel_title else model)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log", nonpositive="mask")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    if drawn:
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return os.path.basename(path) if drawn else None


def _clip_bars(table: list[dict], path: str) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in table if r["token_clip"] > 0]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(1.0 + 0.9 * len(rows), 4))
    ax.bar(range(len(rows)), [r["token_clip"] for r in rows], color=[COLORS.get(r["algo"]) for r in rows])
    ax.set_xticks(range(len(rows)), [f"{r['model']}\n{LABELS.get(r['algo'], r['algo'])}" for r in rows], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("token clip fraction (mean over steps and seeds)")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return os.path.basename(path)


# ---- the report ----------------------------------------------------------------------------------------


def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if 1e-12 < abs(x) < 0.01:  # (below 1e-12: rounding noise, shown as 0)
        return f"{x:.2e}"
    return f"{x:.{digits}f}"


def _pm(values: list[float]) -> str:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return "n/a"
    if len(values) == 1:
        return _fmt(values[0])
    mean, std = float(np.mean(values)), float(np.std(values, ddof=1))
    if 1e-12 < abs(mean) < 0.01:
        return f"{mean:.2e} ± {std:.1e}"
    return f"{mean:.3f} ± {std:.3f}"


def summarize(runs: list[RunData]) -> tuple[list[dict], dict[str, RunStats]]:
    """One row per (model, algorithm) over its complete runs, and every run's statistics by name."""
    per_run = {r.name: run_stats(r) for r in runs}
    table = []
    for (model, algo), group in _groups(runs).items():
        done = [r for r in group if r.complete and r.rows]
        stats = [per_run[r.name] for r in done]
        routing = [s.routing_changed for s in stats if s.routing_changed is not None]
        walls = [r.wall_s for r in done if r.wall_s is not None]
        table.append(
            {
                "model": model,
                "algo": algo,
                "n": len(done),
                "incomplete": len(group) - len(done),
                "final": [s.final_reward for s in stats],
                "best": [s.best_reward for s in stats],
                "token_clip": float(np.mean([s.token_clip for s in stats])) if stats else math.nan,
                "seq_clip": float(np.mean([s.seq_clip for s in stats])) if stats else math.nan,
                "routing": routing,
                "collapsed": [
                    f"seed{r.seed} ({','.join(c for c, _ in s.collapse)})" for r, s in zip(done, stats) if s.collapse
                ],
                "wall_s": float(np.mean(walls)) if walls else None,
                "entropy": [s.final_entropy for s in stats if s.final_entropy is not None],
                "entropy_low": [s.entropy_low_step for s in stats],
                "gate_mean": float(np.mean([s.gate_mean for s in stats])) if stats else math.nan,
                "gate_near_zero": float(np.mean([s.gate_near_zero for s in stats])) if stats else math.nan,
            }
        )
    return table, per_run


def _range(values: list[float]) -> str:
    """``min..max`` of the finite values (one value alone; ``n/a`` for none)."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return "n/a"
    return _fmt(values[0]) if len(values) == 1 else f"{_fmt(min(values))}..{_fmt(max(values))}"


def _entropy_low(steps: list[int | None]) -> str:
    """How many seeds fell below ENTROPY_LOW, and at which steps."""
    hit = sorted(s for s in steps if s is not None)
    if not steps:
        return "n/a"
    if not hit:
        return f"0/{len(steps)}"
    return f"{len(hit)}/{len(steps)} (step {', '.join(str(s) for s in hit)})"


def _family_lines(table: list[dict]) -> list[str]:
    lines = [
        "## Spread, entropy and gates",
        "",
        "Final reward and final entropy (nats/token): means over the last 10% of steps of each seed, here as "
        "min..max over seeds (entropy: mean, then min..max). Entropy below "
        f"{ENTROPY_LOW}: how many seeds' entropy fell below {ENTROPY_LOW} nats/token at some step, and the first "
        "such step of each. SAPO's gate: `gate_mean` (mean gradient gate 4 p (1 - p) over counted tokens, "
        "1 on policy) and `gate_near_zero_fraction` (gate below 0.1), averaged over steps and seeds; the other "
        "variants have no gate. The token clip fraction's meaning differs by variant (docs/gspo.md): GSPO's "
        "counts the tokens of clipped sequences, CISPO's the tokens whose importance weight was capped (their "
        "gradient is kept), GMPO's the tokens whose log-ratio was clipped, GRPO's the tokens outside its band.",
        "",
        "| model | algorithm | final reward min..max | final entropy | entropy below "
        f"{ENTROPY_LOW} | token clip fraction | SAPO gate mean | SAPO gate near zero |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in table:
        ent = f"{_fmt(float(np.mean(row['entropy'])))} ({_range(row['entropy'])})" if row["entropy"] else "n/a"
        lines.append(
            f"| {row['model']} | {LABELS.get(row['algo'], row['algo'])} | {_range(row['final'])} | {ent} | "
            f"{_entropy_low(row['entropy_low'])} | {_fmt(row['token_clip'])} | {_fmt(row['gate_mean'])} | "
            f"{_fmt(row['gate_near_zero'])} |"
        )
    return lines + [""]


def _setup_lines(runs: list[RunData], matrix: dict) -> list[str]:
    from gspo_mcore.algo.policy import DEFAULT_EPS

    cfg = next((r.config for r in runs if r.config), {})
    lines = []
    if cfg:
        ro, batch = cfg.get("rollout", {}), cfg.get("batch", {})
        lines.append(
            f"- Every run: {cfg.get('steps')} steps of {ro.get('prompts_per_step')} prompts x "
            f"{ro.get('group_size')} samples, {batch.get('num_minibatches')} optimizer steps (mini-batches) "
            f"per rollout batch, lr {cfg.get('optim', {}).get('lr')}, at most "
            f"{ro.get('sampling', {}).get('max_new_tokens')} new tokens; one CPU process per run. The "
            "algorithms differ only in the loss and (GRPO + RR) Routing Replay."
        )
        loss = cfg.get("loss", {})
        eps = {
            v: (loss.get("eps_low") or d[0], loss.get("eps_high") or d[1])
            for v, d in DEFAULT_EPS.items()
            if d[0] is not None  # SAPO has no clip range (its temperatures are below)
        }
        default = loss.get("eps_low") is None and loss.get("eps_high") is None
        lines.append(
            "- Clip ranges"
            + (
                " (each variant's paper default; CISPO's bound the importance weight, GMPO's are in log space)"
                if default
                else ""
            )
            + ": "
            + "; ".join(f"{LABELS[v]} eps_low/eps_high {lo:g}/{hi:g}" for v, (lo, hi) in eps.items())
            + f"; SAPO's gate temperatures tau_pos/tau_neg {loss.get('sapo_tau_pos', 1.0):g}/"
            + f"{loss.get('sapo_tau_neg', 1.05):g}."
        )
    lines.append(
        "- Seed k sets `seed`, `model.init_seed` and `sampler.seed`; the algorithms share seeds, so seed k "
        "starts every algorithm from the same initial weights and prompt order."
    )
    lines.append(
        "- GRPO + Routing Replay runs on the MoE model only: a dense model has no router, so replay is a "
        "no-op there (the trainer refuses it)."
    )
    lines.append(
        "- GSPO-token with one advantage per sequence (as here) equals GSPO in value and gradient, so "
        "their curves can differ only through floating-point rounding (which can compound over steps)."
    )
    if matrix and not matrix.get("routing_supported", True):
        lines.append(
            "- This trainer had no `routing` config: GRPO + Routing Replay was not run and routing "
            "volatility was not measured."
        )
    elif matrix.get("measure_every"):
        lines.append(
            f"- MoE runs measure routing volatility every {matrix['measure_every']} steps: "
            "`routing_changed_fraction` = fraction of (response token, MoE layer) pairs whose top-k expert "
            "set changed after the step's first optimizer update; `routing_expert_change_fraction` = "
            "fraction of chosen experts not chosen before."
        )
    return lines


def write_report(out: str) -> str:
    """Write ``<out>/report.md`` and its PNGs; returns the report's path."""
    runs = load_runs(out)
    matrix = {}
    if os.path.exists(os.path.join(out, "matrix.json")):
        with open(os.path.join(out, "matrix.json")) as f:
            matrix = json.load(f)
    table, per_run = summarize(runs)
    groups = _groups([r for r in runs if r.complete and r.rows])
    figs = {
        "reward": _panels(
            groups,
            [("reward_mean", "")],
            os.path.join(out, "reward_curves.png"),
            ylabel="reward (mean of the step's samples)",
            smoothing=SMOOTH,
            title=f"Reward: mean over seeds, band = min..max over seeds; {SMOOTH}-step trailing average",
        ),
        "clip": _panels(
            groups,
            [("clip_fraction", "")],
            os.path.join(out, "clip_fraction.png"),
            log=True,
            band=False,
            ylabel="token clip fraction",
            smoothing=SMOOTH,
            title=f"Token clip fraction: mean over seeds; {SMOOTH}-step trailing average; "
            "gaps: 0 (not drawn on a log scale)",
        ),
        "entropy": _panels(
            groups,
            [("entropy", "")],
            os.path.join(out, "entropy.png"),
            log=True,
            ylabel="entropy (nats/token)",
            smoothing=SMOOTH,
            title=f"Entropy: mean over seeds, band = min..max; {SMOOTH}-step average",
        ),
        "bars": _clip_bars(table, os.path.join(out, "clip_fraction_bars.png")),
    }
    moe = sorted({m for (m, _), rs in groups.items() if any(len(r.series(ROUTING_KEYS[0])[0]) for r in rs)})
    if moe:
        figs["routing"] = _panels(
            groups,
            [(ROUTING_KEYS[0], "changed (token, layer) pairs"), (ROUTING_KEYS[1], "changed experts")],
            os.path.join(out, "routing_volatility.png"),
            models=moe,
            smoothing=1,
            ylabel="fraction after the step's first update",
            title="Routing volatility on measured steps: mean over seeds, band = min..max",
        )
    md = [
        "# GSPO paper miniature",
        "",
        "GSPO, GSPO-token, SAPO, CISPO, GMPO, GRPO and GRPO + Routing Replay on the tiny digit-reversal task "
        "(examples/tiny/task.py: reward 0.2 for the right length + 0.8 x fraction of right digits), "
        "dense and MoE models, trained from random initialisation on CPU.",
        "",
        "## Setup",
        "",
    ]
    md += _setup_lines(runs, matrix)
    md += [
        "",
        "## Results",
        "",
        "Final reward: mean reward over the last 10% of steps of a run; best reward: the highest mean over any "
        "window of that length. Both, and every other column, are given as mean ± sample std over seeds (mean "
        "alone for clip fractions). Token clip fraction: the fraction of response tokens whose loss term is clipped "
        "(for GSPO, the tokens of clipped sequences), averaged over steps. Wall time: launch to exit of the run's "
        "process (or, without run.json, the sum of its step times).",
        "",
        "| model | algorithm | seeds | final reward | best reward | token clip fraction | sequence clip fraction "
        "| routing change fraction | collapsed runs | wall time per run |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in table:
        seeds = f"{row['n']}" + (f" (+{row['incomplete']} incomplete, excluded)" if row["incomplete"] else "")
        collapsed = ", ".join(row["collapsed"]) or "none"
        wall = f"{row['wall_s'] / 60:.1f} min" if row["wall_s"] is not None else "n/a"
        md.append(
            f"| {row['model']} | {LABELS.get(row['algo'], row['algo'])} | {seeds} | {_pm(row['final'])} | "
            f"{_pm(row['best'])} | {_fmt(row['token_clip'])} | {_fmt(row['seq_clip'])} | "
            f"{_pm(row['routing']) if row['routing'] else 'n/a'} | {collapsed} | {wall} |"
        )
    md += ["", *_observations(table), ""]
    if figs["reward"]:
        md += [f"![reward curves]({figs['reward']})", ""]
    md += _family_lines(table)
    if figs["entropy"]:
        md += [f"![entropy]({figs['entropy']})", ""]
    md += ["## Clipping", "", *_clip_lines(table), ""]
    md += [f"![{k}]({figs[k]})" for k in ("clip", "bars") if figs.get(k)] + [""]
    md += ["## Routing volatility", ""]
    if figs.get("routing"):
        md += [f"![routing volatility]({figs['routing']})", ""]
    else:
        md += ["No run reported `routing_changed_fraction`: routing volatility was not measured.", ""]
    md += _collapse_lines(runs, per_run)
    md += _per_run_lines(runs, per_run, matrix, out)
    path = os.path.join(out, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(md) + "\n")
    return path


def _observations(table: list[dict]) -> list[str]:
    lines = []
    for model in sorted({r["model"] for r in table}, key=lambda m: _order(m, MODEL_ORDER)):
        rows = sorted([r for r in table if r["model"] == model and r["final"]], key=lambda r: -np.mean(r["final"]))
        if len(rows) < 2:
            continue
        top = rows[0]
        parts = []
        for other in rows[1:]:
            diff = float(np.mean(top["final"]) - np.mean(other["final"]))
            if min(len(top["final"]), len(other["final"])) < 2:
                note = "one seed: no spread to compare against"
            else:
                note = f"seed ranges {'overlap' if min(top['final']) <= max(other['final']) else 'do not overlap'}"
            parts.append(f"{LABELS.get(other['algo'], other['algo'])} by {diff:.3f} ({note})")
        lines.append(
            f"- {model}: the highest mean final reward is {LABELS.get(top['algo'], top['algo'])} "
            f"({np.mean(top['final']):.3f}, n={top['n']}); it is above " + "; ".join(parts) + "."
        )
    if lines:
        lines.append("- With this few seeds, differences whose seed ranges overlap are not evidence of a difference.")
    return lines


def _clip_lines(table: list[dict]) -> list[str]:
    lines = []
    for model in sorted({r["model"] for r in table}, key=lambda m: _order(m, MODEL_ORDER)):
        by = {r["algo"]: r["token_clip"] for r in table if r["model"] == model}
        grpo = by.get("grpo")
        for algo in ("gspo", "gspo_token"):
            if algo not in by or grpo is None or math.isnan(by[algo]) or math.isnan(grpo):
                continue
            if grpo > 0:
                ratio = by[algo] / grpo
                mag = f"{math.log10(ratio):.1f} orders of magnitude" if ratio > 0 else "-"
                lines.append(
                    f"- {model}: {LABELS[algo]} clips {_fmt(by[algo])} of tokens, GRPO {_fmt(grpo)}: "
                    f"ratio {ratio:.3g} ({mag})."
                )
            else:
                lines.append(f"- {model}: {LABELS[algo]} clips {_fmt(by[algo])} of tokens; GRPO clipped none.")
    return lines or ["No GSPO / GRPO pair to compare."]


def _collapse_lines(runs: list[RunData], per_run: dict[str, RunStats]) -> list[str]:
    lines = [
        "## Collapse",
        "",
        f"A run is flagged when (a) any step reports non-finite tokens (`nonfinite_tokens` > 0), or (b) its final "
        f"reward (last 10% of steps) is more than {COLLAPSE_DROP} (absolute) below its best window, or (c) it "
        f"stalled: in the final window at least {STALLED:.0%} of groups had all-equal rewards (zero advantage, "
        f"hence no policy gradient) while the final reward is below {SOLVED} (the task is not solved). (a) and "
        "(b) are collapses; (c) is learning that stopped short, the entropy-collapse case (the final entropy is "
        "given with it). The results table lists flagged seeds with the rule's letter. Incomplete runs are "
        "checked too.",
        "",
    ]
    flagged = [(r, per_run[r.name]) for r in runs if per_run[r.name].collapse]
    if not flagged:
        lines.append(f"No run was flagged ({len(runs)} checked).")
    for run, stats in flagged:
        lines.append(f"- {run.name}: " + "; ".join(f"({c}) {text}" for c, text in stats.collapse))
    return lines + [""]


def _per_run_lines(runs: list[RunData], per_run: dict[str, RunStats], matrix: dict, out: str) -> list[str]:
    lines = [
        "## Every run",
        "",
        "Final entropy and zero-advantage groups: means over the last 10% of steps.",
        "",
        "| run | steps | final reward | best reward | token clip | final entropy | zero-advantage groups "
        f"| routing change | wall time | entropy < {ENTROPY_LOW} from step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        s = per_run[run.name]
        steps = f"{len(run.rows)}" + (f"/{run.expected_steps}" if run.expected_steps else "")
        wall = f"{run.wall_s:.0f} s" if run.wall_s is not None else "n/a"
        lines.append(
            f"| {run.name} | {steps} | {_fmt(s.final_reward)} | {_fmt(s.best_reward)} | {_fmt(s.token_clip)} "
            f"| {_fmt(s.final_entropy)} | {_fmt(s.final_zero_adv)} | {_fmt(s.routing_changed)} | {wall} "
            f"| {s.entropy_low_step if s.entropy_low_step is not None else 'never'} |"
        )
    have = {r.name for r in runs}
    missing = [m["name"] for m in matrix.get("runs", []) if m["name"] not in have]
    if missing:
        lines += ["", "Runs in the matrix with no metrics: " + ", ".join(missing) + "."]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the run directory (run.py's --out)")
    args = parser.parse_args(argv)
    if not load_runs(args.out):
        print(f"report: no <model>/<algo>/seed<k>/metrics.jsonl under {args.out}", file=sys.stderr)
        return 1
    print(f"report: {write_report(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
