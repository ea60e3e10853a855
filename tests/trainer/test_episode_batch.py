"""Multi-turn samples in the trainer's batch functions: the learner's loss mask is the episode's policy mask,
the reward reads the final turn, and environment errors past reward.max_error_fraction stop the run."""

import pytest
import torch

from gspo_mcore.rollout.turns import EpisodeStats
from gspo_mcore.rollout.types import Sample
from gspo_mcore.trainer.batch import decode_responses, episode_metrics, episode_rewards, learner_samples


def episode(j, end="done", error=None, reward=0.0):
    stats = EpisodeStats(
        turns=2, end=end, error=error, tool_calls=1, env_reward=reward, policy_tokens=3, env_tokens=2, final_turn=(7,)
    )
    return Sample(
        prompt_index=0,
        sample_index=j,
        prompt_ids=(1, 2),
        response_ids=(5, 6, 9, 9, 7),
        response_logprobs=(-0.5, -0.25, 0.0, 0.0, -1.0),
        response_mask=(1, 1, 0, 0, 1),
        finish_reason="stop",
        weight_version=0,
        episode=stats,
    )


class Tok:
    def decode(self, ids, skip_special_tokens=True):
        return ",".join(map(str, ids))


def test_loss_mask_is_the_policy_mask_and_the_reward_reads_the_final_turn():
    groups = [[episode(0), episode(1, reward=0.5)]]
    [s, _], left_out = learner_samples(groups, torch.tensor([1.0, -1.0]), torch.tensor([True]))
    assert left_out == 0
    assert s.loss_mask.tolist() == [0, 0, 1, 1, 0, 0, 1]
    assert s.old_logprobs.tolist() == [0.0, -0.5, -0.25, 0.0, 0.0, -1.0]
    assert decode_responses(groups, Tok()) == ["7", "7"]
    assert episode_rewards(groups).tolist() == [0.0, 0.5]


def test_episode_metrics_and_the_error_budget():
    groups = [[episode(0), episode(1, "error", "timeout"), episode(2, "max_turns"), episode(3)]]
    m = episode_metrics(groups, max_error_fraction=0.25)
    assert m["episode_turns_mean"] == 2.0 and m["episode_end_done"] == 0.5 and m["episode_end_error"] == 0.25
    assert m["episode_env_errors/timeout"] == 1 and m["episode_env_tokens_mean"] == 2.0
    with pytest.raises(RuntimeError, match=r"max_error_fraction=0.2; e.g. episode \(prompt 0, sample 1\): timeout"):
        episode_metrics(groups, max_error_fraction=0.2)
    assert (
        episode_metrics(
            [
                [
                    Sample(
                        prompt_index=0,
                        sample_index=0,
                        prompt_ids=(1,),
                        response_ids=(2,),
                        response_logprobs=(0.0,),
                        finish_reason="stop",
                        weight_version=0,
                    )
                ]
            ],
            max_error_fraction=0.0,
        )
        == {}
    )
