"""Reward registry: a name, or a user function's dotted path, to a reward function.

A reward function is ``fn(response: str, metadata: Mapping[str, Any]) -> float``: the model's response
text and the sample's metadata (the dataset row's extra fields, e.g. ``answer`` or ``tests``). Built-in
rewards return a value in ``[0, 1]`` (partial credit allowed); a user function may return any finite
number (bools count as 0/1).

A reward function may also return a :class:`TokenRewards`: its sequence reward plus one shaping term per
response token ``d_i,t``. The runner gives every function the response's token ids in
``metadata["response_ids"]`` (a tuple of ints) whenever its caller knows them (``RewardRunner.score_tokens``:
the trainer and the evaluator), so the terms can be aligned with the tokens, and checks the length; the
trainer adds the terms, weighted like the reward, to the sample's group-normalised advantage (``A_i + d_i,t``,
used by ``loss.variant: gspo_token``).

Built-ins (imported on first use): ``math``, ``exact``, ``regex``, ``code``. User functions: ``register``
them, or name them by dotted path: ``"pkg.mod:fn"`` (attribute path after the colon may be dotted) or
``"pkg.mod.fn"``.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence


@dataclass(frozen=True)
class TokenRewards:
    """What a reward function returns to shape each response token too (see the module docstring)."""

    reward: float
    """The sequence reward (the group normalisation takes the advantage from it, as from a plain float)."""
    per_token: Sequence[float]
    """One finite term per response token (``len(metadata["response_ids"])``), added to that token's
    advantage after the normalisation (not normalised)."""


RESPONSE_IDS_KEY = "response_ids"
"""The metadata key under which a reward function sees the response's token ids."""

RewardFn = Callable[[str, Mapping[str, Any]], "float | TokenRewards"]

_BUILTINS = {
    "math": "gspo_mcore.rewards.math:math_reward",
    "exact": "gspo_mcore.rewards.match:exact_match",
    "regex": "gspo_mcore.rewards.match:regex_match",
    "code": "gspo_mcore.rewards.code:code_reward",
}
_REGISTRY: dict[str, RewardFn] = {}
_LOCK = threading.Lock()


def register(name: str, fn: RewardFn | None = None, *, overwrite: bool = False):
    """Register ``fn`` under ``name``; without ``fn``, a decorator."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"reward name must be a non-empty string without ':', got {name!r}")

    def add(f: RewardFn) -> RewardFn:
        if not callable(f):
            raise TypeError(f"reward {name!r} must be callable, got {type(f).__name__}")
        with _LOCK:
            if not overwrite and (name in _REGISTRY or name in _BUILTINS):
                raise ValueError(f"reward {name!r} is already registered (pass overwrite=True to replace it)")
            _REGISTRY[name] = f
        return f

    return add if fn is None else add(fn)


def unregister(name: str) -> None:
    with _LOCK:
        _REGISTRY.pop(name, None)


def get(name: str) -> RewardFn:
    """The reward function registered as ``name``, a built-in, or the function at a dotted path."""
    with _LOCK:
        fn = _REGISTRY.get(name)
    if fn is not None:
        return fn
    if name in _BUILTINS:
        fn = load_dotted(_BUILTINS[name])
        with _LOCK:
            _REGISTRY.setdefault(name, fn)
        return fn
    if "." in name or ":" in name:
        return load_dotted(name)
    raise KeyError(f"unknown reward {name!r}; registered: {names()} (or give a dotted path 'pkg.mod:fn')")


def names() -> list[str]:
    with _LOCK:
        return sorted(set(_REGISTRY) | set(_BUILTINS))


def load_dotted(path: str) -> RewardFn:
    """Import ``"pkg.mod:attr.path"`` or ``"pkg.mod.fn"`` and return the callable."""
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
    else:
        module_name, _, attr_path = path.rpartition(".")
    if not module_name or not attr_path:
        raise ValueError(f"reward path must look like 'pkg.mod:fn' or 'pkg.mod.fn', got {path!r}")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"reward {path!r}: cannot import module {module_name!r}: {e}") from e
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise AttributeError(f"reward {path!r}: {module_name!r} has no attribute {attr_path!r}") from None
    if not callable(obj):
        raise TypeError(f"reward {path!r} is not callable ({type(obj).__name__})")
    return obj
