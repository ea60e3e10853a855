"""MoE routing: record each token's experts, replay them (Routing Replay), and measure how often they change.

GSPO paper, section 5.3: after a gradient update, about 10% of the experts a 48-layer MoE activates for
the same rollout change, so GRPO's token ratios ``pi_theta / pi_old`` compare two different sub-networks
and training does not converge. *Routing Replay* records the experts each token used when the old
log-probs were computed and forces the same experts in the training forwards; GSPO, whose ratio is a
sequence-level likelihood, should not need it.

Data layout: a sample's routing is ``[L, num_layers, topk]`` int32, aligned with ``tokens`` (position ``t``
is the routing of input token ``t`` in every layer), with ``-1`` in dense layers. It is independent of the
parallel layout and of the micro-batch packing: it is recorded per micro-batch, scattered back to
samples and summed over the DP / PP / TP ranks that hold its pieces, so the training forward may pack
the samples differently (other mini-batches, micro-batch sizes, DP ranks) and still replay them.

The mechanism is Megatron-Core's own (``TopKRouter.router_replay``, enabled for MoE models by
``model_config.transformer_config``): this module drives each router's ``RouterReplay`` directly (record,
or replay a target), never through Megatron's process-wide list of instances.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from gspo_mcore.learner.shared_prefix import sample_positions

REPLAY_MODES = ("off", "learner", "rollout")


@dataclass(frozen=True, kw_only=True)
class RoutingConfig:
    """Routing Replay and routing-volatility measurement (MoE models; ignored for dense ones)."""

    replay: bool | str = "off"
    """``off``; ``learner`` (R2): record every token's experts in the learner's old-log-prob forward and replay
    them in the training forwards; ``rollout`` (R3): replay the experts the rollout engine routed each token
    to (SGLang's ``return_routed_experts``) in the old-log-prob and the training forwards. ``false`` /
    ``true`` are read as ``off`` / ``learner`` (older configs)."""
    measure_every: int = 0
    """Every this many steps (0: never), measure routing volatility: the fraction of (response token, MoE
    layer) expert choices that differ after the step's first optimizer update (one extra forward pass);
    with ``replay: rollout`` also ``routing_rollout_disagreement``, the fraction whose experts the learner's
    own router (before the update) chooses differently from the engine."""

    def __post_init__(self):
        replay = self.replay
        if isinstance(replay, bool):
            replay = "learner" if replay else "off"
        if replay not in REPLAY_MODES:
            raise ValueError(f"routing.replay must be one of {REPLAY_MODES} (or true/false), got {self.replay!r}")
        object.__setattr__(self, "replay", replay)
        if self.measure_every < 0:
            raise ValueError(f"RoutingConfig.measure_every must be >= 0, got {self.measure_every}")

    @property
    def enabled(self) -> bool:
        """Whether the training forwards replay recorded experts (``learner`` or ``rollout``)."""
        return self.replay != "off"


def moe_routers(chunk) -> list[tuple[int, object]]:
    """``[(layer_index, router)]`` of one model chunk: its top-k routers, by 0-based global layer index."""
    from gspo_mcore.learner.model import unwrap

    out = []
    for module in unwrap(chunk).modules():
        replay = getattr(module, "router_replay", None)
        if replay is not None and getattr(module, "layer_number", None) is not None:
            out.append((int(module.layer_number) - 1, module))
    return out


def is_moe(model) -> bool:
    return bool(getattr(model[0].config, "num_moe_experts", None))


def routing_dims(model) -> tuple[int, int]:
    """``(num_layers, topk)`` of the routing arrays of this model."""
    config = model[0].config
    return int(config.num_layers), int(config.moe_router_topk)


def moe_layer_indices(model) -> list[int]:
    """The 0-based global indices of the model's MoE layers (Megatron's ``moe_layer_freq``)."""
    config = model[0].config
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [i for i in range(int(config.num_layers)) if i % freq == 0]
    return [i for i, m in enumerate(freq) if m]


def check_replay_supported(model) -> None:
    """Refuse the combinations whose replay would silently use the wrong experts."""
    if not is_moe(model):
        raise ValueError("Routing Replay needs a MoE model (this one has no routers)")
    config = model[0].config
    if not any(moe_routers(chunk) for chunk in model) and config.pipeline_model_parallel_size == 1:
        raise ValueError(
            "Routing Replay: the model was built without routing replay support "
            "(TransformerConfig.moe_enable_routing_replay)"
        )
    if config.recompute_granularity is not None and config.pipeline_model_parallel_size > 1:
        raise ValueError(
            "Routing Replay with activation recomputation and pipeline parallelism is not supported: "
            "a recomputed micro-batch would replay another micro-batch's experts (turn one off)"
        )
    if config.moe_expert_capacity_factor is not None:
        raise ValueError("Routing Replay with token dropping (moe_expert_capacity_factor) is not supported")


class RoutingTape:
    """Per rank, for one pass of the schedule: replays each micro-batch's target experts, or records them.

    Plug it into the forward step: :meth:`before` just before a chunk's forward, :meth:`after` just after.
    ``record``: keep every router's chosen experts per micro-batch; ``replay``: force ``mb.routing``.
    """

    def __init__(self, model, *, record: bool = False, replay: bool = False, tp_rank: int = 0, tp_size: int = 1):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if record == replay:
            raise ValueError("RoutingTape: exactly one of record and replay")
        self._action = RouterReplayAction.RECORD if record else RouterReplayAction.REPLAY_FORWARD
        self.record, self.replay = record, replay
        self.sequence_parallel = bool(model[0].config.sequence_parallel) and tp_size > 1
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.routers = [r for chunk in model for r in moe_routers(chunk)]
        self._by_chunk = {id(chunk): moe_routers(chunk) for chunk in model}
        self.recorded: dict[int, dict[int, torch.Tensor]] = {}  # id(mb) -> layer -> [N_local, k]
        self._mbs: dict[int, object] = {}

    def __enter__(self):
        for _, router in self.routers:
            router.router_replay.set_router_replay_action(self._action)
        return self

    def __exit__(self, *exc):
        for _, router in self.routers:
            router.router_replay.clear_router_replay_action()
            router.router_replay.clear_indices()

    def _local_rows(self, rows: torch.Tensor, num_rows: int) -> torch.Tensor:
        """The rows (router order: sequence-major) this TP rank's routers see."""
        if not self.sequence_parallel:
            return rows
        per = num_rows // self.tp_size
        return rows[self.tp_rank * per : (self.tp_rank + 1) * per]

    def before(self, mb, chunk) -> None:
        if not self.replay:
            return
        routing = mb.routing  # (S, R, num_layers, k) in router order
        if routing is None and mb.sample_indices:
            raise ValueError("Routing Replay: the samples of a micro-batch carry no routed_experts")
        for layer, router in self._by_chunk.get(id(chunk), ()):
            if routing is None:  # an empty (dummy) micro-batch: any distinct experts will do
                rows = self._local_rows(torch.arange(mb.tokens.numel()), mb.tokens.shape[1]).numel()
                router.router_replay.target_topk_idx = (
                    torch.arange(router.topk, device=mb.tokens.device).expand(rows, router.topk).contiguous()
                )
                continue
            target = self._local_rows(routing[:, :, layer], routing.shape[0]).reshape(-1, routing.shape[-1])
            if bool((target < 0).any()):
                raise ValueError(f"Routing Replay: no recorded experts for MoE layer {layer}")
            router.router_replay.target_topk_idx = target.long()

    def after(self, mb, chunk) -> None:
        if not self.record:
            return
        self._mbs[id(mb)] = mb
        slot = self.recorded.setdefault(id(mb), {})
        for layer, router in self._by_chunk.get(id(chunk), ()):
            slot[layer] = router.router_replay.get_recorded_indices().detach()

    def scatter_to_samples(self, samples, layout, *, num_layers: int, topk: int) -> list[torch.Tensor]:
        """The recorded routing of every sample, ``[L, num_layers, topk]`` int32 (``-1``: dense layer), on
        every rank: each rank fills what it recorded, then one all-reduce over PP, TP and DP combines them."""
        lengths = [s.length for s in samples]
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        flat = torch.zeros(offsets[-1], num_layers, topk, dtype=torch.int32, device=layout.device)
        contributes = self.sequence_parallel or layout.tp_rank == 0  # without SP every TP rank routes all tokens
        for key, per_layer in self.recorded.items():
            mb = self._mbs[key]
            rows, width = mb.tokens.shape  # (R, S)
            cu = mb.cu_seqlens.tolist()
            for layer, idx in per_layer.items():
                full = torch.zeros(width, rows, topk, dtype=torch.int32, device=idx.device)
                local = idx.view(-1, rows, topk).to(torch.int32) + 1  # +1: 0 means "not recorded here"
                if self.sequence_parallel:
                    per = width // self.tp_size
                    full[self.tp_rank * per : (self.tp_rank + 1) * per] = local
                else:
                    full = local
                positions = full.transpose(0, 1).reshape(rows * width, topk)  # row-major, as cu_seqlens
                if not contributes:
                    continue
                for k, i in enumerate(mb.sample_indices):
                    if mb.score_index is None:
                        own = positions[cu[k] : cu[k] + lengths[i]]
                    else:  # shared prompts: each token's physical position (the prompt's: the unit's first sample's)
                        own = positions[mb.score_index[sample_positions(mb, k, lengths[i])]]
                    flat[offsets[i] : offsets[i + 1], layer] = own.to(flat.device)
        for group, size in (
            (layout.pp_group, layout.pp_size),
            (layout.tp_group, layout.tp_size),
            (layout.dp_group, layout.dp_size),
        ):
            if size > 1:
                dist.all_reduce(flat, group=group)
        flat = (flat - 1).cpu()
        return [flat[offsets[i] : offsets[i + 1]].clone() for i in range(len(samples))]


