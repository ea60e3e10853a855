"""Flush denormal floats to zero on every CPU thread torch computes on.

Attention probabilities underflow into the denormal range all the time (a score about 87 below its row's
maximum in fp32, the same in bf16, which shares fp32's exponent range), and so do their products in the
softmax's backward. x86 CPUs handle an operation on a denormal with a microcode assist of about a hundred
cycles. Measured on a 2-core Xeon with 2 threads (``docs/results/shared-prompt.md``): torch's bf16 softmax over
SmolLM2's ``[6, 1503, 501]`` scores took 15-17 ms and its backward 9-10 ms, against 2.9 ms and 0.8 ms with
flush-to-zero and denormals-are-zero on.

``torch.set_flush_denormal(True)`` sets those two flags (x86's MXCSR FTZ and DAZ bits) on the calling thread
only, and torch's kernels also run on its OpenMP worker threads. :func:`flush_denormals` sets them on the calling
thread and on every thread of torch's pool (the compiled extension's ``set_flush_denormal_all_threads``);
threads created afterwards copy them from their creator. Values below fp32's smallest normal (1.2e-38) then
read and compute as zero, as on GPUs' tensor cores and oneDNN's bf16 kernels: far below anything a
probability, an activation or a gradient of this trainer means.

Applied once per process by the learner's set-up on a CPU host (:func:`gspo_mcore.learner.parallel.init_parallel`),
which also covers the in-process rollout engine in the same process. ``GSPO_FLUSH_DENORMALS=0`` in the
environment leaves the flags as they are. A no-op without the compiled extension or on a CPU that lacks the
flags.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

ENV = "GSPO_FLUSH_DENORMALS"

_threads: int | None = None


def flush_denormals() -> int:
    """Set flush-to-zero and denormals-are-zero as the module docstring says; the number of threads set (0: not
    applied). Once per process: later calls return the first call's answer."""
    global _threads
    if _threads is not None:
        return _threads
    _threads = 0
    if os.environ.get(ENV, "1") == "0":
        logger.info("%s=0: denormal floats computed as they are", ENV)
        return 0
    try:
        from gspo_mcore import _C
    except ImportError:  # the pure-torch install: the calling thread only is better than nothing
        import torch

        _threads = int(torch.set_flush_denormal(True))
        return _threads
    _threads = int(_C.set_flush_denormal_all_threads(True))
    return _threads
