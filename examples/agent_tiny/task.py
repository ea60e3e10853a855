"""The tiny agent task: a lookup the policy cannot do without its tool.

Each row's ``answer`` is a 3-digit secret that the prompt does not show (``"key:q7>"``; the key is a label, not a
hint: the secrets are drawn at random). :class:`LookupEnv` holds the secret table: a first turn that
contains the ``<tool_call>`` token is a lookup call, answered with the observation ``"=SECRET>"``; the next
turn is the answer. A first turn without the call is the answer. The reward (``examples.tiny.task:reward``)
scores the final turn against the secret: 0.2 for three tokens then EOS, plus 0.8 x the fraction of right
digits. Without the tool a digit is right 1 time in 10 (expected reward at most 0.28); with it, copying the
three digits earns 1.0.

The tokenizer is the tiny job's character tokenizer with one filler id replaced by the single (non-special)
token ``<tool_call>``. Held out: rows whose secrets are the tiny job's held-out tenth of all 3-digit strings.
"""

from __future__ import annotations

import json
import os
import random

from examples.tiny import task as tiny
from gspo_mcore.envs import Reset, Step

TOOL_CALL = "<tool_call>"


def make_tokenizer(out_dir: str):
    """The tiny character tokenizer with ``<tool_call>`` as one token (the last filler's id)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(tiny.SPECIALS + tiny.CHARS + tiny.FILLERS[:-1] + [TOOL_CALL])}
    assert len(vocab) == tiny.VOCAB_SIZE
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=tiny.SPECIALS[0]))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_tokens([TOOL_CALL])  # matched whole before the character split (its id stays the vocab's)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
    fast.save_pretrained(out_dir)
    return fast


def _rows(secrets: list[str], seed: int) -> list[dict]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz0123456789"
    return [{"prompt": f"key:{rng.choice(letters)}{rng.choice(letters)}>", "answer": s} for s in secrets]


def prepare(out_dir: str, *, num_prompts: int = 4096, seed: int = 0) -> dict:
    """Write the model directory (tokenizer + tiny Qwen3 config.json), the training and held-out rows."""
    model_dir = os.path.join(out_dir, "model")
    os.makedirs(model_dir, exist_ok=True)
    make_tokenizer(model_dir)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(tiny.model_config(), f, indent=2)
    held = tiny.held_out_strings(3)
    held_set = set(held)
    rng = random.Random(seed)
    train = []
    while len(train) < num_prompts:
        s = f"{rng.randrange(1000):03d}"
        if s not in held_set:
            train.append(s)
    paths = {"model_dir": model_dir}
    for name, secrets in (("prompts", train), ("heldout", held)):
        path = os.path.join(out_dir, f"{name}.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in _rows(secrets, seed + len(name)))
        paths[f"{name}_path"] = path
    return paths


class LookupEnv:
    """First turn: ``<tool_call>`` anywhere in it is a lookup (observation ``"=SECRET>"``, one tool call), else it
    is the answer and the episode ends. Second turn: the answer, done. ``reward`` scores the final turn."""

    def __init__(self, call_bonus: float = 0.0):
        self.call_bonus = call_bonus

    def reset(self, row):
        return Reset(observation=row["prompt"], state={"secret": str(row["metadata"]["answer"]), "turns": 0})

    def step(self, state, action):
        state["turns"] += 1
        if state["turns"] == 1 and TOOL_CALL in action:
            return Step(observation=f"={state['secret']}>", reward=self.call_bonus, info={"tool_calls": 1})
        return Step(done=True)


def reward(response: str, metadata) -> float:
    """The fraction of the answer's 3 digits that the final turn has in place (no length credit: from a random
    start it rewarded stopping after three tokens in the first turn, a no-tool answer, and the tool use
    collapsed, measured)."""
    answer = str(metadata["answer"])
    return sum(a == b for a, b in zip(response, answer)) / len(answer)
