"""The configuration layer: YAML + overrides -> typed configs, with errors that name the key."""

import glob
import os

import pytest

from gspo_mcore.config import ConfigError, apply_overrides, from_dict, load_yaml, save_yaml, to_dict
from gspo_mcore.train import parse_config
from gspo_mcore.trainer import TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "examples", "tiny", "config.yaml")


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "examples", "**", "*.yaml"), recursive=True)))
def test_every_example_config_parses_and_validates(path):
    cfg = parse_config(["--config", path])
    assert isinstance(cfg, TrainConfig)


def test_overrides_reach_nested_typed_fields():
    cfg = parse_config(
        [
            "--config",
            TINY,
            "optim.lr=1e-5",
            "rollout.group_size=4",
            "rollout.sampling.top_p=0.9",
            "data.paths=[a.jsonl, b.parquet]",
            "loss.variant=grpo",
        ]
    )
    assert cfg.optim.lr == 1e-5 and isinstance(cfg.optim.lr, float)
    assert cfg.rollout.group_size == 4
    assert cfg.rollout.sampling.top_p == 0.9
    assert cfg.data.paths == ("a.jsonl", "b.parquet")
    assert cfg.loss.variant == "grpo"


def test_unknown_key_is_refused_with_the_closest_valid_key():
    with pytest.raises(ConfigError, match=r"unknown config key 'optim.lrr'; did you mean 'optim.lr'\?"):
        parse_config(["--config", TINY, "optim.lrr=1"])
    with pytest.raises(
        ConfigError, match=r"unknown config key 'rollout.sampling.temprature'.*'rollout.sampling.temperature'"
    ):
        parse_config(["--config", TINY, "rollout.sampling.temprature=0.5"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lr=fast", r"optim.lr: expected a number"),
        ("rollout.group_size=1.5", r"rollout.group_size: expected an integer"),
        ("loss.variant=ppo", r"loss.variant: must be one of \(.gspo., .gspo_token., .grpo., .sapo., .cispo., .gmpo.\)"),
        ("rollout.sampling.top_p=2", r"top_p must be in \(0, 1\]"),
        (
            "loss.temperature=0.5",
            r"'loss.temperature' no longer exists: .* defined once, by rollout.sampling.temperature",
        ),
        (
            "loss.recompute_old_logprobs=true",
            r"'loss.recompute_old_logprobs' no longer exists: set rollout.old_logprobs",
        ),
        ("rollout.engine=vllm", r"rollout.engine: must be one of \('inprocess', 'sglang'\)"),
        ("eval.pass_k=[1,8]", r"pass@8 needs at least 8 samples per prompt, but eval.n is 4"),
        ("rollout.overlong_buffer=6", r"overlong_buffer must be in \[0, sampling.max_new_tokens = 6\)"),
        ("batch.num_minibatches=100000", r"num_minibatches .* exceeds the rollout batch"),
        ("steps=0", r"steps must be >= 1"),
        ("parallel=3", r"parallel: expected a mapping"),
        ("optim.lr", r"must look like key.path=value"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(["--config", TINY, override])


def test_missing_or_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_yaml(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_yaml(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_yaml(lst)


def test_saved_config_round_trips(tmp_path):
    cfg = parse_config(["--config", TINY, "optim.lr=2e-4"])
    save_yaml(cfg, tmp_path / "config.yaml")
    again = from_dict(TrainConfig, load_yaml(tmp_path / "config.yaml"))
    assert to_dict(again) == to_dict(cfg)


def test_overrides_do_not_mutate_the_input():
    data = {"a": {"b": 1}}
    out = apply_overrides(data, ["a.b=2", "a.c=x"])
    assert data == {"a": {"b": 1}} and out == {"a": {"b": 2, "c": "x"}}


def test_cli_exits_with_code_2_and_a_message_on_config_errors(capsys):
    from gspo_mcore.train import main

    assert main(["--config", TINY, "optim.lrr=1"]) == 2
    assert "did you mean 'optim.lr'" in capsys.readouterr().err


def test_duplicate_keys_are_refused_naming_the_key_and_line(tmp_path):
    """YAML's last-wins on a repeated key would silently drop the first value: refused, at any depth."""
    top = tmp_path / "top.yaml"
    top.write_text("steps: 10\nseed: 1\nsteps: 20\n")
    with pytest.raises(ConfigError, match=r"top.yaml: duplicate key 'steps' at line 3 \(first at line 1\)"):
        load_yaml(top)
    nested = tmp_path / "nested.yaml"
    nested.write_text("optim:\n  lr: 1.0e-5\n  clip_grad: 1.0\n  lr: 3.0e-5\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'lr' at line 4 \(first at line 2\)"):
        load_yaml(nested)
    same_name_elsewhere = tmp_path / "ok.yaml"
    same_name_elsewhere.write_text("optim:\n  lr: 1.0\nloss:\n  lr: 2.0\n")
    assert load_yaml(same_name_elsewhere) == {"optim": {"lr": 1.0}, "loss": {"lr": 2.0}}
