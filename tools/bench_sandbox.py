"""Per-run wall time of the code reward's sandbox: two source trees side by side, interleaved.

Each tree gets one long-lived worker process (``PYTHONPATH=<tree>``, the same interpreter, the same
``nice``), which imports ``gspo_mcore.rewards.code`` once and then scores one response per request with
the tree's default ``CodeRewardConfig()``. The controller alternates the trees (A B A B ...) for every
problem kind, so a machine whose load changes during the measurement treats both alike. Each score is
one sandboxed run (a stdio problem with one case, a call-based problem with three cases in one run, an
assert-style test); the first ``--warmup`` rounds are dropped. Prints the median and the 90th percentile
per tree and kind, in milliseconds, of the wall time and of the CPU time (user + system of the worker and
every process of the run: less sensitive to a loaded machine), and the machine's load before and after.

    python tools/bench_sandbox.py --tree before=/tmp/rw_c1 --tree after=. --runs 20
    python tools/bench_sandbox.py --tree filter=. --tree no-filter=.,seccomp=false --kinds stdio  # one layer

``--judge`` measures instead the host judge's worst case on hostile reports of up to ``max_output_bytes``
(1 MiB), inline and in the child process the code reward uses past ``judge_inline_bytes``: the calling
thread's CPU time (the time it holds the GIL), the child's, the wall time, and the longest stall another
thread of the process sees, with the package found on ``PYTHONPATH``:

    PYTHONPATH=. python tools/bench_sandbox.py --judge

The trees must have the compiled extension (``gspo_mcore/_C*.so``) next to the sources (the package
imports torch, not the extension, for the rewards; copy it in for the same import time anyway). Run as
root to get every sandbox layer (a fresh uid per run, cgroups), as the trainer would on this project's hosts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROBLEMS = {
    "stdio": (
        "a, b = map(int, input().split())\nprint(a + b)\n",
        {"tests": [{"input": "2 3\n", "output": "5\n"}]},
    ),
    "call": (
        "def add(a, b):\n    return a + b\n",
        {"tests": {"fn_name": "add", "inputs": [[1, 2], [2, 2], [-1, 1]], "outputs": [3, 4, 0]}},
    ),
    "assert": (
        "def add(a, b):\n    return a + b\n",
        {"tests": ["assert add(1, 2) == 3\nassert add(2, 2) == 4"]},
    ),
}

WORKER = r"""
import json, os, sys, time
from gspo_mcore.rewards.code import CodeRewardConfig, code_reward
from gspo_mcore.sandbox import SandboxConfig
problems = json.loads(sys.argv[1])
config = CodeRewardConfig(sandbox=SandboxConfig(**json.loads(sys.argv[2])))
print("ready", flush=True)
for line in sys.stdin:
    code, meta = problems[line.strip()]
    c0, t0 = os.times(), time.perf_counter()
    score = code_reward("```python\n" + code + "```", meta, config=config)
    t1, c1 = time.perf_counter(), os.times()
    cpu = sum(c1[:4]) - sum(c0[:4])  # this process and every waited-for descendant: user + system
    print(json.dumps({"ms": (t1 - t0) * 1e3, "cpu_ms": cpu * 1e3, "score": score}), flush=True)
