"""The episode driver: multi-turn rollouts as token-exact trajectories, the same for every engine.

One episode is one token sequence: the prompt (the environment's first observation, rendered with the chat
template), then alternating policy spans (the ids the engine sampled, with its log-probs and weight versions)
and environment spans (only the new observation, rendered with the template's framing and appended). Nothing
sampled is ever decoded and re-tokenised; ``Sample.response_mask`` is 1 on the policy spans only.

The engine decodes (``generate_turns``: :mod:`gspo_mcore.rollout.turns`); this driver owns the rest: it resets
the environments, renders observations (:class:`gspo_mcore.envs.ChatRenderer`), steps the environments of every
turn that ended (concurrently, each in its own thread, each within ``step_timeout_s``), applies the limits
(``max_turns``, ``max_total_tokens``) and builds the samples with their :class:`EpisodeStats`.

An environment step that raises or times out ends its episode as ``error`` with the cause (a timed-out step's
thread is abandoned, not killed: make steps that can hang time out themselves, like the sandboxed tools).

Ranks: with tensor parallelism every rank of the group must feed the engine the same tokens; ``runs_env=False``
ranks do not touch the environment and take every result from ``share`` (e.g. a broadcast from the rank that
runs it), which is called with the results on the rank that runs it and with ``None`` on the others.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gspo_mcore.rollout.turns import EpisodeStats, TurnEnd
from gspo_mcore.rollout.types import RolloutEngine, RolloutError, Sample, SamplingParams, derive_sample_seed

Share = Callable[[Any], Any]
# the info keys summed into the episode's stats (gspo_mcore.envs.base; rollout does not import envs, so the
# environment's answers are read by their attributes: Reset(observation, state, tools), Step(observation, done,
# reward, info))
TOOL_CALLS, TOOL_ERRORS = "tool_calls", "tool_errors"


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
        starts = [self._reset(r, i) for i, r in enumerate(rows) for _ in range(n)] if self.runs_env else None
        prompts = self._agree([ids for ids, _ in starts] if starts is not None else None)
        states = [state for _, state in starts] if starts is not None else [None] * len(prompts)
        episodes = [_Episode(prompt=tuple(ids), state=state) for ids, state in zip(prompts, states)]
        for i, ep in enumerate(episodes):
            if len(ep.prompt) >= self.config.max_total_tokens:
                raise RolloutError(
                    f"episode of row {prompt_offset + i // n}: the first observation has {len(ep.prompt)} tokens, "
                    f"no room under rollout.episode.max_total_tokens={self.config.max_total_tokens}"
                )
        keys = [derive_sample_seed(seed, prompt_offset + i, j) for i in range(len(rows)) for j in range(n)]
        try:
            asyncio.run(
                engine.generate_turns(
                    [ep.prompt for ep in episodes],
                    params,
                    keys=keys,
                    max_total_tokens=self.config.max_total_tokens,
                    on_turns=lambda ends: self._on_turns(episodes, ends),
                )
            )
        finally:
            self._end_all(episodes)
        return [[self._sample(episodes[i * n + j], i, j) for j in range(n)] for i in range(len(rows))]

    # -- environment side -------------------------------------------------------------------------------
    def _reset(self, row: Mapping[str, Any], index: int):
        ok, value, _ = _timed(lambda: self.env.reset(row), self.config.step_timeout_s)
        if not ok:
            raise RolloutError(f"rollout.env: reset of row {index} failed: {value}")
        if not all(hasattr(value, a) for a in ("observation", "state", "tools")):
            raise RolloutError(f"rollout.env: reset of row {index} returned {type(value).__name__}, not envs.Reset")
        return self.renderer.first(value.observation, value.tools), value.state

    def _end_all(self, episodes: list[_Episode]) -> None:
        """The environment's optional ``end_episode(state)`` for every episode, whatever ended it (an agent
        program's pending call is released there); its failures are ignored, each call within the step timeout."""
        end = getattr(self.env, "end_episode", None) if self.runs_env else None
        if end is None:
            return
        for ep in episodes:
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
        for e, (kind, payload, calls, errors, reward, seconds) in zip(ends, outcomes):
            ep = episodes[e.row]
            ep.tool_calls, ep.tool_errors = ep.tool_calls + calls, ep.tool_errors + errors
            ep.env_reward += reward
            ep.env_s += seconds
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
        seconds)`` each; kind ``continue`` (payload: the ids to append), ``done`` or ``error`` (payload: the cause)."""
        actions = [self.renderer.decode(ep.last.ids) for ep in eps]
        results: list[list] = [[False, "not run", 0.0] for _ in eps]
        threads = []
        for k, (ep, action) in enumerate(zip(eps, actions)):

            def work(k=k, state=ep.state, action=action):
                results[k] = list(_timed(lambda: self.env.step(state, action), self.config.step_timeout_s))

            t = threading.Thread(target=work, daemon=True, name="env-step")
            threads.append(t)
            t.start()
        for t in threads:
            t.join()
        out = []
        for ep, (ok, value, seconds) in zip(eps, results):
            if not ok:
                out.append(("error", value, 0, 0, 0.0, seconds))
                continue
            if not all(hasattr(value, a) for a in ("observation", "done", "reward", "info")):
                out.append(("error", f"step returned {type(value).__name__}, not envs.Step", 0, 0, 0.0, seconds))
                continue
            calls, errors = int(value.info.get(TOOL_CALLS, 0)), int(value.info.get(TOOL_ERRORS, 0))
            if value.done:
                out.append(("done", None, calls, errors, float(value.reward), seconds))
                continue
            ids = self.renderer.after_turn(value.observation, ep.last.ids)
            out.append(("continue", tuple(ids), calls, errors, float(value.reward), seconds))
        return out

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
