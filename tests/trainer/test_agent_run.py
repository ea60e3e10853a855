"""The trainer with ``rollout.env`` end to end: two steps of the tiny job with 2-turn episodes (1 rank,
in-process engine): the loop runs, the learner trains on the policy tokens, and metrics.jsonl carries the
episode figures. (A bad ``rollout.env`` is an input error at start-up: tests/trainer/test_input_errors.py.)"""

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT
from helpers.launch import torchrun


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
    subprocess.run(
        [sys.executable, "-m", "examples.tiny.prepare", "--out", str(tmp), "--num-prompts", "32"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    return tmp


@pytest.mark.distributed
def test_tiny_job_with_two_turn_episodes(prepared):
    proc, out = _train(
        prepared,
        "rollout.env=examples.agent_tiny.env:TwoTurns",
        "rollout.env_kwargs={hint: ' ok ', bonus: 0.25}",
        "rollout.episode.max_turns=3",
        "rollout.episode.max_total_tokens=96",
        # evaluation runs the same environment (the evaluator hands it the dataset rows)
        f"eval.datasets=[{{name: held, max_prompts: 4, data: {{paths: [{prepared}/prompts.jsonl]}}}}]",
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum("eval/held/pass@1" in r for r in records) == 2  # before the first step and after the last
    rows = [r for r in records if "loss" in r]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["episode_turns_mean"] == 2.0 and r["episode_end_done"] == 1.0, r
        assert r["episode_tool_calls_mean"] == 1.0 and r["episode_env_tokens_mean"] > 0
        assert r["episode_policy_tokens_mean"] > 0 and r["loss"] == r["loss"]  # finite
