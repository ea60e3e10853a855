"""Test support shared by the test folders (not shipped): the toy learner models and batch, the launchers of
multi-rank worker scripts, the case loop the workers share, and the 2-rank gloo helpers of the ops tests.

Importable as ``helpers`` because ``[tool.pytest.ini_options] pythonpath`` puts ``tests/`` (and the
repository root, for ``examples``) on ``sys.path``; worker scripts started in a subprocess get the same two
folders through ``PYTHONPATH`` (:func:`worker_env`), so no test file edits ``sys.path``.
"""

from __future__ import annotations

import os

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The ``tests/`` folder."""
ROOT = os.path.dirname(TESTS)
"""The repository root."""


def worker_env(**extra: str) -> dict[str, str]:
    """The environment of a spawned worker or job: this process's, one thread per rank, warnings off, and
    ``PYTHONPATH`` led by ``tests/`` (``import helpers``) and the repository root (``gspo_mcore`` and
    ``examples`` of this tree); ``extra`` overrides."""
    path = [TESTS, ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=os.pathsep.join(path), **extra)
