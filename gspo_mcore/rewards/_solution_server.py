"""The solution process of assert-style tests (stdlib only; run in the sandbox, never by the package).

The test harness (``_harness.py``, the test process) starts it with the requests on fd 3 and the replies
on fd 4, standard input and output on /dev/null. It runs ``solution.py`` (the model's code), replies
``{"names": ...}`` (each public name: ``"call"`` for a callable, ``{"module": name}`` for a module,
else ``{"v": its plain value}``), then serves one
request at a time: ``call`` / ``getattr`` / ``iter`` / ``next`` / ``len`` / ``getitem`` / ``contains``
on a name or a handle. A reply is ``{"v": value}`` (plain data, or a handle for any other object),
``{"raise": type name, "msg": text}``, plus ``"after"``: the new value of each list / dict / set argument
(so in-place changes reach the test). Nothing here is trusted: the model's code can rewrite all of it;
the test process only takes plain values from it.
"""

import os
import sys
import traceback

from _wire import NotPlain, Reader, dec, enc, send

_objects = {}


def _handle(obj):
    n = len(_objects) + 1
    _objects[n] = obj
    return n


def _value(x):
    return enc(x, handles=_handle)


def _target(ref, namespace):
    return namespace[ref[1]] if ref[0] == "name" else _objects[ref[1]]


def _serve(req, namespace):
    target = _target(req["ref"], namespace)
    op = req["op"]
    args = dec(req.get("args", []), _objects.__getitem__)
    if op == "call":
        kwargs = dec(req.get("kwargs", {"$": "dict", "v": []}), _objects.__getitem__)
        result = target(*args, **kwargs)
        after = {str(i): _value(a) for i, a in enumerate(args) if type(a) in (list, dict, set)}
        return {"v": _value(result), "after": after}
    if op == "getattr":
        return {"v": _value(getattr(target, args[0]))}
    if op == "iter":
        return {"v": _value(iter(target))}
    if op == "next":
        return {"v": _value(next(target))}
    if op == "len":
        return {"v": _value(len(target))}
    if op == "getitem":
        return {"v": _value(target[args[0]])}
    if op == "contains":
        return {"v": _value(args[0] in target)}
    raise ValueError(f"unknown request {op!r}")


def main():
    requests, replies = Reader(3), 4
    namespace = {"__name__": "solution", "__file__": "solution.py", "__builtins__": __builtins__}
    me = os.getpid()  # a child the solution forks must not answer too: it leaves where it would
    try:
        with open("solution.py", encoding="utf-8") as f:
            exec(compile(f.read(), "solution.py", "exec"), namespace)
    except BaseException:  # noqa: BLE001 - the solution itself failed: every test fails
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    if os.getpid() != me:
        os._exit(0)
    names = {}
    for name, value in list(namespace.items()):
        if name.startswith("__"):
            continue
        if type(value).__name__ == "module":
            names[name] = {"module": value.__name__}
        elif callable(value):
            names[name] = "call"
        else:
            try:
                names[name] = {"v": enc(value)}
            except (NotPlain, RecursionError):
                pass
    send(replies, {"names": names})
    while (req := requests.recv()) is not None:
        try:
            reply = _serve(req, namespace)
        except BaseException as e:  # noqa: BLE001 - reported to the test, which raises it there
            reply = {"raise": type(e).__name__, "msg": str(e)[:1000]}
        if os.getpid() != me:
            os._exit(0)
        send(replies, reply)
    os._exit(0)


if __name__ == "__main__":
    main()
