"""SAPO, CISPO and GMPO (docs/gspo.md) against the float64 reference written from each paper's formula
(gspo_mcore.algo.reference: GMPO as the product of token terms to the power 1/|y_i|, CISPO as
sg[r_hat] A log pi), value and gradient, in float32 and bfloat16, on awkward packed batches; their metrics
against a plain-Python computation; the property each paper is about; and, for every variant, the loss over
the policy's own tokens only when a sequence holds environment spans (multi-turn masks, issue 26)."""

from __future__ import annotations

import math

import pytest
import torch

from gspo_mcore.algo import DEFAULT_EPS, VARIANTS, off_policy_weights, policy_loss, regularizer_loss
from gspo_mcore.algo.policy import SAPO_GATE_NEAR_ZERO
from gspo_mcore.algo.reference import policy_loss_reference

FAMILY = ("sapo", "cispo", "gmpo")
DTYPES = [torch.float32, torch.bfloat16]
_MANTISSA_BITS = {torch.bfloat16: 8, torch.float32: 24}
TAU = (1.0, 1.05)


def cu_of(lengths):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int64)


# (length, mean token log-ratio, advantage, no counted token?): token log-ratios spread by +-0.9 around the
# mean, so ratios reach far on both sides (SAPO's gate near 0, CISPO's cap 4 = exp(1.39), GMPO's +-0.4), with
# an empty sequence, a one-token one, A = 0 and a sequence with no counted token.
ROWS = [
    (6, +0.9, +1.5, False),
    (5, -0.9, -1.2, False),
    (4, +0.9, -0.7, False),
    (3, -0.9, +0.4, False),
    (1, +1.8, +2.0, False),
    (0, 0.0, +1.0, False),
    (4, 0.0, 0.0, False),
    (3, 0.3, -0.5, True),
    (7, 0.2, +0.8, False),
    (5, -0.2, -0.9, False),
    (2, +2.0, -1.1, False),
]
# A multi-turn episode per sequence: spans of (kind, length), "p" prompt, "a" the policy's tokens, "e" the
# environment's (tool output); the loss mask is 1 on "a" spans only.
EPISODES = [
    [("p", 3), ("a", 4), ("e", 2), ("a", 3), ("e", 3), ("a", 2)],
    [("p", 2), ("a", 1), ("e", 4), ("a", 5)],
    [("p", 4), ("a", 6)],
    [("p", 2), ("a", 2), ("e", 1), ("a", 1), ("e", 2), ("a", 3), ("e", 1), ("a", 2)],
    [("p", 3), ("e", 2), ("a", 4), ("e", 5)],  # an environment span right after the prompt and at the end
    [("p", 5)],  # prompt only: no policy token
    [("p", 1), ("a", 3), ("e", 3), ("a", 1)],
]
EPISODE_ADV = [1.2, -0.8, 0.6, -1.5, 2.0, 0.7, -0.3]
EPISODE_DELTA = [0.9, -0.9, 0.2, -0.3, 1.5, 0.0, -1.2]


def make_batch(dtype=torch.float32, rows=ROWS, seed=0, spread=0.9):
    """(logp leaf, old_logp, advantages [B], cu_seqlens, loss_mask) with 20% of tokens masked at random."""
    g = torch.Generator().manual_seed(seed)
    lengths = [r[0] for r in rows]
    T = sum(lengths)
    logp = -(torch.rand(T, generator=g) * 3 + 0.05)
    mask = (torch.rand(T, generator=g) < 0.8).float()
    delta = torch.zeros(T)
    t = 0
    for n, d, _, masked in rows:
        if n:
            mask[t] = 1.0
            if masked:
                mask[t : t + n] = 0.0
            delta[t : t + n] = d + spread * (2 * torch.rand(n, generator=g) - 1)
        t += n
    logp = logp.to(dtype)
    old = (logp.float() - delta).to(dtype)
    adv = torch.tensor([r[2] for r in rows])
    return logp.requires_grad_(True), old, adv, cu_of(lengths), mask


