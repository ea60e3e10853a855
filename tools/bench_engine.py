"""Throughput of the in-process rollout engine against its recompute baseline and transformers' ``generate``.

One process, one Megatron rank, fp32 on the CPU (bf16 with ``--dtype bf16``). A small Qwen3-style model is
built from a ``config.json`` written on the fly; the learner's ``GPTModel`` is initialised from a seed, exported
to Hugging Face safetensors (``gspo_mcore.learner.hf``) and loaded by transformers, so all three sample from the SAME
weights and the SAME left-padded prompts (lengths drawn in ``--prompt-len``):

  kv            InProcessEngine over the learner's model with a KV cache (``learner.inference.decode_model``)
  recompute     InProcessEngine recomputing every sequence at every step (``kv_cache=False``); quadratic
                in the length, so it runs only up to ``--recompute-max-new`` new tokens
  transformers  ``model.generate`` with its KV cache (``do_sample``, no top-k / top-p)
  kv-megatron   the KV engine with the cache in Megatron's ``StaticInferenceContext`` (the path Transformer
                Engine's attention takes; ``MegatronDecodeModel(megatron_cache=True)``)

Shared prefill: ``--group-size G`` samples per prompt (``batch x G`` rows); ``--share-prefill both`` also runs
every in-process engine with ``share_prefill=False`` (one prefill row per sample, the ``-unshared`` twin), so
that the table compares one prefill per distinct prompt (the default) with one per sample. ``--model
config.json`` (a Qwen3 or Llama ``config.json``, e.g. SmolLM2's) replaces the small model's architecture (the
weights are still drawn from the seed). The header names the CPU and ``gspo_mcore._C.cpu_isa()``.

Every run samples at temperature 1 and ignores EOS, so each row gets exactly N new tokens; tokens/s is
``batch * N / seconds`` (the prefill included; with ``--repeat R``, the fastest of R runs, the engines
alternating). The engines also return per-token log-probs; transformers
is asked for none. Before timing, one short untimed call of each warms them up, and the KV engine's
log-probs are checked against a transformers forward over the same sequences (same weights).

Multi-turn (``--turns K``, the KV engine only): per length N, K-turn episodes (``generate_turns``: K policy turns
of N/K sampled tokens, each of the K-1 environment spans of ``--env-tokens`` E tokens prefilled onto the KV
cache with the turn's last token) against one single-turn generation of the same total, N + (K-1) E new
tokens; the table gives both times and their ratio (the issue's target: at most 1.3x).

Example:
  python tools/bench_engine.py --turns 4 --env-tokens 16 --engines kv --new-tokens 128 512 --threads 2
  python tools/bench_engine.py --new-tokens 32 128 512 --batch 64 --threads 2 --json bench_engine.json
  python tools/bench_engine.py --quick --json /tmp/quick.json     # a few seconds of work, for tests
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

ENGINES = ("kv", "recompute", "transformers", "kv-megatron")
DEFAULT_ENGINES = ("kv", "recompute", "transformers")


def model_config(
    *, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, max_positions: int
) -> dict:
    """A Qwen3 ``config.json`` (dense, untied embeddings)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "initializer_range": 0.02,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def export_hf(model, arch, cfg: dict, out_dir: str) -> None:
    """The Megatron model's weights as a Hugging Face directory (config.json + model.safetensors)."""
    from gspo_mcore.learner.hf.export import hf_state_dict
    from gspo_mcore.learner.hf.folder import write_safetensors

    named = hf_state_dict(model, arch)
    write_safetensors(out_dir, named.items(), [(k, t.numel() * t.element_size()) for k, t in named.items()])
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad, dtype=torch.long)  # (B, P)
    mask = torch.zeros((len(prompts), P), dtype=torch.long)  # (B, P)
    for b, p in enumerate(prompts):
        ids[b, P - len(p) :] = torch.tensor(p)
        mask[b, P - len(p) :] = 1
    return ids, mask


def run_engine(engine, prompts, n_new: int, group_size: int = 1) -> float:
    from gspo_mcore.rollout import SamplingParams

    params = SamplingParams(temperature=1.0, max_new_tokens=n_new, ignore_eos=True, seed=0)
    t0 = time.perf_counter()
    out = engine.generate_sync(prompts, group_size, params)
    dt = time.perf_counter() - t0
    bad = [s.prompt_index for g in out for s in g if len(s.response_ids) != n_new]
    if bad:
        raise RuntimeError(f"engine returned responses of the wrong length for prompts {bad[:5]}")
    return dt


