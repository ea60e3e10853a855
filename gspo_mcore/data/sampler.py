"""Epochs over a dataset in a seeded, reproducible order, with a resumable position."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class DifficultyConfig:
    """Difficulty-aware sampling (``sampler.difficulty``, :mod:`gspo_mcore.data.difficulty`): each prompt's recent
    pass rate puts it in a pool (too easy, learnable, too hard); every prompt drawn comes from a pool chosen with
    these weights. Prompts a policy always or never solves give GSPO no signal (every reward of their group equal),
    so they are retired from the epoch stream and only re-tested now and then."""

    window: int = 2
    """A prompt's pass rate is the mean over its last ``window`` groups (each: the share of samples passing)."""
    pass_threshold: float = 1.0
    """A sample passes when its task reward is at least this."""
    easy_at: float = 1.0
    """A pass rate at or above this retires the prompt as too easy."""
    hard_at: float = 0.0
    """A pass rate at or below this retires the prompt as too hard."""
    weight_learnable: float = 1.0
    """Weight of the epoch stream: prompts not seen yet and those whose pass rate is between the bounds (retired
    prompts met in the stream are skipped). New prompts enter only through it, so it must be > 0."""
    weight_easy: float = 0.05
    """Weight of re-testing a random too-easy prompt (falls back to the stream while the pool is empty)."""
    weight_hard: float = 0.05
    """Weight of re-testing a random too-hard prompt (falls back to the stream while the pool is empty)."""

    def __post_init__(self):
        key = "sampler.difficulty"
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"{key}.window must be an integer >= 1, got {self.window!r}")
        for name in ("pass_threshold", "easy_at", "hard_at", "weight_learnable", "weight_easy", "weight_hard"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{key}.{name} must be a finite number, got {v!r}")
        for name in ("weight_learnable", "weight_easy", "weight_hard"):
            if getattr(self, name) < 0:
                raise ValueError(f"{key}.{name} must be >= 0, got {getattr(self, name)}")
        if self.weight_learnable + self.weight_easy + self.weight_hard == 0:
            raise ValueError(
                f"{key}: every pool weight is 0 (weight_learnable, weight_easy, weight_hard): no prompt to draw"
            )
        if self.weight_learnable == 0:
            raise ValueError(
                f"{key}.weight_learnable must be > 0: new prompts enter only through the stream, so with 0 the "
                "easy and hard pools stay empty and no prompt can be drawn"
            )
        if not 0 <= self.hard_at < self.easy_at <= 1:
            raise ValueError(
                f"{key}: need 0 <= hard_at < easy_at <= 1 (pass rates), got hard_at={self.hard_at}, "
                f"easy_at={self.easy_at}"
            )


@dataclass(frozen=True, kw_only=True)
class SamplerConfig:
    seed: int = 0
    """Seed of the per-epoch shuffles (epoch ``e`` is shuffled by ``Random(f"{seed}:{e}")``)."""
    shuffle: bool = True
    """False: file order every epoch."""
    epochs: int | None = 1
    """Passes over the data; None: endless."""
    difficulty: DifficultyConfig | None = None
    """Difficulty-aware sampling (:class:`DifficultyConfig`); ``None``: every prompt in epoch order."""

    def __post_init__(self):
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"SamplerConfig.seed must be an int, got {self.seed!r}")
        bad_epochs = isinstance(self.epochs, bool) or not isinstance(self.epochs, int) or self.epochs < 1
        if self.epochs is not None and bad_epochs:
            raise ValueError(f"SamplerConfig.epochs must be an int >= 1 or None, got {self.epochs!r}")


class PromptSampler:
    """Yields dataset indices epoch after epoch; ``state_dict()`` / ``load_state_dict()`` resume exactly.

    The order of an epoch depends only on (seed, epoch, dataset size), never on where a run stopped,
    so a resumed run continues with the very indices an uninterrupted run would have produced.
    """

    def __init__(self, num_samples: int, config: SamplerConfig = SamplerConfig()):
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
        self.num_samples = num_samples
        self.config = config
        self.epoch = 0
        self.position = 0  # next index within the epoch's order
        self._order: list[int] | None = None

    def epoch_order(self, epoch: int) -> list[int]:
        order = list(range(self.num_samples))
        if self.config.shuffle:
            random.Random(f"{self.config.seed}:{epoch}").shuffle(order)
        return order

    @property
    def exhausted(self) -> bool:
        return self.config.epochs is not None and self.epoch >= self.config.epochs

    def __iter__(self):
        return self

    def __next__(self) -> int:
        if self.position >= self.num_samples:
            self.epoch, self.position, self._order = self.epoch + 1, 0, None
        if self.exhausted:
            raise StopIteration
        if self._order is None:
            self._order = self.epoch_order(self.epoch)
        index = self._order[self.position]
        self.position += 1
        return index

    def take(self, n: int) -> list[int]:
        """The next ``n`` indices, crossing epoch boundaries; fewer only when the last epoch ends."""
        out = []
        for index in self:
            out.append(index)
            if len(out) == n:
                break
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.config.seed,
            "shuffle": self.config.shuffle,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "shuffle", "num_samples"):
            if state.get(key) != getattr(self.config if key != "num_samples" else self, key):
                raise ValueError(
                    f"cannot resume: checkpointed sampler has {key}={state.get(key)!r}, this one "
                    f"{getattr(self.config if key != 'num_samples' else self, key)!r} (different data or seed)"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.num_samples:
            raise ValueError(f"invalid sampler state: epoch={epoch}, position={position}")
        self.epoch, self.position, self._order = epoch, position, None
