"""Write the arithmetic example's prompts: procedural training prompts and held-out items in BIG-bench's format.

    python -m examples.smollm2_arithmetic.prepare_data [--out DIR] [--train-size 4096]

Output (default ``$GSPO_CACHE/smollm2/data``, else ``runs/smollm2/data``; outside the tracked files):

- ``train.jsonl``: up to ``--train-size`` distinct ``reasoning-gym`` ``basic_arithmetic`` problems, two
  terms of ``--train-digits`` digits (reasoning-gym's own ranges: 1 gives 0-10, 2 gives 0-100), ``+`` or
  ``-``, no negation or parentheses ("Calculate 7 - 8."), each with the answer its own verifier accepts
  (``reasoning-gym`` is pinned in the project's requirements.txt);
- ``eval_2_digit_{addition,subtraction}.jsonl``: the items shipped in ``examples/smollm2_arithmetic/data``
  ("What is 80 plus 29?"), in the wording and format of BIG-bench's ``arithmetic`` tasks but **generated for
  this project** (``make_items.py``, a fixed seed; ``data/README.md`` says why), each file checked against
  its recorded SHA-256 (``ITEMS_SHA256``). Nothing is downloaded. :func:`write_eval` writes only these (the
  agent example's data step uses it; it needs no extra package).

Why 1-digit training and 2-digit evaluation: the dequantized SmolLM2-135M-Instruct answers a 2-term
problem of 0-100 correctly in about 3% of its samples at temperature 1 (measured on 64 samples), so
groups of 4 almost never hold a reward spread and GSPO gets no signal; on 1-digit operands it is right
often enough to learn from. The 2-digit items are held out and measure what transfers.

Every row is in the project's prompt format (``gspo_mcore.data.dataset``): a one-turn chat under
``messages`` asking for the number only, the reference ``answer`` (for the ``math`` reward), and where it
came from (``source``, ``index``, ``expression``). Training problems whose operands and operator equal a
held-out item's are left out (``--keep-overlap`` keeps them), so that the evaluation measures
generalisation; the counts are in ``manifest.json``. The step is idempotent: a folder whose manifest records the same
settings is left as it is.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import os
import re
import sys

logger = logging.getLogger("smollm2.prepare_data")

INSTRUCTION = "Answer with the number only."
REASONING_GYM = "reasoning-gym==0.1.25"
TASKS = ("2_digit_addition", "2_digit_subtraction")
ITEMS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
ITEMS_SHA256 = {
    "2_digit_addition": "60fec6329951d5a05e06aed40a65c0a9cf1b9135fa35e718724f0a535b3ab748",
    "2_digit_subtraction": "bdfa96e1d8a1f6d999cf83c23b51d9d88c343604d13e5d93768957e7556c4a52",
}
"""SHA-256 of the shipped item files ``ITEMS_DIR/<task>.jsonl``, as ``make_items.py`` writes them."""
SOURCE = "generated/bigbench-format/{task}"
"""The rows' ``source``: generated in BIG-bench's format, not BIG-bench's items."""
_BB_INPUT = re.compile(r"^What is (-?\d+) (plus|minus) (-?\d+)\?$")
_RG_EXPR = re.compile(r"^(-?\d+) ([+-]) (-?\d+)$")


class DataError(RuntimeError):
    """A missing package or an input not in the expected form (named in the message)."""


def default_out() -> str:
    return os.path.join(os.environ.get("GSPO_CACHE") or "runs", "smollm2", "data")


def row(question: str, answer: str, *, source: str, index: int, expression: str) -> dict:
    return {
        "messages": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "answer": answer,
        "source": source,
        "index": index,
        "expression": expression,
    }


# ------------------------------------------------------------------------------------------ held-out items


def read_items(task: str, items_dir: str = ITEMS_DIR) -> list[dict]:
    """The shipped items of ``task`` (``{"input", "target"}`` a line), refused unless the file's SHA-256 is the
    recorded one."""
    if task not in ITEMS_SHA256:
        raise DataError(f"unknown task {task!r}; known: {', '.join(ITEMS_SHA256)}")
    path = os.path.join(items_dir, f"{task}.jsonl")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise DataError(f"{path}: cannot read the shipped items ({exc.strerror})") from exc
    digest = hashlib.sha256(data).hexdigest()
    if digest != ITEMS_SHA256[task]:
        raise DataError(
            f"{path}: SHA-256 {digest} is not the recorded {ITEMS_SHA256[task]}; "
            "rewrite it with python -m examples.smollm2_arithmetic.make_items"
        )
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


def item_rows(task: str, items: list[dict]) -> list[dict]:
    """``{"input": "What is 80 plus 29?", "target": "109"}`` items -> prompt rows; another form is refused, naming
    the task and the item's index."""
    rows = []
    for i, ex in enumerate(items):
        question = str(ex.get("input", "")).strip()
        target = ex.get("target")
        target = target[0] if isinstance(target, list) and target else target
        m = _BB_INPUT.match(question)
        if not m or target is None or not re.fullmatch(r"-?\d+", str(target).strip()):
            raise DataError(f"{task} item {i}: unexpected item {ex!r}")
        a, op, b = int(m.group(1)), "+" if m.group(2) == "plus" else "-", int(m.group(3))
        rows.append(
            row(question, str(target).strip(), source=SOURCE.format(task=task), index=i, expression=f"{a} {op} {b}")
        )
    if not rows:
        raise DataError(f"{task}: no items")
    return rows


