"""CUDA kernels of gspo_mcore (csrc/cuda/*.cu) against the CPU kernels (csrc/*_cpu.cpp), op by op.

The CPU ops are the specification: each test builds the inputs on the CPU, runs the same op on a CUDA copy,
and compares. Shapes are chosen to hit every code path of the CUDA kernels: rows owned by a warp
(V <= 2048) or by a block (V > 2048); a row split into a scalar head (up to 7 elements before the first
16-byte boundary), 16-byte vectors (two per thread per step plus a leftover one) and a scalar tail; odd row
strides and offsets (a slice of a wider tensor); targets owned and not owned by this vocabulary slice.

Tolerances (why they are what they are):
- max, target value and owned flag: the CUDA kernel computes z = logit * inv_temperature with the same single
  float multiply as the CPU kernel, so these are compared exactly.
- sum-exp and x-sum: both sides sum V float terms exp(z - max) (resp. exp(z - max) (z - max)), but in a
  different order (CPU: float lanes flushed to double every 2048 elements; CUDA: per-thread float partials,
  rescaled when a thread's running max grows, merged by a tree) and with different exp implementations
  (CPU: a Cephes polynomial, CUDA: expf, each within ~2 ulp). All terms of each sum have the same sign, so the
  relative error of either is a few float ulps times log2(V) at worst: rtol 5e-5 is ~10x that margin.
- d logits: each element is one expression in float on both sides (exp, a few products), so the float values
  agree to a few ulps relative, except where the entropy factor (lp + H) cancels, where the absolute error is
  bounded by ~1e-6 * max|d|. The result is then rounded to the logits' dtype, where 1 ulp of a difference
  can flip one rounding step: 2^-8 (bf16) or 2^-11 (fp16) relative. Hence rtol 1e-4 / 1e-2 / 2e-3 for float32
  / bfloat16 / float16 and atol 1e-5 * max|d| (covers the cancellation and fp16 subnormals).
- segment_sum: both sides accumulate exact float*float products in double and round once to float, so they
  agree except in the ~1e-8-probability case of a double sum landing on a float rounding boundary: rtol 1e-6.
- segment_expand: one float multiply on both sides: exact.
- gspo_sequence_terms: CUDA expf vs glibc expf (both within 2 ulp): rtol 1e-6; the clipped flag exactly.

The GPU tests are marked ``gpu`` and skipped without a CUDA device.
"""

from __future__ import annotations

import itertools
import os
import shutil

import gspo_mcore._C as _C  # noqa: F401  (registers torch.ops.gspo_mcore)
import pytest
import torch

from gspo_mcore.ops import reference

DEVICE = "cuda"
ops = torch.ops.gspo_mcore

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def gpu(fn):
    return pytest.mark.gpu(requires_cuda(fn))


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# 1: a single column; 7: head/tail only; 1000: warp-owned rows; 2048/2049: both sides of the warp/block switch;
# 32003: a vocabulary-parallel slice that is not a multiple of 8.
VOCABS = [1, 7, 1000, 2048, 2049, 32003]
GRAD_RTOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _logits(T: int, V: int, dtype: torch.dtype, layout: str, gen: torch.Generator, scale: float = 4.0):
    """CPU logits [T, V]. 'contiguous': a plain tensor; 'strided': a column slice (offset 1, row stride V+5)
    of a wider tensor, so rows start at odd element offsets; 'offset3': offset 3, row stride V+8."""
    if layout == "contiguous":
        return (torch.randn(T, V, generator=gen) * scale).to(dtype)
    off, extra = (1, 5) if layout == "strided" else (3, 8)
    wide = (torch.randn(T, V + extra, generator=gen) * scale).to(dtype)
    return wide[:, off : off + V]


