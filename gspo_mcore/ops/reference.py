"""Pure-torch twins of every compiled op: the specification, and the fallback without the extension.

Each function here computes exactly what the op of the same name in ``torch.ops.gspo_mcore`` computes,
in the plainest torch (it materialises float32 ``[T, V]`` tensors; it is not meant to be fast).
``token_logprobs`` is the end-to-end specification of :func:`gspo_mcore.ops.token_logprobs` on one rank.
"""

from __future__ import annotations

import torch

# Columns of the per-token statistics (see csrc/checks.h).
MAX, SUMEXP, XSUM, TARGET, OWNED = range(5)
NUM_STATS = 5


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, return_entropy: bool = False):
    """``log softmax(logits / temperature)[t, targets[t]]`` in float32 (and the entropy), by autograd.

    float64 logits are kept in float64 (tests use that as the high-precision reference); every other
    dtype is computed in float32, as the op does.
    """
    z = logits.double() if logits.dtype == torch.float64 else logits.float()
    logp_all = torch.log_softmax(z / temperature, dim=-1)  # (T, V)
    logp = logp_all.gather(1, targets[:, None]).squeeze(1)  # (T,)
    if not return_entropy:
        return logp
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def token_logprob_stats(logits, targets, vocab_start: int, inv_temperature: float, with_entropy: bool):
    z = logits.float() * inv_temperature  # (T, V)
    m = z.amax(dim=1)  # (T,)
    d = z - m[:, None]
    e = d.exp()
    local = targets - vocab_start
    owned = (local >= 0) & (local < z.shape[1])
    tgt = z.gather(1, local.clamp(0, z.shape[1] - 1)[:, None]).squeeze(1)
    out = torch.zeros(z.shape[0], NUM_STATS, dtype=torch.float32, device=z.device)
    out[:, MAX] = m
    out[:, SUMEXP] = e.sum(1)
    if with_entropy:
        out[:, XSUM] = (e * d).sum(1)
    out[:, TARGET] = torch.where(owned, tgt, 0.0)
    out[:, OWNED] = owned.float()
    return out


def token_logprob_backward(
    logits, targets, lse, grad_logp, entropy, grad_entropy, vocab_start: int, inv_temperature: float
):
    z = logits.float() * inv_temperature
    lp = z - lse[:, None]  # (T, V) log-probs of this slice
    p = lp.exp()
    d = -p * grad_logp[:, None]
    if entropy is not None:
        d = d - grad_entropy[:, None] * p * (lp + entropy[:, None])
    local = targets - vocab_start
    owned = (local >= 0) & (local < z.shape[1])
    rows = torch.nonzero(owned).squeeze(1)
    d[rows, local[rows]] += grad_logp[rows]
    return (d * inv_temperature).to(logits.dtype)


def token_logprob_grad_inplace_(
    logits, targets, lse, grad_logp, entropy, grad_entropy, vocab_start: int, inv_temperature: float
):
    """Overwrites ``logits`` with ``token_logprob_backward`` of the same arguments."""
    logits.copy_(
        token_logprob_backward(logits, targets, lse, grad_logp, entropy, grad_entropy, vocab_start, inv_temperature)
    )


def segment_sum(values, mask, cu_seqlens):
    counted = mask != 0
    seg = _segment_ids(cu_seqlens, values.shape[0])
    out = torch.zeros(cu_seqlens.shape[0] - 1, dtype=torch.float32, device=values.device)
    contrib = torch.where(counted, mask.double() * values.double(), 0.0)
    return out.double().index_add_(0, seg, contrib).float()


def segment_expand(grad, mask, cu_seqlens):
    seg = _segment_ids(cu_seqlens, mask.shape[0])
    return torch.where(mask != 0, mask * grad[seg], 0.0)


def gspo_sequence_terms(seq_logratio_sum, seq_token_count, advantages, eps_low: float, eps_high: float):
    valid = seq_token_count > 0
    cnt = torch.where(valid, seq_token_count, 1.0)
    ratio = torch.where(valid, torch.exp(seq_logratio_sum / cnt), 1.0)
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    a = advantages
    clipped = valid & (((a > 0) & (ratio > hi)) | ((a < 0) & (ratio < lo)))
    unclipped_term = -ratio * a
    term = torch.where(clipped, -ratio.clamp(lo, hi) * a, unclipped_term)
    term = torch.where(valid, term, 0.0)
    coef = torch.where(clipped | ~valid, 0.0, -a * ratio / cnt)
    # as the op: only `term` is differentiable (ratio, clipped and coef are metrics / coefficients)
    return term, ratio.detach(), clipped.float(), coef.detach()


