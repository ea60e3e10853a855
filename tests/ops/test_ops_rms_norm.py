"""RMSNorm's compiled CPU kernels (csrc/rmsnorm_cpu.cpp) against their pure-torch twin and float64: value, input
gradient and weight gradient in float32 and bfloat16 on awkward shapes. The bound on each is twice the error of
eager torch's own ``torch.nn.RMSNorm`` against float64 on the same rows, plus a few units in the last place of
the output dtype."""

from __future__ import annotations

import pytest
import torch

from gspo_mcore import ops
from gspo_mcore.ops import reference
from gspo_mcore.ops.rms_norm import rms_norm

pytestmark = pytest.mark.skipif(not ops.HAVE_EXTENSION, reason="the compiled extension is not built")

# (leading shape, H): one row, H below one vector, H not a multiple of 16, SmolLM2's hidden size, Qwen's head dim
SHAPES = [((1,), 1), ((3,), 7), ((5, 2), 17), ((33,), 100), ((67, 2), 576), ((4, 3, 2), 128), ((2,), 1000)]
DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-6
ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7}


def _inputs(lead, H, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, H, generator=g) * 3).to(dtype)
    x.view(-1, H)[0, : max(1, H // 3)] *= 40  # a row with a few large entries
    w = (1 + 0.3 * torch.randn(H, generator=g)).to(dtype)
    dy = torch.randn(*lead, H, generator=g).to(dtype)
    return x, w, dy


def _eager(x, w, dy):
    """torch.nn.RMSNorm (the module Megatron's local spec builds): y, dx, dw."""
    m = torch.nn.RMSNorm(x.shape[-1], eps=EPS).to(x.dtype)
    with torch.no_grad():
        m.weight.copy_(w)
    xi = x.clone().requires_grad_()
    y = m(xi)
    y.backward(dy)
    return y.detach(), xi.grad, m.weight.grad


def _exact(x, w, dy):
    y, rstd = reference.rms_norm_forward(x.double(), w.double(), EPS)
    dx, dw = reference.rms_norm_backward(dy.double(), x.double(), w.double(), rstd)
    return y, dx, dw


def _bound(eager, exact, dtype):
    return 2 * (eager.double() - exact).abs().max().item() + 4 * ULP[dtype] * exact.abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lead,H", SHAPES)
def test_compiled_matches_float64_within_eager_error(lead, H, dtype):
    x, w, dy = _inputs(lead, H, dtype)
    exact = _exact(x, w, dy)
    eager = _eager(x, w, dy)
    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = rms_norm(xi, wi, EPS)
    y.backward(dy)
    for name, got, ref, eag in zip(("y", "dx", "dw"), (y, xi.grad, wi.grad), exact, eager):
        assert got.dtype == dtype and got.shape == ref.shape, name
        err = (got.double() - ref).abs().max().item()
        assert err <= _bound(eag, ref, dtype), f"{name}: error {err:.3g} > bound {_bound(eag, ref, dtype):.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compiled_equals_its_twin(dtype):
    """The kernels and the twin compute the same float32 formula: equal up to float32 rounding of the sums."""
    x, w, dy = _inputs((41, 2), 576, dtype, seed=3)
    y, rstd = torch.ops.gspo_mcore.rms_norm_forward(x, w, EPS)
    y_ref, rstd_ref = reference.rms_norm_forward(x, w, EPS)
    torch.testing.assert_close(rstd, rstd_ref, rtol=4e-7, atol=0)
    torch.testing.assert_close(y, y_ref, rtol=4 * ULP[dtype], atol=0)
    dx, dw = torch.ops.gspo_mcore.rms_norm_backward(dy, x, w, rstd)
    dx_ref, dw_ref = reference.rms_norm_backward(dy, x, w, rstd_ref)
    torch.testing.assert_close(dx, dx_ref, rtol=4 * ULP[dtype], atol=1e-5 * dx_ref.abs().max().item())
    torch.testing.assert_close(dw, dw_ref, rtol=4 * ULP[dtype], atol=1e-5 * dw_ref.abs().max().item())


def test_weight_gradient_does_not_depend_on_the_thread_count():
    x, w, dy = _inputs((300,), 64, torch.float32, seed=5)
    _, rstd = torch.ops.gspo_mcore.rms_norm_forward(x, w, EPS)
    threads = torch.get_num_threads()
    try:
        grads = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            grads.append(torch.ops.gspo_mcore.rms_norm_backward(dy, x, w, rstd)[1])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(grads[0], g) for g in grads[1:])


def test_bad_input_is_named():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"weight must have shape \[8\]"):
        rms_norm(x, torch.ones(7), EPS)
    with pytest.raises(TypeError, match="weight is torch.bfloat16 but x is torch.float32"):
        rms_norm(x, torch.ones(8, dtype=torch.bfloat16), EPS)
    with pytest.raises(RuntimeError, match="rms_norm: x must be float32 or bfloat16"):
        torch.ops.gspo_mcore.rms_norm_forward(x.half(), torch.ones(8).half(), EPS)


def test_float64_goes_to_the_twin():
    x, w, dy = _inputs((3,), 9, torch.float64)
    xi = x.clone().requires_grad_()
    y = rms_norm(xi, w, EPS)
    y.backward(dy)
    y_ref, dx_ref, _ = _exact(x, w, dy)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(xi.grad, dx_ref, rtol=1e-10, atol=1e-12)