def multi_turn_batch(dtype=torch.float32, seed=1, env_value=0.0):
    """The EPISODES batch: (logp leaf, old_logp, advantages, cu_seqlens, loss_mask, kinds) with ``kinds`` the
    span kind of every token. Environment and prompt tokens get log-probs ``env_value`` (NaN to prove they are
    never read)."""
    g = torch.Generator().manual_seed(seed)
    kinds = [k for ep in EPISODES for k, n in ep for _ in range(n)]
    lengths = [sum(n for _, n in ep) for ep in EPISODES]
    T = len(kinds)
    mask = torch.tensor([k == "a" for k in kinds], dtype=torch.float32)
    seq = torch.repeat_interleave(torch.arange(len(EPISODES)), torch.tensor(lengths))
    logp = -(torch.rand(T, generator=g) * 3 + 0.05)
    delta = torch.tensor(EPISODE_DELTA)[seq] + 0.9 * (2 * torch.rand(T, generator=g) - 1)
    old = logp - delta
    off = mask == 0
    logp = torch.where(off, env_value, logp).to(dtype)
    old = torch.where(off, env_value, old).to(dtype)
    return logp.requires_grad_(True), old, torch.tensor(EPISODE_ADV), cu_of(lengths), mask, kinds


def eps_of(variant):
    return dict(zip(("eps_low", "eps_high"), DEFAULT_EPS[variant]))


def run(fn, logp, *args, **kw):
    """loss, metrics and d loss / d logp of one call."""
    logp.grad = None
    out = fn(logp, *args, **kw)
    loss, metrics = (out, None) if isinstance(out, torch.Tensor) else out
    loss.backward()
    grad, logp.grad = logp.grad, None
    return loss.detach(), metrics, grad


def ulp(x, dtype):
    _, e = torch.frexp(x.abs())
    return torch.ldexp(torch.ones_like(x), e - _MANTISSA_BITS[dtype]).clamp(min=2.0**-133)


def assert_grads_close(got, want, dtype):
    """float32: to float32 accumulation accuracy; bf16: one bf16 ulp of the value at most."""
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want.double(), rtol=2e-5, atol=1e-8)
    else:
        g, w = got.double(), want.double()
        assert bool(((g - w).abs() <= ulp(w, dtype) + 1e-9).all()), float((g - w).abs().max())


def loss_of(variant, **extra):
    kw = dict(variant=variant, tau_pos=TAU[0], tau_neg=TAU[1], **eps_of(variant), **extra)
    return lambda lp, *a: policy_loss(lp, *a, **kw)


def reference_of(variant, **extra):
    kw = dict(variant=variant, tau_pos=TAU[0], tau_neg=TAU[1], **eps_of(variant), **extra)
    return lambda lp, *a: policy_loss_reference(lp, *a, **kw)


def token_view(logp, old, adv, cu, mask):
    """Per counted token: log-ratio (float64), advantage, sequence index."""
    seg = torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff())
    counted = mask != 0
    d = logp.detach().double() - old.double()
    return d[counted], adv.double()[seg][counted], seg[counted]


def assert_exercised(variant, logp, old, adv, cu, mask, eps_low=None, eps_high=None):
    """The batch exercises what the variant is about, and no decision sits within 1e-5 of its boundary."""
    d, a, _ = token_view(logp, old, adv, cu, mask)
    r = d.exp()
    if variant == "sapo":
        p = torch.sigmoid(torch.where(a > 0, TAU[0], TAU[1]) * (r - 1))
        gate = 4 * p * (1 - p)
        assert bool((gate < SAPO_GATE_NEAR_ZERO).any()) and bool((gate > 0.9).any())
        assert bool(((a > 0) & (r > 1)).any()) and bool(((a < 0) & (r > 1)).any())  # both temperatures matter
        assert bool(((gate - SAPO_GATE_NEAR_ZERO).abs() > 1e-5).all())
    elif variant == "cispo":
        lo, hi = 1 - eps_low, 1 + eps_high
        assert bool((r > hi).any()) and bool((r < hi).any())
        assert bool(((r - hi).abs() > 1e-5).all() and ((r - lo).abs() > 1e-5).all())
        if lo > 0:
            assert bool((r < lo).any())
    else:
        assert bool(((a > 0) & (d > eps_high)).any()) and bool(((a < 0) & (d < -eps_low)).any())
        assert bool(((a > 0) & (d < eps_high) & (a != 0)).any())
        assert bool(((d - eps_high).abs() > 1e-5).all() and ((d + eps_low).abs() > 1e-5).all())


