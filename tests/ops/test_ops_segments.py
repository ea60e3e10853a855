"""Per-sequence ops over packed (THD) segments: segment_sum / segment_mean / segment_expand and GSPO's
sequence terms, against their pure-torch twins and hand computations, values and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from gspo_mcore import ops
from gspo_mcore.ops import reference

# Segment lengths: empty sequences (repeated offsets), one-token sequences, a long one, T=0 with B>0,
# and B=0 (cu_seqlens = [0]).
LENGTHS = {
    "mixed": [3, 1, 0, 5, 0, 0, 2, 1],
    "one-token": [1],
    "long": [300, 1, 77],
    "all-empty": [0, 0, 0],
    "no-sequences": [],
}
MASKS = ["float", "bool", "int", "none"]
VALUE_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def cu_of(lengths, dtype=torch.int64):
    return torch.tensor([0] + list(torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()), dtype=dtype)


def make_mask(lengths, kind):
    """A {0,1} loss mask; the 4th sequence (if any) has no counted token at all."""
    T = sum(lengths)
    m = (torch.rand(T) < 0.7).float()
    cu = cu_of(lengths)
    if len(lengths) > 3:
        m[cu[3] : cu[4]] = 0.0
    if len(lengths) > 1 and lengths[1] == 1:
        m[cu[1]] = 1.0  # a one-token sequence that counts
    if kind == "bool":
        return m.bool()
    if kind == "int":
        return m.long()
    if kind == "none":
        return None
    return m


def hand_segment_sum(values, mask, lengths):
    """The definition, in float64, with Python loops: masked-out values never count."""
    out, t = [], 0
    for n in lengths:
        s = 0.0
        for k in range(t, t + n):
            m = 1.0 if mask is None else float(mask[k])
            if m != 0:
                s += m * float(values[k])
        out.append(s)
        t += n
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("vdtype", VALUE_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64], ids=["cu32", "cu64"])
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("name", list(LENGTHS))
def test_segment_sum(impl, name, mask_kind, cu_dtype, vdtype):
    """segment_sum equals the definition (float64 loop) and its twin; its gradient puts each sequence's
    upstream gradient on that sequence's counted tokens (0 elsewhere), in the values' dtype."""
    lengths = LENGTHS[name]
    T = sum(lengths)
    values = (torch.randn(T) * 3).to(vdtype).requires_grad_(True)
    mask = make_mask(lengths, mask_kind)
    cu = cu_of(lengths, cu_dtype)
    out = ops.segment_sum(values, cu, mask)
    assert out.dtype == torch.float32 and out.shape == (len(lengths),)
    want = hand_segment_sum(values.detach().double(), mask, lengths)
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)
    m32 = torch.ones(T) if mask is None else mask.float()
    twin = reference.segment_sum(values.detach().float(), m32, cu)
    torch.testing.assert_close(out, twin, rtol=1e-6, atol=1e-6)

    w = torch.randn(len(lengths))
    (out * w).sum().backward()
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))
    expected = (m32 * w[seg]) if T else torch.zeros(0)
    assert values.grad.dtype == vdtype
    torch.testing.assert_close(values.grad.float(), expected.to(vdtype).float(), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["mixed", "long", "all-empty", "no-sequences"])
def test_segment_mean(impl, name):
    """segment_mean is the masked mean per sequence (0 for a sequence with no counted token) and the
    counted-token counts; d mean_b / d v_t = mask_t / count_b."""
    lengths = LENGTHS[name]
    T = sum(lengths)
    values = torch.randn(T, requires_grad=True)
    mask = make_mask(lengths, "float")
    cu = cu_of(lengths)
    mean, count = ops.segment_mean(values, cu, mask)
    sums = hand_segment_sum(values.detach().double(), mask, lengths)
    counts = hand_segment_sum(torch.ones(T, dtype=torch.float64), mask, lengths)
    torch.testing.assert_close(count.double(), counts, rtol=0, atol=0)
    want = torch.where(counts > 0, sums / counts.clamp(min=1), 0.0)
    torch.testing.assert_close(mean.double(), want, rtol=1e-6, atol=1e-6)
    assert not count.requires_grad
    w = torch.randn(len(lengths))
    (mean * w).sum().backward()
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))
    expected = mask * (w / counts.float().clamp(min=1))[seg] if T else torch.zeros(0)
    torch.testing.assert_close(values.grad, expected, rtol=1e-6, atol=1e-7)


def test_masked_nan_never_counts(impl):
    """A NaN/inf value on a masked-out token changes no sum and gets gradient exactly 0 (not NaN); a NaN on
    a counted token makes its own sequence's sum NaN and no other."""
    lengths = [3, 4, 2]
    cu = cu_of(lengths)
    mask = torch.tensor([1, 0, 1, 1, 1, 0, 1, 1, 1], dtype=torch.float32)
    clean = torch.randn(9)
    dirty = clean.clone()
    dirty[1], dirty[5] = math.nan, math.inf  # both masked out
    outs = []
    for v in (clean, dirty):
        v = v.clone().requires_grad_(True)
        s = ops.segment_sum(v, cu, mask)
        s.sum().backward()
        outs.append((s.detach(), v.grad))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1]) and outs[1][1][1] == 0 and outs[1][1][5] == 0
    counted_nan = clean.clone()
    counted_nan[4] = math.nan  # counted, in sequence 1
    s = ops.segment_sum(counted_nan, cu, mask)
    assert torch.isnan(s[1]) and torch.isfinite(s[[0, 2]]).all()
    mean, _ = ops.segment_mean(dirty, cu, mask)
    assert torch.isfinite(mean).all()


