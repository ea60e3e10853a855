"""Difficulty-aware prompt sampling (``sampler.difficulty``): pools of too-easy, learnable and too-hard prompts.

A group whose rewards are all equal gives GSPO no signal, and prompts the policy always (or never) solves
make such groups. :class:`DifficultySampler` keeps each prompt's recent pass rates (the share of a group's
samples whose task reward reaches ``pass_threshold``, over its last ``window`` groups) and classifies it:

- too easy: mean pass rate ``>= easy_at``; too hard: ``<= hard_at`` (both *retired*);
- learnable: between the bounds; unseen: never rolled out.

Each prompt drawn comes from a pool picked with weights ``weight_learnable`` (the epoch stream of
:class:`~gspo_mcore.data.sampler.PromptSampler`, skipping retired prompts: unseen and learnable prompts),
``weight_easy`` and ``weight_hard`` (a random retired prompt of that pool, re-tested: a result between the
bounds brings it back into the stream). A retired pool that is empty falls back to the stream; a stream with
only retired prompts left in a whole pass falls back to the retired pools.

Everything is deterministic in ``(seed, draw count)`` and the observed rewards, and :meth:`state_dict` is
JSON (saved in the checkpoint's trainer state), so a resumed run draws what an uninterrupted one would.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from gspo_mcore.data.sampler import DifficultyConfig, PromptSampler, SamplerConfig

POOLS = ("learnable", "easy", "hard")


class DifficultySampler:
    """Same interface as :class:`PromptSampler` (``num_samples``, ``take``, ``state_dict``), plus
    :meth:`observe` (a group's rewards) and :meth:`metrics` (pool sizes and this step's draws)."""

    def __init__(self, num_samples: int, config: SamplerConfig):
        if config.difficulty is None:
            raise ValueError("DifficultySampler needs sampler.difficulty")
        self.stream = PromptSampler(num_samples, config)
        self.num_samples = num_samples
        self.config: SamplerConfig = config
        self.difficulty: DifficultyConfig = config.difficulty
        self.history: dict[int, list[float]] = {}  # prompt index -> its last `window` pass rates
        self.draws = 0  # take() calls so far (seeds each call's pool choices)
        self.drawn = dict.fromkeys(POOLS, 0)  # prompts drawn per pool since the last metrics()
        self.skipped = 0  # retired prompts the stream met (and skipped) since the last metrics()

    # -- classification --------------------------------------------------------------------------------
    def pass_rate(self, index: int) -> float | None:
        rates = self.history.get(index)
        return sum(rates) / len(rates) if rates else None

    def pool_of(self, index: int) -> str:
        """``unseen``, ``learnable``, ``easy`` or ``hard``."""
        rate = self.pass_rate(index)
        if rate is None:
            return "unseen"
        if rate >= self.difficulty.easy_at:
            return "easy"
        if rate <= self.difficulty.hard_at:
            return "hard"
        return "learnable"

    def pools(self) -> dict[str, list[int]]:
        out = {"unseen": [], "learnable": [], "easy": [], "hard": []}
        for i in sorted(self.history):
            out[self.pool_of(i)].append(i)
        return out

    # -- drawing -----------------------------------------------------------------------------------------
    @property
    def exhausted(self) -> bool:
        return self.stream.exhausted

    def take(self, n: int) -> list[int]:
        """The next ``n`` prompts (fewer only when the stream's last epoch ends)."""
        rng = random.Random(f"{self.config.seed}:difficulty:{self.draws}")
        self.draws += 1
        d = self.difficulty
        weights = [d.weight_learnable, d.weight_easy, d.weight_hard]
        pools = self.pools()
        out: list[int] = []
        while len(out) < n:
            pool = rng.choices(POOLS, weights=weights)[0]
            index = None
            if pool != "learnable" and pools[pool]:
                index = rng.choice(pools[pool])
            else:
                pool, index = "learnable", self._next_from_stream()
                if index is None and not self.stream.exhausted:  # only retired prompts left: re-test one
                    retired = pools["easy"] + pools["hard"]
                    index = rng.choice(retired)
                    pool = self.pool_of(index)
            if index is None:  # the last epoch ended
                break
            self.drawn[pool] += 1
            out.append(index)
        return out

    def _next_from_stream(self) -> int | None:
        """The stream's next prompt that is not retired; ``None`` after a whole pass of retired ones (or at
        the end of the last epoch)."""
        for _ in range(self.num_samples):
            got = self.stream.take(1)
            if not got:
                return None
            if self.pool_of(got[0]) in ("unseen", "learnable"):
                return got[0]
            self.skipped += 1
        return None

    # -- feedback ----------------------------------------------------------------------------------------
    def observe(self, index: int, rewards: Sequence[float]) -> None:
        """Record one group of prompt ``index``: its samples' task rewards."""
        if not 0 <= index < self.num_samples:
            raise ValueError(f"observe: prompt index {index} outside 0..{self.num_samples - 1}")
        if not rewards:
            raise ValueError(f"observe: prompt {index} has no rewards")
        rate = sum(float(r) >= self.difficulty.pass_threshold for r in rewards) / len(rewards)
        self.history[index] = (self.history.get(index, []) + [rate])[-self.difficulty.window :]

    def metrics(self) -> dict[str, float]:
        """Pool sizes now, and what was drawn from each pool (and skipped in the stream) since the last call."""
        pools = self.pools()
        out = {f"sampler/pool_{name}": len(pools[name]) for name in ("learnable", "easy", "hard")}
        out["sampler/pool_unseen"] = self.num_samples - len(self.history)
        out |= {f"sampler/drawn_{name}": self.drawn[name] for name in POOLS}
        out["sampler/skipped_retired"] = self.skipped
        self.drawn, self.skipped = dict.fromkeys(POOLS, 0), 0
        return out

    # -- resume ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON: the stream's position, the draw count and every prompt's recent pass rates (copies)."""
        return {
            **self.stream.state_dict(),
            "difficulty": {
                "draws": self.draws,
                "window": self.difficulty.window,
                "history": [[i, list(r)] for i, r in sorted(self.history.items())],
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("difficulty")
        if not isinstance(saved, dict):
            raise ValueError("cannot resume: the checkpointed sampler has no sampler.difficulty state")
        self.stream.load_state_dict(state)
        history = {int(i): [float(x) for x in r][-self.difficulty.window :] for i, r in saved["history"]}
        bad = [i for i in history if not 0 <= i < self.num_samples]
        if bad:
            raise ValueError(f"cannot resume: sampler.difficulty state names prompt {bad[0]} of {self.num_samples}")
        self.history, self.draws = history, int(saved["draws"])


def build_sampler(num_samples: int, config: SamplerConfig) -> PromptSampler | DifficultySampler:
    """The run's prompt sampler: difficulty-aware when ``config.difficulty`` is set."""
    return (
        DifficultySampler(num_samples, config) if config.difficulty is not None else PromptSampler(num_samples, config)
    )
