"""Rank 0's messages about checkpoints, on the logger ``gspo_mcore.learner.checkpoint``.

The messages (saved, resumed, skipped, removed) are part of the run's output: when the application has not
configured logging (the root logger has no handler), they go to stderr as ``[gspo_mcore.checkpoint] ...``;
once it has, they propagate to its handlers like any other record.
"""

from __future__ import annotations

import logging
import sys

from gspo_mcore.learner.checkpoint._dist import rank

logger = logging.getLogger("gspo_mcore.learner.checkpoint")


class _StderrUnlessConfigured(logging.StreamHandler):
    """stderr, only while the root logger has no handler (afterwards the record reaches the root's)."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            self.stream = sys.stderr  # as it is now (a test may have replaced it)
            super().emit(record)


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
