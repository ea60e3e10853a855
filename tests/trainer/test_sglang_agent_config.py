"""``rollout.env`` with ``rollout.engine: sglang`` (docs/agents.md): accepted, with what it cannot do refused at
start-up by key (asynchronous or partial rollouts inside an episode). R3 (``routing.replay: rollout``) is accepted:
the last turn's routed experts cover the whole episode (tests/integration/test_real_routed_experts.py)."""

from __future__ import annotations

import os

import pytest
from helpers import ROOT

from gspo_mcore.train import parse_config

TINY = os.path.join(ROOT, "examples", "tiny", "config.yaml")
BASE = [
    "--config",
    TINY,
    "rollout.engine=sglang",
    "model.load_hf_weights=true",
    "rollout.env=examples.agent_tiny.env:TwoTurns",
    "rollout.sglang.urls=[http://127.0.0.1:30000]",
]


def test_episodes_on_sglang_are_accepted():
    cfg = parse_config(BASE)
    assert cfg.rollout.engine == "sglang" and cfg.rollout.env == "examples.agent_tiny.env:TwoTurns"


def test_episodes_on_sglang_with_routing_replayed_from_the_rollout_are_accepted():
    cfg = parse_config([*BASE, "routing.replay=rollout", "rollout.sglang.colocate=false"])
    assert cfg.routing.replay == "rollout" and cfg.rollout.env == "examples.agent_tiny.env:TwoTurns"


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.max_staleness=1", r"rollout.env: multi-turn episodes do not support rollout.max_staleness"),
    ],
)
def test_what_episodes_on_sglang_cannot_do_is_refused_by_key(override, message):
    with pytest.raises(ValueError, match=message):
        parse_config([*BASE, override, "rollout.sglang.colocate=false"])
