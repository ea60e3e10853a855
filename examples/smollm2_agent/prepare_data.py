"""Write the agent example's prompts: the held-out 2-digit items and the training split of the others.

    python -m examples.smollm2_agent.prepare_data [--data runs/smollm2/data] [--held-out 64]

This writes into ``--data`` the 2-digit items shipped in ``examples/smollm2_arithmetic/data`` as prompt rows
(``eval_2_digit_{addition,subtraction}.jsonl``, 1000 each, "What is 80 plus 29? Answer with the number only.";
generated in BIG-bench's ``arithmetic`` format, not BIG-bench's items: that folder's README), exactly as the
single-turn example's data step does (``examples.smollm2_arithmetic.prepare_data.write_eval``; no extra
package, nothing downloaded). Both examples evaluate on the first ``--held-out`` (64) addition items. Then it
writes ``agent_train.jsonl`` beside them: every other addition item and every subtraction item, leaving out any
whose expression equals a held-out item's. A train/test split of one task: the evaluation measures items never
trained on, in the same wording.

Why not the single-turn example's training set (reasoning-gym's 1-digit "Calculate 7 - 8."): that example must
learn from the model's own arithmetic, which is right often enough only on 1-digit operands. Here the reward
should come from the calculator: on 2-digit items the untrained model is right by itself in about 2% of its
samples, so a rewarded episode is almost always one that called the tool and copied its result; and the
worked examples in the prompt use the items' (BIG-bench's) wording, which the untrained model follows better than
reasoning-gym's (a first training step on "Calculate ..." rows called the tool in 4 of 32 episodes, all four
malformed). Idempotent: the files are rewritten from the shipped items each time (a second).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from examples.smollm2_arithmetic.prepare_data import DataError, default_out, write_eval, write_jsonl

NAME = "agent_train.jsonl"
SOURCES = ("eval_2_digit_addition.jsonl", "eval_2_digit_subtraction.jsonl")
"""The held-out items are the first of the first file."""


def _read(path: str) -> list[dict]:
    if not os.path.isfile(path):
        raise DataError(f"{path} is missing: run python -m examples.smollm2_agent.prepare_data")
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
    parser.add_argument("--data", default=default_out(), help="the data folder (the single-turn example's too)")
    parser.add_argument("--held-out", type=int, default=64, help="the evaluation's items (eval max_prompts)")
    args = parser.parse_args(argv)
    try:
        files, _ = write_eval(args.data)
        rows, _ = training_rows(args.data, args.held_out)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    write_jsonl(os.path.join(args.data, NAME), rows)
    print(json.dumps({**files, NAME: len(rows)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
