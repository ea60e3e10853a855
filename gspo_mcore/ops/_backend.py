"""Chooses, once at import, between the compiled ops and their pure-torch twins.

The compiled extension ``gspo_mcore._C`` registers the ops under ``torch.ops.gspo_mcore``; this module
adds their fake (meta) kernels and autograd formulas. Without the extension every op falls back to
:mod:`gspo_mcore.ops.reference`. Tests force either side with :func:`use_reference`.
"""

from __future__ import annotations

import contextlib
import os

import torch

from gspo_mcore.ops import reference

try:
    from gspo_mcore import _C  # noqa: F401  (loading it registers torch.ops.gspo_mcore.*)

    HAVE_EXTENSION = True
    IMPORT_ERROR: Exception | None = None
except ImportError as exc:  # pragma: no cover - exercised only on broken installs
    HAVE_EXTENSION = False
    IMPORT_ERROR = exc

_use_reference = not HAVE_EXTENSION or os.environ.get("GSPO_MCORE_REFERENCE_OPS", "0") not in ("", "0")


def compiled_enabled() -> bool:
    return not _use_reference


@contextlib.contextmanager
def use_reference(enabled: bool = True):
    """Run the ops through the pure-torch twins (``enabled=True``) or the compiled kernels."""
    global _use_reference
    if not enabled and not HAVE_EXTENSION:
        raise RuntimeError(f"the compiled extension gspo_mcore._C is not available: {IMPORT_ERROR}")
    old, _use_reference = _use_reference, enabled
    try:
        yield
    finally:
        _use_reference = old


def set_grad_buffer_cache(enabled: bool) -> None:
    """Keep (default) or not the last freed CPU gradient buffer of ``token_logprobs`` for reuse; ``False`` also
    frees what it holds (docs/performance.md, "Gradient buffer cache"). No-op without the extension."""
    if HAVE_EXTENSION:
        _C.set_grad_buffer_cache(bool(enabled))


def grad_buffer_cache_bytes() -> int:
    """Bytes the CPU gradient buffer cache holds now (0 without the extension)."""
    return int(_C.grad_buffer_cache_bytes()) if HAVE_EXTENSION else 0


_CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def cpu_kernel(name: str, x: torch.Tensor):
    """The element-wise op ``name`` for ``x``: the compiled kernel (or, with :func:`use_reference`, its twin) for a
    contiguous CPU tensor of float32 or bfloat16, which is what the CPU kernels take; the pure-torch twin
    otherwise (another device, another dtype)."""
    if x.device.type == "cpu" and x.dtype in _CPU_KERNEL_DTYPES and x.is_contiguous():
        return op(name)
    return getattr(reference, name)


def op(name: str):
    """The implementation of op ``name`` currently in use."""
    if _use_reference:
        return getattr(reference, name)
    return getattr(torch.ops.gspo_mcore, name)


if HAVE_EXTENSION:
    lib = "gspo_mcore::"

    @torch.library.register_fake(lib + "token_logprob_stats")
    def _(logits, targets, vocab_start, inv_temperature, with_entropy):
        return logits.new_empty((logits.shape[0], reference.NUM_STATS), dtype=torch.float32)

    @torch.library.register_fake(lib + "token_logprob_backward")
    def _(logits, targets, lse, grad_logp, entropy, grad_entropy, vocab_start, inv_temperature):
        return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)

    @torch.library.register_fake(lib + "token_logprob_grad_inplace_")
    def _(logits, targets, lse, grad_logp, entropy, grad_entropy, vocab_start, inv_temperature):
        return None

    @torch.library.register_fake(lib + "segment_sum")
    def _(values, mask, cu_seqlens):
        return values.new_empty((cu_seqlens.shape[0] - 1,))

    @torch.library.register_fake(lib + "segment_expand")
    def _(grad, mask, cu_seqlens):
        return mask.new_empty(mask.shape)

    @torch.library.register_fake(lib + "gspo_sequence_terms")
    def _(seq_logratio_sum, seq_token_count, advantages, eps_low, eps_high):
        return tuple(seq_logratio_sum.new_empty(seq_logratio_sum.shape) for _ in range(4))

    @torch.library.register_fake(lib + "rms_norm_forward")
    def _(x, weight, eps):
        return torch.empty_like(x), x.new_empty((x.numel() // max(x.shape[-1], 1),), dtype=torch.float32)

    @torch.library.register_fake(lib + "rms_norm_backward")
    def _(grad, x, weight, rstd):
        return torch.empty_like(x), torch.empty_like(weight)

    @torch.library.register_fake(lib + "swiglu_forward")
    def _(h):
        return h.new_empty((*h.shape[:-1], h.shape[-1] // 2))

    @torch.library.register_fake(lib + "swiglu_backward")
    def _(grad, h):
        return torch.empty_like(h)

    @torch.library.register_fake(lib + "masked_softmax_")
    def _(scores, mask, groups_per_batch, fill):
        return None

    @torch.library.register_fake(lib + "softmax_backward_")
    def _(grad, probs):
        return None

    @torch.library.register_fake(lib + "mm_rows")
    def _(a, b, min_rows):
        return a.new_empty((a.shape[0], b.shape[1]))

    @torch.library.register_fake(lib + "rope")
    def _(x, cos, sin, sign):
        return torch.empty_like(x)

    @torch.library.register_fake(lib + "accumulate_")
    def _(dst, src):
        return None

    # segment_sum is linear in `values`: its backward spreads each sequence's gradient over its
    # counted tokens.
    def _segment_sum_setup(ctx, inputs, output):
        _, mask, cu_seqlens = inputs
        ctx.save_for_backward(mask, cu_seqlens)

    def _segment_sum_backward(ctx, grad):
        mask, cu_seqlens = ctx.saved_tensors
        return torch.ops.gspo_mcore.segment_expand(grad.contiguous(), mask, cu_seqlens), None, None

    torch.library.register_autograd(lib + "segment_sum", _segment_sum_backward, setup_context=_segment_sum_setup)

    # gspo_sequence_terms: d term_i / d seq_logratio_sum_i = coef_i, computed by the forward kernel.
    def _terms_setup(ctx, inputs, output):
        ctx.mark_non_differentiable(*output[1:])  # ratio, clipped and coef are metrics / coefficients
        ctx.save_for_backward(output[3])

    def _terms_backward(ctx, grad_term, grad_ratio, grad_clipped, grad_coef):
        (coef,) = ctx.saved_tensors
        grad = None if grad_term is None else grad_term * coef
        return grad, None, None, None, None

    torch.library.register_autograd(lib + "gspo_sequence_terms", _terms_backward, setup_context=_terms_setup)