# ---------------------------------------------------------------------------------------------------
# Against the float64 reference
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("variant", FAMILY)
def test_family_matches_float64_reference(impl, variant, dtype):
    """Loss and d loss / d logp equal the float64 reference written from the paper's formula, on a packed batch
    with empty, one-token, zero-advantage and no-counted-token sequences and random interior mask holes."""
    logp, old, adv, cu, mask = make_batch(dtype)
    assert_exercised(variant, logp, old, adv, cu, mask, **eps_of(variant))
    loss, metrics, grad = run(loss_of(variant), logp, old, adv, cu, mask)
    want_loss, _, want_grad = run(reference_of(variant), logp, old, adv, cu, mask)
    assert loss.dtype == torch.float32 and loss.shape == () and grad.dtype == dtype
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-7)
    assert_grads_close(grad, want_grad, dtype)
    assert grad.abs().max() > 0
    if variant != "sapo":
        assert float(metrics["clip_fraction"]) > 0


@pytest.mark.parametrize("variant", ["cispo"])
def test_cispo_with_a_lower_bound_matches_reference(impl, variant):
    """CISPO with both bounds active (eps_low 0.5: weights kept in [0.5, 4])."""
    logp, old, adv, cu, mask = make_batch()
    assert_exercised(variant, logp, old, adv, cu, mask, eps_low=0.5, eps_high=3.0)
    loss, m, grad = run(lambda lp, *a: policy_loss(lp, *a, variant="cispo", eps_low=0.5), logp, old, adv, cu, mask)
    ref = lambda lp, *a: policy_loss_reference(lp, *a, variant="cispo", eps_low=0.5, eps_high=3.0)  # noqa: E731
    want, _, want_grad = run(ref, logp, old, adv, cu, mask)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-7)
    assert_grads_close(grad, want_grad, torch.float32)
    _, m_default = policy_loss(logp, old, adv, cu, mask, variant="cispo")
    assert float(m["clip_fraction"]) > float(m_default["clip_fraction"])  # the lower bound clips too


# ---------------------------------------------------------------------------------------------------
# Metrics, by hand
# ---------------------------------------------------------------------------------------------------


