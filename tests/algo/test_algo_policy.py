"""policy_loss (GSPO, GSPO-token, GRPO) against the literal reference, hand computations of the spec
(docs/gspo.md) and the invariants the spec calls out: GSPO-token == GSPO for per-sequence
advantages, a global normaliser (micro-batch splits sum to the whole batch), a mean over sequences.
The input checks and NaN handling run for every variant; SAPO, CISPO and GMPO have their own value,
gradient and metric tests in test_algo_family.py."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from gspo_mcore import ops
from gspo_mcore.algo import DEFAULT_EPS, VARIANTS, policy_loss
from gspo_mcore.algo.reference import policy_loss_reference

DTYPES = [torch.float32, torch.bfloat16]
CLIPPED = ("gspo", "gspo_token", "grpo")
"""The hard-clipped variants this file's spec covers (SAPO, CISPO, GMPO: test_algo_family.py)."""
_MANTISSA_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}


def cu_of(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int64)


# One row per sequence: (length, mean log-ratio delta, advantage, all tokens masked out?).
# For the GSPO variants deltas of +-0.05 put the sequence ratio far outside [1 - 3e-4, 1 + 4e-4] and a
# delta of 0 gives a ratio of exactly 1; every sign combination of (ratio side, advantage) is present.
SCENARIO = [
    (4, +0.05, +1.5, False),  # s > 1 + eps_high, A > 0: clipped
    (3, +0.05, -0.7, False),  # s > 1 + eps_high, A < 0: not clipped
    (5, -0.05, -1.2, False),  # s < 1 - eps_low,  A < 0: clipped
    (2, -0.05, +0.4, False),  # s < 1 - eps_low,  A > 0: not clipped
    (6, 0.0, +2.0, False),  # s = 1: inside
    (1, 0.0, -2.0, False),  # one token, inside
    (0, 0.0, +1.0, False),  # empty sequence (cu_seqlens repeats)
    (3, +0.05, 0.0, False),  # A = 0
    (4, -0.05, -0.5, True),  # no counted token: contributes nothing, counts in no metric
    (7, -0.3, -0.9, False),  # far below, A < 0: clipped
    (2, +0.3, +0.8, False),  # far above, A > 0: clipped
]


def make_batch(dtype=torch.float32, rows=SCENARIO, token_noise=0.0, seed=0):
    """(logp leaf, old_logp, advantages [B], cu_seqlens, loss_mask) for ``rows``.

    ``token_noise`` spreads the token log-ratios of the sequences with a nonzero delta (GRPO needs token
    ratios on both sides of its clip range); sequences with delta 0 keep every token ratio exactly 1.
    """
    g = torch.Generator().manual_seed(seed)
    lengths = [r[0] for r in rows]
    T = sum(lengths)
    logp = -(torch.rand(T, generator=g) * 3 + 0.05)
    mask = (torch.rand(T, generator=g) < 0.8).float()
    delta = torch.zeros(T)
    t = 0
    for n, d, _, masked in rows:
        if n:
            mask[t] = 1.0  # at least one counted token...
            if masked:
                mask[t : t + n] = 0.0  # ...unless the sequence has none on purpose
            if d != 0.0:
                delta[t : t + n] = d + token_noise * torch.randn(n, generator=g)
        t += n
    logp = logp.to(dtype)
    old = (logp.float() - delta).to(dtype)
    adv = torch.tensor([r[2] for r in rows])
    return logp.requires_grad_(True), old, adv, cu_of(lengths), mask