"""


class Worker:
    def __init__(self, tree: str, python: str, sandbox: dict):
        env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
        self.proc = subprocess.Popen(
            [python, "-c", WORKER, json.dumps(PROBLEMS), json.dumps(sandbox)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=os.path.abspath(tree),
            text=True,
        )
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the worker for {tree} did not start")

    def score(self, kind: str) -> tuple[float, float]:
        self.proc.stdin.write(kind + "\n")
        self.proc.stdin.flush()
        out = json.loads(self.proc.stdout.readline())
        if out["score"] != 1.0:
            raise RuntimeError(f"the honest {kind} solution scored {out['score']}")
        return out["ms"], out["cpu_ms"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = int(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


def judge_worst_case(repeat: int = 3) -> None:
    """The host judge on hostile reports the size of the sandbox's output cap, inline and in the child.

    Per report: the inline judge's CPU time on the calling thread (``time.thread_time``: the time it holds
    the GIL), best of ``repeat``; then ``judge.verdicts`` with the default ``CodeRewardConfig`` (a child
    past ``judge_inline_bytes``): the calling thread's CPU time, the child's CPU time and the wall time.
    While each runs, another thread of this process spins and records its longest stall (the wall time
    between two of its loop iterations): what the trainer's other threads see. Then the inline cost of
    reports of ``judge_inline_bytes``, the largest judged inline.
    """
    import threading

    from gspo_mcore.rewards import asserts, judge
    from gspo_mcore.rewards.code import CodeRewardConfig
    from gspo_mcore.sandbox import SandboxConfig

    cap, p61 = SandboxConfig().max_output_bytes, 2**61 - 1
    cfg = CodeRewardConfig()

    def one_value(v) -> bytes:
        return (json.dumps({"c": 0, "v": v}) + "\n").encode()[:cap]

    def lines(line: str, size: int = cap) -> bytes:
        return (line + "\n").encode() * (size // (len(line) + 1))

    nested = [[[[[[[[list(range(8))] * 8] * 8] * 8] * 8] * 4] * 2]]
    tests = [asserts.compile_test("assert f(1) == 2")]
    reports = {
        "a set of 40k ints sharing one hash": (one_value({"$": "set", "v": [k * p61 for k in range(40_000)]}), [[1]]),
        "a set of 110k distinct ints": (one_value({"$": "set", "v": list(range(110_000))}), [[1]]),
        "a dict of 50k pairs": (one_value({"$": "dict", "v": [[k, k] for k in range(50_000)]}), [[1]]),
        "240 ints of 4300 digits": (one_value([int("9" * 4300)] * 240), [[1]]),
        "a 1 MiB string": (one_value("x" * (cap - 40)), ["x" * (cap - 40)]),
        "nested lists, 32k leaves": (one_value(nested), [[1]]),
        "70k records of one case": (lines('{"c": 0, "v": 1}'), [1]),
        "70k floats against a float, float_tolerance 1e-6": (lines('{"c": 0, "v": 1e308}'), [1.5]),
        "assert-style: 37k probe records of one site": (lines('{"i": 0, "s": 0, "v": [2]}'), tests),
    }

    def run(name: str, report: bytes, expected: list, inline_bytes: int) -> list[bool] | None:
        kind = "assert" if name.startswith("assert") else "call"
        tol = 1e-6 if "tolerance" in name else None
        return judge.verdicts(
            kind, report, expected, tol, inline_bytes=inline_bytes, cpu_budget_s=cfg.judge_cpu_budget_s
        )

    def measured(fn) -> tuple[float, float, float, float]:
        """(calling thread CPU ms, children's CPU ms, wall ms, another thread's longest stall ms): best of
        ``repeat`` by the calling thread's CPU time."""
        best = None
        for _ in range(repeat):
            stop, stall = threading.Event(), [0.0]

            def spin():
                last = time.perf_counter()
                while not stop.is_set():
                    now = time.perf_counter()
                    stall[0] = max(stall[0], now - last)
                    last = now

            t = threading.Thread(target=spin)
            t.start()
            time.sleep(0.05)
            c0, k0, w0 = time.thread_time(), os.times(), time.perf_counter()
            fn()
            c1, k1, w1 = time.thread_time(), os.times(), time.perf_counter()
            stop.set()
            t.join()
            row = ((c1 - c0) * 1e3, (k1[2] + k1[3] - k0[2] - k0[3]) * 1e3, (w1 - w0) * 1e3, stall[0] * 1e3)
            best = row if best is None or row[0] < best[0] else best
        return best

    print(f"load before: {os.getloadavg()}")
    print(
        "| report (call-based unless said) | size | inline: GIL-holding CPU ms | inline: other thread's longest "
        "stall ms | child: GIL-holding CPU ms | child: its own CPU ms | child: wall ms | child: other thread's "
        "longest stall ms | same verdicts |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, (report, expected) in reports.items():
        inl = measured(lambda: run(name, report, expected, len(report)))
        kid = measured(lambda: run(name, report, expected, cfg.judge_inline_bytes))
        same = run(name, report, expected, len(report)) == run(name, report, expected, cfg.judge_inline_bytes)
        print(
            f"| {name} | {len(report) / 2**20:.2f} MiB | {inl[0]:.0f} | {inl[3]:.0f} | {kid[0]:.0f} | {kid[1]:.0f} "
            f"| {kid[2]:.0f} | {kid[3]:.0f} | {same} |"
        )
    size = cfg.judge_inline_bytes
    print(f"\ninline at the threshold ({size} bytes), GIL-holding CPU ms (best of {repeat}):")
    for name, line, expected in (
        ("records of one case", '{"c": 0, "v": 1}', [1]),
        ("floats against a float, float_tolerance 1e-6", '{"c": 0, "v": 1e308}', [1.5]),
        ("assert-style: probe records of one site", '{"i": 0, "s": 0, "v": [2]}', tests),
    ):
        report = lines(line, size)
        print(f"- {name}: {measured(lambda: run(name, report, expected, size))[0]:.1f}")
    print(f"load after: {os.getloadavg()}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--tree",
        action="append",
        help="NAME=PATH[,FIELD=JSON...]: a source tree (two or more), optionally with SandboxConfig fields "
        "that differ from that tree's defaults (e.g. after-nofilter=.,seccomp=false)",
    )
    ap.add_argument("--judge", action="store_true", help="measure the host judge's worst case instead")
    ap.add_argument("--runs", type=int, default=20, help="measured runs per tree and kind")
    ap.add_argument("--warmup", type=int, default=2, help="runs per tree and kind dropped first")
    ap.add_argument("--kinds", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS))
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--json", help="also write the raw times here")
    args = ap.parse_args(argv)
    if args.judge:
        return judge_worst_case()
    if not args.tree or len(args.tree) < 2:
        ap.error("give two or more --tree NAME=PATH")
    trees, sandboxes = {}, {}
    for spec in args.tree:  # NAME=PATH[,field=json,...]: SandboxConfig fields that differ from the defaults
        name, rest = spec.split("=", 1)
        path, *fields = rest.split(",")
        trees[name] = path
        sandboxes[name] = {k: json.loads(v) for k, v in (f.split("=", 1) for f in fields)}
    print(f"load before: {os.getloadavg()}", flush=True)
    workers = {name: Worker(path, args.python, sandboxes[name]) for name, path in trees.items()}
    times: dict[str, dict[str, list[float]]] = {k: {n: [] for n in trees} for k in args.kinds}
    cpu: dict[str, dict[str, list[float]]] = {k: {n: [] for n in trees} for k in args.kinds}
    t0 = time.time()
    try:
        for i in range(args.warmup + args.runs):
            for kind in args.kinds:
                order = list(trees) if i % 2 == 0 else list(reversed(trees))  # A B, then B A
                for name in order:
                    ms, cpu_ms = workers[name].score(kind)
                    if i >= args.warmup:
                        times[kind][name].append(ms)
                        cpu[kind][name].append(cpu_ms)
    finally:
        for w in workers.values():
            w.close()
    print(f"load after: {os.getloadavg()} ({time.time() - t0:.0f} s)")
    print("| problem | tree | runs | wall median ms | wall p90 ms | CPU median ms | CPU p90 ms |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for kind in args.kinds:
        for name in trees:
            xs, cs = times[kind][name], cpu[kind][name]
            print(
                f"| {kind} | {name} | {len(xs)} | {statistics.median(xs):.0f} | {percentile(xs, 0.9):.0f} "
                f"| {statistics.median(cs):.0f} | {percentile(cs, 0.9):.0f} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trees": trees, "wall_ms": times, "cpu_ms": cpu}, f, indent=1)


if __name__ == "__main__":
    main()
