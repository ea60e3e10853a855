#!/usr/bin/env python
"""PNG curves from a run's metrics file: ``python tools/plot_metrics.py runs/tiny/metrics.jsonl [--out F.png]``.

Plots reward (mean +- std), clip fractions, sequence ratio range, entropy, response length, how responses
end, and one panel per held-out evaluation set (``eval/<name>/...``: reward, pass@k, greedy pass@1, with
pass@1 +- its standard error ``pass@1_stderr`` as a band) against the step. Keys missing from the file are
skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

# (title, curves, bands): ``bands`` maps a curve to the key of its +- band (a standard deviation or error)
PANELS = [
    ("reward", ["reward_mean"], {"reward_mean": "reward_std"}),
    ("clipping", ["clip_fraction", "clipped_sequence_fraction"], {}),
    ("ratio s_i", ["ratio_min", "ratio_mean", "ratio_max"], {}),
    ("entropy", ["entropy"], {}),
    ("response length", ["response_length_mean"], {}),
    ("grad norm", ["grad_norm"], {}),
    ("how responses end", ["finish_stop_fraction", "truncated_fraction"], {}),
    # multi-turn episodes (rollout.env): tool use and how the episodes ended
    ("tool use", ["episode_tool_use_fraction", "episode_tool_calls_mean", "episode_tool_errors_mean"], {}),
    ("how episodes end", ["episode_end_done", "episode_end_max_turns", "episode_end_max_total_tokens"], {}),
]
BAND_SUFFIX = "_stderr"
"""An evaluation key ``K_stderr`` is drawn as a band around the curve ``K``, never as a curve of its own."""


def eval_panels(rows: list[dict]) -> list[tuple[str, list[str], dict[str, str]]]:
    """One panel per evaluation set found in ``rows``: its reward and pass rates, each pass rate with its
    standard-error band when the file has one."""
    keys = sorted({k for r in rows for k in r if k.startswith("eval/")})
    names = sorted({k.split("/")[1] for k in keys})
    shown = ("/reward_mean", "/greedy_pass@1")
    panels = []
    for n in names:
        mine = [k for k in keys if k.startswith(f"eval/{n}/")]
        curves = [k for k in mine if ("/pass@" in k or k.endswith(shown)) and not k.endswith(BAND_SUFFIX)]
        bands = {k: k + BAND_SUFFIX for k in curves if k + BAND_SUFFIX in mine}
        panels.append((f"eval: {n}", curves, bands))
    return panels


def read_metrics(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise SystemExit(f"{path}:{n}: not a JSON object ({exc.msg})") from None
    if not rows:
        raise SystemExit(f"{path}: no metrics")
    return rows


def _series(rows, key):
    pts = [(r["step"], float(r[key])) for r in rows if key in r and isinstance(r[key], (int, float))]
    return [p for p in pts if math.isfinite(p[1])]


def band(rows: list[dict], key: str, spread: str) -> tuple[list, list[float], list[float]]:
    """``(steps, key - spread, key + spread)`` at the steps that have both."""
    mean, width = dict(_series(rows, key)), dict(_series(rows, spread))
    steps = sorted(set(mean) & set(width))
    return steps, [mean[s] - width[s] for s in steps], [mean[s] + width[s] for s in steps]


def plot(rows: list[dict], out: str, title: str = "") -> str:
    import matplotlib.pyplot as plt

    fig = figure(rows, title)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def figure(rows: list[dict], title: str = ""):
    """The matplotlib figure of :func:`plot` (the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in PANELS + eval_panels(rows) if any(_series(rows, k) for k in p[1])]
    cols = 3
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
    for ax, (name, keys, bands) in zip(axes.flat, panels):
        for k in keys:
            pts = _series(rows, k)
            if not pts:
                continue
            marker = "o" if k.startswith("eval/") else None
            (line,) = ax.plot(
                [p[0] for p in pts], [p[1] for p in pts], label=k.split("/")[-1], lw=1.2, marker=marker, ms=3
            )
            if k in bands:
                steps, low, high = band(rows, k, bands[k])
                ax.fill_between(steps, low, high, alpha=0.2, color=line.get_color(), lw=0)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", help="metrics.jsonl written by gspo-train")
    parser.add_argument("--out", help="PNG path (default: metrics.png beside the metrics file)")
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.metrics)), "metrics.png")
    print(plot(read_metrics(args.metrics), out, args.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
