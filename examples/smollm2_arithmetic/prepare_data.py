"""Write the arithmetic example's prompts: procedural training prompts and held-out BIG-bench items.

    pip install reasoning-gym==0.1.25
    python -m examples.smollm2_arithmetic.prepare_data [--out DIR] [--train-size 4096]

Output (default ``$GSPO_CACHE/smollm2/data``, else ``runs/smollm2/data``; outside the tracked files):

- ``train.jsonl``: up to ``--train-size`` distinct ``reasoning-gym`` ``basic_arithmetic`` problems, two
  terms of ``--train-digits`` digits (reasoning-gym's own ranges: 1 gives 0-10, 2 gives 0-100), ``+`` or
  ``-``, no negation or parentheses ("Calculate 7 - 8."), each with the answer its own verifier accepts;
- ``eval_2_digit_{addition,subtraction}.jsonl``: the BIG-bench ``arithmetic`` task items ("What is 80
  plus 29?"), taken from the ``bigbench==1.0.0`` source distribution (``pip download --no-deps``; only the
  ``task.json`` files are read out of it, and the 358 MB archive is deleted afterwards unless
  ``--keep-download``).

Why 1-digit training and 2-digit evaluation: the dequantized SmolLM2-135M-Instruct answers a 2-term
problem of 0-100 correctly in about 3% of its samples at temperature 1 (measured on 64 samples), so
groups of 4 almost never hold a reward spread and GSPO gets no signal; on 1-digit operands it is right
often enough to learn from. BIG-bench's 1-digit tasks are the 100 pairs of 0-9 operands each, so they cannot be held out
from 1-digit training and are not written; the 2-digit items are held out and measure what transfers.

Every row is in the project's prompt format (``gspo_mcore.data.dataset``): a one-turn chat under
``messages`` asking for the number only, the reference ``answer`` (for the ``math`` reward), and where it
came from (``source``, ``index``, ``expression``). Training problems whose operands and operator equal a
held-out item's are left out (``--keep-overlap`` keeps them), so that the evaluation measures
generalisation; the counts are in ``manifest.json``. The step is idempotent: a folder whose manifest records the same
settings is left as it is.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import tarfile

logger = logging.getLogger("smollm2.prepare_data")

INSTRUCTION = "Answer with the number only."
BIGBENCH = "bigbench==1.0.0"
REASONING_GYM = "reasoning-gym==0.1.25"
TASKS = ("2_digit_addition", "2_digit_subtraction")
_TASK_MEMBER = re.compile(r"^bigbench-1\.0\.0/bigbench/benchmark_tasks/arithmetic/(\w+)/task\.json$")
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


# ------------------------------------------------------------------------------------------ BIG-bench


def _pip_download(python: str, download_dir: str) -> subprocess.CompletedProcess:
    cmd = [python, "-m", "pip", "download", "--no-deps", "-d", download_dir, BIGBENCH]
    logger.info("downloading %s (358 MB; pip then unpacks it to read its metadata): %s", BIGBENCH, " ".join(cmd))
    return subprocess.run(cmd, capture_output=True, text=True)


def fetch_bigbench(download_dir: str) -> str:
    """The ``bigbench`` sdist in ``download_dir`` (``pip download --no-deps`` when it is not there yet).

    pip >= 26 refuses it after the download (its metadata declares a direct-URL dependency, ``bleurt @
    file://...``); pip then is run again from a throwaway virtual environment (in ``download_dir``) with
    pip < 26, which only downloads.
    """
    sdist = os.path.join(download_dir, "bigbench-1.0.0.tar.gz")
    if os.path.isfile(sdist):
        return sdist
    os.makedirs(download_dir, exist_ok=True)
    proc = _pip_download(sys.executable, download_dir)
    if not os.path.isfile(sdist) and "cannot declare direct URL dependencies" in proc.stderr:
        venv = os.path.join(download_dir, ".pip-lt-26")
        logger.info("this pip refuses %s's metadata; retrying with pip<26 in %s", BIGBENCH, venv)
        python = os.path.join(venv, "bin", "python")
        if not os.path.isfile(python):
            subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", "pip<26"], check=True)
        proc = _pip_download(python, download_dir)
    if not os.path.isfile(sdist):
        raise DataError(f"pip download {BIGBENCH} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return sdist


def read_tasks(sdist: str) -> dict[str, dict]:
    """The four arithmetic ``task.json`` files of the sdist, parsed (the archive is read once, in order)."""
    tasks = {}
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar:
            m = _TASK_MEMBER.match(member.name)
            if m and m.group(1) in TASKS:
                tasks[m.group(1)] = json.load(tar.extractfile(member))
                if len(tasks) == len(TASKS):
                    break
    missing = [t for t in TASKS if t not in tasks]
    if missing:
        raise DataError(f"{sdist}: no benchmark_tasks/arithmetic/{{{','.join(missing)}}}/task.json")
    return tasks


def bigbench_rows(task: str, data: dict) -> list[dict]:
    rows = []
    for i, ex in enumerate(data.get("examples", [])):
        question = str(ex.get("input", "")).strip()
        target = ex.get("target")
        target = target[0] if isinstance(target, list) and target else target
        m = _BB_INPUT.match(question)
        if not m or target is None or not re.fullmatch(r"-?\d+", str(target).strip()):
            raise DataError(f"bigbench {task} example {i}: unexpected item {ex!r}")
        a, op, b = int(m.group(1)), "+" if m.group(2) == "plus" else "-", int(m.group(3))
        rows.append(
            row(
                question, str(target).strip(), source=f"bigbench/arithmetic/{task}", index=i, expression=f"{a} {op} {b}"
            )
        )
    if not rows:
        raise DataError(f"bigbench {task}: no examples")
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
        raise DataError(f"the reasoning_gym package is not installed; run: pip install {REASONING_GYM}")
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


def prepare_data(
    out: str | None = None,
    *,
    train_size: int = 4096,
    train_digits: int = 1,
    seed: int = 0,
    keep_overlap: bool = False,
    download_dir: str | None = None,
    keep_download: bool = False,
) -> dict:
    """Write the JSONL files (or keep them when up to date); returns the manifest."""
    out = os.path.abspath(out or default_out())
    settings = dict(
        train_size=train_size,
        train_digits=train_digits,
        seed=seed,
        keep_overlap=keep_overlap,
        reasoning_gym=REASONING_GYM,
        bigbench=BIGBENCH,
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
    os.makedirs(out, exist_ok=True)
    download_dir = download_dir or os.path.join(os.path.dirname(out), "downloads")
    sdist = fetch_bigbench(download_dir)
    tasks = read_tasks(sdist)
    files, held_out = {}, set()
    for task in TASKS:
        rows = bigbench_rows(task, tasks[task])
        held_out.update(r["expression"] for r in rows)
        name = f"eval_{task}.jsonl"
        write_jsonl(os.path.join(out, name), rows)
        files[name] = len(rows)
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
    if not keep_download:
        os.remove(sdist)
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
    parser.add_argument(
        "--download-dir", default=None, help="where the bigbench sdist goes (default: OUT/../downloads)"
    )
    parser.add_argument("--keep-download", action="store_true", help="keep the 358 MB bigbench sdist")
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
            download_dir=args.download_dir,
            keep_download=args.keep_download,
        )
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(manifest["files"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
