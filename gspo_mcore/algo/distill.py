"""On-policy distillation's per-token advantages (docs/distill.md): a teacher scores the student's own samples.

For a response ``y`` sampled from the student (the behaviour policy ``pi_old``), each counted token gets

    A_t = kl_coef * (log p_teacher(y_t | x, y_<t) - log pi_old(y_t | x, y_<t)) + reward_weight * R_t

where ``R_t`` is the task reward's advantage of that token (the group-relative ``A_i``, or ``A_i + d_i,t``
with per-token shaping). The first term is minus the per-token sample of the reverse KL
``KL(pi_old || p_teacher)``; GSPO-token's per-token advantages carry ``A_t`` into the loss. Tokens outside
the loss mask get 0 (and a NaN there never reaches the result).

Tensors are aligned with ``tokens[1:]`` of one sample, or of several packed back to back (``[T]``): the
functions are per token and need no sequence boundaries.
"""

from __future__ import annotations

import math

import torch

from gspo_mcore.ops._checks import check_length, check_tensor


def distill_advantages(
    teacher_logp: torch.Tensor,
    student_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    kl_coef: float = 1.0,
    reward_advantages: torch.Tensor | None = None,
    reward_weight: float = 0.0,
) -> torch.Tensor:
    """``A_t`` (module docstring) as float32 ``[T]``; 0 where ``loss_mask`` is 0.

    ``teacher_logp``, ``student_logp``: ``[T]`` log-probs of the sampled tokens; ``loss_mask``: ``[T]`` in
    {0, 1}; ``reward_advantages``: ``[T]`` (needed when ``reward_weight != 0``).
    """
    _check_aligned(teacher_logp=teacher_logp, student_logp=student_logp, loss_mask=loss_mask)
    for name, v in (("kl_coef", kl_coef), ("reward_weight", reward_weight)):
        if isinstance(v, bool) or not (isinstance(v, (int, float)) and math.isfinite(v)):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
    counted = loss_mask != 0
    adv = kl_coef * (teacher_logp.double() - student_logp.double())
    if reward_weight != 0:
        if reward_advantages is None:
            raise ValueError("reward_weight != 0 needs reward_advantages")
        _check_aligned(teacher_logp=teacher_logp, reward_advantages=reward_advantages)
        adv = adv + reward_weight * reward_advantages.double()
    return torch.where(counted, adv, 0.0).float()


def distill_kl(teacher_logp: torch.Tensor, student_logp: torch.Tensor, loss_mask: torch.Tensor) -> tuple[float, int]:
    """``(sum, count)`` over counted tokens of ``log pi_old(y_t) - log p_teacher(y_t)``: summed and divided
    by the count over a batch, the per-token estimate (``k1``, unbiased under the student's samples) of
    ``KL(pi_old || p_teacher)``."""
    _check_aligned(teacher_logp=teacher_logp, student_logp=student_logp, loss_mask=loss_mask)
    counted = loss_mask != 0
    d = torch.where(counted, student_logp.double() - teacher_logp.double(), 0.0)
    return float(d.sum()), int(counted.sum())


def _check_aligned(**tensors: torch.Tensor) -> None:
    """Every tensor 1-D with the first one's length."""
    (first, t0), *rest = tensors.items()
    check_tensor(first, t0, dim=1)
    for name, t in rest:
        check_tensor(name, t, dim=1)
        check_length(name, t, t0.shape[0], first)
