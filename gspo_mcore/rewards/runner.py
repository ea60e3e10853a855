"""Score a batch of responses concurrently; a failing or hanging reward gives 0, never a crash.

Each call runs on its own daemon thread (at most ``max_workers`` at once). A call that raises, returns
something that is not a finite number, or names an unknown reward counts in ``reward_errors``; a call
still running ``timeout_s`` after it started counts in ``reward_timeouts`` and is abandoned: Python
cannot stop a thread, so a reward function that never returns keeps its (daemon) thread until the
process exits. Code rewards bound their own runs (the sandbox kills the program), so their threads
come back.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from gspo_mcore.rewards import registry

logger = logging.getLogger(__name__)
_LOGGED_ERRORS = 5


@dataclass(frozen=True, kw_only=True)
class RewardRunnerConfig:
    reward: str = "math"
    """Reward used for a sample whose metadata names none: a registered name or a dotted path."""
    reward_key: str = "reward_fn"
    """Metadata field that names a sample's own reward (mixed datasets)."""
    max_workers: int = 8
    """Reward calls in flight at once."""
    timeout_s: float = 60.0
    """Per-call limit, counted from the call's start; then reward 0 and ``reward_timeouts`` += 1."""

    def __post_init__(self):
        if not self.reward:
            raise ValueError("RewardRunnerConfig.reward must be non-empty")
        if isinstance(self.max_workers, bool) or not isinstance(self.max_workers, int) or self.max_workers < 1:
            raise ValueError(f"RewardRunnerConfig.max_workers must be an int >= 1, got {self.max_workers!r}")
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"RewardRunnerConfig.timeout_s must be a finite number > 0, got {self.timeout_s!r}")


class RewardRunner:
    """``score(responses, metadata) -> list[float]``; ``metrics()`` counts what went wrong."""

    def __init__(self, config: RewardRunnerConfig = RewardRunnerConfig()):
        self.config = config
        self._counts = collections.Counter()
        self._logged = 0

    def score(self, responses: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> list[float]:
        if len(responses) != len(metadata):
            raise ValueError(f"{len(responses)} responses but {len(metadata)} metadata entries")
        n = len(responses)
        rewards = [0.0] * n
        pending = collections.deque(range(n))
        running: dict[int, float] = {}  # index -> start time
        finished: list[tuple[int, float | None, BaseException | None]] = []
        cond = threading.Condition()

        def call(i: int, fn) -> None:
            value, error = None, None
            try:
                value = _as_reward(fn(responses[i], metadata[i]))
            except BaseException as e:  # noqa: BLE001 - any failure of a reward is a counted 0
                error = e
            with cond:
                if i in running:  # else it was abandoned after its timeout
                    del running[i]
                    finished.append((i, value, error))
                    cond.notify()

        with cond:
            while pending or running:
                while pending and len(running) < self.config.max_workers:
                    i = pending.popleft()
                    try:
                        fn = self._resolve(metadata[i])
                    except Exception as e:  # noqa: BLE001 - unknown reward name: counted, reward 0
                        self._error(i, e)
                        continue
                    running[i] = time.monotonic()
                    threading.Thread(target=call, args=(i, fn), name=f"reward-{i}", daemon=True).start()
                if running and not finished:
                    deadline = min(running.values()) + self.config.timeout_s
                    cond.wait(timeout=max(0.0, deadline - time.monotonic()))
                for i, value, error in finished:
                    if error is not None:
                        self._error(i, error)
                    else:
                        rewards[i] = value
                finished.clear()
                now = time.monotonic()
                for i, started in list(running.items()):
                    if now - started >= self.config.timeout_s:
                        del running[i]
                        self._counts["reward_timeouts"] += 1
                        logger.warning("reward call %d timed out after %.1fs; reward 0", i, self.config.timeout_s)
        self._counts["reward_calls"] += n
        return rewards

    def metrics(self, reset: bool = True) -> dict[str, float]:
        """``reward_calls``, ``reward_errors``, ``reward_timeouts`` since the last reset."""
        out = {k: float(self._counts[k]) for k in ("reward_calls", "reward_errors", "reward_timeouts")}
        if reset:
            self._counts.clear()
        return out

    def _resolve(self, meta: Mapping[str, Any]):
        name = meta.get(self.config.reward_key) or self.config.reward
        return registry.get(name)

    def _error(self, i: int, error: BaseException) -> None:
        self._counts["reward_errors"] += 1
        if self._logged < _LOGGED_ERRORS:
            self._logged += 1
            logger.warning("reward call %d failed (reward 0): %s: %s", i, type(error).__name__, error)


def _as_reward(value: Any) -> float:
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
