"""A run that fails during set-up, after its rollout backend exists (a launched SGLang server, a teacher), still
closes it: nothing is left running."""

import os
import subprocess

from helpers import ROOT, TESTS
from helpers.launch import prepare_tiny, torchrun


def test_backend_is_closed_when_setup_fails_after_it_is_built(tmp_path):
    prepare_tiny(tmp_path, 16)
    cmd = [
        *torchrun(1),
        os.path.join(TESTS, "trainer", "cleanup_worker.py"),
        "--config",
        "examples/tiny/config.yaml",
        "steps=1",
        f"model.hf_dir={tmp_path}/model",
        f"data.paths=[{tmp_path}/prompts.jsonl]",
        f"log.output_dir={tmp_path}/run",
        "log.progress_bar=false",
    ]
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)  # the examples package
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "backend closed 1 time(s)" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