def spec_metrics(variant, logp, old, adv, cu, mask):
    """The metrics in plain Python floats (float64): an independent computation."""
    lp, ol, m = logp.detach().double().tolist(), old.double().tolist(), mask.tolist()
    eps_low, eps_high = DEFAULT_EPS[variant]
    tokens = clipped = clipped_seqs = valid = 0
    ratios, gates = [], []
    for i in range(len(cu) - 1):
        idx = [t for t in range(int(cu[i]), int(cu[i + 1])) if m[t] != 0]
        if not idx:
            continue
        valid += 1
        tokens += len(idx)
        a = float(adv[i])
        d = [lp[t] - ol[t] for t in idx]
        if variant == "sapo":
            tau = TAU[0] if a > 0 else TAU[1]
            p = [1 / (1 + math.exp(-tau * (math.exp(x) - 1))) for x in d]
            gates += [4 * q * (1 - q) for q in p]
            c = [False] * len(d)
        elif variant == "cispo":
            c = [not (1 - eps_low <= math.exp(x) <= 1 + eps_high) for x in d]
        else:
            c = [(a > 0 and x > eps_high) or (a < 0 and x < -eps_low) for x in d]
        ratios += [math.exp(sum(d) / len(d))] if variant == "gmpo" else [math.exp(x) for x in d]
        clipped += sum(c)
        clipped_seqs += any(c)
    out = {
        "clip_fraction": clipped / tokens,
        "clipped_sequence_fraction": clipped_seqs / valid,
        "ratio_mean": sum(ratios) / len(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "num_tokens": float(tokens),
        "num_sequences": float(valid),
        "nonfinite_tokens": 0.0,
    }
    if variant == "sapo":
        out["gate_mean"] = sum(gates) / len(gates)
        out["gate_near_zero_fraction"] = sum(g < SAPO_GATE_NEAR_ZERO for g in gates) / len(gates)
    return out


@pytest.mark.parametrize("variant", FAMILY)
def test_family_metrics_match_hand_computation(impl, variant):
    """clip_fraction (CISPO: weights clipped; GMPO: log-ratios clipped; SAPO: 0), clipped_sequence_fraction,
    ratio_mean/min/max (token ratios for SAPO and CISPO, the unclipped geometric-mean sequence ratio for GMPO),
    and SAPO's gate_mean / gate_near_zero_fraction equal a plain-Python computation."""
    logp, old, adv, cu, mask = make_batch()
    _, metrics = loss_of(variant)(logp, old, adv, cu, mask)
    want = spec_metrics(variant, logp, old, adv, cu, mask)
    assert set(metrics) == set(want)
    for k, v in want.items():
        assert metrics[k].shape == () and not metrics[k].requires_grad
        assert float(metrics[k]) == pytest.approx(v, rel=1e-5, abs=1e-7), k
    if variant == "sapo":
        assert 0 < float(metrics["gate_near_zero_fraction"]) < 1 and float(metrics["gate_mean"]) < 1


# ---------------------------------------------------------------------------------------------------
# What each paper changes
# ---------------------------------------------------------------------------------------------------


def test_sapo_on_policy_is_the_plain_policy_gradient(impl):
    """At r = 1 the gate's slope is 1 (the 4/tau normalisation): every counted token gets -(1/N) A / |y_i|,
    exactly the unclipped policy gradient, and the loss is -(1/N) sum_i (2 / tau_i) A_i."""
    logp, _, adv, cu, mask = make_batch()
    old = logp.detach().clone()
    loss, _, grad = run(loss_of("sapo"), logp, old, adv, cu, mask)
    seg = torch.repeat_interleave(torch.arange(len(ROWS)), cu.diff())
    counts = torch.zeros(len(ROWS)).index_add_(0, seg, mask)
    want = torch.where(mask > 0, -adv[seg] / counts[seg].clamp(min=1) / len(ROWS), 0.0)
    torch.testing.assert_close(grad, want, rtol=1e-6, atol=1e-9)
    tau = torch.where(adv > 0, TAU[0], TAU[1])
    want_loss = -float(torch.where(counts > 0, 2 / tau * adv, 0.0).sum()) / len(ROWS)
    assert float(loss) == pytest.approx(want_loss, rel=1e-6)


@pytest.mark.parametrize("variant", VARIANTS)
def test_on_policy_every_variant_is_the_plain_policy_gradient(impl, variant):
    """On the first mini-batch of a step (r = 1 for every token) no clip, gate or weight acts: GSPO,
    GSPO-token, GRPO, SAPO and GMPO all give each counted token -(1/N) A_i / |y_i| (REINFORCE, a mean over
    each sequence's tokens), CISPO gives -(1/M) A_i (REINFORCE, a mean over the mini-batch's M tokens). So the
    family can only part after the step's first optimizer update (docs/results/paper-miniature.md)."""
    logp, _, adv, cu, mask = make_batch()
    old = logp.detach().clone()
    _, _, grad = run(loss_of(variant), logp, old, adv, cu, mask)
    seg = torch.repeat_interleave(torch.arange(len(ROWS)), cu.diff())
    counts = torch.zeros(len(ROWS)).index_add_(0, seg, mask)
    if variant == "cispo":
        want = torch.where(mask > 0, -adv[seg] / mask.sum(), 0.0)
    else:
        want = torch.where(mask > 0, -adv[seg] / counts[seg].clamp(min=1) / len(ROWS), 0.0)
    torch.testing.assert_close(grad, want, rtol=1e-6, atol=1e-9)


def test_sapo_temperatures_act_by_advantage_sign(impl):
    """tau_pos shapes only the tokens of sequences with A > 0, tau_neg only those with A <= 0; a larger tau
    shrinks the gradient of an off-policy token faster (the paper's reason for tau_neg > tau_pos)."""
    logp, old, adv, cu, mask = make_batch()
    seg = torch.repeat_interleave(torch.arange(len(ROWS)), cu.diff())
    pos = (adv[seg] > 0) & (mask > 0)
    neg = (adv[seg] < 0) & (mask > 0)

    def grad(tp, tn):
        return run(
            lambda lp, *a: policy_loss(lp, *a, variant="sapo", tau_pos=tp, tau_neg=tn), logp, old, adv, cu, mask
        )[2]

    base, more_pos, more_neg = grad(1.0, 1.05), grad(3.0, 1.05), grad(1.0, 3.0)
    assert torch.equal(more_pos[neg], base[neg]) and not torch.allclose(more_pos[pos], base[pos])
    assert torch.equal(more_neg[pos], base[pos]) and not torch.allclose(more_neg[neg], base[neg])
    far = neg & ((logp.detach() - old).abs() > 0.5)
    assert bool(far.any()) and bool((more_neg[far].abs() < base[far].abs()).all())


def test_cispo_never_drops_a_token_gradient(impl):
    """Where GRPO's clip zeroes a token's gradient, CISPO keeps it, with weight sg[clip(r)] : every counted token
    of a sequence with A != 0 gets exactly -(1/M) r_hat A, M the counted tokens."""
    logp, old, adv, cu, mask = make_batch()
    _, _, g_grpo = run(loss_of("grpo"), logp, old, adv, cu, mask)
    _, _, g = run(loss_of("cispo"), logp, old, adv, cu, mask)
    seg = torch.repeat_interleave(torch.arange(len(ROWS)), cu.diff())
    live = (mask > 0) & (adv[seg] != 0)
    assert bool((g_grpo[live] == 0).any()), "the batch must have GRPO-clipped tokens"
    assert bool((g[live] != 0).all())
    r_hat = (logp.detach() - old).exp().clamp(0.0, 4.0)
    want = torch.where(mask > 0, -r_hat * adv[seg] / mask.sum(), 0.0)
    torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-9)


