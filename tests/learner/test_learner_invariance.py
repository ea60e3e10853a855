"""Aggregation invariance: one rollout batch (2 GSPO mini-batch updates) gives the same gradients, losses,
gradient norms and updated parameters for 1 rank, DP2, TP2, PP2, EP2 (MoE), TP2xPP2, ..., and any micro-batch
size.

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

The batch (``invariance_worker.BATCH``) is awkward on purpose: 13 samples (mini-batches of 7 and 6, the 7
split 3 : 4 over 2 DP ranks), a prompt-only sample in each (no counted token: not part of ``N``); with a
15-token budget the 3-sample DP rank runs an empty micro-batch, with a 30-token one a micro-batch holds only
a prompt-only sample.

The gradient of the first mini-batch is compared per parameter, before any optimizer step, as global
tensors (each rank's shards against the matching slices of the 1-rank gradient). The parameters after the
two Adam steps are a weak check of the normaliser: Adam's first steps are about ``lr * sign(g)`` and the
clipping rescales the gradient, so a wrong ``N`` that scales every gradient alike (2N on both DP ranks: every
gradient halved) moved them by only 4.3e-5 (4% of lr), while the gradient check sees a 50% error
(``test_a_wrong_normaliser_fails_the_gradient_check``).

Reference: the 1-rank run, saved to a temp folder; the other layouts compare each rank's shards with it.
The reference itself is checked against the sum of its per-sample gradients (each sample alone, with ``N``
counted by the test from the masks); ``test_learner_gradient.py`` checks the same kind of batch against an
independent torch model.
"""

from __future__ import annotations

import json
import math
import os

import pytest
from helpers.launch import run_ranks

pytestmark = pytest.mark.distributed

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5  # lr = 1e-3: 1% of one Adam step
LOGP_ATOL = 1e-5
GRAD_RTOL = 1e-5
"""Per parameter: max |grad - grad_ref| <= GRAD_RTOL * max |grad_ref| of that parameter + GRAD_ATOL * the
largest gradient entry of the model (fp32 summation-order noise; see the measured figures in the summary)."""
GRAD_ATOL = 1e-6
NUM_SEQUENCES = [6, 5]
"""Counted samples per mini-batch of ``invariance_worker.BATCH`` (7 and 6 samples, one prompt-only in each)."""


def case(name, model="dense", variant="gspo", **kw):
    return dict(name=name, model=model, variant=variant, **kw)


# The loss options (docs/loss.md), each with its own 1-rank reference (``tag``): the off-policy weights
# (TIS truncating one sequence in five, MIS masking two: learner_toy.BEHAVIOUR_SHIFTS), per-token advantages
# for GSPO-token, and the KL penalty (k1: a gradient even at the reference) with the entropy bonus, the
# reference log-probs from the ReferencePolicy's weight swap.
LOSS_OPTIONS = {
    "tis": ("gspo", dict(loss={"off_policy": {"mode": "tis", "cap": 2.0}})),
    "mis": ("grpo", dict(loss={"off_policy": {"mode": "mis", "cap": 2.0}})),
    "tokadv": ("gspo_token", dict(token_adv=True)),
    "kl": ("gspo", dict(loss={"kl_coef": 0.1, "kl_estimator": "k1", "entropy_coef": 0.01})),
}


def option_case(prefix, tag, **kw):
    variant, options = LOSS_OPTIONS[tag]
    return case(f"{prefix}-{variant}-{tag}", variant=variant, tag=tag, **options, **kw)


# Multi-turn episodes (issue 26): the same batch with environment spans inside the responses (loss mask 0
# between policy spans, learner_toy.env_holes). GSPO, and the family variants SAPO, CISPO and GMPO, run only on
# this batch (which keeps every awkward property of the plain one), each with its own 1-rank reference.
MULTI_TURN = ("gspo", "sapo", "cispo", "gmpo")


def mt_case(prefix, variant, **kw):
    return case(f"{prefix}-{variant}-mt", variant=variant, tag="mt", env_spans=True, **kw)


