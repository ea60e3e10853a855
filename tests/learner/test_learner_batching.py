"""Packing samples into micro-batches by token budget (pure Python/torch; no processes)."""

from __future__ import annotations

import random

import pytest
import torch

from gspo_mcore.learner.batching import (
    Sample,
    block_causal_mask,
    build_microbatch,
    count_sequences,
    plan_microbatches,
    split_minibatches,
)


def _sample(length, prompt=2, adv=1.0, old=None):
    mask = torch.zeros(length, dtype=torch.int64)
    mask[prompt:] = 1
    return Sample(tokens=torch.arange(length, dtype=torch.int64) + 10, loss_mask=mask, advantage=adv, old_logprobs=old)


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
        Sample(tokens=torch.zeros(4), loss_mask=torch.ones(4), advantage=0.0)
    with pytest.raises(ValueError, match="at least 2"):
        Sample(tokens=torch.zeros(1, dtype=torch.int64), loss_mask=torch.ones(1), advantage=0.0)
    with pytest.raises(ValueError, match="loss_mask"):
        Sample(tokens=torch.zeros(4, dtype=torch.int64), loss_mask=torch.ones(3), advantage=0.0)
    with pytest.raises(ValueError, match="old_logprobs"):
        Sample(
            tokens=torch.zeros(4, dtype=torch.int64),
            loss_mask=torch.ones(4),
            advantage=0.0,
            old_logprobs=torch.zeros(4),
        )
    prompt_only = Sample(tokens=torch.zeros(4, dtype=torch.int64), loss_mask=torch.zeros(4), advantage=0.0)
    assert count_sequences([_sample(4), prompt_only, _sample(5)]) == 2
