"""Shared by the checkpoint tests: the tiny job's inputs and its uninterrupted reference run.

The reference makes 6 steps on 2 gloo ranks with the distributed optimizer (the harder case: its state is
sharded over the ranks) and saves after every step, keeping 3; resumed runs must reproduce its per-step
metrics exactly. (The non-distributed optimizer's exact continuation is checked by the resharding tests.)
"""

from __future__ import annotations

import pytest
from helpers.checkpoint_launch import DISTOPT, STEPS, metrics, run_tiny


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    from examples.tiny.task import prepare

    d = tmp_path_factory.mktemp("tiny_data")
    prepare(str(d), num_prompts=512)
    return str(d)


def _reference(tmp_path_factory, tiny_data, name, *overrides):
    out = str(tmp_path_factory.mktemp(name))
    log = run_tiny(tiny_data, out, f"steps={STEPS}", "checkpoint.save_every=1", "checkpoint.keep_last=3", *overrides)
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(STEPS)), log[-4000:]
    return {"out": out, "metrics": rows, "log": log}


@pytest.fixture(scope="session")
def reference(tmp_path_factory, tiny_data):
    """The tiny job with the distributed optimizer, uninterrupted."""
    return _reference(tmp_path_factory, tiny_data, "reference", DISTOPT)
