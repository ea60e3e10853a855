"""``ops.linear_token_logprobs``: log-probs and entropy from hidden states and the LM-head weight in vocabulary
chunks, value and gradients (hidden, weight) against its pure-torch twin (one matmul, then log_softmax by
autograd) in the same dtype, against a float64 reference, and vocabulary-parallel over 2 gloo ranks.

Why they must agree: the chunks' statistics merge exactly (online log-sum-exp) into the statistics of the
whole slice, and each chunk's backward only needs the global lse / entropy, so the chunked gradients are the
slices of the twin's. The only differences are float32 rounding of the merge order and, in bf16, the
rounding of d logits @ W summed chunk by chunk.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import linear_cases as L

from gspo_mcore import ops
from gspo_mcore.ops import reference

BACKENDS = [
    pytest.param(True, id="reference"),
    pytest.param(
        False, id="compiled", marks=pytest.mark.skipif(not ops.HAVE_EXTENSION, reason="no compiled extension")
    ),
]

# (name, dtype, T, H, V, chunk, temperature, with entropy): T and V not multiples of chunk, chunk > V,
# chunk = 1, temperatures != 1.
CASES = [
    ("fp32-ent", torch.float32, 37, 24, 101, 16, 1.0, True),
    ("fp32-noent-tau0.7", torch.float32, 29, 16, 257, 64, 0.7, False),
    ("fp32-chunk-over-V", torch.float32, 5, 8, 7, 64, 1.3, True),
    ("fp32-chunk1", torch.float32, 6, 8, 11, 1, 0.9, True),
    ("bf16-ent-tau1.3", torch.bfloat16, 37, 32, 301, 48, 1.3, True),
    ("bf16-noent", torch.bfloat16, 17, 64, 1000, 96, 1.0, False),
]


def _fused(targets, temp, ent, chunk):
    return lambda h, W: ops.linear_token_logprobs(h, W, targets, temperature=temp, return_entropy=ent, chunk=chunk)


def _twin(targets, temp, ent):
    return lambda h, W: reference.linear_token_logprobs(h, W, targets, temperature=temp, return_entropy=ent)


def _close(got, want, rtol, atol_rel, what):
    atol = atol_rel * float(want.abs().max()) + 1e-30
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("use_ref", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_equals_twin(case, use_ref):
    """Value and gradients equal the twin's (whole [T, V] logits by one matmul, log_softmax by autograd)."""
    name, dtype, T, H, V, chunk, temp, ent = case
    hidden, weight, targets, w, u = L.inputs(name, dtype, T, H, V)
    with ops.use_reference(use_ref):
        got = L.loss_and_grads(_fused(targets, temp, ent, chunk), hidden, weight, targets, w, u, ent)
    want = L.loss_and_grads(_twin(targets, temp, ent), hidden, weight, targets, w, u, ent)
    assert got["logp"].dtype == torch.float32 and got["dh"].dtype == dtype and got["dw"].dtype == dtype
    if dtype == torch.float32:
        tol = dict(rtol=1e-5, atol_rel=1e-5)
    else:  # both round d logits and products to bf16 (the twin once, the op per chunk)
        tol = dict(rtol=1e-2, atol_rel=1e-2)
        exact = L.loss_and_grads(
            _twin(targets, temp, ent), hidden.double(), weight.double(), targets, w.double(), u.double(), ent
        )
        for key in ("dh", "dw"):  # no less accurate than eager bf16: within twice its error vs float64
            err = float((got[key].double() - exact[key]).abs().max())
            eager_err = float((want[key].double() - exact[key]).abs().max())
            assert err <= 2 * eager_err + 1e-6 * float(exact[key].abs().max()), (key, err, eager_err)
    _close(got["logp"], want["logp"], 1e-5, 1e-5, "logp")
    if ent:
        _close(got["entropy"], want["entropy"], 1e-5, 1e-5, "entropy")
    else:
        assert got["entropy"] is None
    _close(got["dh"], want["dh"], what="d hidden", **tol)
    _close(got["dw"], want["dw"], what="d weight", **tol)


