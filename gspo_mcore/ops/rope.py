"""Rotary position embedding with a compiled CPU kernel: each row read once, computed in float32, rounded once.

``rope(x, freqs)`` is Megatron-Core's non-interleaved RoPE (``_apply_rotary_pos_emb_bshd``: ``x cos + rotate_half(x)
sin`` with ``rotate_half([x1, x2]) = [-x2, x1]``) for ``x [S, B, H, D]`` and angles ``freqs [S, 1 or B, 1, D]`` whose
two halves are equal (``cat(f, f)``, as Megatron and Hugging Face build them). Megatron's unfused version takes cos and
sin at every call and makes about eight passes, rounding to the model's dtype between them; here cos and sin are
taken once per ``freqs`` tensor (every layer of a forward gets the same one) and the backward is the same rotation
with the sine negated. Kernel: ``csrc/rope_cpu.cpp``; twin: :func:`gspo_mcore.ops.reference.rope`, used off the CPU and
without the extension. Tests: ``tests/ops/test_ops_rope.py``.
"""

from __future__ import annotations

import weakref

import torch

from gspo_mcore.ops import _backend

_angles: tuple[weakref.ref, int, torch.Tensor, torch.Tensor] | None = None


def angles(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(cos, sin)`` of the first half of ``freqs [S, B', 1, D]``, float32 ``[S, B', D/2]``, or ``None`` when its two
    halves differ (another RoPE layout). Cached for the last ``freqs`` seen."""
    global _angles
    if _angles is not None and _angles[0]() is freqs and _angles[1] == freqs._version:
        return _angles[2], _angles[3]
    half = freqs.shape[-1] // 2
    f = freqs.reshape(freqs.shape[0], freqs.shape[1], -1)
    if f.shape[-1] != 2 * half or not torch.equal(f[..., :half], f[..., half:]):
        return None
    lo = f[..., :half].float()
    cos, sin = torch.cos(lo).contiguous(), torch.sin(lo).contiguous()
    _angles = (weakref.ref(freqs), freqs._version, cos, sin)
    return cos, sin


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _backend.cpu_kernel("rope", x)(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        grad = grad.contiguous()
        return _backend.cpu_kernel("rope", grad)(grad, cos, sin, -1.0), None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [S, B, H, D]`` rotated by the angles of :func:`angles` (``cos, sin [S, 1 or B, D/2]``)."""
    if x.dim() != 4 or x.shape[-1] != 2 * cos.shape[-1] or cos.shape[0] != x.shape[0]:
        raise ValueError(f"rope: x {tuple(x.shape)} does not fit angles {tuple(cos.shape)}")
    return _Rope.apply(x.contiguous(), cos, sin)
