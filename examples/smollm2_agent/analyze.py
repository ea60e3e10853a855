"""Read the agent example's evaluation samples and say what changed: correctness, tool use, copying.

    python -m examples.smollm2_agent.analyze runs/smollm2/agent [--json out.json]

Reads ``RUN/eval_samples/step_<k>.jsonl`` (every episode of each evaluation, with its transcript: written by
the evaluator under ``rollout.env``) and the held-out rows' answers from the run's eval set (``--data``), and
prints one markdown table, first evaluation against the last. Per evaluation, over the sampled episodes:

- ``pass@1`` (+- its standard error over the items) and ``pass@4``, recomputed from the rewards;
- ``tool_call_rate``: episodes with at least one calculator call; ``tool_error_rate``: episodes with an error;
  ``own_tool_response``: episodes without a call whose text holds a ``<tool_response>`` the model wrote itself;
- ``tool_result_right``: episodes whose (last) tool result is the right answer (the call's expression was right);
- ``final_equals_tool``: among episodes with a numeric tool result, the final answer's last integer equals it;
- ``correct_with_call`` / ``correct_without_call``: correctness within each kind of episode (does a rise come
  from the calls or from the model's own arithmetic);
- the form of the final answer (a bare integer; one equation), and the same for the greedy episodes.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import sys

from examples.smollm2_arithmetic.reward import equation_only, last_integer, number_only
from gspo_mcore.trainer.evaluation import pass_at_k

# a result the environment appended (its user message in ChatML); the model may also write a <tool_response>
# of its own without calling the tool, which is not a result
_RESULT = re.compile(r"<\|im_start\|>user\n<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)
_INT = re.compile(r"-?\d+")


def tool_result(transcript: str) -> str | None:
    """The last tool result the environment appended to an episode's transcript (``None`` without one)."""
    found = _RESULT.findall(transcript or "")
    return found[-1].strip() if found else None


def episode_figures(row: dict, answer: str) -> dict:
    """One episode's measures (see the module docstring); ``row`` is a line of the samples file."""
    called = row.get("tool_calls", 0) > 0
    result = tool_result(row.get("transcript", "")) if called else None
    numeric = result is not None and _INT.fullmatch(result) is not None
    return {
        "correct": float(row["reward"] >= 1.0),
        "called": float(called),
        "tool_error": float(row.get("tool_errors", 0) > 0),
        "own_tool_response": float(not called and "<tool_response>" in row.get("transcript", "")),
        "tool_result_right": float(numeric and int(result) == int(answer)),
        "numeric_result": float(numeric),
        "final_equals_tool": float(numeric and last_integer(row["response"], {"answer": result}) == 1.0),
        "bare_number": number_only(row["response"], {}),
        "equation": equation_only(row["response"], {}),
    }


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def pass_figures(prompt_indices: list[int], correct: list[float]) -> dict:
    """pass@1 over items (each item's pass rate, averaged), its standard error over items, and pass@4 when every
    item has at least 4 episodes; ``correct[i]`` is episode i's 0/1 outcome, ``prompt_indices[i]`` its item."""
    by_item: dict[int, list[float]] = {}
    for i, c in zip(prompt_indices, correct):
        by_item.setdefault(i, []).append(c)
    rates = [sum(v) / len(v) for v in by_item.values()]
    m, p1 = len(rates), _mean(rates)
    se = math.sqrt(sum((x - p1) ** 2 for x in rates) / (m - 1) / m) if m > 1 else 0.0
    s = {"episodes": len(correct), "items": m, "pass@1": p1, "pass@1_stderr": se}
    if min(len(v) for v in by_item.values()) >= 4:
        s["pass@4"] = _mean([pass_at_k(len(v), int(sum(v)), 4) for v in by_item.values()])
    return s


