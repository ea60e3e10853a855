"""Plain data that crosses from the sandboxed program to the host, and the host's comparisons of it.

The sandboxed harness (``_harness.py``) writes each value it reports as JSON in a tagged form that keeps
Python's builtin types apart: JSON ``null``/``true``/``false``, numbers, strings and lists stand for
themselves; every JSON object is a tag ``{"$": kind, "v": ...}`` for ``tuple``, ``set``, ``frozenset``,
``dict`` (a list of ``[key, value]`` pairs), ``bytes`` (hex) and non-finite ``float`` (its repr). Only
values whose type is exactly one of those builtins are encoded (an ``int`` subclass is not an ``int``);
anything else is reported as "not plain data", which fails the check.

``decode`` rebuilds builtin objects on the host, so the comparisons below run on builtin types only:
no object the model wrote takes part in a verdict.
"""

from __future__ import annotations

import json
import math
import operator
from typing import Any

MAX_DEPTH = 64
"""Nesting deeper than this is not plain data (the harness refuses it too)."""


class NotPlain(ValueError):
    """A reported value is not (a well-formed encoding of) plain data."""


def decode(obj: Any, depth: int = 0) -> Any:
    """The builtin value an encoding stands for; ``NotPlain`` for anything malformed."""
    if depth > MAX_DEPTH:
        raise NotPlain("nested too deeply")
    t = type(obj)
    if obj is None or t in (bool, int, float, str):
        return obj
    if t is list:
        return [decode(x, depth + 1) for x in obj]
    if t is not dict or set(obj) != {"$", "v"}:
        raise NotPlain(f"unexpected JSON {t.__name__}")
    kind, v = obj["$"], obj["v"]
    try:
        if kind == "tuple" and type(v) is list:
            return tuple(decode(x, depth + 1) for x in v)
        if kind in ("set", "frozenset") and type(v) is list:
            items = [decode(x, depth + 1) for x in v]
            return set(items) if kind == "set" else frozenset(items)
        if kind == "dict" and type(v) is list:
            pairs = [(decode(p[0], depth + 1), decode(p[1], depth + 1)) for p in v if type(p) is list and len(p) == 2]
            if len(pairs) != len(v):
                raise NotPlain("malformed dict pairs")
            return dict(pairs)
        if kind == "bytes" and type(v) is str:
            return bytes.fromhex(v)
        if kind == "float" and v in ("nan", "inf", "-inf"):
            return float(v)
    except TypeError as e:  # an unhashable set element or dict key
        raise NotPlain(str(e)) from None
    raise NotPlain(f"unknown tag {kind!r}")


def decode_line(line: str) -> Any:
    """One JSON line of the harness's channel, or None when it is not one (noise is ignored)."""
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return None


def strict_equal(got: Any, want: Any, *, float_tolerance: float | None = None, depth: int = 0) -> bool:
    """Type-strict equality of a decoded result with an expected JSON value (call-based tests).

    Types must match exactly (``True`` is not ``1``, ``1`` is not ``1.0``), except that a tuple result
    matches an expected list (JSON has no tuples) and, with ``float_tolerance``, an int or float result
    matches an expected number within ``math.isclose(rel_tol=abs_tol=float_tolerance)``.
    """
    if depth > MAX_DEPTH:
        return False
    tg, tw = type(got), type(want)
    if tg is tuple and tw is list:
        got, tg = list(got), list
    if float_tolerance is not None and tg in (int, float) and tw in (int, float):
        if tg is int and tw is int:
            return got == want
        return math.isclose(got, want, rel_tol=float_tolerance, abs_tol=float_tolerance) or got == want
    if tg is not tw:
        return False
    if tg is list:
        return len(got) == len(want) and all(
            strict_equal(g, w, float_tolerance=float_tolerance, depth=depth + 1) for g, w in zip(got, want)
        )
    if tg is dict:
        return got.keys() == want.keys() and all(
            strict_equal(got[k], want[k], float_tolerance=float_tolerance, depth=depth + 1) for k in got
        )
    if tg is float and math.isnan(got) and math.isnan(want):
        return True
    return got == want


def _is(a: Any, b: Any) -> bool:
    """``a is b`` for decoded values: identity is meaningful for None and the bools only."""
    if a is None or b is None or type(a) is bool or type(b) is bool:
        return type(a) is type(b) and a == b
    return type(a) is type(b) and a == b


COMPARE = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
    "in": lambda a, b: a in b,
    "not in": lambda a, b: a not in b,
    "is": _is,
    "is not": lambda a, b: not _is(a, b),
}
"""Python's comparison operators, applied on the host to decoded (builtin) values only."""