def test_cispo_is_a_token_mean_over_the_mini_batch(impl):
    """CISPO divides by M, the mini-batch's counted tokens, not by N: num_sequences changes nothing, num_tokens
    scales the loss, and micro-batches each divided by the global M add up to the whole batch's loss and
    gradient (each divided by its own token count, they do not)."""
    logp, old, adv, cu, mask = make_batch()
    M = int(mask.sum())
    l0, _, g0 = run(loss_of("cispo"), logp, old, adv, cu, mask)
    l1, _, g1 = run(loss_of("cispo", num_sequences=3), logp, old, adv, cu, mask)
    assert torch.equal(l0, l1) and torch.equal(g0, g1)
    for m in (4 * M, torch.tensor(4 * M)):
        l2, _, g2 = run(loss_of("cispo", num_tokens=m), logp, old, adv, cu, mask)
        torch.testing.assert_close(l2, l0 / 4, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(g2, g0 / 4, rtol=1e-6, atol=1e-9)
    _assert_micro_batches_add_up("cispo", {"num_tokens": M})


def test_gmpo_without_clipping_is_the_unclipped_sequence_ratio(impl):
    """With every token log-ratio inside [-0.4, 0.4] GMPO is A_i times the geometric mean of the token ratios:
    GSPO's unclipped objective, value and gradient (GSPO with a clip range that never binds)."""
    logp, old, adv, cu, mask = make_batch(spread=0.15, rows=[(n, max(-0.2, min(0.2, d)), a, m) for n, d, a, m in ROWS])
    assert float((logp.detach() - old)[mask > 0].abs().max()) < 0.4
    l_g, m_g, g_g = run(loss_of("gmpo"), logp, old, adv, cu, mask)
    with pytest.warns(UserWarning):
        l_s, _, g_s = run(
            lambda lp, *a: policy_loss(lp, *a, variant="gspo", eps_low=0.99, eps_high=100.0), logp, old, adv, cu, mask
        )
    assert float(m_g["clip_fraction"]) == 0.0
    torch.testing.assert_close(l_g, l_s, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(g_g, g_s, rtol=1e-5, atol=1e-9)


def test_gmpo_clips_tokens_not_sequences(impl):
    """A clipped token gets no gradient, but the other tokens of its sequence keep theirs (GSPO would drop the
    whole sequence): d loss / d logp_t = -(1/N) A_i s~_i / |y_i| on the unclipped tokens, s~_i the clipped
    geometric-mean ratio."""
    logp, old, adv, cu, mask = make_batch()
    _, _, g = run(loss_of("gmpo"), logp, old, adv, cu, mask)
    seg = torch.repeat_interleave(torch.arange(len(ROWS)), cu.diff())
    d = (logp.detach() - old).double()
    a = adv[seg].double()
    clipped = ((a > 0) & (d > 0.4)) | ((a < 0) & (d < -0.4))
    kept = torch.where(clipped, d.clamp(-0.4, 0.4), d) * mask
    counts = torch.zeros(len(ROWS), dtype=torch.float64).index_add_(0, seg, mask.double())
    s = (torch.zeros_like(counts).index_add_(0, seg, kept) / counts.clamp(min=1)).exp()
    want = torch.where((mask > 0) & ~clipped, -a * s[seg] / counts[seg].clamp(min=1) / len(ROWS), 0.0)
    torch.testing.assert_close(g.double(), want, rtol=1e-5, atol=1e-9)
    mixed = [
        i
        for i in range(len(ROWS))
        if clipped[(seg == i) & (mask > 0)].any() and (~clipped[(seg == i) & (mask > 0)]).any()
    ]
    assert mixed and all(bool((g[(seg == i) & (mask > 0) & ~clipped] != 0).all()) for i in mixed)


def _assert_micro_batches_add_up(variant, normaliser):
    logp, old, adv, cu, mask = make_batch()
    whole, _, whole_grad = run(loss_of(variant, **normaliser), logp, old, adv, cu, mask)
    total, grad = torch.zeros(()), torch.zeros_like(whole_grad)
    own = torch.zeros_like(whole_grad)
    for b0, b1 in [(0, 3), (3, 6), (6, 7), (7, 11)]:
        t0, t1 = int(cu[b0]), int(cu[b1])
        piece = logp.detach()[t0:t1].clone().requires_grad_(True)
        args = (old[t0:t1], adv[b0:b1], cu[b0 : b1 + 1] - cu[b0], mask[t0:t1])
        loss, _ = loss_of(variant, **normaliser)(piece, *args)
        loss.backward()
        total += loss.detach()
        grad[t0:t1] = piece.grad
        piece.grad = None
        loss_of(variant)(piece, *args)[0].backward()
        own[t0:t1] = piece.grad
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, whole_grad, rtol=1e-5, atol=1e-8)
    assert not torch.allclose(own, whole_grad, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("variant", ["sapo", "gmpo"])
def test_micro_batches_sum_to_the_whole_batch(impl, variant):
    """SAPO and GMPO are means over sequences with the global N, like GSPO."""
    _assert_micro_batches_add_up(variant, {"num_sequences": len(ROWS)})


@pytest.mark.parametrize("variant", FAMILY)
@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_off_policy_weights_match_reference(impl, variant, mode):
    """The decoupled off-policy weight at the variant's level (token for SAPO and CISPO, sequence for GMPO)
    multiplies its term as in the reference."""
    from gspo_mcore.algo import RATIO_LEVEL

    logp, old, adv, cu, mask = make_batch()
    g = torch.Generator().manual_seed(5)
    mu = old - 0.8 * torch.randn(old.shape[0], generator=g)
    w, _ = off_policy_weights(old, mu, cu, mask, mode=mode, cap=2.0, level=RATIO_LEVEL[variant])
    loss, _, grad = run(loss_of(variant, weights=w), logp, old, adv, cu, mask)
    want, _, want_grad = run(
        reference_of(variant, behaviour_logp=mu, off_policy=mode, cap=2.0), logp, old, adv, cu, mask
    )
    _, _, plain = run(loss_of(variant), logp, old, adv, cu, mask)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-7)
    assert_grads_close(grad, want_grad, torch.float32)
    assert not torch.allclose(grad, plain)


# ---------------------------------------------------------------------------------------------------
# Multi-turn masks: environment spans inside a sequence (issue 26)
# ---------------------------------------------------------------------------------------------------


def compact(logp, old, adv, cu, mask):
    """The same episodes with every non-policy token removed: what a single-turn batch of the policy's tokens
    would be. Returns the compacted tensors and the kept token indices."""
    keep = torch.nonzero(mask > 0).squeeze(1)
    seg = torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff())
    lengths = torch.zeros(len(cu) - 1, dtype=torch.int64).index_add_(0, seg[keep], torch.ones_like(keep))
    return logp.detach()[keep].clone().requires_grad_(True), old[keep], adv, cu_of(lengths.tolist()), mask[keep], keep


