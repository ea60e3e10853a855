"""The SmolLM2 multi-hop example (examples/smollm2_multihop) and its environment (gspo_mcore.envs.lookup): the
config parses and its environment builds over the generated table; the data keeps held-out people out of training;
the lookup tool answers, errs and refuses an empty table; a worked exchange is what an episode renders; one whole
episode (lookup, calculator, answer) runs through the environment; the screen's and the analysis' scoring count
calls right."""

import json
import os

import pytest
from helpers import ROOT
from helpers.agent_tokenizer import CHATML, make_tokenizer

from examples.smollm2_multihop import analyze, prepare_data, screen
from examples.smollm2_multihop.env import EXAMPLE_PEOPLE, INSTRUCTION, INSTRUCTIONS, MultihopEnv, worked_example
from examples.smollm2_multihop.make_items import make_items, make_table
from gspo_mcore.envs import ChatRenderer, load_env
from gspo_mcore.envs.lookup import LookupEnv, load_table
from gspo_mcore.envs.tools import ToolCall
from gspo_mcore.train import parse_config

CONFIG = os.path.join(ROOT, "examples", "smollm2_multihop", "config.yaml")


def _call(tool, **arguments):
    return f"<tool_call>{json.dumps({'name': tool, 'arguments': arguments})}</tool_call>"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("multihop")
    counts = prepare_data.write(str(out), people=60, held_out=10, per_name=2)
    assert counts == {"table.json": 63, "train.jsonl": 100, "eval.jsonl": 10}
    return out


def test_config_parses_and_its_environment_builds_over_the_table(data):
    cfg = parse_config(["--config", CONFIG])
    r = cfg.rollout
    assert r.env == "examples.smollm2_multihop.env:MultihopEnv" and r.episode.tool_format == "fallback"
    assert r.episode.max_turns == 4 and r.engine == "inprocess" and cfg.model.hf_dir == "runs/smollm2/model"
    assert r.env_kwargs["table"] == "runs/smollm2/data/multihop/table.json"
    assert list(cfg.data.paths) == ["runs/smollm2/data/multihop/train.jsonl"]
    assert [d.data.paths for d in cfg.eval.datasets] == [("runs/smollm2/data/multihop/eval.jsonl",)]
    env = load_env(r.env, {**r.env_kwargs, "table": str(data / "table.json")})
    assert isinstance(env, MultihopEnv) and list(env.tools) == ["lookup", "calculator"]
    with pytest.raises(ValueError, match=r"rollout.env: .*no table file"):
        load_env(r.env, {**r.env_kwargs, "table": str(data / "missing.json")})


def test_held_out_people_are_never_asked_about_in_training(data):
    table = json.loads((data / "table.json").read_text())
    train = [json.loads(line) for line in open(data / "train.jsonl")]
    held = [json.loads(line) for line in open(data / "eval.jsonl")]
    train_names, held_names = {r["name"] for r in train}, {r["name"] for r in held}
    assert len(held_names) == 10 and not train_names & held_names and (train_names | held_names) <= set(table)
    assert not {name for name, _ in EXAMPLE_PEOPLE} & (train_names | held_names)
    for r in train + held:  # the answer is the expression on the table's age
        age = table[r["name"]]["age"]
        assert str(age) in r["expression"] and eval(r["expression"]) == int(r["answer"])  # noqa: S307
    assert make_table(60) == make_table(60) and make_table(60, seed=1) != make_table(60)
    # the example asks only "in N years" (the default); both forms on request, and no unknown one
    assert all("will" in r["messages"][0]["content"] and "+" in r["expression"] for r in train + held)
    both = make_items(table, sorted(train_names), 4, templates=(0, 1))
    assert {"+" in r["expression"] for r in both} == {True, False}
    with pytest.raises(ValueError, match="templates"):
        make_items(table, sorted(train_names), 1, templates=(2,))


def test_lookup_answers_errs_and_an_empty_table_is_refused():
    env = LookupEnv(table={"Bexmel": {"age": 34}, "Tom": {"age": 5, "price": 3}})
    state = env.reset({"prompt": "q", "metadata": {}}).state
    step = env.step(state, _call("lookup", name=" bexmel "))
    assert step.observation[0]["content"] == "age: 34" and step.info == {"tool_calls": 1, "tool_errors": 0}
    bare = LookupEnv(table={"Bexmel": {"age": 34}}, name_fields=False)
    assert bare.step(state, _call("lookup", name="Bexmel")).observation[0]["content"] == "34"
    assert env.step(state, _call("lookup", name="Tom")).observation[0]["content"] == "age: 5, price: 3"
    assert env.step(state, _call("lookup", name="Tom", field="price")).observation[0]["content"] == "3"
    bad = env.step(state, _call("lookup", name="Nobody"))
    assert bad.info["tool_errors"] == 1 and "no entry named 'Nobody'" in bad.observation[0]["content"]
    for empty in ({}, {"Bexmel": {}}):
        with pytest.raises(ValueError, match="table"):
            LookupEnv(table=empty)
    with pytest.raises(ValueError, match="the table is empty"):
        load_table({})
    with pytest.raises(ValueError, match="the table is empty"):
        make_items({}, [], 1)
    with pytest.raises(ValueError, match=r"rollout.env: .*the table is empty"):
        load_env("gspo_mcore.envs.lookup:LookupEnv", {"table": {}})


