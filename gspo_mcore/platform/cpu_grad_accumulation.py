"""Each parameter's bfloat16 gradient added into its float32 ``main_grad`` in one pass on a CPU host.

Megatron-Core's ``DistributedDataParallel`` accumulates every gradient with ``param.main_grad.add_(param.grad)`` in a
backward hook on the parameter's gradient accumulator. With bf16 parameters and a float32 gradient buffer (the CPU
learner's mixed precision), torch on a CPU first copies the whole gradient to float32, then adds it: on SmolLM2-135M,
2 threads, about 70 ms of a 1.4-1.5 s step, 36 ms for the tied embedding's ``[49152, 576]`` alone against 6 ms in one
pass (``docs/results/shared-prompt.md``).

:func:`use_one_pass_accumulation` gives each such parameter a post-accumulate-grad hook that runs
:func:`gspo_mcore.ops.accumulate.accumulate_` into ``main_grad`` and then drops ``param.grad``. Megatron's own hook,
which torch runs after it, then finds no gradient and adds nothing (with ``overlap_grad_reduce`` off, as
:func:`gspo_mcore.learner.model.build_model` builds it, it needs none: the buffers are reduced after the backward).
Were the order ever the other way round, Megatron's hook would add and drop the gradient first and this one would
find none: the sum is the same either way. Which gradients are added follows Megatron's hook exactly (see
:func:`_accumulate_into_main_grad`). Parameters whose gradient is already float32, and a DDP with overlapped
reduction, are left to Megatron.
"""

from __future__ import annotations

import torch

from gspo_mcore.ops.accumulate import accumulate_


def _accumulate_into_main_grad(param: torch.Tensor) -> None:
    # Megatron's rule: a fused weight-gradient kernel that already wrote main_grad marks the parameter, and its
    # gradient is then a placeholder, except for a weight shared by two layers (``zero_out_wgrad``, the tied
    # embedding), whose placeholder is zeros and whose gradient is always added
    if param.grad is None or (
        getattr(param, "grad_added_to_main_grad", False) and not getattr(param, "zero_out_wgrad", False)
    ):
        return
    accumulate_(param.main_grad, param.grad)
    param.grad = None


def use_one_pass_accumulation(ddp_model) -> int:
    """Hook every parameter of ``ddp_model`` (Megatron's ``DistributedDataParallel``) whose gradient is not float32
    and whose ``main_grad`` is; the number hooked. A no-op (0) when the wrapper overlaps its gradient reduction."""
    if ddp_model.ddp_config.overlap_grad_reduce:
        return 0
    hooked = 0
    for param in ddp_model.module.parameters():
        main_grad = getattr(param, "main_grad", None)
        if (
            not param.requires_grad
            or main_grad is None
            or main_grad.dtype != torch.float32
            or param.dtype == torch.float32
            or main_grad.device.type != "cpu"
        ):
            continue
        param.register_post_accumulate_grad_hook(_accumulate_into_main_grad)
        hooked += 1
    return hooked