def rms_norm_forward(x, weight, eps: float):
    """RMSNorm over the last dimension in float32, rounded once: ``(y, rstd)`` with ``rstd = 1 / sqrt(mean(x^2) +
    eps)`` float32 (float64 for float64 ``x``), one per row (flattened)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * weight.to(acc)).to(x.dtype), rstd.reshape(-1)


def rms_norm_backward(grad, x, weight, rstd):
    """``(dx, dweight)`` of :func:`rms_norm_forward`'s ``y`` for ``grad = dL/dy``, computed in float32, each rounded
    once to its input's dtype (float64 throughout for float64 inputs)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xf, g, w = x.to(acc), grad.to(acc), weight.to(acc)
    r = rstd.to(acc).reshape(*x.shape[:-1], 1)
    xhat = xf * r
    gw = g * w
    dx = r * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
    dw = (g * xhat).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


def swiglu_forward(h):
    """``silu(a) * b`` for ``h = [a, b]`` split in halves along the last dimension, in float32 (float64 for float64
    ``h``), rounded once."""
    acc = torch.promote_types(h.dtype, torch.float32)
    a, b = h.to(acc).chunk(2, dim=-1)
    return (torch.nn.functional.silu(a) * b).to(h.dtype)


def swiglu_backward(grad, h):
    """``dh = [d a, d b]`` of :func:`swiglu_forward` for ``grad = dL/dy``, in float32 (float64), rounded once."""
    acc = torch.promote_types(h.dtype, torch.float32)
    a, b = h.to(acc).chunk(2, dim=-1)
    g = grad.to(acc)
    s = torch.sigmoid(a)
    return torch.cat([g * b * s * (1 + a * (1 - s)), g * a * s], dim=-1).to(h.dtype)


def masked_softmax_(scores, mask, groups_per_batch: int, fill: float):
    """In place over ``scores [G, R, S]``: the entries ``mask [MB, SQ, S]`` marks (matrix ``g``'s row ``i`` reads
    mask row ``(0 if MB == 1 else g // groups_per_batch, i % SQ)``) set to ``fill``, then the softmax over ``S``,
    computed in float32 (float64 for float64 scores) and rounded once."""
    acc = torch.promote_types(scores.dtype, torch.float32)
    x = scores.to(acc)
    if mask is not None:
        G, R, S = scores.shape
        MB, SQ, _ = mask.shape
        full = mask[:, None, None].expand(MB, groups_per_batch if MB > 1 else G, R // SQ, SQ, S)
        x = x.masked_fill(full.reshape(G, R, S), fill)
    scores.copy_(torch.softmax(x, dim=-1))


def softmax_backward_(grad, probs):
    """``grad = probs * (grad - sum(grad * probs))`` over the last dimension, in place, in float32 (float64)."""
    acc = torch.promote_types(grad.dtype, torch.float32)
    g, p = grad.to(acc), probs.to(acc)
    grad.copy_(p * (g - (g * p).sum(-1, keepdim=True)))


def mm_rows(a, b, min_rows: int):
    """``a @ b``: the product :func:`gspo_mcore.ops.gemm.mm_rows` splits by rows across threads."""
    return a @ b


def accumulate_(dst, src) -> None:
    """``dst += src`` in place (float32 ``dst``): what :func:`gspo_mcore.ops.accumulate.accumulate_` computes in one
    pass."""
    dst.add_(src)


def rope(x, cos, sin, sign: float):
    """Rotary embedding of ``x [S, B, H, D]`` (halves ``[x1, x2]``) by ``cos, sin [S, 1 or B, D/2]`` (float32):
    ``[x1 cos - sign x2 sin, x2 cos + sign x1 sin]``, in float32 (float64 for float64 ``x``), rounded once."""
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    c, s = cos.to(wide)[:, :, None], sign * sin.to(wide)[:, :, None]
    x1, x2 = x.to(wide).chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def _segment_ids(cu_seqlens, num_tokens: int):
    """Sequence index of every token: (T,) int64."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(
        torch.arange(lengths.shape[0], device=cu_seqlens.device), lengths, output_size=num_tokens
    )


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
):
    """The specification of :func:`gspo_mcore.ops.linear_token_logprobs` on one rank, by autograd: the
    LM head's logits ``hidden @ weight.T`` in the inputs' dtype, then :func:`token_logprobs`."""
    return token_logprobs(hidden @ weight.T, targets, temperature=temperature, return_entropy=return_entropy)
