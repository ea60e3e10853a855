"""On-policy distillation with the teacher served by real SGLang (``distill.engine: sglang``).

The session's server serves the tiny test checkpoint as the teacher. Its scoring of given token ids
(``/generate`` with ``max_new_tokens`` 0 and ``logprob_start_len``; :meth:`SGLangEngine.score`) must equal the
in-process teacher's forward (:class:`gspo_mcore.learner.teacher.Teacher` on the same folder) within the tier's
``LOGPROB_TOL``; and the tiny distillation job runs end to end with the SGLang teacher, its first step's
``distill_kl`` and gradient norm equal to the same job's with the in-process teacher.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from sglang_cpu import LOGPROB_TOL, PROMPTS, ROOT, learner_env

pytestmark = pytest.mark.sglang

N, NEW = 2, 16


def test_sglang_teacher_logprobs_equal_the_inprocess_teacher(server, learner, figures):
    params = dict(temperature=1.0, max_new_tokens=NEW, ignore_eos=True)
    steps = [
        {"op": "generate", "name": "student", "prompts": PROMPTS, "n": N, "params": params},
        {"op": "teacher_score", "name": "student", "label": "teacher"},
    ]
    report = learner({"hf_dir": server.base_dir, "urls": [server.url], "steps": steps}, what="teacher")
    t = report["teacher"]["teacher"]
    figures("SGLang teacher vs in-process teacher: max |logp diff|", t["max_abs_diff"])
    figures("SGLang teacher vs in-process teacher: mean |logp diff|", t["mean_abs_diff"])
    figures("SGLang teacher: scoring seconds (10 sequences)", t["seconds"])
    # every counted token scored: half the samples count all 16 response tokens, half from the third on
    samples = len(PROMPTS) * N
    assert t["num_samples"] == samples
    assert t["num_tokens"] == samples * NEW - (samples // 2) * 2
    assert t["max_abs_diff"] <= LOGPROB_TOL, t
    assert t["min_logprob"] < -2.0  # a real spread of log-probs, not a flat distribution
    assert t["max_abs_outside_counted"] == 0.0  # nothing is scored before the first counted token


def _distill(tmp_path, tiny, teacher_dir: str, name: str, steps: int, *extra: str) -> list[dict]:
    out = tmp_path / name
    cmd = [
        sys.executable,
        "-m",
        "gspo_mcore.train",
        "--config",
        "examples/tiny/distill.yaml",
        f"steps={steps}",
        f"model.hf_dir={tiny['model_dir']}",
        f"distill.teacher_dir={teacher_dir}",
        f"data.paths=[{tiny['data_path']}]",
        f"log.output_dir={out}",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "batch.num_minibatches=2",
        "log.progress_bar=false",
        "log.tensorboard=false",
        *extra,
    ]
    log_path = tmp_path / f"{name}.log"
    with open(log_path, "wb") as log:  # a file, not a pipe (see conftest.learner)
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=900, env=learner_env())
    text = log_path.read_text(errors="replace")
    assert proc.returncode == 0, text[-8000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_tiny_distillation_with_an_sglang_teacher(server, tmp_path, figures):
    """The tiny distillation job (a fresh random student, in-process rollouts) with the teacher served by the
    session's server, connected by URL: 2 steps end to end. Step 0's rollout is the same as with the in-process
    teacher on the same folder (same seed, same student), so its ``distill_kl`` must agree to the parity level."""
    from examples.tiny.task import prepare

    tiny = prepare(str(tmp_path / "tiny"), num_prompts=32)
    t0 = time.monotonic()
    served = _distill(
        tmp_path, tiny, server.base_dir, "sglang", 2, "distill.engine=sglang", f"distill.sglang.urls=[{server.url}]"
    )
    figures("tiny distillation, 2 steps, SGLang teacher (s)", time.monotonic() - t0)
    assert [r["step"] for r in served] == [0, 1]
    for r in served:
        # a random student and the random teacher disagree: KL(student || teacher) > 0
        assert r["distill_kl"] > 0.1, r
        assert 0 < r["time_teacher_s"] < r["time_step_s"]
        assert 0 < r["teacher_time_fraction"] < 1
    assert not os.path.exists(tmp_path / "sglang" / "sglang_teacher_logs")  # connected, nothing launched
    local = _distill(tmp_path, tiny, server.base_dir, "inprocess", 1)
    gap = abs(served[0]["distill_kl"] - local[0]["distill_kl"])
    figures("tiny distillation step 0: |distill_kl sglang - inprocess|", gap)
    assert served[0]["reward_mean"] == local[0]["reward_mean"]  # the same rollout
    assert gap <= LOGPROB_TOL, (served[0], local[0])
    # distill_kl is a sum over tokens (blind to which token got which teacher log-prob); the gradient is not:
    # each token's advantage multiplies its own score function
    figures("tiny distillation step 0: relative grad_norm gap sglang - inprocess", _rel(served[0], local[0]))
    assert _rel(served[0], local[0]) <= 1e-4, (served[0]["grad_norm"], local[0]["grad_norm"])


def _rel(a: dict, b: dict) -> float:
    return abs(a["grad_norm"] - b["grad_norm"]) / abs(b["grad_norm"])