def summarize(rows: list[dict], answers: list[str]) -> dict:
    """The measures of one evaluation's samples file (``rows``), against the items' ``answers``."""
    out = {}
    for kind in ("sampled", "greedy"):
        mine = [r for r in rows if r["kind"] == kind]
        if not mine:
            continue
        figs = [episode_figures(r, answers[r["prompt_index"]]) for r in mine]
        s = pass_figures([r["prompt_index"] for r in mine], [f["correct"] for f in figs])
        with_call = [f for f in figs if f["called"]]
        without = [f for f in figs if not f["called"]]
        numeric = [f for f in figs if f["numeric_result"]]
        s.update(
            tool_call_rate=_mean([f["called"] for f in figs]),
            tool_error_rate=_mean([f["tool_error"] for f in figs]),
            own_tool_response=_mean([f["own_tool_response"] for f in figs]),
            tool_result_right=_mean([f["tool_result_right"] for f in figs]),
            final_equals_tool=_mean([f["final_equals_tool"] for f in numeric]),
            correct_with_call=_mean([f["correct"] for f in with_call]),
            correct_without_call=_mean([f["correct"] for f in without]),
            episodes_with_call=len(with_call),
            episodes_with_numeric_result=len(numeric),
            bare_number=_mean([f["bare_number"] for f in figs]),
            equation=_mean([f["equation"] for f in figs]),
        )
        out[kind] = s
    return out


def read_answers(path: str, count: int) -> list[str]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if len(rows) < count:
        raise SystemExit(f"error: {path} has {len(rows)} rows; the samples file refers to {count}")
    return [str(r["answer"]) for r in rows]


def steps_of(run_dir: str) -> list[tuple[int, str]]:
    paths = glob.glob(os.path.join(run_dir, "eval_samples", "step_*.jsonl"))
    found = sorted((int(re.search(r"step_(\d+)\.jsonl$", p).group(1)), p) for p in paths)
    if not found:
        raise SystemExit(f"error: no {run_dir}/eval_samples/step_<k>.jsonl (run the example first)")
    return found


def table(first: tuple[int, dict], last: tuple[int, dict]) -> str:
    (a, sa), (b, sb) = first, last
    lines = [f"| held-out (sampled unless said) | step {a} | step {b} |", "|---|---|---|"]

    def cell(s, kind, key, se=None):
        v = s.get(kind, {}).get(key)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        if se:
            return f"{v:.3f} +- {s[kind][se]:.3f}"
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    rows = [
        ("pass@1 +- standard error", "sampled", "pass@1", "pass@1_stderr"),
        ("pass@4", "sampled", "pass@4", None),
        ("greedy pass@1", "greedy", "pass@1", None),
        ("tool-call rate", "sampled", "tool_call_rate", None),
        ("greedy tool-call rate", "greedy", "tool_call_rate", None),
        ("episodes with a tool error", "sampled", "tool_error_rate", None),
        ("writes a <tool_response> itself, no call", "sampled", "own_tool_response", None),
        ("tool result is the right sum", "sampled", "tool_result_right", None),
        ("final answer = tool result (of numeric results)", "sampled", "final_equals_tool", None),
        ("correct, episodes with a call", "sampled", "correct_with_call", None),
        ("correct, episodes without a call", "sampled", "correct_without_call", None),
        ("episodes with a call / all", "sampled", "episodes_with_call", None),
        ("final answer a bare integer", "sampled", "bare_number", None),
        ("final answer one equation", "sampled", "equation", None),
    ]
    for label, kind, key, se in rows:
        lines.append(f"| {label} | {cell(sa, kind, key, se)} | {cell(sb, kind, key, se)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--data", default="runs/smollm2/data/eval_2_digit_addition.jsonl", help="the eval set's rows")
    p.add_argument("--json", default=None, help="also write every evaluation's measures here")
    args = p.parse_args(argv)
    found = steps_of(args.run_dir)
    results = []
    for step, path in found:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        if rows and "transcript" not in rows[0]:
            raise SystemExit(f"error: {path} has no episode transcripts (not a rollout.env run?)")
        answers = read_answers(args.data, 1 + max(r["prompt_index"] for r in rows))
        results.append((step, summarize(rows, answers)))
    print(table(results[0], results[-1]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(k): v for k, v in results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
