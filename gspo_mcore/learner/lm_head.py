"""The fused LM head (``loss.fused_lm_head``): the last stage's output layer hands back its input hidden
states instead of logits, and :func:`gspo_mcore.ops.linear_token_logprobs` computes the log-probs from them
and the output weight in vocabulary chunks, so the ``[T, V/TP]`` logits (and their gradient) never exist.

The hidden states are prepared exactly as Megatron's ``ColumnParallelLinear`` prepares its input: with
sequence parallelism they are all-gathered over the TP group (reduce-scattered in backward), otherwise copied
into the TP region (their gradient all-reduced over the TP group in backward). The weight is the output
layer's, or the word embedding's when input and output embeddings are tied.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from gspo_mcore.learner.model import unwrap

KEY = "loss.fused_lm_head"


@dataclass(frozen=True)
class FusedHead:
    """What the loss needs to compute log-probs from hidden states: this rank's rows of the output weight
    ``[V/TP, H]`` and the vocabulary chunk size."""

    weight: torch.Tensor
    chunk: int


def _last_gpt(model):
    gpt = unwrap(model[-1])
    return gpt if getattr(gpt, "post_process", False) else None


def check_supported(model) -> None:
    """Raise ``ValueError`` naming ``loss.fused_lm_head`` for a model whose output layer it cannot replace."""
    gpt = _last_gpt(model)
    if gpt is None:
        return  # not the last pipeline stage: nothing to fuse here
    config = gpt.config
    layer = gpt.output_layer
    problems = []
    if getattr(config, "mtp_num_layers", None):
        problems.append("multi-token prediction (mtp_num_layers) runs the output layer on extra hidden states")
    if getattr(layer, "bias", None) is not None:
        problems.append("the output layer has a bias")
    if getattr(layer, "gather_output", False):
        problems.append("the output layer gathers the full vocabulary (parallel_output=False)")
    if getattr(config, "defer_embedding_wgrad_compute", False):
        problems.append("defer_embedding_wgrad_compute computes the output weight's gradient elsewhere")
    if problems:
        raise ValueError(f"{KEY}=true is not supported for this model: " + "; ".join(problems))


def fused_head(model, loss) -> FusedHead | None:
    """The fused head ``loss`` (a :class:`~gspo_mcore.algo.LossConfig`) asks for: ``None`` when
    ``loss.fused_lm_head`` is off or on another pipeline stage; raises ``ValueError`` naming the key for a model
    it cannot serve."""
    return head_for(model, loss.fused_lm_head_chunk) if loss.fused_lm_head else None


def head_for(model, chunk: int) -> FusedHead | None:
    """The last stage's :class:`FusedHead` (``None`` on other pipeline stages)."""
    check_supported(model)
    gpt = _last_gpt(model)
    if gpt is None:
        return None
    if gpt.share_embeddings_and_output_weights:
        weight = gpt.shared_embedding_or_output_weight()
    else:
        weight = gpt.output_layer.weight
    return FusedHead(weight=weight, chunk=chunk)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient. GPTModel returns ``output.transpose(0, 1)
    .contiguous()``, whose backward gives a transposed (non-contiguous) gradient; Megatron's
    ``copy_to_tensor_model_parallel_region`` all-reduces ``grad.contiguous()``, i.e. a copy, for such a
    gradient and hands on the unreduced original (the logits path never meets this: its gradient reaches the
    matmul, which is contiguous)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _column_parallel_input(layer, hidden: torch.Tensor) -> torch.Tensor:
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    if layer.sequence_parallel:
        out = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=layer.tp_group)
    else:
        out = copy_to_tensor_model_parallel_region(hidden, group=layer.tp_group)
    return _ContiguousGrad.apply(out)


@contextlib.contextmanager
def hidden_states_out(model_chunk):
    """While active, ``model_chunk`` (on the last stage) returns ``[B, S, H]`` hidden states, prepared as its
    output layer prepares its input, in place of the ``[B, S, V/TP]`` logits. Elsewhere: no change."""
    gpt = unwrap(model_chunk)
    if not getattr(gpt, "post_process", False):
        yield
        return
    layer = gpt.output_layer

    def forward(input_, weight=None, runtime_gather_output=None):
        return _column_parallel_input(layer, input_), None

    layer.forward = forward
    try:
        yield
    finally:
        del layer.forward
