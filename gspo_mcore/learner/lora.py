"""LoRA adapters on Megatron-Core's tensor-parallel linears (the local layer spec), with the base weights frozen.

A targeted linear computes ``base(x) + (alpha / rank) * B(A(dropout(x)))`` with ``A: [rank, in]`` and
``B: [out, rank]`` (PEFT's shapes). The adapters are two parameters of the linear itself, ``lora_A`` and
``lora_B`` (the class of the module is swapped for a subclass that adds them to its forward and to its sharded
state dict), so checkpoints, Megatron DDP and the optimizer see them like any other parameter, and every other
parameter of the model is frozen (``requires_grad=False``: Megatron's DDP gives it no gradient buffer, the
optimizer, default or distributed, does not hold it, the gradient norm and clipping cover the adapters only, and
a frozen linear takes Megatron's ``linear_with_frozen_weight`` path, which computes no weight gradient).

Tensor parallelism splits the adapters the way Megatron splits the base weight:

- column-parallel base (``linear_qkv``, ``linear_fc1``; output split over TP): ``A`` is replicated, ``B`` is
  split by output rows like the weight. ``A x`` is the full ``[.., rank]`` on every rank; Megatron's
  ``copy_to_tensor_model_parallel_region`` between ``A`` and ``B`` (identity forward, all-reduce backward) makes
  the gradient reaching ``A x`` the sum over the TP ranks' output slices, so ``A``'s gradient is the full one,
  identical on every TP rank;
- row-parallel base (``linear_proj``, ``linear_fc2``; input split over TP): ``A`` is split by input columns
  like the weight, ``reduce_from_tensor_model_parallel_region`` sums the partial ``A x`` over TP (all-reduce
  forward, identity backward), and ``B`` is replicated (its gradient is the same on every TP rank because the
  row-parallel output and its gradient are).

Targets are named by their Hugging Face names. Megatron-Core fuses ``q_proj``/``k_proj``/``v_proj`` into
``linear_qkv`` and ``gate_proj``/``up_proj`` into ``linear_fc1``; one adapter sits on the fused linear, so a
target list must name all of a fused group or none of it (a partial group is refused at start-up, naming the
group and the names it needs). Refused with LoRA, naming the key: sequence parallelism, context parallelism,
Transformer Engine (its linears are other classes), and the MLP targets of a MoE model (the grouped experts).

Initialisation does not depend on the layout (like :func:`~gspo_mcore.learner.model.init_weights`): each global
``A`` is drawn from a generator keyed by ``init_seed`` and its checkpoint name (PEFT's Kaiming-uniform bound,
``U(-1/sqrt(in), 1/sqrt(in))``), this rank copies its shard; ``B = 0``, so at initialisation the model's outputs
equal the base model's bit for bit. :func:`merged_weight` gives ``W + (alpha / rank) B A`` of this rank's shard
(exports and weight syncs write merged weights).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

HF_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The Hugging Face names a target list may use (or :data:`ALL_LINEAR` alone)."""
ALL_LINEAR = "all-linear"
MEGATRON_GROUPS = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
"""Megatron-Core's linear of each transformer layer -> the Hugging Face projections it holds (fused groups)."""
COLUMN = ("linear_qkv", "linear_fc1")
"""Column-parallel (output split over TP); the others are row-parallel (input split)."""
MLP = ("linear_fc1", "linear_fc2")


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """LoRA adapters on the transformer layers' linears (``rank: 0``, the default, is off: full fine-tuning)."""

    rank: int = 0
    """The adapters' rank ``r`` (0: off). At most the smaller size of every targeted linear."""
    alpha: float = 32.0
    """The scale's numerator: the adapters' output is multiplied by ``alpha / rank``."""
    dropout: float = 0.0
    """Dropout on the adapters' input, in [0, 1), applied only in forwards that carry a gradient (the training
    forward), never in forward-only log-probs or decoding. Not layout invariant (a random mask per rank)."""
    target_modules: tuple[str, ...] = (ALL_LINEAR,)
    """Hugging Face names of the adapted projections (``q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    down_proj``) or ``all-linear`` alone (all seven). Fused in Megatron-Core: ``q_proj``/``k_proj``/``v_proj``
    (``linear_qkv``) and ``gate_proj``/``up_proj`` (``linear_fc1``) must be named together or not at all."""
    init_seed: int = 1234
    """Seed of ``A``'s initialisation (layout independent; ``B`` starts at 0)."""

    def __post_init__(self):
        if isinstance(self.target_modules, str):
            object.__setattr__(self, "target_modules", tuple(t.strip() for t in self.target_modules.split(",")))
        else:
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"lora.rank must be an integer >= 1 (or 0: LoRA off), got {self.rank!r}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"lora.alpha must be a finite number > 0, got {self.alpha!r}")
        if not (isinstance(self.dropout, (int, float)) and 0 <= self.dropout < 1):
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")
        targets = self.target_modules
        if not targets:
            raise ValueError(f"lora.target_modules must name at least one of {HF_TARGETS} or {ALL_LINEAR!r}")
        unknown = [t for t in targets if t not in HF_TARGETS and t != ALL_LINEAR]
        if unknown:
            raise ValueError(
                f"lora.target_modules: unknown name(s) {unknown}; the valid names are {list(HF_TARGETS)} or "
                f"{ALL_LINEAR!r} alone"
            )
        if ALL_LINEAR in targets and len(targets) > 1:
            raise ValueError(f"lora.target_modules: {ALL_LINEAR!r} must stand alone, got {list(targets)}")
        named = set(HF_TARGETS if ALL_LINEAR in targets else targets)
        for megatron, group in MEGATRON_GROUPS.items():
            if 0 < len(named & set(group)) < len(group):
                raise ValueError(
                    f"lora.target_modules names {sorted(named & set(group), key=group.index)} but not "
                    f"{[g for g in group if g not in named]}: Megatron-Core fuses {list(group)} into one linear "
                    f"({megatron}) with one adapter, so name all of {list(group)} or none of them"
                )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        """``alpha / rank``."""
        return self.alpha / self.rank

    @property
    def megatron_targets(self) -> tuple[str, ...]:
        """The Megatron-Core linears adapted (names within a transformer layer's attention or MLP)."""
        named = set(HF_TARGETS if ALL_LINEAR in self.target_modules else self.target_modules)
        return tuple(m for m, group in MEGATRON_GROUPS.items() if named & set(group))


