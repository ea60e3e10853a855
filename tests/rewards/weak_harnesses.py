"""Deliberately weakened test harnesses, for the exploit battery only (never used by the package).

Each exploit in ``test_reward_exploits.py`` must beat one of these (so the battery can fail), and score 0
against the package's harness. ``OLD`` is the assert-style harness the package used before verdicts
moved to the host: it ran the tests in the model's interpreter and trusted lines carrying a nonce held
in that interpreter's memory. ``IN_PROCESS`` is the next one (``weak_in_process_harness.py``): verdicts
judged on the host from probes, but the tests still ran in the model's interpreter, so a test without
probes (one that raises, a bare call, a unittest case) passed on a forged "done".
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

from gspo_mcore.rewards import asserts
from gspo_mcore.rewards.code import CodeRewardConfig, _records
from gspo_mcore.sandbox import run_python

IN_PROCESS = (Path(__file__).parent / "weak_in_process_harness.py").read_text()

OLD = '''
"""Assert-style test harness: a script run inside the sandbox as ``main.py`` (stdlib only).

Reads ``{"nonce", "tests", "test_timeout_s"}`` from stdin, executes ``solution.py`` as module
``solution``, then each test (code that raises on failure) in a copy of the solution's namespace,
and writes ``"<nonce> <index> <0|1>"`` per test to its original stdout, which the caller trusts only
with the nonce. The solution's own prints go to /dev/null; ``SystemExit`` and ``os._exit`` in the
solution end the run without verdicts (a failure, never a pass).
"""

import json
import os
import signal
import sys
import traceback


class _TestTimeout(BaseException):
    pass


def _on_alarm(signum, frame):
    raise _TestTimeout()


def main():
    payload = json.loads(sys.stdin.buffer.read())
    nonce, tests, limit = payload["nonce"], payload["tests"], payload.get("test_timeout_s")
    del payload
    out = os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    sys.stdin = open(os.devnull)
    verdict = lambda i, ok: os.write(out, f"{nonce} {i} {int(ok)}\\n".encode())  # noqa: E731
    with open("solution.py", encoding="utf-8") as f:
        source = f.read()
    namespace = {"__name__": "solution", "__file__": "solution.py", "__builtins__": __builtins__}
    try:
        exec(compile(source, "solution.py", "exec"), namespace)
    except BaseException:  # noqa: BLE001 - the solution itself failed: no test passes
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    signal.signal(signal.SIGALRM, _on_alarm)
    for i, test in enumerate(tests):
        ok = False
        try:
            if limit:
                signal.setitimer(signal.ITIMER_REAL, limit)
            exec(compile(test, f"<test {i}>", "exec"), dict(namespace))
            ok = True
        except BaseException:  # noqa: BLE001 - a failing, raising, exiting or slow test
            traceback.print_exc(limit=-3)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        verdict(i, ok)
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
'''

EXIT_STATUS_MAIN = """
import runpy, sys
ns = runpy.run_path("solution.py", run_name="solution")
for test in TESTS:
    exec(test, dict(ns))
"""

MARKERS_MAIN = """
import runpy
ns = runpy.run_path("solution.py", run_name="solution")
for i, test in enumerate(TESTS):
    try:
        exec(test, dict(ns))
        print("PASS", i)
    except BaseException:
        print("FAIL", i)
"""

MARKERS_FD_MAIN = """
import os, runpy
out = os.dup(1)
null = os.open(os.devnull, os.O_WRONLY)
os.dup2(null, 1)
ns = runpy.run_path("solution.py", run_name="solution")
for i, test in enumerate(TESTS):
    try:
        exec(test, dict(ns))
        os.write(out, f"PASS {i}\\n".encode())
    except BaseException:
        os.write(out, f"FAIL {i}\\n".encode())
"""


def old(code: str, tests: list[str], config: CodeRewardConfig) -> float:
    """The old in-interpreter runner: verdict lines ``<nonce> <i> 1``; the nonce lives in the sandbox."""
    nonce = secrets.token_hex(16)
    payload = json.dumps({"nonce": nonce, "tests": tests, "test_timeout_s": config.test_timeout_s})
    r = run_python(OLD, stdin=payload.encode(), files={"solution.py": code}, config=config.sandbox)
    passed = set()
    for line in r.stdout.decode(errors="replace").splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == nonce and parts[2] == "1" and parts[1].isdigit():
            passed.add(int(parts[1]))
    return len(passed & set(range(len(tests)))) / len(tests)


def exit_status(code: str, tests: list[str], config: CodeRewardConfig) -> float:
    """All tests in one script after the solution: 1 when it exits 0."""
    main = f"TESTS = {tests!r}\n" + EXIT_STATUS_MAIN
    return float(run_python(main, files={"solution.py": code}, config=config.sandbox).ok)


def _count_markers(main: str, code: str, tests: list[str], config: CodeRewardConfig) -> float:
    r = run_python(f"TESTS = {tests!r}\n" + main, files={"solution.py": code}, config=config.sandbox)
    lines = set(r.stdout.decode(errors="replace").splitlines())
    return sum(f"PASS {i}" in lines for i in range(len(tests))) / len(tests)


def markers(code: str, tests: list[str], config: CodeRewardConfig) -> float:
    """Prints ``PASS i`` on the program's stdout for each passing test."""
    return _count_markers(MARKERS_MAIN, code, tests, config)


def markers_fd(code: str, tests: list[str], config: CodeRewardConfig) -> float:
    """The solution's stdout goes to /dev/null; ``PASS i`` lines go to a saved descriptor."""
    return _count_markers(MARKERS_FD_MAIN, code, tests, config)


def _in_process(code: str, tests: list[str], config: CodeRewardConfig, hide_literals: bool) -> float:
    compiled = [asserts.compile_test(t, hide_literals=hide_literals) for t in tests]
    payload = {"mode": "assert", "tests": [c.source for c in compiled], "test_timeout_s": config.test_timeout_s}
    r = run_python(IN_PROCESS, stdin=json.dumps(payload).encode(), files={"solution.py": code}, config=config.sandbox)
    return sum(asserts.judge(compiled, _records(r))) / len(tests)


def in_process(code: str, tests: list[str], config: CodeRewardConfig) -> float:
    """Host-judged probes with literals hidden, but the tests run in the solution's interpreter."""
    return _in_process(code, tests, config, hide_literals=True)


def both_sides(code: str, tests: list[str], config: CodeRewardConfig) -> float:
    """``in_process``, and the literal expected values are sent into the sandbox too."""
    return _in_process(code, tests, config, hide_literals=False)


WEAK = {
    "old": old,
    "exit_status": exit_status,
    "markers": markers,
    "markers_fd": markers_fd,
    "both_sides": both_sides,
    "in_process": in_process,
}
