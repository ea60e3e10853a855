"""The engine-independent interface: sampling settings, samples, seeds, prompt normalisation."""

import numpy as np
import pytest
import torch

from gspo_mcore.rollout.types import (
    Sample,
    SamplingParams,
    check_generate_args,
    derive_sample_seed,
    normalize_prompts,
)


def test_sampling_params_defaults_and_conversion():
    p = SamplingParams(stop_token_ids=[2, 7])
    assert (p.temperature, p.top_p, p.top_k, p.max_new_tokens, p.seed) == (1.0, 1.0, -1, 128, None)
    assert p.stop_token_ids == (2, 7)  # frozen and hashable
    hash(p)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": 0},
        {"top_k": -2},
        {"top_k": 2.0},
        {"max_new_tokens": 0},
        {"max_new_tokens": True},
        {"stop_token_ids": (-1,)},
        {"stop_token_ids": (1.5,)},
        {"seed": 2**63},
        {"seed": "1"},
        {"ignore_eos": 1},
    ],
)
def test_sampling_params_rejects(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_logprob_temperature_is_one_when_greedy():
    """Greedy log-probs are of softmax(logits) (SGLang rewrites temperature 0 to 1 with top_k = 1)."""
    assert SamplingParams(temperature=0).logprob_temperature == 1.0
    assert SamplingParams(temperature=0.6).logprob_temperature == 0.6


def test_sample_validates():
    kw = dict(prompt_index=0, sample_index=0, prompt_ids=(1,), weight_version=0)
    Sample(response_ids=(1, 2), response_logprobs=(-0.1, -0.2), finish_reason="stop", **kw)
    with pytest.raises(ValueError, match="2 response ids but 1 log-probs"):
        Sample(response_ids=(1, 2), response_logprobs=(-0.1,), finish_reason="stop", **kw)
    with pytest.raises(ValueError, match="finish_reason"):
        Sample(response_ids=(), response_logprobs=(), finish_reason="eos", **kw)


def test_derive_sample_seed_is_deterministic_distinct_and_int64():
    seeds = {derive_sample_seed(5, i, j) for i in range(50) for j in range(8)}
    assert len(seeds) == 400
    assert all(-(2**63) <= s < 2**63 for s in seeds)
    assert derive_sample_seed(5, 3, 1) == derive_sample_seed(5, 3, 1) != derive_sample_seed(6, 3, 1)


def test_normalize_prompts_accepts_lists_arrays_and_tensors():
    out = normalize_prompts([[1, 2], np.array([3, 4], dtype=np.int64), torch.tensor([5, 6])])
    assert out == [(1, 2), (3, 4), (5, 6)]
    assert all(type(t) is int for p in out for t in p)


@pytest.mark.parametrize("bad", [[[]], [[1, -2]], [[1.5]], [["a"]]])
def test_normalize_prompts_rejects(bad):
    with pytest.raises(ValueError, match="prompt 0"):
        normalize_prompts(bad)


def test_check_generate_args():
    check_generate_args(1, SamplingParams())
    with pytest.raises(ValueError, match="n must be"):
        check_generate_args(0, SamplingParams())
    with pytest.raises(TypeError):
        check_generate_args(1, {"temperature": 1.0})


def test_token_versions_must_cover_the_response_and_start_at_the_sample_version():
    base = dict(
        prompt_index=0,
        sample_index=1,
        prompt_ids=(1,),
        response_ids=(5, 6, 7),
        response_logprobs=(-1.0, -1.0, -1.0),
        finish_reason="length",
        weight_version=3,
    )
    assert Sample(**base, token_versions=(3, 4, 4)).token_versions == (3, 4, 4)
    with pytest.raises(ValueError, match=r"sample \(0, 1\): 2 token versions for 3 response ids"):
        Sample(**base, token_versions=(3, 4))
    with pytest.raises(ValueError, match="weight_version 3 is not the oldest token version 4"):
        Sample(**base, token_versions=(4, 4, 5))
