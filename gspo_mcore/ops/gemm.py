"""A CPU matrix product with its rows split across torch's threads, one single-threaded GEMM per thread.

oneDNN (torch's bfloat16 matmul on a CPU) leaves threads idle on some shapes: measured on a 2-core Xeon with AMX,
``[1002, 1536] x [1536, 576]`` ran at about 1150 GFLOP/s on one thread and on two. :func:`mm_rows` gives each
thread its own block of rows (2000-2300 GFLOP/s there; ``docs/results/shared-prompt.md``). Kernel:
``csrc/gemm_cpu.cpp``; twin: :func:`gspo_mcore.ops.reference.mm_rows` (plain ``a @ b``), used off the CPU and
without the extension.
"""

from __future__ import annotations

import torch

from gspo_mcore.ops import _backend

MIN_ROWS = 128
"""Rows per thread below which the product runs as one GEMM (small blocks waste the GEMM's tiles)."""

MAX_COLS = 1024
"""Outputs wider than this run as one GEMM: oneDNN threads them well itself (measured: ``[1002, 576] x [576,
3072]`` 2600-2700 GFLOP/s as one GEMM, 2200 split)."""


def mm_rows(a: torch.Tensor, b: torch.Tensor, min_rows: int | None = None, max_cols: int | None = None) -> torch.Tensor:
    """``a [M, K] @ b [K, N]``: for ``N <= max_cols`` (default :data:`MAX_COLS`), each thread computes a block of at
    least ``min_rows`` (default :data:`MIN_ROWS`) of the ``M`` rows; otherwise one GEMM."""
    max_cols = MAX_COLS if max_cols is None else max_cols
    if a.device.type == "cpu" and b.device.type == "cpu" and a.dim() == b.dim() == 2 and b.shape[1] <= max_cols:
        return _backend.op("mm_rows")(a, b, int(MIN_ROWS if min_rows is None else min_rows))
    return a @ b
