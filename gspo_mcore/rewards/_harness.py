"""Test harness: a script run inside the sandbox as ``main.py`` (stdlib only). It decides nothing.

It reads ``{"mode", ...}`` from stdin and reports, one JSON object per line on its original stdout, the
plain-data values the host needs; the host (``code.py``, ``asserts.py``) compares them with expected
values it never sends here:

- ``mode == "call"`` (``fn_name``, ``inputs``): runs ``solution.py`` in this interpreter, calls
  ``fn_name(*args)`` (or ``Solution().fn_name``) for each input and reports ``{"c": k, "v": value}``
  (``{"c": k, "bad": why}`` when it is not plain data). The model's code can tamper with everything
  here; it gains nothing, because the expected outputs are not in the sandbox.
- ``mode == "assert"`` (``tests``): this process is the **test process** and never runs the model's
  code. The solution runs in a process of its own (``_solution_server.py``); its names reach the test
  as proxies that call it over a pipe and return only plain data (any other object stays there, as a
  handle that compares by identity here; an exception there is raised here as the builtin exception of
  that name, else as ``RemoteError``); a module it imported is imported here afresh; a name that is a
  builtin (``abs``, ``sorted``, ``len`` ...) is never taken from it, so it cannot change what a test
  computes around its calls. Each rewritten test (``asserts.compile_test``) runs here: its
  probes report ``{"i": test, "s": site, "v": [values]}``; a test that ends (its code, then any
  ``unittest.TestCase`` and any argument-less ``test*()`` function it defines, all passing; or
  ``sys.exit(0)``, e.g. from ``unittest.main()``) reports ``{"done": i}``.

Why the solution cannot forge "done": this process makes itself non-dumpable before the solution
starts (the solution's uid cannot ptrace it, read its memory or open its descriptors; the system-call
filter also refuses ``ptrace`` and ``process_vm_*``); the report descriptor is not inherited by the
solution process; and nothing this process imports later comes from the work directory, which the
solution can write. The solution can make a test fail (kill this process, stall it), never pass.
"""

import builtins
import ctypes
import importlib
import json
import os
import signal
import sys
import traceback
import types

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [_HERE] + [p for p in sys.path if p and os.path.realpath(p) != os.path.realpath(_HERE)]
from _wire import NotPlain, Reader, dec, enc, send  # noqa: E402 - the only import from the work dir

del sys.path[0]  # the work directory is writable by the solution: never import from it again
_PR_SET_DUMPABLE = 4
_BUILTINS = frozenset(vars(builtins))
_BUILTIN_EXCEPTIONS = {n: c for n, c in vars(builtins).items() if isinstance(c, type) and issubclass(c, Exception)}


class _TestTimeout(BaseException):
    pass


class RemoteError(Exception):
    """An exception of the solution process that is not a builtin one (or the process ended)."""


def _on_alarm(signum, frame):
    raise _TestTimeout()


def main():
    if ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        sys.stderr.write("cannot make the test process non-dumpable\n")
        os._exit(1)
    payload = json.loads(sys.stdin.buffer.read())
    out = os.dup(1)
    os.set_inheritable(out, False)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    sys.stdin = open(os.devnull)

    def emit(obj):
        os.write(out, (json.dumps(obj) + "\n").encode())

    limit = payload.get("test_timeout_s")
    signal.signal(signal.SIGALRM, _on_alarm)
    if payload["mode"] == "call":
        _call_cases(payload, _run_solution_here(), limit, emit)
    else:
        _assert_tests(payload, limit, emit)
    sys.stderr.flush()
    os._exit(0)


def _timed(limit, fn, *args):
    try:
        if limit:
            signal.setitimer(signal.ITIMER_REAL, limit)
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


# ------------------------------------------------------------------------------------------ call-based


def _run_solution_here():
    with open("solution.py", encoding="utf-8") as f:
        source = f.read()
    namespace = {"__name__": "solution", "__file__": "solution.py", "__builtins__": __builtins__}
    try:
        exec(compile(source, "solution.py", "exec"), namespace)
    except BaseException:  # noqa: BLE001 - the solution itself failed: nothing to report
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    return namespace


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
            emit({"c": k, "v": enc(value)})
        except NotPlain as e:
            emit({"c": k, "bad": str(e)})
        except BaseException:  # noqa: BLE001 - a raising, exiting or slow call reports nothing
            traceback.print_exc(limit=-3)


# ---------------------------------------------------------------------------------------- assert-style


