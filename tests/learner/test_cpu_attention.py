"""The CPU core attention (:mod:`gspo_mcore.platform.cpu_attention`) against Megatron's ``DotProductAttention``
and a float64 reference written from the formula, value and gradients, fp32 and bf16.

Bound: in each dtype, the fast module's error against float64 (on the same rounded inputs) may be at most
twice Megatron's own error in that dtype, plus a floor of a few units in the last place (both are rounded
computations of the same formula, with different but equally long reduction orders). Every case has an odd
head size, grouped-query heads (3 query heads per KV group), uneven lengths and, where a mask is given,
fully masked (padding) rows, whose probabilities are uniform in every implementation.
"""

from __future__ import annotations

import pytest
import torch

from gspo_mcore.platform.cpu_attention import MASK_VALUE, attention

# (name, sq, b, heads, groups, head dim, mask kind)
CASES = [
    ("causal-none", 37, 3, 6, 2, 24, "none"),
    ("star-padded", 29, 2, 6, 2, 20, "star"),
    ("block-diagonal", 41, 1, 3, 3, 16, "blocks"),
    ("mha-star", 17, 2, 4, 4, 8, "star"),
    ("long-star", 300, 2, 6, 2, 24, "star"),
]


def _inputs(case, dtype):
    name, sq, b, nh, ng, hn, kind = case
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    q = (torch.randn(sq, b, nh, hn, generator=g) * 2).to(dtype)
    k = (torch.randn(sq, b, ng, hn, generator=g) * 2).to(dtype)
    v = torch.randn(sq, b, ng, hn, generator=g).to(dtype)
    causal = torch.ones(sq, sq, dtype=torch.bool).triu_(1)
    if kind == "none":
        mask = None
    elif kind == "blocks":  # two sequences back to back: block-diagonal causal
        cut = sq // 3
        mask = causal.clone()
        mask[cut:, :cut] = True
        mask = mask[None, None]
    else:  # a prompt of P, two suffixes that see it and themselves; the last row's tail is padding
        P, a = sq // 3, sq // 3 + (sq - sq // 3) // 2
        mask = causal.clone()
        mask[a:, P:a] = True
        rows = [mask.clone() for _ in range(b)]
        rows[-1][sq - 3 :, :] = True  # padded queries: every key masked
        mask = torch.stack(rows)[:, None]
    grad = torch.randn(sq, b, nh * hn, generator=g).to(dtype)
    return q, k, v, mask, grad


def _reference(q, k, v, mask, grad):
    """float64, from the formula (Megatron's semantics: masked scores set to -10000, keys of a group shared)."""
    q, k, v, grad = (x.double().requires_grad_(x is not grad) for x in (q, k, v, grad))
    sq, b, nh, hn = q.shape
    r = nh // k.shape[2]
    kk, vv = k.repeat_interleave(r, dim=2), v.repeat_interleave(r, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, kk) / hn**0.5
    if mask is None:
        mask = torch.ones(sq, sq, dtype=torch.bool).triu(1)[None, None]
    probs = torch.softmax(scores.masked_fill(mask, MASK_VALUE), dim=-1)
    out = torch.einsum("bhst,tbhd->sbhd", probs, vv).reshape(sq, b, nh * hn)
    (out * grad).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def _run(fn, q, k, v, mask, grad):
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    out = fn(q, k, v, mask)
    (out.float() * grad.float()).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def _megatron_rank(rank, world, dtypes):
    """One gloo rank with Megatron's groups: both modules built from the same config, run on every case."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from gspo_mcore.platform import megatron_cpu
    from gspo_mcore.platform.cpu_attention import core_attention_class

    megatron_cpu.apply()
    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    results = {}
    try:
        for case in CASES:
            _, sq, b, nh, ng, hn, _ = case
            config = TransformerConfig(
                num_layers=1,
                hidden_size=nh * hn,
                num_attention_heads=nh,
                num_query_groups=ng,
                kv_channels=hn,
                attention_dropout=0.0,
                masked_softmax_fusion=False,
                use_cpu_initialization=True,
            )
            kw = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
            megatron, fast = DotProductAttention(**kw), core_attention_class()(**kw)
            for dtype in dtypes:
                config.params_dtype = dtype
                q, k, v, mask, grad = _inputs(case, dtype)
                results[case[0], str(dtype)] = {
                    "megatron": _run(lambda q, k, v, m: megatron(q, k, v, m), q, k, v, mask, grad),
                    "fast": _run(lambda q, k, v, m: fast(q, k, v, m), q, k, v, mask, grad),
                    "ref": _reference(q, k, v, mask, grad),
                }
    finally:
        ps.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def compared():
    from helpers.dist_cases import run_ranks

    return run_ranks(_megatron_rank, 1, args=((torch.float32, torch.bfloat16),))[0]


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cpu_attention_matches_megatron_within_its_own_error(compared, case, dtype):
    got = compared[case[0], str(dtype)]
    ulp = torch.finfo(dtype).eps
    for name, fast, meg, ref in zip(("output", "dq", "dk", "dv"), got["fast"], got["megatron"], got["ref"]):
        assert fast.dtype == meg.dtype == dtype, name
        scale = ref.abs().max().item()
        err_fast = (fast.double() - ref).abs().max().item()
        err_meg = (meg.double() - ref).abs().max().item()
        bound = 2 * err_meg + 4 * ulp * scale
        assert err_fast <= bound, (
            f"{case[0]} {dtype} {name}: error {err_fast:.3e} > bound {bound:.3e} (Megatron {err_meg:.3e})"
        )


def test_attention_folds_grouped_heads_without_copying_keys():
    """The function alone (no Megatron groups): 4 query heads on 1 KV head give the same result as the heads
    computed one at a time against that head, in float64."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(7, 2, 4, 5, generator=g, dtype=torch.float64)
    k = torch.randn(7, 2, 1, 5, generator=g, dtype=torch.float64)
    v = torch.randn(7, 2, 1, 5, generator=g, dtype=torch.float64)
    mask = torch.ones(7, 7, dtype=torch.bool).triu(1)[None, None]
    out = attention(q, k, v, mask, 0.5).view(7, 2, 4, 5)
    for h in range(4):
        one = attention(q[:, :, h : h + 1], k, v, mask, 0.5)
        torch.testing.assert_close(out[:, :, h], one, rtol=1e-12, atol=1e-12)


def test_dead_queries_are_worked_out_once_per_mask_and_again_when_it_changes():
    from gspo_mcore.platform.cpu_attention import dead_queries

    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).triu(1)
    mask[1, :, 4:] = True  # row 1's last two queries see no key
    view = mask.reshape(2, 1, 1, 6, 6)
    _, dead = dead_queries(view)
    assert dead.shape == (2, 1, 1, 6, 1) and dead.flatten().tolist() == [False] * 10 + [True] * 2
    assert dead_queries(mask.reshape(2, 1, 1, 6, 6))[1] is dead  # every layer's view: the kept answer
    assert dead_queries(mask[1:].reshape(1, 1, 1, 6, 6))[1].flatten().tolist() == [False] * 4 + [True] * 2
    assert dead_queries(mask[:1].reshape(1, 1, 1, 6, 6))[1] is None  # another part of the same data
    assert dead_queries(mask.reshape(2, 1, 1, 6, 6))[1] is not None
    mask[1, :, 4:, 0] = False  # changed in place: worked out again
    assert dead_queries(mask.reshape(2, 1, 1, 6, 6))[1] is None
