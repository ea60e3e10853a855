"""The CP split of micro-batches (single process): the load-balanced layout, and split + unsplit covering every
position exactly once, for rows shorter than 2 CP (some CP ranks then hold padding only), odd lengths and a
prompt-only sample, in both splittable packings."""

import pytest
import torch

from gspo_mcore.learner.batching import TrainSample, build_microbatch
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
        out.append(TrainSample(tokens=tokens, loss_mask=mask, advantage=float(i), old_logprobs=-torch.rand(n - 1)))
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


def _attention_inputs(S=12, b=2, nh=4, ng=2, hd=8):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(S, b, n, hd, generator=g, dtype=torch.float64) for n in (nh, ng, ng))
    w = torch.randn(S, b, nh * hd, generator=g, dtype=torch.float64)  # d loss / d output
    return q, k, v, w


def _reference_attention():
    """Full causal attention in float64 from the formula (grouped-query heads repeated), value and gradients."""
    q, k, v, w = (x.clone() for x in _attention_inputs())
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    r = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(r, dim=2), v.repeat_interleave(r, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, kk) / q.shape[-1] ** 0.5
    S = q.shape[0]
    scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), vv).reshape(S, q.shape[1], -1)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _cp_attention_rank(rank, world):
    import torch.distributed as dist

    from gspo_mcore.platform.cp_attention import causal_attention

    q, k, v, w = _attention_inputs()
    keep = load_balanced_positions(q.shape[0], world, rank)
    q, k, v = (x[keep].clone().requires_grad_(True) for x in (q, k, v))
    out = causal_attention(q, k, v, dist.group.WORLD, 1.0 / q.shape[-1] ** 0.5)
    (out * w[keep]).sum().backward()
    return keep, out.detach(), q.grad, k.grad, v.grad


@pytest.mark.distributed
def test_cp_attention_equals_full_causal_attention_value_and_gradients():
    """2 gloo ranks, load-balanced chunks: each rank's output and its q, k, v gradients equal the matching rows
    of full causal attention (float64, written from the formula). The k, v gradients need the all-gather's
    backward to sum every rank's queries' contributions."""
    from helpers.dist_cases import run_ranks

    ref = _reference_attention()
    for keep, *got in run_ranks(_cp_attention_rank, 2):
        for name, g, r in zip(("output", "dq", "dk", "dv"), got, ref):
            torch.testing.assert_close(g, r[keep], rtol=1e-10, atol=1e-10, msg=name)
