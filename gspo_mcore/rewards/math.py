"""Math answer equivalence: the last ``\\boxed{...}`` of the response against the sample's answer.

Equivalence is math-verify's (``parse`` + ``verify``: numbers, fractions, expressions, sets,
intervals, ...); when math-verify cannot parse either side, or says "not equal", a normalised string
comparison still accepts answers that are the same text up to LaTeX spacing and wrappers.

math-verify bounds its own work with ``signal.alarm``, which only works in the main thread; off the
main thread (``RewardRunner``'s workers) its timeouts are turned off and the runner's per-call timeout
bounds the call instead.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from dataclasses import dataclass
from typing import Any, Mapping

from gspo_mcore.rewards.extract import last_boxed


@dataclass(frozen=True, kw_only=True)
class MathRewardConfig:
    answer_key: str = "answer"
    """Metadata field holding the reference answer (a string or a number)."""
    require_boxed: bool = True
    """No ``\\boxed{}`` in the response: reward 0. False: math-verify extracts from the whole response."""
    timeout_s: int = 5
    """math-verify's own timeout per parse / comparison (main thread only)."""

    def __post_init__(self):
        if not self.answer_key:
            raise ValueError("MathRewardConfig.answer_key must be non-empty")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int) or self.timeout_s < 1:
            raise ValueError(f"MathRewardConfig.timeout_s must be an int >= 1, got {self.timeout_s!r}")


def math_reward(response: str, metadata: Mapping[str, Any], *, config: MathRewardConfig = MathRewardConfig()) -> float:
    """1.0 when the response's final answer equals ``metadata[answer_key]``, else 0.0."""
    if config.answer_key not in metadata or metadata[config.answer_key] is None:
        raise KeyError(f"math reward needs metadata[{config.answer_key!r}] (the reference answer)")
    gold = str(metadata[config.answer_key]).strip()
    gold = last_boxed(gold) or gold
    pred = last_boxed(response)
    if pred is None and config.require_boxed:
        return 0.0
    return float(answers_equivalent(gold, pred, response=response, timeout_s=config.timeout_s))


def answers_equivalent(gold: str, pred: str | None, *, response: str = "", timeout_s: int = 5) -> bool:
    """``pred`` (a boxed answer's content; None: extract from ``response``) equals ``gold``."""
    if pred is not None and normalise(pred) == normalise(gold) and normalise(gold):
        return True
    try:
        from math_verify import parse, verify
    except ImportError:  # pragma: no cover - math-verify is a requirement
        return False
    timeout = timeout_s if threading.current_thread() is threading.main_thread() else None
    if timeout is None:
        _quiet_timeout_warning()
    gold_parsed = parse(gold if "$" in gold else f"${gold}$", parsing_timeout=timeout)
    pred_parsed = parse(f"\\boxed{{{pred}}}" if pred is not None else response, parsing_timeout=timeout)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))


class _DropTimeoutDisabled(logging.Filter):
    """math-verify warns once that its timeout is off; off the main thread the runner's timeout holds."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


@functools.lru_cache(maxsize=None)
def _quiet_timeout_warning() -> None:
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_DropTimeoutDisabled())


_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox)\{([^{}]*)\}")
_DROP = re.compile(r"\\left|\\right|\\[,;:! ]|\\displaystyle|\s+")


def normalise(answer: str) -> str:
    """Answer text up to spacing, ``$``, ``\\left``/``\\right``, ``\\text{}``, ``\\dfrac``, a final period, case."""
    s = answer.strip().strip("$").strip()
    for _ in range(3):
        s = _WRAPPERS.sub(r"\1", s)
    s = _DROP.sub("", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return s.rstrip(".").lower()