def microbatch_routing(
    seqs_routing: list[torch.Tensor | None],
    lengths: list[int],
    *,
    packing: str,
    width: int,
    topk: int,
    num_experts: int,
) -> torch.Tensor | None:
    """A micro-batch's replay target in router order, ``[S, R, num_layers, topk]`` int64, or ``None`` when
    its samples carry no routing.

    Padding positions, and positions a sample leaves unrouted (``-1``: the last token of an engine's routing,
    see :func:`check_rollout_routing`), get placeholder experts: Megatron's dropless dispatcher sizes its
    buffers as ``tokens x topk``, so every position occupies ``topk`` expert slots. The placeholders of the
    ``q``-th position in router order are experts ``(q * topk + j) mod num_experts``, ``j < topk``: distinct
    within a position and spread evenly over all experts (and so over the expert-parallel ranks), not piled
    onto the first experts of the first rank. Their outputs never reach a counted token (attention never
    looks at padding or at a sequence's last position, and no loss, metric or recording reads them)."""
    if not seqs_routing or any(r is None for r in seqs_routing):
        return None
    if not 1 <= topk <= num_experts:
        raise ValueError(f"microbatch_routing: topk={topk} must be in [1, num_experts={num_experts}]")
    num_layers = seqs_routing[0].shape[1]

    def padded(r: torch.Tensor, n: int) -> torch.Tensor:
        r = r.to(torch.int64)
        return torch.cat([r, r.new_full((n, num_layers, topk), -1)]) if n > 0 else r

    if packing == "padded":
        rows = [padded(r, width - n) for r, n in zip(seqs_routing, lengths)]
        out = torch.stack(rows, dim=1)  # (S, R, layers, k)
    else:
        out = padded(torch.cat([r.to(torch.int64) for r in seqs_routing]), width - sum(lengths))[:, None]
    S, R = out.shape[:2]
    q = torch.arange(S * R, dtype=torch.int64).view(S, R, 1, 1)  # router order: sequence-major
    fill = (q * topk + torch.arange(topk, dtype=torch.int64)) % num_experts  # (S, R, 1, k)
    unrouted = (out < 0).any(-1, keepdim=True)  # padding, unrouted rows and dense layers
    return torch.where(unrouted, fill, out).contiguous()


