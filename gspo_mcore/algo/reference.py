"""An independent, literal implementation of the policy losses (the formulas of docs/gspo.md).

It loops over sequences and writes each formula as printed (``torch.minimum`` of the unclipped and
clipped terms), so tests can hold :func:`gspo_mcore.algo.policy_loss` (compiled segment ops, fused
sequence terms) against it, value and gradient. Not for production: it is slow and syncs with the host.
"""

from __future__ import annotations

import torch


def policy_loss_reference(
    logp, old_logp, advantages, cu_seqlens, loss_mask, *, variant, eps_low, eps_high, num_sequences=None
):
    n = num_sequences if num_sequences is not None else cu_seqlens.numel() - 1
    total = logp.new_zeros((), dtype=torch.float64)
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    for i in range(cu_seqlens.numel() - 1):
        a, b = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
        m = loss_mask[a:b].bool()
        lp = logp[a:b][m].double()
        olp = old_logp[a:b][m].double()
        if lp.numel() == 0:
            continue  # a sequence with no counted token contributes nothing
        if variant == "gspo":
            A = advantages[i].double()
            s = torch.exp((lp - olp).mean())
            total = total + torch.minimum(s * A, s.clamp(lo, hi) * A)
        elif variant == "gspo_token":
            A = (
                advantages[a:b][m].double()
                if advantages.numel() == logp.numel()
                else advantages[i].double().expand(lp.shape)
            )
            s = torch.exp((lp - olp).mean()).detach()
            s_t = s * torch.exp(lp - lp.detach())
            total = total + torch.minimum(s_t * A, s_t.clamp(lo, hi) * A).mean()
        elif variant == "grpo":
            A = advantages[i].double()
            w = torch.exp(lp - olp)
            total = total + torch.minimum(w * A, w.clamp(lo, hi) * A).mean()
        else:
            raise ValueError(variant)
    return -(total / n).float()
