"""Benchmark of the per-token log-prob kernel (``gspo_mcore.ops.token_logprobs``) on CPU against its peers.

Every time is reported as a ratio to ONE streaming read of the logits tensor measured in the same run
(the method of the project notes on performance), so that figures from noisy shared machines can be compared.

What "one read" is: the faster of ``torch.sum`` and ``torch.amax`` over a float32 *view* of the logits'
storage (for bf16 logits that view reinterprets pairs of bf16 values as one float32). Both touch every
byte exactly once, write nothing but a scalar and do one vector instruction per 64 bytes, so they are
bound by reading memory, not by arithmetic; ``logits.sum()`` on bf16 itself would also pay a bf16->fp32
conversion per element, and ``logits.float().sum()`` would write a copy. Taking the faster of the two
keeps the baseline honest (a slow baseline would flatter every ratio).

Approaches (each in modes fwd, fwd+bwd, and with entropy where it has it):
  gspo         gspo_mcore.ops.token_logprobs (the compiled CPU kernel)
  eager        torch.log_softmax(logits.float(), -1).gather(...) (+ entropy -(p * logp).sum(-1))
  compile      torch.compile of the eager function (inductor's C++ backend)
  mcore        Megatron-Core tensor_parallel.vocab_parallel_cross_entropy on a 1-rank gloo group
  mcore_fused  Megatron-Core fusions.fused_vocab_parallel_cross_entropy (torch.compile'd pieces)
  liger        Liger-Kernel (Triton, GPU only: reported as skipped on CPU)
"fwd" runs under ``torch.no_grad()`` (the old-log-prob recompute); "fwd+bwd" runs the forward with
autograd and ``torch.autograd.grad`` from a random gradient of logp (and of the entropy), returning
d logits without accumulating into ``.grad``.

Megatron's CE works IN PLACE on float32 logits (it turns them into exp(logits - max) and then into the
gradient); each timed call therefore gets a fresh copy made outside the timed region, and its fwd+bwd
needs no new [T, V] buffer. Every other approach returns a new gradient, so the table also shows the cost
of allocating and writing one fresh [T, V] buffer ("fresh ... alloc + one write"): on a VM whose page
faults are slow this floor dominates fwd+bwd; ``THP_MEM_ALLOC_ENABLE=1`` (torch's opt-in: huge pages for
allocations >= 2 MB) lowers it several times.

Columns: "x read" is median time / median read; "(min)" is fastest time / fastest read, the figure least
disturbed by other processes on a shared machine (a compute-bound kernel loses more to a competing
process than a read, which one thread can nearly saturate).

The compiled backward keeps its last freed gradient buffer for the next call (docs/performance.md, "Gradient
buffer cache"); the timed rounds run with it (as the learner does), the memory pass without it.

Peak extra memory is measured in a separate, untimed pass from the kernel's peak resident set
(``VmHWM`` after resetting it through ``/proc/self/clear_refs``): large tensors are mmap'ed and
returned to the OS when freed, so the resident peak minus the resident size before the call is the
peak of what the call allocated (outputs and the gradient included). It is shown in units of one
float32 ``[T, V]`` buffer; for fwd+bwd the gradient itself is one ``[T, V]`` buffer in the logits' dtype.

Example:
  python tools/bench_logprobs.py --tokens 2048 4096 --vocab 151936 32768 --dtype fp32 bf16 --threads 2 \\
      --reps 5 --json bench.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import signal
import statistics
import sys
import time

import torch

MODES = ("fwd", "fwd+bwd", "fwd+bwd_inplace", "fwd_ent", "fwd+bwd_ent")
# the eager mode a mode is compared with ("vs eager")
EAGER_MODE = {"fwd+bwd_inplace": "fwd+bwd"}


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (``platform.processor()`` is often empty on Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gspo_isa() -> str:
    """The instruction set gspo_mcore's CPU kernels use ('reference' without the extension)."""
    from gspo_mcore.ops import _backend

    if not _backend.HAVE_EXTENSION or not _backend.compiled_enabled():
        return "reference"
    from gspo_mcore import _C

    return _C.cpu_isa()


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ---------------------------------------------------------------------------------------------------
# memory: peak resident set of this process, resettable (Linux >= 4.0)
# ---------------------------------------------------------------------------------------------------
def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _fix_mmap_threshold(nbytes: int = 1 << 20) -> None:
    """Serve every allocation >= nbytes from its own mmap (and return it to the OS when freed).

    glibc raises its mmap threshold as large blocks are freed (up to 32 MB) and then serves medium blocks
    from already-resident heap, which hides them from the resident-set measure; a fixed threshold
    turns the dynamic adjustment off. Tensors of the sizes benchmarked here are mmap'ed either way."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, nbytes)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def measure_peak_extra(fn) -> int | None:
    """Bytes by which the resident peak during ``fn()`` exceeded the resident size before it."""
    gc.collect()
    if not _reset_peak_rss():
        return None
    before = _status_kb("VmRSS")
    out = fn()  # keep the result alive until the peak is read: it is part of the call's footprint
    peak = _status_kb("VmHWM")
    del out
    gc.collect()
    return (peak - before) * 1024


# ---------------------------------------------------------------------------------------------------
# approaches: each gives a callable per mode that returns its outputs (kept alive for the memory pass)
# ---------------------------------------------------------------------------------------------------
class Skip(Exception):
    """An approach (or mode) that cannot run here; the message says why."""


class Timeout(Exception):
    pass


class Case:
    """Inputs of one (T, V, dtype) case."""

    def __init__(self, T: int, V: int, dtype: torch.dtype, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.T, self.V, self.dtype = T, V, dtype
        self.logits = (torch.randn(T, V, generator=g) * 3.0).to(dtype)  # (T, V)
        self.targets = torch.randint(0, V, (T,), generator=g)  # (T,)
        self.grad_logp = torch.randn(T, generator=g)  # (T,)
        self.grad_ent = torch.randn(T, generator=g)  # (T,)
        flat = self.logits.reshape(-1)
        nbytes = flat.numel() * flat.element_size()
        n32 = nbytes // 4
        self.f32_view = flat.view(torch.uint8)[: n32 * 4].view(torch.float32)  # same storage, read as fp32
        self.nbytes = nbytes


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().requires_grad_(True)


def make_read(case: Case):
    v = case.f32_view
    return {"sum": lambda: torch.sum(v), "amax": lambda: torch.amax(v)}


def make_fresh_write(case: Case):
    """Allocate a [T, V] tensor in the logits' dtype and write it once: what any gradient costs before a
    single value is computed (first-touch page faults, the kernel zeroing each page, then the write)."""
    x = case.logits
    return lambda: torch.empty_like(x).fill_(1.0)


def make_gspo(case: Case):
    from gspo_mcore.ops import token_logprobs

    x, t, gl, ge = case.logits, case.targets, case.grad_logp, case.grad_ent

    def fwd():
        with torch.no_grad():
            return token_logprobs(x, t)

    def fwd_ent():
        with torch.no_grad():
            return token_logprobs(x, t, return_entropy=True)

    def fwd_bwd():
        xl = _leaf(x)
        lp = token_logprobs(xl, t)
        return torch.autograd.grad(lp, xl, gl)

    def fwd_bwd_ent():
        xl = _leaf(x)
        lp, ent = token_logprobs(xl, t, return_entropy=True)
        return torch.autograd.grad((lp, ent), xl, (gl, ge))

    # inplace_backward=True overwrites its logits: each timed call gets a fresh non-leaf copy, made outside
    # the timed region (as the LM head's output would be), whose backward is the identity (no extra pass).
    def prepare_inplace():
        xl = _leaf(x)
        return xl, _FreshCopy.apply(xl)

    def fwd_bwd_inplace(arg):
        xl, logits = arg
        lp = token_logprobs(logits, t, inplace_backward=True)
        return torch.autograd.grad(lp, xl, gl)

    return {
        "fwd": fwd,
        "fwd+bwd": fwd_bwd,
        "fwd+bwd_inplace": (prepare_inplace, fwd_bwd_inplace),
        "fwd_ent": fwd_ent,
        "fwd+bwd_ent": fwd_bwd_ent,
    }


class _FreshCopy(torch.autograd.Function):
    """A copy of x whose backward passes the gradient through unchanged (no [T, V] work)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g


