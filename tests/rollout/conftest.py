"""Fixtures for the rollout tests: stand-in SGLang servers (see sglang_standin.py; NOT SGLang)."""

from __future__ import annotations

import pytest
from sglang_standin import StandIn


@pytest.fixture
def standins():
    """``make(**kwargs) -> StandIn`` (started); every stand-in is stopped after the test."""
    made: list[StandIn] = []

    def make(**kwargs) -> StandIn:
        s = StandIn(**kwargs)
        s.start()
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


@pytest.fixture
def file_system_sharing():
    """torch's file_system sharing strategy for the test (CPU tensors sent to SGLang need it), restored after."""
    import torch.multiprocessing as tmp

    old = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    yield
    tmp.set_sharing_strategy(old)