def test_one_whole_episode_looks_up_computes_and_answers(data):
    env = MultihopEnv(table=str(data / "table.json"), examples=2)
    row = json.loads(open(data / "eval.jsonl").readline())
    start = env.reset({"messages": row["messages"], "metadata": row})
    assert start.observation[0]["content"] == INSTRUCTION and start.observation[-1] == row["messages"][0]
    assert len(start.observation) == 2 + 6 * 2
    first = env.step(start.state, _call("lookup", name=row["name"]))
    age = first.observation[0]["content"]
    assert not first.done and age.startswith("age: ") and age[5:] in row["expression"]
    second = env.step(start.state, _call("calculator", expression=row["expression"]))
    assert second.observation[0]["content"] == row["answer"]
    assert env.step(start.state, row["answer"]).done
    # the screen's scoring of that episode: passed, both needed calls made
    episode = {
        "row": row,
        "done": True,
        "text": ["", "", row["answer"]],
        "calls": [ToolCall("lookup", {"name": row["name"]}), ToolCall("calculator", {"expression": row["expression"]})],
    }
    miss = {**episode, "text": ["", "1"], "calls": [ToolCall("calculator", {"expression": "1"})]}
    s = screen.summarize([episode, miss], 2)
    assert (s["pass@1"], s["both_calls"], s["group_has_pass"], s["lookups_per_episode"]) == (0.5, 0.5, 1.0, 0.5)
    with pytest.raises(ValueError, match="instruction must be one of"):
        MultihopEnv(table=str(data / "table.json"), instruction="nope")
    old = MultihopEnv(table=str(data / "table.json"), instruction="two_tools", name_fields=False)
    start = old.reset({"messages": row["messages"], "metadata": row})
    assert start.observation[0]["content"] == INSTRUCTIONS["two_tools"] and "\n41\n" in start.observation[3]["content"]


def test_analysis_counts_the_policy_calls_not_the_environment_messages():
    """The analysis of an evaluation episode: the calls in the policy's turns (a call quoted in a tool result is
    not one), the right person looked up, a calculator call that gives the answer, the looked-up age answered."""
    item = {"name": "Bexmel", "expression": "34 + 5", "answer": "39", "messages": []}
    lookup, calc = _call("lookup", name="bexmel"), _call("calculator", expression="34 + 5")
    end, user = "<|im_end|>\n", "<|im_start|>user\n<tool_response>\n"
    good = (
        f"{lookup}{end}{user}age: 34\n</tool_response>{end}<|im_start|>assistant\n{calc}{end}{user}39\n</tool_response>"
    )
    good += f"{end}<|im_start|>assistant\n39<|im_end|>"
    f = analyze.episode_figures({"transcript": good, "response": "39", "reward": 1.0}, item)
    assert f == {
        "correct": 1.0,
        "calls": 2.0,
        "lookups": 1.0,
        "calculator_calls": 1.0,
        "both_calls": 1.0,
        "right_computation": 1.0,
        "answers_age": 0.0,
    }
    quoted = f"{lookup}{end}{user}{calc}\n</tool_response>{end}<|im_start|>assistant\n34<|im_end|>"
    f = analyze.episode_figures({"transcript": quoted, "response": "34", "reward": 0.0}, item)
    assert (f["calls"], f["both_calls"], f["right_computation"], f["answers_age"]) == (1.0, 0.0, 0.0, 1.0)


def test_worked_example_is_rendered_as_an_episode_renders_its_calls():
    """An episode on the worked exchange's question (the same two calls, the same answer) is, in text, exactly how
    the prompt with that worked exchange begins: the format the model is shown is the one the environment answers
    (the local ChatML tokenizer, fallback format)."""
    tok = make_tokenizer(CHATML)
    renderer = ChatRenderer(tok, tool_format="fallback")
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    shown = worked_example(0)
    table = {name: {"age": age} for name, age in EXAMPLE_PEOPLE}
    bare = MultihopEnv(table=table, examples=0)
    start = bare.reset({"messages": [shown[0]]})
    ids = renderer.first(start.observation, start.tools)
    for k in (1, 3):  # the lookup, then the calculator
        turn = enc(shown[k]["content"]) + [tok.eos_token_id]
        step = bare.step(start.state, shown[k]["content"])
        assert step.observation[0]["content"] in shown[k + 1]["content"]
        ids += turn + renderer.after_turn(step.observation, turn)
    ids += enc(shown[5]["content"]) + [tok.eos_token_id]
    episode = tok.decode(ids)
    question = {"role": "user", "content": "How old will Singri be in 41 years? Answer with the number only."}
    one = MultihopEnv(table=table, examples=1).reset({"messages": [question]})
    prompt = tok.decode(renderer.first(one.observation, one.tools))
    assert prompt.startswith(episode) and prompt.endswith(question["content"] + "<|im_end|>\n<|im_start|>assistant\n")
    assert episode.count("<tool_call>") == 2 + 2 and INSTRUCTION in episode  # the instruction shows both calls
