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

The word embedding's gradient goes straight into its ``main_grad`` too: autograd's embedding backward builds a dense
zeroed ``[V, H]`` bf16 gradient, scatters the tokens' rows into it, and, where the weight is tied to the LM head, adds
it to the head's ``[V, H]`` gradient in bf16 (11 + 15 ms a step on SmolLM2-135M). :func:`use_one_pass_accumulation`
makes each plain ``VocabParallelEmbedding`` (one tensor-parallel rank, no sequence-parallel scatter) a subclass whose
backward adds the tokens' rows, in float32, into ``main_grad`` (``index_add_``) and gives autograd no weight
gradient. The sum is the same, rounded in float32 instead of in bf16 (a token repeated in a micro-batch, and the
tied head's gradient, were summed in bf16 before).
"""

from __future__ import annotations

import functools

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


def _one_pass(param: torch.Tensor) -> bool:
    """Whether ``param``'s gradient is not float32 and its ``main_grad`` (a float32 CPU buffer) is."""
    main_grad = getattr(param, "main_grad", None)
    return (
        param.requires_grad
        and param.dtype != torch.float32
        and main_grad is not None
        and main_grad.dtype == torch.float32
        and main_grad.device.type == "cpu"
    )


class _EmbeddingIntoMainGrad(torch.autograd.Function):
    """``embedding(ids, weight)`` whose weight gradient, the output gradient's rows summed by token in float32, is
    added into ``weight.main_grad``; autograd gets none."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.main_grad = weight.main_grad
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        ctx.main_grad.index_add_(0, ids.reshape(-1), grad.reshape(-1, grad.shape[-1]).float())
        return None, None


@functools.cache
def embedding_class():
    """The subclass of Megatron's ``VocabParallelEmbedding`` that :func:`use_one_pass_accumulation` installs."""
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    class CpuVocabParallelEmbedding(VocabParallelEmbedding):
        """Megatron's embedding (same parameters, state and checkpoints) whose weight gradient goes straight into
        ``main_grad`` on one tensor-parallel rank while autograd is recording; Megatron's forward otherwise."""

        def forward(self, input_):
            if torch.is_grad_enabled() and self.tp_group.size() == 1 and not self.reduce_scatter_embeddings:
                if _one_pass(self.weight):
                    return _EmbeddingIntoMainGrad.apply(input_, self.weight)
            return super().forward(input_)

    return CpuVocabParallelEmbedding


def use_one_pass_accumulation(ddp_model) -> int:
    """Hook every parameter of ``ddp_model`` (Megatron's ``DistributedDataParallel``) whose gradient is not float32
    and whose ``main_grad`` is, and make its plain word embeddings :func:`embedding_class`; the number of parameters
    hooked. A no-op (0) when the wrapper overlaps its gradient reduction."""
    if ddp_model.ddp_config.overlap_grad_reduce:
        return 0
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    for module in ddp_model.module.modules():
        if type(module) is VocabParallelEmbedding:
            module.__class__ = embedding_class()
    hooked = 0
    for param in ddp_model.module.parameters():
        if _one_pass(param):
            param.register_post_accumulate_grad_hook(_accumulate_into_main_grad)
            hooked += 1
    return hooked
