"""The in-process engine on the learner's real Megatron model (1 rank and TP2) over its own KV cache, and at
1 rank over Megatron's ``StaticInferenceContext`` (the path taken with Transformer Engine's attention).

Prompts of different lengths share a batch (left padding) and stop tokens end rows at different steps.
Its returned log-probs must equal a learner forward pass over the generated sequences (same weights,
same temperature): both are ``log softmax(logits / T)`` of one fp32 forward, the engine's over a gathered
vocabulary, the learner's through the vocabulary-parallel kernel; the documented tolerance is 2e-5
(fp32 rounding of different reduction orders over a few thousand logits). TP peers must draw the same
tokens, a fixed seed must reproduce the samples, and the KV-cache engine must draw the same tokens as
the engine that recomputes every sequence at every step. The engine prefills each distinct prompt of a batch
once (a group's samples share it; with the own cache packed without padding) and gives its cache to its
samples through the session's select() with repeated rows: the same tokens and log-probs as one prefill row
per sample.
"""

import json

import pytest
from helpers.launch import run_ranks


def _run(nproc, layout, tau):
    out = run_ranks("trainer/inprocess_worker.py", nproc, [layout, str(tau)], timeout=300)
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.mark.distributed
@pytest.mark.parametrize("nproc, layout, tau", [(1, "1", 1.0), (2, "tp2", 0.7), (1, "1-megatron-cache", 0.7)])
def test_engine_logprobs_equal_learner_forward(nproc, layout, tau):
    rows = _run(nproc, layout, tau)
    assert len(rows) == nproc
    for r in rows:
        assert r["num_tokens"] > 0
        assert r["max_abs_diff"] < 2e-5, r
        assert r["reproducible"]
        assert r["same_as_recompute"], "KV-cache and recompute engines drew different tokens"
        # a prompt prefilled once and copied to its samples by select(), or prefilled once per sample
        assert r["same_as_unshared"], "shared and unshared prefill drew different tokens"
        assert r["unshared_max_abs_diff"] <= 2e-6, r["unshared_max_abs_diff"]  # measured 0 (own cache), 4.8e-7
        assert r["num_stop"] > 0 and r["num_length"] > 0, r  # rows finished mid-batch and rows ran to the cap
    assert all(r["ids"] == rows[0]["ids"] for r in rows), "TP peers drew different tokens"
    # 4 prompts x 3 samples in batches of 8 rows: prompts 0, 1, 2 (4 + 2 + 6 tokens), then 2, 3 (6 + 1), twice.
    # The engine prefills each distinct prompt once: the own cache packed without padding, Megatron's cache as a
    # padded batch of the distinct prompts
    per_call = [[3, 6], [2, 6]] if layout == "1-megatron-cache" else [[1, 12], [1, 7]]
    for r in rows:
        assert r["prefills"] == per_call * 2, r["prefills"]
