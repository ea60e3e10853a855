"""The decoupled off-policy correction: behaviour policy mu, proximal policy pi_prox, current pi_theta.

The clipped ratio of the policy loss is taken against pi_prox (the learner's recompute at the start of the
step); a constant importance weight corrects for the rollouts having been drawn from mu (the engine's
log-probs, possibly of older weights, and numerically not the learner's):

- sequence level (GSPO, GSPO-token): ``w_i = exp(mean_t(log pi_prox - log mu))``, length normalised like
  GSPO's own ratio;
- token level (GRPO): ``w_i,t = exp(log pi_prox_t - log mu_t)``.

``tis`` (truncated importance sampling) uses ``min(w, C)``; ``mis`` (masked importance sampling) uses 1
where ``1/C <= w <= C`` and 0 elsewhere (the sequence, or token, gets no gradient). ``none``: no weight.
The weight multiplies the sequence's (token's) clipped term and carries no gradient.

The product form ``prod_t pi_prox / mu`` is not offered for sequences: with 300 tokens at a per-token ratio
of 0.7 it is ``0.7**300 ~ 1e-46``; one long sequence would dominate or vanish. GSPO's ratio is itself the
geometric mean, and so is this weight.
"""

from __future__ import annotations

import math

import torch

from gspo_mcore import ops

MODES = ("none", "tis", "mis")


def off_policy_weights(
    prox_logp, behaviour_logp, cu_seqlens, loss_mask, *, mode: str, cap: float, level: str, cp_group=None
):
    """``(weights, metrics)``: per-sequence ``[B]`` (``level="sequence"``) or per-token ``[T]`` (``"token"``)
    constant weights, and 0-d detached metrics (sums over this micro-batch, for the caller to reduce):
    ``is_weight_sum`` / ``is_weight_count`` (raw weights, before truncation or masking), ``is_weight_min``,
    ``is_weight_max``, ``is_masked`` (sequences or tokens whose weight MIS sets to 0), ``mu_kl_sum`` (k3
    estimate of KL(mu || pi_prox) summed over counted tokens) and ``mu_kl_count``.

    ``mode="none"`` gives all-ones weights (the metrics are still computed, so the mismatch is visible).
    """
    if mode not in MODES:
        raise ValueError(f"off-policy mode must be one of {MODES}, got {mode!r}")
    if level not in ("sequence", "token"):
        raise ValueError(f"level must be 'sequence' or 'token', got {level!r}")
    if not (isinstance(cap, (int, float)) and math.isfinite(cap) and cap > 1):
        raise ValueError(f"off-policy cap must be a finite number > 1, got {cap!r}")
    m = loss_mask.to(torch.float32)
    counted = m != 0
    d = torch.where(counted, prox_logp.detach().float() - behaviour_logp.detach().float(), 0.0)  # (T,)
    # k3 of KL(mu || pi_prox) with samples from mu: r = pi_prox / mu, k3 = r - 1 - log r
    k3 = torch.where(counted, torch.exp(d) - 1.0 - d, 0.0)
    kl_parts = [k3.sum(), m.sum()]
    if level == "sequence":
        sums = ops.segment_sum(d, cu_seqlens, m)
        counts = ops.segment_sum(m, cu_seqlens, m)
        sums, counts = ops.all_reduce_sum(sums, counts, group=cp_group)
        valid = counts > 0
        raw = torch.where(valid, torch.exp(sums / counts.clamp(min=1.0)), 1.0)  # (B,)
    else:
        valid = counted
        raw = torch.exp(d)  # (T,)  1 where not counted
    if cp_group is not None:
        kl_parts = list(ops.all_reduce_sum(*[p.reshape(1) for p in kl_parts], group=cp_group))
        kl_parts = [p.reshape(()) for p in kl_parts]
    if mode == "tis":
        w = torch.clamp(raw, max=cap)
        masked = torch.zeros_like(raw, dtype=torch.bool)
    elif mode == "mis":
        masked = valid & ((raw < 1.0 / cap) | (raw > cap))
        w = torch.where(masked, 0.0, 1.0)
    else:
        w = torch.ones_like(raw)
        masked = torch.zeros_like(raw, dtype=torch.bool)
    vf = valid.float()
    if level == "token" and cp_group is not None:
        # token weights live on the rank that holds the token: the extremes need a MAX over the group
        import torch.distributed as dist

        ext = torch.stack([-_masked_min(raw, valid), _masked_max(raw, valid)])
        dist.all_reduce(ext, op=dist.ReduceOp.MAX, group=cp_group)
        wmin, wmax = -ext[0], ext[1]
        sums = ops.all_reduce_sum(
            (raw * vf).sum().reshape(1), vf.sum().reshape(1), masked.float().sum().reshape(1), group=cp_group
        )
        wsum, wcount, nmask = (s.reshape(()) for s in sums)
    else:
        wmin, wmax = _masked_min(raw, valid), _masked_max(raw, valid)
        wsum, wcount, nmask = (raw * vf).sum(), vf.sum(), masked.float().sum()
    metrics = {
        "is_weight_sum": wsum,
        "is_weight_count": wcount,
        "is_weight_min": wmin,
        "is_weight_max": wmax,
        "is_masked": nmask,
        "mu_kl_sum": kl_parts[0],
        "mu_kl_count": kl_parts[1],
    }
    return w.detach(), {k: v.detach() for k, v in metrics.items()}


def _masked_min(v, valid):
    return torch.where(valid, v, math.inf).amin() if v.numel() else v.new_tensor(math.inf)


def _masked_max(v, valid):
    return torch.where(valid, v, -math.inf).amax() if v.numel() else v.new_tensor(-math.inf)
