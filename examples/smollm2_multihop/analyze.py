"""Read the multi-hop example's evaluation samples and say what changed: correctness and the calls made.

    python -m examples.smollm2_multihop.analyze runs/smollm2/multihop [--data runs/smollm2/data/multihop/eval.jsonl]
        [--json out.json] [--show 1]

Reads ``RUN/eval_samples/step_<k>.jsonl`` (every evaluation episode with its transcript, written by the evaluator
under ``rollout.env``) and the held-out rows (``--data``: each row's person, expression and answer), and prints one
markdown table, first evaluation against the last. Per evaluation and decoding (sampled, greedy):

- ``pass@1`` (+- its standard error over the items, as the evaluator computes it) and ``pass@4``;
- ``calls``, ``lookups``, ``calculator calls`` per episode (the ``<tool_call>`` blocks of the policy's turns);
- ``both calls``: the share of episodes that looked up the asked-about person and called the calculator (every
  call the task needs); ``right computation``: a calculator call whose expression gives the answer;
- ``answers the looked-up age``: episodes whose final answer is the person's age (the first hop only).

``--show k`` prints ``k`` transcripts of the last evaluation: sampled successes and failures.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys

from examples.smollm2_agent.analyze import pass_figures, read_answers, steps_of
from gspo_mcore.envs import parse_tool_calls
from gspo_mcore.envs.builtin import calculator
from gspo_mcore.envs.tools import ToolCall

_INT = re.compile(r"-?\d+")


def _policy_text(transcript: str) -> str:
    """The transcript without the environment's messages (ChatML user turns), so that only the policy's calls count."""
    return re.sub(r"<\|im_start\|>user\n.*?<\|im_end\|>", "", transcript or "", flags=re.DOTALL)


def episode_figures(row: dict, item: dict) -> dict:
    """One episode's measures; ``row`` is a line of the samples file, ``item`` its held-out row."""
    calls = [c for c in parse_tool_calls(_policy_text(row.get("transcript", ""))) if isinstance(c, ToolCall)]
    lookups = [c for c in calls if c.name == "lookup"]
    calcs = [c for c in calls if c.name == "calculator"]
    looked_up = any(str(c.arguments.get("name", "")).strip().lower() == item["name"].lower() for c in lookups)

    def right(c: ToolCall) -> bool:
        try:
            return calculator(str(c.arguments.get("expression", ""))) == str(item["answer"])
        except Exception:  # noqa: BLE001 - a malformed expression is just not right
            return False

    found = _INT.findall(row.get("response", ""))
    age = item["expression"].split()[0]
    return {
        "correct": float(row["reward"] >= 1.0),
        "calls": float(len(calls)),
        "lookups": float(len(lookups)),
        "calculator_calls": float(len(calcs)),
        "both_calls": float(looked_up and bool(calcs)),
        "right_computation": float(any(right(c) for c in calcs)),
        "answers_age": float(bool(found) and found[-1] == age),
    }


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(rows: list[dict], items: list[dict]) -> dict:
    """The measures of one evaluation's samples (``rows``) against the held-out ``items``."""
    out = {}
    for kind in ("sampled", "greedy"):
        mine = [r for r in rows if r["kind"] == kind]
        if not mine:
            continue
        figs = [episode_figures(r, items[r["prompt_index"]]) for r in mine]
        s = pass_figures([r["prompt_index"] for r in mine], [f["correct"] for f in figs])
        for key in figs[0]:
            if key != "correct":
                s[key] = _mean([f[key] for f in figs])
        out[kind] = s
    return out


def table(first: tuple[int, dict], last: tuple[int, dict]) -> str:
    (a, sa), (b, sb) = first, last
    lines = [f"| held-out | step {a} | step {b} |", "|---|---|---|"]

    def cell(s, kind, key, se=None):
        v = s.get(kind, {}).get(key)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        return f"{v:.3f} +- {s[kind][se]:.3f}" if se else f"{v:.3f}" if isinstance(v, float) else str(v)

    for kind in ("sampled", "greedy"):
        for label, key, se in (
            ("pass@1 +- standard error", "pass@1", "pass@1_stderr"),
            ("pass@4", "pass@4", None),
            ("calls / episode", "calls", None),
            ("lookups / episode", "lookups", None),
            ("calculator calls / episode", "calculator_calls", None),
            ("both needed calls made", "both_calls", None),
            ("a calculator call that gives the answer", "right_computation", None),
            ("answers the looked-up age", "answers_age", None),
        ):
            if key == "pass@4" and kind == "greedy":
                continue
            lines.append(f"| {kind}: {label} | {cell(sa, kind, key, se)} | {cell(sb, kind, key, se)} |")
    return "\n".join(lines)


def read_items(path: str, count: int) -> list[dict]:
    read_answers(path, count)  # the same check: the file covers every prompt index
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--data", default="runs/smollm2/data/multihop/eval.jsonl", help="the eval set's rows")
    p.add_argument("--json", default=None, help="also write every evaluation's measures here")
    p.add_argument("--show", type=int, default=0, help="print this many sampled successes and failures")
    args = p.parse_args(argv)
    results, last = [], []
    for step, path in steps_of(args.run_dir):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        if rows and "transcript" not in rows[0]:
            raise SystemExit(f"error: {path} has no episode transcripts (not a rollout.env run?)")
        items = read_items(args.data, 1 + max(r["prompt_index"] for r in rows))
        results.append((step, summarize(rows, items)))
        last = rows
    print(table(results[0], results[-1]))
    for want, label in ((1.0, "success"), (0.0, "failure")):
        shown = [r for r in last if r["kind"] == "sampled" and (r["reward"] >= 1.0) == bool(want)][: args.show]
        for r in shown:
            q = items[r["prompt_index"]]["messages"][-1]["content"]
            print(f"\n{label} (step {results[-1][0]}): {q}\n{r['transcript']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(k): v for k, v in results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
