"""Screen a prompt before training: how often does the untrained model's first turn call the calculator?

    python -m examples.smollm2_agent.screen [--model runs/smollm2/model]
        [--data runs/smollm2/data/eval_2_digit_addition.jsonl] [--items 16] [--n 4] [--examples 0 1 2 3]

For each number of worked ``examples``, the first turn of ``--items`` held-out rows is rendered exactly as an episode
renders it (:class:`~gspo_mcore.envs.ChatRenderer` over :class:`CalculatorEnv`'s reset) and sampled ``--n``
times at temperature 1 (and once greedily) with transformers' ``generate``; printed per setting: the
fraction of turns with a ``<tool_call>``, of those that parse as a calculator call, and of those whose
result is the right answer. One JSON line per setting.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from examples.smollm2_agent.env import CalculatorEnv
from gspo_mcore.envs import ChatRenderer, parse_tool_calls
from gspo_mcore.envs.tools import ToolCall


def first_turns(model, tok, prompts: list[list[int]], *, n: int, max_new_tokens: int, greedy: bool) -> list[str]:
    """``n`` first turns per prompt (prompt-major), left-padded batched ``generate``."""
    width = max(len(p) for p in prompts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    with torch.no_grad():
        out = model.generate(
            input_ids=ids.repeat_interleave(n, 0),
            attention_mask=mask.repeat_interleave(n, 0),
            max_new_tokens=max_new_tokens,
            pad_token_id=pad,
            **kwargs,
        )
    return [tok.decode(row[width:], skip_special_tokens=True) for row in out]


def score(turns: list[str], answers: list[str]) -> dict:
    """Per turn: a ``<tool_call>`` at all, a valid calculator call, a call whose result is the answer."""
    called = valid = right = 0
    for text, answer in zip(turns, answers):
        calls = parse_tool_calls(text)
        called += bool(calls)
        ok = [c for c in calls if isinstance(c, ToolCall) and c.name == "calculator"]
        if ok and set(ok[0].arguments) == {"expression"}:
            valid += 1
            try:
                from gspo_mcore.envs.builtin import calculator

                right += calculator(str(ok[0].arguments["expression"])) == str(answer)
            except ValueError:
                pass
    m = len(turns)
    return {"turns": m, "call_rate": called / m, "valid_call_rate": valid / m, "right_call_rate": right / m}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="runs/smollm2/model")
    p.add_argument("--data", default="runs/smollm2/data/eval_2_digit_addition.jsonl")
    p.add_argument("--items", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--examples", nargs="+", type=int, default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    p.add_argument("--show", type=int, default=3, help="print this many sampled turns per setting")
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in open(args.data)][: args.items]
    renderer = ChatRenderer(tok, tool_format="fallback")
    for examples in args.examples:
        env = CalculatorEnv(examples=examples)
        prompts = []
        for r in rows:
            start = env.reset({"messages": r["messages"], "metadata": r})
            prompts.append(renderer.first(start.observation, start.tools))
        answers = [r["answer"] for r in rows]
        sampled = first_turns(model, tok, prompts, n=args.n, max_new_tokens=args.max_new_tokens, greedy=False)
        greedy = first_turns(model, tok, prompts, n=1, max_new_tokens=args.max_new_tokens, greedy=True)
        out = {"examples": examples, "prompt_tokens": len(prompts[0])}
        out.update({f"sampled_{k}": v for k, v in score(sampled, [a for a in answers for _ in range(args.n)]).items()})
        out.update({f"greedy_{k}": v for k, v in score(greedy, answers).items()})
        print(json.dumps(out), flush=True)
        for t in sampled[: args.show]:
            print("   ", repr(t[:160]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
