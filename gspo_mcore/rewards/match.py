"""Exact-match and regex rewards.

``exact``: the response's final answer (its last ``\\boxed{}`` when it has one, else the whole
response) equals ``metadata["answer"]`` up to whitespace runs (and case, when so configured).
``regex``: ``metadata["pattern"]`` matches the response. Patterns run on the ``regex`` package with a
timeout, so a pathological pattern against model-written text fails instead of hanging a worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping

import regex

from gspo_mcore.rewards.extract import last_boxed


@dataclass(frozen=True, kw_only=True)
class ExactMatchConfig:
    answer_key: str = "answer"
    """Metadata field with the reference answer (a string, a number, or a list of accepted answers)."""
    use_boxed: bool = True
    """Compare the last ``\\boxed{}`` content when the response has one."""
    case_sensitive: bool = True
    """False: compare case-insensitively (``str.casefold``)."""

    def __post_init__(self):
        if not self.answer_key:
            raise ValueError("ExactMatchConfig.answer_key must be non-empty")


@dataclass(frozen=True, kw_only=True)
class RegexMatchConfig:
    pattern_key: str = "pattern"
    """Metadata field with the pattern (or a list of patterns: reward = fraction that match)."""
    patterns: tuple[str, ...] = ()
    """Fixed patterns for every sample (e.g. a format reward); empty: read ``metadata[pattern_key]``."""
    mode: Literal["search", "fullmatch"] = "search"
    """``search``: anywhere in the response; ``fullmatch``: the whole (stripped) response."""
    ignore_case: bool = False
    """Match case-insensitively."""
    timeout_s: float = 1.0
    """Per-pattern matching time limit; exceeding it raises (the runner counts an error, reward 0)."""

    def __post_init__(self):
        if not self.pattern_key:
            raise ValueError("RegexMatchConfig.pattern_key must be non-empty")
        if self.mode not in ("search", "fullmatch"):
            raise ValueError(f"RegexMatchConfig.mode must be 'search' or 'fullmatch', got {self.mode!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"RegexMatchConfig.timeout_s must be > 0, got {self.timeout_s!r}")
        patterns = (self.patterns,) if isinstance(self.patterns, str) else tuple(self.patterns)
        object.__setattr__(self, "patterns", patterns)
        for p in self.patterns:
            try:
                regex.compile(p)
            except regex.error as e:
                raise ValueError(f"RegexMatchConfig.patterns: {p!r} is not a valid pattern: {e}") from None


def exact_match(response: str, metadata: Mapping[str, Any], *, config: ExactMatchConfig = ExactMatchConfig()) -> float:
    """1.0 when the final answer equals one of the accepted answers, else 0.0."""
    answers = _required(metadata, config.answer_key, "exact")
    answers = answers if isinstance(answers, (list, tuple)) else [answers]
    boxed = last_boxed(response) if config.use_boxed else None
    got = _canon(boxed if boxed is not None else response, config.case_sensitive)
    return float(any(got == _canon(str(a), config.case_sensitive) for a in answers))


def regex_match(response: str, metadata: Mapping[str, Any], *, config: RegexMatchConfig = RegexMatchConfig()) -> float:
    """Fraction of the sample's patterns that match the response (1.0 / 0.0 for a single pattern)."""
    patterns = config.patterns or _required(metadata, config.pattern_key, "regex")
    patterns = patterns if isinstance(patterns, (list, tuple)) else [patterns]
    if not patterns:
        raise ValueError(f"regex reward: metadata[{config.pattern_key!r}] is an empty list")
    flags = regex.IGNORECASE if config.ignore_case else 0
    text = response.strip() if config.mode == "fullmatch" else response
    hits = 0
    for p in patterns:
        match = getattr(regex, config.mode)(p, text, flags=flags, timeout=config.timeout_s)
        hits += match is not None
    return hits / len(patterns)


def _required(metadata: Mapping[str, Any], key: str, reward: str) -> Any:
    if key not in metadata or metadata[key] is None:
        raise KeyError(f"{reward} reward needs metadata[{key!r}]")
    return metadata[key]


def _canon(text: str, case_sensitive: bool) -> str:
    s = " ".join(text.split())
    return s if case_sensitive else s.casefold()
