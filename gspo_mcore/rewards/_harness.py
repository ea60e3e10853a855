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
    verdict = lambda i, ok: os.write(out, f"{nonce} {i} {int(ok)}\n".encode())  # noqa: E731
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
