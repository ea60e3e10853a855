"""A gradient added into a float32 buffer in one pass (``dst += src``), for the learner's ``main_grad`` on a CPU.

``main_grad.add_(grad)`` with a bfloat16 ``grad`` makes torch, on a CPU, copy the whole gradient to float32 before it
adds: two passes and a temporary the size of the parameter. :func:`accumulate_` reads each element once. Kernel:
``csrc/accumulate_cpu.cpp``; twin: :func:`gspo_mcore.ops.reference.accumulate_` (``dst.add_(src)``), used off the
CPU, for other dtypes and without the extension. Tests: ``tests/ops/test_ops_accumulate.py``.
"""

from __future__ import annotations

import torch

from gspo_mcore.ops import _backend, reference

_SOURCE_DTYPES = (torch.float32, torch.bfloat16)


def accumulate_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst += src`` in place and return ``dst``: the compiled kernel for a contiguous float32 CPU ``dst`` and a
    float32 or bfloat16 CPU ``src`` of the same shape, ``dst.add_(src)`` otherwise."""
    if (
        dst.device.type == "cpu"
        and src.device.type == "cpu"
        and dst.dtype == torch.float32
        and src.dtype in _SOURCE_DTYPES
        and dst.is_contiguous()
        and dst.shape == src.shape
    ):
        _backend.op("accumulate_")(dst, src)
    else:
        reference.accumulate_(dst, src)
    return dst
