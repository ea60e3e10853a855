"""The run config is resolved once: the resolved tree is what runs, is saved, and is hashed."""

import os

import pytest

from gspo_mcore.config import from_dict, load_yaml, save_yaml, to_dict
from gspo_mcore.train import parse_config
from gspo_mcore.trainer import TrainConfig, resolve

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "examples", "tiny", "config.yaml")


def test_resolve_fills_every_derived_default():
    cfg = resolve(
        parse_config(
            [
                "--config",
                TINY,
                "log.output_dir=out/x",
                "model.hf_dir=m/dir",
                "eval.datasets=[{name: h, data: {paths: [h.jsonl]}}]",
            ]
        )
    )
    assert cfg.checkpoint.dir == os.path.join("out/x", "checkpoints")
    assert cfg.template.tokenizer_dir == "m/dir"
    assert [d.reward for d in cfg.eval.datasets] == [cfg.reward]
    assert cfg.temperature == cfg.rollout.sampling.temperature == 1.0


def test_resolve_keeps_what_the_user_set():
    cfg = resolve(
        parse_config(
            [
                "--config",
                TINY,
                "checkpoint.dir=ck",
                "template.tokenizer_dir=tok",
                "eval.datasets=[{name: h, data: {paths: [h.jsonl]}, reward: {reward: math}}]",
            ]
        )
    )
    assert cfg.checkpoint.dir == "ck" and cfg.template.tokenizer_dir == "tok"
    assert cfg.eval.datasets[0].reward.reward == "math" != cfg.reward.reward


def test_save_load_resolve_is_the_identity(tmp_path):
    cfg = resolve(parse_config(["--config", TINY, "optim.lr=2e-4", "rollout.sampling.temperature=0.7"]))
    save_yaml(cfg, tmp_path / "config.yaml")
    again = resolve(from_dict(TrainConfig, load_yaml(tmp_path / "config.yaml")))
    assert again == cfg
    assert resolve(again) == again


def test_greedy_sampling_trains_the_untempered_policy():
    cfg = parse_config(["--config", TINY, "rollout.sampling.temperature=0"])
    assert cfg.temperature == 1.0
    assert to_dict(cfg)["loss"].keys() == {
        "variant",
        "eps_low",
        "eps_high",
        "sapo_tau_pos",
        "sapo_tau_neg",
        "compute_entropy",
        "off_policy",
        "kl_coef",
        "kl_estimator",
        "kl_metric",
        "entropy_coef",
        "fused_lm_head",
        "fused_lm_head_chunk",
    }


def test_loss_options_parse_and_bad_ones_fail_at_start_up_naming_the_key():
    cfg = parse_config(
        ["--config", TINY, "loss.off_policy.mode=mis", "loss.off_policy.cap=3", "loss.kl_metric=true"]
        + ["loss.entropy_coef=0.01"]
    )
    assert (cfg.loss.off_policy.mode, cfg.loss.off_policy.cap) == ("mis", 3)
    assert cfg.loss.uses_reference and cfg.loss.entropy_coef == 0.01
    assert parse_config(["--config", TINY]).loss.off_policy.mode == "none"
    with pytest.raises(ValueError, match=r"loss\.off_policy\.mode=tis needs rollout\.old_logprobs=recompute"):
        parse_config(["--config", TINY, "loss.off_policy.mode=tis", "rollout.old_logprobs=rollout"])
    with pytest.raises(ValueError, match=r"loss\.off_policy\.cap must be > 1"):
        parse_config(["--config", TINY, "loss.off_policy.mode=tis", "loss.off_policy.cap=1"])
    with pytest.raises(ValueError, match="mode"):
        parse_config(["--config", TINY, "loss.off_policy.mode=product"])
    with pytest.raises(ValueError, match=r"loss\.kl_coef"):
        parse_config(["--config", TINY, "loss.kl_coef=-1"])


def test_rollout_decode_threads_parses_and_a_bad_count_fails_at_start_up_naming_the_key():
    assert parse_config(["--config", TINY]).rollout.decode_threads is None
    assert parse_config(["--config", TINY, "rollout.decode_threads=1"]).rollout.decode_threads == 1
    for bad in ("0", "-2", "true", "1.5"):
        with pytest.raises(ValueError, match=r"decode_threads"):
            parse_config(["--config", TINY, f"rollout.decode_threads={bad}"])
