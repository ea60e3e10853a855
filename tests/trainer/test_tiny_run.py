"""The trainer end to end: a few steps of the tiny job on 2 CPU ranks (DP2, in-process engine).

Checks that the loop runs, that metrics.jsonl has one record per step with the documented keys, that
the resolved config is saved beside it, and that tools/plot_metrics.py turns it into a PNG.
"""

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT
from helpers.launch import prepare_tiny, torchrun

KEYS = {
    "step",
    "reward_mean",
    "reward_std",
    "clip_fraction",
    "clipped_sequence_fraction",
    "ratio_mean",
    "ratio_min",
    "ratio_max",
    "response_length_mean",
    "logprob_mismatch",
    "time_rollout_s",
    "time_train_s",
    "time_reward_s",
    "rollout_tokens_per_s",
    "train_tokens_per_s",
    "entropy",
    "grad_norm",
    "loss",
    "zero_advantage_group_fraction",
    "reward_errors",
    "reward_timeouts",
}


@pytest.mark.distributed
def test_tiny_job_runs_on_two_ranks_and_writes_metrics(tmp_path):
    prepare_tiny(tmp_path, 64)
    out = tmp_path / "run"
    cmd = [
        *torchrun(2),
        "-m",
        "gspo_mcore.train",
        "--config",
        "examples/tiny/config.yaml",
        "steps=3",
        f"model.hf_dir={tmp_path}/model",
        f"data.paths=[{tmp_path}/prompts.jsonl]",
        f"log.output_dir={out}",
        "rollout.prompts_per_step=8",
        "rollout.group_size=4",
        "log.progress_bar=false",
        # the loss options (docs/loss.md) through the real loop: TIS over the engine's log-probs, the KL
        # reference's weight swap (k3, reported), the entropy bonus
        "loss.off_policy.mode=tis",
        "loss.kl_coef=0.01",
        "loss.entropy_coef=0.001",
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "gspo-train: 3 steps" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        missing = KEYS - set(r)
        assert not missing, f"metrics.jsonl lacks {sorted(missing)}"
        assert 0.0 <= r["reward_mean"] <= 1.0
        assert 0.0 <= r["clip_fraction"] <= 1.0
        # in-process engine and learner: the same fp32 model; measured 2.1e-7 here, 3.7e-7 over the 300-step demo
        assert r["logprob_mismatch"] < 7.5e-7
        # the same fp32 model: weights ~1, KL(mu || pi_prox) ~0; the reference is the initial policy
        assert abs(r["is_weight_mean"] - 1) < 1e-5 and r["is_masked_fraction"] == 0.0
        assert 0.0 <= r["kl_behaviour_prox"] < 1e-9
        assert r["staleness_lag_0"] == 1.0 and r["staleness_max"] == 0.0  # the synchronous loop
    # k3 >= 0; 0 at the first mini-batch of step 0, then the updates move the policy off the reference
    assert all(r["kl"] >= 0 for r in rows) and rows[-1]["kl"] > rows[0]["kl"] > 0
    assert (out / "config.yaml").exists()
    assert any(p.name.startswith("events.out.tfevents") for p in (out / "tensorboard").iterdir())
    png = subprocess.run(
        [sys.executable, "tools/plot_metrics.py", str(out / "metrics.jsonl")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert png.returncode == 0, png.stderr
    assert (out / "metrics.png").stat().st_size > 10_000


def test_plot_tool_names_a_malformed_line(tmp_path):
    bad = tmp_path / "metrics.jsonl"
    bad.write_text('{"step": 0, "reward_mean": 0.1}\nnot json\n')
    proc = subprocess.run([sys.executable, "tools/plot_metrics.py", str(bad)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode != 0 and "metrics.jsonl:2" in proc.stderr


@pytest.mark.distributed
def test_tiny_moe_job_with_routing_replay_measures_routing_volatility(tmp_path):
    """The MoE model on 2 ranks (EP2) with Routing Replay and the volatility measurement every step."""
    prepare_tiny(tmp_path, 64, "--moe")
    out = tmp_path / "run"
    cmd = [
        *torchrun(2),
        "-m",
        "gspo_mcore.train",
        "--config",
        "examples/tiny/config.yaml",
        "steps=2",
        "parallel.expert=2",
        f"model.hf_dir={tmp_path}/model_moe",
        f"data.paths=[{tmp_path}/prompts.jsonl]",
        f"log.output_dir={out}",
        "rollout.prompts_per_step=8",
        "rollout.group_size=4",
        "log.progress_bar=false",
        "log.tensorboard=false",
        "loss.variant=grpo",
        "routing.replay=learner",
        "routing.measure_every=1",
        "optim.lr=0.05",
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert 0.0 <= r["routing_expert_change_fraction"] <= r["routing_changed_fraction"] <= 1.0
    assert max(r["routing_changed_fraction"] for r in rows) > 0, "lr 0.05 must move some routing"
    # the in-process engine samples from the same fp32 model the learner recomputes (measured 2.0e-7)
    assert rows[0]["logprob_mismatch"] < 7.5e-7


def test_routing_replay_refuses_rollout_old_logprobs():
    from gspo_mcore.config import ConfigError
    from gspo_mcore.train import parse_config

    for value in ("true", "learner"):
        with pytest.raises((ConfigError, ValueError), match=r"routing.replay=learner \(or true\) needs rollout.old_l"):
            parse_config(
                ["--config", "examples/tiny/config.yaml", f"routing.replay={value}", "rollout.old_logprobs=rollout"]
            )


def test_rollout_routing_replay_is_refused_without_sglang():
    from gspo_mcore.config import ConfigError
    from gspo_mcore.train import parse_config

    cfg = parse_config(["--config", "examples/tiny/config.yaml", "routing.replay=false"])
    assert cfg.routing.replay == "off" and not cfg.routing.enabled
    with pytest.raises((ConfigError, ValueError), match="routing.replay=rollout needs rollout.engine=sglang"):
        parse_config(["--config", "examples/tiny/config.yaml", "routing.replay=rollout"])
    with pytest.raises((ConfigError, ValueError), match="routing.replay"):
        parse_config(["--config", "examples/tiny/config.yaml", "routing.replay=sglang"])


def test_rollout_routing_replay_of_a_dense_model_fails_at_start_naming_the_key(tmp_path):
    """routing.replay=rollout on a dense checkpoint stops before anything is built or launched."""
    from examples.tiny.task import model_config
    from gspo_mcore.train import parse_config
    from gspo_mcore.trainer.loop import run

    (tmp_path / "config.json").write_text(json.dumps(model_config()))
    cfg = parse_config(
        [
            "--config",
            "examples/tiny/config.yaml",
            f"model.hf_dir={tmp_path}",
            "model.load_hf_weights=true",
            "rollout.engine=sglang",
            "rollout.sglang.urls=[http://127.0.0.1:9]",
            "routing.replay=rollout",
        ]
    )
    with pytest.raises(ValueError, match="routing.replay=rollout needs a MoE model.*dense 'qwen3' model"):
        run(cfg)
