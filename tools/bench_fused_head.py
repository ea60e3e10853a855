"""Benchmark of the fused LM-head log-prob (``gspo_mcore.ops.linear_token_logprobs``) on CPU or CUDA.

From final hidden states ``[T, H]`` and the output weight ``[V, H]`` to the sampled tokens' log-probs, three ways:
  eager   logits = h @ W.T, then torch.log_softmax(logits.float(), -1).gather(...)
  today   logits = h @ W.T, then gspo_mcore.ops.token_logprobs (the learner's path without the fused head)
  fused   gspo_mcore.ops.linear_token_logprobs (vocabulary chunks; the [T, V] logits never exist)
  fused_torch  the same with the pure-torch twins of the per-chunk kernels (is the compiled kernel worth it?)
and, as the floor, ``matmul`` (h @ W.T alone). Modes: ``fwd`` (under no_grad, the old-log-prob recompute) and
``fwd+bwd`` (autograd.grad of logp, from a random upstream gradient, with respect to h and W).

Times are medians of ``--reps`` calls, also shown as a ratio to ONE streaming read of a ``[T, V]`` logits
tensor of the same dtype measured in the same run (see tools/bench_logprobs.py): the fused head never reads
such a tensor, so below-one-read figures are possible for its non-matmul part. Peak memory: on CUDA
``torch.cuda.max_memory_allocated`` above what was allocated before the call; on CPU the resident-set peak
(VmHWM) above the resident size before the call (tools/bench_logprobs.measure_peak_extra), both including
the outputs and the gradients (d W is ``[V, H]``). Every table names the device (CPU model and the
kernels' ISA, or the GPU).

Example:
  python tools/bench_fused_head.py --tokens 4096 --hidden 1024 --vocab 151936 --dtype fp32 bf16 --threads 2
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_logprobs import _fix_mmap_threshold, cpu_model, gspo_isa, measure_peak_extra  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
APPROACHES = ("matmul", "eager", "today", "fused", "fused_torch")
MODES = ("fwd", "fwd+bwd")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, reps: int, warmup: int) -> float:
    """Median seconds of ``fn()``."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peak_bytes(fn, device) -> int | None:
    """Bytes the call allocated at its peak, above what was allocated before (outputs kept until read)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        del out
        return peak
    return measure_peak_extra(fn)


def make_calls(h, W, targets, grad_out, chunk: int):
    """{(approach, mode): callable returning its outputs}."""
    from gspo_mcore import ops

    def eager(hh, WW):
        logits = hh @ WW.T
        return torch.log_softmax(logits.float(), -1).gather(1, targets[:, None]).squeeze(1)

    def today(hh, WW):
        return ops.token_logprobs(hh @ WW.T, targets)

    def fused(hh, WW):
        return ops.linear_token_logprobs(hh, WW, targets, chunk=chunk)

    def fused_torch(hh, WW):
        with ops.use_reference(True):
            return ops.linear_token_logprobs(hh, WW, targets, chunk=chunk)

    def fwd(f):
        def call():
            with torch.no_grad():
                return f(h, W)

        return call

    def fwd_bwd(f, reference=False):
        def call():
            hh, WW = h.detach().requires_grad_(True), W.detach().requires_grad_(True)
            with ops.use_reference(reference):  # the backward runs here too
                return torch.autograd.grad(f(hh, WW), (hh, WW), grad_out)

        return call

    calls = {("matmul", "fwd"): fwd(lambda hh, WW: hh @ WW.T)}
    for name, f in (("eager", eager), ("today", today), ("fused", fused), ("fused_torch", fused_torch)):
        calls[name, "fwd"] = fwd(f)
        calls[name, "fwd+bwd"] = fwd_bwd(f, reference=name == "fused_torch")
    return calls


def device_name(device) -> str:
    if device.type == "cuda":
        return f"GPU {torch.cuda.get_device_name(device)}"
    return f"CPU {cpu_model()}, gspo_mcore ISA {gspo_isa()}, {torch.get_num_threads()} threads"


def timed_peak(fn, device) -> tuple[float, int | None]:
    """One cold call, timed and its peak memory measured at once (``--single-pass``)."""
    t = []

    def call():
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        t.append(time.perf_counter() - t0)
        return out

    mem = peak_bytes(call, device)
    return t[0], mem


def run_case(T, H, V, dtype_name, device, *, chunk, reps, warmup, memory, approaches, single_pass=False):
    dtype = DTYPES[dtype_name]
    g = torch.Generator().manual_seed(0)
    h = torch.randn(T, H, generator=g).to(device, dtype)
    W = (torch.randn(V, H, generator=g) * (2.0 / H**0.5)).to(device, dtype)
    targets = torch.randint(0, V, (T,), generator=g).to(device)
    grad_out = torch.randn(T, generator=g).to(device)
    logits_bytes = T * V * torch.finfo(dtype).bits // 8
    # one streaming read of [T, V] logits in this dtype (float32 view of their storage, as bench_logprobs)
    buf = torch.empty(logits_bytes // 4, dtype=torch.float32, device=device).normal_()
    t_read = min(timed(buf.sum, device, reps, warmup), timed(buf.amax, device, reps, warmup))
    del buf
    calls = make_calls(h, W, targets, grad_out, chunk)
    rows = []
    for (name, mode), call in calls.items():
        if name not in approaches:
            continue
        if single_pass:
            t, mem = timed_peak(call, device)
        else:
            t = timed(call, device, reps, warmup)
            mem = peak_bytes(call, device) if memory else None
        rows.append(dict(approach=name, mode=mode, seconds=t, x_read=t / t_read, peak_bytes=mem))
        print(f"   [progress] {name} {mode}: {t:.2f} s, peak {mem}", file=sys.stderr, flush=True)
        gc.collect()
    check = None
    if "fused" in approaches and "today" in approaches:
        with torch.no_grad():
            a, b = calls["fused", "fwd"](), calls["today", "fwd"]()
        check = float((a - b).abs().max())
    return dict(
        T=T,
        H=H,
        V=V,
        dtype=dtype_name,
        chunk=chunk,
        read_seconds=t_read,
        logits_bytes=logits_bytes,
        rows=rows,
        max_abs_logp_fused_vs_today=check,
    )


def print_case(case, device):
    print(
        f"\n== T={case['T']} H={case['H']} V={case['V']} {case['dtype']} chunk={case['chunk']} on {device_name(device)}"
    )
    print(
        f"   one read of [T, V] logits: {case['read_seconds'] * 1e3:.2f} ms "
        f"({case['logits_bytes'] / 2**30:.2f} GiB; an fp32 [T, V] buffer is "
        f"{case['T'] * case['V'] * 4 / 2**30:.2f} GiB)"
    )
    base = {r["mode"]: r["seconds"] for r in case["rows"] if r["approach"] == "eager"}
    today = {r["mode"]: r for r in case["rows"] if r["approach"] == "today"}
    print(f"   {'approach':<11} {'mode':<8} {'ms':>10} {'x read':>8} {'vs eager':>9} {'peak GiB':>9} {'vs today':>9}")
    for r in case["rows"]:
        vs_eager = base.get(r["mode"], float("nan")) / r["seconds"]
        mem = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.2f}"
        t_mem = today.get(r["mode"], {}).get("peak_bytes")
        mem_ratio = "-" if not (t_mem and r["peak_bytes"]) else f"{r['peak_bytes'] / t_mem:.2f}x"
        print(
            f"   {r['approach']:<11} {r['mode']:<8} {r['seconds'] * 1e3:10.1f} {r['x_read']:8.1f} "
            f"{vs_eager:8.2f}x {mem:>9} {mem_ratio:>9}"
        )
    if case["max_abs_logp_fused_vs_today"] is not None:
        print(f"   max |logp fused - logp today| = {case['max_abs_logp_fused_vs_today']:.2e}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, nargs="+", default=[151936])
    p.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["fp32"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--chunk", type=int, default=4096, help="vocabulary columns per chunk of the fused head")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--approaches", nargs="+", default=["matmul", "eager", "today", "fused"], choices=APPROACHES)
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory pass")
    p.add_argument(
        "--single-pass",
        action="store_true",
        help="one cold call per approach and mode, timed and memory-measured at once (slow or loaded machines)",
    )
    p.add_argument("--json", default=None, metavar="OUT")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cpu":
        _fix_mmap_threshold()
    if args.single_pass:  # warm torch's one-time set-up (autograd, kernels) at a tiny size first
        for dtype_name in args.dtype:
            run_case(
                8,
                16,
                64,
                dtype_name,
                device,
                chunk=16,
                reps=1,
                warmup=0,
                memory=False,
                approaches=args.approaches,
                single_pass=True,
            )
    cases = []
    for dtype_name in args.dtype:
        for T in args.tokens:
            for V in args.vocab:
                case = run_case(
                    T,
                    args.hidden,
                    V,
                    dtype_name,
                    device,
                    chunk=args.chunk,
                    reps=args.reps,
                    warmup=args.warmup,
                    memory=not args.no_memory,
                    approaches=args.approaches,
                    single_pass=args.single_pass,
                )
                print_case(case, device)
                cases.append(case)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device_name(device), load=os.getloadavg(), cases=cases), f, indent=1)


if __name__ == "__main__":
    main()
