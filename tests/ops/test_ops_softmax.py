"""The attention's in-place softmax kernels (csrc/softmax_cpu.cpp) against float64 and their pure-torch twin, in
float32 and bfloat16: the mask applied per score matrix as the attention lays them out (query heads folded into the
rows, a mask shared by the heads of a sequence or by every sequence), fully masked rows, and the backward. The bound
is twice eager torch's own error (masked_fill, softmax, and torch's softmax backward) plus a few ulps."""

from __future__ import annotations

import pytest
import torch

from gspo_mcore import ops
from gspo_mcore.ops import reference
from gspo_mcore.ops.softmax import masked_softmax_, softmax_backward_

pytestmark = pytest.mark.skipif(not ops.HAVE_EXTENSION, reason="the compiled extension is not built")

DTYPES = [torch.float32, torch.bfloat16]
ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7}
FILL = -10000.0
# (G, r, sq, sk, groups per batch, mask batch): G = batch * groups
CASES = [(6, 3, 29, 29, 3, 2), (4, 2, 17, 17, 2, 1), (1, 1, 5, 5, 1, 1), (2, 1, 40, 501, 1, 2), (3, 2, 7, 33, 3, 1)]


def _case(G, r, sq, sk, gpb, mb, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    scores = (torch.randn(G, r * sq, sk, generator=g) * 6).to(dtype)
    mask = torch.rand(mb, sq, sk, generator=g) < 0.4
    mask[0, 0] = True  # a query that sees no key: uniform probabilities
    grad = torch.randn(G, r * sq, sk, generator=g).to(dtype)
    return scores, mask, grad


def _full_mask(mask, G, r, gpb):
    mb, sq, sk = mask.shape
    per = gpb if mb > 1 else G
    return mask[:, None, None].expand(mb, per, r, sq, sk).reshape(G, r * sq, sk)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_masked_softmax_matches_float64_within_eager_error(case, dtype):
    G, r, sq, sk, gpb, mb = case
    scores, mask, grad = _case(*case, dtype)
    full = _full_mask(mask, G, r, gpb)
    exact = torch.softmax(scores.double().masked_fill(full, FILL), -1)
    eager = torch.softmax(scores.masked_fill(full, FILL), -1)
    got = scores.clone()
    masked_softmax_(got, mask, gpb, FILL)
    bound = 2 * (eager.double() - exact).abs().max().item() + 4 * ULP[dtype]
    assert (got.double() - exact).abs().max().item() <= bound
    # backward: d scores from d probs, written over the gradient
    exact_g = exact * (grad.double() - (grad.double() * exact).sum(-1, keepdim=True))
    eager_g = torch._softmax_backward_data(grad, eager, -1, dtype)
    got_g = grad.clone()
    softmax_backward_(got_g, got)
    bound = 2 * (eager_g.double() - exact_g).abs().max().item() + 4 * ULP[dtype] * exact_g.abs().max().item()
    assert (got_g.double() - exact_g).abs().max().item() <= bound


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compiled_equals_its_twin(dtype):
    scores, mask, grad = _case(6, 3, 29, 29, 3, 2, dtype, seed=4)
    a, b = scores.clone(), scores.clone()
    torch.ops.gspo_mcore.masked_softmax_(a, mask, 3, FILL)
    reference.masked_softmax_(b, mask, 3, FILL)
    torch.testing.assert_close(a, b, rtol=4 * ULP[dtype], atol=4 * ULP[dtype])
    ga, gb = grad.clone(), grad.clone()
    torch.ops.gspo_mcore.softmax_backward_(ga, a)
    reference.softmax_backward_(gb, a)
    torch.testing.assert_close(ga, gb, rtol=4 * ULP[dtype], atol=4 * ULP[dtype] * gb.abs().max().item())


def test_no_mask_is_a_plain_softmax():
    scores = torch.randn(2, 9, 13)
    got = scores.clone()
    masked_softmax_(got, None, 1, FILL)
    torch.testing.assert_close(got, torch.softmax(scores, -1), rtol=1e-6, atol=1e-7)


def test_bad_input_is_named():
    s = torch.randn(4, 6, 5)
    with pytest.raises(RuntimeError, match="mask has 4 keys but scores have 5"):
        torch.ops.gspo_mcore.masked_softmax_(s, torch.zeros(1, 3, 4, dtype=torch.bool), 1, FILL)
    with pytest.raises(RuntimeError, match="rows are not a multiple of the mask's 4 queries"):
        torch.ops.gspo_mcore.masked_softmax_(s, torch.zeros(1, 4, 5, dtype=torch.bool), 1, FILL)
    with pytest.raises(RuntimeError, match="a mask of batch 3 does not fit 4 score matrices in groups of 2"):
        torch.ops.gspo_mcore.masked_softmax_(s, torch.zeros(3, 3, 5, dtype=torch.bool), 2, FILL)
    with pytest.raises(RuntimeError, match="softmax_backward_: grad .* and probs .* must match"):
        torch.ops.gspo_mcore.softmax_backward_(s, torch.randn(4, 6, 4))