# ------------------------------------------------------------------------------------------ reasoning-gym


def training_rows(
    size: int, seed: int, *, digits: int = 1, exclude: frozenset[str] = frozenset()
) -> tuple[list[dict], dict]:
    """Up to ``size`` distinct problems (by expression) not in ``exclude``, and counts of what was dropped.

    The generator repeats small problems often ("5 - 3" ~18 times in 4096), so ``4 * size`` are drawn and
    the first occurrence of each expression is kept (1-digit operands give at most 242 distinct problems).
    """
    if digits not in (1, 2):
        raise DataError(f"--train-digits must be 1 or 2, got {digits}")
    if importlib.util.find_spec("reasoning_gym") is None:
        raise DataError(
            f"the reasoning_gym package is not installed; run: pip install {REASONING_GYM} "
            "(the project's requirements.txt pins it: make install)"
        )
    import reasoning_gym

    drawn = 4 * size
    ds = reasoning_gym.create_dataset(
        "basic_arithmetic",
        size=drawn,
        seed=seed,
        min_terms=2,
        max_terms=2,
        min_digits=1,
        max_digits=digits,
        operators=("+", "-"),
        allow_parentheses=False,
        allow_negation=False,
        format_style="simple",
        whitespace="single",
    )
    rows, seen, overlapping = [], set(), set()
    for i, item in enumerate(ds):
        expr = item["metadata"]["expression"]
        if not _RG_EXPR.match(expr):
            raise DataError(f"reasoning_gym basic_arithmetic item {i}: unexpected expression {expr!r}")
        if expr in exclude:
            overlapping.add(expr)
            continue
        if expr in seen:
            continue
        if ds.score_answer(item["answer"], item) != 1.0:
            raise DataError(f"reasoning_gym basic_arithmetic item {i}: its verifier rejects its own answer")
        seen.add(expr)
        rows.append(
            row(
                item["question"], str(item["answer"]), source="reasoning_gym/basic_arithmetic", index=i, expression=expr
            )
        )
        if len(rows) == size:
            break
    return rows, dict(drawn=i + 1, distinct_overlapping_eval=len(overlapping))


# ------------------------------------------------------------------------------------------ writing


def write_jsonl(path: str, rows: list[dict]) -> None:
    tmp = path + ".partial"
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


def write_eval(out: str, items_dir: str = ITEMS_DIR) -> tuple[dict[str, int], frozenset[str]]:
    """Write ``eval_<task>.jsonl`` for each of :data:`TASKS` into ``out``; returns the files' row counts and every
    item's expression."""
    os.makedirs(out, exist_ok=True)
    files, expressions = {}, set()
    for task in TASKS:
        rows = item_rows(task, read_items(task, items_dir))
        expressions.update(r["expression"] for r in rows)
        name = f"eval_{task}.jsonl"
        write_jsonl(os.path.join(out, name), rows)
        files[name] = len(rows)
    return files, frozenset(expressions)


def prepare_data(
    out: str | None = None,
    *,
    train_size: int = 4096,
    train_digits: int = 1,
    seed: int = 0,
    keep_overlap: bool = False,
) -> dict:
    """Write the JSONL files (or keep them when up to date); returns the manifest."""
    out = os.path.abspath(out or default_out())
    settings = dict(
        train_size=train_size,
        train_digits=train_digits,
        seed=seed,
        keep_overlap=keep_overlap,
        reasoning_gym=REASONING_GYM,
        items_sha256=ITEMS_SHA256,
        instruction=INSTRUCTION,
    )
    manifest_path = os.path.join(out, "manifest.json")
    if os.path.isfile(manifest_path):
        with open(manifest_path) as f:
            manifest = json.load(f)
        if manifest.get("settings") == settings and all(
            os.path.isfile(os.path.join(out, n)) for n in manifest["files"]
        ):
            logger.info("%s is up to date; nothing to do", out)
            return manifest
    files, held_out = write_eval(out)
    train, counts = training_rows(
        train_size, seed, digits=train_digits, exclude=frozenset() if keep_overlap else frozenset(held_out)
    )
    write_jsonl(os.path.join(out, "train.jsonl"), train)
    files["train.jsonl"] = len(train)
    manifest = dict(
        settings=settings,
        files=files,
        train_problems_drawn=counts["drawn"],
        train_expressions_dropped_as_eval=counts["distinct_overlapping_eval"],
    )
    with open(manifest_path, "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help=f"output folder (default {default_out()})")
    parser.add_argument("--train-size", type=int, default=4096, help="distinct training problems wanted")
    parser.add_argument(
        "--train-digits", type=int, default=1, choices=(1, 2), help="operand digits (1: 0-10, 2: 0-100)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-overlap", action="store_true", help="keep training problems equal to a held-out item")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.train_size <= 0:
        parser.error(f"--train-size must be > 0, got {args.train_size}")
    try:
        manifest = prepare_data(
            args.out,
            train_size=args.train_size,
            train_digits=args.train_digits,
            seed=args.seed,
            keep_overlap=args.keep_overlap,
        )
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(manifest["files"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
