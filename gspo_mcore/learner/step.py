"""The training step and forward-only log-probs, through Megatron's ``get_forward_backward_func``.

Every pipeline schedule runs the same ``forward_step``: the model's output on the last stage is this
rank's vocabulary slice of the logits, ``[R, S, V/TP]`` (flattened to the micro-batch's ``T`` positions);
:func:`gspo_mcore.ops.token_logprobs` turns it into per-token log-probs with one all-reduce over the TP group
(full logits are never gathered), and
:func:`gspo_mcore.algo.policy_loss` turns those into the loss with ``N`` = the number of sequences in the
whole mini-batch (all micro-batches, all DP ranks).

Megatron divides each micro-batch's loss by the number of micro-batches and averages gradients over DP
ranks; our loss already carries the global ``1/N``, so the loss function multiplies by
``num_microbatches * dp_size`` and the mini-batch gradient is the exact sum of the micro-batch terms.

With ``LossConfig.fused_lm_head`` the last stage's output is its hidden states instead (see
:mod:`gspo_mcore.learner.lm_head`) and :func:`gspo_mcore.ops.linear_token_logprobs` computes the same log-probs
from them and the output weight, chunk by chunk, without the logits.

Context parallelism (CP > 1): every micro-batch is split over the CP group by
:mod:`gspo_mcore.learner.context_parallel`, the policy loss completes its per-sequence sums over the CP
group (one packed all-reduce), and Megatron's own CP handling (the 2-tuple loss multiplied by CP, gradients
averaged over DP x CP) leaves the scale above unchanged (docs/context-parallel.md).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, replace
from functools import partial
from typing import ClassVar, Literal

import torch
import torch.distributed as dist

from gspo_mcore import algo, ops
from gspo_mcore.config import check_literals
from gspo_mcore.learner import context_parallel, lm_head, routing
from gspo_mcore.learner.batching import (
    MicroBatch,
    Sample,
    build_microbatch,
    count_sequences,
    plan_microbatches,
    split_minibatches,
)
from gspo_mcore.learner.optimizer import current_lr, optimizer_step, zero_grads
from gspo_mcore.learner.parallel import Layout
from gspo_mcore.learner.routing import RoutingConfig

CPU_PACKINGS = ("padded", "block_diagonal")


@dataclass(frozen=True, kw_only=True)
class OffPolicyConfig:
    """The decoupled off-policy correction (docs/loss.md): the clipped ratio is taken against the learner's
    recompute pi_prox, and a constant weight ``pi_prox / mu`` (length-normalised per sequence for the GSPO
    variants, per token for GRPO) corrects for the engine's behaviour policy mu."""

    mode: Literal["none", "tis", "mis"] = "none"
    """``none``: no weight (the plain objective); ``tis``: ``min(w, cap)``; ``mis``: samples (GRPO: tokens)
    with ``w`` outside ``[1/cap, cap]`` get no gradient. Needs ``rollout.old_logprobs: recompute``."""
    cap: float = 2.0
    """``C`` (> 1)."""

    def __post_init__(self):
        check_literals(self)
        if isinstance(self.cap, bool) or not (isinstance(self.cap, (int, float)) and math.isfinite(self.cap)):
            raise ValueError(f"loss.off_policy.cap must be a finite number > 1, got {self.cap!r}")
        if self.cap <= 1:
            raise ValueError(f"loss.off_policy.cap must be > 1 (the weights are kept in [1/cap, cap]), got {self.cap}")


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """The policy loss. (Its temperature is the rollout's sampling temperature: ``train_step(temperature=)``.)"""

    REMOVED_KEYS: ClassVar[dict[str, str]] = {
        "temperature": "the policy's temperature is defined once, by rollout.sampling.temperature",
        "recompute_old_logprobs": "set rollout.old_logprobs (recompute or rollout)",
    }

    variant: Literal["gspo", "gspo_token", "grpo"] = "gspo"
    """``"gspo"`` (sequence ratio), ``"gspo_token"`` (GSPO-token) or ``"grpo"`` (token ratios)."""
    eps_low: float | None = None
    """Clip range ``[1 - eps_low, 1 + eps_high]``; ``None``: the variant's paper default."""
    eps_high: float | None = None
    compute_entropy: bool = True
    """Report the mean entropy of the counted tokens."""
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)
    """The train/inference (and staleness) correction; off by default."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the frozen initial policy (0: none, as in the paper)."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """Per-token KL estimator: ``k1 = logp - ref``, ``k3 = exp(ref - logp) - (ref - logp) - 1``."""
    kl_metric: bool = False
    """Report ``kl`` (to the initial policy) even when ``kl_coef`` is 0 (costs the reference forward)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (the loss subtracts ``entropy_coef`` x the sequence-mean entropy)."""
    fused_lm_head: bool = False
    """Compute the log-probs from the last hidden states and the output weight in vocabulary chunks
    (:func:`gspo_mcore.ops.linear_token_logprobs`): the ``[T, V/TP]`` logits and their gradient are never
    built (the output layer's matmul is recomputed per chunk in backward)."""
    fused_lm_head_chunk: int = 4096
    """Vocabulary columns per chunk of the fused LM head: at most ``[T, chunk]`` logits exist at once."""

    def __post_init__(self):
        if self.fused_lm_head_chunk < 1:
            raise ValueError(f"loss.fused_lm_head_chunk must be >= 1, got {self.fused_lm_head_chunk}")
        check_literals(self)
        for key in ("kl_coef", "entropy_coef"):
            v = getattr(self, key)
            if isinstance(v, bool) or not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"loss.{key} must be a finite number >= 0, got {v!r}")

    @property
    def uses_reference(self) -> bool:
        """Whether the reference policy's log-probs are needed (KL penalty or metric)."""
        return self.kl_coef > 0 or self.kl_metric

    @property
    def needs_entropy(self) -> bool:
        return self.compute_entropy or self.entropy_coef > 0

    def head(self, model) -> lm_head.FusedHead | None:
        """The fused head of ``model``'s last stage when ``fused_lm_head`` (``None`` otherwise, or on
        another pipeline stage); raises ``ValueError`` naming the key for a model it cannot serve."""
        return lm_head.head_for(model, self.fused_lm_head_chunk) if self.fused_lm_head else None


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

    def __post_init__(self):
        if self.num_minibatches < 1:
            raise ValueError(f"BatchConfig.num_minibatches must be >= 1, got {self.num_minibatches}")
        if self.max_tokens_per_microbatch < 2:
            raise ValueError(
                f"BatchConfig.max_tokens_per_microbatch must be >= 2, got {self.max_tokens_per_microbatch}"
            )
        check_literals(self)