# Shared-prompt training (batch.share_prompt, gspo_mcore/learner/shared_prefix.py): the same batch with every
# group's samples on their group's prompt (learner_toy.toy_samples(shared_prompts=True); groups of 4 over the
# mini-batches 0-6 and 7-12: one group is cut by the mini-batch boundary, the prompt-only samples share with
# nobody), each loss variant single- and multi-turn, with a 1-rank reference run unshared on that batch.
LOSS_VARIANTS = ("gspo", "gspo_token", "grpo", "sapo", "cispo", "gmpo")  # gspo_mcore.algo.variants (checked below)


def shared_case(name, variant="gspo", tag="grp", **kw):
    return case(name, variant=variant, tag=tag, groups=True, **kw)


SHARED_REFERENCE = (
    [shared_case(f"ref-dense-{v}-grp", v, save=True) for v in LOSS_VARIANTS]
    + [shared_case(f"ref-dense-{v}-grp-mt", v, tag="grp-mt", env_spans=True, save=True) for v in LOSS_VARIANTS]
    + [shared_case("ref-moe-gspo-grp", model="moe", save=True)]
    # Routing Replay (R2): the experts recorded in the (shared) old-log-prob forward, replayed in training
    + [shared_case("ref-moe-gspo-grp-r2", model="moe", tag="grp-r2", replay="learner", save=True)]
    + [
        shared_case(
            f"ref-dense-{LOSS_OPTIONS[t][0]}-{t}-grp",
            LOSS_OPTIONS[t][0],
            tag=f"{t}-grp",
            save=True,
            **LOSS_OPTIONS[t][1],
        )
        for t in LOSS_OPTIONS
    ]
)
SHARED_ONE_RANK = (
    [shared_case(f"1rank-share-{v}", v, share=True) for v in LOSS_VARIANTS]
    + [shared_case(f"1rank-share-{v}-mt", v, tag="grp-mt", env_spans=True, share=True) for v in LOSS_VARIANTS]
    + [
        shared_case("1rank-share-moe", model="moe", share=True),
        shared_case("1rank-share-moe-r2", model="moe", tag="grp-r2", replay="learner", share=True),
        shared_case("1rank-share-mb30", max_tokens=30, share=True),  # units cut to the budget, several micro-batches
        shared_case("1rank-share-bd", packing="block_diagonal", share=True),
    ]
    + [
        shared_case(
            f"1rank-share-{LOSS_OPTIONS[t][0]}-{t}",
            LOSS_OPTIONS[t][0],
            tag=f"{t}-grp",
            share=True,
            **LOSS_OPTIONS[t][1],
        )
        for t in LOSS_OPTIONS
    ]
)
SHARED_TWO_RANKS = [
    shared_case("dp2-share", share=True),
    shared_case("dp2-share-mt", tag="grp-mt", env_spans=True, share=True),
    shared_case("dp2-share-bd-mb30", packing="block_diagonal", max_tokens=30, share=True),
    shared_case("tp2-share", tp=2, share=True),
    shared_case("tp2-share-grpo-mt", "grpo", tag="grp-mt", env_spans=True, tp=2, share=True),
    shared_case("pp2-share-mb30", pp=2, max_tokens=30, share=True),
    shared_case("pp2-share-sapo-mt", "sapo", tag="grp-mt", env_spans=True, pp=2, share=True),
    shared_case("ep2-share-moe", model="moe", ep=2, share=True),
    shared_case("ep2-share-moe-r2", model="moe", tag="grp-r2", replay="learner", ep=2, share=True),
]

