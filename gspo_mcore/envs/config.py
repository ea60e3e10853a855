"""An episode's limits, and loading the environment class a run names (``rollout.env``)."""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gspo_mcore.envs.tools import load_object


@dataclass(frozen=True, kw_only=True)
class EpisodeConfig:
    """Limits of a multi-turn episode (``rollout.episode``); a policy turn's own limit is
    ``rollout.sampling.max_new_tokens``."""

    max_turns: int = 4
    """Policy turns per episode at most; an episode still going after its last turn ends as ``max_turns``."""
    max_total_tokens: int = 1024
    """Prompt plus every turn (policy and environment) at most. A policy turn is cut to fit; an observation
    that would not leave room for one more policy token ends the episode as ``max_total_tokens``."""
    step_timeout_s: float = 30.0
    """Wall-clock seconds one ``env.step`` (or ``reset``) may take; past it the episode ends as an error
    (counted per cause; see ``reward.max_error_fraction``)."""
    tool_format: Literal["auto", "template", "fallback"] = "auto"
    """How tool schemas and results are rendered: the chat template's own tool format when it takes
    ``tools`` (``auto``), always (``template``: refuse a template without), or the documented fallback."""

    def __post_init__(self):
        for name in ("max_turns", "max_total_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"EpisodeConfig.{name} must be an integer >= 1, got {v!r}")
        if not (isinstance(self.step_timeout_s, (int, float)) and math.isfinite(self.step_timeout_s)):
            raise ValueError(f"EpisodeConfig.step_timeout_s must be a finite number, got {self.step_timeout_s!r}")
        if self.step_timeout_s <= 0:
            raise ValueError(f"EpisodeConfig.step_timeout_s must be > 0, got {self.step_timeout_s}")
        if self.tool_format not in ("auto", "template", "fallback"):
            raise ValueError(f"EpisodeConfig.tool_format must be auto, template or fallback, got {self.tool_format!r}")


def load_env(spec: str, kwargs: Mapping[str, Any] | None = None, *, key: str = "rollout.env"):
    """Import ``"pkg.module:Class"``, check it has ``reset(row)`` and ``step(state, action)``, and build it
    with ``kwargs``. Every failure is a ``ValueError`` naming ``key`` (at start-up, before any model)."""
    cls = load_object(spec, key)
    for name, arity in (("reset", 1), ("step", 2)):
        fn = getattr(cls, name, None)
        if not callable(fn):
            raise ValueError(
                f"{key}: {spec} has no method {name}(); an environment needs reset(row) and step(state, action)"
            )
        try:
            params = [
                p
                for p in inspect.signature(fn).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self"
            ]
        except (TypeError, ValueError):
            continue
        if len(params) < arity:
            raise ValueError(f"{key}: {spec}.{name}() takes {len(params)} argument(s), expected {arity}")
    try:
        return cls(**dict(kwargs or {}))
    except Exception as e:  # noqa: BLE001 - the constructor's own error, named
        raise ValueError(f"{key}: {spec}(**{key}_kwargs) failed: {type(e).__name__}: {e}") from e
