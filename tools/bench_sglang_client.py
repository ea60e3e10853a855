"""Requests per second and latency of the rollout's HTTP client against one SGLang server, for source trees side by
side (issue 38: the pooled aiohttp client against the hand-written one it replaced).

For every tree, a worker process loads that tree's ``gspo_mcore/rollout/_http.py`` by its path (only that module:
the rest of the package is not imported) and sends ``--requests`` small ``/generate`` requests (``--prompt-tokens``
token ids, ``--max-new-tokens`` new tokens, log-probs asked for, as the engine asks) through ``_http.request``,
``--concurrency`` at a time, each request timed from its start to its whole body. Trees alternate round by round
(A B A B ...), so a machine whose load changes treats both alike. Printed per tree: requests per second (the median of
the rounds) and the p50 / p99 latency in milliseconds over every round's requests; ``--json`` writes them too.

    python tools/bench_sglang_client.py --url http://127.0.0.1:30000 --tree before=/path/to/old/checkout --tree after=.
    GSPO_SGLANG_VENV=.venv-sglang python tools/bench_sglang_client.py --serve-tiny --tree after=. --rounds 3

``--rollout group`` or ``--rollout episodes`` times rollouts instead: the worker runs with that tree's whole
``gspo_mcore`` on its path and drives ``SGLangEngine`` (the rollout's real code path: ``generate`` of ``--prompts``
prompts x ``--n`` samples, as a GSPO step asks for its groups; or ``generate_turns`` of ``--prompts`` x ``--n``
episodes of ``--turns`` policy turns, each turn after the first sent with the episode so far plus a 3-token
environment span). Each worker makes one small warm-up rollout (the engine persists over a run's steps), then times
``--rollouts`` rollouts, each with its own seed; printed per tree: the median, min and max seconds of a rollout over
every round, and the sampled tokens per second.

    GSPO_SGLANG_VENV=.venv-sglang python tools/bench_sglang_client.py --serve-tiny --rollout group \
        --tree before=/path/to/old/checkout --tree after=. --rounds 3

``--serve-tiny`` launches one real SGLang server itself, the way the real-SGLang tier does (tests/integration:
the tiny random Qwen3 checkpoint, SGLang on the CPU from ``GSPO_SGLANG_VENV``), and stops it at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------------------ the worker
def _load_http(tree: str):
    path = os.path.join(tree, "gspo_mcore", "rollout", "_http.py")
    spec = importlib.util.spec_from_file_location("_bench_http", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def worker(tree: str, url: str, requests: int, concurrency: int, prompt_tokens: int, max_new_tokens: int) -> dict:
    """One round with ``tree``'s client: ``{"seconds", "latencies_ms", "errors"}``."""
    http = _load_http(tree)

    async def main() -> dict:
        latencies: list[float] = []
        errors: list[str] = []
        todo = iter(range(requests))

        async def one_by_one() -> None:
            for i in todo:
                body = {
                    "input_ids": [4 + (i * 7 + k) % 23 for k in range(prompt_tokens)],
                    "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0, "sampling_seed": i},
                    "return_logprob": True,
                }
                t0 = time.perf_counter()
                try:
                    resp = await http.request("POST", url + "/generate", body, timeout_s=300.0, connect_timeout_s=10.0)
                    if resp.status != 200:
                        errors.append(f"HTTP {resp.status}: {resp.text(200)}")
                        continue
                    json.loads(resp.body)
                except http.TransportError as e:
                    errors.append(str(e))
                    continue
                latencies.append((time.perf_counter() - t0) * 1000)

        t0 = time.perf_counter()
        await asyncio.gather(*(one_by_one() for _ in range(concurrency)))
        seconds = time.perf_counter() - t0
        close = getattr(http, "close_pool", None)  # the pooled client's connections; the old one has none
        if close is not None:
            await close()
        return {"seconds": seconds, "latencies_ms": latencies, "errors": errors}

    return asyncio.run(main())


ENV_SPAN = (30, 31, 32)  # the environment's answer appended after each policy turn of an episode (``--rollout
# episodes``): fixed, so both trees prefill the same tokens


