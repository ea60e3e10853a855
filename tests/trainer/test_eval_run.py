"""Evaluation inside a real run (the tiny job, in-process engine): its metrics reach metrics.jsonl on the
documented schedule, and it leaves the training trajectory exactly as it is without evaluation."""

import json
import os
import subprocess

import pytest
from helpers.launch import prepare_tiny, torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EVAL_KEYS = {
    "reward_mean",
    "pass@1",
    "pass@2",
    "pass@1_stderr",
    "greedy_pass@1",
    "greedy_reward_mean",
    "response_length_mean",
    "truncated_fraction",
    "num_prompts",
}


def _train(tmp_path, name, *overrides) -> subprocess.CompletedProcess:
    """3 steps of the tiny job on 1 rank (4 prompts x 4 samples) into ``tmp_path/name``."""
    cmd = [
        *torchrun(1),
        "-m",
        "gspo_mcore.train",
        "--config",
        "examples/tiny/config.yaml",
        "steps=3",
        f"model.hf_dir={tmp_path}/model",
        f"data.paths=[{tmp_path}/prompts.jsonl]",
        f"log.output_dir={tmp_path / name}",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "batch.num_minibatches=2",
        "log.progress_bar=false",
        "log.tensorboard=false",
        "eval.datasets=[]",
        *overrides,
    ]
    return subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1")
    )


def _run(tmp_path, name, *overrides):
    proc = _train(tmp_path, name, *overrides)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.distributed
def test_eval_is_logged_on_schedule_and_does_not_change_training(tmp_path):
    prepare_tiny(tmp_path, 64)
    plain = _run(tmp_path, "plain")
    evald = _run(
        tmp_path,
        "eval",
        "eval.every=2",
        "eval.n=2",
        "eval.pass_k=[1,2]",
        f"eval.datasets=[{{name: heldout, data: {{paths: [{tmp_path}/heldout.jsonl]}}, max_prompts: 8}}]",
    )
    train = [r for r in evald if "loss" in r]
    evals = [r for r in evald if "eval/heldout/pass@1" in r]
    assert [r["step"] for r in evals] == [0, 2, 3]  # before the first step, every 2, after the last
    for r in evals:
        assert {k.removeprefix("eval/heldout/") for k in r if k != "step"} == EVAL_KEYS
        assert r["eval/heldout/num_prompts"] == 8
        assert 0.0 <= r["eval/heldout/pass@1"] <= r["eval/heldout/pass@2"] <= 1.0
    assert len(train) == len(plain) == 3
    for a, b in zip(train, plain):  # the training trajectory is untouched, to the bit
        for key in ("reward_mean", "loss", "grad_norm", "clip_fraction", "entropy", "response_length_mean"):
            assert a[key] == b[key], (a["step"], key)


def test_a_prompt_longer_than_the_model_allows_is_refused_before_anything_is_built(tmp_path):
    prepare_tiny(tmp_path, 8)
    long = tmp_path / "long.jsonl"
    long.write_text(
        json.dumps({"prompt": "rev:1>", "answer": "1"})
        + "\n"
        + json.dumps({"prompt": "rev:" + "7" * 70 + ">", "answer": "7"})
        + "\n"
    )
    from gspo_mcore.train import parse_config
    from gspo_mcore.trainer import run

    for field in ("data.paths", "eval.datasets"):
        value = f"[{long}]" if field == "data.paths" else f"[{{name: h, data: {{paths: [{long}]}}}}]"
        cfg = parse_config(
            [
                "--config",
                "examples/tiny/config.yaml",
                f"model.hf_dir={tmp_path}/model",
                f"data.paths=[{tmp_path}/prompts.jsonl]",
                "eval.datasets=[]",
                f"{field}={value}",
                f"log.output_dir={tmp_path}/out",
            ]
        )
        match = (
            rf"data: {long}:2: the prompt has 75 tokens"
            if field == "data.paths"
            else r"eval.datasets\[h\]: prompt 1: the prompt has 75 tokens"
        )
        with pytest.raises(
            ValueError,
            match=match + r"; with max_new_tokens 6 that exceeds the model's "
            r"max_position_embeddings 64",
        ):
            run(cfg)
        assert not (tmp_path / "out").exists()  # refused before the output directory or a model exists


def test_an_eval_set_missing_the_rewards_field_is_refused_at_start_up(tmp_path):
    prepare_tiny(tmp_path, 8)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "rev:123>", "answer": "321"}) + "\n" + json.dumps({"prompt": "rev:1>"}) + "\n")
    from gspo_mcore.rewards import RewardSetupError
    from gspo_mcore.train import parse_config
    from gspo_mcore.trainer import run

    cfg = parse_config(
        [
            "--config",
            "examples/tiny/config.yaml",
            f"model.hf_dir={tmp_path}/model",
            f"data.paths=[{tmp_path}/prompts.jsonl]",
            f"log.output_dir={tmp_path}/out",
            f"eval.datasets=[{{name: h, data: {{paths: [{bad}]}}}}]",
        ]
    )
    with pytest.raises(RewardSetupError, match=rf"{bad}:2.*answer"):
        run(cfg)
    assert not (tmp_path / "out").exists()


@pytest.mark.distributed
def test_a_reward_that_always_fails_stops_the_run_before_any_update(tmp_path):
    """``json:loads(response, metadata)`` raises TypeError on every call: the first step's reward stops the run
    (reward.max_error_fraction 0.1 by default) with the cause and the prompt, before an optimizer step."""
    prepare_tiny(tmp_path, 16)
    proc = _train(tmp_path, "run", "reward.reward=json:loads", "reward.required_fields=[]")
    out = tmp_path / "run"
    assert proc.returncode != 0
    assert "RewardFailure" in proc.stderr and "TypeError" in proc.stderr and "rev:" in proc.stderr
    assert not (out / "metrics.jsonl").read_text().strip()  # no step was logged: nothing trained on zeros
