"""RMSNorm over the last dimension with a compiled CPU forward and backward.

``y = x * rstd * weight`` with ``rstd = 1 / sqrt(mean(x^2) + eps)`` per row, computed in float32 and rounded
once to ``x``'s dtype (float32 or bfloat16), as ``torch.nn.RMSNorm``. The forward keeps ``rstd`` (one float per
row) for the backward, which is one pass over each row (torch's backward is about ten element-wise ops over the
whole tensor). The kernels are ``csrc/rmsnorm_cpu.cpp``; their pure-torch twins are
:func:`gspo_mcore.ops.reference.rms_norm_forward` and ``rms_norm_backward``, used off the CPU and without the
extension.
"""

from __future__ import annotations

import torch

from gspo_mcore.ops import _backend


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float):
        y, rstd = _backend.cpu_kernel("rms_norm_forward", x)(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _backend.cpu_kernel("rms_norm_backward", x)(grad.contiguous(), x, weight, rstd)
        return dx, dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x [..., H]`` with ``weight [H]`` (same dtype as ``x``); see the module docstring."""
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must have shape [{x.shape[-1]}] (x's last dimension), got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight is {weight.dtype} but x is {x.dtype}: they must match")
    return _RMSNorm.apply(x.contiguous(), weight, float(eps))
