"""One training step of the learner: old log-probs where needed, then one optimizer step per mini-batch.

:func:`train_step` takes the whole rollout batch (the same list of :class:`~gspo_mcore.learner.batching.TrainSample`
on every rank), decides the step's MoE routing once (:func:`gspo_mcore.learner.routing.plan`), completes the
samples (old log-probs, the engine's as behaviour log-probs, reference log-probs, recorded experts) with
forward-only passes (:mod:`.forward`), and runs :func:`train_minibatch` per mini-batch: the schedule
(:mod:`.schedule`) with the loss adapter (:mod:`.loss`), then the optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Literal

from gspo_mcore.algo.loss_config import LossConfig
from gspo_mcore.config import check_literals
from gspo_mcore.learner import lm_head, routing
from gspo_mcore.learner.batching import TrainSample, count_sequences, split_minibatches
from gspo_mcore.learner.forward import forward_logprobs, forward_logprobs_with_routing
from gspo_mcore.learner.loss import policy_loss_func, reduce_metrics
from gspo_mcore.learner.optimizer import current_lr, optimizer_step, zero_grads
from gspo_mcore.learner.parallel import Layout
from gspo_mcore.learner.routing import RoutingConfig
from gspo_mcore.learner.schedule import microbatches_for_rank, run_schedule
from gspo_mcore.ops.logprobs import check_temperature


@dataclass(frozen=True, kw_only=True)
class BatchConfig:
    """How a rollout batch is cut: mini-batches (one optimizer step each) and micro-batches (by tokens)."""

    num_minibatches: int = 4
    """Mini-batches per rollout batch, i.e. optimizer steps per rollout batch (the paper uses 4)."""
    max_tokens_per_microbatch: int = 8192
    """Token budget of one micro-batch on one DP rank, padding included (a longer sample gets a
    micro-batch of its own)."""
    packing: Literal["padded", "block_diagonal"] = "padded"
    """Without Transformer Engine: ``"padded"`` (a row per sample) or ``"block_diagonal"`` (samples back
    to back, block-diagonal mask). With Transformer Engine micro-batches are always THD packed."""
    share_prompt: bool | None = None
    """Compute a group's shared prompt once per micro-batch: samples of a mini-batch whose tokens before the
    first counted token are identical run as one unit (the prompt, then each sample's own tokens attending to it
    and causally to themselves), with the same log-probs, loss and gradients as unshared (docs/guide.md,
    "Shared-prompt training"). ``None``: on wherever supported (Megatron-Core's local layer spec, no context
    parallelism, no MoE auxiliary loss), decided when the learner is built; ``true`` is refused where not
    supported; ``false``: every sample runs its prompt. Combines with LoRA (``lora.rank > 0``; tested at 1 rank and
    TP2)."""

    def __post_init__(self):
        if self.num_minibatches < 1:
            raise ValueError(f"BatchConfig.num_minibatches must be >= 1, got {self.num_minibatches}")
        if self.max_tokens_per_microbatch < 2:
            raise ValueError(
                f"BatchConfig.max_tokens_per_microbatch must be >= 2, got {self.max_tokens_per_microbatch}"
            )
        check_literals(self)


@dataclass(frozen=True, kw_only=True)
class StepSettings:
    """How every training step of a run is done, fixed when the :class:`~gspo_mcore.learner.learner.Learner` is
    built: the loss, the batching, the MoE routing, the policy's temperature and where the old log-probs come
    from."""

    loss: LossConfig = LossConfig()
    batch: BatchConfig = BatchConfig()
    routing: RoutingConfig = RoutingConfig()
    temperature: float = 1.0
    """The policy is ``softmax(logits / temperature)``: the rollout's sampling temperature."""
    recompute_old_logprobs: bool = False
    """Replace the engine's log-probs by the learner's recompute (kept as the behaviour log-probs)."""

    def __post_init__(self):
        check_temperature(self.temperature)

    def forward_options(self) -> dict:
        """The keywords of :func:`~gspo_mcore.learner.forward.forward_logprobs` under these settings (the
        micro-batching, the temperature, the LM-head keys of the loss)."""
        return dict(
            max_tokens=self.batch.max_tokens_per_microbatch,
            packing=self.batch.packing,
            temperature=self.temperature,
            loss_cfg=self.loss,
            share_prompt=bool(self.batch.share_prompt),
        )


