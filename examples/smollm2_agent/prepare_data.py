"""Write the agent example's training prompts: the BIG-bench 2-digit items that are not held out.

    python -m examples.smollm2_agent.prepare_data [--data runs/smollm2/data] [--held-out 64]

``examples.smollm2_arithmetic.prepare_data`` writes the BIG-bench ``arithmetic`` 2-digit items into ``--data``
(``eval_2_digit_{addition,subtraction}.jsonl``, 1000 each, "What is 80 plus 29? Answer with the number only.").
Both examples evaluate on the first ``--held-out`` (64) addition items. This writes ``agent_train.jsonl`` beside
them: every other addition item and every subtraction item, leaving out any whose expression equals a held-out
item's. A train/test split of one task: the evaluation measures items never trained on, in the same wording.

Why not the single-turn example's training set (reasoning-gym's 1-digit "Calculate 7 - 8."): that example must
learn from the model's own arithmetic, which is right often enough only on 1-digit operands. Here the reward
should come from the calculator: on 2-digit items the untrained model is right by itself in about 2% of its
samples, so a rewarded episode is almost always one that called the tool and copied its result; and the
worked examples in the prompt use BIG-bench's wording, which the untrained model follows better than
reasoning-gym's (a first training step on "Calculate ..." rows called the tool in 4 of 32 episodes, all four
malformed). Idempotent: the file is rewritten from the held-out files each time (a second).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from examples.smollm2_arithmetic.prepare_data import DataError, default_out, write_jsonl

NAME = "agent_train.jsonl"
SOURCES = ("eval_2_digit_addition.jsonl", "eval_2_digit_subtraction.jsonl")
"""The held-out items are the first of the first file."""


def _read(path: str) -> list[dict]:
    if not os.path.isfile(path):
        raise DataError(f"{path} is missing: run python -m examples.smollm2_arithmetic.prepare_data first")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def training_rows(data: str, held_out: int = 64) -> tuple[list[dict], frozenset[str]]:
    """The training rows and the held-out expressions (see the module docstring)."""
    first, *others = (_read(os.path.join(data, name)) for name in SOURCES)
    if held_out <= 0 or held_out >= len(first):
        raise DataError(f"--held-out must be in 1..{len(first) - 1}, got {held_out}")
    kept = frozenset(r["expression"] for r in first[:held_out])
    rows = [r for r in first[held_out:] + [r for rs in others for r in rs] if r["expression"] not in kept]
    return rows, kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=default_out(), help="the single-turn example's data folder")
    parser.add_argument("--held-out", type=int, default=64, help="the evaluation's items (eval max_prompts)")
    args = parser.parse_args(argv)
    try:
        rows, _ = training_rows(args.data, args.held_out)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    write_jsonl(os.path.join(args.data, NAME), rows)
    print(json.dumps({NAME: len(rows)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