REFERENCE = (
    [
        case(f"ref-{m}-{v}", m, v, save=True)
        for m, v in (
            ("dense", "gspo"),
            ("dense", "gspo_token"),
            ("dense", "grpo"),
            ("moe", "gspo"),
            ("moe", "grpo"),
            ("dense_tied", "gspo"),
        )
    ]
    + [option_case("ref-dense", tag, save=True) for tag in LOSS_OPTIONS]
    + [mt_case("ref-dense", v, save=True) for v in MULTI_TURN]
    + SHARED_REFERENCE
)
BD = "block_diagonal"  # the default packing on CPU is "padded" (a row per sample)
ONE_RANK = [
    case("1rank-mb60", max_tokens=60),
    case("1rank-mb30-grpo", variant="grpo", max_tokens=30),
    case("1rank-moe-mb50", "moe", max_tokens=50),
    case("1rank-bd-mb40", packing=BD, max_tokens=40),
    case("1rank-bd", packing=BD),
]
# loss.fused_lm_head (log-probs from hidden states and the output weight, vocabulary chunks of 48 of 128):
# compared with the logits path's references, so the fused head must give today's loss and gradients.
FUSED_ONE_RANK = [
    case("1rank-fused", fused=True),
    case("1rank-fused-mb30-grpo", variant="grpo", max_tokens=30, fused=True, chunk=100),
    case("1rank-fused-tied", "dense_tied", fused=True),
]
FUSED_TWO_RANKS = [
    case("tp2-fused", tp=2, fused=True),
    case("pp2-fused-gspo_token", variant="gspo_token", pp=2, fused=True),
    case("tp2-fused-tied", "dense_tied", tp=2, fused=True),
    case("pp2-fused-tied-bd", "dense_tied", pp=2, packing=BD, fused=True),
]
ONE_RANK += FUSED_ONE_RANK + SHARED_ONE_RANK
TWO_RANKS = (
    [case(f"dp2-{v}", variant=v) for v in ("gspo", "gspo_token", "grpo")]
    + [case(f"tp2-{v}", variant=v, tp=2) for v in ("gspo", "gspo_token", "grpo")]
    + [case(f"pp2-{v}", variant=v, pp=2) for v in ("gspo", "gspo_token", "grpo")]
    + [case(f"ep2-moe-{v}", "moe", v, ep=2) for v in ("gspo", "grpo")]
    + [
        case("dp2-mb15", max_tokens=15),
        case("tp2-mb50", tp=2, max_tokens=50),
        case("pp2-mb30", pp=2, max_tokens=30),
        case("ep2-moe-mb50", "moe", ep=2, max_tokens=50),
        case("dp2-distopt", distopt=True),
        case("tp2-tied", "dense_tied", tp=2),
        case("pp2-tied", "dense_tied", pp=2),
        case("dp2-bd-mb30", packing=BD, max_tokens=30),
        case("tp2-bd", packing=BD, tp=2),
        case("pp2-bd-mb20", packing=BD, pp=2, max_tokens=20),
        case("ep2-moe-bd", "moe", packing=BD, ep=2),
    ]
    + [option_case("dp2", tag) for tag in LOSS_OPTIONS]
    + [option_case("tp2", tag, tp=2) for tag in LOSS_OPTIONS]
    + [option_case("pp2-mb30", "kl", pp=2, max_tokens=30), option_case("dp2-distopt", "kl", distopt=True)]
    + FUSED_TWO_RANKS
    + [mt_case("dp2", v) for v in MULTI_TURN]
    + [mt_case("tp2", v, tp=2) for v in MULTI_TURN]
    + [mt_case("pp2-mb30", v, pp=2, max_tokens=30) for v in MULTI_TURN]
    + SHARED_TWO_RANKS
)
# Test-only faults, each must be caught: N + 1 on DP rank 0 only; 2N on both ranks (every gradient halved)
WRONG_N = [
    case("dp2-wrong-n", wrong_n={"dp_rank": 0, "extra": 1}),
    case("dp2-wrong-n-all", wrong_n={"dp_rank": None, "extra": NUM_SEQUENCES[0]}),
]
FOUR_RANKS = [case(f"tp2pp2-{v}", variant=v, tp=2, pp=2) for v in ("gspo", "gspo_token", "grpo")] + [
    case("tp2pp2-mb50", tp=2, pp=2, max_tokens=50),
    case("pp2dp2-distopt-mb50", pp=2, distopt=True, max_tokens=50),
    case("pp2ep2-moe", "moe", pp=2, ep=2),
    case("tp2dp2-tied", "dense_tied", tp=2),
    case("tp2pp2-bd-mb30", packing=BD, tp=2, pp=2, max_tokens=30),
]


