"""The tiny agent task: a lookup the policy cannot do without its tool.

Every row has the same prompt, ``"get:"``; its ``answer`` is a 3-digit secret drawn at random, which only
:class:`LookupEnv` holds. A first turn that is exactly the single token ``<tool_call>`` is a lookup call (the
run stops a turn at that token: ``rollout.sampling.stop_token_ids``), answered with the observation
``"SECRET>"``; the next turn is the answer. Any other first turn is a guess: the episode ends, and the
environment cancels its score, so it is worth 0. The reward (:func:`reward`, the tiny job's) scores the final
turn against the secret: 0.2 for three tokens then EOS, plus 0.8 x the fraction of right digits. Without the
tool a digit is right 1 time in 10; with it, copying the three digits earns 1.0.

The layout mirrors the tiny job's (``rev:407>`` -> ``704``, which the same model learns in a few hundred
steps): ``get:<tool_call>407>`` -> ``407``, the observation ending right before the answer, every position
fixed. (A longer layout, ``key:XY>`` with random key letters and ``=SECRET>`` after a first turn of any length,
learned the copy far more slowly, even with the whole lookup in a single-turn prompt: docs/results/agent-tiny.md.)

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
PROMPT = "get:"


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


TOOL_CALL_ID = tiny.VOCAB_SIZE - 1
"""``<tool_call>``'s id (config.yaml's ``stop_token_ids`` names it)."""


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
            f.writelines(json.dumps({"prompt": PROMPT, "answer": s}) + "\n" for s in secrets)
        paths[f"{name}_path"] = path
    return paths


class LookupEnv:
    """First turn exactly ``<tool_call>``: a lookup (observation ``"SECRET>"``, one tool call, ``call_bonus``
    added to the episode's reward); the second turn is the answer, scored by the run's ``reward``. Any other
    first turn is an answer given without the lookup: the episode ends, and the environment adds minus that
    answer's score (:func:`reward`), so it is worth exactly 0 (a guess is never paid, however lucky)."""

    def __init__(self, call_bonus: float = 0.0):
        self.call_bonus = call_bonus

    def reset(self, row):
        return Reset(observation=row["prompt"], state={"secret": str(row["metadata"]["answer"]), "turns": 0})

    def step(self, state, action):
        state["turns"] += 1
        if state["turns"] > 1:
            return Step(done=True)
        if action == TOOL_CALL:
            return Step(observation=f"{state['secret']}>", reward=self.call_bonus, info={"tool_calls": 1})
        return Step(done=True, reward=-reward(action, {"answer": state["secret"]}))


def reward(response: str, metadata) -> float:
    """The tiny job's reward (:func:`examples.tiny.task.reward`): 0.2 for three tokens then EOS, plus 0.8 x the
    fraction of right digits."""
    return tiny.reward(response, metadata)
