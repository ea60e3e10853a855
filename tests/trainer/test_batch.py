"""The step's batch assembly: overlong shaping of rewards, and which responses reach the learner."""

import pytest
import torch

from gspo_mcore.rollout.types import Sample
from gspo_mcore.trainer.batch import learner_samples, overlong_penalties, staleness_metrics


def _sample(i, j, n_tokens, reason):
    return Sample(
        prompt_index=i,
        sample_index=j,
        prompt_ids=(5, 6),
        response_ids=tuple(range(7, 7 + n_tokens)),
        response_logprobs=tuple(-0.1 * (k + 1) for k in range(n_tokens)),
        finish_reason=reason,
        weight_version=0,
    )


GROUPS = [
    [_sample(0, 0, 3, "stop"), _sample(0, 1, 5, "stop"), _sample(0, 2, 6, "length")],
    [_sample(1, 0, 4, "stop"), _sample(1, 1, 0, "abort"), _sample(1, 2, 6, "length")],
]


def test_overlong_penalty_is_linear_over_the_buffer():
    p = overlong_penalties(GROUPS, max_new_tokens=6, buffer=2, penalty=1.0)
    assert p.tolist() == [0.0, -0.5, -1.0, 0.0, 0.0, -1.0]
    assert overlong_penalties(GROUPS, max_new_tokens=6, buffer=3, penalty=0.6).tolist() == pytest.approx(
        [0.0, -0.4, -0.6, -0.2, 0.0, -0.6]
    )
    assert not overlong_penalties(GROUPS, max_new_tokens=6, buffer=0, penalty=1.0).any()


def test_learner_samples_align_logprobs_and_leave_out_what_cannot_or_must_not_train():
    adv = torch.arange(6, dtype=torch.float32)
    keep = torch.tensor([True, True])
    samples, left_out = learner_samples(GROUPS, adv, keep)
    assert left_out == 1  # the empty response
    assert [s.advantage for s in samples] == [0.0, 1.0, 2.0, 3.0, 5.0]
    s = samples[0]
    assert s.tokens.tolist() == [5, 6, 7, 8, 9] and s.loss_mask.tolist() == [0, 0, 1, 1, 1]
    assert s.old_logprobs.tolist() == pytest.approx([0.0, -0.1, -0.2, -0.3])  # aligned with tokens[1:]
    masked, left_out = learner_samples(GROUPS, adv, keep, mask_truncated=True)
    assert left_out == 3 and [s.advantage for s in masked] == [0.0, 1.0, 3.0]
    only_second, _ = learner_samples(GROUPS, adv, torch.tensor([False, True]))
    assert [s.advantage for s in only_second] == [3.0, 5.0]


def test_per_token_shaping_adds_to_the_sequence_advantage_and_a_wrong_length_names_the_sample():
    adv = torch.arange(6, dtype=torch.float32)
    keep = torch.tensor([True, True])
    shaping = [[0.5, -0.5, 0.0], None, None, None, None, None]
    samples, _ = learner_samples(GROUPS, adv, keep, token_shaping=shaping)
    s = samples[0]  # prompt (5, 6), 3 response tokens; aligned with tokens[1:]
    assert s.token_advantages.tolist() == [0.0, 0.5, -0.5, 0.0]
    assert samples[1].token_advantages is None
    bad = [None, [1.0, 2.0], None, None, None, None]  # sample (0, 1) has 5 response tokens
    with pytest.raises(ValueError, match=r"sample \(prompt 0, sample 1\): 2 per-token advantages for 5"):
        learner_samples(GROUPS, adv, keep, token_shaping=bad)


def test_staleness_histogram_counts_weight_version_lags():
    from dataclasses import replace

    groups = [
        [replace(s, weight_version=v) for s, v in zip(GROUPS[0], (3, 2, 3))],
        [replace(GROUPS[1][0], weight_version=0)],
    ]
    m = staleness_metrics(groups, current_version=3)
    assert m == {
        "staleness_max": 3.0,
        "staleness_mean": 1.0,
        "staleness_lag_0": 0.5,
        "staleness_lag_1": 0.25,
        "staleness_lag_3": 0.25,
    }


def test_a_partial_rollout_counts_at_its_oldest_token_and_is_reported():
    from dataclasses import replace

    s = GROUPS[0][1]  # 5 response tokens
    spanning = replace(s, weight_version=2, token_versions=(2, 2, 3, 3, 3))  # continued on version 3
    groups = [[replace(GROUPS[0][0], weight_version=3), spanning]]
    m = staleness_metrics(groups, current_version=3)
    assert m["staleness_max"] == 1.0 and m["staleness_lag_1"] == 0.5  # the oldest token's lag
    assert m["partial_samples_fraction"] == 0.5
    total = len(GROUPS[0][0].response_ids) + 5
    assert m["partial_newer_token_fraction"] == 3 / total
