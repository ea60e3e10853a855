"""The row-split CPU GEMM (csrc/gemm_cpu.cpp, :func:`gspo_mcore.ops.gemm.mm_rows`) against float64 and eager
``a @ b``: float32 and bfloat16, awkward shapes (1, 7 and 1002 rows, odd inner sizes, a transposed operand), one
and two threads, blocks as small as one row; the bound is twice eager torch's own error against float64 plus a
few units in the last place. Also: inputs that require grad (worker threads have their own grad mode), and bad
input named in the error."""

from __future__ import annotations

import pytest
import torch

from gspo_mcore import ops
from gspo_mcore.ops import gemm

pytestmark = pytest.mark.skipif(not ops.HAVE_EXTENSION, reason="the compiled extension is not built")

SHAPES = [(1, 5, 3), (7, 13, 9), (130, 64, 33), (1002, 576, 576), (257, 97, 1024)]
DTYPES = [torch.float32, torch.bfloat16]
ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7}


@pytest.fixture
def threads():
    old = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(old)


def _inputs(M, K, N, dtype, transposed, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g).to(dtype)
    a[:, 0] *= 50  # uneven magnitudes: rounding errors differ between rows
    b = torch.randn(N, K, generator=g).to(dtype).t() if transposed else torch.randn(K, N, generator=g).to(dtype)
    return a, b


@pytest.mark.parametrize("transposed", [False, True], ids=["b", "bT"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,K,N", SHAPES)
@pytest.mark.parametrize("nthreads", [1, 2])
def test_split_product_matches_float64_within_eager_error(M, K, N, dtype, transposed, nthreads, threads):
    threads(nthreads)
    a, b = _inputs(M, K, N, dtype, transposed)
    exact = a.double() @ b.double()
    eager = a @ b
    bound = 2 * (eager.double() - exact).abs().max().item() + 4 * ULP[dtype] * exact.abs().max().item()
    for min_rows in (1, 3, gemm.MIN_ROWS):
        got = torch.ops.gspo_mcore.mm_rows(a, b, min_rows)
        assert got.dtype == dtype and got.shape == (M, N) and got.is_contiguous()
        err = (got.double() - exact).abs().max().item()
        assert err <= bound, f"min_rows={min_rows}: error {err:.3g} > bound {bound:.3g}"


def test_inputs_that_require_grad_split_under_no_grad(threads):
    """The op runs inside autograd functions' forward (grad mode off there, but on in the worker threads)."""
    threads(2)
    a, b = _inputs(300, 24, 16, torch.bfloat16, transposed=True)
    w = torch.nn.Parameter(b.t().contiguous())
    with torch.no_grad():
        got = torch.ops.gspo_mcore.mm_rows(a, w.t(), 1)
    assert not got.requires_grad
    torch.testing.assert_close(got, a @ w.detach().t(), rtol=0, atol=0.05 * got.abs().max().item())


def test_wide_outputs_and_other_devices_run_one_gemm(monkeypatch):
    calls = []
    monkeypatch.setattr(gemm._backend, "op", lambda name: calls.append(name) or torch.ops.gspo_mcore.mm_rows)
    a, b = _inputs(8, 4, gemm.MAX_COLS + 1, torch.float32, transposed=False)
    torch.testing.assert_close(gemm.mm_rows(a, b), a @ b)
    assert calls == []
    gemm.mm_rows(a, b[:, :5])
    assert calls == ["mm_rows"]


@pytest.mark.parametrize(
    "a,b,min_rows,message",
    [
        (torch.ones(3), torch.ones(3, 2), 1, "mm_rows: a"),
        (torch.ones(3, 4), torch.ones(5, 2), 1, "a's columns must equal b's rows"),
        (torch.ones(3, 4), torch.ones(4, 2, dtype=torch.bfloat16), 1, "must have one dtype"),
        (torch.ones(3, 4), torch.ones(4, 2), 0, "min_rows must be >= 1"),
    ],
)
def test_bad_input_is_named(a, b, min_rows, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.gspo_mcore.mm_rows(a, b, min_rows)
