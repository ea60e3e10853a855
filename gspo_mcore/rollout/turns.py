"""The contract between a multi-turn engine and the episode driver (:mod:`gspo_mcore.rollout.episode`).

An engine that runs episodes (``generate_turns``) decodes each row's policy turn and, whenever turns end,
calls ``on_turns(ends)`` once with all of them; for each it gets back the token ids to append before the
row's next turn (the environment's span, never re-tokenised by the engine), or ``None``: the episode is
over. The engine appends the sampled ids exactly as drawn; the driver owns everything else (environments,
rendering, limits, the trajectory).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
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
    """``stop`` (a stop token, the last id, or a stop string, :class:`TurnStop`), ``length`` (the turn's budget:
    ``max_new_tokens``, the room left under the episode's ``max_total_tokens`` or the row's cap, :data:`TurnCaps`)
    or ``abort``."""
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
    ignored_fields: Mapping[str, int] = field(default_factory=dict)
    """Requests per field that an agent endpoint let through unhonoured (``rollout.env_kwargs.ignore_fields``)."""


OnTurns = Callable[[Sequence[TurnEnd]], Sequence["Sequence[int] | None"]]
TurnCaps = Callable[[int], "int | None"]
"""``caps(row)``: a cap on the tokens of ``row``'s next policy turn (``None``: none), asked when the turn starts
(after ``on_turns`` answered the previous one): an environment's per-turn limit, e.g. an agent request's
``max_tokens``."""


@dataclass(frozen=True)
class TurnStop:
    """Stop strings for one policy turn (an agent request's ``stop``): the turn ends, finish reason ``stop``, at
    the first sampled token whose text completes one of ``strings``. That token is kept (the turn's ids are as
    sampled; the text past the string inside it is the environment's to hide), no later token is sampled."""

    strings: tuple[str, ...]
    """The strings (SGLang matches them itself: its ``sampling_params.stop``)."""
    hit: Callable[[Sequence[int]], bool]
    """``hit(ids)``: whether the turn's ids so far complete one of the strings (the driver decodes them with the
    episode's tokenizer; an engine that samples ids without text asks it after each sampled token)."""


TurnStops = Callable[[int], "TurnStop | None"]
"""``stops(row)``: the stop strings of ``row``'s next policy turn (``None``: none), asked when the turn starts, as
:data:`TurnCaps`."""


def turn_budget(max_new_tokens: int, room: int, caps: TurnCaps | None, row: int) -> int:
    """The tokens ``row``'s next turn may sample: the run's ``max_new_tokens``, the ``room`` left under the
    episode's ``max_total_tokens`` and the row's cap, whichever is smallest. A cap only shortens the turn: each
    token is drawn as without it (the same key stream), and the turn ends ``length`` at the cap."""
    cap = caps(row) if caps is not None else None
    return min(max_new_tokens, room) if cap is None else min(max_new_tokens, room, int(cap))
