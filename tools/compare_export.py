"""Check an exported Hugging Face folder against the training checkpoint it came from: the same logits.

    python tools/compare_export.py --hf hf/x [--checkpoint runs/x/checkpoints/step_399] [--prompts data.jsonl]

Loads the checkpoint into the learner's Megatron model on this one process, through the trainer's own loader
(``--checkpoint``; default: the one named in the folder's ``gspo_mcore_export.json``), and the folder with
transformers, runs both on the same tokens (the ``prompt`` field of the first ``--num`` rows of ``--prompts``,
tokenized by the folder's tokenizer, else random token ids) in float32, and prints the largest absolute
logit difference and the largest logit. Exit status 1 when the difference exceeds ``--rtol`` times the
largest logit (float32 rounding grows with the logits' size: the converter's tests bound 7e-6 at logits of
about 3.5, i.e. 2e-6 relative).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tokens_for(hf_dir: str, prompts: str | None, num: int, vocab: int):
    import torch

    if not prompts:
        return torch.randint(0, vocab, (num, 24), generator=torch.Generator().manual_seed(0))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    with open(prompts) as f:
        texts = [json.loads(line)["prompt"] for line in f if line.strip()][:num]
    ids = [tok(t)["input_ids"] for t in texts]
    width = min(len(i) for i in ids)
    return torch.tensor([i[:width] for i in ids])


def learner_logits(checkpoint: str, toks):
    from gspo_mcore.convert.export_source import locate
    from gspo_mcore.convert.mcore_checkpoint import load_model
    from gspo_mcore.learner.hf.folder import read_config
    from gspo_mcore.learner.inference import logits_fn
    from gspo_mcore.learner.model import build_model
    from gspo_mcore.learner.model_config import load_hf_config
    from gspo_mcore.learner.parallel import ParallelConfig, destroy_parallel, init_parallel

    source = locate(checkpoint, verify="size")
    arch = load_hf_config(read_config(source.side_dir))
    layout = init_parallel(ParallelConfig(), arch)
    try:
        model = build_model(arch, ParallelConfig(), seed=None, wrap_ddp=False)
        load_model(model, source)
        return logits_fn(model, layout)(toks), source
    finally:
        destroy_parallel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf", required=True, help="the exported Hugging Face folder")
    parser.add_argument("--checkpoint", help="the training checkpoint (default: gspo_mcore_export.json's)")
    parser.add_argument("--prompts", help="JSONL with a 'prompt' field (default: random token ids)")
    parser.add_argument("--num", type=int, default=8, help="sequences compared (default 8)")
    parser.add_argument(
        "--rtol", type=float, default=2e-6, help="largest accepted |difference| / max|logit| (default 2e-6)"
    )
    args = parser.parse_args(argv)
    checkpoint = args.checkpoint
    if checkpoint is None:
        meta = os.path.join(args.hf, "gspo_mcore_export.json")
        if not os.path.isfile(meta):
            print(f"error: {meta} does not exist: pass --checkpoint", file=sys.stderr)
            return 2
        with open(meta) as f:
            checkpoint = json.load(f)["checkpoint"]
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.float32).eval()
    toks = tokens_for(args.hf, args.prompts, args.num, model.config.vocab_size)
    with torch.no_grad():
        hf = model(toks).logits.float()
    ref, source = learner_logits(checkpoint, toks)
    diff, scale = float((hf - ref).abs().max()), float(ref.abs().max())
    step = source.training.step if source.training is not None else "?"
    print(
        f"{args.hf} vs {checkpoint} (step {step}): tokens {tuple(toks.shape)}, max|logit| {scale:.3f}, "
        f"max|transformers - learner| {diff:.2e} ({diff / scale:.1e} of max|logit|; rtol {args.rtol:.0e})"
    )
    return 0 if diff <= args.rtol * scale else 1


if __name__ == "__main__":  # the checkpoint reader may re-import this module in a helper process
    sys.exit(main())
