"""Score a batch of responses concurrently; count what fails; stop the run when too much does.

Each reward call (one per sample and term) runs on its own daemon thread (at most ``max_workers`` at
once). A call that raises, or returns something that is not a finite number, is an error; a call
still running ``timeout_s`` after it started is a timeout and is abandoned: Python cannot stop a
thread, so a reward function that never returns keeps its (daemon) thread until the process exits.
Code rewards bound their own runs (the sandbox kills the program), so their threads come back.

A reward function may return :class:`~gspo_mcore.rewards.registry.TokenRewards` (a sequence reward plus one
term per response token): :meth:`RewardRunner.score_tokens` returns those terms too, weighted and summed over
a sample's rewards, after checking that each has one term per response token (else the step stops, naming
the sample).

A failed call contributes 0 to its sample's reward and is counted per reward and per cause. When more
than ``max_error_fraction`` of one ``score`` call's reward calls failed, or when a failure shows the
setup itself is broken (an unknown reward named by a row, an unavailable sandbox), ``score`` raises a
``RewardError`` naming the first failure's cause and sample: training on rewards that are mostly
zeros-by-accident is worse than stopping.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from typing import Any, Mapping, Sequence

from gspo_mcore.rewards import code
from gspo_mcore.rewards.config import RewardRunnerConfig, RewardTermConfig
from gspo_mcore.rewards.registry import RESPONSE_IDS_KEY, TokenRewards
from gspo_mcore.rewards.resolve import Reward, RewardError, RewardSetupError, default_terms, resolve, short_name
from gspo_mcore.sandbox import SandboxUnavailable

__all__ = ["RewardFailure", "RewardRunner", "RewardRunnerConfig", "RewardTermConfig"]

logger = logging.getLogger(__name__)
_LOGGED_ERRORS = 5
_FATAL = (SandboxUnavailable, RewardSetupError)


class RewardFailure(RewardError):
    """Too many reward calls of one step failed, or one failed in a way no retry can fix."""


class TokenRewardsError(RewardSetupError):
    """A reward function's per-token terms do not fit its response: a bug in the function, so the step stops."""


