"""The episode driver: multi-turn rollouts as token-exact trajectories, the same for every engine.

One episode is one token sequence: the prompt (the environment's first observation, rendered with the chat
template), then alternating policy spans (the ids the engine sampled, with its log-probs and weight versions)
and environment spans (only the new observation, rendered with the template's framing and appended). Nothing
sampled is ever decoded and re-tokenised; ``Sample.response_mask`` is 1 on the policy spans only.

The engine decodes (``generate_turns``: :mod:`gspo_mcore.rollout.turns`); this driver owns the rest: it resets
the environments, renders observations (:class:`gspo_mcore.envs.ChatRenderer`), steps the environments of every
turn that ended (concurrently, each in its own thread, each within ``step_timeout_s``), applies the limits
(``max_turns``, ``max_total_tokens``) and builds the samples with their :class:`EpisodeStats`.

An environment reset or step that raises or times out ends its episode as ``error`` with the cause (a timed-out
call's thread is abandoned, not killed: make steps that can hang time out themselves, like the sandboxed tools).
Rendering and tokenising the observation happen inside the same timed call, so a failure there (content the
template cannot render, a first observation too long for ``max_total_tokens``: refused by its characters before
it is tokenised when the renderer says how many characters a token covers at most, ``max_token_chars``) ends
that episode too; it counts against ``reward.max_error_fraction`` like any other. Resets run concurrently, each
within ``step_timeout_s``; an episode whose reset failed has no tokens (``finish_reason`` ``abort``: the learner
leaves it out) and never reaches the engine.

Ranks: with tensor parallelism every rank of the group must feed the engine the same tokens; ``runs_env=False``
ranks do not touch the environment and take every result from ``share`` (e.g. a broadcast from the rank that
runs it), which is called with the results on the rank that runs it and with ``None`` on the others.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gspo_mcore.rollout.turns import EpisodeStats, TurnEnd, TurnStop
from gspo_mcore.rollout.types import RolloutEngine, Sample, SamplingParams, derive_sample_seed

Share = Callable[[Any], Any]
# the info keys summed into the episode's stats (gspo_mcore.envs.base; rollout does not import envs, so the
# environment's answers are read by their attributes: Reset(observation, state, tools, max_new_tokens, stop),
# Step(observation, done, reward, info, max_new_tokens, stop))
TOOL_CALLS, TOOL_ERRORS, IGNORED_FIELDS = "tool_calls", "tool_errors", "ignored_fields"


@dataclass(frozen=True)
class TurnTokens:
    """The policy turn as the trainer counted it, for an environment whose ``step`` takes a ``turn`` keyword
    (``step(state, action, turn=...)``; the agent endpoint reports them as ``usage`` and ``logprobs``)."""

    prompt_tokens: int
    """The episode's tokens before this turn (prompt, earlier turns, environment spans)."""
    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    tokens: tuple[str, ...]
    """Each id's text (``renderer.decode([id])``)."""
    finish_reason: str


class PromptTooLong(ValueError):
    """An episode's first observation leaves no room for a policy token under ``max_total_tokens``."""


@dataclass
class _Episode:
    prompt: tuple[int, ...]
    state: Any = None
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    env_s: float = 0.0
    env_reward: float = 0.0
    end: str | None = None
    error: str | None = None
    last: TurnEnd | None = None
    started: bool = True  # its reset succeeded (else it never reaches the engine)
    cap: int | None = None  # the environment's cap on the next policy turn (Reset/Step.max_new_tokens)
    stop: tuple[str, ...] = ()  # the next policy turn's stop strings (Reset/Step.stop)
    ignored: dict[str, int] = field(default_factory=dict)  # request fields let through unhonoured (info)


