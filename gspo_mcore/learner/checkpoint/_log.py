"""Rank 0's messages about checkpoints, on the logger ``gspo_mcore.learner.checkpoint``.

The messages (saved, resumed, skipped, removed) are part of the run's output: when the application has not
configured logging (no logger between this one and the root has a handler), they go to stderr as
``[gspo_mcore.checkpoint] ...``; once it has (the root's handlers, or ``gspo-train``'s on ``gspo_mcore``),
they propagate to those handlers like any other record, and are printed once.
"""

from __future__ import annotations

import logging
import sys

from gspo_mcore.learner.checkpoint._dist import rank

logger = logging.getLogger("gspo_mcore.learner.checkpoint")


class _StderrUnlessConfigured(logging.StreamHandler):
    """stderr, only while no ancestor logger the record propagates to has a handler (afterwards the record
    reaches that one's)."""

    def emit(self, record: logging.LogRecord) -> None:
        if not _configured_above(logger):
            self.stream = sys.stderr  # as it is now (a test may have replaced it)
            super().emit(record)


def _configured_above(log: logging.Logger) -> bool:
    """Whether a record of ``log`` propagates to a logger with a handler of its own (root included)."""
    while log.propagate and log.parent is not None:
        log = log.parent
        if log.handlers:
            return True
    return False


if not any(isinstance(h, _StderrUnlessConfigured) for h in logger.handlers):
    _handler = _StderrUnlessConfigured()
    _handler.setFormatter(logging.Formatter("[gspo_mcore.checkpoint] %(message)s"))
    logger.addHandler(_handler)
if logger.level == logging.NOTSET:
    logger.setLevel(logging.INFO)


def info(message: str) -> None:
    """Log ``message`` on rank 0 (other ranks stay silent: every rank runs the same checkpoint code)."""
    if rank() == 0:
        logger.info(message)


def warning(message: str) -> None:
    if rank() == 0:
        logger.warning(message)
