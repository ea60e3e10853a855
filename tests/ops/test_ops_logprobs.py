"""token_logprobs and its two ops (token_logprob_stats / token_logprob_backward) on one rank.

Accuracy is bounded by the error eager torch makes in the same dtype, measured against a float64
reference (flash-attention's convention): ``err(kernel) <= 2 * err(eager) + floor``. The floor covers
what every float32 evaluation of ``logp = z_t - lse`` must lose (a few ulps of the operands) and that
eager torch sometimes lands exactly on the float64 value by luck (V=1, ties); each floor is derived
where it is defined.
"""

from __future__ import annotations

import math

import pytest
import torch

from gspo_mcore import ops
from gspo_mcore.ops import reference
from gspo_mcore.ops.logprobs import combine_stats
from gspo_mcore.ops.reference import MAX, OWNED, SUMEXP, TARGET, XSUM

EPS32 = torch.finfo(torch.float32).eps  # 2**-23: one float32 ulp at 1
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Vocabulary widths that are not multiples of any vector width (8 / 16 floats), and how many rows each.
VOCABS = {1: 37, 7: 37, 17: 29, 1000: 16, 32003: 3}
# (logits layout, temperature): contiguous; a slice of a wider tensor (row stride V + 13); and a
# transposed tensor (stride along the vocabulary != 1, so the wrapper must copy it).
LAYOUT_TEMPS = [("contiguous", 1.0), ("sliced", 0.7), ("transposed", 2.5)]
_MANTISSA_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}


def dname(dtype):
    return str(dtype).removeprefix("torch.")


def make_case(T, V, dtype, layout):
    """(leaf, view, targets): ``view(leaf)`` are the logits [T, V] the op sees; ``leaf`` gets the grad.

    Rows are deliberately awkward: every 4th row has a peaked distribution (p(target) ~ 1, so
    ``1 - p`` cancels), and others are shifted by -30 / +40 (the log-sum-exp is far from 0).
    """
    targets = torch.randint(0, V, (T,))
    if T:
        targets[0], targets[-1] = 0, V - 1
    base = torch.randn(T, V) * 3
    rows = torch.arange(T)
    peak = rows % 4 == 1
    base[peak, targets[peak]] += 12
    base[rows % 4 == 2] -= 30
    base[rows % 4 == 3] += 40
    if layout == "contiguous":
        leaf = base.to(dtype)

        def view(t):
            return t
    elif layout == "sliced":
        wide = torch.zeros(T, V + 13)
        wide[:, 5 : 5 + V] = base
        leaf = wide.to(dtype)

        def view(t):
            return t[:, 5 : 5 + V]
    else:
        leaf = base.t().contiguous().to(dtype)

        def view(t):
            return t.t()

    leaf.requires_grad_(True)
    return leaf, view, targets


def grad_of_view(leaf, layout, V):
    g = leaf.grad
    if layout == "sliced":
        pad = torch.cat([g[:, :5], g[:, 5 + V :]], dim=1)
        assert torch.equal(pad, torch.zeros_like(pad)), "gradient leaked into columns outside the slice"
        return g[:, 5 : 5 + V]
    if layout == "transposed":
        return g.t()
    return g


def eager_logp_entropy(logits, targets, temp):
    """Eager torch, written out here (independent of the project's twin): ``log_softmax`` in float64 for
    float64 logits, else in float32 (logits upcast); the target's log-prob and the entropy, both [T]."""
    z = logits.double() if logits.dtype == torch.float64 else logits.float()
    logp_all = torch.log_softmax(z / temp, dim=-1)  # (T, V)
    return logp_all.gather(1, targets[:, None]).squeeze(1), -(logp_all.exp() * logp_all).sum(-1)


def fp64_truth(logits, targets, temp, w, u):
    """logp, entropy, d(sum w*logp + u*H)/d logits and the pieces of the error floors, in float64."""
    x = logits.detach().double().requires_grad_(True)
    lp, H = eager_logp_entropy(x, targets, temp)
    assert lp.dtype == torch.float64
    loss = (lp * w).sum() + ((H * u).sum() if u is not None else 0.0)
    loss.backward()
    z = x.detach() / temp
    lse = torch.logsumexp(z, dim=-1) if z.shape[1] else z.new_zeros(z.shape[0])
    return lp.detach(), H.detach(), x.grad, z, lse


def value_floor(z, lse, targets):
    """Per row [T]: forming ``logp = z_t - (m + log s)`` in float32 rounds z_t (= logit * 1/tau), lse and the
    difference, each by up to half an ulp of its operand (an ulp of |x| is at most EPS32 * |x|): two float32
    epsilons of ``|z_t| + |lse|`` covers it. Per row, so that rows shifted far from 0 do not loosen the bound
    on ordinary rows."""
    if z.shape[0] == 0:
        return z.new_zeros(0)
    zt = z.gather(1, targets[:, None]).squeeze(1)
    return 2 * EPS32 * (zt.abs() + lse.abs())


def entropy_floor(z, lse):
    """Per row [T]: ``H = log S - W / S`` with ``W = sum e^(z-m) (z-m)``: float32 differences ``z - m`` carry up
    to an ulp of ``|z|``; ``log S`` and ``W / S`` are bounded by ``|lse - m|`` and the row's range."""
    if z.shape[0] == 0:
        return z.new_zeros(0)
    return 4 * EPS32 * (1 + lse.abs() + z.abs().amax(dim=1))


def row_bound_use(got, eager, truth, floor):
    """max over rows of ``|got - truth| / (2 |eager - truth| + floor)`` (float64): <= 1 passes. Each row is held
    to twice eager torch's error on that same row plus that row's rounding floor."""
    if got.numel() == 0:
        return 0.0
    err = (got.detach().double() - truth).abs()
    bound = 2 * (eager.detach().double() - truth).abs() + floor
    return float((err / bound).max())


def grad_floor(z, lse, H, temp, w, u):
    """First-order error of a float32 ``p = exp(z * (1/tau) - lse)``: its argument carries an absolute
    error of about an ulp of ``|z| + |lse|``, so ``d logits`` (``~ p * (|w| + |u| (1 + |log p + H|)) / tau``)
    carries that much relative error. Two such ulps, element by element, maximised."""
    if z.numel() == 0:
        return 0.0
    logp_all = z - lse[:, None]
    p = logp_all.exp()
    weight = w.abs()[:, None].expand_as(p).clone()
    if u is not None:
        weight = weight + u.abs()[:, None] * (1 + (logp_all + H[:, None]).abs())
    return 2 * EPS32 * float(((z.abs() + lse.abs()[:, None] + 1) * p * weight / temp).max())