class EpisodeDriver:
    """Runs episodes of ``env`` on an engine's ``generate_turns`` coroutine, on an event loop of its own (see the
    module docstring).

    Args:
        env: an environment (``reset(row)``, ``step(state, action)``).
        renderer: observations -> ids (:class:`gspo_mcore.envs.ChatRenderer` or the same two methods, ``first``
            and ``after_turn``, plus ``decode``).
        config: the limits: ``max_turns``, ``max_total_tokens``, ``step_timeout_s`` (``gspo_mcore.envs.EpisodeConfig``).
    """

    def __init__(self, env, renderer, config, *, runs_env: bool = True, share: Share | None = None):
        if not runs_env and share is None:
            raise ValueError("EpisodeDriver: a rank that does not run the environment needs share")
        self.env, self.renderer, self.config = env, renderer, config
        self.runs_env, self.share = runs_env, share
        try:  # a renderer that takes the turn's end (ChatRenderer) strips the stop text only after a stop token
            self._says_stopped = "stopped" in inspect.signature(renderer.after_turn).parameters
        except (TypeError, ValueError):
            self._says_stopped = False
        try:  # an environment that takes the turn's tokens (AgentEnv) gets them
            self._takes_turn = "turn" in inspect.signature(env.step).parameters
        except (TypeError, ValueError, AttributeError):
            self._takes_turn = False

    def run(
        self,
        engine: RolloutEngine,
        rows: Sequence[Mapping[str, Any]],
        n: int,
        params: SamplingParams,
        *,
        seed: int,
        prompt_offset: int = 0,
    ) -> list[list[Sample]]:
        """``n`` episodes per row; ``out[i][j]`` is episode ``j`` of ``rows[i]``. Episode ``j`` of the row at
        global index ``prompt_offset + i`` samples from the key ``derive_sample_seed(seed, prompt_offset + i, j)``."""
        starts = self._reset_all([r for r in rows for _ in range(n)]) if self.runs_env else None
        # every rank: (prompt ids, None, the first turn's (cap, stop)) or (None, the reset's failure, (None, ()))
        prompts = self._agree([(ids, error, lim) for ids, _, error, lim in starts] if starts is not None else None)
        states = [state for _, state, _, _ in starts] if starts is not None else [None] * len(prompts)
        episodes = []
        for (ids, error, (cap, stop)), state in zip(prompts, states):
            ep = _Episode(prompt=tuple(ids or ()), state=state, started=error is None, cap=cap, stop=tuple(stop))
            if error is not None:
                ep.end, ep.error = "error", error
            episodes.append(ep)
        keys = [derive_sample_seed(seed, prompt_offset + i, j) for i in range(len(rows)) for j in range(n)]
        live = [k for k, ep in enumerate(episodes) if ep.started]

        def on_turns(ends):  # the engine's rows are the live episodes
            return self._on_turns(episodes, [dataclasses.replace(e, row=live[e.row]) for e in ends])

        try:
            if live:
                asyncio.run(
                    engine.generate_turns(
                        [episodes[k].prompt for k in live],
                        params,
                        keys=[keys[k] for k in live],
                        max_total_tokens=self.config.max_total_tokens,
                        on_turns=on_turns,
                        caps=lambda row: episodes[live[row]].cap,
                        stops=lambda row: self._turn_stop(episodes[live[row]].stop),
                    )
                )
        finally:
            self._end_all(episodes)
        return [[self._sample(episodes[i * n + j], i, j) for j in range(n)] for i in range(len(rows))]

    # -- environment side -------------------------------------------------------------------------------
    def _reset_all(self, rows: Sequence[Mapping[str, Any]]) -> list[tuple]:
        """Every episode's reset and first render, concurrently, each within ``step_timeout_s``: ``(ids, state,
        None, the first turn's (cap, stop strings))``, or ``(None, None, cause, (None, ()))`` when it raised or
        timed out."""
        results: list = [(False, "not run", 0.0)] * len(rows)

        def work(k, row):
            results[k] = _timed(lambda: self._reset_one(row), self.config.step_timeout_s)

        threads = [
            threading.Thread(target=work, args=(k, row), daemon=True, name="env-reset") for k, row in enumerate(rows)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [
            (value[0], value[1], None, value[2]) if ok else (None, None, value, (None, ())) for ok, value, _ in results
        ]

    def _reset_one(self, row: Mapping[str, Any]) -> tuple[list[int], Any, tuple]:
        value = self.env.reset(row)
        if not all(hasattr(value, a) for a in ("observation", "state", "tools")):
            raise TypeError(f"reset returned {type(value).__name__}, not envs.Reset")
        limit = self.config.max_total_tokens
        per_token = getattr(self.renderer, "max_token_chars", None)
        if per_token is not None and _chars(value.observation) > limit * per_token:
            raise PromptTooLong(
                f"the first observation has {_chars(value.observation)} characters, more than "
                f"rollout.episode.max_total_tokens={limit} tokens can hold ({per_token} characters per token at most)"
            )
        ids = list(self.renderer.first(value.observation, value.tools))
        if len(ids) >= limit:
            raise PromptTooLong(
                f"the first observation has {len(ids)} tokens, no room under rollout.episode.max_total_tokens={limit}"
            )
        return ids, value.state, (_cap(value, "reset"), _stop(value, "reset"))

    def _end_all(self, episodes: list[_Episode]) -> None:
        """The environment's optional ``end_episode(state)`` for every episode, whatever ended it (an agent
        program's pending call is released there); its failures are ignored, each call within the step timeout."""
        end = getattr(self.env, "end_episode", None) if self.runs_env else None
        if end is None:
            return
        for ep in episodes:
            if ep.started:
                _timed(lambda state=ep.state: end(state), self.config.step_timeout_s)

    def _agree(self, value):
        """The environment rank's ``value`` on every rank (``share``); as it is without ``share``."""
        return self.share(value) if self.share is not None else value

    def _on_turns(self, episodes: list[_Episode], ends: Sequence[TurnEnd]) -> list[list[int] | None]:
        for e in ends:
            ep = episodes[e.row]
            ep.ids += e.ids
            ep.mask += [1] * len(e.ids)
            ep.logprobs += e.logprobs
            ep.versions += e.versions
            ep.turns += 1
            ep.last = e
        outcomes = self._agree(self._step_all([episodes[e.row] for e in ends]) if self.runs_env else None)
        answers: list[list[int] | None] = []
        for e, (kind, payload, calls, errors, reward, ignored, (cap, stop), seconds) in zip(ends, outcomes):
            ep = episodes[e.row]
            ep.tool_calls, ep.tool_errors = ep.tool_calls + calls, ep.tool_errors + errors
            ep.env_reward += reward
            ep.env_s += seconds
            ep.cap, ep.stop = cap, tuple(stop)
            for name, count in ignored.items():
                ep.ignored[name] = ep.ignored.get(name, 0) + count
            if kind != "continue":
                ep.end, ep.error = kind, payload
                answers.append(None)
                continue
            ids = list(payload)
            if ep.turns >= self.config.max_turns:
                ep.end = "max_turns"
                answers.append(None)
            elif len(ep.prompt) + len(ep.ids) + len(ids) + 1 > self.config.max_total_tokens:
                ep.end = "max_total_tokens"
                answers.append(None)
            else:
                ep.ids += ids
                ep.mask += [0] * len(ids)
                ep.logprobs += [0.0] * len(ids)
                ep.versions += [e.versions[-1] if e.versions else 0] * len(ids)
                answers.append(ids)
        return answers

    def _step_all(self, eps: list[_Episode]) -> list[tuple]:
        """Every episode's environment step, concurrently: ``(kind, payload, tool_calls, tool_errors, reward,
        ignored_fields, the next turn's (cap, stop strings), seconds)`` each; kind ``continue`` (payload: the ids
        to append), ``done`` or ``error`` (payload: the cause)."""
        results: list[list] = [[False, "not run", 0.0] for _ in eps]
        threads = []
        for k, ep in enumerate(eps):

            def work(k=k, ep=ep, before=len(ep.prompt) + len(ep.ids) - len(ep.last.ids)):
                results[k] = list(
                    _timed(lambda: self._step_one(ep.state, ep.last, before, ep.stop), self.config.step_timeout_s)
                )

            t = threading.Thread(target=work, daemon=True, name="env-step")
            threads.append(t)
            t.start()
        for t in threads:
            t.join()
        return [
            (*value, seconds) if ok else ("error", value, 0, 0, 0.0, {}, (None, ()), seconds)
            for ok, value, seconds in results
        ]

    def _step_one(self, state, last: TurnEnd, before: int = 0, stop: tuple[str, ...] = ()) -> tuple:
        """One episode's step and the render of its observation (raises on any failure of either); ``stop``: the
        turn's stop strings (a turn they ended has no stop token to strip from the template's end of turn)."""
        action = self.renderer.decode(last.ids)
        if self._takes_turn:
            tokens = tuple(self.renderer.decode([i]) for i in last.ids)
            turn = TurnTokens(before, tuple(last.ids), tuple(last.logprobs), tokens, last.finish_reason)
            value = self.env.step(state, action, turn=turn)
        else:
            value = self.env.step(state, action)
        if not all(hasattr(value, a) for a in ("observation", "done", "reward", "info")):
            raise TypeError(f"step returned {type(value).__name__}, not envs.Step")
        calls, errors = int(value.info.get(TOOL_CALLS, 0)), int(value.info.get(TOOL_ERRORS, 0))
        ignored = {str(k): int(v) for k, v in (value.info.get(IGNORED_FIELDS) or {}).items()}
        if value.done:
            return "done", None, calls, errors, float(value.reward), ignored, (None, ())
        if self._says_stopped:
            by_string = bool(stop) and self._turn_stop(stop).hit(last.ids)
            kwargs = {"stopped": last.finish_reason == "stop" and not by_string}
        else:
            kwargs = {}
        ids = self.renderer.after_turn(value.observation, last.ids, **kwargs)
        limits = (_cap(value, "step"), _stop(value, "step"))
        return "continue", tuple(ids), calls, errors, float(value.reward), ignored, limits

    def _turn_stop(self, strings: tuple[str, ...]) -> TurnStop | None:
        """The engines' :class:`TurnStop` for a turn's stop strings: a turn's ids complete one when their text
        (``renderer.decode``, the whole turn: a string may end inside a token) holds it."""
        if not strings:
            return None

        def hit(ids) -> bool:
            text = self.renderer.decode(list(ids))
            return any(s in text for s in strings)

        return TurnStop(tuple(strings), hit)

    # -- the trajectory ---------------------------------------------------------------------------------
    def _sample(self, ep: _Episode, i: int, j: int) -> Sample:
        last = ep.last
        stats = EpisodeStats(
            turns=ep.turns,
            end=ep.end or "done",
            error=ep.error,
            tool_calls=ep.tool_calls,
            tool_errors=ep.tool_errors,
            env_s=ep.env_s,
            env_reward=ep.env_reward,
            policy_tokens=sum(ep.mask),
            env_tokens=len(ep.mask) - sum(ep.mask),
            final_turn=tuple(last.ids) if last is not None else (),
            ignored_fields=dict(ep.ignored),
        )
        versions = tuple(ep.versions)
        return Sample(
            prompt_index=i,
            sample_index=j,
            prompt_ids=ep.prompt,
            response_ids=tuple(ep.ids),
            response_logprobs=tuple(ep.logprobs),
            finish_reason=last.finish_reason if last is not None else "abort",
            weight_version=min(versions) if versions else 0,
            token_versions=versions if len(set(versions)) > 1 else None,
            response_mask=tuple(ep.mask),
            routed_experts=last.routed_experts if last is not None else None,
            episode=stats,
        )


def _cap(value, what: str) -> int | None:
    """A reset's or step's cap on the next policy turn (``max_new_tokens``; ``None`` when it has none)."""
    cap = getattr(value, "max_new_tokens", None)
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ValueError(f"{what} returned max_new_tokens={cap!r}, not a positive integer")
    return cap


def _stop(value, what: str) -> tuple[str, ...]:
    """A reset's or step's stop strings for the next policy turn (``stop``; ``()`` when it has none)."""
    stop = getattr(value, "stop", None) or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"{what} returned stop={stop!r}, not non-empty strings")
    return stop


def _chars(observation) -> int:
    """The characters of an observation's text (its messages' contents), before any template or tokenizer."""
    if isinstance(observation, str):
        return len(observation)
    total = 0
    for m in observation:
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, Sequence):
            total += sum(
                len(p.get("text", "")) for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str)
            )
    return total


def _timed(fn, timeout_s: float) -> tuple[bool, Any, float]:
    """``fn()`` in a daemon thread, waited for at most ``timeout_s``: ``(True, value, seconds)``, or ``(False,
    cause, seconds)`` when it raised (``"TypeName: message"``) or timed out (``"timeout"``)."""
    box: list = []
    t0 = time.perf_counter()

    def target():
        try:
            box.append((True, fn()))
        except Exception as e:  # noqa: BLE001 - the environment's failure is counted, not raised
            box.append((False, f"{type(e).__name__}: {e}"))

    t = threading.Thread(target=target, daemon=True, name="env-call")
    t.start()
    t.join(timeout_s)
    seconds = time.perf_counter() - t0
    if not box:
        return False, "timeout", seconds
    ok, value = box[0]
    return ok, value, seconds
