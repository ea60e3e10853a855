"""The ``distill:`` section (gspo_mcore.trainer.distill): the example config parses, bad values are refused by
key, and at start-up a teacher with another tokenizer is refused by name (vocabulary compared token by token)."""

from __future__ import annotations

import json
import os

import pytest
from helpers import ROOT

from gspo_mcore.train import parse_config

DISTILL = os.path.join(ROOT, "examples", "tiny", "distill.yaml")


def test_example_config_parses():
    cfg = parse_config(["--config", DISTILL])
    assert cfg.distill.teacher_dir == "runs/tiny/teacher" and cfg.loss.variant == "gspo_token"
    assert parse_config(["--config", os.path.join(ROOT, "examples", "tiny", "config.yaml")]).distill is None


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "distill.engine=sglang distill.teacher_temperature=2",
            r"distill.teacher_temperature=2.0 with distill.engine=sglang: SGLang 0.5.23 scores input tokens with the "
            r"raw logits' log-softmax",
        ),
        ("distill.sglang.urls=[http://127.0.0.1:1]", r"distill.sglang.urls is set but distill.engine=inprocess"),
        ("distill.engine=sglang distill.sglang.urls=[127.0.0.1:1]", r"distill.sglang: urls: '127.0.0.1:1' is not an"),
        ("distill.engine=sglang distill.sglang.num_servers=0", r"distill.sglang: num_servers must be an integer >= 1"),
        ("distill.engine=vllm", r"engine"),
        ("distill.kl_coef=0", r"distill.kl_coef must be a finite number > 0"),
        ("distill.reward_weight=-1", r"distill.reward_weight must be a finite number >= 0"),
        ("distill.teacher_temperature=0", r"distill.teacher_temperature must be a finite number > 0"),
        ("distill.teacher_dir=", r"distill.teacher_dir must be set"),
        ("loss.variant=gspo", r"distill needs a loss.variant that takes per-token advantages \(gspo_token\); "),
        ("rollout.drop_zero_advantage_groups=true", r"distill.reward_weight=0 with rollout.drop_zero_advantage_grou"),
    ],
)
def test_bad_values_are_refused_by_key(override, message):
    with pytest.raises(ValueError, match=message):
        parse_config(["--config", DISTILL, *override.split(" ")])


def test_an_sglang_teacher_parses_connected_or_launched():
    cfg = parse_config(["--config", DISTILL, "distill.engine=sglang", "distill.sglang.urls=[http://127.0.0.1:30000]"])
    assert cfg.distill.engine == "sglang" and cfg.distill.sglang.urls == ("http://127.0.0.1:30000",)
    launched = parse_config(
        ["--config", DISTILL, "distill.engine=sglang", "distill.sglang.extra_args=[--dtype,float32]"]
    )
    assert launched.distill.sglang.urls == () and launched.distill.sglang.extra_args == ("--dtype", "float32")


@pytest.mark.parametrize("variant", ["sapo", "cispo", "gmpo", "grpo"])
def test_the_variants_without_per_token_advantages_are_refused(variant):
    with pytest.raises(ValueError, match=rf"distill needs a loss.variant .*; loss.variant is '{variant}'"):
        parse_config(["--config", DISTILL, f"loss.variant={variant}", "loss.eps_low=null", "loss.eps_high=null"])


def test_reward_mixing_may_keep_dropping_groups():
    cfg = parse_config(["--config", DISTILL, "distill.reward_weight=0.5", "rollout.drop_zero_advantage_groups=true"])
    assert cfg.distill.reward_weight == 0.5