class _Solution:
    """The solution process: started on demand, replaced after a test that timed out or broke it."""

    def __init__(self):
        self.pid = None

    def start(self):
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                null = os.open(os.devnull, os.O_RDWR)
                for fd, to in ((null, 0), (null, 1), (req_r, 3), (rep_w, 4)):
                    os.dup2(fd, to)
                os.closerange(5, 1 << 16)  # the report descriptor among them
                os.execv(sys.executable, [sys.executable, "-E", "-s", "-S", "-B", "_solution_server.py"])
            finally:
                os._exit(127)
        os.close(req_r)
        os.close(rep_w)
        self.pid, self.requests, self.replies = pid, req_w, Reader(rep_r)
        hello = self.replies.recv()
        if type(hello) is not dict or type(hello.get("names")) is not dict:
            self.stop()
            raise RemoteError("the solution failed before it defined anything")
        return hello["names"]

    def stop(self):
        if self.pid is None:
            return
        for fd in (self.requests, self.replies.fd):
            os.close(fd)
        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass
        os.waitpid(self.pid, 0)
        self.pid = None

    def ask(self, ref, op, args=(), kwargs=None, originals=()):
        if self.pid is None:
            raise RemoteError("the solution process is gone")
        request = {"ref": ref, "op": op, "args": enc(list(args), _handle_of)}
        if kwargs:
            request["kwargs"] = enc(dict(kwargs), _handle_of)
        send(self.requests, request)
        reply = self.replies.recv()
        if type(reply) is not dict:
            raise RemoteError("the solution process ended")
        if "raise" in reply:
            name, msg = str(reply["raise"]), str(reply.get("msg", ""))
            if name in _BUILTIN_EXCEPTIONS:
                raise _BUILTIN_EXCEPTIONS[name](msg)
            raise RemoteError(f"{name}: {msg}")
        for k, v in (reply.get("after") or {}).items():
            _copy_back(originals[int(k)], dec(v, _Remote))
        return dec(reply["v"], _Remote)


_SOLUTION = _Solution()


def _handle_of(x):
    if type(x) is _Remote and x._ref[0] == "handle":
        return x._ref[1]
    raise NotPlain(f"{type(x).__name__} cannot be passed to the solution (plain data or its own objects only)")


def _copy_back(original, new):
    """In-place changes of a list / dict / set argument, made in the solution process, reach the test."""
    if type(original) is list and type(new) is list:
        original[:] = new
    elif type(original) in (dict, set) and type(new) is type(original):
        original.clear()
        original.update(new)


class _Remote:
    """A name or an object of the solution process. Compares by identity: its own ``__eq__`` is never used."""

    __slots__ = ("_ref",)

    def __init__(self, ref):
        object.__setattr__(self, "_ref", ["handle", ref] if type(ref) is int else ref)

    def __call__(self, *args, **kwargs):
        return _SOLUTION.ask(self._ref, "call", args, kwargs, originals=args)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _SOLUTION.ask(self._ref, "getattr", (name,))

    def __iter__(self):
        return _SOLUTION.ask(self._ref, "iter")

    def __next__(self):
        return _SOLUTION.ask(self._ref, "next")

    def __len__(self):
        n = _SOLUTION.ask(self._ref, "len")
        if type(n) is not int:
            raise TypeError("len() of a solution object is not an int")
        return n

    def __getitem__(self, key):
        return _SOLUTION.ask(self._ref, "getitem", (key,))

    def __contains__(self, item):
        return _SOLUTION.ask(self._ref, "contains", (item,)) is True

    def __repr__(self):
        return f"<solution object {self._ref[1]!r}>"


def _namespace(names):
    """The test's globals: the solution's names as proxies (or plain values), also as module ``solution``."""
    main = types.ModuleType("__main__")
    solution = types.ModuleType("solution")
    for name, what in names.items():
        if type(name) is not str or name in _BUILTINS:  # the test's abs / sorted / len are Python's own
            continue
        if what == "call":
            value = _Remote(["name", name])
        elif type(what) is dict and "v" in what:
            value = dec(what["v"])
        elif type(what) is dict and type(what.get("module")) is str:
            value = importlib.import_module(what["module"])  # its own copy, from the read-only library
        else:
            continue
        setattr(solution, name, value)
        setattr(main, name, value)
    sys.modules["solution"] = solution
    sys.modules["__main__"] = main
    return main.__dict__


def _run_test(code, ns):
    """Run the test's code, then what it defines but does not run; True when it all passed."""
    try:
        exec(code, ns)
    except SystemExit as e:  # e.g. unittest.main(): its status is the test's verdict
        return e.code in (None, 0, False)
    import unittest

    cases = [
        v
        for v in list(ns.values())
        if isinstance(v, type) and issubclass(v, unittest.TestCase) and v.__module__ == "__main__"
    ]
    if cases:
        suite = unittest.TestSuite(unittest.defaultTestLoader.loadTestsFromTestCase(c) for c in cases)
        if not unittest.TextTestRunner(stream=sys.stderr, verbosity=0).run(suite).wasSuccessful():
            return False
    for name, fn in list(ns.items()):
        if name.startswith("test") and type(fn) is types.FunctionType and fn.__code__.co_argcount == 0:
            fn()
    return True


def _assert_tests(payload, limit, emit):
    names = None
    for i, test in enumerate(payload["tests"]):

        def probe(site, values, i=i):
            try:
                encoded = [enc(v) for v in values]
            except NotPlain as e:
                emit({"i": i, "s": site, "bad": str(e)})
                raise AssertionError(str(e)) from None
            emit({"i": i, "s": site, "v": encoded})

        try:
            if _SOLUTION.pid is None:
                names = _timed(limit, _SOLUTION.start)
            ns = _namespace(names)
            ns["__gspo_probe__"] = probe
            if _timed(limit, _run_test, compile(test, f"<test {i}>", "exec"), ns):
                emit({"done": i})
        except BaseException as e:  # noqa: BLE001 - a raising, exiting or slow test is not done
            traceback.print_exc(limit=-3)
            if not isinstance(e, Exception) or isinstance(e, RemoteError):
                _SOLUTION.stop()  # it may be stuck in a call, or gone: a fresh one for the next test
    _SOLUTION.stop()


if __name__ == "__main__":
    main()
