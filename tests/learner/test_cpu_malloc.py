"""glibc's allocator tuned by the learner's CPU set-up (:mod:`gspo_mcore.platform.cpu_malloc`): a large tensor
freed and allocated again reuses the heap instead of a fresh ``mmap``. Each case runs in a fresh interpreter (the
setting is process-wide and cannot be undone)."""

from __future__ import annotations

import platform

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only"
)

PROBE = r"""
import ctypes, json, resource, sys
import torch
from gspo_mcore.platform import cpu_malloc

class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2
applied = cpu_malloc.keep_freed_memory()
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, (ctypes.c_void_p,)
block = libc.malloc(64 << 20)  # at the top of the heap: nothing allocated after it
ctypes.memset(block, 1, 64 << 20)
grown = libc.mallinfo2().arena
libc.free(block)
kept = libc.mallinfo2().arena - grown  # 0 if the freed top stayed mapped, -64 MiB if it was trimmed back
x = torch.empty(64 << 20, dtype=torch.uint8)  # 64 MiB: above any mmap threshold glibc would pick
mapped = libc.mallinfo2().hblkhd  # bytes in mmap'd blocks
x.fill_(0)  # its pages faulted in
del x
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
y = torch.empty(32 << 20, dtype=torch.uint8).fill_(1)  # fits where x was
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults  # its pages reused, or faulted in afresh
print(json.dumps({"applied": applied, "mapped": mapped, "heap": libc.mallinfo2().arena, "kept": kept,
                  "faults": faults}))
"""


def _probe(env_value: str | None) -> dict:
    from helpers.probe import probe

    return probe(PROBE, "GSPO_KEEP_FREED_MEMORY", env_value)


def test_large_tensors_come_from_the_heap_once_tuned():
    got = _probe(None)
    assert got["applied"] is True
    assert got["mapped"] < (64 << 20), got  # not a fresh mapping
    assert got["heap"] >= (64 << 20), got
    assert got["kept"] > -(1 << 20), got  # a freed block at the heap's top stayed mapped, not trimmed back
    assert got["faults"] < 1000, got  # so the next block reuses its pages (8,192 faults if they were returned)


def test_the_trim_threshold_fits_mallopts_int():
    from gspo_mcore.platform import cpu_malloc

    assert 64 << 20 < cpu_malloc.TRIM_THRESHOLD < 2**31  # a larger value is cut short by the C int


def test_the_environment_can_leave_the_allocator_alone():
    got = _probe("0")
    assert got["applied"] is False
    assert got["mapped"] >= (64 << 20), got  # glibc's default: a 64 MiB block is its own mapping
    assert got["faults"] > 1000, got  # ... mapped afresh each time, its pages faulted in again
