"""The one-pass gradient accumulation (csrc/accumulate_cpu.cpp, :mod:`gspo_mcore.ops.accumulate`): ``dst += src``
for a float32 ``dst`` and a float32 or bfloat16 ``src``, against float64 and against the pure-torch twin
(``dst.add_(src)``), on awkward sizes (empty, one element, around the kernel's 16,384-element blocks, 1 and 2
threads), a non-contiguous ``src``; the fallbacks, and bad input."""

from __future__ import annotations

import pytest
import torch

from gspo_mcore import ops
from gspo_mcore.ops import reference
from gspo_mcore.ops.accumulate import accumulate_

pytestmark = pytest.mark.skipif(not ops.HAVE_EXTENSION, reason="the compiled extension is not built")

SIZES = [(0,), (1,), (7, 3), (16383,), (16384,), (16385,), (3, 16384 + 5), (129, 577)]


def _pair(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    dst = torch.randn(shape, generator=g) * 4
    src = (torch.randn(shape, generator=g) * 3).to(dtype)
    return dst, src


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SIZES)
def test_equals_float32_addition_of_the_widened_source(shape, dtype, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dst, src = _pair(shape, dtype)
        exact = dst.double() + src.double()  # src widens exactly; one float32 rounding of the sum
        twin = dst.clone()
        reference.accumulate_(twin, src)
        out = accumulate_(dst, src)
    finally:
        torch.set_num_threads(before)
    assert out is dst
    assert torch.equal(dst, exact.float())  # one correctly rounded float32 add per element, as torch's
    assert torch.equal(dst, twin)


def test_a_non_contiguous_source():
    dst, src = _pair((40, 30), torch.bfloat16)
    src_t = src.T.contiguous().T  # same values, transposed strides
    want = dst.clone().add_(src)
    accumulate_(dst, src_t)
    assert torch.equal(dst, want)


def test_other_dtypes_and_layouts_take_the_twin():
    dst = torch.zeros(4, 6, dtype=torch.float64)
    accumulate_(dst, torch.ones(4, 6, dtype=torch.float64))
    assert torch.equal(dst, torch.ones(4, 6, dtype=torch.float64))
    dst = torch.zeros(6, 4).T  # a non-contiguous destination: torch's add_
    accumulate_(dst, torch.ones(4, 6, dtype=torch.bfloat16))
    assert torch.equal(dst, torch.ones(4, 6))


def test_bad_input_names_the_argument():
    op = torch.ops.gspo_mcore.accumulate_
    with pytest.raises(RuntimeError, match="dst"):
        op(torch.zeros(3, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="src must be float32 or bfloat16"):
        op(torch.zeros(3), torch.ones(3, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="same shape"):
        op(torch.zeros(3), torch.ones(4))
    with pytest.raises(RuntimeError, match="contiguous"):
        op(torch.zeros(4, 6).T, torch.ones(6, 4))