class RewardRunner:
    """``score(responses, metadata) -> list[float]``; ``metrics()`` reports each reward and what failed."""

    def __init__(self, config: RewardRunnerConfig = RewardRunnerConfig()):
        self.config = config
        self.terms = default_terms(config)  # an unknown or unimportable reward fails here, at start-up
        self._own: dict[str, list[Reward]] = {}
        self._counts: collections.Counter = collections.Counter()
        self._sums: collections.Counter = collections.Counter()
        self._logged = 0

    def terms_for(self, meta: Mapping[str, Any]) -> list[Reward]:
        """The rewards of one sample: its own (``metadata[reward_key]``) or the configured ones."""
        spec = meta.get(self.config.reward_key)
        if not spec:
            return self.terms
        if spec not in self._own:
            self._own[spec] = [
                resolve(spec, self.config, name=short_name(spec), where=f"metadata[{self.config.reward_key!r}]")
            ]
        return self._own[spec]

    def score(
        self, responses: Sequence[str], metadata: Sequence[Mapping[str, Any]], prompts: Sequence[str] | None = None
    ) -> list[float]:
        """One reward per response (the weighted sum of its terms). ``prompts`` only improve messages.

        Raises ``RewardFailure`` when more than ``max_error_fraction`` of the calls failed or timed out,
        or when one failed because the setup is broken (after all calls of the step are counted).
        A reward's per-token terms (:class:`TokenRewards`) are dropped here; :meth:`score_tokens` keeps them.
        """
        return self._score(responses, metadata, prompts, None)[0]

    def score_tokens(
        self,
        responses: Sequence[str],
        metadata: Sequence[Mapping[str, Any]],
        response_ids: Sequence[Sequence[int]],
        prompts: Sequence[str] | None = None,
    ) -> tuple[list[float], list[list[float] | None]]:
        """:meth:`score`, plus per sample the weighted sum of its rewards' per-token terms (``None`` when none
        of its rewards returned :class:`TokenRewards`). Each reward function sees the response's token ids in
        ``metadata["response_ids"]``; a :class:`TokenRewards` whose ``per_token`` is not one finite number per
        response token stops the step (``RewardFailure`` from a ``TokenRewardsError`` naming the sample and the
        lengths): it is a bug in the reward function, not bad luck."""
        if len(response_ids) != len(responses):
            raise ValueError(f"{len(responses)} responses but {len(response_ids)} response_ids")
        return self._score(responses, metadata, prompts, [tuple(int(t) for t in ids) for ids in response_ids])

    def _score(self, responses, metadata, prompts, response_ids):
        if len(responses) != len(metadata):
            raise ValueError(f"{len(responses)} responses but {len(metadata)} metadata entries")
        if prompts is not None and len(prompts) != len(responses):
            raise ValueError(f"{len(responses)} responses but {len(prompts)} prompts")
        n = len(responses)
        jobs: list[tuple[int, Reward]] = []
        failures: list[tuple[int, Reward, str, BaseException | None]] = []  # (sample, reward, cause, error)
        for i in range(n):
            try:
                jobs += [(i, r) for r in self.terms_for(metadata[i])]
            except RewardSetupError as e:
                failures.append(
                    (
                        i,
                        Reward("unknown", str(metadata[i].get(self.config.reward_key)), "", None),
                        "RewardSetupError",
                        e,
                    )
                )
        if response_ids is not None:
            metadata = [{**m, RESPONSE_IDS_KEY: ids} for m, ids in zip(metadata, response_ids)]
        values = self._run(jobs, responses, metadata, failures, response_ids)
        rewards = [0.0] * n
        per_token: list[list[float] | None] = [None] * n
        for (i, r), v in zip(jobs, values):
            if v is None:
                continue
            value, terms = v
            rewards[i] += r.weight * value
            if terms is not None and response_ids is not None:
                acc = per_token[i] or [0.0] * len(terms)
                per_token[i] = [a + r.weight * t for a, t in zip(acc, terms)]
        self._count(jobs, [None if v is None else v[0] for v in values], failures)
        self._check(len(jobs) + sum(f[1].fn is None for f in failures), failures, responses, prompts)
        return rewards, per_token

    def metrics(self, reset: bool = True) -> dict[str, float]:
        """Since the last reset: ``reward_calls`` / ``reward_errors`` / ``reward_timeouts`` (all rewards),
        and per reward ``reward/<name>/mean`` (failed calls count 0), ``/calls``, ``/errors``,
        ``/timeouts`` and ``/errors/<cause>`` (the exception type); ``reward_code_over_budget``: code
        responses scored 0 for running their stdio cases past ``reward.code.stdio_time_budget_s``;
        ``reward_code_judge_failed``: code reports whose child judge ran past ``reward.code.judge_cpu_budget_s``
        or crashed (scored 0)."""
        c = self._counts
        out = {k: float(c[k]) for k in ("reward_calls", "reward_errors", "reward_timeouts")}
        for name in sorted({k.split("/")[1] for k in c if k.startswith("reward/")}):
            calls = c[f"reward/{name}/calls"]
            out[f"reward/{name}/mean"] = self._sums[name] / calls if calls else 0.0
            for k in ("calls", "errors", "timeouts"):
                out[f"reward/{name}/{k}"] = float(c[f"reward/{name}/{k}"])
        out.update({k: float(v) for k, v in c.items() if "/errors/" in k})
        out["reward_code_over_budget"] = float(code.OVER_BUDGET.take(reset))
        out["reward_code_judge_failed"] = float(code.JUDGE_FAILED.take(reset))
        if reset:
            self._counts.clear()
            self._sums.clear()
        return out

    # ------------------------------------------------------------------------------------------------

    def _run(self, jobs, responses, metadata, failures, response_ids=None) -> list[tuple | None]:
        """``(reward, per-token terms or None)`` of the jobs (None: failed, recorded in ``failures``),
        ``max_workers`` at a time."""
        values: list[float | None] = [None] * len(jobs)
        pending = collections.deque(range(len(jobs)))
        running: dict[int, float] = {}  # job -> start time
        finished: list[tuple[int, float | None, BaseException | None]] = []
        cond = threading.Condition()

        def call(j: int) -> None:
            i, reward = jobs[j]
            value, error = None, None
            try:
                value = _as_reward(
                    reward.fn(responses[i], metadata[i]),
                    None if response_ids is None else len(response_ids[i]),
                    f"sample {i}",
                )
            except BaseException as e:  # noqa: BLE001 - any failure of a reward is counted
                error = e
            with cond:
                if j in running:  # else it was abandoned after its timeout
                    del running[j]
                    finished.append((j, value, error))
                    cond.notify()

        with cond:
            while pending or running:
                while pending and len(running) < self.config.max_workers:
                    j = pending.popleft()
                    running[j] = time.monotonic()
                    threading.Thread(target=call, args=(j,), name=f"reward-{j}", daemon=True).start()
                if running and not finished:
                    deadline = min(running.values()) + self.config.timeout_s
                    cond.wait(timeout=max(0.0, deadline - time.monotonic()))
                for j, value, error in finished:
                    if error is not None:
                        failures.append((jobs[j][0], jobs[j][1], type(error).__name__, error))
                    else:
                        values[j] = value
                finished.clear()
                now = time.monotonic()
                for j, started in list(running.items()):
                    if now - started >= self.config.timeout_s:
                        del running[j]
                        failures.append((jobs[j][0], jobs[j][1], "timeout", None))
        return values

    def _count(self, jobs, values, failures) -> None:
        c = self._counts
        c["reward_calls"] += len(jobs)
        for (_, r), v in zip(jobs, values):
            c[f"reward/{r.name}/calls"] += 1
            self._sums[r.name] += v or 0.0
        for i, r, cause, error in failures:
            if r.fn is None:  # the sample's reward could not even be resolved
                c["reward_calls"] += 1
                c[f"reward/{r.name}/calls"] += 1
            kind = "timeouts" if cause == "timeout" else "errors"
            c[f"reward_{kind}"] += 1
            c[f"reward/{r.name}/{kind}"] += 1
            if kind == "errors":
                c[f"reward/{r.name}/errors/{cause}"] += 1
            if self._logged < _LOGGED_ERRORS:
                self._logged += 1
                logger.warning(
                    "reward %r failed on sample %d (reward 0): %s",
                    r.name,
                    i,
                    "timed out" if error is None else f"{cause}: {error}",
                )

    def _check(self, calls: int, failures, responses, prompts) -> None:
        if not failures:
            return
        fatal = [f for f in failures if isinstance(f[3], _FATAL)]
        fraction = len(failures) / max(calls, 1)
        if not fatal and fraction <= self.config.max_error_fraction:
            return
        i, reward, cause, error = (fatal or sorted(failures, key=lambda f: f[0]))[0]
        what = f"timed out after {self.config.timeout_s:g} s" if error is None else f"{cause}: {error}"
        sample = f"prompt {_head(prompts[i])}" if prompts is not None else f"response {_head(responses[i])}"
        why = (
            "cannot run"
            if fatal
            else (
                f"{len(failures)} of {calls} reward calls failed "
                f"(> reward.max_error_fraction={self.config.max_error_fraction:g})"
            )
        )
        raise RewardFailure(
            f"rewards {why}; first: reward {reward.name!r} ({reward.spec}) on sample {i} {what}; {sample}"
        ) from error


