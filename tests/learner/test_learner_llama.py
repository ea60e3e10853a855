"""Aggregation invariance for the Llama and Qwen2 families: one rollout batch (2 GSPO mini-batch updates)
gives the same losses, gradient norms, updated parameters and forward-only log-probs on 1 rank, DP2, TP2
and PP2 (see test_learner_invariance.py for why these are invariant up to fp32 rounding).

Models (``learner_toy``): a Llama with 6 query heads on 2 KV heads (TP2 holds 3 query heads and 1 KV head
per rank; no QK-norm), and a tied-embedding Qwen2 (q/k/v biases: the bias shards must move with their
rows).
"""

from __future__ import annotations

import json
import os

import pytest
from helpers.launch import run_ranks

pytestmark = pytest.mark.distributed

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5  # lr = 1e-3: 1% of one Adam step
LOGP_ATOL = 1e-5

REFERENCE = [dict(name=f"ref-{m}", model=m, variant="gspo", save=True) for m in ("llama", "qwen2_tied")]
TWO_RANKS = [
    dict(name="llama-dp2", model="llama", variant="gspo"),
    dict(name="llama-tp2", model="llama", variant="gspo", tp=2),
    dict(name="llama-pp2", model="llama", variant="gspo", pp=2, max_tokens=60),
    dict(name="qwen2_tied-tp2", model="qwen2_tied", variant="gspo", tp=2),
    dict(name="qwen2_tied-pp2", model="qwen2_tied", variant="gspo", pp=2),
]


def _run(cases, nproc, ref_dir, name, timeout):
    out = os.path.join(ref_dir, name)
    run_ranks(
        "learner/invariance_worker.py",
        nproc,
        ["--cases", json.dumps(cases), "--ref", ref_dir, "--out", out],
        timeout=timeout,
    )
    with open(out) as f:
        return {r["case"]: r for r in map(json.loads, f)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ref_dir = str(tmp_path_factory.mktemp("llama_ref"))
    one = _run(REFERENCE, 1, ref_dir, "one_rank.jsonl", timeout=400)
    return one, _run(TWO_RANKS, 2, ref_dir, "two_ranks.jsonl", timeout=500)


@pytest.mark.parametrize("name", [c["name"] for c in REFERENCE])
def test_reference_runs(results, name):
    r = results[0][name]
    assert all(abs(x) < 10 for x in r["losses"]) and all(g > 0 for g in r["grad_norms"])
    assert r["fwd_vs_train_logp"] < LOGP_ATOL
    assert max(r["clip_fraction"]) > 0, "the test batch must exercise clipping"


@pytest.mark.parametrize("name", [c["name"] for c in TWO_RANKS])
def test_update_is_layout_invariant(results, name, request):
    r = results[1][name]
    request.config._learner_invariance.append(r)
    assert r["init_param_diff"] == 0.0, "initial weights depend on the layout"
    assert r["keys_missing"] == [], f"parameters held by no rank: {r['keys_missing']}"
    for got, ref in zip(r["losses"], r["ref_losses"]):
        assert got == pytest.approx(ref, rel=LOSS_RTOL, abs=1e-7), ("loss", r["losses"], r["ref_losses"])
    for got, ref in zip(r["grad_norms"], r["ref_grad_norms"]):
        assert got == pytest.approx(ref, rel=LOSS_RTOL), ("grad norm", r["grad_norms"], r["ref_grad_norms"])
    assert r["param_diff"] < PARAM_ATOL, f"updated parameters differ by {r['param_diff']:.3g}"
    assert r["logp_diff"] < LOGP_ATOL, f"forward-only log-probs differ from 1 rank by {r['logp_diff']:.3g}"
    assert r["fwd_vs_train_logp"] < LOGP_ATOL
