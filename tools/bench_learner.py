"""Learner throughput: tokens/s of the training forward+backward (GSPO loss) per parallel layout.

    python tools/bench_learner.py                                # CPU: tiny dense/MoE, several layouts
    python tools/bench_learner.py --layouts 1,tp2 --model path/to/config.json --samples 64 --max-len 1024

Each layout runs in its own ``torch.distributed.run`` launch (gloo on CPU, NCCL on GPU). On a GPU the
model is bf16 and uses the Transformer Engine spec when ``transformer_engine`` imports. A step is one
mini-batch of ``--samples`` samples (lengths uniform in [max_len/2, max_len]) through ``forward_backward``
(no optimizer step); tokens/s counts every packed token of the mini-batch over the whole world, timed
over ``--steps`` steps after ``--warmup``. Micro-batches hold up to ``--max-tokens`` tokens per DP rank.
CPU ranks use ``--threads`` threads each (default 1: a layout with R ranks uses R cores).

Workload: by default every sample is its own random sequence (a quarter of it prompt, no loss on it). With
``--prompt-len P --response-len R --group-size G`` the samples come in groups of G that share a P-token prompt,
each followed by its own R tokens (the agent example: ``--group-size 4 --prompt-len 257 --response-len 61``).

Learner options, passed through to the installed learner (refused with a message naming the key when it lacks
them): ``--share-prompt on|off`` (``batch.share_prompt``: ``forward_backward(share_prompt=...)``),
``--dtype bf16`` (``model.options.cpu_bf16``: ``ModelOptions(cpu_bf16=True)``), ``--attention cpu|megatron``
(``model.options.cpu_attention``), ``--rms-norm compiled|torch`` (``model.options.cpu_rms_norm``), ``--swiglu
compiled|torch`` (``model.options.cpu_swiglu``), ``--split-linear on|off`` (``model.options.cpu_split_linear``),
``--rope compiled|torch`` (``model.options.cpu_rope``), ``--grad-accumulation one-pass|megatron``
(``model.options.cpu_grad_accumulation``);
``--fused-lm-head on|off`` (``loss.fused_lm_head``).

Efficiency: the learner's FLOP/s counts the matmuls of the tokens it computes (QKV, attention output
projection, MLP fc1 and fc2, LM head; forward + backward = 3x the forward's 2*M*K*N; attention scores,
norms and the loss not counted; a shared prompt counted once per group). In the same run, on rank 0 with the
same threads, plain GEMMs of those shapes (M = the tokens of one micro-batch; the forward product and the two
of its backward) are timed in fp32 and bf16, and the learner's FLOP/s per rank is given as a fraction of the
GEMM rate of its own dtype. In bf16 the JSON row also gives ``gemm_fraction_best``: against each product's faster
of plain ``torch.matmul`` and the row-split ``gspo_mcore.ops.gemm.mm_rows``, which the learner's linear layers
use (``gemm_gflops["bf16_best"]``). The header prints the CPU model and ``gspo_mcore._C.cpu_isa()``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time

TINY = {
    "dense": dict(
        model_type="qwen3",
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
}
TINY["moe"] = dict(
    TINY["dense"],
    model_type="qwen3_moe",
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=96,
    router_aux_loss_coef=0.001,
)

# name -> (world size, model, TP, PP, EP)
LAYOUTS = {
    "1": (1, "dense", 1, 1, 1),
    "dp2": (2, "dense", 1, 1, 1),
    "tp2": (2, "dense", 2, 1, 1),
    "pp2": (2, "dense", 1, 2, 1),
    "moe-1": (1, "moe", 1, 1, 1),
    "moe-ep2": (2, "moe", 1, 1, 2),
    "tp2pp2": (4, "dense", 2, 2, 1),
}
DEFAULT_LAYOUTS = "1,dp2,tp2,pp2,moe-1,moe-ep2"


MODEL_OPTION_FLAGS = (  # (flag as an args attribute, the model.options key, the value that turns the key on)
    ("attention", "cpu_attention", "cpu"),
    ("rms_norm", "cpu_rms_norm", "compiled"),
    ("swiglu", "cpu_swiglu", "compiled"),
    ("rope", "cpu_rope", "compiled"),
    ("split_linear", "cpu_split_linear", "on"),
    ("grad_accumulation", "cpu_grad_accumulation", "one-pass"),
)


def learner_options(args) -> tuple[dict, dict]:
    """The keywords for ``ModelOptions`` and ``forward_backward`` that ``--dtype`` and ``--share-prompt`` ask
    for; a ``SystemExit`` naming the key when the installed learner lacks it."""
    from gspo_mcore.learner.model import ModelOptions
    from gspo_mcore.learner.step import forward_backward

    model_kw, step_kw = {}, {}
    fields = {f.name for f in dataclasses.fields(ModelOptions)}

    def need(key: str, flag: str, hint: str) -> None:
        if key not in fields:
            raise SystemExit(
                f"{flag}: the installed learner has no model.options.{key} "
                f"(gspo_mcore.learner.model.ModelOptions); {hint}"
            )

    if args.dtype == "bf16":
        need("cpu_bf16", "--dtype bf16", "use --dtype fp32 or a learner with CPU bf16")
        model_kw["cpu_bf16"] = True
    for arg, key, on in MODEL_OPTION_FLAGS:
        flag = "--" + arg.replace("_", "-")
        value = getattr(args, arg, None)
        if value is not None:
            need(key, f"{flag} {value}", f"leave {flag} out")
            model_kw[key] = value == on
    if args.share_prompt is not None:
        if "share_prompt" not in inspect.signature(forward_backward).parameters:
            raise SystemExit(
                f"--share-prompt {args.share_prompt}: the installed learner has no batch.share_prompt "
                "(gspo_mcore.learner.step.forward_backward(share_prompt=...)); leave --share-prompt out"
            )
        step_kw["share_prompt"] = args.share_prompt == "on"
    return model_kw, step_kw


def loss_options(args) -> dict:
    """The ``LossConfig`` keywords ``--fused-lm-head`` asks for; a ``SystemExit`` naming the key when the
    installed learner lacks it."""
    from gspo_mcore.algo.loss_config import LossConfig

    if getattr(args, "fused_lm_head", None) is None:
        return {}
    if "fused_lm_head" not in {f.name for f in dataclasses.fields(LossConfig)}:
        raise SystemExit(
            f"--fused-lm-head {args.fused_lm_head}: the installed learner has no loss.fused_lm_head; leave it out"
        )
    return {"fused_lm_head": args.fused_lm_head == "on"}


def make_samples(args, vocab_size: int, generator):
    """The mini-batch: ``(samples, computed tokens)``, the second counting a prompt shared by a group once when
    ``--share-prompt on`` (what the learner computes, micro-batch padding and split groups aside)."""
    import torch

    from gspo_mcore.learner.batching import TrainSample

    samples, computed = [], 0
    shared = args.prompt_len is not None
    for i in range(args.samples):
        if shared:
            if i % args.group_size == 0:
                prompt = torch.randint(0, vocab_size, (args.prompt_len,), generator=generator)
                computed += args.prompt_len if args.share_prompt == "on" else 0
            tokens = torch.cat([prompt, torch.randint(0, vocab_size, (args.response_len,), generator=generator)])
            n_prompt = args.prompt_len
            computed += args.response_len + (0 if args.share_prompt == "on" else args.prompt_len)
        else:
            length = int(torch.randint(args.max_len // 2, args.max_len + 1, (1,), generator=generator))
            tokens = torch.randint(0, vocab_size, (length,), generator=generator)
            n_prompt = length // 4
            computed += length
        length = len(tokens)
        mask = torch.ones(length, dtype=torch.int64)
        mask[:n_prompt] = 0
        advantage = float(torch.randn(1, generator=generator))
        samples.append(
            TrainSample(
                tokens=tokens, loss_mask=mask, advantage=advantage, old_logprobs=torch.full((length - 1,), -5.0)
            )
        )
    return samples, computed


def matmul_shapes(arch) -> list[tuple[str, int, int, int]]:
    """``(name, K, N, count)`` of the model's matmuls per token: ``count`` of them, each ``[M, K] @ [K, N]``."""
    H, L = arch.hidden_size, arch.num_hidden_layers
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    gated = arch.hidden_act == "silu"
    if arch.num_experts:
        F, per_token = arch.moe_intermediate_size, arch.num_experts_per_tok
    else:
        F, per_token = arch.intermediate_size, 1
    return [
        ("qkv", H, q + 2 * kv, L),
        ("proj", q, H, L),
        ("fc1", H, (2 if gated else 1) * F, L * per_token),
        ("fc2", F, H, L * per_token),
        ("lm_head", H, arch.vocab_size, 1),
    ]