def _head(text: str, n: int = 200) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def _as_reward(value: Any, num_tokens: int | None = None, where: str = "") -> tuple[float, list[float] | None]:
    """A reward function's result as ``(reward, per-token terms or None)``; ``num_tokens``: the response's
    length the per-token terms must have (``None``: not known, the terms are dropped)."""
    if isinstance(value, TokenRewards):
        terms = None
        if num_tokens is not None:
            try:
                terms = [float(t) for t in value.per_token]
            except (TypeError, ValueError):
                raise TokenRewardsError(f"{where}: TokenRewards.per_token must be a sequence of numbers") from None
            if len(terms) != num_tokens:
                raise TokenRewardsError(
                    f"{where}: TokenRewards.per_token has {len(terms)} terms for {num_tokens} response tokens"
                )
            if not all(math.isfinite(t) for t in terms):
                raise TokenRewardsError(f"{where}: TokenRewards.per_token must be finite, got {terms}")
        return _as_float(value.reward), terms
    return _as_float(value), None


def _as_float(value: Any) -> float:
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)) or isinstance(value, complex):
        try:
            value = float(value)  # numpy / torch scalars
        except (TypeError, ValueError):
            raise TypeError(f"a reward must be a number, got {type(value).__name__}") from None
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"a reward must be finite, got {value}")
    return value