def rollout_worker(tree: str, url: str, kind: str, args) -> dict:
    """``--rollouts`` timed rollouts through ``tree``'s ``SGLangEngine``: ``{"seconds": [...], "tokens": [...]}``
    (``tokens``: policy tokens sampled in each rollout)."""
    sys.path.insert(0, tree)
    import gspo_mcore
    from gspo_mcore.rollout import SamplingParams, SGLangEngine

    where = os.path.abspath(gspo_mcore.__file__)
    if not where.startswith(os.path.join(os.path.abspath(tree), "")):
        raise SystemExit(f"bench_sglang_client: imported gspo_mcore from {where}, not from the tree {tree}")

    prompts = [[4 + (i * 7 + k) % 23 for k in range(args.prompt_tokens)] for i in range(args.prompts)]

    async def one(engine, prompts, n: int, seed: int) -> int:
        params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, ignore_eos=True, seed=seed)
        if kind == "group":
            groups = await engine.generate(prompts, n, params)
            return sum(len(s.response_ids) for g in groups for s in g)
        rows = [p for p in prompts for _ in range(n)]
        turns = dict.fromkeys(range(len(rows)), 0)
        sampled = 0

        def on_turns(ends):
            nonlocal sampled
            answers = []
            for t in ends:
                turns[t.row] += 1
                sampled += len(t.ids)
                answers.append(list(ENV_SPAN) if turns[t.row] < args.turns else None)
            return answers

        await engine.generate_turns(
            rows,
            params,
            keys=[seed * 100_000 + b for b in range(len(rows))],
            max_total_tokens=args.prompt_tokens + args.turns * (args.max_new_tokens + len(ENV_SPAN)),
            on_turns=on_turns,
        )
        assert all(k == args.turns for k in turns.values()), turns
        return sampled

    async def main() -> dict:
        seconds, tokens = [], []
        async with SGLangEngine([url]) as engine:
            await one(engine, prompts[:1], 1, 10_000)  # warm-up: connections, first-request costs
            for r in range(args.rollouts):
                t0 = time.perf_counter()
                tokens.append(await one(engine, prompts, args.n, r + 1))
                seconds.append(time.perf_counter() - t0)
        return {"seconds": seconds, "tokens": tokens}

    return asyncio.run(main())