def test_segment_expand_op(compiled):
    """segment_expand (segment_sum's backward) equals its twin: mask[t] * grad[segment(t)]."""
    lengths = LENGTHS["mixed"]
    cu = cu_of(lengths, torch.int32)
    mask = make_mask(lengths, "float")
    grad = torch.randn(len(lengths))
    got = torch.ops.gspo_mcore.segment_expand(grad, mask, cu)
    want = reference.segment_expand(grad, mask, cu)
    assert torch.equal(got, want)


def test_all_reduce_sum_without_group_is_identity():
    """Without a context-parallel group the partial sums already are the sums: returned as they are."""
    a, b = torch.randn(3), torch.randn(3)
    out = ops.all_reduce_sum(a, b)
    assert out[0] is a and out[1] is b


# ---------------------------------------------------------------------------------------------------
# gspo_sequence_terms
# ---------------------------------------------------------------------------------------------------

EPS_LOW, EPS_HIGH = 3e-4, 4e-4


def sequence_case():
    """Per-sequence (mean log-ratio, count, advantage, expected clipped): every branch of the clip, with
    ratios well away from the bounds so that float32 vs float64 cannot flip a decision."""
    rows = [
        (+0.01, 4, +1.5, True),  # s > 1 + eps_high, A > 0: clipped
        (+0.01, 3, -0.7, False),  # s > 1 + eps_high, A < 0: not clipped (pessimistic term is the raw one)
        (-0.01, 5, -1.2, True),  # s < 1 - eps_low,  A < 0: clipped
        (-0.01, 2, +0.4, False),  # s < 1 - eps_low,  A > 0: not clipped
        (+1e-4, 7, +2.0, False),  # inside the range
        (-1e-4, 1, -2.0, False),  # inside the range, one token
        (+0.3, 6, 0.0, False),  # A = 0: contributes 0, never clipped
        (0.0, 0, +1.0, False),  # no counted token: (0, 1, 0, 0)
        (-0.2, 9, -0.1, True),
    ]
    mean = torch.tensor([r[0] for r in rows], dtype=torch.float64)
    count = torch.tensor([float(r[1]) for r in rows])
    seq_sum = (mean * count.double()).float()
    adv = torch.tensor([r[2] for r in rows])
    clipped = torch.tensor([r[3] for r in rows])
    return seq_sum, count, adv, clipped