def routing_change(before: list[torch.Tensor], after: list[torch.Tensor], samples) -> dict[str, float]:
    """How much the experts chosen for the same tokens changed between two recordings.

    Counts the positions whose output is scored (position ``t`` with ``loss_mask[t + 1] == 1``) in the MoE
    layers (entries ``>= 0``). Returns ``routing_changed_fraction`` (fraction of (token, layer) pairs whose
    top-k expert set differs) and ``routing_expert_change_fraction`` (fraction of the chosen experts that
    were not chosen before), both 0 when nothing counts.
    """
    changed = new_experts = pairs = 0
    for b, a, s in zip(before, after, samples):
        if b.shape != a.shape:
            raise ValueError(
                f"routing_change: recordings of one sample differ in shape: {tuple(b.shape)} vs {tuple(a.shape)}"
            )
        counted = torch.zeros(b.shape[0], dtype=torch.bool)
        counted[:-1] = s.loss_mask[1:] > 0
        moe = (b[..., 0] >= 0) & counted[:, None]  # (L, layers)
        if not bool(moe.any()):
            continue
        bb, aa = b[moe].long(), a[moe].long()  # (P, k)
        kept = (aa[:, :, None] == bb[:, None, :]).any(-1)  # (P, k): the new choice was an old one
        changed += int((~kept).any(-1).sum())
        new_experts += int((~kept).sum())
        pairs += int(moe.sum())
    topk = before[0].shape[-1] if before else 1
    return {
        "routing_changed_fraction": changed / pairs if pairs else 0.0,
        "routing_expert_change_fraction": new_experts / (pairs * topk) if pairs else 0.0,
    }


