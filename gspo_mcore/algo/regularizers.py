"""Terms added to the policy loss: a KL penalty to a frozen reference policy and an entropy bonus.

Both are means over sequences of per-sequence token means, with the policy loss's global normaliser ``N``
(so that micro-batches and data-parallel ranks add up to the mini-batch's value, as for the policy loss):

- KL: ``kl_coef * (1/N) sum_i (1/|y_i|) sum_t k(logp_i,t, ref_i,t)``, with the per-token estimator
  ``k1 = logp - ref`` or ``k3 = exp(ref - logp) - (ref - logp) - 1`` (Schulman's unbiased, non-negative
  estimator of KL(pi_theta || pi_ref)); the reference log-probs are constants.
- Entropy bonus: ``-entropy_coef * (1/N) sum_i (1/|y_i|) sum_t H_i,t`` (maximising entropy lowers the loss),
  with ``H`` the per-token entropy of the full temperature-scaled distribution (differentiable).
"""

from __future__ import annotations

import torch

from gspo_mcore import ops

KL_ESTIMATORS = ("k1", "k3")


def kl_per_token(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """The per-token estimate of KL(pi_theta || pi_ref) at the sampled tokens, ``[T]`` float32."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    d = ref_logp.detach().float() - logp.float()  # log(pi_ref / pi_theta)
    if estimator == "k1":
        return -d
    return torch.exp(d) - d - 1.0


def sequence_mean_sum(values, cu_seqlens, mask, *, cp_group=None):
    """``sum_i (1/|y_i|) sum_t mask_t values_t`` over sequences with a counted token (0-d, differentiable).

    Masked-out tokens are zeroed before the sums, so a NaN there never reaches the value or the gradient.
    """
    m = mask.to(torch.float32)
    v = torch.where(m != 0, values, 0.0)
    sums = ops.segment_sum(v, cu_seqlens, m)
    counts = ops.segment_sum(m, cu_seqlens, m)
    sums, counts = ops.all_reduce_sum(sums, counts, group=cp_group)
    return torch.where(counts > 0, sums / counts.clamp(min=1.0), 0.0).sum()


def regularizer_loss(
    logp,
    cu_seqlens,
    loss_mask,
    *,
    num_sequences,
    ref_logp=None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy=None,
    entropy_coef: float = 0.0,
    cp_group=None,
):
    """``(loss, metrics)``: the KL penalty plus the entropy bonus of one (micro-)batch. Masked-out tokens never
    matter, not even through a NaN log-prob, reference log-prob or entropy there.

    ``num_sequences``: the global ``N`` (as for :func:`~gspo_mcore.algo.policy_loss`). ``ref_logp`` ``[T]``:
    reference log-probs (``None``: no KL term and no KL metric); ``entropy`` ``[T]``: per-token entropy
    (``None``: no bonus). ``metrics``: ``kl_sum`` and ``entropy_seq_sum``, the per-sequence means summed
    (divide by the number of counted sequences for a mean), detached.
    """
    inv_n = 1.0 / num_sequences
    loss = logp.new_zeros((), dtype=torch.float32)
    metrics = {}
    if ref_logp is not None:
        # masked-out tokens (prompt, environment spans) are zeroed BEFORE the per-token estimator: its terms
        # there are dropped by the sums, but a NaN log-prob would still make their gradient 0 * NaN = NaN
        counted = loss_mask != 0
        lp = torch.where(counted, logp.float(), 0.0)
        ref = torch.where(counted, ref_logp.detach().float(), 0.0)
        kl = sequence_mean_sum(kl_per_token(lp, ref, kl_estimator), cu_seqlens, loss_mask, cp_group=cp_group)
        metrics["kl_sum"] = kl.detach()
        if kl_coef:
            loss = loss + kl_coef * kl * inv_n
    if entropy is not None:
        ent = sequence_mean_sum(entropy.float(), cu_seqlens, loss_mask, cp_group=cp_group)
        metrics["entropy_seq_sum"] = ent.detach()
        if entropy_coef:
            loss = loss - entropy_coef * ent * inv_n
    return loss, metrics
