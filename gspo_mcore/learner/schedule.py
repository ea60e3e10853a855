"""Megatron's pipeline schedule over this rank's micro-batches.

Every schedule (no pipelining, 1F1B, interleaved) runs the same ``forward_step``: the model's output on the last
stage is this rank's vocabulary slice of the logits, ``[R, S, V/TP]`` (or its hidden states with the fused LM
head, :mod:`gspo_mcore.learner.lm_head`), handed to a loss function of the micro-batch (:mod:`.loss` for training,
:mod:`.forward` for forward-only passes). This module cuts the rollout batch into this DP (and CP) rank's
micro-batches and runs the schedule; it knows nothing of the loss.
"""

from __future__ import annotations

import contextlib
from functools import partial

from gspo_mcore.learner import context_parallel, lm_head, shared_prefix
from gspo_mcore.learner.batching import MicroBatch, build_microbatch, plan_microbatches
from gspo_mcore.learner.parallel import Layout

CPU_PACKINGS = ("padded", "block_diagonal")


def uses_transformer_engine(model) -> bool:
    """Whether the model was built with the Transformer Engine spec (then micro-batches are THD-packed)."""
    from gspo_mcore.learner.model import unwrap

    for module in unwrap(model[0]).modules():
        if type(module).__module__.startswith("megatron.core.extensions.transformer_engine"):
            return True
    return False


def microbatches_for_rank(
    samples, layout: Layout, max_tokens: int, *, model, packing: str = "padded", share_prompt: bool = False
) -> list[MicroBatch]:
    """This DP rank's micro-batches of ``samples`` (the same list on every rank).

    ``packing`` (``"padded"`` or ``"block_diagonal"``) applies without Transformer Engine; with it the
    micro-batches are THD packed sequences. ``share_prompt``: samples sharing a prompt are laid out as one unit
    (never split over ranks or micro-batches) that computes the prompt once (:mod:`.shared_prefix`).
    """
    if packing not in CPU_PACKINGS:
        raise ValueError(f"packing must be one of {CPU_PACKINGS}, got {packing!r}")
    if uses_transformer_engine(model):
        packing = "thd"
    config = model[0].config
    if share_prompt:
        return _shared_microbatches(samples, layout, max_tokens, config, packing)
    plans = plan_microbatches(
        [s.length for s in samples], dp_size=layout.dp_size, max_tokens=max_tokens, padded=packing == "padded"
    )
    pad_multiple = layout.tp_size if config.sequence_parallel else 1
    if layout.cp_size > 1:
        context_parallel.check_packing(packing)
        pad_multiple *= context_parallel.pad_multiple(layout.cp_size)  # each CP rank's part splits over TP
    mbs = [
        build_microbatch(
            samples,
            idx,
            packing=packing,
            pad_multiple=pad_multiple,
            segment_multiple=context_parallel.pad_multiple(layout.cp_size) if layout.cp_size > 1 else 1,
            device=layout.device,
            num_experts=getattr(config, "num_moe_experts", None) or None,
        )
        for idx in plans[layout.dp_rank]
    ]
    if layout.cp_size > 1:
        mbs = [context_parallel.split(mb, layout.cp_size, layout.cp_rank) for mb in mbs]
    return mbs


def _shared_microbatches(samples, layout, max_tokens, config, packing) -> list[MicroBatch]:
    if packing == "thd" or layout.cp_size > 1:
        raise ValueError(
            "batch.share_prompt needs the local layer spec without context parallelism (not Transformer Engine's "
            f"THD packing, not parallel.context > 1; got packing {packing!r}, context {layout.cp_size})"
        )
    units = shared_prefix.find_units(samples, max_tokens)
    plans = plan_microbatches(
        [u.length for u in units], dp_size=layout.dp_size, max_tokens=max_tokens, padded=packing == "padded"
    )
    return [
        shared_prefix.build_shared_microbatch(
            samples,
            [units[j] for j in idx],
            packing=packing,
            pad_multiple=layout.tp_size if config.sequence_parallel else 1,
            device=layout.device,
            num_experts=getattr(config, "num_moe_experts", None) or None,
        )
        for idx in plans[layout.dp_rank]
    ]


def _forward_step(loss_func, tape, fused_head, data_iterator, model):
    mb: MicroBatch = next(data_iterator)
    if tape is not None:
        tape.before(mb, model)
    with contextlib.ExitStack() as stack:
        if fused_head:
            stack.enter_context(lm_head.hidden_states_out(model))
        if mb.score_index is not None:  # shared prompts: RoPE at the continued positions
            stack.enter_context(shared_prefix.explicit_positions(model, mb.position_ids))
        output = model(mb.tokens, mb.position_ids, mb.attention_mask, packed_seq_params=mb.packed_seq_params)
    if tape is not None:
        tape.after(mb, model)
    return output, partial(loss_func, mb)


def _configure(model) -> None:
    from megatron.core.distributed import finalize_model_grads

    config = model[0].config
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model[0].no_sync if len(model) == 1 else [m.no_sync for m in model]


def run_schedule(model, microbatches, loss_func, *, forward_only: bool, tape=None, fused_head: bool = False):
    """Megatron's schedule over ``microbatches``; ``loss_func(mb, output)`` is Megatron's loss function of one
    micro-batch; ``tape`` (a :class:`~gspo_mcore.learner.routing.RoutingTape`) records or replays the MoE routing
    of every micro-batch; ``fused_head``: the last stage outputs hidden states. Returns the schedule's list of
    the loss functions' reported values (last pipeline stage only)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    _configure(model)
    for chunk in model:
        chunk.train()
    fb = get_forward_backward_func()
    max_len = max(int(mb.tokens.shape[1]) for mb in microbatches) * model[0].config.context_parallel_size
    run = partial(
        fb,
        forward_step_func=partial(_forward_step, loss_func, tape, fused_head),
        data_iterator=iter(microbatches),
        model=model,
        num_microbatches=len(microbatches),
        seq_length=max_len,
        micro_batch_size=1,
        forward_only=forward_only,
    )
    if tape is None:
        return run()
    with tape:
        return run()
