"""Packing samples into micro-batches by token budget (pure Python/torch; no processes)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from gspo_mcore.learner.batching import (
    TrainSample,
    block_causal_mask,
    build_microbatch,
    count_sequences,
    plan_microbatches,
    split_minibatches,
)


def _sample(length, prompt=2, adv=1.0, old=None):
    mask = torch.zeros(length, dtype=torch.int64)
    mask[prompt:] = 1
    return TrainSample(
        tokens=torch.arange(length, dtype=torch.int64) + 10, loss_mask=mask, advantage=adv, old_logprobs=old
    )


@pytest.mark.parametrize("seed", range(20))
def test_plan_is_a_partition_with_equal_counts(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(2, 60) for _ in range(rng.randint(1, 40))]
    dp = rng.choice([1, 2, 3, 4])
    budget = rng.choice([10, 40, 100, 1000])
    padded = bool(seed % 2)
    plans = plan_microbatches(lengths, dp_size=dp, max_tokens=budget, padded=padded)
    assert len(plans) == dp
    assert len({len(p) for p in plans}) == 1, "micro-batch count must be equal on all DP ranks"
    seen = sorted(i for p in plans for mb in p for i in mb)
    assert seen == list(range(len(lengths))), "every sample exactly once, never split"
    for p in plans:
        for mb in p:
            cost = len(mb) * max(lengths[i] for i in mb) if padded and mb else sum(lengths[i] for i in mb)
            assert len(mb) <= 1 or cost <= budget


def test_plan_balances_tokens_and_pads_with_empty_microbatches():
    plans = plan_microbatches([10, 10, 10, 10], dp_size=2, max_tokens=100)
    assert [sum(len(mb) for mb in p) for p in plans] == [2, 2]
    plans = plan_microbatches([5], dp_size=2, max_tokens=100)  # fewer samples than ranks
    assert plans == [[[0]], [[]]]
    # a long sample gets its own micro-batch; the other rank splits to match the count
    plans = plan_microbatches([50, 3, 3, 3, 3], dp_size=2, max_tokens=20)
    assert len(plans[0]) == len(plans[1])


def test_split_minibatches():
    assert [list(r) for r in split_minibatches(10, 4)] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    with pytest.raises(ValueError, match="num_minibatches"):
        split_minibatches(3, 4)


def test_padded_microbatch_layout():
    a = _sample(4, prompt=2, adv=0.5, old=torch.tensor([-1.0, -2.0, -3.0]))
    b = _sample(3, prompt=1, adv=-1.0, old=torch.tensor([-4.0, -5.0]))
    mb = build_microbatch([a, b], [1, 0], pad_multiple=1)  # row order follows the indices
    assert mb.tokens.shape == (2, 4) and mb.attention_mask is None and mb.packed_seq_params is None
    assert mb.tokens[0].tolist() == b.tokens.tolist() + [0] and mb.tokens[1].tolist() == a.tokens.tolist()
    assert mb.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert mb.num_tokens == 8 and mb.cu_seqlens.tolist() == [0, 4, 8]
    assert mb.targets.tolist() == b.tokens[1:].tolist() + [0, 0] + a.tokens[1:].tolist() + [0]
    assert mb.loss_mask.tolist() == [1, 1, 0, 0, 0, 1, 1, 0]
    assert mb.old_logprobs.tolist() == [-4, -5, 0, 0, 0, -2, -3, 0]
    assert mb.advantages.tolist() == [-1.0, 0.5]
    assert build_microbatch([a, b], [0, 1], pad_multiple=4).tokens.shape == (2, 4)
    assert build_microbatch([a, b], [0, 1], pad_multiple=3).tokens.shape == (2, 6)


def test_block_diagonal_microbatch_layout():
    a = _sample(4, prompt=2, adv=0.5, old=torch.tensor([-1.0, -2.0, -3.0]))
    b = _sample(3, prompt=1, adv=-1.0, old=torch.tensor([-4.0, -5.0]))
    mb = build_microbatch([a, b], [0, 1], packing="block_diagonal", pad_multiple=4)
    assert mb.tokens.shape == (1, 8)  # 7 tokens padded to a multiple of 4
    assert mb.num_tokens == 7
    assert mb.tokens[0, :7].tolist() == a.tokens.tolist() + b.tokens.tolist()
    assert mb.position_ids[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    assert mb.cu_seqlens.tolist() == [0, 4, 7]
    # position t predicts token t+1 of the same sample; a sample's last position counts for nothing
    assert mb.targets.tolist() == a.tokens[1:].tolist() + [0] + b.tokens[1:].tolist() + [0]
    assert mb.loss_mask.tolist() == [0, 1, 1, 0, 1, 1, 0]
    assert mb.old_logprobs.tolist() == [0, -2, -3, 0, -4, -5, 0]
    assert mb.advantages.tolist() == [0.5, -1.0]
    mask = mb.attention_mask[0, 0]
    assert mask.shape == (8, 8)
    assert not mask[5, 4] and mask[4, 3] and mask[3, 4] and not mask[3, 0]


@pytest.mark.parametrize("packing", ["padded", "block_diagonal"])
def test_empty_microbatch_is_a_masked_dummy(packing):
    mb = build_microbatch([], [], packing=packing)
    assert mb.loss_mask.sum() == 0 and mb.advantages.tolist() == [0.0] and mb.cu_seqlens.tolist() == [0, 2]
    with pytest.raises(ValueError, match="packing must be one of"):
        build_microbatch([], [], packing="ragged")


def test_block_causal_mask():
    m = block_causal_mask([2, 3])[0, 0]
    allowed = (~m).int().tolist()
    assert allowed == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]


def test_sample_validation_and_count():
    with pytest.raises(ValueError, match="int64"):
        TrainSample(tokens=torch.zeros(4), loss_mask=torch.ones(4), advantage=0.0)
    with pytest.raises(ValueError, match="at least 2"):
        TrainSample(tokens=torch.zeros(1, dtype=torch.int64), loss_mask=torch.ones(1), advantage=0.0)
    with pytest.raises(ValueError, match="loss_mask"):
        TrainSample(tokens=torch.zeros(4, dtype=torch.int64), loss_mask=torch.ones(3), advantage=0.0)
    with pytest.raises(ValueError, match="old_logprobs"):
        TrainSample(
            tokens=torch.zeros(4, dtype=torch.int64),
            loss_mask=torch.ones(4),
            advantage=0.0,
            old_logprobs=torch.zeros(4),
        )
    prompt_only = TrainSample(tokens=torch.zeros(4, dtype=torch.int64), loss_mask=torch.zeros(4), advantage=0.0)
    assert count_sequences([_sample(4), prompt_only, _sample(5)]) == 2


@pytest.mark.parametrize("packing", ["padded", "block_diagonal"])
def test_microbatch_carries_the_per_token_fields_aligned_with_old_logprobs(packing):
    """token_advantages, behaviour_logprobs and ref_logprobs travel like old_logprobs (0 where not counted);
    a sample without token advantages gets its sequence advantage on every position."""
    a = _sample(5, adv=2.0, old=torch.full((4,), -1.0))
    b = _sample(3, adv=-1.0, old=torch.full((2,), -2.0))
    a = replace(
        a, token_advantages=torch.arange(4.0), behaviour_logprobs=a.old_logprobs - 0.5, ref_logprobs=-a.old_logprobs
    )
    b = replace(b, behaviour_logprobs=b.old_logprobs - 0.25, ref_logprobs=-b.old_logprobs)
    mb = build_microbatch([a, b], [0, 1], packing=packing)
    counted = mb.loss_mask > 0
    shift = mb.old_logprobs - mb.behaviour_logprobs  # 0.5 on a's counted positions, 0.25 on b's, 0 elsewhere
    assert sorted(set(shift[counted].tolist())) == [0.25, 0.5] and not shift[~counted].any()
    assert torch.equal(mb.ref_logprobs, -mb.old_logprobs)
    assert mb.token_advantages[counted].tolist() == [1.0, 2.0, 3.0, -1.0]  # a: positions 1..3; b: its advantage
    assert not mb.token_advantages[~counted].any()
    # a field some samples lack is not carried; missing token advantages alone are filled in
    assert build_microbatch([a, _sample(3)], [0, 1], packing=packing).behaviour_logprobs is None
    assert build_microbatch([b], [0], packing=packing).token_advantages is None


def test_per_token_fields_of_the_wrong_length_are_refused_naming_the_field():
    for field in ("token_advantages", "behaviour_logprobs", "ref_logprobs"):
        with pytest.raises(ValueError, match=rf"Sample.{field} must be \[L-1\] = \[4\]"):
            replace(_sample(5), **{field: torch.zeros(5)})


def test_the_learner_refuses_inconsistent_loss_inputs_before_any_forward():
    """Checked before the model is touched (model=None here)."""
    from gspo_mcore.algo.loss_config import LossConfig, OffPolicyConfig
    from gspo_mcore.learner.step import StepSettings, forward_backward, train_step

    s = _sample(5, old=torch.zeros(4))
    tok = replace(s, token_advantages=torch.zeros(4))
    with pytest.raises(ValueError, match="only loss.variant=gspo_token uses"):
        forward_backward(None, [tok], None, LossConfig(variant="gspo"), max_tokens=100)
    tis = LossConfig(off_policy=OffPolicyConfig(mode="tis"))
    with pytest.raises(ValueError, match=r"loss.off_policy.mode='tis' needs behaviour_logprobs"):
        forward_backward(None, [s], None, tis, max_tokens=100)
    with pytest.raises(ValueError, match=r"rollout.old_logprobs: recompute\), or behaviour_logprobs .*sample 0"):
        train_step(None, None, None, [s], None, StepSettings(loss=tis))
    with pytest.raises(ValueError, match="sample 0 has none"):
        train_step(None, None, None, [_sample(5)], None, StepSettings(loss=tis, recompute_old_logprobs=True))
    with pytest.raises(ValueError, match="needs a ReferencePolicy"):
        train_step(None, None, None, [s], None, StepSettings(loss=LossConfig(kl_metric=True)))
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        forward_backward(None, [s], None, LossConfig(kl_coef=0.1), max_tokens=100)
