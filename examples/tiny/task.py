"""The tiny job's synthetic verifiable task: reverse a short string of digits.

Prompt ``"rev:407>"`` -> answer ``"704"`` followed by the end-of-sequence token. The reward gives
partial credit: 0.2 for an answer of the right length, plus 0.8 times the fraction of positions with the
right digit. Everything is generated on the fly (the dataset, a character-level tokenizer saved in
Hugging Face format, and a tiny Qwen3-style ``config.json``), so the job needs no download.

Held out: a fixed tenth of all digit strings never appears in the training prompts; the held-out file
holds exactly those, so evaluation measures the reversal on strings the policy was never trained on.

Every token the model can sample except EOS decodes to exactly one visible character (the pad and BOS
tokens are the ordinary characters ``_`` and ``^``, and the ids past the task's characters are the capital
letters), and the reward does not strip whitespace: a response has the right length only when it is three
tokens followed by EOS, so the length credit is earned only by stopping. (An earlier version, with
multi-character and invisible tokens, was gamed by the policy: ``"<s>"`` is three characters long.)
"""

from __future__ import annotations

import json
import os
import random

SPECIALS = ["_", "^", "</s>"]  # pad, BOS (single visible characters, not special tokens), EOS
CHARS = list("0123456789") + list("abcdefghijklmnopqrstuvwxyz") + list(":>=+- ")
FILLERS = list("ABCDEFGHIJKLMNOPQRS")  # the rest of the embedding table: never a right answer
VOCAB_SIZE = 64


def make_tokenizer(out_dir: str):
    """A character-level tokenizer (PreTrainedTokenizerFast) saved to ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS + FILLERS)}
    assert len(vocab) == VOCAB_SIZE
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIALS[0]))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    # only EOS is special (dropped when a response is decoded)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
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
        cfg.update(
            {
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": hidden,
                "norm_topk_prob": True,
                "router_aux_loss_coef": 0.001,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
            }
        )
    return cfg


HELD_OUT_FRACTION = 0.1


def held_out_strings(digits: int = 3) -> list[str]:
    """The digit strings kept out of training: a fixed tenth of all ``10**digits``, the same for every seed."""
    every = [f"{i:0{digits}d}" for i in range(10**digits)]
    random.Random(12345).shuffle(every)
    return sorted(every[: max(1, int(len(every) * HELD_OUT_FRACTION))])


def _row(s: str) -> dict:
    return {"prompt": f"rev:{s}>", "answer": s[::-1]}


def make_rows(n: int, *, digits: int = 3, seed: int = 0) -> list[dict]:
    """``n`` training rows, drawn with replacement from the strings that are not held out."""
    rng = random.Random(seed)
    held = set(held_out_strings(digits))
    rows = []
    while len(rows) < n:
        s = "".join(rng.choice("0123456789") for _ in range(digits))
        if s not in held:
            rows.append(_row(s))
    return rows


def held_out_rows(digits: int = 3) -> list[dict]:
    return [_row(s) for s in held_out_strings(digits)]


def prepare(out_dir: str, *, moe: bool = False, num_prompts: int = 4096, digits: int = 3, seed: int = 0) -> dict:
    """Write the model directory (config.json + tokenizer), the training prompts and the held-out prompts;
    return their paths."""
    model_dir = os.path.join(out_dir, "model_moe" if moe else "model")
    os.makedirs(model_dir, exist_ok=True)
    make_tokenizer(model_dir)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(model_config(moe=moe), f, indent=2)
    data_path = os.path.join(out_dir, "prompts.jsonl")
    heldout_path = os.path.join(out_dir, "heldout.jsonl")
    for path, rows in (
        (data_path, make_rows(num_prompts, digits=digits, seed=seed)),
        (heldout_path, held_out_rows(digits)),
    ):
        with open(path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return {"model_dir": model_dir, "data_path": data_path, "heldout_path": heldout_path}


def reward(response: str, metadata) -> float:
    """Partial credit: 0.2 for an answer of the right length, plus 0.8 x the fraction of right digits. Every
    token but EOS is one visible character, so the right length means: that many tokens, then EOS."""
    answer = str(metadata["answer"])
    got = response
    right = sum(a == b for a, b in zip(got, answer))
    return (float(len(got) == len(answer)) + 4.0 * right / len(answer)) / 5.0