# Layout of the per-micro-batch statistics vector (summed over micro-batches and ranks).
_SUMS = (
    "loss",
    "clipped_tokens",
    "clipped_sequences",
    "ratio_sum",
    "ratio_weight",
    "nonfinite_tokens",
    "num_tokens",
    "num_sequences",
    "entropy_sum",
    "kl_sum",
    "is_weight_sum",
    "is_weight_count",
    "is_masked",
    "mu_kl_sum",
    "mu_kl_count",
)
_MAXES = ("neg_ratio_min", "ratio_max", "neg_is_weight_min", "is_weight_max")


def uses_transformer_engine(model) -> bool:
    """Whether the model was built with the Transformer Engine spec (then micro-batches are THD-packed)."""
    from gspo_mcore.learner.model import unwrap

    for module in unwrap(model[0]).modules():
        if type(module).__module__.startswith("megatron.core.extensions.transformer_engine"):
            return True
    return False


def microbatches_for_rank(
    samples, layout: Layout, max_tokens: int, *, model, packing: str = "padded"
) -> list[MicroBatch]:
    """This DP rank's micro-batches of ``samples`` (the same list on every rank).

    ``packing`` (``"padded"`` or ``"block_diagonal"``) applies without Transformer Engine; with it the
    micro-batches are THD packed sequences.
    """
    if packing not in CPU_PACKINGS:
        raise ValueError(f"packing must be one of {CPU_PACKINGS}, got {packing!r}")
    if uses_transformer_engine(model):
        packing = "thd"
    config = model[0].config
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


def _forward_step(loss_func, tape, fused_head, data_iterator, model):
    mb: MicroBatch = next(data_iterator)
    if tape is not None:
        tape.before(mb, model)
    with lm_head.hidden_states_out(model) if fused_head else contextlib.nullcontext():
        output = model(mb.tokens, mb.position_ids, mb.attention_mask, packed_seq_params=mb.packed_seq_params)
    if tape is not None:
        tape.after(mb, model)
    return output, partial(loss_func, mb)


def _check_temperature(temperature: float) -> float:
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    return float(temperature)


