"""Per-token log-probs from the model's output, and forward-only passes that return them.

:func:`microbatch_logprobs` turns the last stage's output of one micro-batch (this rank's vocabulary slice of
the logits, or the hidden states with the fused LM head) into per-token log-probs with one all-reduce over the
TP group; the training loss (:mod:`.loss`) and :func:`forward_logprobs` both use it, so the old policy's,
the reference's and the trained policy's log-probs are computed the same way.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from gspo_mcore import ops
from gspo_mcore.learner import context_parallel, lm_head, routing, shared_prefix
from gspo_mcore.learner.batching import MicroBatch, TrainSample
from gspo_mcore.learner.parallel import Layout
from gspo_mcore.learner.schedule import microbatches_for_rank, run_schedule
from gspo_mcore.ops.logprobs import check_temperature


def microbatch_logprobs(
    mb: MicroBatch, logits: torch.Tensor, layout: Layout, temperature: float, entropy: bool, head=None
):
    """Log-probs of ``mb.targets`` (and the entropy when ``entropy``) from the last stage's output."""
    logits = logits.reshape(-1, logits.shape[-1])  # (R, S, V/TP) -> (R*S, V/TP)
    # (T, V/TP): the first T positions, or (shared prompts) the scored ones: a prompt's last fans out
    logits = logits[: mb.num_tokens] if mb.score_index is None else logits[mb.score_index]
    tp = layout.tp_group if layout.tp_size > 1 else None
    if head is not None:  # the "logits" are the hidden states (T, H)
        return ops.linear_token_logprobs(
            logits,
            head.weight,
            mb.targets,
            vocab_start=layout.tp_rank * head.weight.shape[0],
            tp_group=tp,
            return_entropy=entropy,
            temperature=temperature,
            chunk=head.chunk,
        )
    return ops.token_logprobs(
        logits,
        mb.targets,
        vocab_start=layout.tp_rank * logits.shape[-1],
        tp_group=tp,
        return_entropy=entropy,
        temperature=temperature,
    )


def _logprob_func(layout, temperature, head, mb, logits):
    logp = microbatch_logprobs(mb, logits, layout, temperature, False, head)
    return logits.new_zeros(()), {"logp": logp.detach().float(), "mb": mb}


@torch.no_grad()
def forward_logprobs(
    model,
    samples: list[TrainSample],
    layout: Layout,
    *,
    max_tokens: int,
    packing: str = "padded",
    temperature: float = 1.0,
    loss_cfg=None,
    replay_routing: bool = False,
    share_prompt: bool = False,
) -> list[torch.Tensor]:
    """Log-probs of ``tokens[1:]`` for every sample (``[L-1]`` float32 each, on the CPU, on every rank).

    Runs forward only through the same schedule and micro-batching as training (old-policy or reference
    log-probs). ``samples`` is the same list on every rank. ``loss_cfg`` (a
    :class:`~gspo_mcore.algo.LossConfig`): only its fused-LM-head keys are used (default: the logits path).
    ``replay_routing``: force every token through the experts in its sample's ``routed_experts`` (MoE; R3
    replays the rollout engine's routing here too). ``share_prompt``: a group's shared prompt computed once
    (:mod:`.shared_prefix`).
    """
    if replay_routing and any(s.routed_experts is None for s in samples):
        raise ValueError("forward_logprobs(replay_routing=True) needs routed_experts on every sample")
    tape = routing.tape(model, layout, replay=replay_routing)
    return _forward_logprobs(
        model,
        samples,
        layout,
        tape,
        max_tokens=max_tokens,
        packing=packing,
        temperature=temperature,
        loss_cfg=loss_cfg,
        share_prompt=share_prompt,
    )


@torch.no_grad()
def forward_logprobs_with_routing(
    model, samples: list[TrainSample], layout: Layout, **options
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """:func:`forward_logprobs` of a MoE model (``options``: its keywords but ``replay_routing``), plus the
    experts every token was routed to: per sample ``[L, num_layers, topk]`` int32 (``-1`` in dense layers), on
    every rank (see :mod:`.routing`)."""
    if not routing.is_moe(model):
        raise ValueError("forward_logprobs_with_routing needs a MoE model")
    tape = routing.tape(model, layout, record=True)
    logps = _forward_logprobs(model, samples, layout, tape, **options)
    num_layers, topk = routing.routing_dims(model)
    return logps, tape.scatter_to_samples(samples, layout, num_layers=num_layers, topk=topk)


def _forward_logprobs(
    model, samples, layout, tape, *, max_tokens, packing="padded", temperature=1.0, loss_cfg=None, share_prompt=False
):
    mbs = microbatches_for_rank(samples, layout, max_tokens, model=model, packing=packing, share_prompt=share_prompt)
    head = lm_head.fused_head(model, loss_cfg) if loss_cfg is not None else None
    store = run_schedule(
        model,
        mbs,
        partial(_logprob_func, layout, check_temperature(temperature), head),
        forward_only=True,
        tape=tape,
        fused_head=loss_cfg is not None and loss_cfg.fused_lm_head,
    )
    sizes = [s.length - 1 for s in samples]
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    flat = torch.zeros(offsets[-1], dtype=torch.float32, device=layout.device)
    for item in store if layout.is_last_stage else []:
        mb = item["mb"]
        logp, cu = context_parallel.unsplit(item["logp"], mb)  # this CP rank's positions; 0 elsewhere
        cu = cu.tolist()
        for k, i in enumerate(mb.sample_indices):
            if mb.score_starts is None:
                flat[offsets[i] : offsets[i + 1]] = logp[cu[k] : cu[k] + sizes[i]]
            else:  # a shared prompt's positions come from its unit's first sample
                flat[offsets[i] : offsets[i + 1]] = logp[shared_prefix.sample_positions(mb, k, sizes[i])]
    groups = ((layout.pp_group, layout.pp_size), (layout.dp_group, layout.dp_size), (layout.cp_group, layout.cp_size))
    for group, size in groups:
        if size > 1:
            dist.all_reduce(flat, group=group)
    flat = flat.cpu()
    return [flat[offsets[i] : offsets[i + 1]].clone() for i in range(len(samples))]
