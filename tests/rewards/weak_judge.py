"""A deliberately naive host judge of call-based tests, for the exploit battery only (never used by the package).

It runs the package's harness in the package's sandbox, like ``code.run_call_tests``, but judges the
report the way a first version would: ``json.loads`` on each line, the tagged values rebuilt directly
(``bytes.fromhex``, ``set(...)``), numbers compared with ``math.isclose``. Nothing here is total: a hostile
report makes it raise, overflow, or spend n**2 / 2 comparisons on a set whose members share one hash.
``rewards/plain.py`` is the package's answer to each.

Also a script: ``python weak_judge.py naive|package OUTPUTS_JSON TOLERANCE TREE < report`` judges a report
read from stdin with 2 CPU seconds to do it, with this judge or the package's (from the source tree TREE).
"""

from __future__ import annotations

import json
import math
import sys


def naive_decode(obj):
    if isinstance(obj, list):
        return [naive_decode(x) for x in obj]
    if isinstance(obj, dict):
        kind, v = obj["$"], obj["v"]
        if kind == "tuple":
            return tuple(naive_decode(x) for x in v)
        if kind == "set":
            return set(naive_decode(x) for x in v)
        if kind == "frozenset":
            return frozenset(naive_decode(x) for x in v)
        if kind == "dict":
            return {naive_decode(k): naive_decode(x) for k, x in v}
        if kind == "bytes":
            return bytes.fromhex(v)
        if kind == "float":
            return float(v)
    return obj


def naive_judge(report: bytes, outputs: list, tolerance: float | None) -> float:
    """Fraction of cases whose reported value equals the expected output (raises on a hostile report)."""
    got = {}
    for line in report.decode(errors="replace").splitlines():
        if line.startswith("{"):
            obj = json.loads(line)
            if "c" in obj and "v" in obj:
                got[obj["c"]] = naive_decode(obj["v"])
    passed = 0
    for k, want in enumerate(outputs):
        if k not in got:
            continue
        if tolerance is not None and isinstance(want, (int, float)):
            passed += math.isclose(got[k], want, rel_tol=tolerance, abs_tol=tolerance)
        else:
            passed += got[k] == want
    return passed / len(outputs)


def harness_report(code: str, fn_name: str, inputs: list, config) -> bytes:
    """What the package's harness reports, in the package's sandbox, for ``code`` on these inputs."""
    from gspo_mcore.rewards.code import _run_harness

    payload = {"mode": "call", "fn_name": fn_name, "inputs": inputs, "test_timeout_s": config.test_timeout_s}
    return _run_harness(code, payload, config).stdout


def naive_call_reward(response: str, metadata: dict, *, config) -> float:
    """``code_reward`` for call-based tests with the naive judge (a reward function for the runner)."""
    from gspo_mcore.rewards.extract import last_code_block

    tests = metadata["tests"]
    report = harness_report(last_code_block(response), tests["fn_name"], tests["inputs"], config)
    return naive_judge(report, tests["outputs"], config.float_tolerance)


def package_judge(report: bytes, outputs: list, tolerance: float | None) -> float:
    """The package's judge of the same report (``code.run_call_tests`` after the sandbox ran)."""
    from gspo_mcore.rewards.code import _call_ok, _records

    class Result:
        stdout = report

    got: dict[int, list] = {}
    for r in _records(Result()):
        if type(r.get("c")) is int:
            got.setdefault(r["c"], []).append(r)
    passed = sum(
        bool(got.get(k)) and all(_call_ok(r, want, tolerance) for r in got[k]) for k, want in enumerate(outputs)
    )
    return passed / len(outputs)


if __name__ == "__main__":  # weak_judge.py naive|package OUTPUTS_JSON TOLERANCE TREE < report
    import types

    for name in ("gspo_mcore", "gspo_mcore.rewards"):  # the package's judge alone: no torch, no package __init__
        pkg = types.ModuleType(name)
        pkg.__path__ = [sys.argv[4] + "/" + name.replace(".", "/")]
        sys.modules[name] = pkg
    judge = {"naive": naive_judge, "package": package_judge}[sys.argv[1]]
    tol = None if sys.argv[3] == "none" else float(sys.argv[3])
    if judge is package_judge:
        import gspo_mcore.rewards.code  # noqa: F401 - imported before the clock starts
    report = sys.stdin.buffer.read()
    import resource

    used = resource.getrusage(resource.RUSAGE_SELF)
    limit = int(used.ru_utime + used.ru_stime) + 2  # 2 CPU seconds for judging, whichever judge
    resource.setrlimit(resource.RLIMIT_CPU, (limit, limit + 1))
    print(judge(report, json.loads(sys.argv[2]), tol))
