"""The tiny agent example (examples/agent_tiny): its inputs, its environment, and a 2-step run of its config.
(Its config's parsing and --print-config are checked with every example's in tests/test_config_reference.py.)"""

import json
import os
import subprocess

import pytest
import yaml
from helpers import ROOT
from helpers.launch import torchrun

from examples.agent_tiny.task import PROMPT, TOOL_CALL, TOOL_CALL_ID, LookupEnv, prepare, reward
from examples.tiny.task import held_out_strings


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("agent_tiny")
    return out, prepare(str(out), num_prompts=64)


def test_inputs_hide_the_secret_and_hold_out_the_held_out_secrets(prepared):
    from transformers import AutoTokenizer

    _, paths = prepared
    tok = AutoTokenizer.from_pretrained(paths["model_dir"])
    assert tok(TOOL_CALL, add_special_tokens=False)["input_ids"] == [TOOL_CALL_ID]
    # an episode that looks up: prompt, the one-token call, the 4-token observation, each character one token
    ids = tok(f"{PROMPT}{TOOL_CALL}042>", add_special_tokens=False)["input_ids"]
    assert len(ids) == len(PROMPT) + 1 + 4 and ids[len(PROMPT)] == TOOL_CALL_ID
    # the config stops a turn at the call token, in training and in evaluation
    cfg = yaml.safe_load(open(os.path.join(ROOT, "examples", "agent_tiny", "config.yaml")))
    assert cfg["rollout"]["sampling"]["stop_token_ids"] == [TOOL_CALL_ID]
    assert cfg["eval"]["sampling"]["stop_token_ids"] == [TOOL_CALL_ID]
    assert tok.decode(tok(f"1{TOOL_CALL}2", add_special_tokens=False)["input_ids"]) == f"1{TOOL_CALL}2"
    train = [json.loads(line) for line in open(paths["prompts_path"])]
    held = [json.loads(line) for line in open(paths["heldout_path"])]
    assert len(train) == 64 and [r["answer"] for r in held] == held_out_strings(3)
    assert not {r["answer"] for r in train} & {r["answer"] for r in held}
    for r in train + held:  # one prompt for every row: the secret is only in the environment
        assert r["prompt"] == PROMPT and len(r["answer"]) == 3 and r["answer"].isdigit()


def test_lookup_env_answers_a_tool_call_with_the_secret():
    env = LookupEnv(call_bonus=0.5)
    row = {"prompt": PROMPT, "messages": None, "metadata": {"answer": "042"}}
    first = env.reset(row)
    assert first.observation == PROMPT
    call = env.step(first.state, TOOL_CALL)
    assert (call.observation, call.done, call.reward, call.info) == ("042>", False, 0.5, {"tool_calls": 1})
    second = env.step(first.state, "042")  # the answer after the lookup ends the episode, without a bonus
    assert second.done and second.reward == 0.0
    # only a turn that is exactly the call is one; any other first turn is an answer without the lookup, and the
    # environment cancels its score: a guess is worth 0, however lucky
    for turn, score in (("042", 1.0), ("040", 0.2 + 0.8 * 2 / 3), ("04", 0.8 * 2 / 3), (f"x{TOOL_CALL}", 0.0)):
        direct = env.reset(row)
        end = env.step(direct.state, turn)
        assert end.done and end.info == {} and end.reward == pytest.approx(-score), turn
        assert reward(turn, {"answer": "042"}) + end.reward == pytest.approx(0.0)
    # the tiny job's reward: 0.2 for three tokens then EOS, 0.8 x the fraction of right digits
    assert reward("042", {"answer": "042"}) == 1.0
    assert reward("040", {"answer": "042"}) == pytest.approx(0.2 + 0.8 * 2 / 3)
    assert reward("0424", {"answer": "042"}) == pytest.approx(0.8)


@pytest.mark.distributed
def test_two_steps_of_the_example(prepared):
    out, paths = prepared
    cmd = [
        *torchrun(2),
        "-m",
        "gspo_mcore.train",
        "--config",
        "examples/agent_tiny/config.yaml",
        "steps=2",
        f"model.hf_dir={paths['model_dir']}",
        f"data.paths=[{paths['prompts_path']}]",
        f"log.output_dir={out}/run",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "log.progress_bar=false",
        f"eval.datasets=[{{name: heldout, max_prompts: 4, data: {{paths: [{paths['heldout_path']}]}}}}]",
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    # every training step's record (a step whose groups all have equal rewards makes no update and has no "loss":
    # at the random start most episodes guess, and guesses are worth 0)
    rows = [r for r in records if "episode_turns_mean" in r]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["episode_end_done"] + r.get("episode_end_max_turns", 0.0) == 1.0
        assert 0.0 <= r["episode_tool_use_fraction"] <= 1.0 and 1.0 <= r["episode_turns_mean"] <= 2.0
        # a call gets exactly "SECRET>" back: 4 environment tokens per calling episode
        assert r["episode_env_tokens_mean"] == pytest.approx(4 * r["episode_tool_use_fraction"])
    assert sum("eval/heldout/pass@1" in r for r in records) == 2
