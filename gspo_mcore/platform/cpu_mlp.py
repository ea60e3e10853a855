"""SwiGLU with the compiled CPU kernels in Megatron-Core's MLP.

Megatron's ``MLP`` (local spec, no bias-activation fusion) computes the gated activation as ``torch.chunk``, silu
and a multiply, and autograd's backward as two multiplies, silu's backward and a ``cat`` of the two halves: 2.2-3.2
ms of each SmolLM2 layer in bf16 on 2 threads. :func:`gspo_mcore.ops.activation.swiglu` does it in one pass each
way (value and gradient tested against float64 in ``tests/ops/test_ops_activation.py``).

:func:`use_compiled_swiglu` turns each plain ``MLP`` of a model (dense layers; MoE experts built as ``MLP`` too)
into :class:`CpuMLP`, the same module whose forward runs ``linear_fc1``, the compiled SwiGLU and ``linear_fc2``
where the call is exactly that (gated silu, no clamp, no offset, no per-token scale, a CPU tensor of float32 or
bfloat16); any other call runs Megatron's forward.
"""

from __future__ import annotations

import functools

import torch

from gspo_mcore.ops.activation import swiglu


@functools.cache
def mlp_class():
    """:class:`CpuMLP` (built on first use: it subclasses Megatron's ``MLP``)."""
    from megatron.core.transformer.mlp import MLP

    class CpuMLP(MLP):
        """Megatron's ``MLP`` whose forward runs :func:`gspo_mcore.ops.activation.swiglu` where it covers the call."""

        def _fast(self, hidden_states, per_token_scale) -> bool:
            c = self.config
            return (
                per_token_scale is None
                and c.gated_linear_unit
                and self.activation_func is torch.nn.functional.silu
                and not c.use_te_activation_func
                and not c.bias_activation_fusion
                and c.activation_func_clamp_value is None
                and c.glu_linear_offset == 0
                and hidden_states.device.type == "cpu"
                and hidden_states.dtype in (torch.float32, torch.bfloat16)
            )

        def forward(self, hidden_states, per_token_scale=None, **kwargs):
            if not self._fast(hidden_states, per_token_scale):
                return super().forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
            intermediate, bias = self.linear_fc1(hidden_states)
            if bias is not None:
                intermediate = intermediate + bias
            return self.linear_fc2(swiglu(intermediate))

    return CpuMLP


def use_compiled_swiglu(model: torch.nn.Module) -> int:
    """Make every plain Megatron ``MLP`` in ``model`` a ``CpuMLP`` in place; how many were changed."""
    from megatron.core.transformer.mlp import MLP

    cls = mlp_class()
    changed = 0
    for module in model.modules():
        if type(module) is MLP:
            module.__class__ = cls
            changed += 1
    return changed
