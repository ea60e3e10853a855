"""An independent, literal implementation of the policy losses (the formulas of docs/gspo.md).

It loops over sequences and writes each formula as printed (``torch.minimum`` of the unclipped and
clipped terms; GMPO as the authors' product of clipped token ratios
``min[rho^sgn(A), clip(rho^sgn(A), e1, e2)]^sgn(A)`` raised to ``1/|y_i|``; CISPO as the paper's
``sg[r_hat] A log pi``, value and gradient), so tests can hold :func:`gspo_mcore.algo.policy_loss` (compiled
segment ops, fused sequence terms, log-space means) against it, value and gradient. Not for production: it
is slow and syncs with the host.
"""

from __future__ import annotations

import math

import torch


def _is_weight(log_w, mode, cap):
    """The off-policy weight from its log (float64, constant): TIS ``min(w, C)``, MIS ``[1/C <= w <= C]``."""
    w = torch.exp(log_w.detach())
    if mode == "tis":
        return torch.clamp(w, max=cap)
    if mode == "mis":
        return ((w >= 1.0 / cap) & (w <= cap)).double()
    return torch.ones_like(w)


def policy_loss_reference(
    logp,
    old_logp,
    advantages,
    cu_seqlens,
    loss_mask,
    *,
    variant,
    eps_low,
    eps_high,
    num_sequences=None,
    num_tokens=None,
    tau_pos=1.0,
    tau_neg=1.05,
    behaviour_logp=None,
    off_policy="none",
    cap=2.0,
    ref_logp=None,
    kl_coef=0.0,
    kl_estimator="k3",
    entropy=None,
    entropy_coef=0.0,
):
    """The loss of docs/gspo.md and docs/loss.md, written per sequence in float64.

    ``behaviour_logp`` (mu) with ``off_policy`` ``tis``/``mis``: the importance weight of the decoupled
    objective (``old_logp`` is pi_prox); ``ref_logp`` with ``kl_coef``: the KL penalty; ``entropy`` with
    ``entropy_coef``: the entropy bonus (``entropy`` differentiable if its gradient is wanted).
    """
    n = num_sequences if num_sequences is not None else cu_seqlens.numel() - 1
    m_tokens = num_tokens if num_tokens is not None else max(int(loss_mask.bool().sum()), 1)
    total = logp.new_zeros((), dtype=torch.float64)
    token_total = logp.new_zeros((), dtype=torch.float64)  # CISPO: a sum over tokens, divided by M
    penalty = logp.new_zeros((), dtype=torch.float64)
    lo, hi = (1.0 - eps_low, 1.0 + eps_high) if eps_low is not None else (None, None)
    for i in range(cu_seqlens.numel() - 1):
        a, b = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
        m = loss_mask[a:b].bool()
        lp = logp[a:b][m].double()
        olp = old_logp[a:b][m].double()
        if lp.numel() == 0:
            continue  # a sequence with no counted token contributes nothing
        mu = behaviour_logp[a:b][m].double() if behaviour_logp is not None else olp
        if ref_logp is not None and kl_coef:
            d = ref_logp[a:b][m].double() - lp  # log(pi_ref / pi_theta)
            k = -d if kl_estimator == "k1" else torch.exp(d) - d - 1.0
            penalty = penalty + kl_coef * k.mean()
        if entropy is not None and entropy_coef:
            penalty = penalty - entropy_coef * entropy[a:b][m].double().mean()
        if variant == "gspo":
            A = advantages[i].double()
            s = torch.exp((lp - olp).mean())
            w = _is_weight((olp - mu).mean(), off_policy, cap)
            total = total + w * torch.minimum(s * A, s.clamp(lo, hi) * A)
        elif variant == "gspo_token":
            A = (
                advantages[a:b][m].double()
                if advantages.numel() == logp.numel()
                else advantages[i].double().expand(lp.shape)
            )
            s = torch.exp((lp - olp).mean()).detach()
            s_t = s * torch.exp(lp - lp.detach())
            w = _is_weight((olp - mu).mean(), off_policy, cap)
            total = total + w * torch.minimum(s_t * A, s_t.clamp(lo, hi) * A).mean()
        elif variant == "grpo":
            A = advantages[i].double()
            r = torch.exp(lp - olp)
            w = _is_weight(olp - mu, off_policy, cap)
            total = total + (w * torch.minimum(r * A, r.clamp(lo, hi) * A)).mean()
        elif variant == "sapo":
            # J_i = (1/|y_i|) sum_t f(r_t) A_i, f(r) = sigmoid(tau (r - 1)) * 4 / tau, tau by the sign of A_i
            A = advantages[i].double()
            tau = tau_pos if float(A) > 0 else tau_neg
            r = torch.exp(lp - olp)
            w = _is_weight(olp - mu, off_policy, cap)
            total = total + (w * torch.sigmoid(tau * (r - 1.0)) * (4.0 / tau) * A).mean()
        elif variant == "cispo":
            # MiniMax-M1 (Eq. 4-5): J = (1/M) sum_t sg[clip(r_t, 1 - eps_low, 1 + eps_high)] A_i log pi_t
            A = advantages[i].double()
            r_hat = torch.exp(lp - olp).clamp(lo, hi).detach()
            w = _is_weight(olp - mu, off_policy, cap)
            token_total = token_total + (w * r_hat * A * lp).sum()
        elif variant == "gmpo":
            # the authors' J_i = (prod_t min[rho_t^sgn(A), clip(rho_t^sgn(A), e1, e2)]^sgn(A)) ** (1/|y_i|) * A_i,
            # e1 = e^-eps_low, e2 = e^eps_high (policy_loss refuses eps_low != eps_high: only e2 acts here)
            A = advantages[i].double()
            if float(A) == 0.0:
                continue  # a zero term
            sgn = 1.0 if float(A) > 0 else -1.0
            rho_s = torch.exp(lp - olp) ** sgn
            kept = torch.minimum(rho_s, rho_s.clamp(math.exp(-eps_low), math.exp(eps_high))) ** sgn
            w = _is_weight((olp - mu).mean(), off_policy, cap)
            total = total + w * kept.prod() ** (1.0 / lp.numel()) * A
        else:
            raise ValueError(variant)
    return ((penalty - total) / n - token_total / m_tokens).float()