def _tokenizer(out_dir, vocab):
    """A character-level tokenizer like the tiny task's, with the given vocabulary (token -> id)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="_"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(out_dir)


@pytest.fixture
def tiny(tmp_path):
    from examples.tiny.task import prepare

    return prepare(str(tmp_path / "student"), num_prompts=8)


def _plan(tiny, teacher_dir, *overrides):
    from gspo_mcore.data.template import load_tokenizer
    from gspo_mcore.learner.model_config import load_hf_config
    from gspo_mcore.trainer import distill, resolve

    cfg = resolve(
        parse_config(
            ["--config", DISTILL, f"model.hf_dir={tiny['model_dir']}", f"distill.teacher_dir={teacher_dir}", *overrides]
        )
    )
    return distill.plan(cfg, load_hf_config(tiny["model_dir"]), load_tokenizer(tiny["model_dir"]))


def _teacher(tmp_path, name, vocab=None, **config):
    from examples.tiny.task import CHARS, FILLERS, SPECIALS, model_config

    d = tmp_path / name
    d.mkdir()
    _tokenizer(str(d), vocab or {t: i for i, t in enumerate(SPECIALS + CHARS + FILLERS)})
    (d / "config.json").write_text(json.dumps(model_config() | config))
    return str(d)


def test_a_teacher_with_the_same_tokenizer_and_any_size_passes(tmp_path, tiny):
    plan = _plan(tiny, _teacher(tmp_path, "big", num_hidden_layers=3, hidden_size=96, head_dim=24))
    assert plan.arch.num_hidden_layers == 3 and plan.arch.hidden_size == 96


def test_a_teacher_with_another_tokenizer_is_refused_by_name(tmp_path, tiny):
    from examples.tiny.task import CHARS, FILLERS, SPECIALS

    tokens = SPECIALS + CHARS + FILLERS
    swapped = {t: i for i, t in enumerate(tokens)} | {"0": tokens.index("1"), "1": tokens.index("0")}
    with pytest.raises(
        ValueError,
        match=r"distill.teacher_dir=.*swapped: the teacher's tokenizer differs from the "
        r"student's .*: token '0' has id 3 for the student and 4 for the teacher",
    ):
        _plan(tiny, _teacher(tmp_path, "swapped", swapped))
    # the same size, one token renamed
    renamed = {("Z" if t == "S" else t): i for i, t in enumerate(tokens)}
    with pytest.raises(ValueError, match=r"the student's token 'S' \(id 63\) is not in the teacher's vocabulary"):
        _plan(tiny, _teacher(tmp_path, "renamed", renamed))
    bigger = {t: i for i, t in enumerate(tokens + ["T"])}
    with pytest.raises(
        ValueError, match=r"the teacher's vocabulary has 65 tokens, the student's 64; e.g. 'T' \(id 64\)"
    ):
        _plan(tiny, _teacher(tmp_path, "bigger", bigger, vocab_size=65))


def test_a_teacher_the_layout_cannot_split_is_refused_with_the_reason(tmp_path, tiny, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    d = _teacher(tmp_path, "odd", num_attention_heads=3, num_key_value_heads=1, head_dim=16)
    with pytest.raises(
        ValueError, match=r"distill.teacher_dir=.*does not fit.*TP=2 does not divide num_attention_heads=3"
    ):
        _plan(tiny, d, "parallel.tensor=2")
    short = _teacher(tmp_path, "short", max_position_embeddings=32)
    with pytest.raises(ValueError, match=r"max_position_embeddings 32 is below the student's 64"):
        _plan(tiny, short)


def test_an_sglang_teacher_gets_the_same_tokenizer_checks_but_not_the_layout_fit(tmp_path, tiny, monkeypatch):
    """Served apart from the learner, an SGLang teacher need not fit the learner's layout; its tokenizer is
    still compared with the student's by name."""
    from examples.tiny.task import CHARS, FILLERS, SPECIALS

    monkeypatch.setenv("WORLD_SIZE", "2")
    odd = _teacher(tmp_path, "odd", num_attention_heads=3, num_key_value_heads=1, head_dim=16)
    plan = _plan(tiny, odd, "parallel.tensor=2", "distill.engine=sglang")
    assert plan.arch.num_attention_heads == 3 and plan.cfg.engine == "sglang"
    tokens = SPECIALS + CHARS + FILLERS
    swapped = {t: i for i, t in enumerate(tokens)} | {"0": tokens.index("1"), "1": tokens.index("0")}
    with pytest.raises(ValueError, match=r"token '0' has id 3 for the student and 4 for the teacher"):
        _plan(tiny, _teacher(tmp_path, "swapped", swapped), "distill.engine=sglang")
    with pytest.raises(ValueError, match=r"distill.teacher_dir=.*nowhere"):
        _plan(tiny, str(tmp_path / "nowhere"), "distill.engine=sglang")