def multi_turn_eps(variant):
    """The clip range used on the episodes: the papers' except for the GSPO variants, whose episode-level
    sequence ratios (token log-ratios spread by 0.9) clip both ways at 0.2 / 0.3 (a warned-about range)."""
    return dict(eps_low=0.2, eps_high=0.3) if variant in ("gspo", "gspo_token") else eps_of(variant)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("variant", VARIANTS)
def test_multi_turn_matches_float64_reference(impl, variant, dtype):
    """Every variant on episodes whose policy spans are separated by environment spans: loss and gradient
    equal the float64 reference (which reads only the counted tokens)."""
    logp, old, adv, cu, mask, _ = multi_turn_batch(dtype)
    kw = dict(variant=variant, tau_pos=TAU[0], tau_neg=TAU[1], **multi_turn_eps(variant))
    with _maybe_warns(variant):
        loss, m, grad = run(lambda lp, *a: policy_loss(lp, *a, **kw), logp, old, adv, cu, mask)
    want, _, want_grad = run(lambda lp, *a: policy_loss_reference(lp, *a, **kw), logp, old, adv, cu, mask)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-7)
    assert_grads_close(grad, want_grad, dtype)
    assert float(m["num_tokens"]) == float(mask.sum()) and float(m["num_sequences"]) == 6
    if variant != "sapo":
        assert 0 < float(m["clip_fraction"]) < 1


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("variant", VARIANTS)
def test_multi_turn_is_the_loss_of_the_policy_tokens_alone(impl, variant):
    """Removing the prompt and environment tokens from the episodes changes nothing: the loss and every metric
    (sequence ratio and length normalisation over policy tokens, clip fraction, ratio statistics, SAPO's gate)
    are the same, each policy token gets the same gradient, and the environment tokens get exactly 0, even
    with NaN log-probs there."""
    logp, old, adv, cu, mask, kinds = multi_turn_batch(env_value=math.nan)
    c_logp, c_old, c_adv, c_cu, c_mask, keep = compact(logp, old, adv, cu, mask)
    kw = dict(variant=variant, **multi_turn_eps(variant))
    with _maybe_warns(variant):
        loss, m, grad = run(lambda lp, *a: policy_loss(lp, *a, **kw), logp, old, adv, cu, mask)
        c_loss, c_m, c_grad = run(lambda lp, *a: policy_loss(lp, *a, **kw), c_logp, c_old, c_adv, c_cu, c_mask)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, c_loss, rtol=1e-6, atol=1e-8)
    assert set(m) == set(c_m)
    for k in m:
        torch.testing.assert_close(m[k], c_m[k], rtol=1e-6, atol=1e-8, msg=k)
    torch.testing.assert_close(grad[keep], c_grad, rtol=1e-6, atol=1e-9)
    env = torch.tensor([k != "a" for k in kinds])
    assert torch.equal(grad[env], torch.zeros(int(env.sum())))
    assert grad[keep].abs().max() > 0


