"""Parallel layout: tensor (TP), pipeline (PP), expert (EP, expert-TP), context (CP) and data (DP) sizes.

DP is derived: ``world_size / (TP * PP * CP)``. :func:`validate_layout` refuses an impossible layout with a
clear ``ValueError`` before any process group or model is built; :func:`init_parallel` creates the
process groups (NCCL on GPU, gloo on CPU) and seeds the RNGs; :func:`destroy_parallel` tears them down.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gspo_mcore.learner.model_config import ModelArch
from gspo_mcore.platform.launch import free_port


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Model-parallel sizes; the data-parallel size is whatever the world size leaves."""

    tensor: int = 1
    """Tensor parallel (TP): attention heads, MLP width and vocabulary split across ranks."""
    pipeline: int = 1
    """Pipeline parallel (PP): layers split into stages."""
    expert: int = 1
    """Expert parallel (EP): MoE experts split across ranks (within the data-parallel ranks)."""
    expert_tensor: int | None = None
    """Expert tensor parallel: each expert's MLP split across ranks (default: 1 with EP > 1, else TP)."""
    context: int = 1
    """Context parallel (CP): every sequence split across ranks in Megatron's load-balanced layout (GPU:
    Transformer Engine's CP attention; CPU: a correctness-only attention; see docs/context-parallel.md)."""
    sequence_parallel: bool | None = None
    """Sequence parallelism with TP (default: on when TP > 1 and the model is MoE; needs a GPU/TE)."""

    def __post_init__(self):
        for name in ("tensor", "pipeline", "expert", "context"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelConfig.{name} must be an int >= 1, got {value!r}")
        et = self.expert_tensor
        if et is not None and (isinstance(et, bool) or not isinstance(et, int) or et < 1):
            raise ValueError(f"ParallelConfig.expert_tensor must be an int >= 1 or None, got {et!r}")

    @property
    def expert_tensor_size(self) -> int:
        if self.expert_tensor is not None:
            return self.expert_tensor
        return 1 if self.expert > 1 else self.tensor

    def model_parallel_size(self) -> int:
        return self.tensor * self.pipeline * self.context

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // self.model_parallel_size()

    def use_sequence_parallel(self, arch: ModelArch) -> bool:
        if self.sequence_parallel is not None:
            return self.sequence_parallel and self.tensor > 1
        return self.tensor > 1 and arch.is_moe


@dataclass(frozen=True)
class Layout:
    """This rank's place in the parallel layout, with the process groups: the one description of a layout
    that the learner, the converters and the checkpoints are given (``None`` groups on 1-sized axes of a
    single process)."""

    world_size: int
    rank: int
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    dp_size: int
    dp_rank: int
    ep_size: int
    cp_size: int
    tp_group: object
    pp_group: object
    dp_group: object
    device: torch.device
    ep_rank: int = 0
    ep_group: object = None
    etp_size: int = 1
    """Expert tensor-parallel size (the TP split of expert weights)."""
    etp_rank: int = 0
    etp_group: object = None
    cp_rank: int = 0
    cp_group: object = None

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @classmethod
    def single(cls, device: torch.device | None = None) -> "Layout":
        """One process, nothing split."""
        return cls(
            world_size=1,
            rank=0,
            tp_size=1,
            tp_rank=0,
            pp_size=1,
            pp_rank=0,
            dp_size=1,
            dp_rank=0,
            ep_size=1,
            cp_size=1,
            tp_group=None,
            pp_group=None,
            dp_group=None,
            device=device or torch.device("cpu"),
        )


def validate_layout(cfg: ParallelConfig, world_size: int, arch: ModelArch, *, on_gpu: bool) -> int:
    """Raise ``ValueError`` naming the problem if ``cfg`` cannot run ``arch`` on ``world_size`` ranks.

    Returns the data-parallel size.
    """
    tp, pp, ep, cp, etp = cfg.tensor, cfg.pipeline, cfg.expert, cfg.context, cfg.expert_tensor_size
    errors = []
    if world_size % (tp * pp * cp):
        errors.append(f"world size {world_size} is not divisible by TP*PP*CP = {tp}*{pp}*{cp} = {tp * pp * cp}")
    if arch.num_attention_heads % tp:
        errors.append(f"TP={tp} does not divide num_attention_heads={arch.num_attention_heads}")
    if arch.num_key_value_heads % tp:
        errors.append(f"TP={tp} does not divide num_key_value_heads={arch.num_key_value_heads}")
    if arch.vocab_size % tp:
        errors.append(f"TP={tp} does not divide vocab_size={arch.vocab_size} (the vocabulary is split over TP)")
    if arch.intermediate_size % tp:
        errors.append(f"TP={tp} does not divide intermediate_size={arch.intermediate_size}")
    if arch.num_hidden_layers % pp:
        errors.append(f"PP={pp} does not divide num_hidden_layers={arch.num_hidden_layers}")
    if ep > 1 or etp != tp:
        if not arch.is_moe:
            errors.append(f"EP={ep}, expert-TP={etp} need a MoE model, but model_type={arch.model_type!r} is dense")
    if arch.is_moe:
        if arch.num_experts % ep:
            errors.append(f"EP={ep} does not divide num_experts={arch.num_experts}")
        if arch.moe_intermediate_size % etp:
            errors.append(f"expert-TP={etp} does not divide moe_intermediate_size={arch.moe_intermediate_size}")
        if world_size % pp == 0 and (world_size // pp) % (ep * etp):
            errors.append(
                f"EP*expert-TP = {ep}*{etp} does not divide the ranks of one pipeline stage "
                f"(world size {world_size} / PP {pp} = {world_size // pp})"
            )
    if not on_gpu:
        if cfg.use_sequence_parallel(arch):
            errors.append(
                f"sequence parallelism (TP={tp} with a MoE model needs it) needs a GPU: the CPU "
                "(local, non-Transformer-Engine) norm refuses it; on CPU split MoE models with EP, "
                "not TP"
            )
    if errors:
        raise ValueError("impossible parallel layout: " + "; ".join(errors))
    return world_size // (tp * pp * cp)


def init_parallel(cfg: ParallelConfig, arch: ModelArch, *, seed: int = 1234, timeout_minutes: int = 10) -> Layout:
    """Initialise torch.distributed (from the torchrun environment when needed) and Megatron's groups.

    NCCL on a host with a GPU, gloo otherwise. The layout is validated before anything is created.
    """
    on_gpu = torch.cuda.is_available()
    if not dist.is_initialized():
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    else:
        world_size = dist.get_world_size()
    validate_layout(cfg, world_size, arch, on_gpu=on_gpu)
    if not on_gpu:
        from gspo_mcore.platform import cpu_denormals, cpu_malloc, megatron_cpu

        megatron_cpu.apply()
        cpu_malloc.keep_freed_memory()  # large tensors reused step to step instead of mapped afresh
        cpu_denormals.flush_denormals()  # no microcode assists on underflowing attention probabilities
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:  # a single process without torchrun
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
        if on_gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            backend="nccl" if on_gpu else "gloo", timeout=datetime.timedelta(minutes=timeout_minutes)
        )
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tensor,
        pipeline_model_parallel_size=cfg.pipeline,
        context_parallel_size=cfg.context,
        expert_model_parallel_size=cfg.expert,
        expert_tensor_parallel_size=cfg.expert_tensor_size,
        distributed_timeout_minutes=timeout_minutes,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return current_layout()


def current_layout() -> Layout:
    """Megatron's groups for this rank as a :class:`Layout` (:meth:`Layout.single` when neither
    torch.distributed nor Megatron's model parallelism is initialised)."""
    from megatron.core import parallel_state as ps

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if not (dist.is_initialized() and ps.model_parallel_is_initialized()):
        return Layout.single(device)
    return Layout(
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        cp_size=ps.get_context_parallel_world_size(),
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        device=device,
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_group=ps.get_expert_model_parallel_group(),
        etp_size=ps.get_expert_tensor_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        etp_group=ps.get_expert_tensor_parallel_group(),
        cp_rank=ps.get_context_parallel_rank(),
        cp_group=ps.get_context_parallel_group(),
    )


def destroy_parallel() -> None:
    """Tear down Megatron's groups and the default process group."""
    from megatron.core import parallel_state as ps

    if dist.is_initialized():
        dist.barrier()  # no rank tears down while a peer may still be in a collective with it
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
