"""tools/plot_metrics.py: an evaluation's ``pass@1_stderr`` is drawn as a band around pass@1, not as a curve."""

from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROWS = [
    {"step": 0, "reward_mean": 0.1, "reward_std": 0.05},
    {"step": 0, "eval/heldout/pass@1": 0.20, "eval/heldout/pass@1_stderr": 0.04, "eval/heldout/pass@4": 0.5},
    {"step": 1, "reward_mean": 0.3, "reward_std": 0.1},
    {"step": 2, "eval/heldout/pass@1": 0.60, "eval/heldout/pass@1_stderr": 0.05, "eval/heldout/pass@4": 0.9},
]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("plot_metrics", os.path.join(ROOT, "tools", "plot_metrics.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stderr_is_a_band_of_pass_at_1_not_a_curve(tool):
    ((title, curves, bands),) = tool.eval_panels(ROWS)
    assert title == "eval: heldout"
    assert curves == ["eval/heldout/pass@1", "eval/heldout/pass@4"]
    assert bands == {"eval/heldout/pass@1": "eval/heldout/pass@1_stderr"}


def test_drawn_band_spans_pass_at_1_plus_minus_stderr(tool):
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection

    fig = tool.figure(ROWS)
    try:
        ax = next(a for a in fig.axes if a.get_title() == "eval: heldout")
        assert sorted(line.get_label() for line in ax.get_lines()) == ["pass@1", "pass@4"]
        (poly,) = [c for c in ax.collections if isinstance(c, PolyCollection)]
        ys = poly.get_paths()[0].vertices[:, 1]
        assert min(ys) == pytest.approx(0.20 - 0.04) and max(ys) == pytest.approx(0.60 + 0.05)
    finally:
        plt.close(fig)
