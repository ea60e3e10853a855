"""The trainer with ``rollout.env`` end to end: two steps of the tiny job with 2-turn episodes (1 rank,
in-process engine): the loop runs, the learner trains on the policy tokens, and metrics.jsonl carries the
episode figures. (A bad ``rollout.env`` is an input error at start-up: tests/trainer/test_input_errors.py.)"""

import json
import os
import subprocess

import pytest
from helpers import ROOT
from helpers.launch import prepare_tiny, torchrun


def _train(tmp_path, *extra, steps=2, name="run"):
    out = tmp_path / name
    cmd = [
        *torchrun(1),
        "-m",
        "gspo_mcore.train",
        "--config",
        "examples/tiny/config.yaml",
        f"steps={steps}",
        f"model.hf_dir={tmp_path}/model",
        f"data.paths=[{tmp_path}/prompts.jsonl]",
        f"log.output_dir={out}",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "log.progress_bar=false",
        "eval.datasets=[]",
        *extra,
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    return proc, out


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agent")
    prepare_tiny(tmp, 32)
    return tmp


TWO_TURNS = ("rollout.episode.max_turns=3", "rollout.episode.max_total_tokens=96")


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def two_turns_run(prepared, tmp_path_factory):
    proc, out = _train(
        prepared,
        "rollout.env=examples.agent_tiny.env:TwoTurns",
        "rollout.env_kwargs={hint: ' ok ', bonus: 0.25}",
        *TWO_TURNS,
        # evaluation runs the same environment (the evaluator hands it the dataset rows)
        f"eval.datasets=[{{name: held, max_prompts: 4, data: {{paths: [{prepared}/prompts.jsonl]}}}}]",
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return out


@pytest.mark.distributed
def test_tiny_job_with_two_turn_episodes(two_turns_run):
    records = _records(two_turns_run)
    assert sum("eval/held/pass@1" in r for r in records) == 2  # before the first step and after the last
    rows = [r for r in records if "loss" in r]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["episode_turns_mean"] == 2.0 and r["episode_end_done"] == 1.0, r
        assert r["episode_tool_calls_mean"] == 1.0 and r["episode_env_tokens_mean"] > 0
        assert r["episode_policy_tokens_mean"] > 0 and r["loss"] == r["loss"]  # finite
    # every episode's end, one line each (gspo_mcore/trainer/episode_log.py)
    episodes = [json.loads(line) for line in (two_turns_run / "episodes.jsonl").read_text().splitlines()]
    assert [e["step"] for e in episodes] == [0] * 16 + [1] * 16
    assert all(e["end"] == "done" and e["cause"] is None and e["turns"] == 2 for e in episodes)


@pytest.mark.distributed
def test_an_agent_program_over_the_endpoint_trains_the_same_steps(prepared, two_turns_run):
    """The same episodes written as an agent program that calls the OpenAI-compatible endpoint over HTTP
    (examples/agent_tiny/agent.py, gspo_mcore.envs:AgentEnv with serve: true): the same tokens, rewards and
    losses as the environment class, step for step."""
    proc, out = _train(
        prepared,
        "rollout.env=gspo_mcore.envs:AgentEnv",
        "rollout.env_kwargs={agent: examples.agent_tiny.agent:two_turns_http, "
        "agent_kwargs: {hint: ' ok ', bonus: 0.25}, serve: true}",
        *TWO_TURNS,
        f"eval.datasets=[{{name: held, max_prompts: 4, data: {{paths: [{prepared}/prompts.jsonl]}}}}]",
        name="agent_program",
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    ref, got = _records(two_turns_run), _records(out)
    assert len(got) == len(ref)
    keys = ("loss", "reward_mean", "eval/held/pass@1", "episode_turns_mean", "episode_env_tokens_mean")
    keys += ("episode_policy_tokens_mean", "response_length_mean", "grad_norm")
    for a, b in zip(got, ref):
        assert a["step"] == b["step"]
        for k in keys:
            assert a.get(k) == b.get(k), (k, a.get(k), b.get(k))
    rows = [r for r in got if "loss" in r]
    assert [r["step"] for r in rows] == [0, 1] and all(r["episode_end_done"] == 1.0 for r in rows)
    assert all(r[k] is not None for r in rows for k in ("loss", "reward_mean", "grad_norm"))
    assert all(r["episode_tool_calls_mean"] == 0.0 for r in rows)  # no <tool_call> in the tiny turns