# Context parallelism: every sample split over the CP ranks in the load-balanced layout (2 CP chunks per
# row, padded to a multiple of 2 CP); per-sequence sums completed by one all-reduce. With a 15-token budget
# every sample is alone in its row, so on CP4 rows of 5-7 tokens are shorter than 2 CP = 8 (some CP ranks hold
# one real position and padding) and odd lengths are padded; the prompt-only samples are split like the rest.
CP_TWO_RANKS = (
    [case(f"cp2-{v}", variant=v, cp=2) for v in ("gspo", "gspo_token", "grpo")]
    + [
        case("cp2-mb15", cp=2, max_tokens=15),
        case("cp2-moe", "moe", cp=2),
    ]
    + [option_case("cp2", tag, cp=2) for tag in LOSS_OPTIONS]
    + [mt_case("cp2", v, cp=2) for v in MULTI_TURN]
)  # their per-token inputs split like the rest
CP_FOUR_RANKS = [
    case("cp2dp2-gspo", cp=2),
    case("cp2tp2-grpo", variant="grpo", cp=2, tp=2),
    case("cp2pp2-gspo_token", variant="gspo_token", cp=2, pp=2, max_tokens=50),
    case("cp4-mb15", cp=4, max_tokens=15),
    case("cp2ep2-moe", "moe", cp=2, ep=2),
]
# Test-only fault: the CP all-reduce of the per-sequence sums is skipped (each rank's loss sees only its own
# tokens' partial sums) - must fail the comparison
CP_BROKEN = [case("cp2-no-cp-reduce", cp=2, break_cp_reduce=True)]


