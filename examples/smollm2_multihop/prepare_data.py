"""Write the multi-hop example's table and prompts.

    python -m examples.smollm2_multihop.prepare_data [--data runs/smollm2/data/multihop] [--people 300]
        [--held-out 64] [--per-name 4] [--seed 0] [--templates 0]

Writes into ``--data``: ``table.json`` (every person, held-out ones included: the ``lookup`` tool's table),
``train.jsonl`` (``--per-name`` questions about each training person) and ``eval.jsonl`` (one question about
each held-out person, none of them named in training). ``--templates``: which question forms
(``make_items.TEMPLATES``: 0 "How old will X be in N years?", 1 "How old was X N years ago?"); the example
uses 0. The worked exchanges' people (``env.py``) are in the table and asked about nowhere. Deterministic in
``--seed``; rewritten each time (a second).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from examples.smollm2_multihop.env import EXAMPLE_PEOPLE
from examples.smollm2_multihop.make_items import make_items, make_table, split

DEFAULT_DATA = os.path.join(os.environ.get("GSPO_CACHE") or "runs", "smollm2", "data", "multihop")


def write(
    data: str,
    *,
    people: int = 300,
    held_out: int = 64,
    per_name: int = 4,
    seed: int = 0,
    templates: tuple[int, ...] = (0,),
) -> dict[str, int]:
    """Write the three files; their row counts."""
    generated = make_table(people, seed)
    _, train_names, eval_names = split(generated, held_out, 0)
    # the worked exchanges' people (env.py) are in the table too, and asked about nowhere
    table = {name: {"age": age} for name, age in EXAMPLE_PEOPLE}
    clash = [n for n in generated if n in table]
    if clash:
        raise ValueError(f"generated name {clash[0]!r} is a worked example's; choose another --seed")
    table |= generated
    os.makedirs(data, exist_ok=True)
    train = make_items(table, train_names, per_name, seed, templates)
    held = make_items(table, eval_names, 1, seed + 1, templates)
    with open(os.path.join(data, "table.json"), "w") as f:
        json.dump(table, f, indent=0)
    for name, rows in (("train.jsonl", train), ("eval.jsonl", held)):
        with open(os.path.join(data, name), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return {"table.json": len(table), "train.jsonl": len(train), "eval.jsonl": len(held)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=DEFAULT_DATA)
    p.add_argument("--people", type=int, default=300)
    p.add_argument("--held-out", type=int, default=64)
    p.add_argument("--per-name", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--templates", nargs="+", type=int, default=[0])
    a = p.parse_args(argv)
    try:
        counts = write(
            a.data, people=a.people, held_out=a.held_out, per_name=a.per_name, seed=a.seed, templates=tuple(a.templates)
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
