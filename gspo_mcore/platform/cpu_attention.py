"""A faster core attention for Megatron-Core's local (non-Transformer-Engine) layer spec on a CPU host.

Megatron's local ``DotProductAttention`` computes the scores in the model's dtype, then (unfused softmax)
casts the whole ``[b, np, sq, sk]`` score tensor to fp32, masks it out of place, takes the softmax, and casts
the probabilities back; autograd then keeps and replays every one of those tensors. On a 2-core CPU in bf16
that traffic, not the matmuls, is most of the attention's time (measured: one
SmolLM2 layer at ``b=2, np=9, s=501`` took 34-38 ms forward+backward, against 13-19 ms here;
``docs/results/shared-prompt.md``).

:class:`CpuDotProductAttention` is that module with a forward that keeps every tensor in the model's dtype and
one hand-written backward (:class:`_Attention`):

- forward: ``scores = q @ kᵀ * scale`` (one batched matmul per KV group: the query heads that share a key
  head are folded into the row dimension, so grouped-query attention never copies keys or values),
  then, in place and in one pass over each row (:func:`gspo_mcore.ops.softmax.masked_softmax_`, compiled on a
  CPU), masked scores set to -10000 (Megatron's value) and ``probs = softmax(scores)`` (fp32 inside, stored in the
  model's dtype, as Megatron stores them), ``out = probs @ v``;
- backward: ``dv = probsᵀ @ dout``, ``dprobs = dout @ vᵀ``, the softmax backward in place
  (:func:`gspo_mcore.ops.softmax.softmax_backward_`; zero for a query whose every key is masked, as through
  Megatron's out-of-place ``masked_fill``: elsewhere a masked score's probability is 0 and so is its gradient),
  ``dq = dscores @ k * scale``,
  ``dk = dscoresᵀ @ q * scale``. Only ``q, k, v, probs`` are kept.

Same inputs, outputs and semantics as ``DotProductAttention``: ``query [sq, b, np, hn]``, ``key`` and
``value [sk, b, ng, hn]``, ``attention_mask [b or 1, 1, sq, sk]`` bool (True: masked) or ``None`` with the
causal mask type; output ``[sq, b, np * hn]``. Anything this path does not cover (packed sequences, an
attention bias, a softmax offset, window attention, extra softmax scaling, attention dropout while training,
a non-causal mask type without a mask) runs Megatron's own forward unchanged. Its parity with Megatron's
module, value and gradient in fp32 and bf16, is ``tests/learner/test_cpu_attention.py``.
"""

from __future__ import annotations

import functools

import torch

from gspo_mcore.ops.softmax import masked_softmax_, softmax_backward_

MASK_VALUE = -10000.0
"""What masked scores are set to before the softmax (Megatron's ``attention_mask_func``)."""


class _Attention(torch.autograd.Function):
    """``softmax(q kᵀ * scale, masked) v`` for ``q [G, r*sq, hn]`` (``G = b * ng`` KV heads, each with its ``r``
    query heads folded into the rows), ``k, v [G, sk, hn]`` and ``mask`` a ``[b or 1, 1, 1, sq, sk]`` bool view
    (True: masked) or ``None``; see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, mask, shape, scale: float):
        b, ng, r, sq = shape
        scores = torch.baddbmm(
            q.new_empty(q.shape[0], q.shape[1], k.shape[1]), q, k.transpose(1, 2), beta=0.0, alpha=scale
        )  # (G, r*sq, sk), as Megatron computes them
        mask, dead = dead_queries(mask)
        # masked scores set to -10000 and the softmax (fp32 inside), in place: one pass over each row
        masked_softmax_(scores, None if mask is None else mask.reshape(mask.shape[0], sq, -1), ng, MASK_VALUE)
        probs = scores
        ctx.save_for_backward(q, k, v, probs)
        ctx.scale, ctx.dead, ctx.shape = scale, dead, shape
        return torch.bmm(probs, v)  # (G, r*sq, hn)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, probs = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_v = torch.bmm(probs.transpose(1, 2), grad_out)
        grad_probs = torch.bmm(grad_out, v.transpose(1, 2))
        softmax_backward_(grad_probs, probs)  # in place: fp32 inside
        grad_scores = grad_probs
        if ctx.dead is not None:  # masked_fill's gradient: nothing flows into a score that was overwritten
            grad_scores.view(*ctx.shape, -1).masked_fill_(ctx.dead, 0.0)
        grad_q = torch.bmm(grad_scores, k).mul_(ctx.scale)
        grad_k = torch.bmm(grad_scores.transpose(1, 2), q).mul_(ctx.scale)
        return grad_q, grad_k, grad_v, None, None, None


def dead_queries(mask: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(mask, dead)`` for a ``[MB, 1, 1, sq, sk]`` mask view: ``dead`` marks the queries that see no key
    (padding: their probabilities are uniform and pass no gradient), ``None`` when there are none. Worked out once
    per mask and kept on the tensor the view was made from (every layer of a forward gets the same mask, and the
    check is a pass over it) until that tensor is changed in place."""
    if mask is None:
        return None, None
    base = mask._base if mask._base is not None else mask
    key = (base._version, mask.shape, mask.stride(), mask.storage_offset())  # the same elements of the same data
    kept = getattr(base, "_gspo_dead_queries", None)
    if kept is not None and kept[0] == key:
        return mask, kept[1]
    dead = mask.all(dim=-1, keepdim=True)
    dead = dead if bool(dead.any()) else None
    base._gspo_dead_queries = (key, dead)
    return mask, dead


