"""Difficulty-aware sampling (gspo_mcore.data.difficulty) on a scripted reward: which pool each prompt lands in,
exactly which prompts are drawn and skipped, re-tests, the fall-backs, resume, and the refused settings."""

import json
from types import SimpleNamespace

import pytest
import torch

from gspo_mcore.config import from_dict
from gspo_mcore.data.difficulty import DifficultySampler, build_sampler
from gspo_mcore.data.sampler import DifficultyConfig, PromptSampler, SamplerConfig
from gspo_mcore.trainer.loop import _observe

# the scripted reward: prompts 0-3 always pass, 4-6 never, 7-9 half the time (groups of 2)
REWARDS = {**{i: [1.0, 1.0] for i in range(4)}, **{i: [0.0, 0.0] for i in range(4, 7)}, 7: [1, 0], 8: [0, 1], 9: [1, 0]}


def _sampler(**difficulty):
    cfg = SamplerConfig(seed=5, shuffle=False, epochs=None, difficulty=DifficultyConfig(window=1, **difficulty))
    return DifficultySampler(10, cfg)


def _first_epoch(s):
    drawn = s.take(10)
    for i in drawn:
        s.observe(i, REWARDS[i])
    return drawn


def test_pools_and_the_stream_skips_retired_prompts():
    s = _sampler(weight_easy=0, weight_hard=0)
    assert _first_epoch(s) == list(range(10))
    assert {k: v for k, v in s.metrics().items() if "pool" in k} == {
        "sampler/pool_learnable": 3,
        "sampler/pool_easy": 4,
        "sampler/pool_hard": 3,
        "sampler/pool_unseen": 0,
    }
    # the next epochs hold 0..9 in order; 0-6 are retired, so each pass yields 7, 8, 9 and skips seven
    assert s.take(6) == [7, 8, 9, 7, 8, 9]
    m = s.metrics()
    assert (m["sampler/drawn_learnable"], m["sampler/drawn_easy"], m["sampler/skipped_retired"]) == (6, 0, 14)
    assert s.metrics()["sampler/drawn_learnable"] == 0  # counts are per step


def test_retired_prompts_are_retested_and_a_changed_one_comes_back():
    s = _sampler(weight_learnable=1e-12, weight_easy=1.0, weight_hard=0.0)
    _first_epoch(s)
    s.metrics()
    retest = s.take(20)
    assert len(retest) == 20 and set(retest) <= {0, 1, 2, 3}  # only the easy pool
    assert s.metrics()["sampler/drawn_easy"] == 20
    s.observe(0, [1.0, 0.0])  # prompt 0 now fails half the time: learnable again
    assert s.pool_of(0) == "learnable" and s.metrics()["sampler/pool_easy"] == 3
    s2 = _sampler(weight_easy=0, weight_hard=0)
    _first_epoch(s2)
    s2.observe(0, [0.0, 1.0])
    assert s2.take(4) == [0, 7, 8, 9]  # back in the stream


def test_a_pool_of_hard_prompts_only_falls_back_to_retests():
    s = _sampler(weight_easy=0, weight_hard=0)
    drawn = s.take(10)
    for i in drawn:
        s.observe(i, [0.0, 0.0])
    again = s.take(3)  # the stream has only retired prompts: re-tests, not a hang or an empty batch
    assert len(again) == 3 and s.metrics()["sampler/drawn_hard"] == 3


def test_window_averages_the_last_groups():
    s = DifficultySampler(3, SamplerConfig(difficulty=DifficultyConfig(window=2, pass_threshold=0.5)))
    s.observe(1, [1.0, 0.5])  # both pass (>= 0.5): rate 1
    assert s.pool_of(1) == "easy"
    s.observe(1, [0.0, 0.4])  # rate 0: mean of the last two is 0.5
    assert s.pass_rate(1) == 0.5 and s.pool_of(1) == "learnable"
    s.observe(1, [0.0, 0.0])
    assert s.history[1] == [0.0, 0.0] and s.pool_of(1) == "hard"


def test_resume_draws_what_an_uninterrupted_run_draws():
    def rewards(i, step):
        return [float((i * 7 + step) % 3 == 0), float((i + step) % 4 == 0)]

    def run(s, steps, start=0):
        out = []
        for step in range(start, steps):
            batch = s.take(4)
            for i in batch:
                s.observe(i, rewards(i, step))
            out.append(batch)
        return out

    cfg = SamplerConfig(seed=2, epochs=None, difficulty=DifficultyConfig(weight_easy=0.3, weight_hard=0.3))
    whole = run(DifficultySampler(12, cfg), 10)
    first = DifficultySampler(12, cfg)
    head = run(first, 6)
    state = json.loads(json.dumps(first.state_dict()))  # the checkpoint's trainer state is JSON
    resumed = DifficultySampler(12, cfg)
    resumed.load_state_dict(state)
    assert head + run(resumed, 10, start=6) == whole
    with pytest.raises(ValueError, match="no sampler.difficulty state"):
        DifficultySampler(12, cfg).load_state_dict(PromptSampler(12, cfg).state_dict())


def test_the_loop_observes_every_group_and_builds_the_sampler_the_config_names():
    s = _sampler()
    prompts = [SimpleNamespace(index=i) for i in (2, 5)]
    _observe(s, prompts, torch.tensor([1.0, 1.0, 0.0, 1.0]), 2)
    assert s.history == {2: [1.0], 5: [0.5]}
    _observe(PromptSampler(3), prompts, torch.zeros(4), 2)  # a plain sampler: nothing to do
    assert isinstance(build_sampler(4, SamplerConfig()), PromptSampler)
    assert isinstance(build_sampler(4, SamplerConfig(difficulty=DifficultyConfig())), DifficultySampler)


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"weight_learnable": 0, "weight_easy": 0, "weight_hard": 0}, "every pool weight is 0"),
        ({"weight_learnable": 0}, "weight_learnable must be > 0"),
        ({"weight_easy": -0.1}, r"sampler.difficulty.weight_easy must be >= 0"),
        ({"window": 0}, r"sampler.difficulty.window"),
        ({"hard_at": 0.6, "easy_at": 0.5}, "hard_at < easy_at"),
        ({"weight_hard": float("nan")}, r"sampler.difficulty.weight_hard must be a finite"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(bad, match):
    with pytest.raises(ValueError, match=match):
        from_dict(SamplerConfig, {"difficulty": bad})
