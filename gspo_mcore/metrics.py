"""Where a run's numbers go: ``metrics.jsonl`` (one JSON object per step), TensorBoard, wandb (optional),
and a progress bar with the live reward and clip fraction. Only the writing rank (rank 0) creates any.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)


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
    """Show a tqdm progress bar of the steps on rank 0."""
    overwrite: bool = False
    """A fresh run in an ``output_dir`` that holds another run's files (config, metrics, checkpoints, ...) is
    refused; ``true`` deletes those files first (see :mod:`gspo_mcore.trainer.run_dir`)."""

    def __post_init__(self):
        if not self.output_dir:
            raise ValueError("LogConfig.output_dir must be set")
        if not isinstance(self.overwrite, bool):
            raise ValueError(f"LogConfig.overwrite must be true or false, got {self.overwrite!r}")


class MetricsLogger:
    """Writes one record per step. ``enabled=False`` (ranks other than 0) makes every call a no-op."""

    def __init__(
        self,
        cfg: LogConfig,
        *,
        total_steps: int,
        start_step: int = 0,
        enabled: bool = True,
        run_config: dict | None = None,
    ):
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
                logger.warning("tensorboard is not installed: metrics go to metrics.jsonl only")
        if cfg.wandb_project:
            try:
                import wandb

                self._wandb = wandb.init(project=cfg.wandb_project, config=run_config or {}, dir=cfg.output_dir)
            except ImportError:
                logger.warning("wandb_project is set but wandb is not installed: skipping wandb")
        if cfg.progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="GSPO", unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, float], *, advance: bool = True) -> None:
        """Write one record; ``advance=False`` (evaluations) leaves the progress bar where it is."""
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
        if self._bar is not None and advance:
            self._bar.set_postfix(
                reward=f"{record.get('reward_mean', float('nan')):.3f}",
                clip=f"{record.get('clip_fraction', float('nan')):.2e}",
            )
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


def step_metrics(
    groups, scores, shaped, keep, updates, reward_metrics, group_size, *, timings, left_out=0, update_skipped=False
) -> dict:
    """One training step's record: rollout, reward, learner (mean over the mini-batches) and timing figures.

    ``scores``: the task rewards, ``shaped``: what the advantages were taken from (after overlong shaping),
    both ``(num_groups * G,)``; ``keep``: ``(num_groups,)`` groups trained on; ``updates``: the learner's
    per-mini-batch metrics; ``timings``: seconds per phase.
    """
    from gspo_mcore.algo import zero_advantage_groups

    samples = [s for g in groups for s in g]
    lengths = [len(s.response_ids) for s in samples]
    n = max(len(samples), 1)
    record = {
        "reward_mean": float(scores.mean()),
        "reward_std": float(scores.std()) if scores.numel() > 1 else 0.0,
        "response_length_mean": sum(lengths) / n,
        "zero_advantage_group_fraction": float(zero_advantage_groups(shaped, group_size).float().mean()),
        "groups_used": int(keep.sum()),
        "finish_stop_fraction": sum(s.finish_reason == "stop" for s in samples) / n,
        "truncated_fraction": sum(s.finish_reason == "length" for s in samples) / n,
        "samples_left_out": left_out,
        "update_skipped": float(update_skipped),
        **{k: float(v) for k, v in reward_metrics.items()},
    }
    if not _same(scores, shaped):
        record["reward_shaped_mean"] = float(shaped.mean())
    if updates:
        for key in updates[0]:
            record[key] = sum(u[key] for u in updates) / len(updates)  # mean over the mini-batches
        record["ratio_min"] = min(u["ratio_min"] for u in updates)
        record["ratio_max"] = max(u["ratio_max"] for u in updates)
        if "is_weight_min" in updates[0]:
            record["is_weight_min"] = min(u["is_weight_min"] for u in updates)
            record["is_weight_max"] = max(u["is_weight_max"] for u in updates)
        if "rollout_logprob_abs_diff" in updates[0]:
            record["logprob_mismatch"] = updates[0]["rollout_logprob_abs_diff"]
    record.update({f"time_{k}_s": v for k, v in timings.items()})
    record["time_step_s"] = sum(timings.values())
    record["rollout_tokens_per_s"] = sum(lengths) / max(timings.get("rollout", 0.0), 1e-9)
    record["train_tokens_per_s"] = sum(u.get("num_tokens", 0.0) for u in updates) / max(timings.get("train", 0.0), 1e-9)
    return record


def _same(a, b) -> bool:
    return a.shape == b.shape and bool((a == b).all())