def spec(logp, old, adv, cu, mask, variant, eps_low, eps_high, num_sequences=None):
    """The spec in plain Python floats (float64), metrics included: an independent third implementation."""
    lo, hi = 1 - eps_low, 1 + eps_high
    lp, ol, m = logp.detach().double().tolist(), old.double().tolist(), mask.tolist()
    B = len(cu) - 1
    per_token_adv = variant == "gspo_token" and adv.shape[0] == len(lp)
    N = num_sequences if num_sequences is not None else B
    total, tokens, clipped_tokens, clipped_seqs, valid, ratios = 0.0, 0, 0, 0, 0, []
    for i in range(B):
        idx = [t for t in range(int(cu[i]), int(cu[i + 1])) if m[t] != 0]
        if not idx:
            continue
        n = len(idx)
        valid += 1
        tokens += n
        if variant in ("gspo", "gspo_token"):
            s = math.exp(sum(lp[t] - ol[t] for t in idx) / n)
            ratios.append(s)
            advs = [float(adv[t]) if per_token_adv else float(adv[i]) for t in idx]
            rs = [s] * n
        else:
            rs = [math.exp(lp[t] - ol[t]) for t in idx]
            ratios.extend(rs)
            advs = [float(adv[i])] * n
        clip = [(a > 0 and r > hi) or (a < 0 and r < lo) for r, a in zip(rs, advs)]
        terms = [min(r * a, min(max(r, lo), hi) * a) for r, a in zip(rs, advs)]
        if variant == "gspo":
            total += terms[0]  # one term per sequence, whatever its length
            clipped_tokens += n * clip[0]
        else:
            total += sum(terms) / n
            clipped_tokens += sum(clip)
        clipped_seqs += any(clip)
    metrics = {
        "clip_fraction": clipped_tokens / max(tokens, 1),
        "clipped_sequence_fraction": clipped_seqs / max(valid, 1),
        "ratio_mean": sum(ratios) / len(ratios) if ratios else 1.0,
        "ratio_min": min(ratios) if ratios else 1.0,
        "ratio_max": max(ratios) if ratios else 1.0,
        "num_tokens": float(tokens),
        "num_sequences": float(valid),
        "nonfinite_tokens": 0.0,
    }
    return -total / N, metrics


def ulp(x, dtype):
    _, e = torch.frexp(x.abs())
    return torch.ldexp(torch.ones_like(x), e - _MANTISSA_BITS[dtype]).clamp(min=2.0**-133)


