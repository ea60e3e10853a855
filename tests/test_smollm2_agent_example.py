"""The SmolLM2 agent example (examples/smollm2_agent): its config asks for the single-turn example's data, held-out
items and reward with the calculator environment; its environment's worked example is rendered exactly as an
episode renders a call (on a local ChatML tokenizer, and on SmolLM2's own when its prepared folder is there);
its analysis reads episodes right. (Its config's --print-config round trip is in tests/test_config_reference.py.)"""

import json
import math
import os

import pytest
from helpers import ROOT
from helpers.agent_tokenizer import CHATML, make_tokenizer

from examples.smollm2_agent import analyze, prepare_data
from examples.smollm2_agent.env import EXAMPLES, INSTRUCTION, SUFFIX, CalculatorEnv, worked_example
from gspo_mcore.envs import ChatRenderer, load_env
from gspo_mcore.train import parse_config

AGENT = os.path.join(ROOT, "examples", "smollm2_agent", "config.yaml")
SINGLE = os.path.join(ROOT, "examples", "smollm2_arithmetic", "config.yaml")


def test_config_is_the_single_turn_task_with_the_calculator():
    agent, single = parse_config(["--config", AGENT]), parse_config(["--config", SINGLE])
    assert (
        list(agent.data.paths) == ["runs/smollm2/data/" + prepare_data.NAME]
        and agent.model.hf_dir == single.model.hf_dir
    )
    assert agent.reward == single.reward  # correctness of the final answer, no bonus for calling
    (a,), (s,) = agent.eval.datasets, single.eval.datasets
    assert (a.data.paths, a.max_prompts, a.reward) == (s.data.paths, 64, s.reward)
    assert (agent.eval.n, agent.eval.pass_k) == (single.eval.n, single.eval.pass_k)
    r = agent.rollout
    assert r.env == "examples.smollm2_agent.env:CalculatorEnv" and r.episode.tool_format == "fallback"
    assert 2 <= r.episode.max_turns <= 3 and r.engine == "inprocess"
    env = load_env(r.env, r.env_kwargs)
    assert isinstance(env, CalculatorEnv) and list(env.tools) == ["calculator"]


def test_env_offers_the_calculator_and_runs_it():
    env = CalculatorEnv()
    row = {"messages": [{"role": "user", "content": "What is 80 plus 29? Answer with the number only."}]}
    start = env.reset({**row, "metadata": {"answer": "109"}})
    roles = [m["role"] for m in start.observation]
    assert roles == ["system"] + ["user", "assistant", "user", "assistant"] * 2 + ["user"]
    assert start.observation[0]["content"] == INSTRUCTION and start.tools == ()  # the instruction says how to call
    assert start.observation[-1] == row["messages"][0]
    assert [m["role"] for m in CalculatorEnv(examples=0).reset(row).observation] == ["system", "user"]
    assert len(CalculatorEnv(examples=3).reset(row).observation) == 2 + 4 * 3
    step = env.step(
        start.state, '<tool_call>{"name": "calculator", "arguments": {"expression": "80 + 29"}}</tool_call>'
    )
    assert (
        not step.done and step.observation[0]["content"] == "109" and step.info == {"tool_calls": 1, "tool_errors": 0}
    )
    bad = env.step(start.state, '<tool_call>{"name": "calculator", "arguments": {"expression": "x"}}</tool_call>')
    assert bad.info["tool_errors"] == 1 and bad.observation[0]["content"].startswith("Error:")
    assert env.step(start.state, "109").done
    for bad_examples in (4, -1, True, "2"):
        with pytest.raises(ValueError, match="examples must be an integer from 0 to 3"):
            CalculatorEnv(examples=bad_examples)


def _smollm2_tokenizer():
    from transformers import AutoTokenizer

    path = os.environ.get("GSPO_SMOLLM2_DIR") or os.path.join(ROOT, "runs", "smollm2", "model")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        pytest.skip(f"no prepared SmolLM2 folder at {path} (python -m examples.smollm2_arithmetic.prepare)")
    return AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("which", ["local_chatml", "smollm2"])
