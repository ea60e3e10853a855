"""Per-sequence reductions over packed (THD) segments given ``cu_seqlens``.

``segment_sum`` returns one partial sum per sequence over the tokens this rank holds; with context
parallelism each rank holds part of every sequence, and ``all_reduce_sum`` (one all-reduce of a packed
``[k, B]`` tensor) completes the sums. Its backward is the identity: every rank's tokens receive the
gradient of the full sum, so no communication is needed on the way back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gspo_mcore.ops import _backend
from gspo_mcore.ops._checks import check_cu_seqlens, check_length, check_tensor

_FLOAT = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def segment_sum(values: torch.Tensor, cu_seqlens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``out[b] = sum_{t in [cu[b], cu[b+1]), mask[t] != 0} mask[t] * values[t]``: float32 ``[B]``.

    Differentiable with respect to ``values``. Masked-out tokens never count, even if their value is NaN.
    """
    check_tensor("values", values, dim=1, dtypes=_FLOAT)
    check_cu_seqlens(cu_seqlens, values.shape[0], values.device)
    mask = _as_mask(mask, values)
    return _backend.op("segment_sum")(values.float().contiguous(), mask, cu_seqlens.contiguous())


def segment_mean(values: torch.Tensor, cu_seqlens: torch.Tensor, mask: torch.Tensor | None = None, *, cp_group=None):
    """Masked mean of ``values`` within each sequence, and each sequence's counted-token count.

    With ``cp_group`` the sums and counts are partial on each rank and are completed with one all-reduce.
    A sequence with no counted token has mean 0. Returns ``(mean [B], count [B])``, float32.
    """
    check_tensor("values", values, dim=1, dtypes=_FLOAT)
    check_cu_seqlens(cu_seqlens, values.shape[0], values.device)
    mask = _as_mask(mask, values)
    sums = _backend.op("segment_sum")(values.float().contiguous(), mask, cu_seqlens.contiguous())
    counts = _backend.op("segment_sum")(mask, mask, cu_seqlens.contiguous()).detach()
    sums, counts = all_reduce_sum(sums, counts, group=cp_group)
    return torch.where(counts > 0, sums / counts.clamp(min=1.0), 0.0), counts


def all_reduce_sum(*partials: torch.Tensor, group=None):
    """Sum per-sequence partials ``[B]`` over ``group`` in ONE all-reduce; identity backward."""
    if group is None or dist.get_world_size(group) == 1:
        return partials
    return _AllReduceSum.apply(group, *partials)


def _as_mask(mask, values):
    if mask is None:
        return torch.ones_like(values, dtype=torch.float32)
    check_tensor("mask", mask, dim=1, device=values.device)
    check_length("mask", mask, values.shape[0], "the token dimension (T)")
    return mask.to(torch.float32).contiguous()


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *partials):
        packed = torch.stack([p.float() for p in partials])  # (k, B)
        dist.all_reduce(packed, group=group)
        return tuple(packed.unbind(0))

    @staticmethod
    def backward(ctx, *grads):
        return (None, *grads)