def check_rollout_routing(samples, *, num_layers: int, topk: int, num_experts: int, moe_layers) -> None:
    """Check the engine's routing of every sample before R3 replays it (``routing.replay: rollout``).

    Each sample's ``routed_experts`` must be ``[L, num_layers, topk]`` with expert ids in ``[0, num_experts)``
    at every position but the last in every MoE layer (``moe_layers``: 0-based indices). The last position
    may be ``-1``: the engine never runs the last generated token through the model (SGLang returns
    ``L - 1`` rows), and its output is neither scored nor attended to. Fails naming the sample."""
    moe_layers = list(moe_layers)
    for i, s in enumerate(samples):
        r = s.routed_experts
        if r is None:
            raise ValueError(
                f"routing.replay=rollout: sample {i} carries no routed_experts (the rollout engine must return "
                "the experts it routed every token to)"
            )
        if tuple(r.shape) != (s.length, num_layers, topk):
            raise ValueError(
                f"routing.replay=rollout: sample {i} has routed_experts of shape {tuple(r.shape)}, expected "
                f"[L={s.length}, num_layers={num_layers}, topk={topk}]"
            )
        body = r[:-1][:, moe_layers]
        if body.numel() and (int(body.min()) < 0 or int(body.max()) >= num_experts):
            bad = ((body < 0) | (body >= num_experts)).any(-1).nonzero()[0].tolist()
            raise ValueError(
                f"routing.replay=rollout: sample {i} has no valid experts at position {bad[0]} in MoE layer "
                f"{moe_layers[bad[1]]} (ids must be in [0, {num_experts}); only the last position may be -1)"
            )


def tape(model, layout, *, record: bool = False, replay: bool = False) -> RoutingTape | None:
    """A :class:`RoutingTape` for one pass of the schedule (``None`` when it neither records nor replays)."""
    if not (record or replay):
        return None
    if replay:
        check_replay_supported(model)
    return RoutingTape(model, record=record, replay=replay, tp_rank=layout.tp_rank, tp_size=layout.tp_size)


@dataclass(frozen=True)
class RoutingPlan:
    """What one training step does with MoE routing, decided once from the config, the model and the batch
    (:func:`plan`)."""

    mode: str
    """``off`` (dense models too), ``learner`` (R2) or ``rollout`` (R3)."""
    measure: bool
    """Measure routing volatility this step (MoE only)."""
    record_old: bool
    """The old-log-prob forward records every token's experts: R2 (samples without ``routed_experts``), or a
    volatility measurement outside R3 (the routing before the update)."""

    @property
    def replay_old(self) -> bool:
        """The old-log-prob forward replays the engine's routing (R3)."""
        return self.mode == "rollout"

    @property
    def replay_training(self) -> bool:
        """The training forwards replay the samples' ``routed_experts`` (R2 or R3)."""
        return self.mode != "off"

    @property
    def keep_recorded(self) -> bool:
        """The experts recorded in the old-log-prob forward become the samples' ``routed_experts`` (R2)."""
        return self.mode == "learner"


def plan(model, samples, config: RoutingConfig, *, measure: bool) -> RoutingPlan:
    """The step's :class:`RoutingPlan`. Under R3 it checks the engine's routing of every sample first
    (:func:`check_rollout_routing`), naming the sample it refuses."""
    moe = is_moe(model)
    mode = config.replay if moe else "off"
    measure = measure and moe
    if mode == "rollout":
        c = model[0].config
        check_rollout_routing(
            samples,
            num_layers=int(c.num_layers),
            topk=int(c.moe_router_topk),
            num_experts=int(c.num_moe_experts),
            moe_layers=moe_layer_indices(model),
        )
    record_old = (mode == "learner" and any(s.routed_experts is None for s in samples)) or (
        measure and mode != "rollout"
    )
    return RoutingPlan(mode=mode, measure=measure, record_old=record_old)
