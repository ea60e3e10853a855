"""Screen the multi-hop prompt before training: how often does the untrained model finish whole episodes right?

    python -m examples.smollm2_multihop.screen [--model runs/smollm2/model] [--data runs/smollm2/data/multihop]
        [--items 16] [--n 4] [--examples 1 2] [--temperatures 0.7 1.0]

For each number of worked ``examples``, ``--items`` held-out rows are played as whole episodes (up to 3 policy
turns: lookup, calculator, answer), rendered exactly as the trainer renders them (:class:`~gspo_mcore.envs.
ChatRenderer` over :class:`MultihopEnv`, fallback tool format), with transformers' ``generate``: once greedily
and ``--n`` times at each temperature. One JSON line per setting: pass@1 (the final turn's last integer is the
answer), the share of prompts with at least one passing sample among the ``n`` (the chance a group holds a reward
spread), lookups and calculator calls per episode, and the share of episodes that made both needed calls.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from examples.smollm2_arithmetic.reward import last_integer
from examples.smollm2_multihop.env import MultihopEnv
from gspo_mcore.envs import ChatRenderer, parse_tool_calls
from gspo_mcore.envs.tools import ToolCall


def generate(model, tok, prompts: list[list[int]], *, max_new_tokens: int, temperature: float) -> list[list[int]]:
    """One turn per prompt (left-padded batch); each turn's ids up to and including the first end-of-turn id."""
    width = max(len(p) for p in prompts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kw = {"do_sample": False} if temperature == 0 else {"do_sample": True, "temperature": temperature, "top_k": 0}
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad, **kw)
    turns = []
    for row in out[:, width:].tolist():
        cut = next((k + 1 for k, t in enumerate(row) if t == tok.eos_token_id), len(row))
        turns.append(row[:cut])
    return turns


def play(model, tok, env, renderer, rows, *, n: int, temperature: float, max_turns: int, max_new_tokens: int):
    """``n`` episodes per row; per episode: (final text, tool calls made, the transcript)."""
    episodes = []
    for r in rows:
        for _ in range(n):
            start = env.reset({"messages": r["messages"], "metadata": r})
            ids = renderer.first(start.observation, start.tools)
            episodes.append({"row": r, "state": start.state, "ids": ids, "calls": [], "text": [], "done": False})
    for _ in range(max_turns):
        live = [e for e in episodes if not e["done"]]
        if not live:
            break
        turns = generate(model, tok, [e["ids"] for e in live], max_new_tokens=max_new_tokens, temperature=temperature)
        for e, turn in zip(live, turns):
            text = tok.decode(turn, skip_special_tokens=True)
            e["text"].append(text)
            e["calls"] += [c for c in parse_tool_calls(text) if isinstance(c, ToolCall)]
            step = env.step(e["state"], text)
            if step.done:
                e["done"] = True
                continue
            stopped = bool(turn) and turn[-1] == tok.eos_token_id
            e["ids"] = e["ids"] + turn + renderer.after_turn(step.observation, turn, stopped)
    return episodes


def summarize(episodes, n: int) -> dict:
    m = len(episodes)
    passed = [e["done"] and last_integer(e["text"][-1], e["row"]) == 1.0 for e in episodes]
    lookups = [sum(c.name == "lookup" for c in e["calls"]) for e in episodes]
    calcs = [sum(c.name == "calculator" for c in e["calls"]) for e in episodes]
    both = [
        any(
            c.name == "lookup" and str(c.arguments.get("name", "")).lower() == e["row"]["name"].lower()
            for c in e["calls"]
        )
        and k > 0
        for e, k in zip(episodes, calcs)
    ]
    groups = [any(passed[i : i + n]) for i in range(0, m, n)]
    return {
        "pass@1": sum(passed) / m,
        "stderr": (sum(passed) / m * (1 - sum(passed) / m) / m) ** 0.5,
        "group_has_pass": sum(groups) / len(groups),
        "lookups_per_episode": sum(lookups) / m,
        "calculator_calls_per_episode": sum(calcs) / m,
        "both_calls": sum(both) / m,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="runs/smollm2/model")
    p.add_argument("--data", default=os.path.join("runs", "smollm2", "data", "multihop"))
    p.add_argument("--items", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--examples", nargs="+", type=int, default=[1, 2])
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.7, 1.0])
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--show", type=int, default=2, help="print this many sampled transcripts per setting")
    a = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in open(os.path.join(a.data, "eval.jsonl"))][: a.items]
    renderer = ChatRenderer(tok, tool_format="fallback")
    for examples in a.examples:
        env = MultihopEnv(table=os.path.join(a.data, "table.json"), examples=examples)
        for temperature in [0.0, *a.temperatures]:
            n = 1 if temperature == 0 else a.n
            t0 = time.perf_counter()
            eps = play(
                model,
                tok,
                env,
                renderer,
                rows,
                n=n,
                temperature=temperature,
                max_turns=a.max_turns,
                max_new_tokens=a.max_new_tokens,
            )
            out = {"examples": examples, "temperature": temperature, "n": n, **summarize(eps, n)}
            out["seconds"] = round(time.perf_counter() - t0, 1)
            print(json.dumps(out), flush=True)
            for e in eps[: a.show]:
                print("   ", json.dumps(e["text"])[:400], file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