def test_worked_example_is_rendered_as_an_episode_renders_a_call(which):
    """The prompt's worked example is, token for token in text, what an episode on the same question looks like
    when the policy makes the same call and gives the same answer: the format the model is shown is the one
    the environment will answer."""
    tok = make_tokenizer(CHATML) if which == "local_chatml" else _smollm2_tokenizer()
    renderer = ChatRenderer(tok, tool_format="fallback")
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    question, expression = EXAMPLES[0]
    call, result, answer = (m["content"] for m in worked_example(question, expression)[1:])
    # an episode on the worked example's question, without the worked example
    bare = CalculatorEnv(examples=0)
    start = bare.reset({"messages": [{"role": "user", "content": question + SUFFIX}]})
    ids = renderer.first(start.observation, start.tools)
    turn = enc(call) + [tok.eos_token_id]
    step = bare.step(start.state, call)
    assert step.observation[0]["content"] in result
    ids += turn + renderer.after_turn(step.observation, turn) + enc(answer) + [tok.eos_token_id]
    episode = tok.decode(ids)
    # the prompt with the worked example, for another question, starts with exactly that episode
    question = {"role": "user", "content": "What is 80 plus 29? Answer with the number only."}
    shown = CalculatorEnv(examples=1).reset({"messages": [question]})
    prompt = tok.decode(renderer.first(shown.observation, shown.tools))
    assert prompt.startswith(episode) and prompt.endswith(question["content"] + "<|im_end|>\n<|im_start|>assistant\n")
    assert "<tool_call>" in episode and INSTRUCTION in episode
    # the config's two: the second worked example follows the first as a further exchange
    two = CalculatorEnv(examples=2).reset({"messages": [question]})
    assert tok.decode(renderer.first(two.observation, two.tools)).startswith(
        episode + "\n<|im_start|>user\n" + EXAMPLES[1][0]
    )


def _row(kind, i, j, response, reward, transcript, calls, errors=0):
    return dict(
        set="s",
        kind=kind,
        prompt_index=i,
        sample_index=j,
        response=response,
        reward=reward,
        tool_calls=calls,
        tool_errors=errors,
        turns=1 + calls,
        end="done",
        transcript=transcript,
    )


