"""On-policy distillation through the real training loop: the tiny job with examples/tiny/distill.yaml and a
real (random-weight) teacher of another size, 2 steps on 1 CPU rank; the distillation metrics are logged."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT, worker_env
from helpers.distill_models import write_teacher


@pytest.mark.distributed
def test_tiny_distillation_runs_and_logs_the_teacher_metrics(tmp_path):
    from examples.tiny.task import prepare

    tiny = prepare(str(tmp_path), num_prompts=32)
    teacher = write_teacher(str(tmp_path / "teacher"), seed=1, num_hidden_layers=3)  # deeper than the student
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "gspo_mcore.train",
        "--config",
        "examples/tiny/distill.yaml",
        "steps=2",
        f"model.hf_dir={tiny['model_dir']}",
        f"distill.teacher_dir={teacher}",
        f"data.paths=[{tiny['data_path']}]",
        f"log.output_dir={out}",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "batch.num_minibatches=2",
        "log.progress_bar=false",
        "log.tensorboard=false",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=worker_env())
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        # a random teacher and a random student disagree: KL(student || teacher) > 0 (measured 3.0 and 2.8 nats/token)
        assert r["distill_kl"] > 0.1
        assert 0 < r["time_teacher_s"] < r["time_step_s"]
        assert 0 < r["teacher_time_fraction"] < 1
    assert os.path.exists(out / "config.yaml")
