"""Plain data on the sandbox's wires (stdlib only; copied next to the harness, never imported by the package).

The tagged JSON form of ``plain.py``: ``None``, ``bool``, ``int``, ``str``, finite ``float`` and ``list``
stand for themselves; ``{"$": kind, "v": ...}`` for ``tuple``, ``set``, ``frozenset``, ``dict`` (a list of
pairs), ``bytes`` (hex), a non-finite ``float`` (its repr) and, between the test process and the
solution process only, ``handle`` (an object that stays in the solution process, by number).
Only values of exactly those types are encoded: anything else raises ``NotPlain`` (or, where a
``handles`` callback is given, becomes a handle).
"""

import json
import math
import os

MAX_DEPTH = 64


class NotPlain(Exception):
    pass


def enc(x, handles=None, depth=0):
    if depth > MAX_DEPTH:
        raise NotPlain("nested too deeply")
    t = type(x)
    if x is None or t is bool or t is str or t is int:
        return x
    if t is float:
        return x if math.isfinite(x) else {"$": "float", "v": repr(x)}
    if t is list:
        return [enc(v, handles, depth + 1) for v in x]
    if t is tuple:
        return {"$": "tuple", "v": [enc(v, handles, depth + 1) for v in x]}
    if t is set or t is frozenset:
        return {"$": t.__name__, "v": [enc(v, handles, depth + 1) for v in x]}
    if t is dict:
        return {"$": "dict", "v": [[enc(k, handles, depth + 1), enc(v, handles, depth + 1)] for k, v in x.items()]}
    if t is bytes:
        return {"$": "bytes", "v": x.hex()}
    if handles is not None:
        return {"$": "handle", "v": handles(x)}
    raise NotPlain(f"{t.__module__}.{t.__qualname__} is not plain data")


def dec(obj, handle=None, depth=0):
    """The value ``obj`` encodes; ``handle(n)`` gives the object of handle ``n``. Raises on anything else."""
    if depth > MAX_DEPTH:
        raise NotPlain("nested too deeply")
    t = type(obj)
    if obj is None or t in (bool, int, float, str):
        return obj
    if t is list:
        return [dec(x, handle, depth + 1) for x in obj]
    if t is not dict or set(obj) != {"$", "v"}:
        raise NotPlain(f"unexpected {t.__name__}")
    kind, v = obj["$"], obj["v"]
    if kind == "tuple":
        return tuple(dec(x, handle, depth + 1) for x in v)
    if kind in ("set", "frozenset"):
        items = [dec(x, handle, depth + 1) for x in v]
        return set(items) if kind == "set" else frozenset(items)
    if kind == "dict":
        return {dec(k, handle, depth + 1): dec(x, handle, depth + 1) for k, x in v}
    if kind == "bytes":
        return bytes.fromhex(v)
    if kind == "float" and v in ("nan", "inf", "-inf"):
        return float(v)
    if kind == "handle" and handle is not None and type(v) is int:
        return handle(v)
    raise NotPlain(f"unknown tag {kind!r}")


def send(fd, obj):
    data = (json.dumps(obj) + "\n").encode()
    while data:
        data = data[os.write(fd, data) :]


class Reader:
    """Line-delimited JSON from a descriptor (``None`` at end of file)."""

    def __init__(self, fd):
        self.fd, self.buf = fd, b""

    def recv(self):
        while b"\n" not in self.buf:
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)