def _maybe_warns(variant):
    return pytest.warns(UserWarning) if variant in ("gspo", "gspo_token") else _nothing()


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_multi_turn_off_policy_kl_and_entropy_are_over_policy_tokens(impl, level):
    """The off-policy weight (length-normalised over the policy tokens), its metrics, the KL penalty and the
    entropy bonus of the episodes equal those of the policy tokens alone."""
    logp, old, adv, cu, mask, _ = multi_turn_batch(env_value=math.nan)
    c_logp, c_old, _, c_cu, c_mask, keep = compact(logp, old, adv, cu, mask)
    g = torch.Generator().manual_seed(3)
    mu = old - 0.5 * torch.randn(old.shape[0], generator=g)
    ref = old - 0.3 * torch.randn(old.shape[0], generator=g)
    ent = torch.where(mask > 0, torch.rand(old.shape[0], generator=g), math.nan)
    w, wm = off_policy_weights(old, mu, cu, mask, mode="tis", cap=2.0, level=level)
    c_w, c_wm = off_policy_weights(c_old, mu[keep], c_cu, c_mask, mode="tis", cap=2.0, level=level)
    torch.testing.assert_close(w[keep] if level == "token" else w, c_w)
    for k in wm:
        torch.testing.assert_close(wm[k], c_wm[k], msg=k)
    reg = dict(num_sequences=7, kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01)
    loss, rm, grad = run(lambda lp, *a: regularizer_loss(lp, *a, ref_logp=ref, entropy=ent, **reg), logp, cu, mask)
    c_loss, c_rm, c_grad = run(
        lambda lp, *a: regularizer_loss(lp, *a, ref_logp=ref[keep], entropy=ent[keep], **reg), c_logp, c_cu, c_mask
    )
    torch.testing.assert_close(loss, c_loss)
    for k in rm:
        torch.testing.assert_close(rm[k], c_rm[k], msg=k)
    torch.testing.assert_close(grad[keep], c_grad)
    assert float(grad[mask == 0].abs().max()) == 0.0


