"""Adapt megatron-core's ``dist_checkpointing`` writer to synchronous saves (on every host, GPU or CPU).

megatron-core's ``FileSystemWriterAsync`` hands its write results back through a module-level queue,
``filesystem_async._results_queue``, created on first use by a ``multiprocessing.Manager`` started with
``spawn``: 3-12 s, and a re-import of the main module. A synchronous save runs the writer in this process,
so a plain ``queue.Queue`` is enough: :func:`in_process_write_results` puts one in place for the duration
of a save and restores the previous value afterwards.

Checked on megatron-core :data:`CHECKED_VERSIONS`. A version without the attribute gets nothing patched
(the save then works as megatron wrote it, only slower).
"""

from __future__ import annotations

import contextlib
import queue

CHECKED_VERSIONS = ("0.16.1",)
"""megatron-core versions this adapter was checked on."""


@contextlib.contextmanager
def in_process_write_results():
    """Within the block, megatron's checkpoint writer collects its results in an in-process queue."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_results_queue"):
        yield
        return
    before = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = before
