"""The attention's softmax, in place, with compiled CPU kernels: the mask applied and the softmax taken in one pass
over each row, and its backward written over the incoming gradient. Kernels: ``csrc/softmax_cpu.cpp``; pure-torch
twins: :func:`gspo_mcore.ops.reference.masked_softmax_` and ``softmax_backward_``, used off the CPU, for other
dtypes and without the extension."""

from __future__ import annotations

import torch

from gspo_mcore.ops import _backend


def masked_softmax_(scores: torch.Tensor, mask: torch.Tensor | None, groups_per_batch: int, fill: float) -> None:
    """Over ``scores [G, R, S]`` in place: the entries ``mask [MB, SQ, S]`` (bool, True: masked) marks set to ``fill``,
    then the softmax over ``S``. Matrix ``g``'s row ``i`` reads mask row ``(0 if MB == 1 else g // groups_per_batch,
    i % SQ)``: the attention's score matrices, ``groups_per_batch`` per sequence, each with its query heads folded
    into the rows."""
    _backend.cpu_kernel("masked_softmax_", scores)(scores, mask, int(groups_per_batch), float(fill))


def softmax_backward_(grad: torch.Tensor, probs: torch.Tensor) -> None:
    """``grad = probs * (grad - sum(grad * probs, -1))`` in place: the softmax's backward."""
    _backend.cpu_kernel("softmax_backward_", grad)(grad, probs)
