"""Context-parallel core attention for Megatron-Core's local (non-Transformer-Engine) layer spec, on CPU.

Megatron's local ``DotProductAttention`` refuses context parallelism ("only supported by
TEDotProductAttention"). This module is its stand-in when CP > 1 without Transformer Engine, so that the CP
data path (load-balanced splitting, rotary positions, masks, per-sequence reductions, gradients) runs on a
CPU exactly as on a GPU. It is a CORRECTNESS path, not a fast one: every rank all-gathers the keys and
values of the whole sequence and attends its queries to all of them (memory and compute of full attention
per rank; no ring, no overlap).

Layout (Megatron's load-balanced CP layout): every sequence dimension of length ``S`` is cut into
``2 * CP`` chunks of ``c = S / (2 CP)`` positions; CP rank ``r`` holds chunks ``r`` and ``2 CP - 1 - r``
(in that order), so its local sequence is ``2c`` positions. Causal masking compares GLOBAL positions:
query ``i`` of rank ``r`` sees key ``j`` iff ``global(j) <= global(i)``.

Gradients: the all-gather's backward is a reduce-scatter (implemented as all-reduce and slice, since gloo
has no reduce-scatter): each rank's keys and values receive the gradients from every rank's queries.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist


def load_balanced_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The global positions (``[seq_len / cp_size]`` int64) that CP rank ``cp_rank`` holds of a sequence
    dimension of ``seq_len`` positions (a multiple of ``2 * cp_size``): chunks ``r`` and ``2CP-1-r``."""
    if seq_len % (2 * cp_size):
        raise ValueError(f"a CP-split sequence length must be a multiple of 2 * CP = {2 * cp_size}, got {seq_len}")
    c = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c)
    return torch.cat([first, second])


def _global_order(cp_size: int) -> torch.Tensor:
    """Index into the gathered ``[cp, 2 (halves)]`` chunks, flattened, that puts them in global order."""
    order = []
    for j in range(2 * cp_size):
        order.append(2 * j if j < cp_size else 2 * (2 * cp_size - 1 - j) + 1)
    return torch.tensor(order)


class _GatherSequence(torch.autograd.Function):
    """All-gather ``x`` (``[s_local, ...]``) over ``group`` into ``[cp, s_local, ...]``; backward: the
    gradient summed over ranks (all-reduce), this rank's slice (= a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        ctx.rank = dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank].clone(), None


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """The full sequence ``[S, ...]`` in global order from every CP rank's load-balanced ``[S/CP, ...]``."""
    cp = dist.get_world_size(group)
    gathered = _GatherSequence.apply(x, group)  # (cp, 2c, ...)
    c = x.shape[0] // 2
    chunks = gathered.reshape(cp * 2, c, *x.shape[1:])  # (2cp, c, ...): [rank r, half h] at 2r + h
    return chunks.index_select(0, _global_order(cp).to(x.device)).reshape(cp * 2 * c, *x.shape[1:])


def causal_attention(query, key, value, group, softmax_scale: float) -> torch.Tensor:
    """This CP rank's causal attention output ``[sq, b, np * hn]`` from its load-balanced ``query [sq, b, np,
    hn]``, ``key`` and ``value [sq, b, ng, hn]`` (``np`` a multiple of ``ng``: grouped-query attention)."""
    return attend(*attention_probs(query, key, value, group, softmax_scale))


def attend(probs, value) -> torch.Tensor:
    """``probs [b, np, sq, S] @ value [S, b, np, hn]`` -> ``[sq, b, np * hn]``."""
    context = torch.matmul(probs, value.permute(1, 2, 0, 3))  # (b, np, sq, hn)
    sq, b, nh, hd = context.shape[2], context.shape[0], context.shape[1], context.shape[3]
    return context.permute(2, 0, 1, 3).reshape(sq, b, nh * hd)


def attention_probs(query, key, value, group, softmax_scale: float):
    """Causal attention probabilities ``[b, np, sq, S]`` of this rank's queries over the gathered keys (global
    positions), and the gathered values ``[S, b, np, hn]`` (KV heads repeated for grouped-query attention)."""
    cp = dist.get_world_size(group)
    sq, b, nh, hd = query.shape
    kv = gather_sequence(torch.cat([key, value], dim=-1), group)  # (S, b, ng, 2hn)
    key, value = kv.split([key.shape[-1], value.shape[-1]], dim=-1)
    if nh // key.shape[2] > 1:
        key = key.repeat_interleave(nh // key.shape[2], dim=2)
        value = value.repeat_interleave(nh // value.shape[2], dim=2)
    sk = key.shape[0]
    scores = torch.matmul(query.permute(1, 2, 0, 3), key.permute(1, 2, 3, 0)) * softmax_scale  # (b, np, sq, sk)
    q_pos = load_balanced_positions(sk, cp, dist.get_rank(group)).to(query.device)  # global positions
    masked = torch.arange(sk, device=query.device)[None, :] > q_pos[:, None]  # (sq, sk)
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))  # softmax in fp32 at least
    probs = torch.softmax(scores.masked_fill(masked, -10000.0), dim=-1).to(value.dtype)
    return probs, value


@functools.cache
def core_attention_class():
    """The ``core_attention`` module class (built once: it subclasses Megatron's ``MegatronModule``)."""
    from megatron.core.transformer.module import MegatronModule

    class CpuContextParallelAttention(MegatronModule):
        """Drop-in for the local spec's ``core_attention`` (same constructor and forward as
        ``DotProductAttention``): causal self-attention of this CP rank's queries against the gathered keys
        and values of the whole sequence. Scores, softmax (fp32) and the ``-10000`` mask value follow
        ``DotProductAttention``."""

        def __init__(
            self,
            config,
            layer_number: int,
            attn_mask_type,
            attention_type: str,
            attention_dropout: float | None = None,
            softmax_scale: float | None = None,
            cp_comm_type: str | None = None,
            pg_collection=None,
        ):
            super().__init__(config=config)
            from megatron.core import parallel_state as ps
            from megatron.core.transformer.enums import AttnMaskType

            if attn_mask_type != AttnMaskType.causal:
                raise ValueError(f"the CPU context-parallel attention is causal only, got {attn_mask_type}")
            if config.window_size is not None or config.softmax_type != "vanilla":
                raise ValueError("the CPU context-parallel attention supports no window attention or softmax offset")
            self.cp_group = pg_collection.cp if pg_collection is not None else ps.get_context_parallel_group()
            self.softmax_scale = 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
            self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

        def forward(
            self,
            query,
            key,
            value,
            attention_mask,
            attn_mask_type=None,
            attention_bias=None,
            packed_seq_params=None,
        ):
            if packed_seq_params is not None or attention_bias is not None or attention_mask is not None:
                raise ValueError(
                    "the CPU context-parallel attention takes padded rows only (no attention mask, packed "
                    "sequences or attention bias)"
                )
            probs, value = attention_probs(query, key, value, self.cp_group, self.softmax_scale)
            if self.training and self.dropout > 0:
                from megatron.core import tensor_parallel

                with tensor_parallel.get_cuda_rng_tracker().fork():
                    probs = torch.nn.functional.dropout(probs, p=self.dropout)
            return attend(probs, value)

    return CpuContextParallelAttention
