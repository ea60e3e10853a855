"""RMSNorm with the compiled CPU kernels in Megatron-Core's local layer spec.

Megatron's local spec builds every RMSNorm (each layer's two, the final one, Qwen3's query and key norms) as a
``torch.nn.RMSNorm``. Its forward is one op on a CPU, but its backward is composed of about ten element-wise
ops over the whole activation: on SmolLM2's ``[1002, 576]`` bf16 rows with 2 threads, 2.0-2.6 ms forward and
backward against 0.4 ms for :func:`gspo_mcore.ops.rms_norm.rms_norm` (one pass over each row; value and
gradients tested against float64 in ``tests/ops/test_ops_rms_norm.py``). With 61 norms a step that is about
0.1 s of a 2 s SmolLM2 step.

:func:`use_compiled_rms_norm` turns each ``torch.nn.RMSNorm`` of a model into :class:`CpuRMSNorm`, the same
module (parameters, state-dict keys, hooks) whose forward calls the compiled op wherever it covers the call (a
CPU tensor of float32 or bfloat16, normalised over the last dimension, with a weight); anything else runs
``torch.nn.RMSNorm``'s own forward.
"""

from __future__ import annotations

import torch

from gspo_mcore.ops.rms_norm import rms_norm


class CpuRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` whose forward runs :func:`gspo_mcore.ops.rms_norm.rms_norm` where it can."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.weight is None
            or len(self.normalized_shape) != 1
            or x.device.type != "cpu"
            or x.dtype not in (torch.float32, torch.bfloat16)
            or self.weight.dtype != x.dtype
        ):
            return super().forward(x)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return rms_norm(x, self.weight, eps)


def use_compiled_rms_norm(model: torch.nn.Module) -> int:
    """Make every ``torch.nn.RMSNorm`` in ``model`` a :class:`CpuRMSNorm` in place; how many were changed."""
    changed = 0
    for module in model.modules():
        if type(module) is torch.nn.RMSNorm:
            module.__class__ = CpuRMSNorm
            changed += 1
    return changed
