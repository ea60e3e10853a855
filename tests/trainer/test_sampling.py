"""Dynamic sampling's refill logic (gspo_mcore.trainer.dynamic_sampling.collect) on scripted rounds: which groups
are kept, how many prompts are drawn, when it stops, and that the prompt stream it leaves is the one a
resumed run continues from."""

import pytest
import torch

from gspo_mcore.data.sampler import PromptSampler, SamplerConfig
from gspo_mcore.trainer.config import RolloutConfig
from gspo_mcore.trainer.dynamic_sampling import collect, rollout_seed

G = 2


def _stream(n=100, epochs=None):
    return PromptSampler(n, SamplerConfig(seed=3, epochs=epochs))


def _roll_by(signal_of, calls):
    """A round whose prompt ``i`` gets a reward spread when ``signal_of(i)``; records (prompts, round)."""

    def roll(prompts, round_):
        calls.append((list(prompts), round_))
        rewards = torch.tensor([[0.0, 1.0] if signal_of(i) else [0.5, 0.5] for i in prompts]).reshape(-1)
        return [[(i, j) for j in range(G)] for i in prompts], rewards, rewards.clone()

    return roll


def _collect(sampler, signal_of, calls, **kw):
    args = dict(target=4, group_size=G, dynamic=True, max_rounds=3)
    return collect(sampler.take, _roll_by(signal_of, calls), **(args | kw))


def test_refill_keeps_the_first_target_groups_with_signal_and_draws_full_rounds():
    sampler, calls = _stream(), []
    batch = _collect(sampler, lambda i: i % 3 == 0, calls)
    drawn = [p for c, _ in calls for p in c]
    assert [r for _, r in calls] == list(range(batch.rounds))
    assert all(len(c) == 4 for c, _ in calls)  # every round draws prompts_per_step fresh prompts
    assert drawn == _stream().take(len(drawn))  # in stream order, none skipped or repeated
    kept = [p for p, k in zip(batch.prompts, batch.keep.tolist()) if k]
    assert kept == [p for p in drawn if p % 3 == 0][:4]
    assert batch.short == 0 and batch.keep.shape == (len(drawn),)
    assert batch.scores.shape == (len(drawn) * G,)
    # the loop stopped at the first round that completed the target
    assert sum(p % 3 == 0 for p in drawn[:-4]) < 4 <= sum(p % 3 == 0 for p in drawn)


def test_one_round_suffices_when_every_group_has_signal_and_extras_are_discarded():
    sampler, calls = _stream(), []
    batch = _collect(sampler, lambda i: True, calls, target=4)
    assert batch.rounds == 1 and batch.keep.tolist() == [True] * 4
    sampler, calls = _stream(), []
    batch = _collect(sampler, lambda i: i != calls[0][0][0], calls)  # round 0 loses its first group
    assert batch.rounds == 2 and int(batch.keep.sum()) == 4
    assert batch.keep.tolist() == [False, True, True, True, True, False, False, False]


def test_the_bound_is_kept_and_the_step_trains_on_what_it_has():
    sampler, calls = _stream(), []
    batch = _collect(sampler, lambda i: i == calls[0][0][1], calls, max_rounds=2)  # one group with signal
    assert batch.rounds == 2 and len(calls) == 2
    assert int(batch.keep.sum()) == 1 and batch.short == 3
    sampler, calls = _stream(), []
    batch = _collect(sampler, lambda i: False, calls, max_rounds=1)
    assert batch.rounds == 1 and int(batch.keep.sum()) == 0 and batch.short == 4


def test_running_out_of_prompts_stops_the_rounds():
    sampler, calls = _stream(n=6, epochs=1), []
    batch = _collect(sampler, lambda i: False, calls, max_rounds=5)
    assert [len(c) for c, _ in calls] == [4, 2] and batch.rounds == 2 and batch.short == 4
    assert _collect(sampler, lambda i: True, calls) is None  # nothing left: the loop ends


def test_without_dynamic_sampling_one_round_and_the_drop_rule():
    for drop, expect in ((False, [True] * 4), (True, [False, True, False, True])):
        sampler, calls = _stream(), []
        order = _stream().take(4)
        batch = _collect(
            sampler, lambda i: order.index(i) % 2 == 1, calls, dynamic=False, drop_zero_advantage_groups=drop
        )
        assert batch.rounds == 1 and len(calls) == 1 and batch.short == 0
        assert batch.keep.tolist() == expect


def test_the_stream_position_after_a_step_resumes_the_same_prompts():
    """A run checkpoints the loader's position after each step; a resumed run loads it and must draw what
    the uninterrupted run drew next."""
    signal = lambda i: i % 4 == 1  # noqa: E731
    whole, calls = _stream(), []
    for _ in range(3):
        _collect(whole, signal, calls)
    uninterrupted = [c for c, _ in calls]

    first, calls = _stream(), []
    for _ in range(2):
        _collect(first, signal, calls)
    state = first.state_dict()
    resumed = _stream()
    resumed.load_state_dict(state)
    _collect(resumed, signal, calls)
    assert [c for c, _ in calls] == uninterrupted


def test_round_seeds_are_distinct_and_round_zero_keeps_the_historical_seed():
    assert rollout_seed(1234, 7, 0) == 1234 * 100_003 + 7
    seeds = {rollout_seed(1234, s, r) for s in range(50) for r in range(4)}
    assert len(seeds) == 200
    assert all(-(2**63) <= x < 2**63 for x in seeds)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_max_sampling_rounds_below_one_is_refused_naming_the_key(bad):
    with pytest.raises(ValueError, match="max_sampling_rounds"):
        RolloutConfig(dynamic_sampling=True, max_sampling_rounds=bad)
