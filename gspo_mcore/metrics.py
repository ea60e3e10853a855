"""Where a run's numbers go: ``metrics.jsonl`` (one JSON object per step), TensorBoard, wandb (optional),
and a progress bar with the live reward and clip fraction. Only the writing rank (rank 0) creates any.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class LogConfig:
    """Run outputs."""

    output_dir: str = "runs/gspo"
    """metrics.jsonl, config.yaml, TensorBoard events and checkpoints go here."""
    tensorboard: bool = True
    """Write TensorBoard events under ``<output_dir>/tensorboard``."""
    wandb_project: str | None = None
    """Log to this wandb project when wandb is installed (``None``: off)."""
    progress_bar: bool = True

    def __post_init__(self):
        if not self.output_dir:
            raise ValueError("LogConfig.output_dir must be set")


class MetricsLogger:
    """Writes one record per step. ``enabled=False`` (ranks other than 0) makes every call a no-op."""

    def __init__(self, cfg: LogConfig, *, total_steps: int, start_step: int = 0, enabled: bool = True,
                 run_config: dict | None = None):
        self.enabled = enabled
        self._tb = self._wandb = self._bar = None
        if not enabled:
            return
        os.makedirs(cfg.output_dir, exist_ok=True)
        self.path = os.path.join(cfg.output_dir, "metrics.jsonl")
        if start_step == 0 and os.path.exists(self.path):
            os.replace(self.path, self.path + ".previous")  # a fresh run never mixes with an old one
        self._file = open(self.path, "a", buffering=1)
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(os.path.join(cfg.output_dir, "tensorboard"))
            except ImportError:
                print("[gspo_mcore] tensorboard is not installed: metrics go to metrics.jsonl only")
        if cfg.wandb_project:
            try:
                import wandb

                self._wandb = wandb.init(project=cfg.wandb_project, config=run_config or {}, dir=cfg.output_dir)
            except ImportError:
                print("[gspo_mcore] wandb_project is set but wandb is not installed: skipping wandb")
        if cfg.progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="GSPO", unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, float) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(record, step=step)
        if self._bar is not None:
            self._bar.set_postfix(reward=f"{record.get('reward_mean', float('nan')):.3f}",
                                  clip=f"{record.get('clip_fraction', float('nan')):.2e}")
            self._bar.update(1)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()
        if self._wandb is not None:
            self._wandb.finish()


def _plain(v):
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)  # JSON has no NaN/inf: keep them visible as strings
    return v