def eager_logp(x, t):
    return torch.log_softmax(x.float(), -1).gather(1, t[:, None]).squeeze(1)  # (T,)


def eager_logp_ent(x, t):
    lp_all = torch.log_softmax(x.float(), -1)  # (T, V)
    return lp_all.gather(1, t[:, None]).squeeze(1), -(lp_all.exp() * lp_all).sum(-1)


def _torch_modes(case: Case, f, f_ent):
    x, t, gl, ge = case.logits, case.targets, case.grad_logp, case.grad_ent

    def fwd():
        with torch.no_grad():
            return f(x, t)

    def fwd_ent():
        with torch.no_grad():
            return f_ent(x, t)

    def fwd_bwd():
        xl = _leaf(x)
        return torch.autograd.grad(f(xl, t), xl, gl)

    def fwd_bwd_ent():
        xl = _leaf(x)
        lp, ent = f_ent(xl, t)
        return torch.autograd.grad((lp, ent), xl, (gl, ge))

    return {"fwd": fwd, "fwd+bwd": fwd_bwd, "fwd_ent": fwd_ent, "fwd+bwd_ent": fwd_bwd_ent}


def make_eager(case: Case):
    return _torch_modes(case, eager_logp, eager_logp_ent)


def make_compile(case: Case):
    try:
        import torch._inductor  # noqa: F401
    except Exception as exc:  # pragma: no cover
        raise Skip(f"torch.compile unavailable: {exc}")
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    # Fresh compiled functions per case (dynamic=False: one specialised kernel per shape, the best case).
    f = torch.compile(lambda x, t: eager_logp(x, t), dynamic=False)
    f_ent = torch.compile(lambda x, t: eager_logp_ent(x, t), dynamic=False)
    return _torch_modes(case, f, f_ent)


