"""Context parallelism (CP) in the learner's data path: each micro-batch split over the CP group.

Megatron's load-balanced layout: every row of ``S`` positions (``S`` a multiple of ``2 * CP``; the
micro-batch builder pads to it) is cut into ``2 * CP`` chunks; CP rank ``r`` keeps chunks ``r`` and
``2CP-1-r`` of every row (see :func:`gspo_mcore.platform.cp_attention.load_balanced_positions`), for the
tokens, position ids, targets, loss mask, old log-probs and the optional per-token loss inputs
(per-token advantages, behaviour and reference log-probs) alike. The rotary table is sliced the same
way by Megatron, so each kept position keeps its global angle. Per-sequence advantages stay whole.

The loss then sees this rank's part of every sequence: ``cu_seqlens`` are the local offsets, and the
policy loss completes its per-sequence sums with one packed all-reduce over the CP group
(:func:`gspo_mcore.ops.all_reduce_sum`); every CP rank computes the full loss value, and the gradient that
reaches its tokens is exactly the unsplit sequence's. Forward-only log-probs are put back in place with
:func:`unsplit` (zeros elsewhere) and summed over the CP group.

Only ``"padded"`` micro-batches split (a row per sample): on GPU the THD path is Transformer Engine's own
(``cu_seqlens`` per CP rank, see :func:`split_thd`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from gspo_mcore.learner.batching import MicroBatch
from gspo_mcore.platform.cp_attention import load_balanced_positions


def pad_multiple(cp_size: int) -> int:
    """Row lengths must be a multiple of this for a CP split: ``2 * CP``."""
    return 2 * cp_size


def split_padded(mb: MicroBatch, cp_size: int, cp_rank: int) -> MicroBatch:
    """This CP rank's part of a ``"padded"`` micro-batch (rows of width ``S``, ``S % (2 CP) == 0``)."""
    if mb.attention_mask is not None or mb.packed_seq_params is not None:
        raise ValueError("split_padded takes a 'padded' micro-batch (a row per sample)")
    rows, width = mb.tokens.shape  # (R, S)
    keep = load_balanced_positions(width, cp_size, cp_rank).to(mb.tokens.device)  # (S/CP,)
    flat = (torch.arange(rows, device=keep.device)[:, None] * width + keep[None, :]).reshape(-1)  # (R*S/CP,)
    local = width // cp_size

    def per_token(x):  # (R*S,) -> (R*S/CP,)
        return x.reshape(rows, width)[:, keep].reshape(-1)

    return replace(
        mb,
        tokens=mb.tokens[:, keep].contiguous(),
        position_ids=mb.position_ids[:, keep].contiguous(),
        targets=per_token(mb.targets),
        loss_mask=per_token(mb.loss_mask),
        old_logprobs=per_token(mb.old_logprobs),
        **_split_token_fields(mb, per_token),
        cu_seqlens=torch.arange(rows + 1, dtype=torch.int64, device=mb.cu_seqlens.device) * local,
        cp_positions=flat,
        unsplit_cu_seqlens=mb.cu_seqlens,
    )


TOKEN_FIELDS = ("token_advantages", "behaviour_logprobs", "ref_logprobs")


def _split_token_fields(mb: MicroBatch, per_token) -> dict:
    """The micro-batch's optional per-token loss inputs (those it carries), split like the old log-probs."""
    return {name: per_token(getattr(mb, name)) for name in TOKEN_FIELDS if getattr(mb, name) is not None}


def unsplit(values: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``values`` of this CP rank's part of ``mb`` put back in the unsplit positions (zeros at the
    other ranks' positions: a sum over the CP group completes them), and the unsplit ``cu_seqlens``."""
    if mb.cp_positions is None:
        return values, mb.cu_seqlens
    total = int(mb.unsplit_cu_seqlens[-1])
    full = values.new_zeros(total)
    full[mb.cp_positions] = values
    return full, mb.unsplit_cu_seqlens


def split_thd(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Token indices (into a THD-packed row whose every segment length is a multiple of ``2 CP``) that CP
    rank ``cp_rank`` holds: chunks ``r`` and ``2CP-1-r`` of EVERY segment, as Transformer Engine's CP
    attention expects with ``cu_seqlens`` of the unsplit segments (GPU path; see docs/context-parallel.md).
    """
    parts = []
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        parts.append(start + load_balanced_positions(end - start, cp_size, cp_rank))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


SPLITTABLE = ("padded", "thd")


def check_packing(packing: str) -> None:
    """Refuse a packing that cannot be CP-split (``"block_diagonal"``: its mask is not split here)."""
    if packing not in SPLITTABLE:
        raise ValueError(
            f"batch.packing={packing!r} cannot be split over context-parallel ranks: with CP > 1 use "
            "'padded' on CPU (micro-batches are THD packed with Transformer Engine)"
        )


def split(mb: MicroBatch, cp_size: int, cp_rank: int) -> MicroBatch:
    """This CP rank's part of a ``"padded"`` or ``"thd"`` micro-batch (see the module docstring)."""
    if mb.routing is not None:
        raise ValueError("Routing Replay is not supported with context parallelism (it replays whole sequences)")
    if mb.packed_seq_params is None:
        return split_padded(mb, cp_size, cp_rank)
    # THD (Transformer Engine): every segment (sample, padded to 2 CP) split alike; the packed-sequence
    # parameters keep the UNSPLIT cu_seqlens, which is what TE's CP attention and Megatron's THD rotary expect
    # (a trailing padding segment, for sequence parallelism, is split like the others but never scored)
    segments = mb.packed_seq_params.cu_seqlens_q.to(torch.int64).cpu()
    rows = split_thd(segments, cp_size, cp_rank).to(mb.tokens.device)  # the row's tokens, padding segment last
    keep = split_thd(mb.cu_seqlens.cpu(), cp_size, cp_rank).to(mb.tokens.device)  # the samples' positions
    return replace(
        mb,
        tokens=mb.tokens[:, rows].contiguous(),
        position_ids=mb.position_ids[:, rows].contiguous(),
        targets=mb.targets[keep],
        loss_mask=mb.loss_mask[keep],
        old_logprobs=mb.old_logprobs[keep],
        **_split_token_fields(mb, lambda x: x[keep]),
        cu_seqlens=mb.cu_seqlens // cp_size,
        cp_positions=keep,
        unsplit_cu_seqlens=mb.cu_seqlens,
    )
