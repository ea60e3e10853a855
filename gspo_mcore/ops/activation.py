"""SwiGLU with a compiled CPU forward and backward.

``swiglu(h) = silu(a) * b`` for ``h = [a, b]`` split in halves along the last dimension, computed in float32 and
rounded once to ``h``'s dtype (float32 or bfloat16). The backward writes both halves of ``dh`` in one pass (eager
torch: two multiplies, silu's backward and a cat). Kernels: ``csrc/activation_cpu.cpp``; pure-torch twins:
:func:`gspo_mcore.ops.reference.swiglu_forward` and ``swiglu_backward``, used off the CPU and without the extension.
"""

from __future__ import annotations

import torch

from gspo_mcore.ops import _backend


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        ctx.save_for_backward(h)
        return _backend.cpu_kernel("swiglu_forward", h)(h)

    @staticmethod
    def backward(ctx, grad):
        (h,) = ctx.saved_tensors
        return _backend.cpu_kernel("swiglu_backward", h)(grad.contiguous(), h)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` for ``h [..., 2F] = [a, b]``: ``[..., F]``; see the module docstring."""
    if h.dim() == 0 or h.shape[-1] % 2:
        raise ValueError(f"swiglu: h's last dimension must be even (the two halves), got shape {tuple(h.shape)}")
    return _SwiGLU.apply(h.contiguous())
