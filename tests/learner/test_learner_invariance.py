"""Aggregation invariance: one rollout batch (2 GSPO mini-batch updates) gives the same losses, gradient
norms and updated parameters for 1 rank, DP2, TP2, PP2, EP2 (MoE), TP2xPP2, ..., and any micro-batch size.

Why the quantities are invariant. For a mini-batch of ``N`` sequences the loss is
``L = -(1/N) sum_i J_i`` with ``N`` global. A micro-batch ``m`` on DP rank ``r`` computes
``L_{m,r} = -(1/N) sum_{i in m,r} J_i``; since every sample lies in exactly one micro-batch of one rank
(never split), ``sum_{m,r} L_{m,r} = L`` and, the gradient being linear, ``sum_{m,r} grad L_{m,r} = grad L``.
Megatron divides each micro-batch loss by the number of micro-batches ``M`` and averages gradients over
the ``D`` DP ranks; the learner multiplies by ``M * D`` first, so the accumulated gradient is exactly
``grad L``. Within one micro-batch, TP splits matmuls and the vocabulary (the log-sum-exp is combined
from per-rank statistics, not approximated), PP splits layers and EP places experts on other ranks: each
computes the same function. The initial weights do not depend on the layout (each global tensor drawn
from its own seed), so loss, gradient (and its global norm, hence clipping) and the Adam update agree up
to fp32 rounding (summation order). The old log-probs are recomputed by each layout with per-sequence
offsets that keep every clip decision far from its boundary (see ``learner_toy.OFFSETS``).

Reference: the 1-rank run, saved to a temp folder; the other layouts compare each rank's shards with it.
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


def case(name, model="dense", variant="gspo", **kw):
    return dict(name=name, model=model, variant=variant, **kw)


REFERENCE = [case(f"ref-{m}-{v}", m, v, save=True)
             for m, v in (("dense", "gspo"), ("dense", "gspo_token"), ("dense", "grpo"), ("moe", "gspo"),
                          ("moe", "grpo"), ("dense_tied", "gspo"))]
BD = "block_diagonal"  # the default packing on CPU is "padded" (a row per sample)
ONE_RANK = [case("1rank-mb60", max_tokens=60), case("1rank-mb30-grpo", variant="grpo", max_tokens=30),
            case("1rank-moe-mb50", "moe", max_tokens=50), case("1rank-bd-mb40", packing=BD, max_tokens=40),
            case("1rank-bd", packing=BD)]
TWO_RANKS = (
    [case(f"dp2-{v}", variant=v) for v in ("gspo", "gspo_token", "grpo")]
    + [case(f"tp2-{v}", variant=v, tp=2) for v in ("gspo", "gspo_token", "grpo")]
    + [case(f"pp2-{v}", variant=v, pp=2) for v in ("gspo", "gspo_token", "grpo")]
    + [case(f"ep2-moe-{v}", "moe", v, ep=2) for v in ("gspo", "grpo")]
    + [case("dp2-mb50", max_tokens=50), case("tp2-mb50", tp=2, max_tokens=50), case("pp2-mb30", pp=2, max_tokens=30),
       case("ep2-moe-mb50", "moe", ep=2, max_tokens=50), case("dp2-distopt", distopt=True),
       case("tp2-tied", "dense_tied", tp=2), case("pp2-tied", "dense_tied", pp=2),
       case("dp2-bd-mb30", packing=BD, max_tokens=30), case("tp2-bd", packing=BD, tp=2),
       case("pp2-bd-mb20", packing=BD, pp=2, max_tokens=20), case("ep2-moe-bd", "moe", packing=BD, ep=2)]
)
FOUR_RANKS = (
    [case(f"tp2pp2-{v}", variant=v, tp=2, pp=2) for v in ("gspo", "gspo_token", "grpo")]
    + [case("tp2pp2-mb50", tp=2, pp=2, max_tokens=50), case("pp2dp2-distopt-mb50", pp=2, distopt=True, max_tokens=50),
       case("pp2ep2-moe", "moe", pp=2, ep=2), case("tp2dp2-tied", "dense_tied", tp=2),
       case("tp2pp2-bd-mb30", packing=BD, tp=2, pp=2, max_tokens=30)]
)


def _run(cases, nproc, ref_dir, out, timeout):
    run_ranks("learner/invariance_worker.py", nproc, ["--cases", json.dumps(cases), "--ref", ref_dir, "--out", out],
              timeout=timeout)
    with open(out) as f:
        return {r["case"]: r for r in map(json.loads, f)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ref_dir = str(tmp_path_factory.mktemp("learner_ref"))
    results = _run(REFERENCE + ONE_RANK, 1, ref_dir, os.path.join(ref_dir, "one_rank.jsonl"), timeout=120)
    return ref_dir, results


@pytest.fixture(scope="module")
def two_ranks(reference):
    ref_dir, _ = reference
    return _run(TWO_RANKS, 2, ref_dir, os.path.join(ref_dir, "two_ranks.jsonl"), timeout=180)


@pytest.fixture(scope="module")
def four_ranks(reference):
    ref_dir, _ = reference
    return _run(FOUR_RANKS, 4, ref_dir, os.path.join(ref_dir, "four_ranks.jsonl"), timeout=240)


def _check(result, request):
    request.config._learner_invariance.append(result)
    assert result["init_param_diff"] == 0.0, "initial weights depend on the layout"
    assert result["keys_missing"] == [], f"parameters held by no rank: {result['keys_missing']}"
    for got, ref in zip(result["losses"], result["ref_losses"]):
        assert got == pytest.approx(ref, rel=LOSS_RTOL, abs=1e-7), ("loss", result["losses"], result["ref_losses"])
    for got, ref in zip(result["grad_norms"], result["ref_grad_norms"]):
        assert got == pytest.approx(ref, rel=LOSS_RTOL), ("grad norm", result["grad_norms"], result["ref_grad_norms"])
    assert result["param_diff"] < PARAM_ATOL, f"updated parameters differ by {result['param_diff']:.3g}"
    assert result["logp_diff"] < LOGP_ATOL, f"forward-only log-probs differ from 1 rank by {result['logp_diff']:.3g}"
    assert result["fwd_vs_train_logp"] < LOGP_ATOL
    assert max(result["clip_fraction"]) > 0, "the test batch must exercise clipping"


def test_reference_runs(reference):
    """The 1-rank runs themselves: finite losses, clipping exercised, forward-only == training forward."""
    _, results = reference
    for r in results.values():
        if r["case"].startswith("ref-"):
            assert all(map(lambda x: abs(x) < 10, r["losses"])) and all(g > 0 for g in r["grad_norms"])
            assert r["fwd_vs_train_logp"] < LOGP_ATOL


@pytest.mark.parametrize("name", [c["name"] for c in ONE_RANK])
def test_one_rank_microbatch_sizes(reference, name, request):
    result = reference[1][name]
    if "mb" in name:
        assert min(result["num_microbatches"]) > 1
    _check(result, request)


@pytest.mark.parametrize("name", [c["name"] for c in TWO_RANKS])
def test_two_ranks(two_ranks, name, request):
    _check(two_ranks[name], request)


@pytest.mark.parametrize("name", [c["name"] for c in FOUR_RANKS])
def test_four_ranks(four_ranks, name, request):
    _check(four_ranks[name], request)
