"""Two conventions settled against the papers (issue 35, docs/gspo.md), each against a float64 formula written
here from the paper, independent of ``gspo_mcore.algo.reference``:

- CISPO reports the value of MiniMax-M1's objective (arXiv 2506.13585, Eq. 4-5),
  ``loss = -(1/M) sum_t sg[clip(r_t, 1 - eps_low, 1 + eps_high)] A_i log pi_t``, not ``-(1/M) sum r_hat A``;
  its gradient ``-(1/M) r_hat A`` per counted token is unchanged.
- GMPO takes the authors' one clip range (arXiv 2507.20673; their code, callsys/GMPO, has a single
  ``cliprange``): ``min[rho^sgn(A), clip(rho^sgn(A), e1, e2)]^sgn(A)`` uses ``e2`` alone, so an asymmetric
  ``(eps_low, eps_high)`` has no meaning in it and is refused at start-up; a symmetric one matches.
"""

from __future__ import annotations

import math

import pytest
import torch

from gspo_mcore.algo import LossConfig, policy_loss

LENGTHS = [5, 3, 6, 1, 4]
ADV = [1.3, -0.8, 0.6, -1.7, 0.0]


def batch(spread=0.9, seed=0):
    """(logp leaf [T] float32, old_logp, advantages [B], cu_seqlens, loss_mask): token log-ratios spread by
    +-``spread``, one masked token in two sequences."""
    g = torch.Generator().manual_seed(seed)
    T = sum(LENGTHS)
    logp = -(torch.rand(T, generator=g, dtype=torch.float64) * 2.5 + 0.1)
    old = logp - spread * (2 * torch.rand(T, generator=g, dtype=torch.float64) - 1)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    mask = torch.ones(T)
    mask[1] = mask[cu[2] + 2] = 0.0
    return logp.float().requires_grad_(True), old.float(), torch.tensor(ADV), cu, mask


def per_sequence(cu, mask, *tensors):
    """The counted entries of each sequence, float64: a list of tuples."""
    out = []
    for i in range(len(cu) - 1):
        m = mask[cu[i] : cu[i + 1]].bool()
        out.append(tuple(t[cu[i] : cu[i + 1]][m].double() for t in tensors))
    return out


# ---------------------------------------------------------------------------------------------------
# CISPO: the reported loss is the objective's value
# ---------------------------------------------------------------------------------------------------


def cispo_paper(logp, old, adv, cu, mask, eps_low, eps_high):
    """MiniMax-M1 Eq. 4-5 in float64: ``-(1/M) sum_i sum_t sg[r_hat_t] A_i log pi_t`` and its gradient."""
    lp = logp.detach().double().requires_grad_(True)
    total, m_tokens = lp.new_zeros(()), int(mask.sum())
    for i, (lpi, oi) in enumerate(per_sequence(cu, mask, lp, old)):
        r_hat = torch.exp(lpi - oi).clamp(1 - eps_low, 1 + eps_high).detach()
        total = total + (r_hat * float(adv[i]) * lpi).sum()
    loss = -total / m_tokens
    loss.backward()
    return float(loss.detach()), lp.grad


@pytest.mark.parametrize("eps", [(1.0, 3.0), (0.2, 0.28)], ids=["paper-default", "both-bounds"])
def test_cispo_reports_the_objective_value_with_the_same_gradient(impl, eps):
    logp, old, adv, cu, mask = batch()
    old[0], old[cu[1]] = logp[0].detach() - 1.6, logp[cu[1]].detach() + 1.7  # r = 4.95 > 4 (cap); r = 0.18
    loss, m = policy_loss(logp, old, adv, cu, mask, variant="cispo", eps_low=eps[0], eps_high=eps[1])
    loss.backward()
    want_loss, want_grad = cispo_paper(logp, old, adv, cu, mask, *eps)
    assert float(loss.detach()) == pytest.approx(want_loss, rel=1e-6, abs=1e-7)
    torch.testing.assert_close(logp.grad.double(), want_grad, rtol=1e-6, atol=1e-8)
    assert float(m["clip_fraction"]) > 0  # the weights are really clipped: the test sees r_hat, not r
    # the gradient is exactly the former convention's, -(1/M) r_hat A on each counted token
    r = torch.exp(logp.detach().double() - old.double()).clamp(1 - eps[0], 1 + eps[1])
    a_tok = torch.tensor(ADV, dtype=torch.float64).repeat_interleave(cu.diff())
    old_grad = torch.where(mask.bool(), -r * a_tok / mask.sum(), 0.0)
    torch.testing.assert_close(logp.grad.double(), old_grad, rtol=1e-6, atol=1e-8)
    # and the value is not the former -(1/M) sum r_hat A (so this test would catch a return to it)
    former = float((old_grad * mask).sum())
    assert abs(float(loss.detach()) - former) > 0.1