def ulp(x, dtype):
    """Spacing of ``dtype`` numbers at ``|x|`` (float64 tensor in, float64 out)."""
    bits = _MANTISSA_BITS[dtype]
    _, e = torch.frexp(x.abs())
    out = torch.ldexp(torch.ones_like(x), e - bits)
    tiny = {torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133, torch.float32: 2.0**-149}[dtype]
    return out.clamp(min=tiny)


def maxabs(t):
    return float(t.detach().abs().max()) if t.numel() else 0.0


def run_kernel(logits, targets, temp, entropy, w, u):
    out = ops.token_logprobs(logits, targets, temperature=temp, return_entropy=entropy)
    lp, H = out if entropy else (out, None)
    loss = (lp.double() * w).sum() + ((H.double() * u).sum() if entropy else 0.0)
    loss.backward()
    return lp.detach(), (H.detach() if entropy else None)


def check_against_fp64(T, V, dtype, layout, temp, entropy, error_report, tag):
    leaf, view, targets = make_case(T, V, dtype, layout)
    logits = view(leaf)
    if layout == "sliced" and T > 1:
        assert logits.stride() == (V + 13, 1) and not logits.is_contiguous()
    if layout == "transposed" and T > 1 and V > 1:
        assert logits.stride(1) != 1
    w = torch.randn(T, dtype=torch.float64)
    u = torch.randn(T, dtype=torch.float64) if entropy else None
    lp64, H64, g64, z, lse = fp64_truth(logits, targets, temp, w, u)

    # the kernel (or the reference twin, depending on the `backend` fixture)
    lp_k, H_k = run_kernel(logits, targets, temp, entropy, w, u)
    g_k = grad_of_view(leaf, layout, V).double()
    assert lp_k.dtype == torch.float32 and lp_k.shape == (T,)

    # eager torch in float32 (logits upcast), written out in this file
    leaf_e = leaf.detach().clone().requires_grad_(True)
    lp_e, H_e = eager_logp_entropy(view(leaf_e), targets, temp)
    ((lp_e.double() * w).sum() + ((H_e.double() * u).sum() if entropy else 0.0)).backward()
    g_e = grad_of_view(leaf_e, layout, V).double()

    floor = value_floor(z, lse, targets)  # (T,)
    use_v = row_bound_use(lp_k, lp_e, lp64, floor)
    assert use_v <= 1.0, use_v
    error_report(f"logp {dname(dtype)} [{tag}]", maxabs(lp_k.double() - lp64), maxabs(lp_e.double() - lp64), use=use_v)

    if dtype != torch.float32:
        # eager torch computing in the input dtype itself: log_softmax of bf16/fp16 logits rounds its
        # output to that dtype (an error of ~half an ulp of |logp|, orders above float32's).
        low = torch.log_softmax(logits.detach() / temp, dim=-1)
        assert low.dtype == dtype
        lp_low = low.gather(1, targets[:, None]).squeeze(1).double()
        use_low = row_bound_use(lp_k, lp_low, lp64, floor)
        assert use_low <= 1.0, use_low
        error_report(
            f"logp {dname(dtype)} vs eager-in-{dname(dtype)} [{tag}]",
            maxabs(lp_k.double() - lp64),
            maxabs(lp_low - lp64),
            use=use_low,
        )

    if entropy:
        use_h = row_bound_use(H_k, H_e, H64, entropy_floor(z, lse))
        assert use_h <= 1.0, use_h
        error_report(
            f"entropy {dname(dtype)} [{tag}]", maxabs(H_k.double() - H64), maxabs(H_e.double() - H64), use=use_h
        )

    gf = grad_floor(z, lse, H64, temp, w, u)
    if dtype == torch.float32:
        errg_k, errg_e = maxabs(g_k - g64), maxabs(g_e - g64)
        assert errg_k <= 2 * errg_e + gf, (errg_k, errg_e, gf)
        error_report(f"grad float32 [{tag}]", errg_k, errg_e, gf)
    else:
        # The gradient is written in the logits' dtype: its rounding (half an ulp, one ulp with the
        # float32 error before it) dominates everything else.
        u_ = ulp(g64, dtype)
        bound = u_ + gf

        def use(g):  # max over elements of |error| / (1 ulp + floor): <= 1 passes
            return float(((g - g64).abs() / bound).max()) if g.numel() else 0.0

        assert use(g_k) <= 1.0, use(g_k)
        assert use(g_e) <= 1.0  # eager float32-then-round obeys the same bound
        leaf_low = leaf.detach().clone().requires_grad_(True)
        la = torch.log_softmax(view(leaf_low) / temp, dim=-1)
        lp_l = la.gather(1, targets[:, None]).squeeze(1)
        loss_l = (lp_l.double() * w).sum()
        if entropy:
            loss_l = loss_l + ((-(la.exp() * la).sum(-1)).double() * u).sum()
        loss_l.backward()
        g_l = grad_of_view(leaf_low, layout, V).double()
        error_report(f"grad {dname(dtype)}: |err| / (1 ulp + floor) [{tag}]", use(g_k), use(g_e), use=use(g_k))
        error_report(
            f"grad {dname(dtype)}: |err| / (1 ulp + floor), vs eager-in-{dname(dtype)} [{tag}]",
            use(g_k),
            use(g_l),
            use=use(g_k),
        )
        error_report(f"grad {dname(dtype)} max abs [{tag}]", maxabs(g_k - g64), maxabs(g_e - g64), use=0.0)


# float32 and bfloat16 on every vocabulary width; float16 (also supported) on two of them
DTYPE_VOCABS = [(d, V) for d in (torch.float32, torch.bfloat16) for V in VOCABS] + [
    (torch.float16, 17),
    (torch.float16, 1000),
]