_DIST_READY = False


def _init_one_rank_group():
    global _DIST_READY
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 20000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    if not _DIST_READY:
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        _DIST_READY = True


def _mcore_modes(case: Case, ce):
    """Megatron's CE is -logp of the target; the logits go in as [s, b, V] = [T, 1, V].

    For float32 logits Megatron subtracts the max and takes exp IN PLACE on its input (its memory trick:
    the LM-head output is dead after the loss), so each call gets a fresh copy made outside the timed
    region (``prepare``); for bf16 its ``.float()`` makes that copy inside the call (and is timed)."""
    x, t, gl = case.logits, case.targets, case.grad_logp
    t3 = t[:, None]  # (T, 1)
    neg_g = (-gl)[:, None]  # d loss = -d logp
    inplace = case.dtype == torch.float32

    def prepare():
        return x.clone() if inplace else x

    def fwd(xin):
        with torch.no_grad():
            return -ce(xin[:, None, :], t3)

    def fwd_bwd(xin):
        xl = _leaf(xin)
        loss = ce(xl[:, None, :], t3)  # (T, 1)
        return torch.autograd.grad(loss, xl, neg_g)

    return {"fwd": (prepare, fwd), "fwd+bwd": (prepare, fwd_bwd)}


def make_mcore(case: Case):
    try:
        from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
    except Exception as exc:
        raise Skip(f"megatron-core not importable: {exc}")
    _init_one_rank_group()
    return _mcore_modes(case, lambda x, t: vocab_parallel_cross_entropy(x, t))


def make_mcore_fused(case: Case):
    try:
        from megatron.core import parallel_state
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    except Exception as exc:
        raise Skip(f"megatron-core not importable: {exc}")
    _init_one_rank_group()
    group = parallel_state.get_tensor_model_parallel_group()
    return _mcore_modes(case, lambda x, t: fused_vocab_parallel_cross_entropy(x, t, group))


def make_liger(case: Case):
    try:
        import liger_kernel  # noqa: F401
    except Exception:
        raise Skip("liger-kernel is not installed; it is Triton (GPU) only and has no CPU path")
    raise Skip("liger-kernel's fused cross-entropy is a Triton kernel: it needs a GPU")


APPROACHES = {
    "gspo": make_gspo,
    "eager": make_eager,
    "compile": make_compile,
    "mcore": make_mcore,
    "mcore_fused": make_mcore_fused,
    "liger": make_liger,
}


