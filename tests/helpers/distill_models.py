"""Tiny Hugging Face teacher directories for the distillation tests: the tiny task's tokenizer and a Qwen3
``config.json`` (examples/tiny/task.py), with weights drawn from a seed by transformers itself (no download),
saved as safetensors. Imports transformers only when called."""

from __future__ import annotations

import json
import os

import torch


def write_teacher(out_dir: str, *, seed: int = 0, **config) -> str:
    """Write a teacher folder at ``out_dir`` (``config``: overrides of the tiny model's ``config.json``, e.g.
    ``num_hidden_layers=3``); returns it. Matrices ``N(0, 0.3)`` so the teacher is far from uniform."""
    import transformers

    from examples.tiny.task import make_tokenizer, model_config

    os.makedirs(out_dir, exist_ok=True)
    cfg = model_config() | config
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.3 * noise)
    model.save_pretrained(out_dir, safe_serialization=True)
    make_tokenizer(out_dir)
    with open(os.path.join(out_dir, "config.json"), "w") as f:  # the plain config, as prepare() writes it
        json.dump(cfg, f, indent=2)
    return out_dir


def hf_logprobs(model_dir: str, tokens: list[list[int]], temperature: float = 1.0) -> list[torch.Tensor]:
    """transformers' own float64 log-probs of ``tokens[1:]`` for each sequence (the independent check)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    out = []
    with torch.no_grad():
        for ids in tokens:
            x = torch.tensor([ids])
            logits = model(x).logits[0, :-1].double() / temperature
            out.append(torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0])
    return out
