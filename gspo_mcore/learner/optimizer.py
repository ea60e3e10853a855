"""Megatron-Core's optimizer (Adam, optional distributed optimizer, gradient clipping) and LR schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from gspo_mcore.config import check_literals

DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """Adam with decoupled weight decay, global-norm clipping, linear warm-up then decay."""

    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    weight_decay: float = 0.01
    """Decoupled (AdamW) weight decay."""
    adam_beta1: float = 0.9
    """Adam's first-moment decay, in [0, 1)."""
    adam_beta2: float = 0.999
    """Adam's second-moment decay, in [0, 1)."""
    adam_eps: float = 1e-8
    """Adam's denominator term."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to ``lr``."""
    lr_decay_steps: int | None = None
    """Step at which the decay reaches ``min_lr`` (``None``: constant after warm-up)."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate shape after the warm-up; ``linear`` and ``cosine`` decay to ``min_lr`` at ``lr_decay_steps``."""
    use_distributed_optimizer: bool = False
    """Shard the optimizer state over data-parallel ranks (build the model with the same flag)."""

    def __post_init__(self):
        for name in ("lr", "min_lr", "weight_decay", "adam_eps", "clip_grad"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"OptimConfig.{name} must be a finite number >= 0, got {value!r}")
        if self.min_lr > self.lr:
            raise ValueError(f"OptimConfig.min_lr={self.min_lr} must be <= lr={self.lr}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"OptimConfig.{name} must be in [0, 1), got {getattr(self, name)!r}")
        check_literals(self)
        if self.lr_warmup_steps < 0:
            raise ValueError(f"OptimConfig.lr_warmup_steps must be >= 0, got {self.lr_warmup_steps}")
        if self.lr_decay_style != "constant":
            if self.lr_decay_steps is None or self.lr_decay_steps <= self.lr_warmup_steps:
                raise ValueError(
                    f"lr_decay_style={self.lr_decay_style!r} needs lr_decay_steps > lr_warmup_steps "
                    f"({self.lr_warmup_steps}), got {self.lr_decay_steps}"
                )


def build_optimizer(model, cfg: OptimConfig):
    """``(optimizer, scheduler)``: Megatron's optimizer over the model chunks and its LR scheduler.

    Also installs the optimizer's loss-scale hook on the model config (used by the pipeline schedules).
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    ddp_flag = model[0].ddp_config.use_distributed_optimizer
    if ddp_flag != cfg.use_distributed_optimizer:
        raise ValueError(
            f"OptimConfig.use_distributed_optimizer={cfg.use_distributed_optimizer} but the model was "
            f"built with use_distributed_optimizer={ddp_flag}; build both with the same flag"
        )
    model_config = model[0].config
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad,
        bf16=model_config.bf16,
        fp16=False,
        params_dtype=model_config.params_dtype,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, model)
    decay_steps = cfg.lr_decay_steps if cfg.lr_decay_steps is not None else cfg.lr_warmup_steps + 1
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if cfg.lr_warmup_steps > 0 else cfg.lr,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.lr_warmup_steps,
        lr_decay_steps=max(decay_steps, cfg.lr_warmup_steps + 1),
        lr_decay_style=cfg.lr_decay_style,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    model_config.grad_scale_func = optimizer.scale_loss if model_config.bf16 else None
    return optimizer, scheduler


def current_lr(optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"]) if optimizer.param_groups else 0.0


def zero_grads(model, optimizer) -> None:
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()


def optimizer_step(optimizer, scheduler) -> tuple[bool, float]:
    """One optimizer step and one LR-schedule step; returns ``(update_successful, grad_norm)``."""
    ok, grad_norm, _ = optimizer.step()
    if ok:
        scheduler.step(increment=1)
    return bool(ok), float(grad_norm) if grad_norm is not None else float("nan")


__all__ = ["DECAY_STYLES", "OptimConfig", "build_optimizer", "current_lr", "optimizer_step", "zero_grads"]