# ---------------------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------------------
def _split(entry):
    """A mode entry is ``fn`` or ``(prepare, fn)``; returns ``(prepare, fn)`` with fn taking prepare()'s value."""
    if isinstance(entry, tuple):
        return entry
    return (lambda: None), (lambda _: entry())


def _timed(prepare, fn) -> float:
    arg = prepare()
    t0 = time.perf_counter()
    out = fn(arg)
    dt = time.perf_counter() - t0
    del out, arg
    return dt


def _with_alarm(seconds: float, fn):
    """Run ``fn`` with a SIGALRM deadline (used around the first calls, which may compile)."""
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        return fn()

    def handler(signum, frame):
        raise Timeout(f"took longer than {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def check_accuracy(case: Case, modes) -> dict:
    """max |logp - fp64 reference| (and entropy) on the first rows; a check that the right thing is timed."""
    rows = min(case.T, 128)
    ref_all = torch.log_softmax(case.logits[:rows].double(), -1)
    ref = ref_all.gather(1, case.targets[:rows, None]).squeeze(1)
    ref_ent = -(ref_all.exp() * ref_all).sum(-1)
    out = {}
    if "fwd" in modes:
        _, fn = _split(modes["fwd"])
        lp = fn(_split(modes["fwd"])[0]())
        lp = lp.reshape(-1)[:rows].double()
        out["logp_err"] = float((lp - ref).abs().max())
    if "fwd_ent" in modes:
        _, fn = _split(modes["fwd_ent"])
        lp, ent = fn(None)
        out["ent_err"] = float((ent[:rows].double() - ref_ent).abs().max())
    return out


def run_case(
    case: Case, names, reps: int, warmup: int, compile_timeout: float, measure_memory: bool, modes_wanted=MODES
):
    results = {}  # (approach, mode) -> dict
    notes = []
    read = make_read(case)
    runnable = {}  # (approach, mode) -> (prepare, fn)
    for name in names:
        try:
            modes = APPROACHES[name](case)
        except Skip as exc:
            notes.append(f"{name}: skipped: {exc}")
            continue
        except Exception as exc:  # an approach that breaks must not take the benchmark down with it
            notes.append(f"{name}: skipped: {type(exc).__name__}: {exc}")
            continue
        for mode in MODES:
            if mode not in modes or mode not in modes_wanted:
                continue
            prepare, fn = _split(modes[mode])
            try:  # warm-up (the first call compiles where there is something to compile)
                limit = compile_timeout if name in ("compile", "mcore_fused") else 0
                t0 = time.perf_counter()
                _with_alarm(limit, lambda: _timed(prepare, fn))
                first = time.perf_counter() - t0
                for _ in range(warmup - 1):
                    _timed(prepare, fn)
            except (Skip, Timeout) as exc:
                notes.append(f"{name} {mode}: skipped: {exc}")
                continue
            except Exception as exc:
                msg = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
                notes.append(f"{name} {mode}: skipped: {type(exc).__name__}: {msg}")
                continue
            runnable[(name, mode)] = (prepare, fn)
            results[(name, mode)] = {"first_call_s": first, "times": []}
        if name == "gspo" or name == "eager":
            try:
                acc = check_accuracy(case, modes)
                for mode in MODES:
                    if (name, mode) in results:
                        results[(name, mode)].update(acc)
            except Exception as exc:
                notes.append(f"{name}: accuracy check failed: {exc}")
        gc.collect()

    for fn in read.values():  # warm the read
        fn()
    fresh = make_fresh_write(case)
    fresh()
    read_times = {k: [] for k in read}
    fresh_times = []
    for _ in range(reps):  # round robin: every approach sees the same machine weather
        for k, fn in read.items():
            t0 = time.perf_counter()
            fn()
            read_times[k].append(time.perf_counter() - t0)
        fresh_times.append(_timed(lambda: None, lambda _: fresh()))
        for key, (prepare, fn) in runnable.items():
            results[key]["times"].append(_timed(prepare, fn))
        gc.collect()

    read_med = {k: statistics.median(v) for k, v in read_times.items()}
    read_kind = min(read_med, key=read_med.get)
    one_read = read_med[read_kind]
    one_read_min = min(min(v) for v in read_times.values())
    for key, r in results.items():
        r["median_s"] = statistics.median(r["times"])
        r["min_s"] = min(r["times"])
        r["x_read"] = r["median_s"] / one_read
        r["x_read_min"] = r["min_s"] / one_read_min

    if measure_memory:
        # The gradient buffer cache would serve the gradient from memory already resident and hide it: off here.
        from gspo_mcore.ops import set_grad_buffer_cache

        set_grad_buffer_cache(False)
        try:
            for key, (prepare, fn) in runnable.items():
                arg = prepare()
                results[key]["peak_extra_bytes"] = measure_peak_extra(lambda: fn(arg))
                del arg
        finally:
            set_grad_buffer_cache(True)
    return {
        "read": {
            k: {"median_s": read_med[k], "GBps": case.nbytes / read_med[k] / 1e9, "times": read_times[k]} for k in read
        },
        "fresh_write": {
            "median_s": statistics.median(fresh_times),
            "min_s": min(fresh_times),
            "x_read": statistics.median(fresh_times) / one_read,
            "x_read_min": min(fresh_times) / one_read_min,
            "times": fresh_times,
        },
        "one_read_s": one_read,
        "one_read_min_s": one_read_min,
        "one_read_kind": read_kind,
        "results": results,
        "notes": notes,
    }


def print_case(case: Case, out: dict, dtype_name: str):
    T, V = case.T, case.V
    tv32 = T * V * 4
    print(
        f"\n=== T={T} V={V} dtype={dtype_name}  logits {case.nbytes / 1e9:.3f} GB  threads={torch.get_num_threads()}"
        f"  CPU: {cpu_model()}  gspo ISA: {gspo_isa()}"
    )
    for k, r in out["read"].items():
        mark = " <- one read" if k == out["one_read_kind"] else ""
        print(f"  read via {k:5s}: {r['median_s'] * 1e3:8.2f} ms  {r['GBps']:6.1f} GB/s{mark}")
    fw = out["fresh_write"]
    print(
        f"  fresh [T,V] alloc + one write: {fw['median_s'] * 1e3:8.2f} ms = {fw['x_read']:.2f}x read "
        f"(min {fw['x_read_min']:.2f}x): the floor under any approach that returns a new gradient"
    )
    res = out["results"]
    hdr = (
        f"  {'approach':12s} {'mode':12s} {'median ms':>10s} {'x read':>8s} {'(min)':>7s} {'vs eager':>9s} "
        f"{'peak extra':>11s} {'logp err':>9s} {'first call':>10s}"
    )
    print(hdr)
    print("  " + "-" * (len(hdr) - 2))
    for mode in MODES:
        eager = res.get(("eager", EAGER_MODE.get(mode, mode)))
        for (name, m), r in res.items():
            if m != mode:
                continue
            speed = f"{eager['median_s'] / r['median_s']:8.2f}x" if eager else f"{'-':>9s}"
            pk = r.get("peak_extra_bytes")
            pk_s = f"{pk / tv32:9.2f}TV" if pk is not None else f"{'?':>11s}"
            err = r.get("logp_err")
            err_s = f"{err:9.1e}" if err is not None else f"{'':9s}"
            print(
                f"  {name:12s} {mode:12s} {r['median_s'] * 1e3:10.2f} {r['x_read']:8.2f} {r['x_read_min']:7.2f} "
                f"{speed} {pk_s} "
                f"{err_s} {r['first_call_s']:9.2f}s"
            )
    print("  (x read: median time / median of one read; (min): fastest time / fastest read, the figure least")
    print("   disturbed by other processes; vs eager: eager's median / this median, same mode (fwd+bwd for")
    print("   fwd+bwd_inplace: token_logprobs(..., inplace_backward=True), the gradient written into the logits);")
    print(
        "   peak extra: resident peak above the inputs, in fp32 [T,V] buffers (=%.0f MB); fwd+bwd includes"
        % (tv32 / 1e6)
    )
    print(
        "   the returned gradient, itself %.2f TV in this dtype; logp err: max |logp - fp64| on 128 rows)"
        % (case.logits.element_size() / 4)
    )
    for n in out["notes"]:
        print("  note:", n)
    g = {m: res.get(("gspo", m)) for m in MODES}
    e = {m: res.get(("eager", m)) for m in MODES}
    if g["fwd"] and g["fwd+bwd"]:
        checks = [
            ("fwd <= 2.5x read", g["fwd"]["x_read"] <= 2.5),
            ("fwd+bwd <= 5x read", g["fwd+bwd"]["x_read"] <= 5.0),
        ]
        if e["fwd+bwd"]:
            checks.append(("fwd+bwd >= 5x faster than eager", e["fwd+bwd"]["median_s"] / g["fwd+bwd"]["median_s"] >= 5))
        if g["fwd+bwd_inplace"]:
            checks.append(("fwd+bwd_inplace <= 5x read", g["fwd+bwd_inplace"]["x_read"] <= 5.0))
        pk = g["fwd+bwd"].get("peak_extra_bytes")
        if pk is not None:
            grad = T * V * case.logits.element_size()
            checks.append(("fwd+bwd extra beyond grad < 0.1 TV", pk - grad < 0.1 * tv32))
        print("  targets: " + "; ".join(f"{n}: {'MET' if ok else 'MISSED'}" for n, ok in checks))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096], help="T values")
    p.add_argument("--vocab", type=int, nargs="+", default=[151936, 32768], help="V values")
    p.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per approach and mode first")
    p.add_argument("--approaches", nargs="+", default=list(APPROACHES), choices=list(APPROACHES))
    p.add_argument(
        "--compile-timeout",
        type=float,
        default=300.0,
        help="seconds allowed for the first (compiling) call of torch.compile'd approaches",
    )
    p.add_argument(
        "--modes", nargs="+", default=list(MODES), choices=list(MODES), help="modes to time (default: all of them)"
    )
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory pass")
    p.add_argument("--isa", default=None, help="force gspo_mcore's CPU ISA (avx512_bf16, avx512, avx2, default)")
    p.add_argument("--json", default=None, metavar="OUT", help="write all numbers to this JSON file")
    args = p.parse_args(argv)

    _fix_mmap_threshold()
    if args.threads:
        torch.set_num_threads(args.threads)
    import gspo_mcore
    from gspo_mcore.ops import _backend

    isa = None
    if _backend.HAVE_EXTENSION:
        from gspo_mcore import _C

        if args.isa:
            _C.set_cpu_isa(args.isa)
        isa = _C.cpu_isa()
    print(f"gspo_mcore {gspo_mcore.__file__}  compiled ops: {_backend.compiled_enabled()}  isa: {isa}")
    thp = "?"
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        pass
    print(
        f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', '')!r} (torch madvises >= 2 MB "
        f"allocations into huge pages when 1)  /sys/kernel/mm/transparent_hugepage/enabled: {thp}"
    )
    try:
        load = "load average (1, 5, 15 min): " + " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        load = "load average: ?"
    print(f"CPU: {cpu_model()}  gspo ISA: {isa}  {load}")
    print(
        f"torch {torch.__version__}  threads {torch.get_num_threads()}  {platform.processor() or platform.machine()}"
        f"  cpus {os.cpu_count()}  parallel backend: {torch.__config__.parallel_info().splitlines()[0]}"
    )
    print("command: " + " ".join([os.path.basename(sys.executable)] + sys.argv))

    report = {
        "argv": sys.argv,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "isa": isa,
        "cpu": cpu_model(),
        "loadavg": list(os.getloadavg()),
        "cases": [],
    }
    for dname in args.dtype:
        for V in args.vocab:
            for T in args.tokens:
                case = Case(T, V, DTYPES[dname])
                out = run_case(
                    case,
                    args.approaches,
                    args.reps,
                    max(1, args.warmup),
                    args.compile_timeout,
                    not args.no_memory,
                    args.modes,
                )
                print_case(case, out, dname)
                sys.stdout.flush()
                report["cases"].append(
                    {
                        "T": T,
                        "V": V,
                        "dtype": dname,
                        "bytes": case.nbytes,
                        "one_read_s": out["one_read_s"],
                        "one_read_min_s": out["one_read_min_s"],
                        "one_read_kind": out["one_read_kind"],
                        "read": out["read"],
                        "fresh_write": out["fresh_write"],
                        "notes": out["notes"],
                        "results": [{"approach": a, "mode": m, **r} for (a, m), r in out["results"].items()],
                    }
                )
                del case, out
                gc.collect()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