def hand_terms(seq_sum, count, adv):
    """The spec, per sequence, in float64: term = -min(s A, clip(s) A), d term / d seq_sum."""
    terms, ratios, coefs = [], [], []
    lo, hi = 1 - EPS_LOW, 1 + EPS_HIGH
    for s_sum, n, a in zip(seq_sum.tolist(), count.tolist(), adv.tolist()):
        if n == 0:
            terms.append(0.0), ratios.append(1.0), coefs.append(0.0)
            continue
        s = math.exp(s_sum / n)
        clip = (a > 0 and s > hi) or (a < 0 and s < lo)
        terms.append(-min(s * a, min(max(s, lo), hi) * a))
        ratios.append(s)
        coefs.append(0.0 if clip else -a * s / n)
    f = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    return f(terms), f(ratios), f(coefs)


def test_gspo_sequence_terms(impl):
    """term, ratio, clipped flag and coef equal the spec in float64 for every clip branch (both signs of
    A, inside the range, A=0, no counted token); autograd of term w.r.t. seq_logratio_sum is coef."""
    seq_sum, count, adv, clipped = sequence_case()
    x = seq_sum.clone().requires_grad_(True)
    term, ratio, clip, coef = ops.gspo_sequence_terms(x, count, adv, EPS_LOW, EPS_HIGH)
    t64, r64, c64 = hand_terms(seq_sum, count, adv)
    assert torch.equal(clip, clipped.float())
    torch.testing.assert_close(term.double(), t64, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ratio.double(), r64, rtol=1e-6, atol=0)
    torch.testing.assert_close(coef.double(), c64, rtol=1e-6, atol=1e-8)
    for out in (ratio, clip, coef):
        assert not out.requires_grad
    w = torch.randn(len(adv))
    (term * w).sum().backward()
    torch.testing.assert_close(x.grad, w * coef, rtol=1e-6, atol=1e-8)