def _token_logprobs(mb: MicroBatch, logits: torch.Tensor, layout: Layout, temperature: float, entropy: bool, head=None):
    logits = logits.reshape(-1, logits.shape[-1])[: mb.num_tokens]  # (R, S, V/TP) -> (T, V/TP)
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


def _policy_loss_func(layout, loss_cfg, temperature, num_sequences, scale, head, mb, logits):
    out = _token_logprobs(mb, logits, layout, temperature, loss_cfg.needs_entropy, head)
    logp, entropy = out if loss_cfg.needs_entropy else (out, None)
    zero = logp.new_zeros((), dtype=torch.float32)
    weights, off = None, {}
    cp_group = layout.cp_group if layout.cp_size > 1 else None
    if mb.behaviour_logprobs is not None:
        level = "token" if loss_cfg.variant == "grpo" else "sequence"
        w, off = algo.off_policy_weights(
            mb.old_logprobs,
            mb.behaviour_logprobs,
            mb.cu_seqlens,
            mb.loss_mask,
            mode=loss_cfg.off_policy.mode,
            cap=loss_cfg.off_policy.cap,
            level=level,
            cp_group=cp_group,
        )
        weights = w if loss_cfg.off_policy.mode != "none" else None
    advantages = mb.token_advantages if mb.token_advantages is not None else mb.advantages
    loss, m = algo.policy_loss(
        logp,
        mb.old_logprobs,
        advantages,
        mb.cu_seqlens,
        mb.loss_mask,
        variant=loss_cfg.variant,
        eps_low=loss_cfg.eps_low,
        eps_high=loss_cfg.eps_high,
        num_sequences=num_sequences,
        weights=weights,
        cp_group=cp_group,
    )
    extra, r = algo.regularizer_loss(
        logp,
        mb.cu_seqlens,
        mb.loss_mask,
        num_sequences=num_sequences,
        ref_logp=mb.ref_logprobs,
        kl_coef=loss_cfg.kl_coef,
        kl_estimator=loss_cfg.kl_estimator,
        entropy=entropy if loss_cfg.entropy_coef > 0 else None,
        entropy_coef=loss_cfg.entropy_coef,
        cp_group=cp_group,
    )
    loss = loss + extra
    weight = m["num_tokens"] if loss_cfg.variant == "grpo" else m["num_sequences"]
    none = weight == 0
    entropy_sum = (entropy.detach() * mb.loss_mask).sum() if entropy is not None else zero
    sums = torch.stack(
        [
            loss.detach(),
            m["clip_fraction"] * m["num_tokens"],
            m["clipped_sequence_fraction"] * m["num_sequences"],
            m["ratio_mean"] * weight,
            weight,
            m["nonfinite_tokens"],
            m["num_tokens"],
            m["num_sequences"],
            entropy_sum,
            r.get("kl_sum", zero),
            *(off.get(k, zero) for k in ("is_weight_sum", "is_weight_count", "is_masked", "mu_kl_sum", "mu_kl_count")),
        ]
    )
    no_w = off.get("is_weight_count", zero) == 0
    maxes = torch.stack(
        [
            torch.where(none, -math.inf, -m["ratio_min"]),
            torch.where(none, -math.inf, m["ratio_max"]),
            torch.where(no_w, -math.inf, -off.get("is_weight_min", zero)),
            torch.where(no_w, -math.inf, off.get("is_weight_max", zero)),
        ]
    )
    return loss * scale, {"sums": sums, "maxes": maxes}


def _configure(model) -> None:
    from megatron.core.distributed import finalize_model_grads

    config = model[0].config
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model[0].no_sync if len(model) == 1 else [m.no_sync for m in model]


def _run_schedule(model, microbatches, loss_func, *, forward_only: bool, tape=None, fused_head: bool = False):
    """Megatron's schedule over ``microbatches``; ``tape`` (a :class:`routing.RoutingTape`) records or
    replays the MoE routing of every micro-batch; ``fused_head``: the last stage outputs hidden states."""
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


def _tape(model, layout: Layout, *, record: bool = False, replay: bool = False):
    if not (record or replay):
        return None
    if replay:
        routing.check_replay_supported(model)
    return routing.RoutingTape(model, record=record, replay=replay, tp_rank=layout.tp_rank, tp_size=layout.tp_size)


