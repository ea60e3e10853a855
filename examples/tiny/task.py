"""The tiny job's synthetic verifiable task: reverse a short string of digits.

Prompt ``"rev:4071>"`` -> answer ``"1704"`` followed by the end-of-sequence token. The reward gives
partial credit: 0.2 for an answer of the right length, plus 0.8 times the fraction of positions with the
right digit. Everything is generated on the fly (the dataset, a character-level tokenizer saved in
Hugging Face format, and a tiny Qwen3-style ``config.json``), so the job needs no download.
"""

from __future__ import annotations

import json
import os
import random

SPECIALS = ["<pad>", "<s>", "</s>"]
CHARS = list("0123456789") + list("abcdefghijklmnopqrstuvwxyz") + list(":>=+- ")
VOCAB_SIZE = 64  # padded: ids beyond the tokenizer's are never a correct answer, the policy learns to avoid them


def make_tokenizer(out_dir: str):
    """A character-level tokenizer (PreTrainedTokenizerFast) saved to ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    assert len(vocab) <= VOCAB_SIZE
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out_dir)
    return fast


def model_config(*, moe: bool = False, layers: int = 2, hidden: int = 64) -> dict:
    """A tiny Qwen3 (or Qwen3-MoE) ``config.json``."""
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if moe else "qwen3",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "max_position_embeddings": 64,
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
    if moe:
        cfg.update({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": hidden,
                    "norm_topk_prob": True, "router_aux_loss_coef": 0.001, "decoder_sparse_step": 1,
                    "mlp_only_layers": []})
    return cfg


def make_rows(n: int, *, digits: int = 3, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        s = "".join(rng.choice("0123456789") for _ in range(digits))
        rows.append({"prompt": f"rev:{s}>", "answer": s[::-1]})
    return rows


def prepare(out_dir: str, *, moe: bool = False, num_prompts: int = 4096, digits: int = 3, seed: int = 0) -> dict:
    """Write the model directory (config.json + tokenizer) and the prompt dataset; return their paths."""
    model_dir = os.path.join(out_dir, "model_moe" if moe else "model")
    os.makedirs(model_dir, exist_ok=True)
    make_tokenizer(model_dir)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(model_config(moe=moe), f, indent=2)
    data_path = os.path.join(out_dir, "prompts.jsonl")
    with open(data_path, "w") as f:
        for row in make_rows(num_prompts, digits=digits, seed=seed):
            f.write(json.dumps(row) + "\n")
    return {"model_dir": model_dir, "data_path": data_path}


def reward(response: str, metadata) -> float:
    """Partial credit: 0.2 for the right length, plus 0.8 x the fraction of right digits."""
    answer = str(metadata["answer"])
    got = response.strip()
    right = sum(a == b for a, b in zip(got, answer))
    return (float(len(got) == len(answer)) + 4.0 * right / len(answer)) / 5.0
