"""The environment interface: what a user writes to train a multi-turn agent.

An environment is any class with two methods (checked at start-up, :func:`gspo_mcore.envs.config.load_env`):

- ``reset(row) -> Reset``: the dataset row (``{"prompt" or "messages", "metadata"}``) in, the first
  observation out (chat messages, or text for a model without a chat template) with the episode's state;
- ``step(state, action) -> Step``: the policy's turn as text in; the next observation (or ``None``), whether
  the episode is done, and an ``info`` dict;
- optionally ``end_episode(state)``: called once when an episode ends, whatever ended it (done, a limit, an
  error), to release what the episode holds (:class:`gspo_mcore.envs.agent.AgentEnv` ends its agent's call).

The episode's reward is the run's ``reward:`` section applied to the final policy turn; an environment may
add a term (``Step.reward``, summed over the episode). It never sees token ids, engines or the learner: the
rollout side (:mod:`gspo_mcore.rollout.episode`) tokenises observations and keeps the sampled ids exact.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

Message = Mapping[str, Any]
"""One chat message: ``{"role": ..., "content": ...}`` (``role`` ``"tool"`` for a tool's result, with ``name``)."""
Observation = str | Sequence[Message]
"""Chat messages (appended to the conversation), or plain text (for a model without a chat template)."""

# info keys the episode driver sums over an episode's steps (ints; IGNORED_FIELDS: {field: int})
TOOL_CALLS, TOOL_ERRORS, IGNORED_FIELDS = "tool_calls", "tool_errors", "ignored_fields"


@dataclass(frozen=True, kw_only=True)
class Reset:
    """An episode's start."""

    observation: Observation
    """The first observation: the prompt, as chat messages (rendered with the model's chat template) or text."""
    state: Any = None
    """The episode's own state, handed back to every ``step`` (never shared between episodes)."""
    tools: tuple[Mapping[str, Any], ...] = ()
    """JSON schemas of the tools the model may call (OpenAI's ``{"type": "function", "function": {...}}``),
    given to the chat template (or the fallback tool prompt, :mod:`gspo_mcore.envs.render`)."""
    max_new_tokens: int | None = None
    """A cap on the first policy turn's tokens (``None``: none); the run's ``rollout.sampling.max_new_tokens``
    and the room left under ``rollout.episode.max_total_tokens`` still apply (the smallest wins)."""
    stop: tuple[str, ...] = ()
    """Stop strings for the first policy turn: it ends at the first sampled token whose text completes one (that
    token kept: the turn's ids are as sampled; an agent request's ``stop``)."""

    def __post_init__(self):
        _check_observation(self.observation, "Reset.observation", allow_none=False)
        object.__setattr__(self, "tools", tuple(self.tools))
        _check_cap(self.max_new_tokens, "Reset.max_new_tokens")
        object.__setattr__(self, "stop", _check_stop(self.stop, "Reset.stop"))


@dataclass(frozen=True, kw_only=True)
class Step:
    """What the environment answers to one policy turn."""

    observation: Observation | None = None
    """The next observation, appended to the episode (``None``: nothing to add)."""
    done: bool = False
    """The episode is over (its final policy turn was the last one)."""
    reward: float = 0.0
    """A term added to the episode's reward (summed over its steps)."""
    info: dict = field(default_factory=dict)
    """Free-form; the ints under ``tool_calls`` and ``tool_errors`` are summed into the episode's metrics, and so
    are the counts of ``ignored_fields`` (``{field: requests}``: request fields an agent endpoint let through
    unhonoured)."""
    max_new_tokens: int | None = None
    """A cap on the next policy turn's tokens (``None``: none), as :attr:`Reset.max_new_tokens`."""
    stop: tuple[str, ...] = ()
    """Stop strings for the next policy turn, as :attr:`Reset.stop`."""

    def __post_init__(self):
        _check_observation(self.observation, "Step.observation", allow_none=True)
        _check_cap(self.max_new_tokens, "Step.max_new_tokens")
        object.__setattr__(self, "stop", _check_stop(self.stop, "Step.stop"))
        if not isinstance(self.done, bool):
            raise TypeError(f"Step.done must be a bool, got {type(self.done).__name__}")
        if not isinstance(self.reward, (int, float)) or isinstance(self.reward, bool):
            raise TypeError(f"Step.reward must be a number, got {type(self.reward).__name__}")
        if not self.done and self.observation is None:
            raise ValueError("Step: an episode that is not done needs an observation for the next turn")


@runtime_checkable
class Environment(Protocol):
    """The two methods an environment class must have (see the module docstring)."""

    def reset(self, row: Mapping[str, Any]) -> Reset: ...

    def step(self, state: Any, action: str) -> Step: ...


def _check_cap(cap, what: str) -> None:
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ValueError(f"{what} must be a positive integer or None, got {cap!r}")


def _check_stop(stop, what: str) -> tuple[str, ...]:
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"{what} must be non-empty strings, got {stop!r}")
    return stop


def _check_observation(obs, what: str, *, allow_none: bool) -> None:
    if obs is None and allow_none:
        return
    if isinstance(obs, str):
        return
    if isinstance(obs, Sequence) and obs and all(isinstance(m, Mapping) and "role" in m for m in obs):
        return
    raise TypeError(f"{what} must be text or a non-empty list of chat messages with a 'role', got {obs!r:.200}")