def attention(query, key, value, mask, scale: float) -> torch.Tensor:
    """Softmax attention in Megatron's layouts: ``query [sq, b, np, hn]``, ``key``/``value [sk, b, ng, hn]``,
    ``mask`` bool ``[b or 1, 1, sq, sk]`` (True: masked) or ``None`` (causal) -> ``[sq, b, np * hn]``."""
    sq, b, nh, hn = query.shape
    sk, ng = key.shape[0], key.shape[2]
    r = nh // ng
    q = query.permute(1, 2, 0, 3).reshape(b * ng, r * sq, hn)  # the query heads of one KV group consecutive
    k = key.permute(1, 2, 0, 3).reshape(b * ng, sk, hn)
    v = value.permute(1, 2, 0, 3).reshape(b * ng, sk, hn)
    if mask is None:
        mask = causal_mask(sq, sk, query.device)
    mask = mask.reshape(mask.shape[0], 1, 1, sq, sk)  # broadcast over KV groups and their query heads
    out = _Attention.apply(q, k, v, mask, (b, ng, r, sq), scale)  # (b*ng, r*sq, hn)
    return out.view(b, nh, sq, hn).permute(2, 0, 1, 3).reshape(sq, b, nh * hn)


@functools.lru_cache(maxsize=8)
def causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    """``[1, 1, sq, sk]`` bool, True above the diagonal (the last query sees every key), as Megatron's default; one
    (read-only) tensor per shape, made once."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu_(sk - sq + 1)[None, None]


@functools.cache
def core_attention_class():
    """:class:`CpuDotProductAttention` (built on first use: it subclasses Megatron's ``DotProductAttention``)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class CpuDotProductAttention(DotProductAttention):
        """Megatron's local ``DotProductAttention`` (same constructor, parameters and state) whose forward runs
        :func:`attention` wherever that covers the call (see the module docstring)."""

        def _fast(self, attention_mask, attn_mask_type, attention_bias, packed_seq_params) -> bool:
            softmax = self.scale_mask_softmax
            return (
                packed_seq_params is None
                and attention_bias is None
                and self.softmax_offset is None
                and softmax.scale is None
                and softmax.window_size is None
                and not (self.training and self.attention_dropout.p > 0)
                and (attention_mask is not None or (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal)
            )

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
            if not self._fast(attention_mask, attn_mask_type, attention_bias, packed_seq_params):
                return super().forward(
                    query,
                    key,
                    value,
                    attention_mask,
                    attn_mask_type=attn_mask_type,
                    attention_bias=attention_bias,
                    packed_seq_params=packed_seq_params,
                )
            return attention(query, key, value, attention_mask, self.softmax_scale)

    return CpuDotProductAttention


def with_core_attention(block_spec, core_class):
    """A copy of a local-spec ``TransformerBlockSubmodules`` whose layers use ``core_class`` as their core attention
    (this module's :func:`core_attention_class`, or :func:`gspo_mcore.platform.cp_attention.core_attention_class`);
    the given spec, which Megatron may share between calls, is not modified."""
    import copy

    spec = copy.deepcopy(block_spec)
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = core_class
    return spec