def model_flops(arch, tokens: int) -> float:
    """Forward + backward matmul FLOPs of ``tokens`` tokens: 3 x 2 x tokens x sum(K x N x count)."""
    return 6.0 * tokens * sum(k * n * c for _, k, n, c in matmul_shapes(arch))


def gemm_rate(arch, M: int, dtype, repeat: int = 3) -> float:
    """FLOP/s of plain ``torch.matmul`` at the model's shapes for ``M`` tokens: per shape the forward product
    ``[M, K] @ [K, N]`` and its backward's two (``dY @ W^T``, ``X^T @ dY``), the fastest of ``repeat``; all
    shapes weighted by their count per token."""
    import torch

    flops = seconds = 0.0
    g = torch.Generator().manual_seed(0)
    for _, K, N, count in matmul_shapes(arch):
        x, w = torch.randn(M, K, generator=g).to(dtype), torch.randn(K, N, generator=g).to(dtype)
        dy = torch.randn(M, N, generator=g).to(dtype)
        best = float("inf")
        for r in range(repeat + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            x @ w
            dy @ w.T
            x.T @ dy
            dt = time.perf_counter() - t0
            if r:
                best = min(best, dt)
        flops += count * 6.0 * M * K * N
        seconds += count * best
    return flops / seconds


def best_gemm_rate(arch, M: int, dtype, repeat: int = 3) -> float:
    """As :func:`gemm_rate`, but each of the three products the faster of plain ``torch.matmul`` and
    ``gspo_mcore.ops.gemm.mm_rows`` (rows split across the threads): the best this machine is known to do."""
    import torch

    from gspo_mcore.ops.gemm import mm_rows

    def timed(fn, a, b):
        best = float("inf")
        for r in range(repeat + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            fn(a, b)
            if r:
                best = min(best, time.perf_counter() - t0)
        return best

    flops = seconds = 0.0
    g = torch.Generator().manual_seed(0)
    for _, K, N, count in matmul_shapes(arch):
        x, w = torch.randn(M, K, generator=g).to(dtype), torch.randn(K, N, generator=g).to(dtype)
        dy = torch.randn(M, N, generator=g).to(dtype)
        for a, b in ((x, w), (dy, w.T), (x.T, dy)):
            seconds += count * min(timed(torch.matmul, a, b), timed(mm_rows, a, b))
        flops += count * 6.0 * M * K * N
    return flops / seconds


def cpu_header() -> dict:
    """The CPU model and the kernels' instruction set (``gspo_mcore._C.cpu_isa()``)."""
    import platform

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        from gspo_mcore import _C

        isa = _C.cpu_isa()
    except ImportError as e:
        isa = f"unavailable ({e})"
    return {"cpu": cpu, "cpu_isa": isa}


def worker(args):
    import torch
    import torch.distributed as dist

    from gspo_mcore.algo.loss_config import LossConfig
    from gspo_mcore.learner.model import ModelOptions, build_model, have_transformer_engine
    from gspo_mcore.learner.model_config import load_hf_config
    from gspo_mcore.learner.parallel import ParallelConfig, destroy_parallel, init_parallel
    from gspo_mcore.learner.schedule import uses_transformer_engine
    from gspo_mcore.learner.step import forward_backward

    torch.set_num_threads(args.threads)
    _, model_name, tp, pp, ep = LAYOUTS[args.layout]
    arch = load_hf_config(args.model if args.model else TINY[model_name])
    pc = ParallelConfig(tensor=tp, pipeline=pp, expert=ep)
    layout = init_parallel(pc, arch, seed=1)
    model_kw, step_kw = learner_options(args)
    model = build_model(arch, pc, ModelOptions(**model_kw), seed=1)
    samples, computed_tokens = make_samples(args, arch.vocab_size, torch.Generator().manual_seed(0))
    total_tokens = sum(s.length for s in samples)
    loss_cfg = LossConfig(variant="gspo", **loss_options(args))
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    profiler = None
    for step in range(args.warmup + args.steps):
        if step == args.warmup and args.profile and dist.get_rank() == 0:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
            profiler.__enter__()
        for chunk in model:
            chunk.zero_grad_buffer()
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        metrics = forward_backward(
            model, samples, layout, loss_cfg, max_tokens=args.max_tokens, packing=args.packing, **step_kw
        )
        sync()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    if profiler is not None:
        profiler.__exit__(None, None, None)
        table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        by_shape = profiler.key_averages(group_by_input_shape=True)
        table += "\n" + by_shape.table(sort_by="self_cpu_time_total", row_limit=40, max_shapes_column_width=90)
        with open(args.profile, "a") as f:
            f.write(
                f"== layout {args.layout}, {args.steps} timed steps, dtype {args.dtype}, share_prompt "
                f"{args.share_prompt}, attention {args.attention}\n{table}\n"
            )
    t = torch.tensor([sum(times) / len(times)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    gemm = {}
    if dist.get_rank() == 0 and not torch.cuda.is_available():  # the GEMM rates, this rank's threads
        M = min(args.max_tokens, computed_tokens)
        gemm = {name: gemm_rate(arch, M, dtype) for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
        if importlib.util.find_spec("gspo_mcore.ops.gemm") is not None:  # the best known: plain or rows split
            gemm["bf16_best"] = best_gemm_rate(arch, M, torch.bfloat16)
    dist.barrier()
    if dist.get_rank() == 0:
        dtype = str(model[0].config.params_dtype).removeprefix("torch.")
        flops_per_rank = model_flops(arch, computed_tokens) / float(t) / layout.world_size
        own = gemm.get({"float32": "fp32", "bfloat16": "bf16"}.get(dtype, ""))
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
        row = dict(
            layout=args.layout,
            world=layout.world_size,
            model=args.model or model_name,
            device="cuda" if torch.cuda.is_available() else "cpu",
            te=have_transformer_engine(),
            dtype=dtype,
            share_prompt=args.share_prompt,
            **{arg: getattr(args, arg, None) for arg, _, _ in MODEL_OPTION_FLAGS},
            fused_lm_head=args.fused_lm_head,
            samples=args.samples,
            packing="thd" if uses_transformer_engine(model) else args.packing,
            tokens=total_tokens,
            microbatches=int(metrics["num_microbatches"]),
            step_s=float(t),
            tokens_per_s=total_tokens / float(t),
            computed_tokens=computed_tokens,
            computed_tokens_per_s=computed_tokens / float(t),
            gflops_per_rank=flops_per_rank / 1e9,
            gemm_gflops={k: v / 1e9 for k, v in gemm.items()},
            gemm_fraction=flops_per_rank / own if own else None,
            gemm_fraction_best=(
                flops_per_rank / max(own, gemm["bf16_best"])
                if own and "bf16_best" in gemm and dtype == "bfloat16"
                else None
            ),
            peak_gib=peak,
        )
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    destroy_parallel()


def launch(args, name, out):
    world = LAYOUTS[name][0]
    from gspo_mcore.platform.launch import torchrun_prefix

    cmd = [
        *torchrun_prefix(world),
        os.path.abspath(__file__),
        "--worker",
        "--layout",
        name,
        "--out",
        out,
    ]
    keys = ("model", "samples", "max_len", "max_tokens", "steps", "warmup", "threads", "packing", "dtype", "profile")
    for key in (
        keys
        + tuple(arg for arg, _, _ in MODEL_OPTION_FLAGS)
        + (
            "share_prompt",
            "fused_lm_head",
            "group_size",
            "prompt_len",
            "response_len",
        )
    ):
        value = getattr(args, key)
        if value is not None:
            cmd += [f"--{key.replace('_', '-')}", str(value)]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        print(f"{name}: FAILED\n{proc.stderr[-3000:]}", file=sys.stderr)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default=DEFAULT_LAYOUTS, help=f"comma-separated, from {sorted(LAYOUTS)}")
    parser.add_argument("--model", default=None, help="a config.json (default: the tiny dense/MoE toy models)")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=1024, help="token budget of a micro-batch")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--packing",
        default="padded",
        choices=("padded", "block_diagonal"),
        help="CPU micro-batch layout (with Transformer Engine: always THD)",
    )
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per rank (OMP_NUM_THREADS)")
    parser.add_argument(
        "--dtype",
        default="fp32",
        choices=("fp32", "bf16"),
        help="on a CPU, the learner's model dtype: bf16 is model.options.cpu_bf16 (refused when the learner lacks it)",
    )
    parser.add_argument(
        "--share-prompt",
        default=None,
        choices=("on", "off"),
        help="batch.share_prompt passed to forward_backward (default: leave it to the learner; refused when the "
        "learner lacks it)",
    )
    parser.add_argument(
        "--attention",
        default=None,
        choices=("cpu", "megatron"),
        help="on a CPU, model.options.cpu_attention: cpu (gspo_mcore.platform.cpu_attention) or megatron "
        "(DotProductAttention's own forward); default: leave it to the learner; refused when the learner lacks it",
    )
    parser.add_argument(
        "--rms-norm",
        default=None,
        choices=("compiled", "torch"),
        help="on a CPU, model.options.cpu_rms_norm: compiled (gspo_mcore.platform.cpu_norm) or torch "
        "(torch.nn.RMSNorm); default: leave it to the learner; refused when the learner lacks it",
    )
    parser.add_argument(
        "--swiglu",
        default=None,
        choices=("compiled", "torch"),
        help="on a CPU, model.options.cpu_swiglu: compiled (gspo_mcore.platform.cpu_mlp) or torch (Megatron's MLP "
        "forward); default: leave it to the learner; refused when the learner lacks it",
    )
    parser.add_argument(
        "--rope",
        default=None,
        choices=("compiled", "torch"),
        help="on a CPU, model.options.cpu_rope: compiled (gspo_mcore.platform.cpu_rope) or torch (Megatron's unfused "
        "RoPE); default: leave it to the learner; refused when the learner lacks it",
    )
    parser.add_argument(
        "--split-linear",
        default=None,
        choices=("on", "off"),
        help="on a CPU, model.options.cpu_split_linear: the linear layers' bf16 products split by rows across "
        "threads (gspo_mcore.platform.cpu_linear) or Megatron's torch.matmul; default: leave it to the learner; "
        "refused when the learner lacks it",
    )
    parser.add_argument(
        "--grad-accumulation",
        default=None,
        choices=("one-pass", "megatron"),
        help="on a CPU, model.options.cpu_grad_accumulation: bf16 gradients added into the float32 buffers in one "
        "pass (gspo_mcore.platform.cpu_grad_accumulation) or by Megatron's main_grad.add_; default: leave it to "
        "the learner; refused when the learner lacks it",
    )
    parser.add_argument(
        "--fused-lm-head",
        default=None,
        choices=("on", "off"),
        help="loss.fused_lm_head: log-probs from the hidden states in vocabulary chunks, no [T, V] logits "
        "(default: the learner's default; refused when the learner lacks it)",
    )
    parser.add_argument("--group-size", type=int, default=1, help="samples per shared prompt (with --prompt-len)")
    parser.add_argument("--prompt-len", type=int, default=None, help="groups share a prompt of this many tokens")
    parser.add_argument("--response-len", type=int, default=None, help="tokens after the prompt (with --prompt-len)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument(
        "--profile",
        default=None,
        help="write torch.profiler's table of rank 0's timed steps (ops by self CPU time) to this file, one section "
        "per layout; the profiler's overhead is in that run's times, so take figures from a run without it",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if (args.prompt_len is None) != (args.response_len is None):
        parser.error("--prompt-len and --response-len go together")
    if args.prompt_len is not None and (args.prompt_len < 1 or args.response_len < 1 or args.group_size < 1):
        parser.error("--prompt-len, --response-len and --group-size must be >= 1")
    if args.prompt_len is None and args.group_size != 1:
        parser.error("--group-size needs --prompt-len and --response-len")
    learner_options(args)  # refuse what the installed learner lacks before any launch
    loss_options(args)
    names = args.layouts.split(",")
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layouts {unknown}; known: {sorted(LAYOUTS)}")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.jsonl")
        open(out, "w").close()
        for name in names:
            launch(args, name, out)
        with open(out) as f:
            rows = [json.loads(line) for line in f]
    header = cpu_header() | {"threads": args.threads, "load_avg": [round(x, 2) for x in os.getloadavg()]}
    print(f"bench_learner: {header['cpu']}, cpu_isa {header['cpu_isa']}, {args.threads} threads per rank")
    print(
        f"{'layout':<9} {'ranks':>5} {'device':>6} {'dtype':>8} {'share':>5} {'attn':>8} {'norm':>8} {'swiglu':>8} "
        f"{'fused':>5} "
        f"{'packing':>14} {'tokens':>7} "
        f"{'computed':>8} {'mb/rank':>7} {'step ms':>9} {'tokens/s':>10} {'comp tok/s':>10} {'GFLOP/s/rank':>12} "
        f"{'GEMM fp32':>9} {'GEMM bf16':>9} {'of GEMM':>7}"
    )
    for r in rows:
        gemm = r["gemm_gflops"]
        frac = "-" if r["gemm_fraction"] is None else f"{100 * r['gemm_fraction']:.0f}%"
        print(
            f"{r['layout']:<9} {r['world']:>5} {r['device']:>6} {r['dtype']:>8} {r['share_prompt'] or '-':>5} "
            f"{r.get('attention') or '-':>8} {r.get('rms_norm') or '-':>8} {r.get('swiglu') or '-':>8} "
            f"{r.get('fused_lm_head') or '-':>5} "
            f"{r['packing']:>14} {r['tokens']:>7} {r['computed_tokens']:>8} {r['microbatches']:>7} "
            f"{1000 * r['step_s']:>9.1f} {r['tokens_per_s']:>10.0f} {r['computed_tokens_per_s']:>10.0f} "
            f"{r['gflops_per_rank']:>12.1f} {gemm.get('fp32', float('nan')):>9.1f} "
            f"{gemm.get('bf16', float('nan')):>9.1f} {frac:>7}"
        )
    print(json.dumps({"header": header, "rows": rows}))


if __name__ == "__main__":
    main()
