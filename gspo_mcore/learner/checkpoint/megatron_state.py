"""Model and optimizer state through Megatron-Core ``dist_checkpointing`` (the ``megatron/`` part of a checkpoint).

Model tensors and the non-distributed optimizer's state are sharded as global tensors, so they load into any
TP/PP/EP/DP layout. The distributed optimizer's state is ``dp_reshardable`` (loads at any DP size, same
TP/PP/EP) or ``fully_reshardable`` (any layout). The optimizer's keys carry no per-sub-optimizer prefix, so
they do not depend on how Megatron splits the parameters into dense and expert sub-optimizers; a layout
change that changes the NUMBER of sub-optimizers is refused for the optimizer state.
"""

from __future__ import annotations

import typing

import torch

from gspo_mcore.learner.checkpoint.errors import CheckpointError

OptimizerFormat = typing.Literal["dp_reshardable", "fully_reshardable"]
OPTIMIZER_FORMATS = typing.get_args(OptimizerFormat)
"""How the distributed optimizer's state is sharded on disk (Megatron's ``distrib_optim_sharding_type``)."""


def model_keys(model) -> list[str]:
    """The checkpoint keys of the model chunks: ``model``, or ``model0``, ``model1``... (Megatron-LM's)."""
    return ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]  # Megatron-LM's keys


ModelPart = typing.Literal["all", "adapters"]
MODEL_PARTS = typing.get_args(ModelPart)
"""What a checkpoint holds of the model (``trainer_state.json``'s ``model``): every parameter (``all``; full
fine-tuning, and checkpoints written before LoRA's adapter-only ones) or only the LoRA adapters (``adapters``: the
frozen base is rebuilt at resume as at the start, from ``model.hf_dir`` or ``model.init_seed``)."""


def model_part(model) -> ModelPart:
    """What a checkpoint of ``model`` holds: ``adapters`` when it carries LoRA adapters, else ``all``."""
    from gspo_mcore.learner.lora import has_adapters

    return "adapters" if has_adapters(model) else "all"


def _model_sharded_state_dict(model, part: ModelPart = "all") -> dict:
    from gspo_mcore.learner.lora import is_adapter
    from gspo_mcore.learner.model import unwrap

    out = {}
    for key, chunk in zip(model_keys(model), model):
        sharded = unwrap(chunk).sharded_state_dict()
        out[key] = {k: v for k, v in sharded.items() if is_adapter(k)} if part == "adapters" else sharded
    return out


