"""Per-token rewards: a reward function returns ``TokenRewards`` (a sequence reward plus one term per response
token), the runner checks and weights the terms, and the trainer turns them into ``A_i + d_i,t``."""

import pytest
import torch

from gspo_mcore import rewards
from gspo_mcore.rewards import RewardRunner, RewardRunnerConfig, RewardTermConfig, TokenRewards
from gspo_mcore.rollout.types import Sample
from gspo_mcore.trainer.batch import learner_samples
from gspo_mcore.trainer.dynamic_sampling import collect


def _per_token(response, metadata):
    """1 for a response containing 'a', and -0.1 on every response token equal to 7."""
    ids = metadata["response_ids"]
    return TokenRewards(reward=float("a" in response), per_token=[-0.1 if t == 7 else 0.0 for t in ids])


def _wrong_length(response, metadata):
    return TokenRewards(reward=1.0, per_token=[0.0] * (len(metadata["response_ids"]) + 1))


def _not_finite(response, metadata):
    return TokenRewards(reward=1.0, per_token=[float("inf")] * len(metadata["response_ids"]))


@pytest.fixture
def token_rewards():
    names = {"t_per_token": _per_token, "t_wrong_length": _wrong_length, "t_not_finite": _not_finite}
    for name, fn in names.items():
        rewards.register(name, fn, overwrite=True)
    yield
    for name in names:
        rewards.unregister(name)


def test_per_token_terms_are_weighted_and_summed_over_a_samples_rewards(token_rewards):
    terms = (
        RewardTermConfig(name="shaped", reward="t_per_token", weight=2.0),
        RewardTermConfig(name="match", reward="exact", weight=0.5),
    )
    runner = RewardRunner(RewardRunnerConfig(terms=terms))
    values, per_token = runner.score_tokens(
        ["a", "b"], [{"answer": "a"}, {"answer": "a"}], [[7, 3, 7], [3]], prompts=["p", "q"]
    )
    assert values == [2.0 + 0.5, 0.0]
    assert per_token == [pytest.approx([-0.2, 0.0, -0.2]), [0.0]]
    # score() knows no tokens: a per-token reward cannot run there (the trainer and the evaluator give them)
    with pytest.raises(rewards.RewardFailure, match="KeyError: 'response_ids'"):
        runner.score(["a"], [{"answer": "a"}])


def test_plain_rewards_give_no_per_token_terms():
    runner = RewardRunner(RewardRunnerConfig(reward="exact"))
    assert runner.score_tokens(["a"], [{"answer": "a"}], [[1, 2]]) == ([1.0], [None])


@pytest.mark.parametrize(
    "name, message",
    [
        ("t_wrong_length", "sample 1: TokenRewards.per_token has 3 terms for 2 response tokens"),
        ("t_not_finite", "sample 1: TokenRewards.per_token must be finite"),
    ],
)
def test_per_token_terms_that_do_not_fit_stop_the_step_naming_the_sample(token_rewards, name, message):
    runner = RewardRunner(RewardRunnerConfig(reward="exact", max_error_fraction=1.0))
    with pytest.raises(rewards.RewardFailure, match=f"cannot run.*{name}.*{message}"):
        runner.score_tokens(["a", "b"], [{"answer": "a"}, {"reward_fn": name}], [[1], [1, 2]])


def _sample(i, j, response):
    return Sample(
        prompt_index=i,
        sample_index=j,
        prompt_ids=(1, 5),
        response_ids=tuple(response),
        response_logprobs=(-1.0,) * len(response),
        finish_reason="stop",
        weight_version=0,
    )


def test_terms_reach_the_learners_token_advantages_through_the_rollout_batch(token_rewards):
    """collect() carries the terms of every round; learner_samples adds them to A_i (only on response tokens)."""
    runner = RewardRunner(RewardRunnerConfig(reward="t_per_token"))
    groups = [[_sample(0, 0, [7, 3]), _sample(0, 1, [3, 3, 7])]]
    values, terms = runner.score_tokens(["a", "b"], [{}, {}], [s.response_ids for s in groups[0]])
    scores = torch.tensor(values)
    batch = collect(
        lambda n: ["prompt"],
        lambda prompts, r: (groups, scores, scores, terms),
        target=1,
        group_size=2,
        dynamic=False,
        max_rounds=1,
    )
    assert batch.token_shaping == terms
    advantages = torch.tensor([1.0, -1.0])
    samples, _ = learner_samples(batch.groups, advantages, batch.keep, token_shaping=batch.token_shaping)
    # tokens[1:] = prompt[1:] + response: one prompt position, then the response tokens
    assert samples[0].token_advantages.tolist() == pytest.approx([1.0, 0.9, 1.0])
    assert samples[1].token_advantages.tolist() == pytest.approx([-1.0, -1.0, -1.0, -1.1])
    plain = collect(
        lambda n: ["prompt"],
        lambda prompts, r: (groups, scores, scores),
        target=1,
        group_size=2,
        dynamic=False,
        max_rounds=1,
    )
    assert plain.token_shaping is None