def test_analysis_counts_calls_results_and_copies(tmp_path):
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "80 + 29"}}</tool_call>'
    res = "<|im_end|>\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    rows = [  # item 0 (answer 109): a right call copied, a right call not copied, a wrong call copied, no call
        _row("sampled", 0, 0, "109", 1.0, call + res.format(109) + "109", 1),
        _row("sampled", 0, 1, "The sum is 100", 0.0, call + res.format(109) + "The sum is 100", 1),
        _row("sampled", 0, 2, "99", 0.0, call + res.format(99) + "99", 1),
        _row("sampled", 0, 3, "109", 1.0, "109", 0),
        # item 1 (answer 50): a tool error, then a right answer; three answers without a call, one right
        _row("sampled", 1, 0, "50", 1.0, call + res.format("Error: bad") + "50", 1, 1),
        *[_row("sampled", 1, j, a, r, a, 0) for j, (a, r) in enumerate([("5", 0.0), ("50", 1.0)], 1)],
        # no call, but the model writes a tool response of its own: not a result
        _row("sampled", 1, 3, "7", 0.0, "<tool_response>\n7\n</tool_response>", 0),
        _row("greedy", 0, 0, "109", 1.0, call + res.format(109) + "109", 1),
        _row("greedy", 1, 0, "5", 0.0, "5", 0),
    ]
    s = analyze.summarize(rows, ["109", "50"])
    sampled, greedy = s["sampled"], s["greedy"]
    assert sampled["pass@1"] == pytest.approx(0.5) and sampled["pass@1_stderr"] == pytest.approx(0.0)
    assert sampled["pass@4"] == 1.0 and greedy["pass@1"] == 0.5 and greedy["tool_call_rate"] == 0.5
    assert sampled["tool_call_rate"] == pytest.approx(4 / 8) and sampled["tool_error_rate"] == pytest.approx(1 / 8)
    assert sampled["tool_result_right"] == pytest.approx(2 / 8) and sampled["own_tool_response"] == pytest.approx(1 / 8)
    assert sampled["final_equals_tool"] == pytest.approx(2 / 3)  # of the 3 numeric results, 2 copied
    assert sampled["correct_with_call"] == pytest.approx(2 / 4) and sampled["correct_without_call"] == pytest.approx(
        2 / 4
    )
    assert sampled["bare_number"] == pytest.approx(7 / 8)
    # the command line over a run folder: one table, first evaluation against the last
    (tmp_path / "eval_samples").mkdir()
    for step in (0, 12):
        with open(tmp_path / "eval_samples" / f"step_{step}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    data = tmp_path / "eval.jsonl"
    data.write_text('{"answer": "109"}\n{"answer": "50"}\n')
    assert analyze.main([str(tmp_path), "--data", str(data), "--json", str(tmp_path / "a.json")]) == 0
    assert json.loads((tmp_path / "a.json").read_text())["12"]["sampled"]["episodes_with_call"] == 4


def test_training_data_leaves_the_held_out_items_out(tmp_path):
    with pytest.raises(prepare_data.DataError, match="eval_2_digit_addition.jsonl is missing"):
        prepare_data.training_rows(str(tmp_path))
    add = ["80 + 29", "3 + 4", "11 + 12", "80 + 29", "5 + 6"]  # the first 2 held out; a repeat of one later
    sub = ["50 - 7", "3 + 4"]
    for name, items in zip(prepare_data.SOURCES, (add, sub)):
        (tmp_path / name).write_text("".join(json.dumps({"expression": e}) + "\n" for e in items))
    rows, held_out = prepare_data.training_rows(str(tmp_path), held_out=2)
    assert held_out == {"80 + 29", "3 + 4"} and [r["expression"] for r in rows] == ["11 + 12", "5 + 6", "50 - 7"]
    with pytest.raises(prepare_data.DataError, match="--held-out must be in 1..4"):
        prepare_data.training_rows(str(tmp_path), held_out=5)
    # the command writes the shipped items over the folder's files, then the split: 998 + 1000 distinct items
    assert prepare_data.main(["--data", str(tmp_path), "--held-out", "2"]) == 0
    assert len((tmp_path / prepare_data.NAME).read_text().splitlines()) == 1998


def test_worked_examples_are_not_held_out_items(tmp_path):
    assert prepare_data.main(["--data", str(tmp_path)]) == 0
    rows, held_out = prepare_data.training_rows(str(tmp_path))
    assert not {e for _, e in EXAMPLES} & (held_out | {r["expression"] for r in rows})


def test_pass_figures_average_items_not_episodes():
    """pass@1 is the mean of the items' pass rates (an item with more episodes does not weigh more), its standard
    error is over items, and pass@4 is given only when every item has 4 episodes (both analyses use this)."""
    s = analyze.pass_figures([0, 0, 0, 0, 1, 1], [1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    assert s["episodes"] == 6 and s["items"] == 2
    assert s["pass@1"] == pytest.approx((0.75 + 0.0) / 2)
    assert s["pass@1_stderr"] == pytest.approx(math.sqrt(((0.75 - 0.375) ** 2 + 0.375**2) / 1 / 2))
    assert "pass@4" not in s
    s = analyze.pass_figures([0] * 4 + [1] * 4, [1.0, 0.0, 0.0, 0.0] + [0.0] * 4)
    assert s["pass@4"] == pytest.approx(0.5)
