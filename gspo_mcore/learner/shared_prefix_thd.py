"""Shared-prompt attention in two parts: the form the GPU path (Transformer Engine / FlashAttention, THD
packing) needs, since fused attention kernels take no dense ``[S, S]`` mask.

The star layout of :mod:`~gspo_mcore.learner.shared_prefix` stays as it is (a unit is its prompt's ``P`` tokens,
then each sample's own tokens, with continued position ids), so every linear layer, the MLP and RoPE still see
the prompt once. Only the attention changes: instead of one masked ``[S, S]`` softmax it is a varlen attention
with different query and key/value segments (:func:`two_part_layout`):

- query segments are the physical ones, in order: the prompt (``P`` queries), then each sample's own tokens
  (``l_k`` queries); an unshared sample is one segment of its ``L`` tokens. So the queries need no gather;
- key/value segment ``k`` is the prompt's keys and values followed by sample ``k``'s own (``P + l_k`` entries),
  gathered from the physical K/V by ``kv_index`` (the prompt's entries repeated once per sample: attention
  memory grows by ``n * P`` entries per unit, the layer compute does not). The gather's backward sums every
  sample's gradient into the one copy of the prompt's K/V;
- the mask is causal aligned to the bottom right (query ``i`` of a segment of ``lq`` queries and ``lkv`` keys
  sees key ``j`` iff ``j <= i + lkv - lq``): the prompt segment is plainly causal, and a sample's token sees the
  whole prompt and, causally, its own tokens. This is Transformer Engine's ``padding_causal_bottom_right`` mask
  (Megatron-Core's ``AttnMaskType.causal_bottom_right``) and FlashAttention's causal varlen convention (>= 2.1),
  with ``PackedSeqParams(cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, qkv_format="thd")``.

:func:`reference_attention` is that computation in plain torch; ``tests/learner/test_shared_prefix.py`` checks a
model using it against the per-sequence loop in float64 (log-probs and gradients). Not wired yet: a
``SelfAttention`` whose core attention gathers K/V by ``kv_index`` before calling Transformer Engine (RoPE applied
at the explicit positions before the gather, since Megatron's THD rotary restarts positions per segment). Until
that exists and is tested on a GPU, ``batch.share_prompt`` is refused with Transformer Engine
(:func:`~gspo_mcore.learner.shared_prefix.resolve`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TwoPartLayout:
    """Varlen segments of one THD row: ``cu_seqlens_q`` / ``cu_seqlens_kv`` (``[N + 1]``, int32) and, for every
    key/value entry, the physical token it reads (``kv_index``, ``[cu_seqlens_kv[-1]]``)."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    kv_index: torch.Tensor
    max_seqlen_q: int
    max_seqlen_kv: int


def two_part_layout(units, lengths) -> TwoPartLayout:
    """The segments of ``units`` (:class:`~gspo_mcore.learner.shared_prefix.Unit`, laid out back to back as in
    the star layout) whose samples have ``lengths`` (indexed by sample)."""
    q_lens, kv_lens, index = [], [], []
    base = 0
    for u in units:
        if not u.shared:
            n = int(lengths[u.samples[0]])
            q_lens.append(n)
            kv_lens.append(n)
            index.append(base + torch.arange(n))
            base += n
            continue
        p = u.prompt
        prompt = base + torch.arange(p)
        q_lens.append(p)
        kv_lens.append(p)
        index.append(prompt)
        offset = base + p
        for i in u.samples:
            own = int(lengths[i]) - p
            if own <= 0:
                raise ValueError(f"two_part_layout: sample {i} has no token after its unit's {p}-token prompt")
            q_lens.append(own)
            kv_lens.append(p + own)
            index += [prompt, offset + torch.arange(own)]
            offset += own
        base = offset
    return TwoPartLayout(
        cu_seqlens_q=_cumulative(q_lens),
        cu_seqlens_kv=_cumulative(kv_lens),
        kv_index=torch.cat(index),
        max_seqlen_q=max(q_lens),
        max_seqlen_kv=max(kv_lens),
    )


def _cumulative(lengths) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.int32), torch.tensor(lengths, dtype=torch.int32).cumsum(0)])


def reference_attention(q, k, v, layout: TwoPartLayout, scale: float) -> torch.Tensor:
    """Plain-torch two-part attention: ``q``, ``k``, ``v`` ``[T, H, D]`` at the physical positions of one THD row;
    returns ``[T, H, D]``. Keys and values are gathered by ``layout.kv_index`` and each segment attends with the
    bottom-right-aligned causal mask."""
    k, v = k[layout.kv_index], v[layout.kv_index]
    out = []
    for s in range(layout.cu_seqlens_q.numel() - 1):
        q0, q1 = int(layout.cu_seqlens_q[s]), int(layout.cu_seqlens_q[s + 1])
        k0, k1 = int(layout.cu_seqlens_kv[s]), int(layout.cu_seqlens_kv[s + 1])
        lq, lkv = q1 - q0, k1 - k0
        scores = torch.einsum("ihd,jhd->hij", q[q0:q1], k[k0:k1]) * scale
        hidden = torch.arange(lkv)[None, :] > torch.arange(lq)[:, None] + (lkv - lq)
        weights = scores.masked_fill(hidden, float("-inf")).softmax(-1)
        out.append(torch.einsum("hij,jhd->ihd", weights, v[k0:k1]))
    return torch.cat(out)