@pytest.mark.parametrize("case", [c for c in CASES if c[1] == torch.float32], ids=lambda c: c[0])
def test_fp32_equals_float64_reference(case):
    """In float32 the op is as accurate as eager matmul + log_softmax: against float64 it errs at float32
    rounding of the logits' scale (compiled kernels)."""
    name, dtype, T, H, V, chunk, temp, ent = case
    hidden, weight, targets, w, u = L.inputs(name, dtype, T, H, V)
    got = L.loss_and_grads(_fused(targets, temp, ent, chunk), hidden, weight, targets, w, u, ent)
    want = L.loss_and_grads(
        _twin(targets, temp, ent), hidden.double(), weight.double(), targets, w.double(), u.double(), ent
    )
    for key in ("logp", "dh", "dw") + (("entropy",) if ent else ()):
        _close(got[key], want[key], 1e-5, 1e-5, key)


def test_graph_saves_no_logits():
    """Autograd keeps only hidden, weight, targets and [T] vectors: no saved tensor of T*chunk elements or
    more besides the inputs, while the twin saves [T, V] ones (so the probe can see them)."""
    T, H, V, chunk = 64, 16, 500, 32
    hidden, weight, targets, _, _ = L.inputs("mem", torch.float32, T, H, V)
    h, W = hidden.requires_grad_(True), weight.requires_grad_(True)

    def saved(fn):
        shapes = []

        def pack(t):
            shapes.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(h, W)
        return [s for s in shapes if s not in ((T, H), (V, H)) and torch.Size(s).numel() >= T * chunk]

    assert saved(_fused(targets, 1.0, True, chunk)) == []
    assert (T, V) in saved(_twin(targets, 1.0, True))


def test_bad_arguments_name_the_input():
    hidden, weight, targets, _, _ = L.inputs("bad", torch.float32, 4, 8, 10)
    with pytest.raises(ValueError, match="weight has hidden size 7"):
        ops.linear_token_logprobs(hidden, weight[:, :7], targets)
    with pytest.raises(TypeError, match="weight must have dtype"):
        ops.linear_token_logprobs(hidden, weight.double(), targets)
    with pytest.raises(ValueError, match="chunk must be an int >= 1"):
        ops.linear_token_logprobs(hidden, weight, targets, chunk=0)
    with pytest.raises(ValueError, match="temperature must be"):
        ops.linear_token_logprobs(hidden, weight, targets, temperature=0.0)
    with pytest.raises(ValueError, match="targets has 3 entries"):
        ops.linear_token_logprobs(hidden, weight, targets[:3])
    with pytest.raises(ValueError, match=r"targets\[1\]=10 is outside the vocabulary"):
        ops.linear_token_logprobs(hidden, weight, torch.tensor([0, 10, 1, 2]))


@pytest.fixture(scope="module")
def tp_ranks():
    from helpers import dist_cases as H

    return {
        use_ref: H.run_ranks(L.tp_rank, world=2, args=(use_ref,)) for use_ref in (True, False)[: 1 + ops.HAVE_EXTENSION]
    }


@pytest.mark.distributed
@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo")
@pytest.mark.parametrize("use_ref", BACKENDS)
@pytest.mark.parametrize("case", L.TP_CASES, ids=[c[0] for c in L.TP_CASES])
def test_vocab_parallel_equals_single_rank(tp_ranks, case, use_ref):
    """On 2 ranks with the vocabulary split unevenly: every rank's logp / entropy equal the twin's on the
    whole weight, the sum of the ranks' d hidden equals the twin's, and each rank's d weight is its rows of
    the twin's."""
    name, dtype, T, H, V, split, chunk, temp, ent = case
    hidden, weight, targets, w, u = L.inputs(name, dtype, T, H, V, split)
    want = L.loss_and_grads(_twin(targets, temp, ent), hidden, weight, targets, w, u, ent)
    tol = dict(rtol=1e-5, atol_rel=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol_rel=1e-2)
    start = 0
    for r in range(2):
        got = tp_ranks[use_ref][r][name]
        _close(got["logp"], want["logp"], 1e-5, 1e-5, "logp")
        if ent:
            _close(got["entropy"], want["entropy"], 1e-5, 1e-5, "entropy")
        _close(got["dh"], want["dh"], what="d hidden", **tol)
        assert got["dw"].shape == (split[r], H)
        _close(got["dw"], want["dw"][start : start + split[r]], what="d weight", **tol)
        start += split[r]