# -------------------------------------------------------------------------------------------- the controller
def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _run_round(tree: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", tree, "--url", args.url]
    cmd += ["--requests", str(args.requests), "--concurrency", str(args.concurrency)]
    cmd += ["--prompt-tokens", str(args.prompt_tokens), "--max-new-tokens", str(args.max_new_tokens)]
    env = None
    if args.rollout:
        cmd += ["--rollout", args.rollout, "--prompts", str(args.prompts), "--n", str(args.n)]
        cmd += ["--turns", str(args.turns), "--rollouts", str(args.rollouts)]
        env = {**os.environ, "PYTHONPATH": tree}  # that tree's gspo_mcore, nothing of this one's
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=tree if args.rollout else None, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"bench_sglang_client: the worker for {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _serve_tiny(workdir: str):
    sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
    sys.path.insert(0, ROOT)
    from sglang_cpu import launch, server_config, sglang_missing, write_tiny_checkpoint

    missing = sglang_missing()
    if missing:
        raise SystemExit(f"bench_sglang_client: --serve-tiny: {missing}")
    ckpt = write_tiny_checkpoint(os.path.join(workdir, "ckpt"))
    procs, seconds = launch([server_config(ckpt, workdir)], workdir)
    print(f"launched a tiny SGLang server at {procs[0].url} in {seconds:.0f} s", flush=True)
    return procs[0]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", help="the SGLang server (http://host:port)")
    p.add_argument("--serve-tiny", action="store_true", help="launch one tiny SGLang server (GSPO_SGLANG_VENV)")
    p.add_argument("--tree", action="append", default=[], help="NAME=PATH of a source tree (repeat; default this one)")
    p.add_argument("--requests", type=int, default=200, help="requests per round and tree")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight at once")
    p.add_argument("--rounds", type=int, default=3, help="rounds per tree (trees alternate)")
    p.add_argument("--prompt-tokens", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--rollout", choices=("group", "episodes"), help="time rollouts through each tree's SGLangEngine")
    p.add_argument("--prompts", type=int, default=16, help="--rollout: prompts per rollout")
    p.add_argument("--n", type=int, default=8, help="--rollout: samples (group) or episodes per prompt")
    p.add_argument("--turns", type=int, default=3, help="--rollout episodes: policy turns per episode")
    p.add_argument("--rollouts", type=int, default=2, help="--rollout: timed rollouts per round and tree")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for key in (
        "requests",
        "concurrency",
        "rounds",
        "prompt_tokens",
        "max_new_tokens",
        "prompts",
        "n",
        "turns",
        "rollouts",
    ):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.worker and args.rollout:
        print(json.dumps(rollout_worker(args.worker, args.url, args.rollout, args)))
        return
    if args.worker:
        out = worker(args.worker, args.url, args.requests, args.concurrency, args.prompt_tokens, args.max_new_tokens)
        print(json.dumps(out))
        return
    trees = {}
    for spec in args.tree or [f"this={ROOT}"]:
        name, sep, path = spec.partition("=")
        if not sep or not os.path.isfile(os.path.join(path, "gspo_mcore", "rollout", "_http.py")):
            p.error(f"--tree {spec!r}: give NAME=PATH of a checkout with gspo_mcore/rollout/_http.py")
        trees[name] = os.path.abspath(path)
    if bool(args.url) == args.serve_tiny:
        p.error("give exactly one of --url and --serve-tiny")
    server = None
    with tempfile.TemporaryDirectory(prefix="bench_sglang_client_") as workdir:
        try:
            if args.serve_tiny:
                server = _serve_tiny(workdir)
                args.url = server.url
            load_before = os.getloadavg()[0]
            rounds: dict[str, list[dict]] = {name: [] for name in trees}
            for _ in range(args.rounds):
                for name, tree in trees.items():
                    rounds[name].append(_run_round(tree, args))
            load_after = os.getloadavg()[0]
        finally:
            if server is not None:
                server.shutdown()
    if args.rollout:
        _report_rollouts(rounds, trees, args, (load_before, load_after))
        return
    figures = {}
    print(
        f"{args.requests} /generate requests per round, {args.concurrency} at a time, {args.rounds} round(s); "
        f"load average {load_before:.1f} before, {load_after:.1f} after"
    )
    print(f"{'tree':<12} {'req/s':>8} {'p50 ms':>9} {'p99 ms':>9} {'errors':>7}")
    for name, rs in rounds.items():
        lat = [x for r in rs for x in r["latencies_ms"]]
        errors = [e for r in rs for e in r["errors"]]
        rps = statistics.median((len(r["latencies_ms"]) / r["seconds"]) for r in rs)
        p50, p99 = (_percentile(lat, 0.5), _percentile(lat, 0.99)) if lat else (float("nan"),) * 2
        figures[name] = {
            "requests_per_s": rps,
            "p50_ms": p50,
            "p99_ms": p99,
            "errors": len(errors),
            "tree": trees[name],
        }
        print(f"{name:<12} {rps:>8.1f} {p50:>9.1f} {p99:>9.1f} {len(errors):>7}")
        if errors:
            print(f"  first error: {errors[0]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "load": [load_before, load_after], "trees": figures}, f, indent=2)


def _report_rollouts(rounds: dict, trees: dict, args, load: tuple[float, float]) -> None:
    what = (
        f"{args.prompts} prompts x {args.n} samples"
        if args.rollout == "group"
        else f"{args.prompts * args.n} episodes of {args.turns} turns"
    )
    print(
        f"rollout {args.rollout}: {what}, {args.max_new_tokens} new tokens a turn, {args.prompt_tokens}-token prompts; "
        f"{args.rollouts} timed rollout(s) per round, {args.rounds} round(s); load average {load[0]:.1f} before, "
        f"{load[1]:.1f} after"
    )
    print(f"{'tree':<12} {'median s':>9} {'min s':>7} {'max s':>7} {'tokens/s':>9}")
    figures = {}
    for name, rs in rounds.items():
        seconds = [x for r in rs for x in r["seconds"]]
        tokens = sum(x for r in rs for x in r["tokens"])
        figures[name] = {
            "rollout_s_median": statistics.median(seconds),
            "rollout_s_min": min(seconds),
            "rollout_s_max": max(seconds),
            "rollout_s": seconds,
            "tokens_per_rollout": tokens / len(seconds),
            "tokens_per_s": tokens / sum(seconds),
            "tree": trees[name],
        }
        f = figures[name]
        print(
            f"{name:<12} {f['rollout_s_median']:>9.2f} {f['rollout_s_min']:>7.2f} {f['rollout_s_max']:>7.2f} "
            f"{f['tokens_per_s']:>9.1f}"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"settings": vars(args), "load": list(load), "trees": figures}, fh, indent=2)


if __name__ == "__main__":
    main()
