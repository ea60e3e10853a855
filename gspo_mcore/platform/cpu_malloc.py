"""glibc's allocator on a CPU host: keep freed memory for reuse instead of handing it back to the kernel.

By default glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and
returns it with ``munmap`` when freed. A training step on a CPU allocates and frees the same large tensors every
step (an embedding's ``[V, H]`` gradient, its fp32 copy for the gradient buffer, activations), so every step
pays the kernel's page faults and zeroing for all of them again: on SmolLM2-135M in bf16 (2 cores) a profile
put the tied embedding's three alone at about 0.25 s of a 2-2.3 s step (``docs/results/shared-prompt.md``).
:func:`keep_freed_memory` sets ``M_MMAP_MAX = 0`` (large blocks come from the heap too) and a high
``M_TRIM_THRESHOLD`` (freed heap memory stays mapped), which is what jemalloc and tcmalloc, the allocators
PyTorch's CPU guides recommend preloading, do by design. The process's resident size then stays near its peak
instead of falling between steps.

Applied once per process by the learner's set-up on a CPU host (:func:`gspo_mcore.learner.parallel.init_parallel`);
``GSPO_KEEP_FREED_MEMORY=0`` in the environment leaves the allocator as it is. A no-op on a GPU host, off Linux,
and where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

logger = logging.getLogger(__name__)

ENV = "GSPO_KEEP_FREED_MEMORY"
M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_MAX = -4
TRIM_THRESHOLD = 2**31 - 1
"""Freed heap memory above this much (2 GiB) is returned to the kernel. ``mallopt`` takes a C ``int``: a larger
value (an earlier ``1 << 40``) was cut to 0 on its way in, which made glibc trim the heap on every ``free``, so that
each large tensor allocated again page-faulted afresh (2,174 faults for one ``[6, 1503, 501]`` bf16 score tensor,
0.5 -> 3 ms for its ``bmm``); the argument types are now declared, so such a value raises instead."""

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Tune glibc's ``malloc`` as the module docstring says; True when it is (now or before) tuned."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get(ENV, "1") == "0":
        logger.info("%s=0: glibc's allocator left as it is", ENV)
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt.argtypes, libc.mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
        ok = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    except (OSError, AttributeError) as exc:  # no such library or symbol: leave the allocator alone
        logger.info("glibc's mallopt is not available (%s): allocator left as it is", exc)
        return False
    _applied = ok
    return ok
