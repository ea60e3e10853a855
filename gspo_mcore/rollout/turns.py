"""The contract between a multi-turn engine and the episode driver (:mod:`gspo_mcore.rollout.episode`).

An engine that runs episodes (``generate_turns``) decodes each row's policy turn and, whenever turns end,
calls ``on_turns(ends)`` once with all of them; for each it gets back the token ids to append before the
row's next turn (the environment's span, never re-tokenised by the engine), or ``None``: the episode is
over. The engine appends the sampled ids exactly as drawn; the driver owns everything else (environments,
rendering, limits, the trajectory).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from gspo_mcore.rollout.types import FinishReason


@dataclass(frozen=True)
class TurnEnd:
    """One policy turn that ended: the ids sampled in it, as drawn."""

    row: int
    """The row (episode) in the ``generate_turns`` call."""
    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    """The engine's log-prob of each id (the convention of :mod:`gspo_mcore.rollout.types`)."""
    versions: tuple[int, ...]
    """The weight version that sampled each id."""
    finish_reason: FinishReason
    """``stop`` (a stop token, the last id), ``length`` (the turn's budget: ``max_new_tokens`` or the room left
    under the episode's ``max_total_tokens``) or ``abort``."""
    routed_experts: object = None
    """SGLang with R3: the experts of the whole sequence so far (prompt, earlier turns, this turn)."""


EpisodeEnd = Literal["done", "max_turns", "max_total_tokens", "error"]
EPISODE_ENDS: tuple[str, ...] = ("done", "max_turns", "max_total_tokens", "error")


@dataclass(frozen=True, kw_only=True)
class EpisodeStats:
    """How one episode went (``Sample.episode``)."""

    turns: int
    """Policy turns."""
    end: EpisodeEnd
    """``done`` (the environment ended it), ``max_turns``, ``max_total_tokens`` (an observation would not leave
    room for another policy token) or ``error`` (an environment step raised or timed out: see ``error``)."""
    error: str | None = None
    """The cause of an ``error`` end: ``timeout``, or the exception's type and message."""
    tool_calls: int = 0
    tool_errors: int = 0
    env_s: float = 0.0
    """Wall-clock seconds of the episode's environment steps."""
    env_reward: float = 0.0
    """The environment's own reward terms, summed."""
    policy_tokens: int = 0
    env_tokens: int = 0
    final_turn: tuple[int, ...] = ()
    """The ids of the last policy turn (the text the run's ``reward:`` scores)."""


OnTurns = Callable[[Sequence[TurnEnd]], Sequence["Sequence[int] | None"]]
