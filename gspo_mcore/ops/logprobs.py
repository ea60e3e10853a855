"""Per-token log-probs (and entropy) of the sampled tokens, from vocabulary-parallel logits.

``token_logprobs`` never builds a float32 ``[T, V]`` tensor: a kernel writes five float32 statistics per
token of this rank's vocabulary slice, ONE all-reduce of those packed statistics finishes the
full-vocabulary log-sum-exp across the tensor-parallel group, and the backward writes ``d logits`` in one
pass per row, in the logits' dtype, with no communication.

With ``inplace_backward=True`` the backward writes ``d logits`` over the logits themselves, in the same one
pass, instead of into a new buffer: no ``[T, V]`` gradient buffer is allocated (the memory scheme of
Megatron-Core's fused cross-entropy and Liger-Kernel, which write it during the forward; writing it in the
backward keeps the logits readable until then, rounds the gradient once, and supports the entropy term).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from gspo_mcore.ops import _backend
from gspo_mcore.ops._checks import check_length, check_tensor
from gspo_mcore.ops.reference import MAX, OWNED, SUMEXP, TARGET, XSUM

_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_temperature(temperature: float) -> float:
    """``temperature`` as a float; ``ValueError`` unless it is a finite number > 0 (the policy is
    ``softmax(logits / temperature)``)."""
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    return float(temperature)


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int = 0,
    tp_group=None,
    return_entropy: bool = False,
    temperature: float = 1.0,
    inplace_backward: bool = False,
):
    """Log-probability of ``targets`` under ``softmax(logits / temperature)`` over the full vocabulary.

    Args:
        logits: ``[T, V_local]`` float32, bfloat16 or float16; contiguous along the vocabulary.
        targets: ``[T]`` int64 global vocabulary ids.
        vocab_start: first global id of this rank's slice (the rank owns ``[vocab_start, vocab_start+V_local)``).
        tp_group: the torch.distributed group the vocabulary is split over (``None``: not split).
        return_entropy: also return the per-token entropy of the full distribution.
        temperature: the sampling temperature; the policy is ``softmax(logits / temperature)``.
        inplace_backward: the backward writes the gradient over ``logits`` and returns them as their own
            gradient (no new ``[T, V]`` buffer). Only when autograd records (grad mode on and
            ``logits.requires_grad``); otherwise this is the ordinary path. The contract: ``logits`` must be a
            contiguous non-leaf tensor (e.g. the LM head's output), or a view spanning the whole of such a
            tensor; their values are kept until this op's backward runs and are gone after it. Another
            autograd node that saved them and runs its backward later raises torch's "modified by an
            inplace operation" error instead of reading the gradient, and so does a change to the logits
            between the forward and the backward. The entropy's gradient is supported. The backward may run
            once (no ``retain_graph`` re-runs).

    Returns:
        ``logp`` ``[T]`` float32, or ``(logp, entropy)``. Differentiable with respect to ``logits``.

    Raises ``ValueError``/``TypeError`` naming the argument for bad shapes, dtypes, devices, a
    temperature that is not positive, or targets outside the vocabulary. NaN or +inf in a row of logits
    gives NaN for that token (never a silently finite number). ``-inf`` entries are tokens of probability 0,
    as in ``torch.log_softmax``: the other tokens' log-probs stay finite (a row of only ``-inf`` gives NaN),
    but the entropy of such a row (and its gradient) is NaN (``0 * -inf``, as in the reference).
    """
    check_tensor("logits", logits, dim=2, dtypes=_LOGIT_DTYPES)
    check_tensor("targets", targets, dim=1, dtypes=(torch.int64,), device=logits.device)
    check_length("targets", targets, logits.shape[0], "logits' first dimension (T)")
    if logits.shape[1] == 0:
        raise ValueError("logits must have at least one vocabulary column (V_local >= 1)")
    check_temperature(temperature)
    if tp_group is None and vocab_start != 0:
        raise ValueError(
            f"vocab_start={vocab_start} needs tp_group: without a tensor-parallel group the "
            "logits hold the whole vocabulary and vocab_start must be 0"
        )
    if inplace_backward and torch.is_grad_enabled() and logits.requires_grad:
        _check_inplace_logits(logits)
        logp, entropy = _TokenLogprobsInplace.apply(
            logits, targets, int(vocab_start), 1.0 / float(temperature), tp_group, bool(return_entropy)
        )
        return (logp, entropy) if return_entropy else logp
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    logp, entropy = _TokenLogprobs.apply(
        logits, targets, int(vocab_start), 1.0 / float(temperature), tp_group, bool(return_entropy)
    )
    return (logp, entropy) if return_entropy else logp


def combine_stats(stats: torch.Tensor):
    """Full-vocabulary ``(logp, lse, entropy, owners)`` from per-rank statistics ``[R, T, 5]``.

    ``lse = M + log sum_r exp(m_r - M) s_r`` with ``M = max_r m_r``; the entropy is
    ``log S - sum_r exp(m_r - M) (w_r + (m_r - M) s_r) / S`` (all relative to ``M`` for accuracy).
    """
    m = stats[..., MAX]  # (R, T)
    big_m = m.amax(dim=0)  # (T,)
    # A row that is all -inf (or has +inf) gives M = +-inf; keep the arithmetic NaN there, as torch does.
    shift = m - big_m  # (R, T)
    a = shift.exp()
    s_r = stats[..., SUMEXP]
    big_s = (a * s_r).sum(0)
    log_s = big_s.log()
    lse = big_m + log_s
    logp = stats[..., TARGET].sum(0) - lse
    entropy = log_s - (a * (stats[..., XSUM] + shift * s_r)).sum(0) / big_s
    owners = stats[..., OWNED].sum(0)
    return logp, lse, entropy, owners


def _full_vocab_stats(logits, targets, vocab_start, inv_temperature, tp_group, with_entropy):
    """``(logp, lse, entropy)`` [T] float32 over the full vocabulary: this rank's statistics and ONE
    all-reduce of them across ``tp_group``."""
    stats = _backend.op("token_logprob_stats")(logits, targets, vocab_start, inv_temperature, with_entropy)
    return reduce_vocab_stats(stats, targets, tp_group)


def reduce_vocab_stats(stats, targets, tp_group):
    """``(logp, lse, entropy)`` [T] float32 over the full vocabulary from this rank's statistics ``stats``
    ``(T, 5)``: ONE all-reduce of them across ``tp_group`` (``None``: not split), then the combination; the
    targets are checked to be owned by exactly one rank."""
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        # One all-reduce: rank r writes its statistics into slot r of a zeroed buffer.
        world, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        packed = stats.new_zeros((world,) + tuple(stats.shape))  # (R, T, 5)
        packed[rank] = stats
        dist.all_reduce(packed, group=tp_group)
    else:
        packed = stats[None]
    logp, lse, entropy, owners = combine_stats(packed)
    _check_owned(owners, targets)
    return logp, lse, entropy


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, inv_temperature, tp_group, with_entropy):
        # An output the loss does not use gets grad None (not zeros): an entropy returned only for logging
        # then costs nothing in the backward, and cannot turn d logp into 0 * NaN where it is NaN.
        ctx.set_materialize_grads(False)
        logp, lse, entropy = _full_vocab_stats(logits, targets, vocab_start, inv_temperature, tp_group, with_entropy)
        ctx.vocab_start, ctx.inv_temperature, ctx.with_entropy = vocab_start, inv_temperature, with_entropy
        if not with_entropy:
            entropy = None
        ctx.save_for_backward(logits, targets, lse, entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        grad = _backend.op("token_logprob_backward")(*_backward_args(ctx, ctx.saved_tensors, grad_logp, grad_entropy))
        return grad, None, None, None, None, None


def _backward_args(ctx, saved, grad_logp, grad_entropy) -> tuple:
    """The backward ops' arguments ``(logits, targets, lse, grad_logp, entropy, grad_entropy, vocab_start,
    inv_temperature)`` from the saved ``(logits, targets, lse, entropy)`` and the upstream gradients (``None``
    where an output is unused: zero for logp, no entropy term)."""
    logits, targets, lse, entropy = saved
    if grad_logp is None:
        grad_logp = torch.zeros_like(lse)
    use_entropy = entropy is not None and grad_entropy is not None
    return (
        logits,
        targets,
        lse,
        grad_logp.float().contiguous(),
        entropy if use_entropy else None,
        grad_entropy.float().contiguous() if use_entropy else None,
        ctx.vocab_start,
        ctx.inv_temperature,
    )


def _check_inplace_logits(logits: torch.Tensor) -> None:
    """Refuses logits that must not be overwritten: they must be contiguous and not a leaf, and span all of
    their storage (``logits`` itself, or a view spanning the whole of its base)."""
    if not logits.is_contiguous():
        raise ValueError(
            f"token_logprobs(inplace_backward=True) overwrites the logits, which must be contiguous "
            f"(got shape {tuple(logits.shape)}, strides {logits.stride()}); pass a contiguous "
            "tensor or use inplace_backward=False"
        )
    base = logits._base
    if base is not None and not (
        base.is_contiguous() and base.numel() == logits.numel() and base.data_ptr() == logits.data_ptr()
    ):
        raise ValueError(
            f"token_logprobs(inplace_backward=True): logits {tuple(logits.shape)} are a view of part "
            f"of a larger tensor {tuple(base.shape)}, whose other elements must not be "
            "overwritten; pass a tensor of their own (e.g. .clone()) or inplace_backward=False"
        )
    owner = logits if base is None else base
    if owner.is_leaf:
        raise ValueError(
            "token_logprobs(inplace_backward=True) cannot overwrite logits that are a leaf tensor "
            "requiring grad (its .grad would be lost); pass the output of the layer that computed "
            "them, or use inplace_backward=False"
        )


class _TokenLogprobsInplace(torch.autograd.Function):
    """As :class:`_TokenLogprobs`, but the backward writes ``d logits`` over the logits themselves (which the
    forward saved) instead of into a new ``[T, V]`` buffer, and returns them as the gradient. The logits keep
    their values until then; the backward bumps their version, so any other autograd node that saved them
    and runs later raises torch's "modified by an inplace operation" error instead of reading the gradient."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, inv_temperature, tp_group, with_entropy):
        ctx.set_materialize_grads(False)
        logp, lse, entropy = _full_vocab_stats(logits, targets, vocab_start, inv_temperature, tp_group, with_entropy)
        ctx.vocab_start, ctx.inv_temperature, ctx.consumed = vocab_start, inv_temperature, False
        if not with_entropy:
            entropy = None
        ctx.save_for_backward(logits, targets, lse, entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        if ctx.consumed:
            raise RuntimeError(
                "token_logprobs(inplace_backward=True): the backward already ran once and wrote the "
                "gradient over the logits; it cannot run again (retain_graph)"
            )
        saved = ctx.saved_tensors  # raises if the logits were modified since the forward
        ctx.consumed = True
        logits = saved[0]
        _backend.op("token_logprob_grad_inplace_")(*_backward_args(ctx, saved, grad_logp, grad_entropy))
        torch.autograd.graph.increment_version(logits)
        return logits, None, None, None, None, None


def _check_owned(owners: torch.Tensor, targets: torch.Tensor) -> None:
    """Every target id must belong to exactly one rank's slice (i.e. lie inside the vocabulary)."""
    if owners.numel() == 0:
        return
    if owners.device.type == "cpu":
        bad = owners != 1
        if bool(bad.any()):
            t = int(torch.nonzero(bad)[0, 0])
            raise ValueError(
                f"targets[{t}]={int(targets[t])} is outside the vocabulary ({int(bad.sum())} target(s) out of range)"
            )
    else:
        torch._assert_async((owners == 1).all(), "targets outside the vocabulary")
