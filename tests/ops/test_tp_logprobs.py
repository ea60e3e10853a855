"""Tensor (vocabulary) parallel token_logprobs and context-parallel segment_mean / policy_loss on 2 gloo
ranks, against the single-rank result, value and gradient.

Why they must agree: the vocabulary-parallel forward all-reduces per-token statistics from which the
full-vocabulary log-sum-exp (and entropy) is rebuilt exactly, and the backward of each rank's slice
only needs that global lse / entropy, so rank r's d logits IS the slice [start_r, start_r + V_r) of the
single-rank d logits. Under context parallelism every per-sequence quantity is a sum of per-rank partial
sums, completed by one all-reduce whose backward is the identity, so the loss is the single-rank loss on
every rank and each rank's tokens get the single-rank gradient.

All ranks run in ONE spawn (module fixture); the tests then check its results.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import dist_cases as H

from gspo_mcore import ops

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"),
]

BACKENDS = [
    pytest.param(True, id="reference"),
    pytest.param(
        False, id="compiled", marks=pytest.mark.skipif(not ops.HAVE_EXTENSION, reason="no compiled extension")
    ),
]
_MANTISSA_BITS = {torch.bfloat16: 8, torch.float32: 24}


@pytest.fixture(scope="module")
def ranks():
    """The results of :func:`helpers.dist_cases.all_checks` on each of 2 ranks."""
    return H.run_ranks(H.all_checks, world=2)


def _ulp(x, dtype):
    _, e = torch.frexp(x.abs())
    return torch.ldexp(torch.ones_like(x), e - _MANTISSA_BITS[dtype]).clamp(min=2.0**-133)


@pytest.mark.parametrize("use_ref", BACKENDS)
@pytest.mark.parametrize("case", H.TP_CASES, ids=[c[0] for c in H.TP_CASES])
def test_vocab_parallel_equals_single_rank(ranks, case, use_ref):
    """Every rank's logp and entropy equal the single-rank values (to float32 rounding of the different
    combination order) and every rank's d logits equals its slice of the single-rank d logits, for V split
    unevenly, targets on both ranks' slices, fp32 and bf16, temperatures != 1, with and without entropy."""
    name, dtype, V, split, T, temp, ent = case
    with ops.use_reference(use_ref):
        full = H.tp_single_rank(case)
    logits, targets, _, _ = H.tp_inputs(case)
    owners = (targets >= split[0]).long()
    assert set(owners.tolist()) == {0, 1}  # targets on both sides of the split
    # float32 rounding of logp = z_t - lse with |z|, |lse| up to ~ max|logit| / tau + log V
    scale = float(logits.float().abs().max()) / temp + float(torch.log(torch.tensor(float(V)))) + 1
    atol = 8 * torch.finfo(torch.float32).eps * scale
    start = 0
    for r in range(2):
        got = ranks[r]["tp"][(name, use_ref)]
        torch.testing.assert_close(got["logp"], full["logp"], rtol=0, atol=atol)
        if ent:
            torch.testing.assert_close(got["entropy"], full["entropy"], rtol=0, atol=atol)
        else:
            assert got["entropy"] is None
        want = full["grad"][:, start : start + split[r]]
        assert got["grad"].shape == (T, split[r]) and got["grad"].dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got["grad"], want, rtol=1e-5, atol=atol * float(want.abs().max()))
        else:  # both round (nearly) the same float32 value to bf16
            g, w = got["grad"].double(), want.double()
            assert bool(((g - w).abs() <= _ulp(w, dtype) + 1e-7).all()), float((g - w).abs().max())
        start += split[r]


@pytest.mark.parametrize("use_ref", BACKENDS)
def test_target_outside_global_vocab_raises_on_every_rank(ranks, use_ref):
    """A target id >= V (global) or < 0 is owned by no rank: every rank raises ValueError naming it
    (after the collective, so no rank hangs), while ids >= V_local of rank 0 are valid."""
    for r in range(2):
        msgs = ranks[r]["tp_out_of_range", use_ref]
        assert msgs["V"] is not None and "targets[4]=1001 is outside the vocabulary" in msgs["V"]
        assert msgs["negative"] is not None and "targets[4]=-1 is outside the vocabulary" in msgs["negative"]


@pytest.mark.parametrize("use_ref", BACKENDS)
@pytest.mark.parametrize(
    "key", ["segment_mean", "gspo", "gspo_token", "gspo_token-per-token", "grpo", "sapo", "cispo", "gmpo"]
)
def test_context_parallel_equals_single_rank(ranks, key, use_ref):
    """segment_mean and policy_loss (each variant) with cp_group, each rank holding an uneven part of every
    sequence: the mean / loss and all metrics equal the single-rank values on every rank, and each rank's
    gradient equals the single-rank gradient at the tokens it holds."""
    full = H.cp_single_rank(use_ref)[key]
    grad = torch.full_like(full[3], float("nan"))
    for r in range(2):
        value, count, metrics, g = ranks[r]["cp"][use_ref][key]
        torch.testing.assert_close(value, full[0], rtol=1e-6, atol=1e-7)
        if count is not None:
            torch.testing.assert_close(count, full[1], rtol=0, atol=0)
        if metrics is not None:
            assert set(metrics) == set(full[2])
            for k in metrics:
                torch.testing.assert_close(metrics[k], full[2][k], rtol=1e-6, atol=1e-7, msg=k)
        idx, _ = H.cp_index(r)
        grad[idx] = g
    assert not torch.isnan(grad).any()  # the ranks' tokens cover the batch
    torch.testing.assert_close(grad, full[3], rtol=1e-5, atol=1e-8)
    if key == "sapo":  # no clip: its gate must be away from 1 somewhere
        assert float(full[2]["gate_mean"]) < 0.999
    elif key != "segment_mean":
        assert float(full[2]["clip_fraction"]) > 0  # the batch clips: the test is not vacuous
