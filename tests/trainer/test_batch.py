"""The step's batch assembly: overlong shaping of rewards, and which responses reach the learner."""

import pytest
import torch

from gspo_mcore.rollout.types import Sample
from gspo_mcore.trainer.batch import learner_samples, overlong_penalties


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
