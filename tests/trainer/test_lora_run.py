"""The tiny job with LoRA through the real loop (gspo_mcore.learner.lora, issue 39), on 2 ranks at TP2, with the
KL reference (its weight swap covers the adapters) and a checkpoint every step: a run stopped after 2 steps and
resumed to 3 gives the uninterrupted run's step 2 (the checkpoint holds the adapters and their optimizer state),
the converter writes merged weights (a frozen tensor unchanged between steps 0 and 2, every adapted projection
moved, no adapter tensor in the folder), and a full fine-tuning run may not resume from the LoRA checkpoint
(refused at start-up, naming the keys)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT
from helpers.launch import prepare_tiny, torchrun
from safetensors.torch import load_file

pytestmark = pytest.mark.distributed


def _run(tmp_path, out, *extra, nproc=2):
    cmd = [
        *(torchrun(nproc) if nproc > 1 else [sys.executable]),
        "-m",
        "gspo_mcore.train",
        "--config",
        "examples/tiny/config.yaml",
        f"model.hf_dir={tmp_path}/model",
        f"data.paths=[{tmp_path}/prompts.jsonl]",
        f"log.output_dir={out}",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "log.progress_bar=false",
        "checkpoint.save_every=1",
        "loss.kl_coef=0.01",
        *extra,
    ]
    return subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1")
    )


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_tiny_job_with_lora_resumes_exactly_and_refuses_a_full_resume(tmp_path):
    prepare_tiny(tmp_path, 32)
    lora = ["parallel.tensor=2", "lora.rank=4", "lora.alpha=8"]
    straight = _run(tmp_path, tmp_path / "a", "steps=3", "checkpoint.keep_last=3", *lora)
    assert straight.returncode == 0, straight.stderr[-6000:]
    first = _run(tmp_path, tmp_path / "b", "steps=2", *lora)
    assert first.returncode == 0, first.stderr[-6000:]
    resumed = _run(tmp_path, tmp_path / "b", "steps=3", "checkpoint.resume=true", *lora)
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    a, b = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert [r["step"] for r in a] == [0, 1, 2] and [r["step"] for r in b] == [0, 1, 2]
    for key in ("reward_mean", "loss", "grad_norm", "kl"):
        if key in a[2]:
            assert b[2][key] == pytest.approx(a[2][key], rel=1e-6, abs=1e-9), key
    assert any(r.get("grad_norm", 0) > 0 for r in a), "no update happened: the test would prove nothing"

    # the converter writes merged weights: a frozen tensor is the same at every step, an adapted one moved
    exported = {}
    for step in (0, 2):
        out = tmp_path / f"export{step}"
        proc = subprocess.run(
            [sys.executable, "tools/convert_mcore_to_hf.py", "--mcore", f"{tmp_path}/a/checkpoints/step_{step}"]
            + ["--out", str(out)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        exported[step] = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert set(exported[0]) == set(exported[2]) and not any("lora" in k for k in exported[0])
    for name, before in exported[0].items():
        same = bool((before == exported[2][name]).all())
        adapted = name.endswith(("_proj.weight",))
        assert same != adapted, (name, "adapted" if adapted else "frozen", "unchanged" if same else "changed")

    full = _run(tmp_path, tmp_path / "b", "steps=4", "checkpoint.resume=true", nproc=1)
    assert full.returncode != 0
    assert "was written by a LoRA (lora.rank=4" in full.stdout + full.stderr
    assert "this run is full fine-tuning (lora.rank=0)" in full.stdout + full.stderr