@pytest.mark.parametrize("layout,temp", LAYOUT_TEMPS, ids=[f"{a}-tau{t}" for a, t in LAYOUT_TEMPS])
@pytest.mark.parametrize("entropy", [False, True], ids=["noent", "ent"])
@pytest.mark.parametrize("dtype,V", DTYPE_VOCABS, ids=[f"{dname(d)}-V{V}" for d, V in DTYPE_VOCABS])
def test_token_logprobs_accuracy(backend, dtype, V, entropy, layout, temp, error_report):
    """logp, entropy and d logits (compiled kernels under each ISA, and the reference twin) are within
    2x eager torch's error of float64 (+ a float32-rounding floor), on V that is no multiple of the
    vector width, strided / transposed logits, temperatures != 1, with and without entropy."""
    check_against_fp64(
        VOCABS[V], V, dtype, layout, temp, entropy, error_report, "reference" if backend == "reference" else "compiled"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dname)
def test_one_row_of_151936(backend, dtype, error_report):
    """A single row of Qwen's vocabulary (151936): long reductions keep the same accuracy bound."""
    check_against_fp64(
        1, 151936, dtype, "contiguous", 0.8, True, error_report, "reference" if backend == "reference" else "compiled"
    )


@pytest.mark.parametrize("V", [1, 7, 1000])
def test_single_token(backend, V, error_report):
    """T=1 works (one row, one target), value and gradient; V=1 gives logp 0 and entropy 0."""
    check_against_fp64(1, V, torch.float32, "contiguous", 1.3, True, error_report, "T=1")
    if V == 1:
        lp, H = ops.token_logprobs(torch.randn(1, 1), torch.zeros(1, dtype=torch.long), return_entropy=True)
        assert abs(float(lp)) < 1e-6 and abs(float(H)) < 1e-6


@pytest.mark.parametrize("entropy", [False, True])
def test_zero_tokens(backend, entropy):
    """T=0: empty outputs and an empty gradient (a micro-batch slice may be empty on some rank)."""
    logits = torch.randn(0, 11, requires_grad=True)
    out = ops.token_logprobs(logits, torch.zeros(0, dtype=torch.long), return_entropy=entropy)
    lp = out[0] if entropy else out
    assert lp.shape == (0,) and lp.dtype == torch.float32
    total = lp.sum() + (out[1].sum() if entropy else 0.0)
    total.backward()
    assert logits.grad.shape == (0, 11)


def test_compiled_and_reference_twins_agree(cpu_isa):
    """Same inputs through use_reference(False) and use_reference(True): the two implementations of the
    same specification agree to float32 precision (value, entropy and gradient)."""
    leaf, view, targets = make_case(23, 1000, torch.float32, "sliced")
    w = torch.randn(23, dtype=torch.float64)
    u = torch.randn(23, dtype=torch.float64)
    lp_c, H_c = run_kernel(view(leaf), targets, 0.9, True, w, u)
    g_c = leaf.grad.clone()
    leaf.grad = None
    with ops.use_reference(True):
        lp_r, H_r = run_kernel(view(leaf), targets, 0.9, True, w, u)
    g_r = leaf.grad
    _, H64, _, z, lse = fp64_truth(view(leaf), targets, 0.9, w, u)
    # each is within its floor of float64 (test_token_logprobs_accuracy), so within twice of each other
    torch.testing.assert_close(lp_c, lp_r, rtol=0, atol=2 * float(value_floor(z, lse, targets).max()))
    torch.testing.assert_close(H_c, H_r, rtol=0, atol=2 * float(entropy_floor(z, lse).max()))
    torch.testing.assert_close(g_c, g_r, rtol=0, atol=2 * grad_floor(z, lse, H64, 0.9, w, u))


# ---------------------------------------------------------------------------------------------------
# The two ops directly (vocabulary slices: vocab_start != 0, targets on and off this slice)
# ---------------------------------------------------------------------------------------------------


def _slice_case(dtype, V=301, T=19, vocab_start=1000):
    logits = (torch.randn(T, V) * 4).to(dtype)
    # targets: some in [vocab_start, vocab_start + V), some below, some above
    targets = torch.randint(vocab_start - 50, vocab_start + V + 50, (T,))
    targets[:3] = torch.tensor([vocab_start, vocab_start + V - 1, vocab_start + V])
    return logits, targets


@pytest.mark.parametrize("inv_temperature", [1.0, 1 / 0.7])
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
def test_stats_op_matches_reference(cpu_isa, dtype, with_entropy, inv_temperature):
    """token_logprob_stats on a vocabulary slice equals its twin: the max and the target logit exactly
    (the same float32 products), ownership exactly, the sums to float32 accumulation accuracy."""
    vs = 1000
    logits, targets = _slice_case(dtype, vocab_start=vs)
    got = torch.ops.gspo_mcore.token_logprob_stats(logits, targets, vs, inv_temperature, with_entropy)
    want = reference.token_logprob_stats(logits, targets, vs, inv_temperature, with_entropy)
    assert got.shape == want.shape == (19, 5) and got.dtype == torch.float32
    torch.testing.assert_close(got[:, MAX], want[:, MAX], rtol=0, atol=0)
    torch.testing.assert_close(got[:, TARGET], want[:, TARGET], rtol=0, atol=0)
    torch.testing.assert_close(got[:, OWNED], want[:, OWNED], rtol=0, atol=0)
    owned = (targets >= vs) & (targets < vs + 301)
    assert torch.equal(got[:, OWNED].bool(), owned) and owned.any() and (~owned).any()
    torch.testing.assert_close(got[:, SUMEXP], want[:, SUMEXP], rtol=2e-6, atol=0)
    if with_entropy:
        torch.testing.assert_close(got[:, XSUM], want[:, XSUM], rtol=2e-5, atol=2e-5)
    else:
        assert torch.equal(got[:, XSUM], torch.zeros(19))


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
def test_backward_op_matches_reference(cpu_isa, dtype, with_entropy):
    """token_logprob_backward on a slice, given a global lse / entropy (as after the TP all-reduce),
    equals its twin: one-hot terms only where this slice owns the target."""
    vs, it = 1000, 1 / 1.3
    logits, targets = _slice_case(dtype, vocab_start=vs)
    stats = reference.token_logprob_stats(logits, targets, vs, it, True)
    # pretend the other ranks' slices add as much mass again: the global lse is larger than the local one
    other = stats.clone()
    other[:, OWNED] = 1 - stats[:, OWNED]
    _, lse, H, _ = combine_stats(torch.stack([stats, other]))
    g = torch.randn(19)
    gh = torch.randn(19) if with_entropy else None
    Hh = H if with_entropy else None
    got = torch.ops.gspo_mcore.token_logprob_backward(logits, targets, lse, g, Hh, gh, vs, it)
    want = reference.token_logprob_backward(logits, targets, lse, g, Hh, gh, vs, it)
    assert got.dtype == dtype and got.shape == logits.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:  # both round the same float32 value; they may differ by one rounding step
        assert bool(((got.double() - want.double()).abs() <= ulp(want.double(), dtype) + 1e-7).all())


