"""Flush-to-zero on every CPU thread (:mod:`gspo_mcore.platform.cpu_denormals`): after the learner's set-up calls
it, a denormal operand reads as zero on torch's worker threads too, not only on the calling thread. Each case runs
in a fresh interpreter (the flags are per process and per thread)."""

from __future__ import annotations

import platform

import pytest

from gspo_mcore import ops

pytestmark = [
    pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86's MXCSR flags"),
    pytest.mark.skipif(not ops.HAVE_EXTENSION, reason="the compiled extension is not built"),
]

PROBE = r"""
import json, torch
torch.set_num_threads(2)
x = torch.full((1 << 20,), 1e-39)  # a denormal float32; 1M elements: the multiply is split over both threads
before = float(((x * 3) != 0).float().mean())  # the pool now exists, before the call
from gspo_mcore.platform import cpu_denormals
threads = cpu_denormals.flush_denormals()
after = float(((x * 3) != 0).float().mean())
print(json.dumps({"threads": threads, "before": before, "after": after}))
"""


def _probe(env_value: str | None) -> dict:
    from helpers.probe import probe

    return probe(PROBE, "GSPO_FLUSH_DENORMALS", env_value)


def test_every_thread_flushes_denormals():
    got = _probe(None)
    assert got["before"] == 1.0, got  # denormals computed as they are by default
    assert got["threads"] >= 1, got
    assert got["after"] == 0.0, got  # zero everywhere: both threads' halves


def test_the_environment_can_leave_the_flags_alone():
    got = _probe("0")
    assert got["threads"] == 0 and got["after"] == 1.0, got