def test_gspo_sequence_terms_compiled_vs_twin(compiled):
    """The compiled op and its twin agree on every output and on the gradient."""
    seq_sum, count, adv, _ = sequence_case()
    outs = []
    for use_ref in (False, True):
        x = seq_sum.clone().requires_grad_(True)
        with ops.use_reference(use_ref):
            res = ops.gspo_sequence_terms(x, count, adv, EPS_LOW, EPS_HIGH)
        res[0].sum().backward()
        outs.append((*res, x.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def test_gspo_sequence_terms_nan(impl):
    """A NaN sequence log-ratio or advantage gives a NaN term (fmin must not hide it), is not counted as
    clipped, and leaves the other sequences alone."""
    seq_sum = torch.tensor([math.nan, 0.02, 0.0])
    count = torch.tensor([3.0, 2.0, 1.0])
    adv = torch.tensor([1.0, 1.0, math.nan])
    term, ratio, clip, _ = ops.gspo_sequence_terms(seq_sum, count, adv, EPS_LOW, EPS_HIGH)
    assert torch.isnan(term[0]) and torch.isnan(term[2]) and torch.isfinite(term[1])
    assert clip.tolist() == [0.0, 1.0, 0.0]


def test_gspo_sequence_terms_errors(impl):
    """Wrong shapes, lengths, devices and types raise errors naming the argument."""
    s, n, a = torch.zeros(3), torch.ones(3), torch.ones(3)
    with pytest.raises(ValueError, match="seq_logratio_sum must be 1-D"):
        ops.gspo_sequence_terms(s[None], n, a, EPS_LOW, EPS_HIGH)
    with pytest.raises(ValueError, match="seq_token_count has 2 entries but seq_logratio_sum has 3"):
        ops.gspo_sequence_terms(s, n[:2], a, EPS_LOW, EPS_HIGH)
    with pytest.raises(ValueError, match="advantages has 4 entries but seq_logratio_sum has 3"):
        ops.gspo_sequence_terms(s, n, torch.ones(4), EPS_LOW, EPS_HIGH)
    with pytest.raises(ValueError, match="advantages must be 1-D"):
        ops.gspo_sequence_terms(s, n, a[:, None], EPS_LOW, EPS_HIGH)
    with pytest.raises(ValueError, match="advantages is on meta but must be on cpu"):
        ops.gspo_sequence_terms(s, n, a.to("meta"), EPS_LOW, EPS_HIGH)
    with pytest.raises(TypeError, match="seq_token_count must be a torch.Tensor"):
        ops.gspo_sequence_terms(s, [1, 1, 1], a, EPS_LOW, EPS_HIGH)


# ---------------------------------------------------------------------------------------------------
# opcheck
# ---------------------------------------------------------------------------------------------------


def _segment_samples(requires_grad):
    a = (
        torch.randn(9, requires_grad=requires_grad),
        torch.tensor([1.0, 0, 1, 1, 1, 0, 1, 1, 1]),
        torch.tensor([0, 3, 3, 7, 9], dtype=torch.int32),
    )
    b = (torch.randn(0, requires_grad=requires_grad), torch.zeros(0), torch.zeros(3, dtype=torch.int64))
    c = (torch.randn(5, requires_grad=requires_grad), torch.ones(5), torch.tensor([0, 1, 2, 3, 4, 5]))
    return [a, b, c]


@pytest.mark.parametrize("i", [0, 1, 2])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_segment_sum(compiled, requires_grad, i):
    """segment_sum's schema, fake kernel and registered autograd (segment_expand backward) are consistent."""
    torch.library.opcheck(torch.ops.gspo_mcore.segment_sum.default, _segment_samples(requires_grad)[i])


@pytest.mark.parametrize("i", [0, 1, 2])
def test_opcheck_segment_expand(compiled, i):
    """segment_expand is registered consistently (schema, fake kernel), empty sequences and T=0 included."""
    _, mask, cu = _segment_samples(False)[i]
    torch.library.opcheck(torch.ops.gspo_mcore.segment_expand.default, (torch.randn(cu.shape[0] - 1), mask, cu))


@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_gspo_sequence_terms(compiled, requires_grad):
    """gspo_sequence_terms' schema, fake kernel and registered autograd (term only) are consistent."""
    seq_sum, count, adv, _ = sequence_case()
    torch.library.opcheck(
        torch.ops.gspo_mcore.gspo_sequence_terms.default,
        (seq_sum.requires_grad_(requires_grad), count, adv, EPS_LOW, EPS_HIGH),
    )
    torch.library.opcheck(
        torch.ops.gspo_mcore.gspo_sequence_terms.default,
        (torch.zeros(0, requires_grad=requires_grad), torch.zeros(0), torch.zeros(0), 0.2, 0.27),
    )


# ---------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------

CU_BAD = [
    ("not-starting-at-0", torch.tensor([1, 3, 6]), ValueError, r"cu_seqlens must start at 0, got 1"),
    (
        "not-monotone",
        torch.tensor([0, 4, 2, 6]),
        ValueError,
        r"cu_seqlens must be non-decreasing, but cu_seqlens\[1\]=4 > cu_seqlens\[2\]=2",
    ),
    ("not-ending-at-T", torch.tensor([0, 2, 5]), ValueError, r"cu_seqlens must end at the number of tokens T=6, got 5"),
    ("past-T", torch.tensor([0, 2, 7]), ValueError, r"cu_seqlens must end at the number of tokens T=6, got 7"),
    ("float", torch.tensor([0.0, 3.0, 6.0]), TypeError, r"cu_seqlens must have dtype in \(int32, int64\)"),
    ("int16", torch.tensor([0, 3, 6], dtype=torch.int16), TypeError, r"cu_seqlens must have dtype"),
    ("2-D", torch.tensor([[0, 3, 6]]), ValueError, r"cu_seqlens must be 1-D"),
    ("empty", torch.zeros(0, dtype=torch.long), ValueError, r"cu_seqlens must have B\+1 >= 1 entries"),
    ("device", torch.tensor([0, 3, 6], device="meta"), ValueError, r"cu_seqlens is on meta but must be on cpu"),
]


@pytest.mark.parametrize("fn", ["segment_sum", "segment_mean"])
@pytest.mark.parametrize("case", CU_BAD, ids=[c[0] for c in CU_BAD])
def test_bad_cu_seqlens(impl, case, fn):
    """Bad offsets raise the documented error naming cu_seqlens, before any kernel runs."""
    _, cu, exc, match = case
    with pytest.raises(exc, match=match):
        getattr(ops, fn)(torch.randn(6), cu, torch.ones(6))


VALUES_BAD = [
    ("values-2d", lambda: (torch.randn(2, 3), torch.tensor([0, 6]), None), ValueError, r"values must be 1-D"),
    ("values-int", lambda: (torch.arange(6), torch.tensor([0, 6]), None), TypeError, r"values must have dtype"),
    ("values-list", lambda: ([1.0] * 6, torch.tensor([0, 6]), None), TypeError, r"values must be a torch.Tensor"),
    (
        "mask-length",
        lambda: (torch.randn(6), torch.tensor([0, 6]), torch.ones(5)),
        ValueError,
        r"mask has 5 entries but the token dimension \(T\) has 6",
    ),
    ("mask-2d", lambda: (torch.randn(6), torch.tensor([0, 6]), torch.ones(6, 1)), ValueError, r"mask must be 1-D"),
    (
        "mask-device",
        lambda: (torch.randn(6), torch.tensor([0, 6]), torch.ones(6, device="meta")),
        ValueError,
        r"mask is on meta but must be on cpu",
    ),
]


@pytest.mark.parametrize("fn", ["segment_sum", "segment_mean"])
@pytest.mark.parametrize("case", VALUES_BAD, ids=[c[0] for c in VALUES_BAD])
def test_bad_values_and_mask(impl, case, fn):
    """Bad values / mask raise the documented error naming the argument (``mask``, as in the signature)."""
    _, build, exc, match = case
    v, cu, m = build()
    with pytest.raises(exc, match=match):
        getattr(ops, fn)(v, cu, m)


def test_segment_op_checks_in_cpp(compiled):
    """The compiled segment ops re-check offsets and dtypes themselves (callable without the wrapper)."""
    v, m = torch.randn(6), torch.ones(6)
    op = torch.ops.gspo_mcore.segment_sum
    with pytest.raises(RuntimeError, match="cu_seqlens must start at 0"):
        op(v, m, torch.tensor([1, 6]))
    with pytest.raises(RuntimeError, match="cu_seqlens must be non-decreasing"):
        op(v, m, torch.tensor([0, 5, 4, 6]))
    with pytest.raises(RuntimeError, match="cu_seqlens must end at the number of tokens T=6"):
        op(v, m, torch.tensor([0, 5]))
    with pytest.raises(RuntimeError, match="cu_seqlens must be int32 or int64"):
        op(v, m, torch.tensor([0.0, 6.0]))
    with pytest.raises(RuntimeError, match="values must be Float"):
        op(v.double(), m, torch.tensor([0, 6]))
    with pytest.raises(RuntimeError, match="values has 6 tokens but mask has 5"):
        op(v, m[:5], torch.tensor([0, 6]))
    with pytest.raises(RuntimeError, match="grad has 2 entries but cu_seqlens describes 1 sequences"):
        torch.ops.gspo_mcore.segment_expand(torch.ones(2), m, torch.tensor([0, 6]))
    with pytest.raises(RuntimeError, match="seq_token_count has 2 entries"):
        torch.ops.gspo_mcore.gspo_sequence_terms(torch.ones(3), torch.ones(2), torch.ones(3), 0.1, 0.1)
    with pytest.raises(RuntimeError, match="advantages must be Float"):
        torch.ops.gspo_mcore.gspo_sequence_terms(torch.ones(3), torch.ones(3), torch.ones(3).double(), 0.1, 0.1)


@pytest.mark.parametrize("use_ref", [True, False])
def test_gspo_sequence_terms_inf_ratio_with_zero_advantage_is_nan(use_ref):
    """s = exp(1000) = inf with A = 0: inf * 0 is NaN, and fmin must not hide it (the loss must not look fine)."""
    from gspo_mcore import ops

    with ops.use_reference(use_ref):
        term, ratio, clipped, coef = ops.gspo_sequence_terms(
            torch.tensor([1000.0, 0.1]), torch.tensor([1.0, 1.0]), torch.tensor([0.0, 1.0]), 3e-4, 4e-4
        )
    assert torch.isinf(ratio[0]) and torch.isnan(term[0])
    assert torch.isfinite(term[1])