def test_kernel_handles_row_stride(cpu_isa):
    """The kernels read rows at stride(0) (a slice of a wider tensor is not copied) and give what a
    contiguous copy gives, bit for bit."""
    wide = torch.randn(9, 120)
    sl = wide[:, 3:110]
    targets = torch.randint(0, 107, (9,))
    a = torch.ops.gspo_mcore.token_logprob_stats(sl, targets, 0, 1.0, True)
    b = torch.ops.gspo_mcore.token_logprob_stats(sl.contiguous(), targets, 0, 1.0, True)
    assert torch.equal(a, b)
    _, lse, H, _ = combine_stats(a[None])
    g = torch.randn(9)
    ga = torch.ops.gspo_mcore.token_logprob_backward(sl, targets, lse, g, H, g, 0, 1.0)
    gb = torch.ops.gspo_mcore.token_logprob_backward(sl.contiguous(), targets, lse, g, H, g, 0, 1.0)
    assert torch.equal(ga, gb)


# ---------------------------------------------------------------------------------------------------
# torch.library.opcheck: schema, fake (meta) kernels, autograd registration, AOT dispatch
# ---------------------------------------------------------------------------------------------------


def _stats_samples():
    x = torch.randn(5, 7)
    t = torch.randint(0, 7, (5,))
    xb, tb = _slice_case(torch.bfloat16, V=33, T=6, vocab_start=10)
    return [(x, t, 0, 1.0, True), (xb, tb, 10, 1 / 0.7, False)]


@pytest.mark.parametrize("i", [0, 1])
def test_opcheck_token_logprob_stats(compiled, i):
    """The compiled op is registered consistently (schema, fake kernel, no autograd claims)."""
    torch.library.opcheck(torch.ops.gspo_mcore.token_logprob_stats.default, _stats_samples()[i])


@pytest.mark.parametrize("i", [0, 1])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_opcheck_token_logprob_backward(compiled, i, with_entropy):
    """The backward op is registered consistently, with and without the optional entropy tensors."""
    logits, targets, vs, it, _ = _stats_samples()[i]
    stats = reference.token_logprob_stats(logits, targets, vs, it, True)
    _, lse, H, _ = combine_stats(stats[None])
    T = logits.shape[0]
    args = (
        logits,
        targets,
        lse,
        torch.randn(T),
        H if with_entropy else None,
        torch.randn(T) if with_entropy else None,
        vs,
        it,
    )
    torch.library.opcheck(torch.ops.gspo_mcore.token_logprob_backward.default, args)


@pytest.mark.parametrize("i", [0, 1])
def test_opcheck_token_logprob_grad_inplace(compiled, i):
    """The in-place op is registered consistently (its schema declares the mutation of logits)."""
    logits, targets, vs, it, _ = _stats_samples()[i]
    stats = reference.token_logprob_stats(logits, targets, vs, it, True)
    _, lse, H, _ = combine_stats(stats[None])
    T = logits.shape[0]
    ent = (H, torch.randn(T)) if i == 1 else (None, None)
    torch.library.opcheck(
        torch.ops.gspo_mcore.token_logprob_grad_inplace_.default,
        (logits.clone(), targets, lse, torch.randn(T), *ent, vs, it),
    )


