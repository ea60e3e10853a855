"""3-turn episodes on the in-process engine over the learner's real Megatron model, 1 rank and TP2
(tests/trainer/episode_worker.py): the environment spans are prefilled onto the KV cache (never recomputing
the prefix) while other episodes decode, and the engine's log-prob of every policy token equals the learner's
forward over the whole episode within the tolerance of tests/trainer/test_inprocess_learner.py (2e-5: fp32
rounding of different reduction orders); the KV engine draws what the recompute engine draws; TP peers agree.
"""

import json

import pytest
from helpers.launch import run_ranks


@pytest.mark.distributed
@pytest.mark.parametrize("nproc, layout, tau", [(1, "1", 1.0), (2, "tp2", 0.7)])
def test_episode_logprobs_equal_learner_forward(nproc, layout, tau):
    out = run_ranks("trainer/episode_worker.py", nproc, [layout, str(tau)], timeout=300)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(rows) == nproc
    for r in rows:
        assert r["max_abs_diff"] < 2e-5, r
        assert r["same_as_recompute"], "the KV-cache engine drew other tokens than the recompute engine"
        assert r["same_as_unshared"], "a group's episodes drew other tokens or log-probs from a shared prefill"
        assert r["env_tokens"] > 0 and r["policy_tokens"] > 0
        assert set(r["turns"]) == {3} and set(r["ends"]) == {"max_turns"}, r
        # turns of different lengths: episodes were at different turns in the same passes
        assert len({len(ids) for ids in r["ids"]}) > 3
    assert all(r["ids"] == rows[0]["ids"] for r in rows), "TP peers drew different tokens"
