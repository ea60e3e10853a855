"""The Learner's public verbs (``logprobs``, ``train``, ``export_weights``, ``save`` / ``load``) on one rank, against
the functions underneath (see learner_api_worker.py for what is checked)."""

from __future__ import annotations

import pytest
from helpers.launch import run_ranks

pytestmark = pytest.mark.distributed


def test_learner_verbs(tmp_path):
    out = run_ranks("learner/learner_api_worker.py", 1, ["--out", str(tmp_path / "ckpt")], timeout=600)
    assert "LEARNER_API_OK" in out
