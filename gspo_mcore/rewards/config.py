"""The run config's ``reward:`` section: which rewards, composed how, each built-in's settings.

Loaded by ``gspo_mcore.config.from_dict`` like every other section (unknown keys fail with the dotted
key). docs/rewards.md describes each field with examples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gspo_mcore.rewards.code import CodeRewardConfig
from gspo_mcore.rewards.match import ExactMatchConfig, RegexMatchConfig
from gspo_mcore.rewards.math import MathRewardConfig


@dataclass(frozen=True, kw_only=True)
class RewardTermConfig:
    """One weighted term of a composed reward: ``reward = sum(weight * term(response, metadata))``."""

    name: str
    """Name in the metrics (``reward/<name>/mean`` ...) and in error messages; unique in ``terms``."""
    reward: str
    """A built-in (``math``, ``exact``, ``regex``, ``code``), a registered name, or a dotted path
    ``pkg.mod:fn`` to a user function."""
    weight: float = 1.0
    """Factor of this term in the sum (any finite number; negative for a penalty)."""
    options: dict[str, Any] = field(default_factory=dict)
    """For a built-in: fields of its section (``reward.math`` ...) that differ for this term, e.g.
    ``{patterns: ["^Answer:"]}`` for a regex format term. For a user function: keyword arguments."""
    required_fields: tuple[str, ...] = ()
    """Metadata fields a user function reads (checked on every dataset row at start-up). Built-ins
    declare their own (``answer_key``, ``tests_key``, ``pattern_key``)."""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise ValueError(f"RewardTermConfig.name must be a non-empty string without '/', got {self.name!r}")
        if not isinstance(self.reward, str) or not self.reward:
            raise ValueError(f"reward term {self.name!r}: reward must be a non-empty string, got {self.reward!r}")
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) or not math.isfinite(self.weight):
            raise ValueError(f"reward term {self.name!r}: weight must be a finite number, got {self.weight!r}")
        object.__setattr__(self, "required_fields", tuple(self.required_fields))


@dataclass(frozen=True, kw_only=True)
class RewardRunnerConfig:
    reward: str = "math"
    """The reward when ``terms`` is empty: a built-in, a registered name, or a dotted path ``pkg.mod:fn``."""
    required_fields: tuple[str, ...] = ()
    """Metadata fields ``reward`` reads when it is a user function (checked at start-up)."""
    terms: tuple[RewardTermConfig, ...] = ()
    """Several rewards summed with weights (each reported on its own); replaces ``reward`` when set."""
    reward_key: str = "reward_fn"
    """Metadata field that names a sample's own reward (mixed datasets); it replaces the whole
    composition for that sample."""
    max_workers: int = 8
    """Reward calls in flight at once."""
    timeout_s: float = 60.0
    """Per-call limit, counted from the call's start; then reward 0 and a counted timeout."""
    max_error_fraction: float = 0.1
    """A ``score`` call in which more than this fraction of the reward calls failed or timed out
    raises ``RewardFailure`` (the run stops). 1.0: never stop for failing calls."""
    math: MathRewardConfig = field(default_factory=MathRewardConfig)
    """Settings of the built-in ``math`` reward."""
    exact: ExactMatchConfig = field(default_factory=ExactMatchConfig)
    """Settings of the built-in ``exact`` reward."""
    regex: RegexMatchConfig = field(default_factory=RegexMatchConfig)
    """Settings of the built-in ``regex`` reward."""
    code: CodeRewardConfig = field(default_factory=CodeRewardConfig)
    """Settings of the built-in ``code`` reward, its sandbox included (``reward.code.sandbox``)."""

    def __post_init__(self):
        if not self.reward:
            raise ValueError("RewardRunnerConfig.reward must be non-empty")
        if isinstance(self.max_workers, bool) or not isinstance(self.max_workers, int) or self.max_workers < 1:
            raise ValueError(f"RewardRunnerConfig.max_workers must be an int >= 1, got {self.max_workers!r}")
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"RewardRunnerConfig.timeout_s must be a finite number > 0, got {self.timeout_s!r}")
        if not (isinstance(self.max_error_fraction, (int, float)) and 0 <= self.max_error_fraction <= 1):
            raise ValueError(
                f"RewardRunnerConfig.max_error_fraction must be in [0, 1], got {self.max_error_fraction!r}"
            )
        budget = self.code.stdio_time_budget_s
        uses_code = self.reward == "code" or any(t.reward == "code" for t in self.terms)
        if uses_code and budget is not None and budget >= self.timeout_s:
            raise ValueError(
                f"reward.code.stdio_time_budget_s ({budget:g}) must be below reward.timeout_s ({self.timeout_s:g}): "
                "a response over the budget must score 0, not time the reward call out"
            )
        object.__setattr__(self, "required_fields", tuple(self.required_fields))
        object.__setattr__(self, "terms", tuple(self.terms))
        names = [t.name for t in self.terms]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"RewardRunnerConfig.terms: duplicate names {dup}")
