"""Generate the held-out arithmetic items in BIG-bench's wording and format: generated here, not BIG-bench's items.

    python -m examples.smollm2_arithmetic.make_items [--out examples/smollm2_arithmetic/data] [--check]

Both SmolLM2 examples evaluate on 2-digit additions and the agent example trains on the rest of these items.
They used to read BIG-bench's ``arithmetic`` tasks out of the ``bigbench==1.0.0`` source distribution at
set-up; on 2026-12-05 the package index served only ``bigbench`` 0.0.1, so the items are now generated once
and shipped with the project (``data/2_digit_{addition,subtraction}.jsonl``, committed).

Each file has ``SIZE`` lines ``{"input": "What is 80 plus 29?", "target": "109"}`` (``minus`` for the
subtraction task, whose target may be negative: "What is 12 minus 57?" / ``"-45"``), BIG-bench's wording and
item format. Both operands have ``DIGITS`` digits (10-99), drawn uniformly by ``random.Random(SEED + k)`` for
the k-th task of ``TASKS``, two ``randrange`` calls per item, first operand first; a pair drawn before in the
same task is skipped, so the items of a task are distinct. Python's ``random`` gives the same draws for
an integer seed on every CPython 3 since 3.2, so this rewrites the files bit for bit: ``--check`` compares
them, and their SHA-256 are recorded in ``prepare_data.ITEMS_SHA256``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys

SEED = 20261205
SIZE = 1000
DIGITS = 2
TASKS = {"2_digit_addition": "plus", "2_digit_subtraction": "minus"}
"""Task name -> the operator's word; the k-th task is drawn with ``random.Random(SEED + k)``."""

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def items(task: str, *, seed: int = SEED, size: int = SIZE) -> list[dict]:
    """The task's ``size`` distinct items, in draw order (see the module docstring)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    word = TASKS[task]
    rng = random.Random(seed + list(TASKS).index(task))
    low, high = 10 ** (DIGITS - 1), 10**DIGITS
    if size > (high - low) ** 2:
        raise ValueError(f"size {size} exceeds the {(high - low) ** 2} distinct operand pairs of {task}")
    seen, out = set(), []
    while len(out) < size:
        a, b = rng.randrange(low, high), rng.randrange(low, high)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        out.append({"input": f"What is {a} {word} {b}?", "target": str(a + b if word == "plus" else a - b)})
    return out


def encode(rows: list[dict]) -> bytes:
    """The file's bytes: one compact JSON object a line, keys in the order input, target."""
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def file_name(task: str) -> str:
    return f"{task}.jsonl"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="folder of the item files (default: the shipped one)")
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on a difference")
    args = parser.parse_args(argv)
    status = 0
    for task in TASKS:
        data, path = encode(items(task)), os.path.join(args.out, file_name(task))
        if args.check:
            with open(path, "rb") as f:
                same = f.read() == data
            print(f"{path}: {'same' if same else 'DIFFERS'} (generated sha256 {sha256(data)})")
            status |= 0 if same else 1
        else:
            os.makedirs(args.out, exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
            print(f"{path}: {SIZE} items, sha256 {sha256(data)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