# ---------------------------------------------------------------------------------------------------
# Configuration errors, by key
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(variant="ppo"), r"loss.variant must be one of \('gspo', 'gspo_token', 'grpo', 'sapo', 'cispo', 'gmpo'\)"),
        (dict(variant="sapo", eps_high=0.2), r"loss.eps_high=0.2: sapo has no clip range"),
        (dict(variant="sapo", sapo_tau_pos=0.0), r"loss.sapo_tau_pos must be a finite number > 0"),
        (dict(sapo_tau_neg=math.inf), r"loss.sapo_tau_neg must be a finite number > 0"),
        (dict(sapo_tau_neg=True), r"loss.sapo_tau_neg must be a finite number > 0"),
        (dict(variant="cispo", eps_low=1.5), r"loss.eps_low must be <= 1 for cispo"),
        (dict(variant="cispo", eps_high=-0.1), r"loss.eps_high must be a finite number >= 0"),
        (dict(variant="gmpo", eps_low=math.nan), r"loss.eps_low must be a finite number >= 0"),
        (dict(variant="grpo", eps_low=1.0), r"loss.eps_low must be < 1"),
    ],
)
def test_loss_config_refuses_bad_family_keys(kw, match):
    from gspo_mcore.algo import LossConfig

    with pytest.raises(ValueError, match=match):
        LossConfig(**kw)


def test_loss_config_accepts_the_paper_defaults():
    from gspo_mcore.algo import LossConfig

    for v in VARIANTS:
        LossConfig(variant=v)
    LossConfig(variant="cispo", eps_low=1.0, eps_high=5.0)
    LossConfig(variant="gmpo", eps_low=0.6, eps_high=0.6)
    LossConfig(variant="sapo", sapo_tau_pos=0.5, sapo_tau_neg=2.0)
