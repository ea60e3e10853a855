"""Bad layouts and configs give the documented errors, before any process group or model exists."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist
from helpers.learner_toy import DENSE, MOE

from gspo_mcore.algo.loss_config import LossConfig
from gspo_mcore.learner.model_config import load_hf_config
from gspo_mcore.learner.optimizer import OptimConfig
from gspo_mcore.learner.parallel import ParallelConfig, init_parallel, validate_layout
from gspo_mcore.learner.step import BatchConfig

dense = load_hf_config(DENSE)  # 4 heads, 2 KV heads, 4 layers, vocab 128
moe = load_hf_config(MOE)  # 4 experts


def test_good_layouts_give_the_data_parallel_size():
    assert validate_layout(ParallelConfig(), 4, dense, on_gpu=False) == 4
    assert validate_layout(ParallelConfig(tensor=2, pipeline=2), 8, dense, on_gpu=False) == 2
    assert validate_layout(ParallelConfig(expert=2), 2, moe, on_gpu=False) == 2
    assert validate_layout(ParallelConfig(pipeline=2, expert=2), 4, moe, on_gpu=False) == 2
    assert validate_layout(ParallelConfig(tensor=2, context=2), 8, dense, on_gpu=True) == 2
    assert validate_layout(ParallelConfig(context=2), 4, dense, on_gpu=False) == 2  # the CPU CP attention
    assert validate_layout(ParallelConfig(context=2, expert=2), 4, moe, on_gpu=False) == 2


@pytest.mark.parametrize(
    "cfg, world, arch, message",
    [
        (ParallelConfig(tensor=2), 3, dense, "world size 3 is not divisible by TP\\*PP\\*CP"),
        (ParallelConfig(tensor=4), 4, dense, "TP=4 does not divide num_key_value_heads=2"),
        (ParallelConfig(tensor=8), 8, dense, "TP=8 does not divide num_attention_heads=4"),
        (ParallelConfig(pipeline=3), 3, dense, "PP=3 does not divide num_hidden_layers=4"),
        (ParallelConfig(expert=3), 3, moe, "EP=3 does not divide num_experts=4"),
        (ParallelConfig(expert=2), 2, dense, "need a MoE model"),
        (ParallelConfig(expert=4), 2, moe, "does not divide the ranks of one pipeline stage"),
        (ParallelConfig(tensor=2), 2, moe, "sequence parallelism"),
    ],
)
def test_impossible_layouts_are_refused(cfg, world, arch, message):
    with pytest.raises(ValueError, match=message):
        validate_layout(cfg, world, arch, on_gpu=False)


def test_every_problem_is_listed():
    with pytest.raises(ValueError) as err:
        validate_layout(ParallelConfig(tensor=8, pipeline=3), 7, dense, on_gpu=False)
    text = str(err.value)
    assert "world size" in text and "num_attention_heads" in text and "num_hidden_layers" in text


def test_init_parallel_refuses_before_creating_anything(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="impossible parallel layout"):
        init_parallel(ParallelConfig(tensor=2), dense)
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tensor=0), "tensor must be an int >= 1"),
        (dict(pipeline=1.5), "pipeline must be an int >= 1"),
        (dict(expert_tensor=0), "expert_tensor"),
    ],
)
def test_parallel_config_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs)


def test_hf_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DENSE))
    assert load_hf_config(tmp_path) == dense
    assert load_hf_config(tmp_path / "config.json") == dense
    assert moe.is_moe and moe.moe_layer_pattern() == [1, 1, 1, 1]
    assert load_hf_config(dict(MOE, mlp_only_layers=[0], decoder_sparse_step=1)).moe_layer_pattern() == [0, 1, 1, 1]
    with pytest.raises(ValueError, match="unsupported model_type 'mistral'"):
        load_hf_config(dict(DENSE, model_type="mistral"))
    with pytest.raises(ValueError, match="rope_scaling"):
        load_hf_config(dict(DENSE, rope_scaling={"type": "yarn"}))
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        load_hf_config(dict(DENSE, num_key_value_heads=3))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        load_hf_config(dict(MOE, num_experts_per_tok=5))
    with pytest.raises(ValueError, match="num_experts > 0"):
        load_hf_config(dict(MOE, num_experts=0))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: OptimConfig(lr=-1.0), "lr must be a finite number >= 0"),
        (lambda: OptimConfig(lr=1e-6, min_lr=1e-5), "min_lr"),
        (lambda: OptimConfig(adam_beta2=1.0), "adam_beta2"),
        (lambda: OptimConfig(lr_decay_style="cosine", lr_warmup_steps=10, lr_decay_steps=5), "lr_decay_steps"),
        (lambda: OptimConfig(lr_decay_style="step"), "lr_decay_style"),
        (lambda: LossConfig(variant="ppo"), "variant must be one of"),
        (lambda: LossConfig(fused_lm_head=True, fused_lm_head_chunk=0), "loss.fused_lm_head_chunk must be >= 1"),
        (lambda: BatchConfig(num_minibatches=0), "num_minibatches"),
        (lambda: BatchConfig(max_tokens_per_microbatch=1), "max_tokens_per_microbatch"),
    ],
)
def test_bad_configs(make, message):
    with pytest.raises(ValueError, match=message):
        make()