def assert_grads_close(got, want, dtype):
    """float32: to float32 accumulation accuracy; bf16: both round nearly the same float to bf16, so they
    may differ by one bf16 ulp of the value (and no more)."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-8)
    else:
        g, w = got.double(), want.double()
        assert bool(((g - w).abs() <= ulp(w, dtype) + 1e-9).all()), float((g - w).abs().max())


def run(fn, logp, *args, **kw):
    """loss, metrics and d loss / d logp of one call (leaves ``logp.grad`` cleared)."""
    logp.grad = None
    loss, *rest = fn(logp, *args, **kw)
    loss.backward()
    grad, logp.grad = logp.grad, None
    return loss.detach(), (rest[0] if rest else None), grad


def reference_loss(logp, old, adv, cu, mask, variant, **kw):
    return (policy_loss_reference(logp, old, adv, cu, mask, variant=variant, **kw),)


def eps_of(variant):
    return dict(zip(("eps_low", "eps_high"), DEFAULT_EPS[variant]))


# ---------------------------------------------------------------------------------------------------
# Against the literal reference and the spec
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("variant", CLIPPED)
def test_policy_loss_matches_reference(impl, variant, dtype):
    """Each variant's loss and d loss / d logp equal policy_loss_reference (a literal per-sequence loop
    with torch.minimum) on a batch that clips with both signs of the advantage, has empty sequences,
    one-token sequences and a sequence with no counted token; logp in float32 and bfloat16."""
    noise = 0.25 if variant == "grpo" else 0.0
    logp, old, adv, cu, mask = make_batch(dtype, token_noise=noise)
    if variant == "gspo_token":  # per-token advantages that vary within sequences
        adv = adv.repeat_interleave(cu.diff()) + 0.3 * torch.randn(int(cu[-1]))
    eps = eps_of(variant)
    loss, metrics, grad = run(policy_loss, logp, old, adv, cu, mask, variant=variant, **eps)
    want_loss, _, want_grad = run(reference_loss, logp, old, adv, cu, mask, variant, **eps)
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert grad.dtype == dtype
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-7)
    assert_grads_close(grad, want_grad, dtype)
    spec_loss, spec_m = spec(logp, old, adv, cu, mask, variant, **eps)
    assert float(loss) == pytest.approx(spec_loss, rel=1e-5, abs=1e-7)
    # the scenario must really clip, with both signs of the advantage (else the test proves little)
    assert 0 < spec_m["clip_fraction"] < 1
    assert metrics["clip_fraction"] > 0
    _assert_both_clip_sides(logp, old, adv, cu, mask, variant, **eps)


def _assert_both_clip_sides(logp, old, adv, cu, mask, variant, eps_low, eps_high):
    """Some counted term is clipped above with A > 0 and some below with A < 0; no ratio sits within 1e-5
    of a clip bound (where float32 and float64 could disagree about clipping)."""
    lr = (logp.detach().double() - old.double()) * mask
    seg = torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff())
    counted = mask != 0
    if variant == "grpo":
        r, a = lr.exp()[counted], adv[seg][counted]
    else:
        cnt = torch.zeros(len(cu) - 1, dtype=torch.float64).index_add_(0, seg, mask.double())
        s = (torch.zeros_like(cnt).index_add_(0, seg, lr) / cnt.clamp(min=1)).exp()
        r = s[seg][counted]
        a = (adv if adv.shape[0] == mask.shape[0] else adv[seg])[counted].double()
    hi, lo = 1 + eps_high, 1 - eps_low
    assert bool(((a > 0) & (r > hi)).any()) and bool(((a < 0) & (r < lo)).any())
    assert bool(((r - hi).abs() > 1e-5).all() and ((r - lo).abs() > 1e-5).all())


@pytest.mark.parametrize("variant", CLIPPED)
def test_metrics_match_hand_computation(impl, variant):
    """clip_fraction (for GSPO: tokens of clipped sequences / counted tokens), clipped_sequence_fraction,
    ratio_mean/min/max (sequence ratios for the GSPO variants, token ratios for GRPO), num_tokens,
    num_sequences (sequences with a counted token) and nonfinite_tokens equal a hand computation."""
    logp, old, adv, cu, mask = make_batch(token_noise=0.25 if variant == "grpo" else 0.0)
    eps = eps_of(variant)
    _, metrics = policy_loss(logp, old, adv, cu, mask, variant=variant, **eps)
    _, want = spec(logp, old, adv, cu, mask, variant, **eps)
    assert set(metrics) == set(want)
    for k, v in want.items():
        assert metrics[k].shape == () and not metrics[k].requires_grad
        assert float(metrics[k]) == pytest.approx(v, rel=1e-5, abs=1e-7), k
    if variant == "gspo":
        # explicitly, from the scenario table: sequences 0, 2, 9, 10 are clipped
        counts = [int(mask[cu[i] : cu[i + 1]].sum()) for i in range(len(SCENARIO))]
        clipped_tokens = counts[0] + counts[2] + counts[9] + counts[10]
        assert float(metrics["clip_fraction"]) == pytest.approx(clipped_tokens / sum(counts))
        assert float(metrics["clipped_sequence_fraction"]) == pytest.approx(4 / 9)
        assert float(metrics["num_sequences"]) == 9 and float(metrics["num_tokens"]) == sum(counts)


def test_metrics_when_nothing_counts(impl):
    """No counted token at all: loss 0, ratios reported as 1, fractions 0 (no division by zero)."""
    logp = torch.randn(5, requires_grad=True)
    for variant in VARIANTS:
        loss, m = policy_loss(
            logp, logp.detach() + 1, torch.ones(2), torch.tensor([0, 2, 5]), torch.zeros(5), variant=variant
        )
        assert float(loss.detach()) == 0.0
        assert [float(m[k]) for k in ("ratio_mean", "ratio_min", "ratio_max")] == [1.0, 1.0, 1.0]
        assert float(m["clip_fraction"]) == 0 and float(m["num_sequences"]) == 0 and float(m["num_tokens"]) == 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_zero_tokens(impl, variant):
    """T=0 (B sequences, all empty, or B=0): loss 0 and an empty gradient."""
    for cu in (torch.tensor([0, 0, 0]), torch.tensor([0])):
        logp = torch.zeros(0, requires_grad=True)
        loss, m = policy_loss(logp, torch.zeros(0), torch.zeros(cu.numel() - 1), cu, torch.zeros(0), variant=variant)
        loss.backward()
        assert float(loss.detach()) == 0.0 and logp.grad.shape == (0,) and float(m["num_tokens"]) == 0


# ---------------------------------------------------------------------------------------------------
# GSPO-token vs GSPO
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_gspo_token_equals_gspo_for_sequence_advantages(impl, dtype):
    """With A_i,t = A_i for every token (passed [T]-shaped), GSPO-token equals GSPO in value and in
    gradient (spec: s_i,t == s_i numerically and grad s_i,t = s_i grad logp_t), clipped sequences included."""
    logp, old, adv, cu, mask = make_batch(dtype)
    adv_t = adv.repeat_interleave(cu.diff())  # (T,)
    assert adv_t.shape[0] != adv.shape[0]
    l1, m1, g1 = run(policy_loss, logp, old, adv, cu, mask, variant="gspo")
    l2, m2, g2 = run(policy_loss, logp, old, adv_t, cu, mask, variant="gspo_token")
    torch.testing.assert_close(l2, l1, rtol=1e-6, atol=1e-8)
    assert_grads_close(g2, g1, dtype)
    assert g1.abs().max() > 0
    for k in m1:
        torch.testing.assert_close(m2[k], m1[k], rtol=1e-6, atol=1e-8)
    # the [B]-shaped form broadcasts the same way
    l3, _, g3 = run(policy_loss, logp, old, adv, cu, mask, variant="gspo_token")
    torch.testing.assert_close(l3, l1, rtol=1e-6, atol=1e-8)
    assert_grads_close(g3, g1, dtype)


def test_gspo_token_differs_when_advantages_vary(impl):
    """With advantages varying within a sequence, GSPO-token weighs each token by its own A_i,t: the
    value equals GSPO with A_i = mean_t A_i,t (nothing clipped: both are s_i * mean A), but the
    gradients differ, token by token as A_i,t / |y_i|."""
    rows = [(5, 0.0, 0.0, False), (3, 0.0, 0.0, False), (4, 0.0, 0.0, False)]  # ratios exactly 1: no clip
    logp, old, _, cu, mask = make_batch(rows=rows)
    mask = torch.ones_like(mask)
    adv_t = torch.randn(12)
    seg = torch.repeat_interleave(torch.arange(3), cu.diff())
    adv_mean = torch.zeros(3).index_add_(0, seg, adv_t) / cu.diff()
    l_tok, _, g_tok = run(policy_loss, logp, old, adv_t, cu, mask, variant="gspo_token")
    l_seq, _, g_seq = run(policy_loss, logp, old, adv_mean, cu, mask, variant="gspo")
    torch.testing.assert_close(l_tok, l_seq, rtol=1e-5, atol=1e-7)
    assert (g_tok - g_seq).abs().max() > 0.05
    # GSPO-token: d loss / d logp_t = -(1/N) s A_t / |y_i| with s = 1
    torch.testing.assert_close(g_tok, -adv_t / cu.diff()[seg] / 3, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------------
# The normaliser N is global: micro-batches and data-parallel ranks
# ---------------------------------------------------------------------------------------------------


def _split(logp, old, adv, cu, mask, bounds, per_token):
    """Micro-batches made of whole sequences [b0, b1): tensors re-based to their own offsets."""
    out = []
    for b0, b1 in bounds:
        t0, t1 = int(cu[b0]), int(cu[b1])
        a = adv[t0:t1] if per_token else adv[b0:b1]
        out.append((t0, t1, old[t0:t1], a, cu[b0 : b1 + 1] - cu[b0], mask[t0:t1]))
    return out


@pytest.mark.parametrize(
    "variant,per_token", [("gspo", False), ("gspo_token", False), ("gspo_token", True), ("grpo", False)]
)
def test_micro_batches_sum_to_the_whole_batch(impl, variant, per_token):
    """Splitting a mini-batch into micro-batches, each normalised by the GLOBAL N (num_sequences=B_total),
    gives the same summed loss and the same gradient as the whole batch (and so does a data-parallel
    split); normalising each by its own B does not."""
    logp, old, adv, cu, mask = make_batch(token_noise=0.25 if variant == "grpo" else 0.0)
    if per_token:
        adv = adv.repeat_interleave(cu.diff()) + 0.3 * torch.randn(int(cu[-1]))
    B = len(SCENARIO)
    eps = eps_of(variant)
    whole_loss, _, whole_grad = run(policy_loss, logp, old, adv, cu, mask, variant=variant, **eps)
    bounds = [(0, 3), (3, 7), (7, 8), (8, 11)]  # includes the empty sequence (6) and a 1-sequence batch
    for n_kw in ({"num_sequences": B}, {"num_sequences": torch.tensor(B)}):
        total, grad = torch.zeros(()), torch.zeros_like(whole_grad)
        for t0, t1, o, a, c, m in _split(logp, old, adv, cu, mask, bounds, per_token):
            piece = logp.detach()[t0:t1].clone().requires_grad_(True)
            loss, _ = policy_loss(piece, o, a, c, m, variant=variant, **eps, **n_kw)
            loss.backward()
            total += loss.detach()
            grad[t0:t1] = piece.grad
        torch.testing.assert_close(total, whole_loss, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(grad, whole_grad, rtol=1e-5, atol=1e-8)
    # the pitfall: each micro-batch normalised by its own sequence count
    grad = torch.zeros_like(whole_grad)
    for t0, t1, o, a, c, m in _split(logp, old, adv, cu, mask, bounds, per_token):
        piece = logp.detach()[t0:t1].clone().requires_grad_(True)
        policy_loss(piece, o, a, c, m, variant=variant, **eps)[0].backward()
        grad[t0:t1] = piece.grad
    assert not torch.allclose(grad, whole_grad, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("variant", CLIPPED)
def test_normaliser_scales_the_loss(impl, variant):
    """loss(num_sequences=N) = loss(default N = B) * B / N, value and gradient (int or 0-d tensor N)."""
    logp, old, adv, cu, mask = make_batch(token_noise=0.25 if variant == "grpo" else 0.0)
    B = len(SCENARIO)
    l0, _, g0 = run(policy_loss, logp, old, adv, cu, mask, variant=variant)
    for n in (4 * B, torch.tensor(4 * B), torch.tensor([4 * B])):
        l1, _, g1 = run(policy_loss, logp, old, adv, cu, mask, variant=variant, num_sequences=n)
        torch.testing.assert_close(l1, l0 / 4, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(g1, g0 / 4, rtol=1e-6, atol=1e-9)


# ---------------------------------------------------------------------------------------------------
# The pitfalls of gspo.md
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", [*CLIPPED, "gmpo"])
def test_mean_over_sequences_not_tokens(impl, variant):
    """A short (2 tokens) and a long (8 tokens) sequence with the same per-token log-ratio and advantage
    get EQUAL per-sequence weight: each token's gradient scales as 1/|y_i| (a token-mean of a broadcast
    sequence loss would give every token the same gradient). With different advantages the loss is the
    plain mean over sequences of s_i A_i, not a token-weighted mean, nor a token sum."""
    lengths = [2, 8]
    T = 10
    logp = (-torch.rand(T) - 0.5).requires_grad_(True)
    old = logp.detach() - 1e-4  # every token log-ratio is 1e-4: inside any clip range
    mask, cu = torch.ones(T), cu_of(lengths)
    adv = torch.tensor([1.0, 1.0])
    _, _, g = run(policy_loss, logp, old, adv, cu, mask, variant=variant)
    torch.testing.assert_close(g[:2], g[:1].expand(2))
    torch.testing.assert_close(g[2:], g[2:3].expand(8))
    assert float(g[0] / g[2]) == pytest.approx(4.0, rel=1e-5)  # (1/2) / (1/8)
    assert float(g[:2].sum()) == pytest.approx(float(g[2:].sum()), rel=1e-5)  # equal weight per sequence
    s = math.exp(1e-4)
    assert float(g[0]) == pytest.approx(-(1 / 2) * s * 1.0 / 2, rel=1e-5)  # -(1/N) A s / |y_i|

    adv = torch.tensor([2.0, -1.0])
    loss = policy_loss(logp, old, adv, cu, mask, variant=variant)[0].detach()
    seq_mean = -(s * 2.0 + s * -1.0) / 2
    token_weighted = -(2 * s * 2.0 + 8 * s * -1.0) / 10
    token_sum = -(2 * s * 2.0 + 8 * s * -1.0) / 2
    assert float(loss) == pytest.approx(seq_mean, rel=1e-5)
    assert abs(float(loss) - token_weighted) > 0.1 and abs(float(loss) - token_sum) > 0.1


def test_grpo_clip_range_with_gspo_warns():
    """Using GRPO's clip range (0.2) with GSPO makes clipping a no-op: policy_loss warns."""
    logp, old, adv, cu, mask = make_batch()
    with pytest.warns(UserWarning, match="clipping a no-op"):
        policy_loss(logp, old, adv, cu, mask, variant="gspo", eps_low=0.2, eps_high=0.27)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        policy_loss(logp, old, adv, cu, mask, variant="grpo", eps_low=0.2, eps_high=0.27)
        policy_loss(logp, old, adv, cu, mask, variant="gspo")