def check_layout(cfg: LoraConfig, *, arch, parallel, use_te: bool) -> None:
    """Refuse, naming the keys, what LoRA cannot be combined with (before anything is built)."""
    if not cfg.enabled:
        return
    if parallel.use_sequence_parallel(arch):
        raise ValueError(
            "lora.rank > 0 with sequence parallelism (parallel.sequence_parallel): a replicated adapter would see "
            "a sequence-split input and need its gradient summed over TP, which is not implemented"
        )
    if parallel.context > 1:
        raise ValueError(
            f"lora.rank > 0 with parallel.context={parallel.context}: LoRA is not implemented with context "
            "parallelism (set parallel.context: 1)"
        )
    if use_te:
        raise ValueError(
            "lora.rank > 0 with Transformer Engine (model.options.use_te, on by default on a GPU with TE): the "
            "adapters wrap Megatron-Core's local linears only; set model.options.use_te: false"
        )
    if arch.is_moe:
        mlp = [t for t in cfg.megatron_targets if t in MLP]
        if mlp:
            names = [n for m in mlp for n in MEGATRON_GROUPS[m]]
            raise ValueError(
                f"lora.target_modules names the MLP projections {names} of a MoE model ({arch.model_type}): "
                "adapters on the grouped experts are not implemented; target q_proj, k_proj, v_proj, o_proj only"
            )


def _lora_forward(self, input_, *args, **kwargs):
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )

    output, bias = super(type(self), self).forward(input_, *args, **kwargs)
    x = input_
    if self.lora_dropout > 0 and self.training and torch.is_grad_enabled():
        x = torch.nn.functional.dropout(x, p=self.lora_dropout, training=True)
    a = torch.matmul(x, self.lora_A.t())
    if self.lora_column:
        a = copy_to_tensor_model_parallel_region(a, group=self.tp_group)
    else:
        a = reduce_from_tensor_model_parallel_region(a, group=self.tp_group)
    return output + self.lora_scale * torch.matmul(a, self.lora_B.t()), bias


def _lora_sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    axes = {"weight": 0, "bias": 0, "lora_B": 0} if self.lora_column else {"weight": 1, "lora_A": 1}
    out = make_sharded_tensors_for_checkpoint(
        self.state_dict(prefix="", keep_vars=True),
        prefix,
        axes,
        sharded_offsets,
        tp_group=self.tp_group,
        dp_cp_group=metadata["dp_cp_group"],
    )
    if self.lora_swiglu:
        # SwiGLU's linear_fc1: each TP rank holds [gate_r; up_r]; the global B is [gate; up], like the weight's
        # (Megatron's MLP applies the same factory to linear_fc1.weight)
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        key = f"{prefix}lora_B"
        out[key] = apply_swiglu_sharded_factory(
            out[key], sharded_offsets, (metadata or {}).get("singleton_local_shards", False)
        )
    return out