def _run(cases, nproc, ref_dir, out, timeout):
    run_ranks(
        "learner/invariance_worker.py",
        nproc,
        ["--cases", json.dumps(cases), "--ref", ref_dir, "--out", out],
        timeout=timeout,
    )
    with open(out) as f:
        return {r["case"]: r for r in map(json.loads, f)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ref_dir = str(tmp_path_factory.mktemp("learner_ref"))
    results = _run(REFERENCE + ONE_RANK, 1, ref_dir, os.path.join(ref_dir, "one_rank.jsonl"), timeout=300)
    return ref_dir, results


@pytest.fixture(scope="module")
def two_ranks(reference):
    ref_dir, _ = reference
    return _run(TWO_RANKS + WRONG_N, 2, ref_dir, os.path.join(ref_dir, "two_ranks.jsonl"), timeout=400)


@pytest.fixture(scope="module")
def four_ranks(reference):
    ref_dir, _ = reference
    return _run(FOUR_RANKS, 4, ref_dir, os.path.join(ref_dir, "four_ranks.jsonl"), timeout=500)


@pytest.fixture(scope="module")
def cp_two_ranks(reference):
    ref_dir, _ = reference
    return _run(CP_TWO_RANKS + CP_BROKEN, 2, ref_dir, os.path.join(ref_dir, "cp_two_ranks.jsonl"), timeout=400)


@pytest.fixture(scope="module")
def cp_four_ranks(reference):
    ref_dir, _ = reference
    return _run(CP_FOUR_RANKS, 4, ref_dir, os.path.join(ref_dir, "cp_four_ranks.jsonl"), timeout=900)


def _grad_bounds(result) -> dict[str, float]:
    scale = max(result["grad_ref_scale"].values())
    return {k: GRAD_RTOL * s + GRAD_ATOL * scale for k, s in result["grad_ref_scale"].items()}


def _grad_problems(result) -> list[str]:
    """The parameters whose gradient differs from the reference's by more than the bound."""
    bounds = _grad_bounds(result)
    return [
        f"{k}: |dgrad| {d:.3g} > {bounds[k]:.3g} (max |grad| {result['grad_ref_scale'][k]:.3g})"
        for k, d in result["grad_diff"].items()
        if not d <= bounds[k]
    ]


def _check_grads(result):
    problems = _grad_problems(result)
    assert not problems, "gradient differs from 1 rank:\n" + "\n".join(problems)


def _record(result, request):
    """Add the gradient figures and show the result in the terminal summary."""
    if "grad_diff" in result:
        bounds = _grad_bounds(result)
        result["grad_rel"] = max(result["grad_diff"].values()) / max(result["grad_ref_scale"].values())
        result["grad_bound_ratio"] = max(d / bounds[k] for k, d in result["grad_diff"].items())
    request.config._learner_invariance.append(result)


def _check(result, request):
    _record(result, request)
    assert result["init_param_diff"] == 0.0, "initial weights depend on the layout"
    assert result["keys_missing"] == [], f"parameters held by no rank: {result['keys_missing']}"
    assert result["num_sequences"] == result["expected_num_sequences"] == NUM_SEQUENCES
    if "grad_diff" in result:
        _check_grads(result)
    else:  # the distributed optimizer reduce-scatters: each rank holds only its part of the gradient
        assert "distopt" in result["case"], "no gradient comparison"
    for got, ref in zip(result["losses"], result["ref_losses"]):
        assert got == pytest.approx(ref, rel=LOSS_RTOL, abs=1e-7), ("loss", result["losses"], result["ref_losses"])
    for got, ref in zip(result["grad_norms"], result["ref_grad_norms"]):
        assert got == pytest.approx(ref, rel=LOSS_RTOL), ("grad norm", result["grad_norms"], result["ref_grad_norms"])
    assert result["param_diff"] < PARAM_ATOL, f"updated parameters differ by {result['param_diff']:.3g}"
    assert result["logp_diff"] < LOGP_ATOL, f"forward-only log-probs differ from 1 rank by {result['logp_diff']:.3g}"
    assert result["fwd_vs_train_logp"] < LOGP_ATOL
    _assert_exercised(result)


def _assert_exercised(result):
    """The test batch exercises the variant's clip (for SAPO: its gate, which has none)."""
    if result["variant"] == "sapo":
        gates = [m["gate_near_zero_fraction"] for m in result["extra_metrics"]]
        assert max(gates) > 0 and min(m["gate_mean"] for m in result["extra_metrics"]) < 0.99, gates
    else:
        assert max(result["clip_fraction"]) > 0, "the test batch must exercise clipping"


def test_reference_runs(reference):
    """The 1-rank runs themselves: finite losses, ``N`` = the counted samples, the batched gradient equal to the
    sum of per-sample gradients, clipping exercised, forward-only == training forward."""
    _, results = reference
    refs = [r for r in results.values() if r["case"].startswith("ref-")]
    assert len(refs) == len(REFERENCE)
    for r in refs:
        # (the second mini-batch may be clipped entirely: GSPO's clip range is 3e-4 / 4e-4 after a 1e-3 step)
        assert all(math.isfinite(x) for x in r["losses"] + r["grad_norms"]) and r["grad_norms"][0] > 0, r
        assert r["num_sequences"] == r["expected_num_sequences"] == NUM_SEQUENCES, r["case"]
        assert r["per_sample_grad_diff"] <= (GRAD_RTOL + GRAD_ATOL) * r["grad_scale"], r["case"]
        assert r["fwd_vs_train_logp"] < LOGP_ATOL
        _assert_exercised(r)


def test_the_loss_options_do_what_they_say(reference):
    """The option references: the KL reference swap leaves the weights as they were; the off-policy batch
    reaches beyond the cap (TIS truncates, MIS masks); per-token advantages make GSPO-token's gradient differ
    from GSPO-token with one advantage per sequence (i.e. from GSPO); the multi-turn batch's environment spans
    change GSPO's gradient."""
    ref_dir, results = reference
    kl = results["ref-dense-gspo-kl"]
    assert kl["swap_restored"] is True
    assert kl["extra_metrics"][1]["kl"] != 0.0  # after the first update the policy has left the reference
    for tag in ("tis", "mis"):
        r = next(r for r in results.values() if r["case"].endswith(f"-{tag}"))
        assert max(m["is_weight_max"] for m in r["extra_metrics"]) > 2.0
    assert max(m["is_masked_fraction"] for m in results["ref-dense-grpo-mis"]["extra_metrics"]) > 0
    import torch

    tok = torch.load(os.path.join(ref_dir, "dense-gspo_token-tokadv.pt"))["grads"]
    plain = torch.load(os.path.join(ref_dir, "dense-gspo_token.pt"))["grads"]
    worst = max(float((tok[k] - plain[k]).abs().max() / plain[k].abs().max().clamp(min=1e-12)) for k in plain)
    assert worst > 0.05, f"per-token advantages changed the GSPO-token gradient by only {worst:.3g} (relative)"
    for tag in LOSS_OPTIONS:
        plain_name = "dense-" + LOSS_OPTIONS[tag][0]
        opt = torch.load(os.path.join(ref_dir, f"{plain_name}-{tag}.pt"))["grads"]
        base = torch.load(os.path.join(ref_dir, f"{plain_name}.pt"))["grads"]
        assert any(not torch.allclose(opt[k], base[k], rtol=1e-4, atol=0) for k in base), f"{tag} changed nothing"
    # the environment spans matter: the multi-turn GSPO gradient is not the single-turn one (measured: 44% apart)
    mt = torch.load(os.path.join(ref_dir, "dense-gspo-mt.pt"))["grads"]
    plain = torch.load(os.path.join(ref_dir, "dense-gspo.pt"))["grads"]
    assert max(float((mt[k] - plain[k]).abs().max() / plain[k].abs().max().clamp(min=1e-12)) for k in plain) > 0.05


def test_the_batch_covers_uneven_shares_empty_and_prompt_only_microbatches(two_ranks):
    """What the batch is for: on DP2 the first mini-batch splits 3 : 4, a small budget gives the 3-sample rank
    an empty micro-batch, and some micro-batch holds only a prompt-only sample."""
    assert two_ranks["dp2-gspo"]["dp_shares"][0] == [3, 4]
    assert two_ranks["dp2-mb15"]["empty_microbatches"] > 0
    bd = two_ranks["dp2-bd-mb30"]
    assert bd["no_token_microbatches"] > bd["empty_microbatches"]


@pytest.mark.parametrize("name", [c["name"] for c in WRONG_N])
def test_a_wrong_normaliser_fails_the_gradient_check(two_ranks, name, request):
    """A wrong ``N`` must fail the per-parameter gradient comparison. ``dp2-wrong-n``: DP rank 0 uses N + 1,
    rank 1 N (measured: the gradient 14% off, 1.3e4 x its bound). ``dp2-wrong-n-all``: both use 2N, so every
    gradient is halved (4.5e4 x its bound); clipping and Adam's nearly scale-invariant first steps leave
    the updated parameters within 4.3e-5 of the reference (see the summary table)."""
    result = two_ranks[name]
    _record(result, request)
    with pytest.raises(AssertionError, match="gradient differs"):
        _check_grads(result)


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


@pytest.mark.parametrize("name", [c["name"] for c in CP_TWO_RANKS])
def test_context_parallel_two_ranks(cp_two_ranks, name, request):
    _check(cp_two_ranks[name], request)


@pytest.mark.parametrize("name", [c["name"] for c in CP_FOUR_RANKS])
def test_context_parallel_four_ranks(cp_four_ranks, name, request):
    _check(cp_four_ranks[name], request)


def test_context_parallel_without_its_reduction_fails(cp_two_ranks, request):
    """Skipping the CP all-reduce of the per-sequence sums (each CP rank then normalises by its own part of
    every sequence) must fail the gradient comparison."""
    result = cp_two_ranks["cp2-no-cp-reduce"]
    _record(result, request)
    with pytest.raises(AssertionError, match="gradient differs"):
        _check_grads(result)


def test_shared_prompt_cases_cover_every_variant_and_compute_fewer_tokens(reference, two_ranks):
    """The shared-prompt cases: every loss variant of the algorithm, and each computes fewer tokens than its
    samples hold (the prompts once per unit); the unshared references compute them all."""
    from gspo_mcore.algo.variants import LOSS_VARIANTS as VARIANTS

    assert set(LOSS_VARIANTS) == set(VARIANTS)
    results = {**reference[1], **two_ranks}
    for c in SHARED_ONE_RANK + SHARED_TWO_RANKS:
        r = results[c["name"]]
        assert all(a < b for a, b in zip(r["computed_tokens"], r["sample_tokens"])), (c["name"], r)
    for c in SHARED_REFERENCE:
        r = results[c["name"]]
        assert r["computed_tokens"] == r["sample_tokens"]
