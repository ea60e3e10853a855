"""Check the learner on the prepared SmolLM2 folder: its logits against transformers', and its speed.

    python -m examples.smollm2_arithmetic.check_model [--model DIR] [--bench] [--json FILE]

1 process (1 rank, gloo), float32. The learner builds the Megatron-Core ``GPTModel`` from the folder's
``config.json`` and loads the safetensors (``load_hf_weights``); transformers loads the same folder.
Both run a chat-formatted arithmetic prompt; the script reports max |Megatron - transformers| over all
logits, the largest |logit|, and whether the greedy next tokens agree at every position.
``--bench`` then times the learner's training forward+backward (GSPO loss, ``forward_backward``, no
optimizer step) on ``--samples`` sequences of ``--length`` tokens in one micro-batch, after one warm-up
step, and the forward-only log-probs (``forward_logprobs``) on the same batch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from examples.smollm2_arithmetic.prepare import default_out

PROMPT = "What is 7 plus 5? Answer with the number only."


def prompt_tokens(model_dir: str, prompt: str = PROMPT):
    """``[1, L]`` token ids of ``prompt`` as a user turn, with the assistant turn opened."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return torch.tensor([list(ids)], dtype=torch.long)


def compare_logits(model_dir: str, prompt: str = PROMPT) -> dict:
    """Megatron (1 rank) vs transformers logits on ``prompt``; the process keeps its groups for a bench."""
    import torch
    from transformers import AutoModelForCausalLM

    from gspo_mcore.learner.hf.load import load_hf_weights
    from gspo_mcore.learner.inference import logits_fn
    from gspo_mcore.learner.model import build_model
    from gspo_mcore.learner.model_config import load_hf_config
    from gspo_mcore.learner.parallel import ParallelConfig, init_parallel

    tokens = prompt_tokens(model_dir, prompt)  # [1, L]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(tokens).logits.float()  # [1, L, V]
    del hf
    arch = load_hf_config(model_dir)
    layout = init_parallel(ParallelConfig(), arch, seed=0)
    model = build_model(arch, ParallelConfig(), seed=None, wrap_ddp=False)
    load_hf_weights(model, model_dir)
    got = logits_fn(model, layout)(tokens)  # [1, L, V]
    return dict(
        num_tokens=int(tokens.shape[1]),
        max_abs_diff=float((got - want).abs().max()),
        max_abs_logit=float(want.abs().max()),
        greedy_agree=bool(torch.equal(got.argmax(-1), want.argmax(-1))),
    )


def bench(model_dir: str, *, samples: int, length: int, steps: int) -> dict:
    """Tokens/s of the learner's forward+backward and forward-only log-probs (1 rank; groups already up)."""
    import torch

    from gspo_mcore.algo.loss_config import LossConfig
    from gspo_mcore.learner.batching import TrainSample
    from gspo_mcore.learner.forward import forward_logprobs
    from gspo_mcore.learner.hf.load import load_hf_weights
    from gspo_mcore.learner.model import build_model
    from gspo_mcore.learner.model_config import load_hf_config
    from gspo_mcore.learner.parallel import ParallelConfig, current_layout
    from gspo_mcore.learner.step import forward_backward

    arch = load_hf_config(model_dir)
    layout = current_layout()
    model = build_model(arch, ParallelConfig(), seed=None)
    load_hf_weights(model, model_dir)
    g = torch.Generator().manual_seed(0)
    batch = []
    for _ in range(samples):
        mask = torch.ones(length, dtype=torch.int64)
        mask[: length // 4] = 0  # a prompt quarter
        batch.append(
            TrainSample(
                tokens=torch.randint(0, arch.vocab_size, (length,), generator=g),
                loss_mask=mask,
                advantage=float(torch.randn(1, generator=g)),
            )
        )
    max_tokens = samples * length  # one micro-batch
    t0 = time.perf_counter()
    logp = forward_logprobs(model, batch, layout, max_tokens=max_tokens)
    forward_s = time.perf_counter() - t0
    batch = [
        TrainSample(tokens=s.tokens, loss_mask=s.loss_mask, advantage=s.advantage, old_logprobs=lp)
        for s, lp in zip(batch, logp)
    ]
    times = []
    for step in range(1 + steps):
        for chunk in model:
            chunk.zero_grad_buffer()
        t0 = time.perf_counter()
        forward_backward(model, batch, layout, LossConfig(variant="gspo"), max_tokens=max_tokens)
        if step:
            times.append(time.perf_counter() - t0)
    tokens = samples * length
    return dict(
        samples=samples,
        length=length,
        threads=torch.get_num_threads(),
        steps=steps,
        fwd_bwd_seconds=sum(times) / len(times),
        fwd_bwd_tokens_per_s=tokens * len(times) / sum(times),
        forward_seconds=forward_s,
        forward_tokens_per_s=tokens / forward_s,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help=f"prepared folder (default {default_out()})")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--bench", action="store_true", help="also time forward+backward")
    parser.add_argument("--samples", type=int, default=8, help="sequences in the timed batch")
    parser.add_argument("--length", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=2, help="timed forward+backward steps (after 1 warm-up)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    model_dir = args.model or default_out()
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        print(
            f"error: no config.json in {model_dir}; run: python -m examples.smollm2_arithmetic.prepare", file=sys.stderr
        )
        return 2
    from gspo_mcore.learner.parallel import destroy_parallel

    result = dict(model=os.path.abspath(model_dir), logits=compare_logits(model_dir, args.prompt))
    print(json.dumps(result["logits"]))
    if args.bench:
        result["bench"] = bench(model_dir, samples=args.samples, length=args.length, steps=args.steps)
        print(json.dumps(result["bench"]))
    destroy_parallel()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