_CLASSES: dict[type, type] = {}


def _lora_class(base: type) -> type:
    if base not in _CLASSES:
        _CLASSES[base] = type(
            f"LoRA{base.__name__}",
            (base,),
            {"forward": _lora_forward, "sharded_state_dict": _lora_sharded_state_dict, "__module__": __name__},
        )
    return _CLASSES[base]


def is_adapter(name: str) -> bool:
    """Whether a parameter name is an adapter's (``...lora_A`` / ``...lora_B``)."""
    return name.endswith((".lora_A", ".lora_B")) or name in ("lora_A", "lora_B")


def _targets(gpt, cfg: LoraConfig):
    """``(name, module, megatron_name)`` of every targeted linear of this rank's ``GPTModel``."""
    out = []
    for name, module in gpt.named_modules():
        parts = name.split(".")
        if len(parts) != 5 or parts[:2] != ["decoder", "layers"]:
            continue
        owner, linear = parts[3], parts[4]
        if linear in cfg.megatron_targets and owner == ("mlp" if linear in MLP else "self_attention"):
            out.append((name, module, linear))
    return out


def attach(gpt, cfg: LoraConfig) -> None:
    """Add the adapters to this rank's bare ``GPTModel`` (before the DDP wrap), initialise them, freeze every
    other parameter. ``lora.rank`` above a targeted linear's smaller size is refused, naming the key."""
    if not cfg.enabled:
        return
    targets = _targets(gpt, cfg)
    if not targets:
        raise ValueError(f"lora.target_modules={list(cfg.target_modules)} matches no linear of this model stage")
    for p in gpt.parameters():
        p.requires_grad_(False)
    for name, module, linear in targets:
        swiglu = linear == "linear_fc1" and bool(module.config.gated_linear_unit)
        adapt_linear(module, cfg, column=linear in COLUMN, swiglu=swiglu, name=name)
    init_adapters(gpt, seed=cfg.init_seed)


def adapt_linear(module, cfg: LoraConfig, *, column: bool, swiglu: bool = False, name: str = "linear") -> None:
    """Turn one Megatron-Core ``ColumnParallelLinear`` (``column``) or ``RowParallelLinear`` into its LoRA
    version, in place: zero ``lora_A``/``lora_B`` of this rank's shapes (fill them with :func:`init_adapters`).
    ``swiglu``: a SwiGLU ``linear_fc1`` (its rows per TP rank are ``[gate_r; up_r]``)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    expected = ColumnParallelLinear if column else RowParallelLinear
    if not isinstance(module, expected) or type(module).__module__.startswith("transformer_engine"):
        raise ValueError(f"LoRA: {name} is a {type(module).__name__}, not Megatron-Core's {expected.__name__}")
    if column and module.gather_output or (not column and not module.input_is_parallel):
        raise ValueError(f"LoRA: {name} gathers its output or scatters its input; not supported")
    size = min(module.input_size, module.output_size)
    if cfg.rank > size:
        raise ValueError(
            f"lora.rank={cfg.rank} exceeds the size of {name} ({module.output_size} x {module.input_size}): "
            f"the rank must be at most {size}"
        )
    weight = module.weight
    local_out, local_in = weight.shape
    module.lora_A = torch.nn.Parameter(torch.zeros((cfg.rank, local_in), dtype=weight.dtype, device=weight.device))
    module.lora_B = torch.nn.Parameter(torch.zeros((local_out, cfg.rank), dtype=weight.dtype, device=weight.device))
    for p, split in ((module.lora_A, not column), (module.lora_B, column)):
        # Megatron's TP attributes: what its grad-norm (no double counting of replicated parameters) reads
        p.tensor_model_parallel = split
        p.partition_dim = (0 if column else 1) if split else -1
        p.partition_stride = 1
    module.lora_column = column
    module.lora_swiglu = swiglu
    module.lora_scale = cfg.scale
    module.lora_dropout = float(cfg.dropout)
    module.__class__ = _lora_class(type(module))
    weight.lora_owner = module  # merged_weight(weight) finds the adapters of a base weight


@torch.no_grad()
def init_adapters(gpt, *, seed: int, b_std: float = 0.0) -> None:
    """Fill every adapter from ``seed``, identically for any layout: ``A ~ U(-1/sqrt(in), 1/sqrt(in))`` per global
    tensor (a generator keyed by its checkpoint name), ``B = 0`` (``b_std > 0``: ``N(0, b_std)``, for tests)."""
    for sh in _adapter_shards(gpt):
        gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(sh.key.encode())) % (2**63))
        shape = tuple(sh.global_shape)
        if sh.key.endswith("lora_A"):
            bound = 1.0 / math.sqrt(shape[-1])
            full = (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * bound
        else:
            full = torch.randn(shape, generator=gen, dtype=torch.float64) * b_std
        sh.data.copy_(full[_global_index(sh)].reshape(sh.data.shape).to(sh.data.dtype))


def _global_index(sh) -> tuple[slice, ...]:
    """Where a ``ShardedTensor``'s local data sits in its global tensor (prepended axes, such as the layer
    number, count as size 1)."""
    shape = tuple(sh.global_shape)
    local_shape = tuple(sh.local_shape)
    if len(local_shape) == len(shape) - sh.prepend_axis_num:
        local_shape = (1,) * sh.prepend_axis_num + local_shape
    return tuple(slice(o, o + n) for o, n in zip(sh.global_offset, local_shape))


def _adapter_shards(model) -> list:
    """This rank's adapter ``ShardedTensor`` s (factories built) across the model chunks."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from gspo_mcore.learner.model import _flatten, unwrap

    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [
        sh
        for chunk in chunks
        for sh in _flatten(unwrap(chunk).sharded_state_dict(), ShardedTensorFactory)
        if isinstance(sh, ShardedTensor) and is_adapter(sh.key)
    ]