def forward_backward(
    model,
    samples: list[TrainSample],
    layout: Layout,
    loss_cfg: LossConfig,
    *,
    max_tokens: int,
    packing: str = "padded",
    num_sequences: int | None = None,
    num_tokens: int | None = None,
    temperature: float = 1.0,
    replay_routing: bool = False,
    share_prompt: bool = False,
) -> dict[str, float]:
    """Accumulate the policy-loss gradient of ``samples`` into the model's gradient buffers (no step).

    ``samples``: the whole mini-batch, identical on all ranks, each with ``old_logprobs``.
    ``num_sequences``: the normaliser ``N`` (default: the samples with at least one counted token).
    ``num_tokens``: CISPO's normaliser ``M`` (default: the counted tokens of ``samples``).
    ``temperature``: the policy is ``softmax(logits / temperature)``, the rollout's sampling temperature.
    ``replay_routing``: force every token through the experts in its sample's ``routed_experts`` (MoE).
    ``share_prompt``: samples sharing a prompt compute it once (:mod:`.shared_prefix`).
    Returns the metrics of :func:`train_minibatch` except the optimizer's.
    """
    if replay_routing and any(s.routed_experts is None for s in samples):
        raise ValueError(
            "Routing Replay needs routed_experts on every sample (recorded by forward_logprobs with "
            "record_routing=True, which train_step does when RoutingConfig.replay is set)"
        )
    if any(s.old_logprobs is None for s in samples):
        raise ValueError("the policy loss needs old_logprobs on every sample (see train_step / forward_logprobs)")
    if loss_cfg.variant != "gspo_token":
        bad = next((i for i, s in enumerate(samples) if s.token_advantages is not None), None)
        if bad is not None:
            raise ValueError(
                f"sample {bad} carries per-token advantages, which only loss.variant=gspo_token uses "
                f"(loss.variant is {loss_cfg.variant!r})"
            )
    if loss_cfg.off_policy.mode != "none" and any(s.behaviour_logprobs is None for s in samples):
        raise ValueError(
            f"loss.off_policy.mode={loss_cfg.off_policy.mode!r} needs behaviour_logprobs (the engine's) on every "
            "sample, with old_logprobs the learner's recompute (train_step with recompute_old_logprobs=True)"
        )
    if loss_cfg.kl_coef > 0 and any(s.ref_logprobs is None for s in samples):
        raise ValueError("loss.kl_coef > 0 needs ref_logprobs on every sample (train_step with a ReferencePolicy)")
    n = count_sequences(samples) if num_sequences is None else num_sequences
    mbs = microbatches_for_rank(samples, layout, max_tokens, model=model, packing=packing, share_prompt=share_prompt)
    scale = float(len(mbs) * layout.dp_size)
    head = lm_head.fused_head(model, loss_cfg)
    m_tok = sum(s.num_response_tokens for s in samples) if num_tokens is None else num_tokens
    loss_func = partial(
        policy_loss_func,
        layout,
        loss_cfg,
        check_temperature(temperature),
        max(n, 1),
        scale,
        head,
        num_tokens=max(m_tok, 1),
    )
    store = run_schedule(
        model,
        mbs,
        loss_func,
        forward_only=False,
        tape=routing.tape(model, layout, replay=replay_routing),
        fused_head=loss_cfg.fused_lm_head,
    )
    metrics = reduce_metrics(
        store,
        layout,
        with_kl=all(s.ref_logprobs is not None for s in samples),
        with_off_policy=all(s.behaviour_logprobs is not None for s in samples),
        with_gate=loss_cfg.variant == "sapo",
    )
    metrics["num_microbatches"] = float(len(mbs))
    return metrics