def run_turns(engine, prompts, n_new: int, turns: int, env_tokens: int) -> float:
    """K-turn episodes of ``n_new // turns`` policy tokens per turn and ``env_tokens`` environment tokens between
    turns; the seconds."""
    from gspo_mcore.rollout import SamplingParams

    per_turn = n_new // turns
    params = SamplingParams(temperature=1.0, max_new_tokens=per_turn, ignore_eos=True, seed=0)
    done = [0] * len(prompts)

    def on_turns(ends):
        out = []
        for e in ends:
            done[e.row] += 1
            out.append(None if done[e.row] == turns else [3 + (e.row + i) % 50 for i in range(env_tokens)])
        return out

    total = max(len(p) for p in prompts) + per_turn * turns + env_tokens * (turns - 1) + 1
    t0 = time.perf_counter()
    turns_run = engine.generate_turns(
        prompts, params, keys=list(range(len(prompts))), max_total_tokens=total, on_turns=on_turns
    )
    asyncio.run(turns_run)  # the engine's turn loop is a coroutine (the RolloutEngine contract)
    dt = time.perf_counter() - t0
    if done != [turns] * len(prompts):
        raise RuntimeError("generate_turns: an episode did not run all its turns")
    return dt


def run_transformers(hf, ids, mask, n_new: int) -> float:
    t0 = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=n_new,
            min_new_tokens=n_new,
            pad_token_id=0,
        )
    dt = time.perf_counter() - t0
    if out.shape[1] != ids.shape[1] + n_new:
        raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens, expected {n_new}")
    return dt