@torch.no_grad()
def global_adapters(model) -> dict[str, torch.Tensor]:
    """Every adapter as its full global float32 tensor, on every rank (a collective over the whole world; adapters
    are small): ``{checkpoint key: tensor}``, e.g. ``decoder.layers.self_attention.linear_qkv.lora_B`` of shape
    ``[layers, out, rank]`` (the layer number is the leading axis, as in the checkpoint). Each rank places the
    main replicas of its shards (the same ``ShardedTensor`` metadata the checkpoint writes, so any TP/PP/DP
    layout and SwiGLU's ``[gate; up]`` order of ``linear_fc1`` come out as in the checkpoint) into zeros, and the
    sum over the ranks assembles them."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    shards = _adapter_shards(model)
    mine = sorted({(sh.key, tuple(sh.global_shape)) for sh in shards})
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    keys = sorted(set().union(*map(set, everyone)))
    if len({k for k, _ in keys}) != len(keys):
        raise RuntimeError(f"the ranks disagree on the adapters' global shapes: {keys}")
    device = shards[0].data.device if shards else _any_device(model)
    out = {}
    for key, shape in keys:
        full = torch.zeros(shape, dtype=torch.float32, device=device)
        for sh in shards:
            if sh.key == key and is_main_replica(sh.replica_id):
                full[_global_index(sh)] = sh.data.reshape(full[_global_index(sh)].shape).float()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(full)
        out[key] = full.cpu()
    return out


def _any_device(model) -> torch.device:
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return next(p.device for c in chunks for p in c.parameters())


def merged_weight(weight: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``W + (alpha / rank) B A`` for a LoRA-adapted base weight (computed in fp32, returned
    in the weight's dtype); any other tensor unchanged."""
    module = getattr(weight, "lora_owner", None)
    if module is None:
        return weight
    with torch.no_grad():
        delta = module.lora_scale * (module.lora_B.float() @ module.lora_A.float())
        return (weight.float() + delta).to(weight.dtype)


def has_adapters(model) -> bool:
    """Whether this rank's model chunks carry LoRA adapters (the same answer on every rank)."""
    return bool(adapter_parameters(model))


def adapter_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """This rank's adapter parameters ``(name, parameter)`` across the model chunks."""
    from gspo_mcore.learner.model import unwrap

    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [(n, p) for c in chunks for n, p in unwrap(c).named_parameters() if is_adapter(n)]


__all__ = [
    "ALL_LINEAR",
    "HF_TARGETS",
    "MEGATRON_GROUPS",
    "LoraConfig",
    "adapt_linear",
    "adapter_parameters",
    "attach",
    "check_layout",
    "global_adapters",
    "has_adapters",
    "init_adapters",
    "is_adapter",
    "merged_weight",
]