def _to_device(x: torch.Tensor) -> torch.Tensor:
    """A device copy with the same strides and storage offset as the CPU tensor (slices stay slices)."""
    if x.is_contiguous():
        return x.to(DEVICE)
    base = x.as_strided((x.untyped_storage().nbytes() // x.element_size(),), (1,), 0).to(DEVICE)
    return base.as_strided(x.shape, x.stride(), x.storage_offset())


def _targets(T: int, V: int, vocab_start: int, gen: torch.Generator) -> torch.Tensor:
    """Targets around the slice [vocab_start, vocab_start + V): mostly owned, some just outside, the slice
    edges always included, and one far-away id (another rank's)."""
    t = torch.randint(vocab_start - 3, vocab_start + V + 3, (T,), generator=gen)
    t[0] = vocab_start + V - 1
    if T > 1:
        t[1] = vocab_start
    if T > 2:
        t[2] = vocab_start + V  # first id of the next slice: not owned
    if T > 3:
        t[3] = 10**9
    return t


def _check_stats(got: torch.Tensor, want: torch.Tensor, ignore_max_rows=None):
    got = got.cpu()
    assert got.dtype == torch.float32 and got.shape == want.shape
    g, w = got.clone(), want.clone()
    if ignore_max_rows is not None:  # rows with a NaN: the max column is unspecified there
        g[ignore_max_rows, 0] = 0.0
        w[ignore_max_rows, 0] = 0.0
    torch.testing.assert_close(g[:, [0, 3, 4]], w[:, [0, 3, 4]], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(g[:, 1:3], w[:, 1:3], rtol=5e-5, atol=1e-6, equal_nan=True)


def _check_grad(got: torch.Tensor, want: torch.Tensor, upstream: float = 0.0):
    """``upstream``: max |g| * it of the rows. Where a row's target has p ~ 1 (V = 1, say), its exact gradient
    g it (1 - p) is 0 and each kernel gives the rounding of p instead (the GPU's expf 0, the CPU's 3e-9 in
    float32, up to 4e-6 relative with the narrow dtypes' cheaper exp): that floor, not max |want|, bounds it."""
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    scale = want.float().abs().nan_to_num(0.0, 0.0, 0.0).max().item()
    rounding = (4 * torch.finfo(torch.float32).eps if want.dtype == torch.float32 else 8e-6) * upstream
    torch.testing.assert_close(
        got.float(), want.float(), rtol=GRAD_RTOL[want.dtype], atol=1e-5 * scale + rounding + 1e-30, equal_nan=True
    )


def _lse_entropy(stats: torch.Tensor):
    lse = stats[:, 0] + stats[:, 1].log()
    entropy = (lse - stats[:, 0]) - stats[:, 2] / stats[:, 1]
    return lse.contiguous(), entropy.contiguous()


# ---------------------------------------------------------------------------------------------------------
# token_logprob_stats / token_logprob_backward


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("V", VOCABS)
@pytest.mark.parametrize("layout", ["contiguous", "strided", "offset3"])
@pytest.mark.parametrize("T", [1, 37])
def test_stats_and_backward_match_cpu(dtype, V, layout, T):
    gen = torch.Generator().manual_seed(V * 131 + T)
    x = _logits(T, V, dtype, layout, gen)
    vocab_start = 5000
    tg = _targets(T, V, vocab_start, gen)
    xd, tgd = _to_device(x), tg.to(DEVICE)
    assert xd.stride() == x.stride()
    for with_entropy, it in [(False, 1.0), (True, 1.0 / 0.7)]:
        want = ops.token_logprob_stats(x, tg, vocab_start, it, with_entropy)
        got = ops.token_logprob_stats(xd, tgd, vocab_start, it, with_entropy)
        _check_stats(got, want)

        lse, entropy = _lse_entropy(want)
        g = torch.randn(T, generator=gen)
        h, gh = (entropy, torch.randn(T, generator=gen)) if with_entropy else (None, None)
        want_d = ops.token_logprob_backward(x, tg, lse, g, h, gh, vocab_start, it)
        got_d = ops.token_logprob_backward(
            xd,
            tgd,
            lse.to(DEVICE),
            g.to(DEVICE),
            None if h is None else h.to(DEVICE),
            None if gh is None else gh.to(DEVICE),
            vocab_start,
            it,
        )
        _check_grad(got_d, want_d, upstream=g.abs().max().item() * it)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_full_vocab_rows(dtype, layout):
    """Qwen-sized rows (V = 151936) for a few tokens."""
    gen = torch.Generator().manual_seed(7)
    T, V = 3, 151936
    x = _logits(T, V, dtype, layout, gen, scale=6.0)
    tg = torch.tensor([0, V - 1, 12345])
    xd, tgd = _to_device(x), tg.to(DEVICE)
    for with_entropy in (False, True):
        want = ops.token_logprob_stats(x, tg, 0, 1.0, with_entropy)
        _check_stats(ops.token_logprob_stats(xd, tgd, 0, 1.0, with_entropy), want)
        lse, entropy = _lse_entropy(want)
        g = torch.randn(T, generator=gen)
        h, gh = (entropy, torch.randn(T, generator=gen)) if with_entropy else (None, None)
        want_d = ops.token_logprob_backward(x, tg, lse, g, h, gh, 0, 1.0)
        got_d = ops.token_logprob_backward(
            xd,
            tgd,
            lse.to(DEVICE),
            g.to(DEVICE),
            None if h is None else h.to(DEVICE),
            None if gh is None else gh.to(DEVICE),
            0,
            1.0,
        )
        _check_grad(got_d, want_d)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("V", [7, 300, 5000])
def test_stats_special_values(dtype, V):
    """NaN anywhere gives NaN sum-exp; an all -inf row gives sum-exp and x-sum 0 (so a vocabulary shard that is
    all masked adds nothing when shards merge); -inf entries in a finite row add nothing to either (never
    0 * -inf); +inf gives NaN. The first run on an H100 (2026-12-06) found the GPU giving NaN for the all -inf
    row where the CPU gives 0."""
    gen = torch.Generator().manual_seed(V)
    x = torch.randn(8, V, generator=gen) * 3
    x[0, V // 3] = float("nan")
    x[1, :] = float("-inf")
    x[2, V // 2] = float("inf")
    x[3, : V // 2] = float("-inf")  # the first threads of the row see only -inf
    x[4, V // 2 :] = float("-inf")
    x[5, :] = float("nan")
    x[6, :-1] = float("-inf")
    x[6, -1] = float("nan")
    x = x.to(dtype)
    tg = torch.tensor([0, 1, 2, 3, V - 1, V, -1, 5 % V])
    nan_rows = torch.isnan(x.float()).any(1)
    for with_entropy in (False, True):
        want = ops.token_logprob_stats(x, tg, 0, 1.0, with_entropy)
        got = ops.token_logprob_stats(x.to(DEVICE), tg.to(DEVICE), 0, 1.0, with_entropy)
        _check_stats(got, want, ignore_max_rows=nan_rows)
        got = got.cpu()
        for r in (0, 2, 5, 6):
            assert torch.isnan(got[r, 1]), r
        assert got[1, 1] == 0 and got[1, 2] == 0
        assert torch.isfinite(got[[3, 4]][:, 1:3]).all()


@gpu
def test_stats_odd_targets_and_many_rows():
    """Non-contiguous targets, a negative vocab_start offset, and enough rows for many blocks."""
    gen = torch.Generator().manual_seed(3)
    T, V = 3001, 9
    x = torch.randn(T, V, generator=gen).to(torch.bfloat16)
    tg_wide = torch.randint(-5, 20, (2 * T,), generator=gen)
    tg = tg_wide[::2]
    want = ops.token_logprob_stats(x, tg, -2, 1.0, True)
    got = ops.token_logprob_stats(x.to(DEVICE), tg_wide.to(DEVICE)[::2], -2, 1.0, True)
    _check_stats(got, want)


@gpu
def test_empty_inputs():
    for dtype in DTYPES:
        x = torch.empty(0, 11, dtype=dtype, device=DEVICE)
        tg = torch.empty(0, dtype=torch.int64, device=DEVICE)
        s = ops.token_logprob_stats(x, tg, 0, 1.0, True)
        assert s.shape == (0, 5) and s.dtype == torch.float32 and s.device.type == "cuda"
        e = torch.empty(0, device=DEVICE)
        d = ops.token_logprob_backward(x, tg, e, e, e, e, 0, 1.0)
        assert d.shape == (0, 11) and d.dtype == dtype
    for idx in (torch.int32, torch.int64):
        cu = torch.zeros(1, dtype=idx, device=DEVICE)
        e = torch.empty(0, device=DEVICE)
        assert ops.segment_sum(e, e, cu).shape == (0,)
        assert ops.segment_expand(e, e, cu).shape == (0,)
        cu3 = torch.zeros(4, dtype=idx, device=DEVICE)  # three empty sequences, no token
        torch.testing.assert_close(ops.segment_sum(e, e, cu3).cpu(), torch.zeros(3), rtol=0, atol=0)
        assert ops.segment_expand(torch.ones(3, device=DEVICE), e, cu3).shape == (0,)
    outs = ops.gspo_sequence_terms(e, e, e, 0.2, 0.2)
    assert all(o.shape == (0,) for o in outs)


@gpu
def test_device_mismatch_is_an_error():
    x = torch.randn(4, 10, device=DEVICE)
    with pytest.raises(RuntimeError, match="gspo_mcore"):
        ops.token_logprob_stats(x, torch.zeros(4, dtype=torch.int64), 0, 1.0, False)
    with pytest.raises(RuntimeError, match="gspo_mcore"):
        ops.segment_sum(torch.ones(4, device=DEVICE), torch.ones(4, device=DEVICE), torch.tensor([0, 4]))


@gpu
def test_deterministic():
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(64, 40000, generator=gen) * 5).to(torch.bfloat16).to(DEVICE)
    tg = torch.randint(0, 40000, (64,), generator=gen).to(DEVICE)
    a = ops.token_logprob_stats(x, tg, 0, 1.0, True)
    b = ops.token_logprob_stats(x, tg, 0, 1.0, True)
    assert torch.equal(a, b)
    v = torch.randn(100000, generator=gen).to(DEVICE)
    cu = torch.tensor([0, 3, 50000, 50000, 100000], dtype=torch.int32, device=DEVICE)
    m = torch.ones_like(v)
    assert torch.equal(ops.segment_sum(v, m, cu), ops.segment_sum(v, m, cu))


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_token_logprobs_end_to_end(dtype):
    """gspo_mcore.ops.token_logprobs on CUDA (compiled kernels) against log_softmax + gather, with autograd."""
    from gspo_mcore.ops import token_logprobs, use_reference

    gen = torch.Generator().manual_seed(5)
    T, V, temp = 50, 3001, 0.8
    x = (torch.randn(T, V, generator=gen) * 3).to(dtype).to(DEVICE).requires_grad_()
    tg = torch.randint(0, V, (T,), generator=gen).to(DEVICE)
    gl, gh = torch.randn(T, device=DEVICE), torch.randn(T, device=DEVICE)
    with use_reference(False):
        lp, ent = token_logprobs(x, tg, return_entropy=True, temperature=temp)
        (dx,) = torch.autograd.grad((lp * gl + ent * gh).sum(), x)
    xr = x.detach().float().requires_grad_()
    lp_r, ent_r = reference.token_logprobs(xr, tg, temperature=temp, return_entropy=True)
    (dx_r,) = torch.autograd.grad((lp_r * gl + ent_r * gh).sum(), xr)
    torch.testing.assert_close(lp, lp_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent_r, rtol=1e-5, atol=1e-5)
    _check_grad(dx, dx_r.to(dtype).cpu())


# ---------------------------------------------------------------------------------------------------------
# segment_sum / segment_expand / gspo_sequence_terms

SEGMENTS = [[5], [3, 0, 4, 0], [0, 0, 1], [1000, 1, 0, 333, 4097], [7] * 300, [70000]]


@gpu
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("lengths", SEGMENTS, ids=lambda s: f"B{len(s)}_T{sum(s)}")
def test_segments_match_cpu(index_dtype, lengths):
    gen = torch.Generator().manual_seed(len(lengths) * 7 + sum(lengths))
    T, B = sum(lengths), len(lengths)
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=index_dtype)
    v = torch.randn(T, generator=gen) * 10
    m = (torch.rand(T, generator=gen) > 0.3).float() * torch.rand(T, generator=gen) * 2
    cud = cu.to(DEVICE)
    got = ops.segment_sum(v.to(DEVICE), m.to(DEVICE), cud).cpu()
    torch.testing.assert_close(got, ops.segment_sum(v, m, cu), rtol=1e-6, atol=1e-7)
    g = torch.randn(B, generator=gen)
    got = ops.segment_expand(g.to(DEVICE), m.to(DEVICE), cud).cpu()
    torch.testing.assert_close(got, ops.segment_expand(g, m, cu), rtol=0, atol=0)


@gpu
def test_segments_zero_mask_hides_nan():
    """A token with mask 0 never counts, even with a NaN value (or a NaN gradient): the contract of
    gspo_mcore.ops.segment_sum, checked against the CPU op and the pure-torch reference."""
    cu = torch.tensor([0, 3, 6])
    v = torch.tensor([1.0, float("nan"), 2.0, float("inf"), 4.0, 5.0])
    m = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0])
    got = ops.segment_sum(v.to(DEVICE), m.to(DEVICE), cu.to(DEVICE)).cpu()
    torch.testing.assert_close(got, ops.segment_sum(v, m, cu), rtol=0, atol=0)
    torch.testing.assert_close(got, reference.segment_sum(v, m, cu), rtol=0, atol=0)
    g = torch.tensor([float("nan"), 2.0])
    got = ops.segment_expand(g.to(DEVICE), m.to(DEVICE), cu.to(DEVICE)).cpu()
    torch.testing.assert_close(got, ops.segment_expand(g, m, cu), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got, reference.segment_expand(g, m, cu), rtol=0, atol=0, equal_nan=True)


@gpu
def test_segments_malformed_offsets_do_not_fault():
    """cu_seqlens is not validated on the device; a malformed one must not read or write out of bounds."""
    v = torch.randn(10, device=DEVICE)
    m = torch.ones(10, device=DEVICE)
    for cu in ([0, 5, 3, 100], [-7, 2, 20], [4, 4, 4]):
        cud = torch.tensor(cu, device=DEVICE)
        ops.segment_sum(v, m, cud)
        ops.segment_expand(torch.randn(len(cu) - 1, device=DEVICE), m, cud)
    torch.cuda.synchronize()


@gpu
def test_sequence_terms_match_cpu():
    gen = torch.Generator().manual_seed(2)
    B = 1000
    s = torch.randn(B, generator=gen) * 0.3
    cnt = torch.randint(-1, 6, (B,), generator=gen).float()
    a = torch.randn(B, generator=gen)
    s[0], a[1], cnt[2], a[3], s[4] = float("nan"), float("nan"), float("nan"), 0.0, 50.0
    want = ops.gspo_sequence_terms(s, cnt, a, 0.2, 0.28)
    got = ops.gspo_sequence_terms(s.to(DEVICE), cnt.to(DEVICE), a.to(DEVICE), 0.2, 0.28)
    for name, gv, wv in zip(("term", "ratio", "clipped", "coef"), got, want):
        tol = 0 if name == "clipped" else 1e-6
        torch.testing.assert_close(gv.cpu(), wv, rtol=tol, atol=tol * 1e-3, equal_nan=True, msg=name)


# ---------------------------------------------------------------------------------------------------------
# the build itself (no GPU needed)


@pytest.mark.skipif(
    torch.version.cuda is None
    or shutil.which("nvcc") is None
    or os.environ.get("GSPO_MCORE_NO_CUDA", "0") not in ("", "0"),
    reason="the CUDA kernels are built only with a CUDA torch and nvcc",
)
def test_built_with_cuda():
    assert _C.built_with_cuda is True
    for name in (
        "token_logprob_stats",
        "token_logprob_backward",
        "segment_sum",
        "segment_expand",
        "gspo_sequence_terms",
    ):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"gspo_mcore::{name}", "CUDA"), name


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("entropy", [False, True])
def test_linear_token_logprobs_on_cuda(dtype, entropy):
    """ops.linear_token_logprobs on CUDA (cuBLAS matmul per chunk + the CUDA kernels): logp / entropy equal the
    twin's (one matmul + log_softmax on the same device), and d hidden / d weight err against float64 by no
    more than twice what the twin errs in the same dtype. T, V not multiples of the chunk; temperature 0.8."""
    from gspo_mcore.ops import linear_token_logprobs

    T, H, V, chunk, temp = 301, 64, 5003, 1024, 0.8
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(T, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * (2.0 / H**0.5)
    targets = torch.randint(0, V, (T,), generator=gen)
    w, u = torch.randn(T, generator=gen), torch.randn(T, generator=gen)

    def run(fn, h, W, dev):
        h = h.detach().to(dev).requires_grad_(True)
        W = W.detach().to(dev).requires_grad_(True)
        out = fn(h, W, targets.to(dev))
        logp, ent = out if entropy else (out, None)
        loss = (w.to(dev, logp.dtype) * logp).sum() + ((u.to(dev, ent.dtype) * ent).sum() if entropy else 0.0)
        loss.backward()
        res = {"logp": logp, "dh": h.grad, "dw": W.grad}
        if entropy:
            res["entropy"] = ent
        return {k: v.detach().double().cpu() for k, v in res.items()}

    def fused(h, W, t):
        return linear_token_logprobs(h, W, t, temperature=temp, return_entropy=entropy, chunk=chunk)

    def twin(h, W, t):
        return reference.linear_token_logprobs(h, W, t, temperature=temp, return_entropy=entropy)

    h, W = hidden.to(dtype), weight.to(dtype)
    got = run(fused, h, W, DEVICE)
    want = run(twin, h, W, DEVICE)
    exact = run(twin, h.double(), W.double(), "cpu")
    for key in got:
        err = float((got[key] - exact[key]).abs().max())
        twin_err = float((want[key] - exact[key]).abs().max())
        scale = float(exact[key].abs().max())
        assert err <= 2 * twin_err + 1e-5 * scale, (key, err, twin_err, scale)
