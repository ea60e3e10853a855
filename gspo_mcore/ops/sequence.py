"""GSPO's sequence-level importance ratio and clipping (the compiled op's Python entry)."""

from __future__ import annotations

import torch

from gspo_mcore.ops import _backend
from gspo_mcore.ops._checks import check_length, check_tensor


def gspo_sequence_terms(
    seq_logratio_sum: torch.Tensor,
    seq_token_count: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
):
    """Per-sequence GSPO terms from ``L_i * |y_i|`` (the summed token log-ratio) and ``|y_i|``.

    ``s_i = exp(seq_logratio_sum_i / |y_i|)``; ``term_i = -min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i)``.
    Returns ``(term, ratio, clipped, coef)``, float32 ``[B]``, where ``coef = d term / d seq_logratio_sum``
    (0 for clipped sequences). Only ``term`` is differentiable. A sequence with ``|y_i| = 0`` gives
    ``(0, 1, 0, 0)``.
    """
    check_tensor("seq_logratio_sum", seq_logratio_sum, dim=1)
    n = seq_logratio_sum.shape[0]
    for name, t in (("seq_token_count", seq_token_count), ("advantages", advantages)):
        check_tensor(name, t, dim=1, device=seq_logratio_sum.device)
        check_length(name, t, n, "seq_logratio_sum")
    return _backend.op("gspo_sequence_terms")(
        seq_logratio_sum.float().contiguous(),
        seq_token_count.float().contiguous(),
        advantages.float().contiguous(),
        float(eps_low),
        float(eps_high),
    )