# ---------------------------------------------------------------------------------------------------
# GMPO: one clip range, the authors' formula
# ---------------------------------------------------------------------------------------------------


def gmpo_authors(logp, old, adv, cu, mask, e1, e2):
    """The authors' objective in float64, ``-(1/N) sum_i A_i (prod_t min[rho^s, clip(rho^s, e1, e2)]^s)^(1/|y_i|)``
    with ``s = sgn(A_i)``, and its gradient (``N`` the sequences with a counted token)."""
    lp = logp.detach().double().requires_grad_(True)
    seqs = per_sequence(cu, mask, lp, old)
    n = sum(1 for lpi, _ in seqs if lpi.numel())
    total = lp.new_zeros(())
    for i, (lpi, oi) in enumerate(seqs):
        a = float(adv[i])
        if a == 0 or lpi.numel() == 0:
            continue
        s = 1.0 if a > 0 else -1.0
        rho_s = torch.exp(lpi - oi) ** s
        kept = torch.minimum(rho_s, rho_s.clamp(e1, e2)) ** s
        total = total + a * kept.prod() ** (1.0 / lpi.numel())
    loss = -total / n
    loss.backward()
    return float(loss.detach()), lp.grad


@pytest.mark.parametrize("eps", [0.4, 0.15])
def test_gmpo_matches_the_authors_formula(impl, eps):
    """The authors' ``e1 = e^-eps``, ``e2 = e^eps``: policy_loss's value and gradient, with tokens clipped
    on both sides of 1 (``A > 0`` above, ``A < 0`` below)."""
    logp, old, adv, cu, mask = batch(spread=0.9)
    loss, m = policy_loss(logp, old, adv, cu, mask, variant="gmpo", eps_low=eps, eps_high=eps, num_sequences=5)
    loss.backward()
    want_loss, want_grad = gmpo_authors(logp, old, adv, cu, mask, math.exp(-eps), math.exp(eps))
    assert float(loss.detach()) == pytest.approx(want_loss, rel=1e-6, abs=1e-7)
    torch.testing.assert_close(logp.grad.double(), want_grad, rtol=1e-5, atol=1e-8)
    d = (logp.detach() - old).double()
    a_tok = torch.tensor(ADV, dtype=torch.float64).repeat_interleave(cu.diff())
    assert bool(((a_tok > 0) & (d > eps) & mask.bool()).any()) and bool(((a_tok < 0) & (d < -eps) & mask.bool()).any())
    assert 0 < float(m["clip_fraction"]) < 1


def test_gmpo_authors_formula_has_one_bound():
    """Why asymmetric bounds are refused: in the authors' formula ``e1`` never acts (the ``min`` keeps the
    smaller of ``x`` and ``clip(x)``, so raising ``x`` to ``e1`` never wins), so the floor of an ``A < 0``
    token's log-ratio is ``-log e2 = -eps_high``, not the ``-eps_low`` of the verl/TRL form."""
    logp, old, adv, cu, mask = batch(spread=0.9)
    base = gmpo_authors(logp, old, adv, cu, mask, math.exp(-0.1), math.exp(0.3))
    for e1 in (math.exp(-0.6), math.exp(-0.01), 1.0):
        assert gmpo_authors(logp, old, adv, cu, mask, e1, math.exp(0.3))[0] == base[0]
    assert gmpo_authors(logp, old, adv, cu, mask, math.exp(-0.1), math.exp(0.2))[0] != base[0]


@pytest.mark.parametrize("eps", [dict(eps_low=0.2, eps_high=0.4), dict(eps_low=0.2), dict(eps_high=0.3)])
def test_gmpo_refuses_asymmetric_bounds(eps):
    with pytest.raises(ValueError, match=r"loss.eps_low=.* and loss.eps_high=.* differ, but gmpo takes one clip"):
        LossConfig(variant="gmpo", **eps)
    logp, old, adv, cu, mask = batch()
    with pytest.raises(ValueError, match=r"eps_low=.* and eps_high=.* differ, but gmpo takes one clip range"):
        policy_loss(logp, old, adv, cu, mask, variant="gmpo", **eps)
    LossConfig(variant="gmpo", eps_low=0.25, eps_high=0.25)  # one range, given twice: accepted
