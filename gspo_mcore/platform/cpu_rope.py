"""The compiled RoPE (:mod:`gspo_mcore.ops.rope`) in Megatron-Core's attention on a CPU host.

Megatron's ``Attention.forward`` rotates the queries and keys with ``apply_rotary_pos_emb`` (imported into
``megatron.core.transformer.attention``); without Transformer Engine that is the unfused version, about eight
passes over the queries and keys per call, 1.8-2.3 ms of each SmolLM2 layer forward and backward in bf16 on 2 threads.
:func:`use_compiled_rope` marks a model's ``TransformerConfig`` and, once per process, wraps that function: a call
from a marked config runs :func:`gspo_mcore.ops.rope.rope` where it covers the call (a CPU tensor ``[S, B, H, D]``
rotated over all of ``D``, non-interleaved, no packed sequences, no YaRN scale, no multi-latent attention, angles
whose two halves are equal); every other call, and every call from an unmarked config, runs Megatron's function
unchanged. Tests: ``tests/learner/test_cpu_modules.py`` (the model with and without it).
"""

from __future__ import annotations

import torch

from gspo_mcore.ops.rope import angles, rope

FLAG = "_gspo_compiled_rope"
"""The attribute :func:`use_compiled_rope` sets on a model's ``TransformerConfig``."""

_megatron_rope = None


def _covered(t, freqs, config, cu_seqlens, mscale) -> bool:
    return (
        getattr(config, FLAG, False)
        and cu_seqlens is None
        and mscale == 1.0
        and not config.rotary_interleaved
        and not config.multi_latent_attention
        and not config.apply_rope_fusion
        and t.device.type == "cpu"
        and t.dtype in (torch.float32, torch.bfloat16)
        and t.dim() == 4
        and freqs.dim() == 4
        and freqs.shape[-1] == t.shape[-1]
        and freqs.shape[0] == t.shape[0]
        and freqs.shape[1] in (1, t.shape[1])
    )


def _apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None):
    if _covered(t, freqs, config, cu_seqlens, mscale):
        cos_sin = angles(freqs)
        if cos_sin is not None:
            return rope(t, *cos_sin)
    return _megatron_rope(t, freqs, config=config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)


def use_compiled_rope(config) -> None:
    """Let the attention of models built from ``config`` (a ``TransformerConfig``) rotate with the compiled RoPE."""
    global _megatron_rope
    from megatron.core.transformer import attention

    if _megatron_rope is None:
        _megatron_rope = attention.apply_rotary_pos_emb
        attention.apply_rotary_pos_emb = _apply_rotary_pos_emb
    setattr(config, FLAG, True)
