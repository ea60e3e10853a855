"""SwiGLU's compiled CPU kernels (csrc/activation_cpu.cpp) against float64 and their pure-torch twin, value and
gradient in float32 and bfloat16 on awkward shapes; the bound is twice eager torch's own error (chunk, silu,
multiply, as Megatron's MLP computes it) against float64 plus a few units in the last place. Also the exp the
kernels use, against float64 over its whole range."""

from __future__ import annotations

import pytest
import torch

from gspo_mcore import ops
from gspo_mcore.ops import reference
from gspo_mcore.ops.activation import swiglu

pytestmark = pytest.mark.skipif(not ops.HAVE_EXTENSION, reason="the compiled extension is not built")

SHAPES = [((1,), 2), ((3,), 14), ((5, 2), 34), ((33,), 200), ((67, 2), 3072), ((2,), 1002)]
DTYPES = [torch.float32, torch.bfloat16]
ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7}


def _inputs(lead, F2, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(*lead, F2, generator=g) * 4).to(dtype)
    h.view(-1, F2)[0, : max(1, F2 // 4)] *= 30  # large gates: silu's tails, exp over- and underflow
    dy = torch.randn(*lead, F2 // 2, generator=g).to(dtype)
    return h, dy


def _eager(h, dy):
    hi = h.clone().requires_grad_()
    a, b = torch.chunk(hi, 2, dim=-1)
    y = torch.nn.functional.silu(a) * b
    y.backward(dy)
    return y.detach(), hi.grad


def _bound(eager, exact, dtype):
    return 2 * (eager.double() - exact).abs().max().item() + 4 * ULP[dtype] * exact.abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lead,F2", SHAPES)
def test_compiled_matches_float64_within_eager_error(lead, F2, dtype):
    h, dy = _inputs(lead, F2, dtype)
    exact = (reference.swiglu_forward(h.double()), reference.swiglu_backward(dy.double(), h.double()))
    eager = _eager(h, dy)
    hi = h.clone().requires_grad_()
    y = swiglu(hi)
    y.backward(dy)
    for name, got, ref, eag in zip(("y", "dh"), (y, hi.grad), exact, eager):
        assert got.dtype == dtype and got.shape == ref.shape, name
        err = (got.double() - ref).abs().max().item()
        assert err <= _bound(eag, ref, dtype), f"{name}: error {err:.3g} > bound {_bound(eag, ref, dtype):.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compiled_equals_its_twin(dtype):
    h, dy = _inputs((41, 2), 384, dtype, seed=3)
    y, y_ref = torch.ops.gspo_mcore.swiglu_forward(h), reference.swiglu_forward(h)
    torch.testing.assert_close(y, y_ref, rtol=4 * ULP[dtype], atol=1e-6)
    dh, dh_ref = torch.ops.gspo_mcore.swiglu_backward(dy, h), reference.swiglu_backward(dy, h)
    torch.testing.assert_close(dh, dh_ref, rtol=4 * ULP[dtype], atol=1e-6)


def test_exp_within_two_float32_ulps_over_its_range():
    """sigmoid is 1 / (1 + exp(-x)): through it, the kernels' exp is checked on every float32 exponent it meets."""
    x = torch.linspace(-87.0, 87.0, 200_001)
    h = torch.cat([x[:, None], torch.ones(x.shape[0], 1)], dim=1)  # y = silu(x) * 1
    y = torch.ops.gspo_mcore.swiglu_forward(h)[:, 0].double()
    exact = x.double() * torch.sigmoid(x.double())
    rel = ((y - exact).abs() / exact.abs().clamp_min(1e-30)).max().item()
    assert rel < 6 * ULP[torch.float32], rel


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"last dimension must be even"):
        swiglu(torch.randn(3, 5))
    with pytest.raises(RuntimeError, match="swiglu: h must be float32 or bfloat16"):
        torch.ops.gspo_mcore.swiglu_forward(torch.randn(2, 4).half())
    with pytest.raises(RuntimeError, match="swiglu_backward: grad has shape"):
        torch.ops.gspo_mcore.swiglu_backward(torch.randn(2, 3), torch.randn(2, 4))