def logprob_check(engine, hf, prompts, n_new: int) -> float:
    """Max |engine log-prob - transformers forward log-prob| over the engine's samples (tau = 1)."""
    from gspo_mcore.rollout import SamplingParams

    out = engine.generate_sync(
        prompts, 1, SamplingParams(temperature=1.0, max_new_tokens=n_new, ignore_eos=True, seed=1)
    )
    worst = 0.0
    with torch.no_grad():
        for g in out:
            s = g[0]
            seq = torch.tensor(s.prompt_ids + s.response_ids)[None]  # (1, L)
            logits = hf(input_ids=seq).logits[0, len(s.prompt_ids) - 1 : -1].float()  # (N, V)
            ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.response_ids)[:, None]).squeeze(1)
            worst = max(worst, float((ref - torch.tensor(s.response_logprobs)).abs().max()))
    return worst


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--batch", type=int, default=64, help="prompts per call (one sample each)")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[16, 48], metavar=("MIN", "MAX"))
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument(
        "--recompute-max-new",
        type=int,
        default=128,
        help="run the recompute engine only up to this many new tokens (its cost is quadratic)",
    )
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(DEFAULT_ENGINES))
    parser.add_argument("--group-size", type=int, default=1, help="samples per prompt (rows: batch x group size)")
    parser.add_argument(
        "--share-prefill",
        choices=("on", "off", "both"),
        default="on",
        help="in-process engines: one prefill per distinct prompt (on), per sample (off), or both side by side",
    )
    parser.add_argument(
        "--model", default=None, help="a Qwen3 / Llama config.json for the architecture (weights drawn from the seed)"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="time every engine and length this many times, alternating the engines, and report the fastest",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny model and batch, lengths 4 and 8 (tests)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument(
        "--dtype",
        default="fp32",
        choices=("fp32", "bf16"),
        help="bf16: the learner's model (and so the engines' decode) in bf16 (model.options.cpu_bf16; needs "
        "AVX512_BF16 or AMX-BF16); transformers still runs fp32 from the same (bf16-rounded) weights",
    )
    parser.add_argument("--turns", type=int, default=1, help="K > 1: also K-turn episodes vs one turn (KV engine)")
    parser.add_argument("--env-tokens", type=int, default=16, help="environment tokens between turns (--turns)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be >= 1, got {args.repeat}")
    if args.group_size < 1:
        parser.error(f"--group-size must be >= 1, got {args.group_size}")
    if args.quick:
        args.new_tokens, args.batch, args.prompt_len = [4, 8], 8, [3, 9]
        args.vocab, args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate = 128, 64, 2, 4, 2, 128
    if args.threads:
        torch.set_num_threads(args.threads)

    import megatron.core
    import transformers

    from gspo_mcore.learner.inference import MegatronDecodeModel, decode_model
    from gspo_mcore.learner.model import ModelOptions, build_model, unwrap
    from gspo_mcore.learner.model_config import load_hf_config
    from gspo_mcore.learner.parallel import ParallelConfig, destroy_parallel, init_parallel
    from gspo_mcore.rollout import InProcessEngine

    if args.model:
        with open(args.model) as f:
            cfg = json.load(f)
        args.vocab = cfg["vocab_size"]
    else:
        cfg = model_config(
            vocab=args.vocab,
            hidden=args.hidden,
            layers=args.layers,
            heads=args.heads,
            kv_heads=args.kv_heads,
            intermediate=args.intermediate,
            max_positions=max(1024, args.prompt_len[1] + max(args.new_tokens)),
        )
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.prompt_len[0], args.prompt_len[1] + 1, (args.batch,), generator=g).tolist()
    prompts = [torch.randint(3, args.vocab, (n,), generator=g).tolist() for n in lengths]
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f)
        arch = load_hf_config(tmp)
        parallel = ParallelConfig()
        layout = init_parallel(parallel, arch, seed=0)
        options = ModelOptions(cpu_bf16=True) if args.dtype == "bf16" else ModelOptions()
        model = build_model(arch, parallel, options, seed=0, wrap_ddp=False)
        export_hf(model, arch, cfg, tmp)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    decode_models = {
        "kv": decode_model(model, layout),
        "recompute": decode_model(model, layout, kv_cache=False),
        "kv-megatron": MegatronDecodeModel(unwrap(model[0]), layout, megatron_cache=True),
    }
    rows = args.batch * args.group_size
    engines = {}
    for name, dm in decode_models.items():
        for shared in {"on": [True], "off": [False], "both": [True, False]}[args.share_prefill]:
            engine = InProcessEngine(
                dm, eos_token_id=2, vocab_size=args.vocab, max_batch_size=rows, share_prefill=shared
            )
            engines[name if shared else f"{name}-unshared"] = engine
    if args.share_prefill == "off":  # the engines' names say what they run
        args.engines = [e if e == "transformers" else f"{e}-unshared" for e in args.engines]
    elif args.share_prefill == "both":
        args.engines = [x for e in args.engines for x in ([e] if e == "transformers" else [e, f"{e}-unshared"])]
    ids, mask = left_padded([p for p in prompts for _ in range(args.group_size)], 0)
    n_params = sum(p.numel() for p in hf.parameters())
    try:
        from gspo_mcore import _C

        cpu_isa = _C.cpu_isa()
    except ImportError as e:
        cpu_isa = f"unavailable ({e})"
    header = {
        "cpu": cpu_name(),
        "cpu_isa": cpu_isa,
        "isa": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "torch": torch.__version__,
        "megatron_core": megatron.core.__version__,
        "transformers": transformers.__version__,
        "model": {
            k: cfg[k]
            for k in (
                "vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "intermediate_size",
            )
        }
        | {"parameters": n_params},
        "batch": args.batch,
        "group_size": args.group_size,
        "share_prefill": args.share_prefill,
        "prompt_len": [min(lengths), max(lengths)],
        "dtype": "bfloat16" if args.dtype == "bf16" else "float32",
        "repeat": args.repeat,
    }
    for name, e in engines.items():  # warm-up, untimed
        if name in args.engines:
            run_engine(e, prompts, 2, args.group_size)
    if "transformers" in args.engines:
        run_transformers(hf, ids, mask, 2)
    kv = engines.get("kv") or engines["kv-unshared"]
    header["kv_vs_transformers_max_abs_logprob_diff"] = logprob_check(kv, hf, prompts[:8], 8)

    results = []
    for n_new in args.new_tokens:
        times: dict[str, list[float]] = {}
        for _ in range(args.repeat):  # the engines alternate, so that a change of load hits them alike
            for name in args.engines:
                if name.startswith("recompute") and n_new > args.recompute_max_new:
                    continue
                dt = (
                    run_transformers(hf, ids, mask, n_new)
                    if name == "transformers"
                    else run_engine(engines[name], prompts, n_new, args.group_size)
                )
                times.setdefault(name, []).append(dt)
                print(f"  {name} x {n_new} new tokens: {dt:.2f} s", file=sys.stderr, flush=True)
        for name in args.engines:
            if name not in times:
                results.append({"engine": name, "new_tokens": n_new, "skipped": "above --recompute-max-new"})
                continue
            dt = min(times[name])
            results.append(
                {
                    "engine": name,
                    "new_tokens": n_new,
                    "seconds": dt,
                    "seconds_all": times[name],
                    "tokens_per_s": rows * n_new / dt,
                    "ms_per_step": 1e3 * dt / n_new,
                }
            )
    if args.turns > 1:
        K, E = args.turns, args.env_tokens
        run_turns(kv, prompts, 2 * K, K, 2)  # warm-up, untimed
        for n_new in args.new_tokens:
            n_new = n_new - n_new % K
            same_total = n_new + (K - 1) * E
            times = {"turns": [], "single": []}
            for _ in range(args.repeat):
                times["turns"].append(run_turns(kv, prompts, n_new, K, E))
                times["single"].append(run_engine(kv, prompts, same_total))
            results.append(
                {
                    "engine": "kv-turns",
                    "turns": K,
                    "env_tokens": E,
                    "new_tokens": n_new,
                    "total_new_tokens": same_total,
                    "seconds": min(times["turns"]),
                    "single_turn_seconds": min(times["single"]),
                    "ratio": min(times["turns"]) / min(times["single"]),
                }
            )
    header["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    destroy_parallel()

    m = header["model"]
    print(
        f"bench_engine: {header['cpu']} (cpu_isa {header['cpu_isa']}, torch {header['isa']}), "
        f"{header['threads']} threads, load avg "
        f"{header['load_avg']} -> {header['load_avg_end']}; torch {header['torch']}, megatron-core "
        f"{header['megatron_core']}, transformers {header['transformers']}"
    )
    print(
        f"model: {cfg['model_type']} vocab {m['vocab_size']}, hidden {m['hidden_size']}, "
        f"{m['num_hidden_layers']} layers, "
        f"{m['num_attention_heads']}/{m['num_key_value_heads']} heads, ffn {m['intermediate_size']}, "
        f"{m['parameters'] / 1e6:.2f} M parameters, {header['dtype']}; batch {args.batch} x {args.group_size} samples, "
        f"prompts of "
        f"{header['prompt_len'][0]}-{header['prompt_len'][1]} tokens (left-padded)"
    )
    print(
        f"kv engine vs transformers forward, max |log-prob diff|: "
        f"{header['kv_vs_transformers_max_abs_logprob_diff']:.2e}"
    )
    print(f"{'new tokens':>10} | " + " | ".join(f"{e:>22}" for e in args.engines) + " | kv / transformers")
    for n_new in args.new_tokens:
        row = {r["engine"]: r for r in results if r["new_tokens"] == n_new}
        cells = [
            f"{row[e]['tokens_per_s']:>9.0f} tok/s {row[e]['ms_per_step']:>6.1f} ms"
            if "tokens_per_s" in row[e]
            else f"{'skipped':>22}"
            for e in args.engines
        ]
        ratio = (
            f"{row['kv']['tokens_per_s'] / row['transformers']['tokens_per_s']:.2f}x"
            if "kv" in row and "transformers" in row
            else "-"
        )
        print(f"{n_new:>10} | " + " | ".join(cells) + f" | {ratio}")
    print(
        "(ms = milliseconds per decoding step for the whole batch, prefill included"
        + (f"; the fastest of {args.repeat} runs each)" if args.repeat > 1 else ")")
    )
    turn_rows = [r for r in results if r["engine"] == "kv-turns"]
    if turn_rows:
        print(
            f"{'policy tok':>10} | {'K turns, E env tok':>18} | {'episodes s':>10} | {'1 turn, same total':>18} | ratio"
        )
        for r in turn_rows:
            print(
                f"{r['new_tokens']:>10} | {r['turns']:>8} x {r['env_tokens']:>7} | {r['seconds']:>10.3f} | "
                f"{r['single_turn_seconds']:>12.3f} ({r['total_new_tokens']}) | {r['ratio']:.2f}x"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