@pytest.mark.parametrize("entropy", [False, True], ids=["noent", "ent"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
def test_grad_inplace_op_matches_reference(cpu_isa, dtype, entropy):
    """token_logprob_grad_inplace_ on a vocabulary slice writes exactly what its twin writes (up to one
    rounding step in bf16 / fp16): the backward for the given grad_logp (and entropy term), into the
    logits themselves; and bit for bit what the out-of-place op returns (the same row kernel)."""
    vs, it = 1000, 1 / 1.3
    logits, targets = _slice_case(dtype, vocab_start=vs)
    T = logits.shape[0]
    stats = reference.token_logprob_stats(logits, targets, vs, it, True)
    _, lse, H, _ = combine_stats(stats[None])
    g = torch.randn(T)
    ent = (H, torch.randn(T)) if entropy else (None, None)
    got, want = logits.clone(), logits.clone()
    torch.ops.gspo_mcore.token_logprob_grad_inplace_(got, targets, lse, g, *ent, vs, it)
    reference.token_logprob_grad_inplace_(want, targets, lse, g, *ent, vs, it)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        assert bool(((got.double() - want.double()).abs() <= ulp(want.double(), dtype) + 1e-7).all())
    assert not torch.equal(got, logits)
    out_of_place = torch.ops.gspo_mcore.token_logprob_backward(logits, targets, lse, g, *ent, vs, it)
    assert torch.equal(got, out_of_place)


# ---------------------------------------------------------------------------------------------------
# NaN / inf
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dname)
def test_nonfinite_row_poisons_only_its_token(backend, dtype, bad):
    """NaN or +inf anywhere in a row makes that token's logp and entropy NaN (never a silently finite
    number); every other row's value and gradient are exactly what they are without the bad row."""
    T, V = 6, 53
    clean = (torch.randn(T, V) * 2).to(dtype)
    targets = torch.randint(0, V, (T,))
    dirty = clean.clone()
    dirty[2, 17] = bad
    dirty[4, int(targets[4])] = bad  # the target's own logit
    outs = []
    for x in (clean, dirty):
        x = x.clone().requires_grad_(True)
        lp, H = ops.token_logprobs(x, targets, return_entropy=True, temperature=0.9)
        (lp.nan_to_num(0.0).sum() + H.nan_to_num(0.0).sum()).backward()
        outs.append((lp.detach(), H.detach(), x.grad))
    (lp0, H0, g0), (lp1, H1, g1) = outs
    bad_rows = torch.tensor([False, False, True, False, True, False])
    assert torch.isnan(lp1[bad_rows]).all() and torch.isnan(H1[bad_rows]).all()
    assert torch.equal(lp1[~bad_rows], lp0[~bad_rows])
    assert torch.equal(H1[~bad_rows], H0[~bad_rows])
    assert torch.equal(g1[~bad_rows], g0[~bad_rows])


def test_unused_entropy_leaves_logp_gradient_alone(backend):
    """Returning the entropy only for logging changes nothing in d logp / d logits (bit for bit), even on a
    row with a -inf logit, whose entropy is NaN (an unused output must not inject 0 * NaN); and a loss
    on the entropy alone gets the float64 entropy gradient."""
    x = torch.randn(5, 40) * 2
    x[0, 7] = -math.inf
    targets = torch.randint(8, 40, (5,))
    grads = []
    for ent in (False, True):
        leaf = x.clone().requires_grad_(True)
        out = ops.token_logprobs(leaf, targets, return_entropy=ent, temperature=0.8)
        (out[0] if ent else out).sum().backward()
        grads.append(leaf.grad)
    assert torch.isfinite(grads[1]).all()
    assert torch.equal(grads[0], grads[1])
    leaf = x[1:].clone().requires_grad_(True)
    _, H = ops.token_logprobs(leaf, targets[1:], return_entropy=True, temperature=0.8)
    H.sum().backward()
    x64 = x[1:].double().requires_grad_(True)
    _, H64 = eager_logp_entropy(x64, targets[1:], 0.8)
    H64.sum().backward()
    torch.testing.assert_close(leaf.grad.double(), x64.grad, rtol=0, atol=1e-5)


def test_minus_inf_logit_is_a_masked_token(backend):
    """-inf is a legitimate logit (a token with probability 0): logp of the other targets stays finite
    and equals torch.log_softmax; a row that is entirely -inf has no distribution and gives NaN."""
    x = torch.randn(3, 9)
    x[0, 4] = -math.inf
    x[1, :] = -math.inf
    targets = torch.tensor([2, 2, 5])
    lp = ops.token_logprobs(x, targets)
    want = torch.log_softmax(x, dim=-1).gather(1, targets[:, None]).squeeze(1)
    assert torch.isfinite(lp[[0, 2]]).all()
    torch.testing.assert_close(lp[[0, 2]], want[[0, 2]], rtol=0, atol=2e-6)
    assert torch.isnan(lp[1])


# ---------------------------------------------------------------------------------------------------
# Bad input: documented errors that name the argument
# ---------------------------------------------------------------------------------------------------


def _ok():
    return torch.randn(4, 10), torch.randint(0, 10, (4,))


BAD_INPUTS = [
    ("logits-1d", lambda x, t: (x[0], t, {}), ValueError, r"logits must be 2-D"),
    ("logits-3d", lambda x, t: (x[None], t, {}), ValueError, r"logits must be 2-D"),
    ("logits-fp64", lambda x, t: (x.double(), t, {}), TypeError, r"logits must have dtype"),
    ("logits-int", lambda x, t: (x.long(), t, {}), TypeError, r"logits must have dtype"),
    ("logits-list", lambda x, t: (x.tolist(), t, {}), TypeError, r"logits must be a torch.Tensor"),
    ("logits-no-vocab", lambda x, t: (x[:, :0], t, {}), ValueError, r"logits must have at least one vocabulary"),
    ("targets-int32", lambda x, t: (x, t.int(), {}), TypeError, r"targets must have dtype"),
    ("targets-2d", lambda x, t: (x, t[:, None], {}), ValueError, r"targets must be 1-D"),
    ("targets-length", lambda x, t: (x, t[:3], {}), ValueError, r"targets has 3 entries but logits"),
    ("targets-device", lambda x, t: (x, t.to("meta"), {}), ValueError, r"targets is on meta but must be on cpu"),
    ("logits-device", lambda x, t: (x.to("meta"), t, {}), ValueError, r"targets is on cpu but must be on meta"),
    ("target-too-big", lambda x, t: (x, torch.tensor([0, 10, 1, 2]), {}), ValueError, r"targets\[1\]=10 is outside"),
    ("target-negative", lambda x, t: (x, torch.tensor([0, 1, -1, 2]), {}), ValueError, r"targets\[2\]=-1 is outside"),
    ("temperature-0", lambda x, t: (x, t, {"temperature": 0.0}), ValueError, r"temperature must be"),
    ("temperature-neg", lambda x, t: (x, t, {"temperature": -1.0}), ValueError, r"temperature must be"),
    ("temperature-nan", lambda x, t: (x, t, {"temperature": math.nan}), ValueError, r"temperature must be"),
    ("temperature-inf", lambda x, t: (x, t, {"temperature": math.inf}), ValueError, r"temperature must be"),
    ("temperature-str", lambda x, t: (x, t, {"temperature": "1"}), ValueError, r"temperature must be"),
    ("vocab_start-without-group", lambda x, t: (x, t, {"vocab_start": 5}), ValueError, r"vocab_start=5 needs tp_group"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_raises_naming_the_argument(backend, case):
    """Bad shapes, dtypes, devices, targets and temperatures raise the documented error, naming the
    argument, on both the compiled and the reference path."""
    _, build, exc, match = case
    x, t, kw = build(*_ok())
    with pytest.raises(exc, match=match):
        ops.token_logprobs(x, t, **kw)


CPP_BAD = [
    ("logits-1d", lambda x, t: (x[0], t), r"logits must be 2-D"),
    ("targets-2d", lambda x, t: (x, t[:, None]), r"targets must be 1-D"),
    ("logits-fp64", lambda x, t: (x.double(), t), r"logits must be float32, bfloat16 or float16"),
    ("targets-int32", lambda x, t: (x, t.int()), r"targets must be Long"),
    ("rows", lambda x, t: (x, t[:2]), r"logits has 4 rows but targets has 2"),
    ("no-vocab", lambda x, t: (x[:, :0], t), r"logits must have at least one vocabulary column"),
    ("column-stride", lambda x, t: (x.t().contiguous().t(), t), r"logits must be contiguous along the vocabulary"),
]


@pytest.mark.parametrize("case", CPP_BAD, ids=[c[0] for c in CPP_BAD])
def test_op_checks_in_cpp(compiled, case):
    """The compiled ops validate their arguments themselves (they are callable without the wrapper)."""
    _, build, match = case
    x, t = build(*_ok())
    with pytest.raises(RuntimeError, match=match):
        torch.ops.gspo_mcore.token_logprob_stats(x, t, 0, 1.0, False)


def test_backward_op_checks_in_cpp(compiled):
    """token_logprob_backward names lse / grad_logp / entropy / grad_entropy in its shape and dtype errors."""
    x, t = _ok()
    lse, g = torch.zeros(4), torch.zeros(4)
    op = torch.ops.gspo_mcore.token_logprob_backward
    with pytest.raises(RuntimeError, match=r"lse must have shape \[4\]"):
        op(x, t, lse[:3], g, None, None, 0, 1.0)
    with pytest.raises(RuntimeError, match=r"grad_logp must be Float"):
        op(x, t, lse, g.double(), None, None, 0, 1.0)
    with pytest.raises(RuntimeError, match=r"entropy and grad_entropy must be given together"):
        op(x, t, lse, g, lse, None, 0, 1.0)
    with pytest.raises(RuntimeError, match=r"grad_entropy must have shape \[4\]"):
        op(x, t, lse, g, lse, g[:1], 0, 1.0)


# ---------------------------------------------------------------------------------------------------
# CPU instruction-set selection and the compiled path being used
# ---------------------------------------------------------------------------------------------------


def test_isa_selection(compiled):
    """'auto' picks the best supported ISA; unsupported or unknown names raise; 'default' always works."""
    from gspo_mcore import _C

    supported = _C.supported_cpu_isas()
    assert "default" in supported
    try:
        assert _C.set_cpu_isa("auto") == supported[0]
        assert _C.set_cpu_isa("default") == "default" == _C.cpu_isa()
        with pytest.raises(RuntimeError, match="unknown CPU ISA 'sse9'"):
            _C.set_cpu_isa("sse9")
        for name in ("avx512", "avx2"):
            if name not in supported:
                with pytest.raises(RuntimeError, match=f"does not support the '{name}'"):
                    _C.set_cpu_isa(name)
    finally:
        _C.set_cpu_isa("auto")
    assert _C.cpu_isa() == supported[0]


def _profiled_op_names(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


def test_token_logprobs_runs_the_compiled_ops(compiled):
    """With the extension, token_logprobs' forward and backward run torch.ops.gspo_mcore kernels (not the
    reference twins); under use_reference(True) they do not."""
    assert ops.HAVE_EXTENSION and ops.compiled_enabled()

    def step():
        x = torch.randn(4, 50, requires_grad=True)
        lp, H = ops.token_logprobs(x, torch.randint(0, 50, (4,)), return_entropy=True)
        (lp.sum() + H.sum()).backward()

    names = _profiled_op_names(step)
    assert {"gspo_mcore::token_logprob_stats", "gspo_mcore::token_logprob_backward"} <= names
    with ops.use_reference(True):
        assert not ops.compiled_enabled()
        names = _profiled_op_names(step)
    assert not any(n.startswith("gspo_mcore::") for n in names)


# ---------------------------------------------------------------------------------------------------
# The accuracy checker itself, and the vectorised exp
# ---------------------------------------------------------------------------------------------------


def _ordinary_case(T=64, V=1000):
    x = torch.randn(T, V) * 3  # no shifted rows: |z| and |lse| are ~10
    return x, torch.randint(0, V, (T,))


def test_row_floor_rejects_a_few_ulps_on_ordinary_rows(backend):
    """The per-row bound is tight enough to catch a kernel that is off by a few ulps on ordinary rows, even
    when the batch also holds rows shifted by +40 (a batch-wide floor would have let this through)."""
    x, targets = _ordinary_case()
    x[::8] += 40  # some shifted rows in the same batch
    lp_k = ops.token_logprobs(x, targets)
    lp_e, _ = eager_logp_entropy(x, targets, 1.0)
    lp64, _ = eager_logp_entropy(x.double(), targets, 1.0)
    z64 = x.double()
    floor = value_floor(z64, torch.logsumexp(z64, -1), targets)
    assert row_bound_use(lp_k, lp_e, lp64, floor) <= 1.0
    ordinary = torch.arange(64) % 8 != 0
    bad = lp_k.clone()
    bad[ordinary] += 8 * ulp(bad[ordinary].double(), torch.float32).float()  # 8 ulps of logp (~4e-6 at |logp|~10)
    assert row_bound_use(bad, lp_e, lp64, floor) > 1.0
    # the batch-wide floor this replaced accepted the same perturbation
    old_floor = (
        4 * EPS32 * float((z64.gather(1, targets[:, None]).squeeze(1).abs() + torch.logsumexp(z64, -1).abs()).max())
    )
    assert maxabs(bad.double() - lp64) <= 2 * maxabs(lp_e.double() - lp64) + old_floor


def test_vector_exp_accuracy_vs_float64(cpu_isa):
    """The kernels' vectorised exp is within 2 float32 ulps of float64 over its whole range [-87.3, 0]
    (and exactly 0 below): token_logprob_backward with lse = 0, grad_logp = -1, no owned target and
    temperature 1 writes d logits = exp(logits) element by element."""
    x = torch.cat([torch.linspace(-87.3, 0.0, 200003), -torch.rand(50000) * 20, torch.tensor([-87.4, -100.0])])
    T = 7
    V = x.numel() // T
    x = x[: T * V].reshape(T, V).contiguous()
    targets = torch.full((T,), -1, dtype=torch.long)  # vocab_start 0: owned by no column
    e = torch.ops.gspo_mcore.token_logprob_backward(x, targets, torch.zeros(T), -torch.ones(T), None, None, 0, 1.0)
    want = x.double().exp()
    ulps = ((e.double() - want).abs() / ulp(want, torch.float32)).flatten()
    normal = x.flatten() >= -87.3
    assert float(ulps[normal].max()) <= 2.0, float(ulps[normal].max())
    assert torch.equal(e.flatten()[~normal], torch.zeros(int((~normal).sum())))


def _forward_sums_case(dtype, V=5000):
    """Rows of V = 2 chunks of 2048 + a tail of 904 (not a multiple of any vector width) that exercise the
    forward's online sums: ordinary rows; a max that grows chunk by chunk (rescaled sums); values 80-140 below
    the max (the exponential's underflow, including 2^d for d around -127 in log2 units); -inf entries; and
    rows far from 0 (-30 / +40, where the shift by the max is rounded)."""
    T = 12
    x = torch.randn(T, V) * 3
    x[1] += torch.linspace(0.0, 25.0, V)  # the max grows in every chunk
    x[2, ::3] -= 80.0 + 60.0 * torch.rand(x[2, ::3].shape)  # underflow, across the clamp
    x[3, 100] = 0.0
    x[3, 101:] = -88.5 + torch.rand(V - 101)  # exp(-88.x): below float32's normal range
    x[4, ::7] = -math.inf
    x[5, -3:] = -math.inf  # in the tail
    x[6] -= 30.0
    x[7] += 40.0
    x[8, 4500] = 30.0  # one dominant value, in the last chunk
    x[9, :] = x[9, :].abs().neg()  # all negative
    return x.to(dtype)


@pytest.mark.parametrize("inv_temperature", [1.0, 1 / 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dname)
def test_forward_sums_accuracy_vs_float64(cpu_isa, dtype, inv_temperature):
    """token_logprob_stats' sums S = sum exp(z - m) and W = sum exp(z - m) (z - m), against float64 sums over
    the same logits, the same float32 1/tau and the same max m, per row: |err S| <= 2 eps (1 + |m|) S and
    |err W| <= 2 eps (1 + |m|) (S + sum exp(z - m) |z - m|). The |m| term is the rounding of z - m (an ulp of
    |z|, as in value_floor); on the rows near 0 (all negative, or max 0) the bound is 2-3 epsilons, which a
    polynomial off by 1e-6 fails. The max itself is exact."""
    x = _forward_sums_case(dtype)
    T = x.shape[0]
    targets = torch.zeros(T, dtype=torch.long)
    got = torch.ops.gspo_mcore.token_logprob_stats(x, targets, 0, inv_temperature, True)
    it32 = float(torch.tensor(inv_temperature, dtype=torch.float32))  # the kernels scale by 1/tau in float32
    z = x.double() * it32
    m = got[:, MAX].double()
    assert torch.equal(got[:, MAX], (x.float() * it32).amax(dim=1))
    d = z - m[:, None]
    e = d.exp()
    s64 = e.sum(1)
    w64 = torch.where(e > 0, e * d, 0.0).sum(1)
    wabs = torch.where(e > 0, e * d.abs(), 0.0).sum(1)
    floor = 2 * EPS32 * (1 + m.abs())
    use_s = ((got[:, SUMEXP].double() - s64).abs() / (floor * s64)).max()
    assert float(use_s) <= 1.0, float(use_s)
    use_w = ((got[:, XSUM].double() - w64).abs() / (floor * (s64 + wabs))).max()
    assert float(use_w) <= 1.0, float(use_w)


def test_bfloat16_max_orders_signs_and_nonfinite(cpu_isa):
    """The bfloat16 forward finds each chunk's max from the bits read as 16-bit integers (logprobs_isa_impl.h);
    the order of signs, zeros and infinities must come out as torch's max: all-negative rows (the value of least
    magnitude), -0 beside +0, -inf, +inf, extremes in the vector part and in the tail. NaN is ignored by the max
    (the sums carry it into the result instead)."""
    V = 3000  # one chunk of 2048 (vector loop) and one of 952 (vector loop and a tail of 24 / 8 / 0 values)
    T = 10
    x = -(torch.rand(T, V) * 50 + 1)
    x[1, 2047] = -0.5  # all negative, extreme at the end of a chunk
    x[2, V - 1] = -0.25  # all negative, extreme in the tail
    x[3, :] = -0.0
    x[3, 17] = 0.0
    x[4, :] = -math.inf
    x[5, :] = -math.inf
    x[5, V - 2] = -1e30  # a finite value among -inf, in the tail
    x[6, 5] = math.inf
    x[7, V - 1] = 3.0  # the only positive value, in the tail
    x[8, :] = torch.randn(V) * 3
    x[9, 100] = math.nan
    x[9, 200] = 7.0
    x = x.to(torch.bfloat16)
    got = torch.ops.gspo_mcore.token_logprob_stats(x, torch.zeros(T, dtype=torch.long), 0, 1.0, False)
    xf = x.float()
    want = torch.where(xf.isnan(), -math.inf, xf).amax(dim=1)
    assert torch.equal(got[:, MAX], want), (got[:, MAX], want)  # (-0 == +0: either zero is the max of row 3)
    # +inf (row 6) and NaN (row 9) make the sums NaN; the rest are exact here: each value is 0 or an exp of 0
    assert torch.isnan(got[[6, 9], SUMEXP]).all() and not torch.isnan(got[[0, 1, 2, 3, 4, 5, 7, 8], SUMEXP]).any()
    assert got[3, SUMEXP] == V and got[4, SUMEXP] == 0 and got[5, SUMEXP] == 1  # -1e30 among -inf: exp(0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dname)
def test_narrow_gradient_exp_accuracy_vs_float64(cpu_isa, dtype):
    """The cheaper exp of the bfloat16 / float16 gradient (vexp_narrow) is within 4e-6 relative of float64
    before the gradient is rounded to its dtype: every element is within half an ulp of that dtype plus 4e-6
    relative of exp in float64 (a degree-3 polynomial, 1e-4, fails this), and exactly 0 below -87.3 (as are
    -inf logits). Same route as the float32 test: lse = 0, grad_logp = -1, no owned target, temperature 1."""
    lo = -15.0 if dtype == torch.float16 else -87.3  # float16 holds exp(x) only down to ~6e-8
    x = torch.cat([torch.linspace(lo, 0.0, 100003), -torch.rand(50000) * 10, torch.tensor([-87.4, -100.0])])
    x = torch.cat([x.to(dtype), torch.tensor([-float("inf")], dtype=dtype)])
    T = 7
    V = x.numel() // T
    x = x[: T * V].reshape(T, V).contiguous()
    targets = torch.full((T,), -1, dtype=torch.long)
    e = torch.ops.gspo_mcore.token_logprob_backward(x, targets, torch.zeros(T), -torch.ones(T), None, None, 0, 1.0)
    assert e.dtype == dtype
    want = x.double().exp()
    bound = 0.5 * torch.maximum(ulp(want, dtype), ulp(e.double(), dtype)) + 4e-6 * want
    normal = (x >= -87.3) & (want >= torch.finfo(dtype).tiny)
    err = (e.double() - want).abs()
    assert bool((err[normal] <= bound[normal]).all()), float((err / bound)[normal].max())
    below = x < -87.3
    assert torch.equal(e[below].double(), torch.zeros(int(below.sum()), dtype=torch.float64))


# ---------------------------------------------------------------------------------------------------
# inplace_backward=True: the gradient is written into the logits' buffer
# ---------------------------------------------------------------------------------------------------


def _inplace_pair(dtype, T=23, V=1003, temp=0.8, entropy=False):
    """(out-of-place logp, H, grad) and (in-place logp, H, grad) for the same logits, upstream w."""
    x0, targets = make_case(T, V, torch.float32, "contiguous")[0].detach(), None
    x0 = x0.to(dtype)
    targets = torch.randint(0, V, (T,))
    w = torch.randn(T)
    res = []
    for inplace in (False, True):
        leaf = x0.clone().requires_grad_(True)
        logits = leaf * 1  # a non-leaf, as the LM head's output is
        out = ops.token_logprobs(logits, targets, temperature=temp, return_entropy=entropy, inplace_backward=inplace)
        lp, H = out if entropy else (out, None)
        loss = (lp * w).sum()
        if entropy == "loss":
            loss = loss + 0.3 * (H * w.flip(0)).sum()
        loss.backward()
        res.append((lp.detach(), H.detach() if entropy else None, leaf.grad, logits))
    return res, x0, targets, w


@pytest.mark.parametrize("entropy", [False, "logged", "loss"], ids=["noent", "ent-logged", "ent-loss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dname)
def test_inplace_backward_matches_out_of_place(backend, dtype, entropy):
    """Value and gradient of inplace_backward=True equal the out-of-place path bit for bit (the same
    forward statistics, the same backward row kernel, written over the logits instead of a new buffer),
    with the entropy logged or in the loss; the bf16 gradient is within one bf16 ulp of float64. The
    logits buffer now holds that gradient."""
    (a, b), x0, targets, w = _inplace_pair(dtype, entropy=entropy)
    assert torch.equal(a[0], b[0])
    if entropy:
        assert torch.equal(a[1], b[1])
    assert torch.equal(b[2], a[2])
    if dtype == torch.bfloat16 and not entropy:
        _, _, truth, _, _ = fp64_truth(x0, targets, 0.8, w.double(), None)
        err = (b[2].double() - truth).abs()
        assert bool((err <= ulp(truth, dtype) + 1e-7).all()), float((err / ulp(truth, dtype)).max())
    assert b[2].dtype == dtype
    assert torch.equal(b[3].detach(), b[2])  # the gradient was formed in the logits' own buffer
    assert not torch.equal(a[3].detach(), a[2])  # (the out-of-place path leaves the logits alone)


def test_inplace_backward_guards(backend):
    """inplace_backward=True refuses logits it must not overwrite (naming the reason), leaves logits alone
    where nothing is differentiated, keeps them readable until its backward, and a consumer that reads
    them after that backward, or a change to them before it, raises torch's version error."""
    x = torch.randn(6, 50)
    t = torch.randint(0, 50, (6,))
    leaf = x.clone().requires_grad_(True)
    with pytest.raises(ValueError, match="leaf tensor"):
        ops.token_logprobs(leaf, t, inplace_backward=True)
    with pytest.raises(ValueError, match="must be contiguous"):
        ops.token_logprobs((leaf * 1).t().contiguous().t(), t, inplace_backward=True)
    wide = leaf * 1
    wide2 = torch.cat([wide, wide], 1)
    with pytest.raises(ValueError, match="view of part"):
        ops.token_logprobs(wide2[:, :50].contiguous()[:3], t[:3], inplace_backward=True)
    # no autograd recording: nothing is written
    y = x.clone()
    with torch.no_grad():
        lp = ops.token_logprobs(y, t, inplace_backward=True)
    assert torch.equal(y, x) and torch.equal(lp, ops.token_logprobs(x, t))
    # a view spanning the whole tensor (e.g. [S, 1, V] -> [S, V]) is accepted
    s3 = (leaf * 1)[:, None, :]
    ops.token_logprobs(s3.reshape(6, 50), t, inplace_backward=True).sum().backward()
    # the logits are intact after the forward, and may be used again (here by a loss term that saves them,
    # whose backward runs before this op's: autograd runs the later node first)
    logits = leaf * 1
    lp = ops.token_logprobs(logits, t, inplace_backward=True)
    assert torch.equal(logits.detach(), x)
    leaf.grad = None
    (lp.sum() + (logits * logits).sum()).backward()
    want = torch.autograd.grad(ops.token_logprobs(leaf * 1, t).sum() + (leaf * leaf).sum(), leaf)[0]
    torch.testing.assert_close(leaf.grad, want, rtol=1e-5, atol=1e-6)
    # another consumer saved the logits BEFORE this op (its backward runs after ours): the version check fires
    logits = leaf * 1
    other = (logits * logits).sum()
    lp = ops.token_logprobs(logits, t, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (lp.sum() + other).backward()
    # the logits changed between the forward and the backward
    logits = leaf * 1
    lp = ops.token_logprobs(logits, t, inplace_backward=True)
    with torch.no_grad():
        logits.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        lp.sum().backward()
    # no second backward
    logits = leaf * 1
    lp = ops.token_logprobs(logits, t, inplace_backward=True)
    lp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="cannot run again"):
        lp.sum().backward()


def test_grad_buffer_cache_reuses_and_frees(compiled):
    """The out-of-place backward's large gradient buffer is kept when freed and reused by the next call of a
    fitting size (same memory, correct values: the buffer is fully rewritten); a call of another size gets a
    fresh buffer; turning the cache off frees what it holds."""
    ops.set_grad_buffer_cache(True)
    T, V = 64, 40000  # 10 MB of float32: above the 4 MB threshold of the huge-page buffers
    x = torch.randn(T, V)
    t = torch.randint(0, V, (T,))
    lse = torch.logsumexp(x, -1)
    g = torch.randn(T)
    bwd = torch.ops.gspo_mcore.token_logprob_backward
    first = bwd(x, t, lse, g, None, None, 0, 1.0)
    ptr, want = first.data_ptr(), first.clone()
    del first
    assert ops.grad_buffer_cache_bytes() >= T * V * 4
    again = bwd(x, t, lse, g, None, None, 0, 1.0)
    assert again.data_ptr() == ptr and torch.equal(again, want)
    assert ops.grad_buffer_cache_bytes() == 0  # taken
    del again
    bigger = bwd(
        torch.randn(4 * T, V), torch.randint(0, V, (4 * T,)), torch.zeros(4 * T), torch.randn(4 * T), None, None, 0, 1.0
    )
    assert bigger.data_ptr() != ptr
    del bigger
    ops.set_grad_buffer_cache(False)
    assert ops.grad_buffer_cache_bytes() == 0
    ops.set_grad_buffer_cache(True)