def train_minibatch(
    model,
    optimizer,
    scheduler,
    samples: list[TrainSample],
    layout: Layout,
    loss_cfg: LossConfig,
    *,
    max_tokens: int,
    packing: str = "padded",
    temperature: float = 1.0,
    replay_routing: bool = False,
    share_prompt: bool = False,
) -> dict[str, float]:
    """One optimizer step on one mini-batch (``samples``: the whole mini-batch, identical on all ranks).

    Every sample must carry ``old_logprobs``. Returns the mini-batch's metrics, reduced over DP and
    available on every rank: ``loss``, ``grad_norm``, ``lr``, ``update_successful``, ``clip_fraction``,
    ``clipped_sequence_fraction``, ``ratio_mean/min/max``, ``nonfinite_tokens``, ``num_tokens``,
    ``num_sequences``, ``entropy`` (mean over counted tokens), ``num_microbatches`` (per DP rank).
    """
    zero_grads(model, optimizer)
    metrics = forward_backward(
        model,
        samples,
        layout,
        loss_cfg,
        max_tokens=max_tokens,
        packing=packing,
        temperature=temperature,
        replay_routing=replay_routing,
        share_prompt=share_prompt,
    )
    lr = current_lr(optimizer)
    ok, grad_norm = optimizer_step(optimizer, scheduler)
    metrics.update(grad_norm=grad_norm, update_successful=float(ok), lr=lr)
    return metrics