def test_clipped_sequence_gets_no_gradient(impl):
    """A clipped GSPO sequence contributes nothing to the gradient; an unclipped one gives every counted
    token -(1/N) A s / |y_i| and masked tokens 0 (spec: grad J formula)."""
    logp, old, adv, cu, mask = make_batch()
    _, _, g = run(policy_loss, logp, old, adv, cu, mask, variant="gspo")
    N = len(SCENARIO)
    for i, (n, _, a, _) in enumerate(SCENARIO):
        t0, t1 = int(cu[i]), int(cu[i + 1])
        m = mask[t0:t1]
        cnt = float(m.sum())
        if cnt == 0:
            assert torch.equal(g[t0:t1], torch.zeros(n))
            continue
        s = math.exp(float((logp.detach()[t0:t1] - old[t0:t1]).mul(m).sum()) / cnt)
        clipped = (a > 0 and s > 1 + 4e-4) or (a < 0 and s < 1 - 3e-4)
        want = torch.zeros(n) if clipped else -(a * s / cnt / N) * m
        torch.testing.assert_close(g[t0:t1], want, rtol=1e-5, atol=1e-9)


# ---------------------------------------------------------------------------------------------------
# NaN / inf
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, -math.inf, math.inf], ids=["nan", "-inf", "inf"])
@pytest.mark.parametrize("where", ["logp", "old_logp"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_nonfinite_counted_token_makes_loss_nan(impl, variant, where, bad):
    """A non-finite log-ratio on a counted token makes the loss NaN (never silently finite) and
    nonfinite_tokens counts it."""
    logp, old, adv, cu, mask = make_batch()
    t = int(cu[4]) + 1  # a counted token of sequence 4 (delta 0, A = +2)
    mask[t] = 1.0
    if where == "logp":
        lp = logp.detach().clone()
        lp[t] = bad
        logp = lp.requires_grad_(True)
    else:
        old = old.clone()
        old[t] = bad
    loss, m = policy_loss(logp, old, adv, cu, mask, variant=variant)
    assert torch.isnan(loss), float(loss)
    assert float(m["nonfinite_tokens"]) == 1.0


@pytest.mark.parametrize("variant", VARIANTS)
def test_nan_in_masked_token_changes_nothing(impl, variant):
    """NaN/inf in logp, old_logp (and per-token advantages) of masked-out tokens changes neither the loss,
    nor the metrics, nor any gradient (the masked tokens' gradient is exactly 0, not 0 * NaN)."""
    logp, old, adv, cu, mask = make_batch(token_noise=0.25 if variant == "grpo" else 0.0)
    if variant == "gspo_token":
        adv = adv.repeat_interleave(cu.diff())
    masked = torch.nonzero(mask == 0).squeeze(1)[:4]
    assert masked.numel() == 4
    l0, m0, g0 = run(policy_loss, logp, old, adv, cu, mask, variant=variant)
    lp = logp.detach().clone()
    lp[masked[:2]] = torch.tensor([math.nan, math.inf])
    o = old.clone()
    o[masked[1:3]] = torch.tensor([math.nan, -math.inf])
    a = adv.clone()
    if variant == "gspo_token":
        a[masked[3]] = math.nan
    l1, m1, g1 = run(policy_loss, lp.requires_grad_(True), o, a, cu, mask, variant=variant)
    assert torch.equal(l1, l0)
    assert all(torch.equal(m1[k], m0[k]) for k in m0)
    assert torch.equal(g1, g0)
    assert torch.equal(g1[masked], torch.zeros(4))


# ---------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------


def _good():
    return dict(
        logp=torch.randn(6),
        old_logp=torch.randn(6),
        advantages=torch.randn(2),
        cu_seqlens=torch.tensor([0, 4, 6]),
        loss_mask=torch.ones(6),
    )


def _with(**kw):
    def build():
        args = _good()
        extra = {k: v for k, v in kw.items() if k not in args}
        args.update({k: v for k, v in kw.items() if k in args})
        return args, extra

    return build


POLICY_BAD = [
    (
        "variant",
        _with(variant="ppo"),
        ValueError,
        r"variant must be one of \('gspo', 'gspo_token', 'grpo', 'sapo', 'cispo', 'gmpo'\), got 'ppo'",
    ),
    ("eps_low-negative", _with(eps_low=-0.1), ValueError, r"eps_low must be a finite number >= 0"),
    ("eps_low-one", _with(eps_low=1.0), ValueError, r"eps_low must be < 1"),
    ("eps_low-nan", _with(eps_low=math.nan), ValueError, r"eps_low must be a finite number"),
    ("eps_high-negative", _with(eps_high=-1e-4), ValueError, r"eps_high must be a finite number >= 0"),
    ("eps_high-inf", _with(eps_high=math.inf), ValueError, r"eps_high must be a finite number"),
    ("num_sequences-0", _with(num_sequences=0), ValueError, r"num_sequences must be a positive int"),
    ("num_sequences-negative", _with(num_sequences=-4), ValueError, r"num_sequences must be a positive int"),
    ("num_sequences-float", _with(num_sequences=2.5), ValueError, r"num_sequences must be a positive int"),
    ("num_sequences-bool", _with(num_sequences=True), ValueError, r"num_sequences must be a positive int"),
    ("num_sequences-vector", _with(num_sequences=torch.tensor([2, 2])), ValueError, r"num_sequences must be a scalar"),
    ("logp-2d", _with(logp=torch.randn(6, 1)), ValueError, r"logp must be 1-D"),
    ("logp-int", _with(logp=torch.zeros(6, dtype=torch.long)), TypeError, r"logp must have dtype"),
    ("old_logp-length", _with(old_logp=torch.randn(5)), ValueError, r"old_logp has 5 entries but logp has 6"),
    (
        "old_logp-device",
        _with(old_logp=torch.randn(6, device="meta")),
        ValueError,
        r"old_logp is on meta but must be on cpu",
    ),
    ("loss_mask-length", _with(loss_mask=torch.ones(7)), ValueError, r"loss_mask has 7 entries but logp has 6"),
    ("loss_mask-2d", _with(loss_mask=torch.ones(6, 1)), ValueError, r"loss_mask must be 1-D"),
    ("loss_mask-device", _with(loss_mask=torch.ones(6, device="meta")), ValueError, r"loss_mask is on meta"),
    (
        "advantages-per-token-for-gspo",
        _with(advantages=torch.randn(6)),
        ValueError,
        r"advantages must have shape \[B\]=2 \(one per sequence\) for variant 'gspo', got \(6,\)",
    ),
    (
        "advantages-per-token-for-grpo",
        _with(advantages=torch.randn(6), variant="grpo"),
        ValueError,
        r"advantages must have shape \[B\]=2 \(one per sequence\) for variant 'grpo'",
    ),
    (
        "advantages-wrong-for-gspo_token",
        _with(advantages=torch.randn(5), variant="gspo_token"),
        ValueError,
        r"advantages must have shape \[B\]=2 or \[T\]=6 for variant 'gspo_token', got \(5,\)",
    ),
    ("advantages-2d", _with(advantages=torch.randn(2, 1)), ValueError, r"advantages must be 1-D"),
    ("advantages-int", _with(advantages=torch.ones(2, dtype=torch.long)), TypeError, r"advantages must have dtype"),
    ("advantages-device", _with(advantages=torch.ones(2, device="meta")), ValueError, r"advantages is on meta"),
    ("cu-start", _with(cu_seqlens=torch.tensor([1, 4, 6])), ValueError, r"cu_seqlens must start at 0"),
    (
        "cu-monotone",
        _with(cu_seqlens=torch.tensor([0, 5, 4, 6]), advantages=torch.randn(3)),
        ValueError,
        r"cu_seqlens must be non-decreasing",
    ),
    (
        "cu-end",
        _with(cu_seqlens=torch.tensor([0, 4, 5])),
        ValueError,
        r"cu_seqlens must end at the number of tokens T=6",
    ),
    ("cu-dtype", _with(cu_seqlens=torch.tensor([0.0, 4.0, 6.0])), TypeError, r"cu_seqlens must have dtype"),
]


@pytest.mark.parametrize("case", POLICY_BAD, ids=[c[0] for c in POLICY_BAD])
def test_policy_loss_bad_input(impl, case):
    """Bad input raises the documented error naming the argument."""
    _, build, exc, match = case
    args, extra = build()
    with pytest.raises(exc, match=match):
        policy_loss(**args, **extra)


# ---------------------------------------------------------------------------------------------------
# The GSPO path runs in the compiled extension
# ---------------------------------------------------------------------------------------------------


def _profiled(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


def test_gspo_path_runs_compiled_ops(compiled):
    """With the extension (the default when it imports), the GSPO loss's forward runs the compiled
    segment_sum and gspo_sequence_terms kernels and its backward runs segment_expand; under
    use_reference(True) no gspo_mcore op runs."""
    assert ops.HAVE_EXTENSION and ops.compiled_enabled()
    logp, old, adv, cu, mask = make_batch()

    def step():
        logp.grad = None
        policy_loss(logp, old, adv, cu, mask, variant="gspo")[0].backward()

    names = _profiled(step)
    assert {"gspo_mcore::segment_sum", "gspo_mcore::gspo_sequence_terms", "gspo_mcore::segment_expand"} <= names
    with ops.use_reference(True):
        names = _profiled(step)
    assert not any(n.startswith("gspo_mcore::") for n in names)


@pytest.mark.parametrize("variant", VARIANTS)
def test_non_binary_mask_is_refused(impl, variant):
    """A 0.5 mask would give neither a mean nor the reference's ``.bool()`` result (counts sum m^2)."""
    logp, old, adv, cu, mask = make_batch()
    for dtype in (torch.float32, torch.int64):
        loss, _ = policy_loss(logp, old, adv, cu, mask.to(dtype), variant=variant)  # 0/1 in any dtype is fine
        assert torch.isfinite(loss)
    weighted = mask.clone()
    t = int(torch.nonzero(mask)[0, 0])
    weighted[t] = 0.5
    with pytest.raises(ValueError, match=rf"loss_mask must hold only 0 and 1.*loss_mask\[{t}\]=0.5"):
        policy_loss(logp, old, adv, cu, weighted, variant=variant)
    with pytest.raises(ValueError, match="loss_mask"):
        policy_loss(logp, old, adv, cu, mask * 2, variant=variant)
