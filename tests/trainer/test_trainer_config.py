"""The run config is resolved once: the resolved tree is what runs, is saved, and is hashed."""

import os

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
    assert to_dict(cfg)["loss"].keys() == {"variant", "eps_low", "eps_high", "compute_entropy"}