def train_step(
    model,
    optimizer,
    scheduler,
    samples: list[TrainSample],
    layout: Layout,
    settings: StepSettings,
    *,
    reference=None,
    measure_routing: bool = False,
) -> list[dict[str, float]]:
    """One rollout batch: old log-probs where needed, then one optimizer step per mini-batch.

    ``samples`` is the whole rollout batch, identical on every rank; ``settings`` the loss, batching, routing,
    temperature (the rollout's sampling temperature: the policy is ``softmax(logits / temperature)``) and
    ``recompute_old_logprobs``. Samples without ``old_logprobs`` (all of them with ``recompute_old_logprobs``)
    get them from a forward pass of the current, pre-update policy. Returns one metrics dict per mini-batch (see
    :func:`train_minibatch`); when rollout log-probs were replaced, each also has ``rollout_logprob_abs_diff``
    (mean over counted tokens of ``|recomputed - rollout|``).

    MoE models: with ``settings.routing.replay == "learner"`` (R2) the old-log-prob forward records every token's
    experts and the training forwards replay them (Routing Replay); samples that already carry
    ``routed_experts`` and ``old_logprobs`` are replayed as given. With ``"rollout"`` (R3) every sample must
    carry the engine's ``routed_experts`` (checked by :func:`routing.check_rollout_routing`), and the
    old-log-prob forward and the training forwards all replay them. With ``measure_routing`` the batch is
    forwarded again after the first optimizer step and every dict gets ``routing_changed_fraction`` and
    ``routing_expert_change_fraction`` (see :func:`routing.routing_change`); under R3 also
    ``routing_rollout_disagreement`` (the learner's own routing before the update against the engine's).

    Off-policy (docs/loss.md): with ``recompute_old_logprobs`` the samples' own log-probs (the engine's, mu)
    are kept as ``behaviour_logprobs`` next to the recompute (pi_prox): the metrics ``is_weight_*``,
    ``is_masked_fraction`` and ``kl_behaviour_prox`` are then reported, and ``settings.loss.off_policy`` weights
    the loss (a mode other than ``none`` requires ``recompute_old_logprobs``, or samples that bring their
    own ``old_logprobs`` / ``behaviour_logprobs`` pair). ``reference`` (a
    :class:`~gspo_mcore.learner.kl_reference.ReferencePolicy` built with ``settings.forward_options()``): its
    log-probs are attached as ``ref_logprobs`` when ``settings.loss.uses_reference`` (KL penalty / ``kl`` metric).
    """
    loss_cfg, batch_cfg, recompute_old_logprobs = settings.loss, settings.batch, settings.recompute_old_logprobs
    if loss_cfg.off_policy.mode != "none" and not recompute_old_logprobs:
        # samples may bring their own (pi_prox, mu) pair; otherwise the recompute below makes it
        missing = next((i for i, s in enumerate(samples) if s.behaviour_logprobs is None), None)
        if missing is not None:
            raise ValueError(
                f"loss.off_policy.mode={loss_cfg.off_policy.mode!r} needs the learner's recompute of the proximal "
                f"policy (rollout.old_logprobs: recompute), or behaviour_logprobs on every sample (sample {missing} "
                "has none)"
            )
    if loss_cfg.off_policy.mode != "none" and recompute_old_logprobs:
        missing = next((i for i, s in enumerate(samples) if s.old_logprobs is None), None)
        if missing is not None:
            raise ValueError(
                f"loss.off_policy.mode={loss_cfg.off_policy.mode!r} needs the behaviour (engine) log-probs, "
                f"but sample {missing} has none"
            )
    if loss_cfg.uses_reference and reference is None:
        raise ValueError("loss.kl_coef > 0 or loss.kl_metric needs a ReferencePolicy (train_step(reference=...))")
    extra = {}
    kw = settings.forward_options()
    plan = routing.plan(model, samples, settings.routing, measure=measure_routing)
    before = None  # the experts before the update: recorded, or (R3) the learner's own routing
    if plan.replay_old and plan.measure:  # the learner's own routing before the update, against the engine's
        _, before = forward_logprobs_with_routing(model, samples, layout, **kw)
        change = routing.routing_change([s.routed_experts for s in samples], before, samples)
        extra["routing_rollout_disagreement"] = change["routing_changed_fraction"]
    if recompute_old_logprobs or any(s.old_logprobs is None for s in samples) or plan.record_old:
        if plan.record_old:
            old, before = forward_logprobs_with_routing(model, samples, layout, **kw)
        else:
            old = forward_logprobs(model, samples, layout, replay_routing=plan.replay_old, **kw)
        extra.update(_rollout_logprob_diff(samples, old))
        samples = [
            replace(s, old_logprobs=lp, behaviour_logprobs=s.old_logprobs)
            if recompute_old_logprobs
            else (replace(s, old_logprobs=lp) if s.old_logprobs is None else s)
            for s, lp in zip(samples, old)
        ]
        if plan.keep_recorded:
            # the experts recorded with the old log-probs; samples that bring both keep their own pair
            samples = [
                s if s.routed_experts is not None and not recompute_old_logprobs else replace(s, routed_experts=r)
                for s, r in zip(samples, before)
            ]
    if loss_cfg.uses_reference:
        ref = reference.logprobs(samples)
        samples = [replace(s, ref_logprobs=lp) for s, lp in zip(samples, ref)]
    results = []
    for j, part in enumerate(split_minibatches(len(samples), batch_cfg.num_minibatches)):
        results.append(
            dict(
                train_minibatch(
                    model,
                    optimizer,
                    scheduler,
                    [samples[i] for i in part],
                    layout,
                    loss_cfg,
                    max_tokens=batch_cfg.max_tokens_per_microbatch,
                    packing=batch_cfg.packing,
                    temperature=settings.temperature,
                    replay_routing=plan.replay_training,
                    share_prompt=bool(batch_cfg.share_prompt),
                ),
                **extra,
            )
        )
        if j == 0 and plan.measure:
            _, after = forward_logprobs_with_routing(model, samples, layout, **kw)
            extra.update(routing.routing_change(before, after, samples))
    return [dict(r, **extra) for r in results]


def _rollout_logprob_diff(samples, old) -> dict[str, float]:
    """``rollout_logprob_abs_diff``: the mean over counted tokens of ``|recomputed - rollout|`` for the samples
    that brought the engine's log-probs (none: no metric)."""
    rollout = [(s, lp) for s, lp in zip(samples, old) if s.old_logprobs is not None]
    if not rollout:
        return {}
    diff = sum(float(((lp - s.old_logprobs.float()).abs() * s.loss_mask[1:].float()).sum()) for s, lp in rollout)
    count = sum(s.num_response_tokens for s, _ in rollout)
    return {"rollout_logprob_abs_diff": diff / max(count, 1)}
