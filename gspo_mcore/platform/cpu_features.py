"""What this CPU computes natively: bf16 matrix instructions (AVX512_BF16, AMX-BF16).

Read from the kernel's CPU flags (``/proc/cpuinfo``); where there is no such file, from the compiled
extension's instruction-set probe (``gspo_mcore._C.supported_cpu_isas``). bf16 on a CPU without these
instructions is emulated by PyTorch and runs many times slower than fp32 (on an AVX2-only CPU a SmolLM2-135M
forward+backward did not finish in 600 s), so the learner's bf16 option is refused there.
"""

from __future__ import annotations

import functools

BF16_FLAGS = ("amx_bf16", "avx512_bf16")
"""The CPU flags (as ``/proc/cpuinfo`` names them) that mean native bf16 matrix arithmetic."""


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """The flags of the first processor in ``/proc/cpuinfo``; ``None`` where that file cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        return None
    return frozenset()


def native_bf16() -> tuple[str, ...]:
    """The native bf16 features of this CPU (a subset of :data:`BF16_FLAGS`); empty where it has none."""
    flags = cpu_flags()
    if flags is not None:
        return tuple(f for f in BF16_FLAGS if f in flags)
    try:
        from gspo_mcore import _C
    except ImportError:
        return ()
    return ("avx512_bf16",) if "avx512_bf16" in _C.supported_cpu_isas() else ()


__all__ = ["BF16_FLAGS", "cpu_flags", "native_bf16"]
