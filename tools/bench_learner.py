"""Learner throughput: tokens/s of the training forward+backward (GSPO loss) per parallel layout.

    python tools/bench_learner.py                                # CPU: tiny dense/MoE, several layouts
    python tools/bench_learner.py --layouts 1,tp2 --model path/to/config.json --samples 64 --max-len 1024

Each layout runs in its own ``torch.distributed.run`` launch (gloo on CPU, NCCL on GPU). On a GPU the
model is bf16 and uses the Transformer Engine spec when ``transformer_engine`` imports. A step is one
mini-batch of ``--samples`` samples (lengths uniform in [max_len/2, max_len]) through ``forward_backward``
(no optimizer step); tokens/s counts every packed token of the mini-batch over the whole world, timed
over ``--steps`` steps after ``--warmup``. Micro-batches hold up to ``--max-tokens`` tokens per DP rank.
CPU ranks use ``--threads`` threads each (default 1: a layout with R ranks uses R cores).
"""

from __future__ import annotations

import argparse
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


def worker(args):
    import torch
    import torch.distributed as dist

    from gspo_mcore.algo.loss_config import LossConfig
    from gspo_mcore.learner.batching import TrainSample
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
    model = build_model(arch, pc, ModelOptions(cpu_bf16=True) if args.cpu_bf16 else ModelOptions(), seed=1)
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(args.samples):
        length = int(torch.randint(args.max_len // 2, args.max_len + 1, (1,), generator=g))
        tokens = torch.randint(0, arch.vocab_size, (length,), generator=g)
        mask = torch.ones(length, dtype=torch.int64)
        mask[: length // 4] = 0
        samples.append(
            TrainSample(
                tokens=tokens,
                loss_mask=mask,
                advantage=float(torch.randn(1, generator=g)),
                old_logprobs=torch.full((length - 1,), -5.0),
            )
        )
    total_tokens = sum(s.length for s in samples)
    loss_cfg = LossConfig(variant="gspo")
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for step in range(args.warmup + args.steps):
        for chunk in model:
            chunk.zero_grad_buffer()
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        metrics = forward_backward(model, samples, layout, loss_cfg, max_tokens=args.max_tokens, packing=args.packing)
        sync()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    t = torch.tensor([sum(times) / len(times)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
        row = dict(
            layout=args.layout,
            world=layout.world_size,
            model=args.model or model_name,
            device="cuda" if torch.cuda.is_available() else "cpu",
            te=have_transformer_engine(),
            dtype=str(model[0].config.params_dtype).removeprefix("torch."),
            samples=args.samples,
            packing="thd" if uses_transformer_engine(model) else args.packing,
            tokens=total_tokens,
            microbatches=int(metrics["num_microbatches"]),
            step_s=float(t),
            tokens_per_s=total_tokens / float(t),
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
    for key in ("model", "samples", "max_len", "max_tokens", "steps", "warmup", "threads", "packing"):
        value = getattr(args, key)
        if value is not None:
            cmd += [f"--{key.replace('_', '-')}", str(value)]
    if args.cpu_bf16:
        cmd.append("--cpu-bf16")
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
        "--cpu-bf16",
        action="store_true",
        help="on a CPU, the model in bf16 (model.options.cpu_bf16; needs AVX512_BF16 or AMX-BF16)",
    )
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
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
    print(
        f"{'layout':<9} {'ranks':>5} {'device':>6} {'dtype':>8} {'packing':>14} {'tokens':>7} {'mb/rank':>7} "
        f"{'step ms':>9} {'tokens/s':>10}"
    )
    for r in rows:
        print(
            f"{r['layout']:<9} {r['world']:>5} {r['device']:>6} {r['dtype']:>8} {r['packing']:>14} {r['tokens']:>7} "
            f"{r['microbatches']:>7} {1000 * r['step_s']:>9.1f} {r['tokens_per_s']:>10.0f}"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
