# The package's assert-style harness before the test process was split from the solution (c1cf151): the
# solution runs in the interpreter that runs the tests, so it can forge "done". For the exploit battery only.
"""Test harness: a script run inside the sandbox as ``main.py`` (stdlib only). It decides nothing.

It reads ``{"mode", ...}`` from stdin, runs ``solution.py`` (the model's code) as module ``solution``,
then reports, one JSON object per line on its original stdout, the plain-data values the host needs;
the host (``code.py``, ``asserts.py``) compares them with expected values it never sends here:

- ``mode == "call"`` (``fn_name``, ``inputs``): calls ``fn_name(*args)`` (or ``Solution().fn_name``) for
  each input and reports ``{"c": k, "v": value}`` (``{"c": k, "bad": why}`` when it is not plain data).
- ``mode == "assert"`` (``tests``): runs each rewritten test (``asserts.compile_test``) in a copy of the
  solution's namespace; its probes report ``{"i": test, "s": site, "v": [values]}``; a test that ends
  reports ``{"done": i}``.

The solution's own output goes to /dev/null. It runs in this interpreter and can tamper with anything
here, this script included: that is why nothing here is trusted beyond the values it reports, which
the model could have computed (or forged) anyway. Values are encoded by exact type (see ``plain.py``).
"""

import json
import math
import os
import signal
import sys
import traceback

_MAX_DEPTH = 64


class _TestTimeout(BaseException):
    pass


class _NotPlain(Exception):
    pass


def _on_alarm(signum, frame):
    raise _TestTimeout()


def _enc(x, depth=0):
    if depth > _MAX_DEPTH:
        raise _NotPlain("nested too deeply")
    t = type(x)
    if x is None or t is bool or t is str or t is int:
        return x
    if t is float:
        return x if math.isfinite(x) else {"$": "float", "v": repr(x)}
    if t is list:
        return [_enc(v, depth + 1) for v in x]
    if t is tuple:
        return {"$": "tuple", "v": [_enc(v, depth + 1) for v in x]}
    if t is set or t is frozenset:
        return {"$": t.__name__, "v": [_enc(v, depth + 1) for v in x]}
    if t is dict:
        return {"$": "dict", "v": [[_enc(k, depth + 1), _enc(v, depth + 1)] for k, v in x.items()]}
    if t is bytes:
        return {"$": "bytes", "v": x.hex()}
    raise _NotPlain(f"{t.__module__}.{t.__qualname__} is not plain data")


def main():
    payload = json.loads(sys.stdin.buffer.read())
    out = os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    sys.stdin = open(os.devnull)

    def emit(obj):
        os.write(out, (json.dumps(obj) + "\n").encode())

    limit = payload.get("test_timeout_s")
    with open("solution.py", encoding="utf-8") as f:
        source = f.read()
    namespace = {"__name__": "solution", "__file__": "solution.py", "__builtins__": __builtins__}
    try:
        exec(compile(source, "solution.py", "exec"), namespace)
    except BaseException:  # noqa: BLE001 - the solution itself failed: nothing to report
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    signal.signal(signal.SIGALRM, _on_alarm)
    if payload["mode"] == "call":
        _call_cases(payload, namespace, limit, emit)
    else:
        _assert_tests(payload, namespace, limit, emit)
    sys.stderr.flush()
    os._exit(0)


def _timed(limit, fn, *args):
    try:
        if limit:
            signal.setitimer(signal.ITIMER_REAL, limit)
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _call_cases(payload, namespace, limit, emit):
    name = payload["fn_name"]
    fn = namespace.get(name)
    if fn is None and isinstance(namespace.get("Solution"), type):  # LeetCode style
        fn = getattr(namespace["Solution"](), name, None)
    if not callable(fn):
        sys.stderr.write(f"the solution defines no function {name!r}\n")
        return
    for k, args in enumerate(payload["inputs"]):
        try:
            value = _timed(limit, fn, *args)
            emit({"c": k, "v": _enc(value)})
        except _NotPlain as e:
            emit({"c": k, "bad": str(e)})
        except BaseException:  # noqa: BLE001 - a raising, exiting or slow call reports nothing
            traceback.print_exc(limit=-3)


def _assert_tests(payload, namespace, limit, emit):
    for i, test in enumerate(payload["tests"]):

        def probe(site, values, i=i):
            try:
                encoded = [_enc(v) for v in values]
            except _NotPlain as e:
                emit({"i": i, "s": site, "bad": str(e)})
                raise AssertionError(str(e)) from None
            emit({"i": i, "s": site, "v": encoded})

        ns = dict(namespace)
        ns["__gspo_probe__"] = probe
        try:
            _timed(limit, exec, compile(test, f"<test {i}>", "exec"), ns)
            emit({"done": i})
        except BaseException:  # noqa: BLE001 - a raising, exiting or slow test is not done
            traceback.print_exc(limit=-3)


if __name__ == "__main__":
    main()
