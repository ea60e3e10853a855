"""The checkpoint messages are printed once: by their own stderr handler when nothing is configured, by the
application's handler once ``gspo-train`` (or anyone) has put one on the ``gspo_mcore`` logger or the root."""

from __future__ import annotations

import logging

import pytest

from gspo_mcore.learner.checkpoint import _log


@pytest.fixture
def clean_loggers(monkeypatch):
    """No handler on ``gspo_mcore`` or the root (pytest's own capture handler included), restored after."""
    package = logging.getLogger("gspo_mcore")
    monkeypatch.setattr(package, "handlers", [])
    monkeypatch.setattr(package, "propagate", True)
    monkeypatch.setattr(package, "level", package.level)

    def unconfigure_root():  # pytest adds its handler to the root for each test phase: call in the test body
        monkeypatch.setattr(logging.getLogger(), "handlers", [])

    return unconfigure_root


def test_unconfigured_prints_once_on_stderr(clean_loggers, capsys):
    clean_loggers()
    _log.info("saved step_3 (alone)")
    err = capsys.readouterr().err
    assert err.count("saved step_3 (alone)") == 1 and "[gspo_mcore.checkpoint]" in err


def test_with_gspo_train_logging_prints_once(clean_loggers, capsys):
    from gspo_mcore.train import _log_to_stderr

    clean_loggers()
    _log_to_stderr()  # gspo-train's handler on the gspo_mcore logger (created now: it writes to capsys's stderr)
    _log.info("saved step_4 (configured)")
    err = capsys.readouterr().err
    assert err.count("saved step_4 (configured)") == 1, err
    assert "[gspo_mcore] saved step_4" in err


def test_with_root_logging_prints_once(clean_loggers, capsys):
    import sys

    clean_loggers()
    handler = logging.StreamHandler(sys.stderr)
    logging.getLogger().addHandler(handler)
    try:
        _log.info("saved step_5 (root)")
    finally:
        logging.getLogger().removeHandler(handler)
    assert capsys.readouterr().err.count("saved step_5 (root)") == 1
