"""The CP split of micro-batches (single process): the load-balanced layout, and split + unsplit covering every
position exactly once, for rows shorter than 2 CP (some CP ranks then hold padding only), odd lengths and a
prompt-only sample, in both splittable packings."""

import pytest
import torch

from gspo_mcore.learner import Sample
from gspo_mcore.learner.batching import build_microbatch
from gspo_mcore.learner.context_parallel import check_packing, pad_multiple, split, unsplit
from gspo_mcore.platform.cp_attention import load_balanced_positions


def test_load_balanced_positions_are_chunks_r_and_2cp_minus_1_minus_r():
    assert load_balanced_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert load_balanced_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert load_balanced_positions(8, 4, 3).tolist() == [3, 4]
    with pytest.raises(ValueError, match="multiple of 2 \\* CP = 4"):
        load_balanced_positions(6, 2, 0)


def _samples():
    out = []
    for i, n in enumerate([2, 3, 7, 5]):
        tokens = torch.arange(1, n + 1, dtype=torch.int64) + 10 * i
        mask = torch.zeros(n, dtype=torch.int64)
        if i != 3:  # sample 3 is prompt-only
            mask[1:] = 1
        out.append(Sample(tokens=tokens, loss_mask=mask, advantage=float(i), old_logprobs=-torch.rand(n - 1)))
    return out


@pytest.mark.parametrize("packing, row_multiple", [("padded", 1), ("thd", 1), ("thd", 5)])
@pytest.mark.parametrize("cp", [2, 4])
def test_split_then_unsplit_covers_every_position_once(packing, row_multiple, cp):
    """``row_multiple`` 5: the row padded further, as sequence parallelism pads it to TP x 2 CP (THD then has a trailing
    padding segment, split like the others but never scored)."""
    pytest.importorskip("megatron.core")
    samples = _samples()
    m = pad_multiple(cp)
    full = build_microbatch(samples, [0, 1, 2, 3], packing=packing, pad_multiple=m * row_multiple, segment_multiple=m)
    if row_multiple > 1:
        assert full.tokens.shape[1] > full.num_tokens
    seen = torch.zeros(full.num_tokens)
    tokens = torch.zeros(full.num_tokens, dtype=torch.int64)
    for r in range(cp):
        part = split(full, cp, r)
        assert part.num_tokens * cp == full.num_tokens
        assert part.tokens.numel() * cp == full.tokens.numel()
        assert int(part.cu_seqlens[-1]) == part.num_tokens
        ones, cu = unsplit(torch.ones(part.num_tokens), part)
        assert torch.equal(cu, full.cu_seqlens)
        seen += ones
        tokens += unsplit(part.tokens.reshape(-1)[: part.num_tokens].float(), part)[0].long()
        mask, _ = unsplit(part.loss_mask, part)
        assert torch.equal(mask * ones, full.loss_mask * ones)
        old, _ = unsplit(part.old_logprobs, part)
        assert torch.equal(old * ones, full.old_logprobs * ones)
    assert torch.equal(seen, torch.ones(full.num_tokens))
    assert torch.equal(tokens, full.tokens.reshape(-1)[: full.num_tokens])
    assert full.loss_mask.sum() == sum(s.num_response_tokens for s in samples)


def test_block_diagonal_packing_is_refused_with_cp():
    with pytest.raises(ValueError, match="cannot be split over context-parallel ranks"):
        check_packing("block_diagonal")
