"""The learner's GSPO gradient equals autograd through an independent single-process torch model.

The learner runs Megatron's GPTModel with samples packed into micro-batches (block-diagonal masks),
vocabulary-parallel log-probs from ``gspo_mcore.ops`` and the loss from ``gspo_mcore.algo``, then
Megatron DDP's gradient buffers. ``grad_worker.py`` re-implements the same Qwen3 forward and the GSPO
formula in plain torch, one sample at a time, and differentiates it with autograd. Untied and tied
embeddings; the batch is split into several micro-batches and some sequences are clipped. The batch has 13
samples, two of them prompt-only (no counted token: not in ``N`` on either side).
"""

from __future__ import annotations

import json

import pytest
from helpers.launch import run_ranks

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("grad") / "grad.jsonl"
    run_ranks("learner/grad_worker.py", 1, ["--out", str(out)], timeout=300)
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_gspo_gradient_matches_independent_torch_model(rows):
    assert [r["model"] for r in rows] == ["dense", "dense_tied"]
    for r in rows:
        assert r["num_microbatches"] > 1 and 0 < r["clip_fraction"] < 1
        assert r["num_sequences"] == 11  # 13 samples, 2 prompt-only
        assert r["learner_loss"] == pytest.approx(r["torch_loss"], rel=1e-5, abs=1e-8)
        # fp32, different summation orders: the error is at rounding level of the largest entry
        assert r["max_grad_diff"] <= 1e-5 * r["max_grad"], r


def test_recomputed_old_logprobs_replace_the_rollout_ones(rows):
    """train_step(recompute_old_logprobs=True) reports |recomputed - rollout| and trains on the recomputed
    log-probs: the rollout ones were shifted by 0.05, the first update's sequence ratios are still 1."""
    r = rows[0]
    assert r["rollout_logprob_abs_diff"] == pytest.approx(0.05, abs=1e-5)
    assert abs(r["first_ratio_max"] - 1) < 1e-5 and abs(r["first_ratio_min"] - 1) < 1e-5
