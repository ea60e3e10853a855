"""Megatron-Core's linear layers with their forward and input-gradient GEMMs split by rows across CPU threads.

On a CPU, Megatron's ``ColumnParallelLinear`` and ``RowParallelLinear`` run ``torch.matmul``, which oneDNN runs
for bfloat16, and oneDNN keeps some shapes on one thread: measured on a 2-core Xeon with AMX, a SmolLM2 layer's
output projection and MLP down projection (``[1002, 576]`` outputs) and the input gradients back to the hidden
size ran at 1050-1350 GFLOP/s on two threads, about what one thread gives. :func:`gspo_mcore.ops.gemm.mm_rows`
gives each thread its own rows (2000-2300 GFLOP/s on the same shapes).

:func:`use_split_linear` turns each plain ``ColumnParallelLinear`` and ``RowParallelLinear`` of a model into a
subclass (same parameters, state and checkpoints) whose ``_forward_impl`` runs :class:`_Linear` where the call is
the plain case: a CPU bfloat16 input, no gradient accumulation fusion, no sequence parallelism, no tensor-parallel
all-reduce of the input gradient, no deferred weight gradient. Any other call runs Megatron's. The weight
gradient is Megatron's product, ``grad_output^T @ input``, unchanged. Tests: ``tests/learner/test_cpu_modules.py``
(the model with and without it) and ``tests/ops/test_ops_gemm.py`` (the product).
"""

from __future__ import annotations

import functools

import torch

from gspo_mcore.ops.gemm import mm_rows


class _Linear(torch.autograd.Function):
    """``input @ weight^T + bias`` over the last dimension of ``input``, with :func:`mm_rows` forward and for the
    input gradient."""

    @staticmethod
    def forward(ctx, input, weight, bias):
        x = input.reshape(-1, input.shape[-1])
        out = mm_rows(x, weight.t())
        if bias is not None:
            out += bias
        ctx.save_for_backward(input, weight)
        ctx.use_bias = bias is not None
        return out.view(*input.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        grad = grad_output.reshape(-1, grad_output.shape[-1])
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = mm_rows(grad, weight).view(input.shape)
        if ctx.needs_input_grad[1]:
            grad_weight = grad.t().matmul(input.reshape(-1, input.shape[-1]))
        if ctx.use_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(dim=0)
        return grad_input, grad_weight, grad_bias


def _plain(
    input,
    weight,
    bias,
    gradient_accumulation_fusion=False,
    allreduce_dgrad=False,
    sequence_parallel=False,
    grad_output_buffer=None,
    wgrad_deferral_limit=None,
    **_,
) -> bool:
    return (
        not gradient_accumulation_fusion
        and not allreduce_dgrad
        and not sequence_parallel
        and grad_output_buffer is None
        and input.device.type == "cpu"
        and input.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and input.dim() >= 2
    )


def _split_impl(self, input, weight, *args, **kwargs):
    names = ("bias", "gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel", "grad_output_buffer")
    call = dict(zip(names, args), **kwargs)
    if not _plain(input, weight, **call):
        # Megatron's own: the base of the split class in this module's MRO (a LoRA class may sit above it)
        split = next(k for k in type(self).__mro__ if k.__dict__.get("_forward_impl") is _split_impl)
        return super(split, self)._forward_impl(input, weight, *args, **kwargs)
    return _Linear.apply(input, weight, call.get("bias"))


@functools.cache
def linear_classes() -> dict[type, type]:
    """Megatron's ``ColumnParallelLinear`` and ``RowParallelLinear`` -> their split-GEMM subclasses (built on first
    use)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return {
        base: type(f"Cpu{base.__name__}", (base,), {"_forward_impl": _split_impl, "__module__": __name__})
        for base in (ColumnParallelLinear, RowParallelLinear)
    }


def use_split_linear(model: torch.nn.Module) -> int:
    """Make every plain ``ColumnParallelLinear`` and ``RowParallelLinear`` in ``model`` its split-GEMM subclass in
    place; how many were changed."""
    classes = linear_classes()
    changed = 0
    for module in model.modules():
        cls = classes.get(type(module))
        if cls is not None:
            module.__class__ = cls
            changed += 1
    return changed
