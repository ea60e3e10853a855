"""Early stop when nothing is left to learn (``early_stop``, off by default).

Two independent rules; the run stops at the first that fires (after logging the step or evaluation that fired it,
then the usual final evaluation):

- ``eval_patience: k``: held-out pass@1 (of ``eval_set``, default the first evaluation set) has not risen above
  its best for ``k`` evaluations in a row (it reached its maximum and held there, or fell back);
- ``no_signal_steps: k``: no sample of the last ``k`` steps had a non-zero advantage (every group's shaped
  rewards were equal: GSPO had nothing to push on).

The tracker's state is JSON and saved with every checkpoint, so a resumed run stops where an uninterrupted one
would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class EarlyStopConfig:
    """``early_stop``: stop a run that has nothing left to learn (both rules 0: off)."""

    eval_patience: int = 0
    """Stop when held-out pass@1 has not exceeded its best for this many evaluations in a row (needs
    ``eval.every > 0``; inactive without ``eval.datasets``). 0: off."""
    eval_set: str = ""
    """The evaluation set whose ``pass@1`` is watched; empty: the first of ``eval.datasets``."""
    no_signal_steps: int = 0
    """Stop when no sample of the last this many steps had a non-zero advantage. 0: off."""

    def __post_init__(self):
        for name in ("eval_patience", "no_signal_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"early_stop.{name} must be an integer >= 0, got {v!r}")
        if not isinstance(self.eval_set, str):
            raise ValueError(f"early_stop.eval_set must be a string, got {self.eval_set!r}")


def check_early_stop(cfg) -> None:
    """Cross-section rules (``cfg``: the :class:`~gspo_mcore.trainer.config.TrainConfig`)."""
    es, names = cfg.early_stop, [d.name for d in cfg.eval.datasets]
    if es.eval_set and es.eval_set not in names:
        raise ValueError(f"early_stop.eval_set={es.eval_set!r} is not one of eval.datasets ({names})")
    if es.eval_patience and names and cfg.eval.every == 0:
        raise ValueError(
            f"early_stop.eval_patience={es.eval_patience} needs eval.every > 0 (with eval.every=0 the run evaluates "
            "only before its first step and after its last)"
        )


class EarlyStop:
    """Feed it every evaluation record and every step record; it says when to stop (and why)."""

    def __init__(self, config: EarlyStopConfig, eval_sets: list[str]):
        self.config = config
        name = config.eval_set or (eval_sets[0] if eval_sets else "")
        self.metric = f"eval/{name}/pass@1" if name and config.eval_patience else ""
        self.best: float | None = None
        self.since_best = 0  # evaluations since the best was set
        self.no_signal = 0  # consecutive steps without a non-zero advantage
        self.reason = ""

    def after_eval(self, record: dict[str, float]) -> bool:
        if not self.metric or self.metric not in record:
            return False
        value = float(record[self.metric])
        if self.best is None or value > self.best:
            self.best, self.since_best = value, 0
            return False
        self.since_best += 1
        if self.since_best >= self.config.eval_patience:
            self.reason = (
                f"{self.metric} has not risen above its best {self.best:.4f} for {self.since_best} evaluations "
                f"(early_stop.eval_patience={self.config.eval_patience})"
            )
            return True
        return False

    def after_step(self, record: dict[str, float]) -> bool:
        if not self.config.no_signal_steps:
            return False
        signal = record.get("nonzero_advantage_fraction", 1.0) > 0
        self.no_signal = 0 if signal else self.no_signal + 1
        if self.no_signal >= self.config.no_signal_steps:
            self.reason = (
                f"no sample had a non-zero advantage in the last {self.no_signal} steps "
                f"(early_stop.no_signal_steps={self.config.no_signal_steps})"
            )
            return True
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "since_best": self.since_best, "no_signal": self.no_signal}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.since_best, self.no_signal = state["best"], int(state["since_best"]), int(state["no_signal"])
