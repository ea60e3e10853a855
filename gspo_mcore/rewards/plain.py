"""Plain data that crosses from the sandboxed program to the host, and the host's comparisons of it.

The sandboxed harness (``_harness.py``) writes each value it reports as JSON in a tagged form that keeps
Python's builtin types apart: JSON ``null``/``true``/``false``, numbers, strings and lists stand for
themselves; every JSON object is a tag ``{"$": kind, "v": ...}`` for ``tuple``, ``set``, ``frozenset``,
``dict`` (a list of ``[key, value]`` pairs), ``bytes`` (hex) and non-finite ``float`` (its repr). Only
values whose type is exactly one of those builtins are encoded (an ``int`` subclass is not an ``int``);
anything else is reported as "not plain data", which fails the check.

``decode`` rebuilds builtin objects on the host, so the comparisons below run on builtin types only:
no object the model wrote takes part in a verdict.

The host's judge is a total function of what the sandbox reports (the report is hostile):

- ``decode_line`` and ``decode`` never raise anything but ``NotPlain`` (malformed hex, unhashable keys,
  nesting past ``MAX_DEPTH``, an integer literal of more than ``MAX_INT_DIGITS`` digits: "not plain");
- their cost is linear in the report's size: JSON parsing and one pass over the values; a set, frozenset
  or dict is built only when at most ``MAX_SAME_HASH`` of its members share one hash value (Python's
  hash of ints, floats and tuples is not keyed, so a report can make every member collide and turn the
  ``n`` insertions into ``n**2 / 2`` comparisons);
- ``strict_equal`` and ``COMPARE`` never raise for decoded values where Python would overflow (a huge
  int against a float is "not equal").
"""

from __future__ import annotations

import json
import math
import operator
from typing import Any

MAX_DEPTH = 64
"""Nesting deeper than this is not plain data (the harness refuses it too)."""
MAX_INT_DIGITS = 4300
"""Longest integer literal parsed (CPython's default ``int`` string limit, fixed here whatever the host's
``sys.set_int_max_str_digits``): parsing a decimal integer is quadratic in its length."""
MAX_SAME_HASH = 8
"""Members of one reported set / frozenset / dict that may share a hash value (see the module docstring)."""


class NotPlain(ValueError):
    """A reported value is not (a well-formed encoding of) plain data."""


def decode(obj: Any) -> Any:
    """The builtin value an encoding stands for; ``NotPlain`` (and nothing else) for anything malformed."""
    try:
        return _decode(obj, 0)
    except NotPlain:
        raise
    except (ValueError, TypeError, RecursionError, MemoryError, OverflowError) as e:
        raise NotPlain(f"{type(e).__name__}: {e}"[:200]) from None


def _decode(obj: Any, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise NotPlain("nested too deeply")
    t = type(obj)
    if obj is None or t in (bool, int, float, str):
        return obj
    if t is list:
        return [_decode(x, depth + 1) for x in obj]
    if t is not dict or set(obj) != {"$", "v"}:
        raise NotPlain(f"unexpected JSON {t.__name__}")
    kind, v = obj["$"], obj["v"]
    try:
        if kind == "tuple" and type(v) is list:
            return tuple(_decode(x, depth + 1) for x in v)
        if kind in ("set", "frozenset") and type(v) is list:
            items = _few_collisions([_decode(x, depth + 1) for x in v])
            return set(items) if kind == "set" else frozenset(items)
        if kind == "dict" and type(v) is list:
            pairs = [(_decode(p[0], depth + 1), _decode(p[1], depth + 1)) for p in v if type(p) is list and len(p) == 2]
            if len(pairs) != len(v):
                raise NotPlain("malformed dict pairs")
            _few_collisions([k for k, _ in pairs])
            return dict(pairs)
        if kind == "bytes" and type(v) is str:
            return bytes.fromhex(v)
        if kind == "float" and v in ("nan", "inf", "-inf"):
            return float(v)
    except TypeError as e:  # an unhashable set element or dict key
        raise NotPlain(str(e)) from None
    raise NotPlain(f"unknown tag {kind!r}")


def _few_collisions(items: list) -> list:
    """``items``, unless more than ``MAX_SAME_HASH`` of them share a hash (``TypeError``: unhashable)."""
    counts: dict[int, int] = {}
    for x in items:
        h = hash(x)  # distinct hash values are distinct int keys here: no collisions among them
        counts[h] = counts.get(h, 0) + 1
        if counts[h] > MAX_SAME_HASH:
            raise NotPlain(f"more than {MAX_SAME_HASH} members share a hash value")
    return items


def _parse_int(text: str) -> int:
    if len(text) > MAX_INT_DIGITS + 1:  # a sign
        raise ValueError(f"an integer literal of {len(text)} digits")
    return int(text)


def decode_line(line: str) -> Any:
    """One JSON line of the harness's channel, or None when it is not one (noise is ignored). Linear."""
    try:
        return json.loads(line, parse_int=_parse_int)
    except (ValueError, RecursionError, MemoryError):
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
        try:
            return math.isclose(got, want, rel_tol=float_tolerance, abs_tol=float_tolerance) or got == want
        except OverflowError:  # an int too large for a float: no float is within a tolerance of it
            return got == want
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