def sharded_state_dict(model, optimizer, opt_format: str | None, *, is_loading: bool, part: ModelPart = "all") -> dict:
    """The sharded state dict of ``model`` (a list of chunks) and ``optimizer`` (unless ``None``).

    ``opt_format`` is one of :data:`OPTIMIZER_FORMATS` for a distributed optimizer, else ``None``. ``part``:
    ``adapters`` keeps only the model's LoRA adapters (the optimizer holds nothing else)."""
    sharded = _model_sharded_state_dict(model, part)
    if optimizer is not None:
        model_sd = {}
        for part in sharded.values():
            model_sd.update(part)
        # model-space optimizer keys without a per-sub-optimizer prefix: they then do not depend on how the
        # parameters are split into sub-optimizers (dense / expert), which changes with EP
        metadata = {"chained_optim_avoid_prefix": True}
        if opt_format:
            metadata["distrib_optim_sharding_type"] = opt_format
        if opt_format == "fully_reshardable":
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = True  # gather over gloo, to DP rank 0
        sharded["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    return sharded


def uses_distributed_optimizer(optimizer) -> bool:
    """Whether any of ``optimizer``'s sub-optimizers is Megatron's ``DistributedOptimizer``."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(o, DistributedOptimizer) for o in sub_optimizers(optimizer))


def sub_optimizers(optimizer) -> list:
    """The parts of a ``ChainedOptimizer``, or ``[optimizer]``."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def load_model_and_optimizer(
    megatron_dir: str,
    model,
    optimizer,
    *,
    saved_optimizer: dict,
    saved_layout: dict,
    layout: dict,
    part: ModelPart = "all",
) -> None:
    """Load the dist_checkpointing part into ``model`` (and ``optimizer`` unless ``None``).

    The optimizer kind must match the checkpoint's; a ``dp_reshardable`` distributed-optimizer state
    only loads into the same TP/PP/EP sizes. ``part``: what the checkpoint holds of the model (its
    ``trainer_state.json``'s ``model``); ``adapters`` loads the LoRA adapters and leaves every other parameter
    as it is (the base the caller built).
    """
    from megatron.core import dist_checkpointing

    from gspo_mcore.learner.lora import has_adapters, is_adapter
    from gspo_mcore.learner.model import unwrap

    if part not in MODEL_PARTS:
        raise CheckpointError(f"{megatron_dir}: unknown model part {part!r} (this code reads {MODEL_PARTS})")
    if part == "adapters" and not has_adapters(model):
        raise CheckpointError(
            f"{megatron_dir}: the checkpoint holds LoRA adapters only and this model has none; resume with the "
            "lora section the run was trained with"
        )
    distributed = uses_distributed_optimizer(optimizer) if optimizer is not None else saved_optimizer["distributed"]
    opt_format = saved_optimizer.get("format")
    if optimizer is not None:
        if distributed != saved_optimizer["distributed"]:
            raise CheckpointError(
                f"{megatron_dir}: saved with use_distributed_optimizer="
                f"{saved_optimizer['distributed']}, this run has {distributed}; resume with the "
                "same optim.use_distributed_optimizer"
            )
        parts = len(sub_optimizers(optimizer))
        if saved_optimizer.get("parts", parts) != parts:
            raise CheckpointError(
                f"{megatron_dir}: the optimizer state was saved as {saved_optimizer['parts']} sub-optimizers (Megatron "
                f"puts dense and expert parameters in separate ones for some expert layouts) at "
                f"{fmt_layout(saved_layout, ('tp', 'ep', 'etp'))}, this run has {parts} at "
                f"{fmt_layout(layout, ('tp', 'ep', 'etp'))}: that change of layout is not supported for the "
                "optimizer state (the model alone loads: load_model_and_optimizer(..., optimizer=None))"
            )
        fixed = ("tp", "pp", "ep", "etp")
        if opt_format == "dp_reshardable" and any(saved_layout[k] != layout[k] for k in fixed):
            raise CheckpointError(
                f"{megatron_dir}: the distributed-optimizer state was saved dp_reshardable at "
                f"{fmt_layout(saved_layout, fixed)}; it loads only at the same TP/PP/EP (any DP), this run is "
                f"{fmt_layout(layout, fixed)}. Save with checkpoint.optimizer_format=fully_reshardable to change them"
            )
    with torch.no_grad():
        if optimizer is not None and distributed:
            for sub in sub_optimizers(optimizer):  # torch Adam has no state before its first step
                sub._init_optimizer_states_with_dummy_values()
        sharded = sharded_state_dict(model, optimizer, opt_format if distributed else None, is_loading=True, part=part)
        # every requested key must be in the checkpoint; with the optimizer, also every saved key must be used
        loaded = dist_checkpointing.load(
            sharded, megatron_dir, strict="raise_all" if optimizer is not None else "raise_unexpected"
        )
        for key, chunk in zip(model_keys(model), model):
            if part == "all":
                chunk.load_state_dict(loaded[key], strict=True)
                continue
            missing, unexpected = unwrap(chunk).load_state_dict(loaded[key], strict=False)  # DDP's returns None
            missing = [k for k in missing if is_adapter(k)]
            if missing or unexpected:
                raise CheckpointError(f"{megatron_dir}: adapters missing {missing[:4]}, unexpected {unexpected[:4]}")
        if optimizer is not None:
            optimizer.load_state_dict(loaded["optimizer"])
            _check_adam_steps(optimizer, megatron_dir)


def _check_adam_steps(optimizer, where: str) -> None:
    """torch's Adam keeps a step counter per parameter: after a load each must be its own tensor holding
    the restored step. megatron-core 0.16.1's distributed optimizer breaks both (fixed on CPU hosts by
    :mod:`gspo_mcore.platform.megatron_cpu`); a silently restarted bias correction must not go unnoticed."""
    for sub in sub_optimizers(optimizer):
        inner = getattr(sub, "optimizer", None)
        seen = set()
        for group in getattr(inner, "param_groups", []):
            for param in group["params"]:
                step = inner.state.get(param, {}).get("step")
                if not torch.is_tensor(step):
                    continue
                if id(step) in seen or ("step" in group and float(step) != float(group["step"])):
                    raise CheckpointError(
                        f"{where}: after loading, torch Adam's per-parameter step counters are "
                        "shared or stale (megatron-core's distributed optimizer with torch's Adam, "
                        "i.e. without Apex/Transformer Engine): resuming would train wrongly"
                    )
                seen.add(id(step))


# ---- the parallel layout a checkpoint was saved at ----------------------------------------------------


def layout_dict(layout) -> dict:
    """``layout`` (a :class:`~gspo_mcore.learner.parallel.Layout`) as recorded in ``trainer_state.json``."""
    return {
        "world_size": layout.world_size,
        "tp": layout.tp_size,
        "pp": layout.pp_size,
        "dp": layout.dp_size,
        "ep": layout.ep_size,
        "etp": layout.etp_size,
        "cp": layout.cp_size,
    }


def fmt_layout(layout: dict, keys) -> str:
    return " ".join(f"{k.upper()}={layout[k]}" for k in keys)
