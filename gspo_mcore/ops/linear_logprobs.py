"""Per-token log-probs (and entropy) straight from the final hidden states and the LM-head weight.

``linear_token_logprobs`` never holds more than ``[T, chunk]`` logits: it walks this rank's vocabulary slice
in chunks of ``chunk`` columns, computes each chunk's logits with one matmul, reduces them at once to the five
per-token statistics of :func:`gspo_mcore.ops.token_logprobs` (compiled kernel, or its pure-torch twin) and
merges the chunks' statistics with an online log-sum-exp. ONE all-reduce of those packed statistics over the
tensor-parallel group then finishes the full-vocabulary log-sum-exp, exactly as for ``token_logprobs``.

The backward recomputes each chunk's logits, turns them into ``d logits`` with the existing backward kernel
and folds that into ``d hidden`` (``+= d_logits @ W_c``) and ``d weight`` (``[c] = d_logits^T @ hidden``)
before moving on: neither the logits nor their gradient ever exist as ``[T, V]`` tensors. The
autograd graph holds only the hidden states, the weight, the targets and two ``[T]`` vectors.
"""

from __future__ import annotations

import torch

from gspo_mcore.ops import _backend
from gspo_mcore.ops._checks import check_length, check_tensor
from gspo_mcore.ops.gemm import mm_rows
from gspo_mcore.ops.logprobs import check_temperature, reduce_vocab_stats
from gspo_mcore.ops.reference import MAX, OWNED, SUMEXP, TARGET, XSUM

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEFAULT_CHUNK = 4096


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int = 0,
    tp_group=None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk: int = DEFAULT_CHUNK,
):
    """``token_logprobs(hidden @ weight.T, targets, ...)`` without building the ``[T, V_local]`` logits.

    Args:
        hidden: ``[T, H]`` final hidden states (float32, bfloat16 or float16), the same on every TP rank.
        weight: ``[V_local, H]`` this rank's rows of the output (LM-head) weight, same dtype and device.
        targets: ``[T]`` int64 global vocabulary ids.
        vocab_start: first global id of this rank's slice (the rank owns ``[vocab_start, vocab_start+V_local)``).
        tp_group: the torch.distributed group the vocabulary is split over (``None``: not split).
        temperature: the policy is ``softmax(hidden @ weight.T / temperature)``.
        return_entropy: also return the per-token entropy of the full distribution.
        chunk: vocabulary columns per chunk: the most logits held at once is ``[T, chunk]``.

    Each chunk's logits are computed in the inputs' dtype (as the LM head computes them) and reduced in
    float32. The gradient of ``hidden`` is this rank's contribution ``d_logits_local @ W_local``: with a
    ``tp_group`` the caller sums it over the group (Megatron's column-parallel input region does, in
    backward). The gradient of ``weight`` is complete for this rank's rows.

    Returns ``logp`` ``[T]`` float32, or ``(logp, entropy)``; differentiable with respect to ``hidden`` and
    ``weight``. Bad shapes, dtypes, devices, temperature, chunk, or targets outside the vocabulary raise
    ``ValueError``/``TypeError`` naming the argument.
    """
    check_tensor("hidden", hidden, dim=2, dtypes=_DTYPES)
    check_tensor("weight", weight, dim=2, dtypes=(hidden.dtype,), device=hidden.device)
    check_tensor("targets", targets, dim=1, dtypes=(torch.int64,), device=hidden.device)
    check_length("targets", targets, hidden.shape[0], "hidden's first dimension (T)")
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"weight has hidden size {weight.shape[1]} (shape {tuple(weight.shape)}) but hidden has "
            f"{hidden.shape[1]} (shape {tuple(hidden.shape)})"
        )
    if weight.shape[0] == 0:
        raise ValueError("weight must have at least one vocabulary row (V_local >= 1)")
    check_temperature(temperature)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an int >= 1 (vocabulary columns per chunk), got {chunk!r}")
    if tp_group is None and vocab_start != 0:
        raise ValueError(
            f"vocab_start={vocab_start} needs tp_group: without a tensor-parallel group the "
            "weight holds the whole vocabulary and vocab_start must be 0"
        )
    logp, entropy = _LinearTokenLogprobs.apply(
        hidden.contiguous(),
        weight.contiguous(),
        targets,
        int(vocab_start),
        1.0 / float(temperature),
        tp_group,
        bool(return_entropy),
        int(chunk),
    )
    return (logp, entropy) if return_entropy else logp


def merge_stats(stats: torch.Tensor) -> torch.Tensor:
    """The statistics ``[T, 5]`` of a union of disjoint vocabulary slices, from theirs, ``[C, T, 5]``.

    Online log-sum-exp: ``M = max_c m_c``, ``S = sum_c exp(m_c - M) s_c`` and the entropy sum taken
    relative to ``M``, ``X = sum_c exp(m_c - M) (x_c + (m_c - M) s_c)``; target logit and owner count add.
    """
    m = stats[..., MAX]  # (C, T)
    big_m = m.amax(dim=0)  # (T,)
    shift = m - big_m
    a = shift.exp()
    s = stats[..., SUMEXP]
    out = torch.empty_like(stats[0])
    out[:, MAX] = big_m
    out[:, SUMEXP] = (a * s).sum(0)
    out[:, XSUM] = (a * (stats[..., XSUM] + shift * s)).sum(0)
    out[:, TARGET] = stats[..., TARGET].sum(0)
    out[:, OWNED] = stats[..., OWNED].sum(0)
    return out


def _chunks(num_rows: int, chunk: int):
    return [(c, min(c + chunk, num_rows)) for c in range(0, num_rows, chunk)]


class _LinearTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_start, inv_temperature, tp_group, with_entropy, chunk):
        ctx.set_materialize_grads(False)
        stats_op = _backend.op("token_logprob_stats")
        parts = []
        for c0, c1 in _chunks(weight.shape[0], chunk):
            logits = hidden @ weight[c0:c1].T  # (T, c) in the inputs' dtype, as the LM head computes it
            parts.append(stats_op(logits, targets, vocab_start + c0, inv_temperature, with_entropy))
            del logits
        stats = merge_stats(torch.stack(parts)) if len(parts) > 1 else parts[0]
        logp, lse, entropy = reduce_vocab_stats(stats, targets, tp_group)
        ctx.vocab_start, ctx.inv_temperature, ctx.chunk = vocab_start, inv_temperature, chunk
        if not with_entropy:
            entropy = None
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        grad_logp = grad_logp.float().contiguous()
        use_entropy = entropy is not None and grad_entropy is not None
        grad_entropy = grad_entropy.float().contiguous() if use_entropy else None
        backward_op = _backend.op("token_logprob_backward")
        # d hidden accumulates over chunks in float32 (each chunk's product is rounded once to the dtype).
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        for c0, c1 in _chunks(weight.shape[0], ctx.chunk):
            w = weight[c0:c1]
            logits = hidden @ w.T  # (T, c), recomputed
            d_logits = backward_op(
                logits,
                targets,
                lse,
                grad_logp,
                entropy if use_entropy else None,
                grad_entropy,
                ctx.vocab_start + c0,
                ctx.inv_temperature,
            )
            del logits
            if need_h:
                if hidden.dtype == torch.float32:
                    grad_h.addmm_(d_logits, w)
                else:  # the product's output is narrow ([T, H]): rows split across the threads
                    grad_h += mm_rows(d_logits, w)
            if need_w:
                torch.mm(d_logits.T, hidden, out=grad_w[c0:c1])
        if need_h:
            grad_h = grad_h.to(hidden.dtype)
        return grad_h, grad_w, None, None, None, None, None, None