def forward_backward(
    model,
    samples: list[Sample],
    layout: Layout,
    loss_cfg: LossConfig,
    *,
    max_tokens: int,
    packing: str = "padded",
    num_sequences: int | None = None,
    temperature: float = 1.0,
    replay_routing: bool = False,
) -> dict[str, float]:
    """Accumulate the policy-loss gradient of ``samples`` into the model's gradient buffers (no step).

    ``samples``: the whole mini-batch, identical on all ranks, each with ``old_logprobs``.
    ``num_sequences``: the normaliser ``N`` (default: the samples with at least one counted token).
    ``temperature``: the policy is ``softmax(logits / temperature)``, the rollout's sampling temperature.
    ``replay_routing``: force every token through the experts in its sample's ``routed_experts`` (MoE).
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
    mbs = microbatches_for_rank(samples, layout, max_tokens, model=model, packing=packing)
    scale = float(len(mbs) * layout.dp_size)
    head = loss_cfg.head(model)
    loss_func = partial(_policy_loss_func, layout, loss_cfg, _check_temperature(temperature), max(n, 1), scale, head)
    store = _run_schedule(
        model,
        mbs,
        loss_func,
        forward_only=False,
        tape=_tape(model, layout, replay=replay_routing),
        fused_head=loss_cfg.fused_lm_head,
    )
    metrics = _reduce_metrics(
        store,
        layout,
        with_kl=all(s.ref_logprobs is not None for s in samples),
        with_off_policy=all(s.behaviour_logprobs is not None for s in samples),
    )
    metrics["num_microbatches"] = float(len(mbs))
    return metrics


def train_minibatch(
    model,
    optimizer,
    scheduler,
    samples: list[Sample],
    layout: Layout,
    loss_cfg: LossConfig,
    *,
    max_tokens: int,
    packing: str = "padded",
    temperature: float = 1.0,
    replay_routing: bool = False,
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
    )
    lr = current_lr(optimizer)
    ok, grad_norm = optimizer_step(optimizer, scheduler)
    metrics.update(grad_norm=grad_norm, update_successful=float(ok), lr=lr)
    return metrics


def _reduce_metrics(store, layout: Layout, *, with_kl: bool = False, with_off_policy: bool = False) -> dict[str, float]:
    sums = torch.zeros(len(_SUMS), dtype=torch.float32, device=layout.device)
    maxes = torch.full((len(_MAXES),), -math.inf, dtype=torch.float32, device=layout.device)
    for item in store if layout.is_last_stage else []:
        sums += item["sums"].float()
        maxes = torch.maximum(maxes, item["maxes"].float())
    if layout.cp_size > 1:  # every CP rank holds the complete per-sequence sums, but only its tokens' entropy
        k = _SUMS.index("entropy_sum")
        dist.all_reduce(sums[k : k + 1], group=layout.cp_group)
    for group, size in ((layout.pp_group, layout.pp_size), (layout.dp_group, layout.dp_size)):
        if size > 1:
            dist.all_reduce(sums, group=group)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
    s = dict(zip(_SUMS, sums.tolist()))
    mx = dict(zip(_MAXES, maxes.tolist()))
    ratio_known = s["ratio_weight"] > 0
    out = {
        "loss": s["loss"],
        "clip_fraction": s["clipped_tokens"] / max(s["num_tokens"], 1.0),
        "clipped_sequence_fraction": s["clipped_sequences"] / max(s["num_sequences"], 1.0),
        "ratio_mean": s["ratio_sum"] / s["ratio_weight"] if ratio_known else 1.0,
        "ratio_min": -mx["neg_ratio_min"] if ratio_known else 1.0,
        "ratio_max": mx["ratio_max"] if ratio_known else 1.0,
        "nonfinite_tokens": s["nonfinite_tokens"],
        "num_tokens": s["num_tokens"],
        "num_sequences": s["num_sequences"],
        "entropy": s["entropy_sum"] / max(s["num_tokens"], 1.0),
    }
    if with_off_policy:  # the batch carried behaviour log-probs (see train_step)
        known = s["is_weight_count"] > 0
        out.update(
            is_weight_mean=s["is_weight_sum"] / s["is_weight_count"] if known else 1.0,
            is_weight_min=-mx["neg_is_weight_min"] if known else 1.0,
            is_weight_max=mx["is_weight_max"] if known else 1.0,
            is_masked_fraction=s["is_masked"] / max(s["is_weight_count"], 1.0),
            kl_behaviour_prox=s["mu_kl_sum"] / max(s["mu_kl_count"], 1.0),
        )
    if with_kl:
        out["kl"] = s["kl_sum"] / max(s["num_sequences"], 1.0)
    return out


def _logprob_func(layout, temperature, head, mb, logits):
    logp = _token_logprobs(mb, logits, layout, temperature, False, head)
    return logits.new_zeros(()), {"logp": logp.detach().float(), "mb": mb}


@torch.no_grad()
def forward_logprobs(
    model,
    samples: list[Sample],
    layout: Layout,
    *,
    max_tokens: int,
    packing: str = "padded",
    temperature: float = 1.0,
    loss_cfg: LossConfig | None = None,
    replay_routing: bool = False,
) -> list[torch.Tensor]:
    """Log-probs of ``tokens[1:]`` for every sample (``[L-1]`` float32 each, on the CPU, on every rank).

    Runs forward only through the same schedule and micro-batching as training (old-policy or reference
    log-probs). ``samples`` is the same list on every rank. ``loss_cfg``: only its fused-LM-head keys are
    used (default: the logits path). ``replay_routing``: force every token through the experts in its
    sample's ``routed_experts`` (MoE; R3 replays the rollout engine's routing here too).
    """
    if replay_routing and any(s.routed_experts is None for s in samples):
        raise ValueError("forward_logprobs(replay_routing=True) needs routed_experts on every sample")
    return _forward_logprobs(
        model,
        samples,
        layout,
        max_tokens=max_tokens,
        packing=packing,
        temperature=temperature,
        loss_cfg=loss_cfg,
        tape=_tape(model, layout, replay=replay_routing),
    )[0]


@torch.no_grad()
def forward_logprobs_with_routing(
    model,
    samples: list[Sample],
    layout: Layout,
    *,
    max_tokens: int,
    packing: str = "padded",
    temperature: float = 1.0,
    loss_cfg: LossConfig | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """:func:`forward_logprobs` of a MoE model, plus the experts every token was routed to: per sample
    ``[L, num_layers, topk]`` int32 (``-1`` in dense layers), on every rank (see :mod:`.routing`)."""
    if not routing.is_moe(model):
        raise ValueError("forward_logprobs_with_routing needs a MoE model")
    tape = _tape(model, layout, record=True)
    logps, _ = _forward_logprobs(
        model,
        samples,
        layout,
        max_tokens=max_tokens,
        packing=packing,
        temperature=temperature,
        tape=tape,
        loss_cfg=loss_cfg,
    )
    num_layers, topk = routing.routing_dims(model)
    return logps, tape.scatter_to_samples(samples, layout, num_layers=num_layers, topk=topk)


def _forward_logprobs(model, samples, layout, *, max_tokens, packing, temperature, tape=None, loss_cfg=None):
    mbs = microbatches_for_rank(samples, layout, max_tokens, model=model, packing=packing)
    head = loss_cfg.head(model) if loss_cfg is not None else None
    store = _run_schedule(
        model,
        mbs,
        partial(_logprob_func, layout, _check_temperature(temperature), head),
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
            flat[offsets[i] : offsets[i + 1]] = logp[cu[k] : cu[k] + sizes[i]]
    groups = ((layout.pp_group, layout.pp_size), (layout.dp_group, layout.dp_size), (layout.cp_group, layout.cp_size))
    for group, size in groups:
        if size > 1:
            dist.all_reduce(flat, group=group)
    flat = flat.cpu()
    return [flat[offsets[i] : offsets[i + 1]].clone() for i in range(len(samples))], mbs


def train_step(
    model,
    optimizer,
    scheduler,
    samples: list[Sample],
    layout: Layout,
    loss_cfg: LossConfig,
    batch_cfg: BatchConfig,
    routing_cfg: RoutingConfig = RoutingConfig(),
    *,
    temperature: float = 1.0,
    recompute_old_logprobs: bool = False,
    measure_routing: bool = False,
    reference=None,
) -> list[dict[str, float]]:
    """One rollout batch: old log-probs where needed, then one optimizer step per mini-batch.

    ``samples`` is the whole rollout batch, identical on every rank; ``temperature`` the rollout's sampling
    temperature (the policy is ``softmax(logits / temperature)``). Samples without ``old_logprobs``
    (all of them with ``recompute_old_logprobs``) get them from a forward pass of the current,
    pre-update policy. Returns one metrics dict per mini-batch (see :func:`train_minibatch`); when
    rollout log-probs were replaced, each also has ``rollout_logprob_abs_diff`` (mean over counted tokens
    of ``|recomputed - rollout|``).

    MoE models: with ``routing_cfg.replay == "learner"`` (R2) the old-log-prob forward records every token's
    experts and the training forwards replay them (Routing Replay); samples that already carry
    ``routed_experts`` and ``old_logprobs`` are replayed as given. With ``"rollout"`` (R3) every sample must
    carry the engine's ``routed_experts`` (checked by :func:`routing.check_rollout_routing`), and the
    old-log-prob forward and the training forwards all replay them. With ``measure_routing`` the batch is
    forwarded again after the first optimizer step and every dict gets ``routing_changed_fraction`` and
    ``routing_expert_change_fraction`` (see :func:`routing.routing_change`); under R3 also
    ``routing_rollout_disagreement`` (the learner's own routing before the update against the engine's).

    Off-policy (docs/loss.md): with ``recompute_old_logprobs`` the samples' own log-probs (the engine's, mu)
    are kept as ``behaviour_logprobs`` next to the recompute (pi_prox): the metrics ``is_weight_*``,
    ``is_masked_fraction`` and ``kl_behaviour_prox`` are then reported, and ``loss_cfg.off_policy`` weights
    the loss (a mode other than ``none`` requires ``recompute_old_logprobs``, or samples that bring their
    own ``old_logprobs`` / ``behaviour_logprobs`` pair). ``reference`` (a
    :class:`~gspo_mcore.learner.reference.ReferencePolicy`): its log-probs are attached as ``ref_logprobs``
    when ``loss_cfg.uses_reference`` (KL penalty / ``kl`` metric).
    """
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
    moe = routing.is_moe(model)
    mode = routing_cfg.replay if moe else "off"
    replay = mode == "learner"  # R2: record in the old-log-prob forward, replay in the training forwards
    from_rollout = mode == "rollout"  # R3: replay the engine's routing in both
    measure = measure_routing and moe
    before = None
    kw = dict(
        max_tokens=batch_cfg.max_tokens_per_microbatch,
        packing=batch_cfg.packing,
        temperature=temperature,
        loss_cfg=loss_cfg,
    )
    if from_rollout:
        config = model[0].config
        routing.check_rollout_routing(
            samples,
            num_layers=int(config.num_layers),
            topk=int(config.moe_router_topk),
            num_experts=int(config.num_moe_experts),
            moe_layers=routing.moe_layer_indices(model),
        )
        if measure:  # the learner's own routing before the update, against the engine's
            _, before = forward_logprobs_with_routing(model, samples, layout, **kw)
            change = routing.routing_change([s.routed_experts for s in samples], before, samples)
            extra["routing_rollout_disagreement"] = change["routing_changed_fraction"]
    needs_routing = (replay and any(s.routed_experts is None for s in samples)) or (measure and not from_rollout)
    if recompute_old_logprobs or any(s.old_logprobs is None for s in samples) or needs_routing:
        if needs_routing:
            old, before = forward_logprobs_with_routing(model, samples, layout, **kw)
        else:
            old = forward_logprobs(model, samples, layout, replay_routing=from_rollout, **kw)
        rollout = [(s, lp) for s, lp in zip(samples, old) if s.old_logprobs is not None]
        if rollout:
            diff = sum(
                float(((lp - s.old_logprobs.float()).abs() * s.loss_mask[1:].float()).sum()) for s, lp in rollout
            )
            count = sum(s.num_response_tokens for s, _ in rollout)
            extra["rollout_logprob_abs_diff"] = diff / max(count, 1)
        samples = [
            replace(s, old_logprobs=lp, behaviour_logprobs=s.old_logprobs)
            if recompute_old_logprobs
            else (replace(s, old_logprobs=lp) if s.old_logprobs is None else s)
            for s, lp in zip(samples, old)
        ]
        if replay:
            # the experts recorded with the old log-probs; samples that bring both keep their own pair
            samples = [
                s if s.routed_experts is not None and not recompute_old_logprobs else replace(s, routed_experts=r)
                for s, r in zip(samples, before)
            ]
    if loss_cfg.uses_reference:
        ref = reference.logprobs(model, samples, layout, **kw)
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
                    temperature=temperature,
                    replay_routing=replay or from_rollout,
                ),
                **extra,
            )
        )
        if j == 0 and measure:
            _, after = forward_logprobs_with_routing(model, samples, layout, **kw)
            extra.update(routing.routing_change(before, after, samples))
    return [dict(r, **extra) for r in results]
