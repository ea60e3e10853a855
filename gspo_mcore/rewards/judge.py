"""The host's verdict on what a sandboxed harness reported, inline or in a child process on a CPU budget.

The judge (``plain.decode_line`` / ``decode`` / ``strict_equal``, ``asserts.judge``) is total and linear
in the report's size, but it is Python: a hostile report near the sandbox's output cap (1 MiB) costs
about 0.4 s of CPU with the GIL held, and the reward calls run on threads of the trainer's process. So
``verdicts`` judges a report of at most ``inline_bytes`` on the calling thread (a few ms) and a larger
one in a short-lived child interpreter (``python -I -S``, no torch import: the child loads only this
module, ``asserts`` and ``plain``) while the calling thread waits without the GIL. The child runs under
a CPU budget: ``ITIMER_PROF`` kills it after ``cpu_budget_s`` CPU seconds of judging (``RLIMIT_CPU``
is the backstop), and a wall-clock limit catches a child that does not run at all. A child that is
killed, fails or answers anything but the verdicts gives ``None``: the caller scores 0 and counts it.

The child receives the report and the expected values from the host (pickle, host to child only) and
answers one JSON list of booleans; nothing the model wrote is unpickled on the host.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping

from gspo_mcore.rewards import asserts
from gspo_mcore.rewards.plain import NotPlain, decode, decode_line, strict_equal

_ROOT = str(Path(__file__).resolve().parents[2])
_ENV = ("PATH", "LD_LIBRARY_PATH")
"""The only environment the child gets (``-I`` ignores the ``PYTHON*`` variables anyway)."""

_CHILD = r"""
import resource, signal, sys, types
budget = float(sys.argv[2])
hard = int(budget) + 3
resource.setrlimit(resource.RLIMIT_CPU, (hard - 1, hard))
for name in ("gspo_mcore", "gspo_mcore.rewards"):  # the packages without their __init__ (torch)
    m = types.ModuleType(name)
    m.__path__ = [sys.argv[1] + "/" + name.replace(".", "/")]
    sys.modules[name] = m
import json, pickle
from gspo_mcore.rewards import judge
payload = sys.stdin.buffer.read()
signal.setitimer(signal.ITIMER_PROF, budget)  # SIGPROF's default action ends the process
kind, report, expected, tol = pickle.loads(payload)
out = judge.judge_calls(report, expected, tol) if kind == "call" else judge.judge_asserts(report, expected)
sys.stdout.write(json.dumps([bool(x) for x in out]))
"""


def records(stdout: bytes) -> list[dict]:
    """The JSON objects among the report's lines (other lines are noise and ignored). Linear."""
    out = []
    for line in stdout.decode(errors="replace").splitlines():
        obj = decode_line(line)
        if type(obj) is dict:
            out.append(obj)
    return out


def call_ok(record: Mapping[str, Any], want: Any, tol: float | None) -> bool:
    """Total: a malformed report, a value that is not plain data, or one that cannot be compared is a fail."""
    if set(record) != {"c", "v"}:
        return False  # "not plain data", or malformed
    try:
        got = decode(record["v"])
        if strict_equal(got, want, float_tolerance=tol):
            return True
        return type(want) is list and len(want) == 1 and strict_equal(got, want[0], float_tolerance=tol)
    except (NotPlain, ArithmeticError, RecursionError, TypeError, ValueError, MemoryError):
        return False


def judge_calls(stdout: bytes, outputs: list, tol: float | None) -> list[bool]:
    """Per call-based case: reported at least once, and every report of it equals ``outputs[k]``."""
    results: dict[int, list] = {}
    for r in records(stdout):
        k = r.get("c")
        if type(k) is int and 0 <= k < len(outputs):
            results.setdefault(k, []).append(r)
    return [bool(results.get(k)) and all(call_ok(r, want, tol) for r in results[k]) for k, want in enumerate(outputs)]


def judge_asserts(stdout: bytes, tests: list[asserts.CompiledTest]) -> list[bool]:
    """Per assert-style test: passed (``asserts.judge`` on the report's records)."""
    return asserts.judge(tests, records(stdout))


def verdicts(
    kind: str, stdout: bytes, expected: Any, tol: float | None, *, inline_bytes: int, cpu_budget_s: float
) -> list[bool] | None:
    """``judge_calls`` (kind ``"call"``) or ``judge_asserts`` (``"assert"``) of a report: inline when it
    has at most ``inline_bytes`` bytes, else in a child on ``cpu_budget_s`` CPU seconds; None when the
    child ran past its budget, crashed or answered nonsense."""
    if kind not in ("call", "assert"):
        raise ValueError(f"judge kind must be 'call' or 'assert', got {kind!r}")
    if len(stdout) <= inline_bytes:
        return judge_calls(stdout, expected, tol) if kind == "call" else judge_asserts(stdout, expected)
    return _in_child(kind, stdout, expected, tol, cpu_budget_s)


def _in_child(kind: str, stdout: bytes, expected: Any, tol: float | None, cpu_budget_s: float) -> list[bool] | None:
    payload = pickle.dumps((kind, stdout, expected, tol), protocol=pickle.HIGHEST_PROTOCOL)
    try:
        proc = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _CHILD, _ROOT, repr(float(cpu_budget_s))],
            input=payload,
            capture_output=True,
            env={k: os.environ[k] for k in _ENV if k in os.environ},
            timeout=wall_limit_s(cpu_budget_s),
        )
    except (subprocess.TimeoutExpired, OSError):
        return None
    if proc.returncode != 0:
        return None
    try:
        out = json.loads(proc.stdout)
    except ValueError:
        return None
    n = len(expected)
    if type(out) is not list or len(out) != n or any(type(x) is not bool for x in out):
        return None
    return out


def wall_limit_s(cpu_budget_s: float) -> float:
    """The child's wall-clock limit: room for its start and a loaded machine, far above the CPU budget."""
    return 10.0 + 4 * math.ceil(cpu_budget_s)
