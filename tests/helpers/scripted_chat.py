"""A scripted chat policy over the tiny ChatML tokenizer (helpers.agent_tokenizer), for episode tests on the
in-process engine: its greedy turns are fixed strings, sampled one id per character (never the merged 'ab')."""

from __future__ import annotations

import json

import torch

from helpers.agent_tokenizer import make_tokenizer

TOK = make_tokenizer()
HEADER = TOK("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]


def chars(text):
    """One id per character: how the scripted policy samples (never the merged 'ab' id)."""
    return [TOK.convert_tokens_to_ids(c) for c in text]


def scripted_model(turns):
    """A logits_fn whose greedy policy writes ``turns[t]`` character by character (then EOS) in its t-th
    assistant turn (a list of ids: those ids, e.g. the merged 'ab'): it finds the last assistant header of each
    row and counts what follows it."""
    V = len(TOK)

    def fn(tokens):  # (B, L) right-padded with 0 -> (B, L, V)
        B, L = tokens.shape
        out = torch.zeros((B, L, V))
        for b in range(B):
            row = tokens[b].tolist()
            end = max(i for i, t in enumerate(row) if t != 0) + 1
            heads = [i for i in range(end - len(HEADER) + 1) if row[i : i + len(HEADER)] == HEADER]
            turn, k = len(heads) - 1, end - (heads[-1] + len(HEADER))
            text = turns[min(turn, len(turns) - 1)]
            script = (chars(text) if isinstance(text, str) else list(text)) + [TOK.eos_token_id]
            out[b, end - 1, script[min(k, len(script) - 1)]] = 12.0
        return out

    return fn


def lookup(key: str, row) -> str:
    """Look a key up.

    Args:
        key: the key.
    """
    return row["table"][key]


def call(name, **arguments):
    """A ``<tool_call>`` block."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"
