"""TEST SUPPORT ONLY, NOT SGLang's kernel package and not part of gspo_mcore: a stand-in ``sgl_kernel`` that
lets the pinned SGLang (0.5.23) start on a plain CPU machine for the integration tests in ``tests/integration``.

With ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports a few names from ``sgl_kernel`` (its CPU kernels, which are
not on PyPI and are built for Intel AMX). The integration tier puts this directory on the server's
``PYTHONPATH``. Only what the tiny dense model's path needs is implemented, in plain torch:

- ``assign_req_to_token_pool_cpu`` (called by ``srt/mem_cache/allocation.py``), the twin of SGLang's
  Triton kernel ``assign_req_to_token_pool``.

Every other name resolves to a function that raises ``NotImplementedError`` when called, so an import at
SGLang start-up succeeds and a code path the tests do not expect fails loudly instead of silently.
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+gspo-mcore-test-standin"


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor, out_cache_loc: torch.Tensor,
                                 pool_len: int) -> None:
    """For each request ``i``: ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`` = the next
    ``end_offset[i] - start_offset[i]`` entries of ``out_cache_loc`` (requests back to back, in order)."""
    assert req_to_token.shape[1] == pool_len, (tuple(req_to_token.shape), pool_len)
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset:offset + n].to(req_to_token.dtype)
        offset += max(n, 0)


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def not_implemented(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not provided by the gspo_mcore test stand-in (tests/integration/sgl_kernel_cpu); "
            "only assign_req_to_token_pool_cpu is"
        )

    not_implemented.__name__ = name
    return not_implemented
