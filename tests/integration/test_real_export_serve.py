"""Train -> export -> serve: a real SGLang server started on a folder exported from a real training checkpoint
gives the learner's log-probs at that step.

1. The tiny GSPO job (2 gloo ranks, in-process engine) trains 2 steps from the tier's test checkpoint
   (``model.load_hf_weights``) and saves a checkpoint after each (the trainer's ``Checkpointer``).
2. ``tools/convert_mcore_to_hf.py --run <run folder>`` exports its newest valid checkpoint (step 1).
3. A second SGLang server is launched on the exported folder (``--dtype float32``, the tier's CPU flags).
4. The learner (``learner_worker.py``, 1 rank) loads that checkpoint through the trainer's loader, samples
   through the new server (temperature 1) and scores the samples: every response token's log-prob must equal
   SGLang's within ``LOGPROB_TOL`` (the tier's parity bound, see sglang_cpu.py). Negative control: the same
   samples scored by the starting weights are far off (the run changed the model, and the server serves the
   trained one, not the base it was started from).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml
from sglang_cpu import LOGPROB_TOL, PROMPTS, ROOT, get_json, launch, server_config

pytestmark = pytest.mark.sglang

PARAMS = dict(temperature=1.0, max_new_tokens=24, ignore_eos=True)


def _train(base_dir: str, tmp_path) -> str:
    from examples.tiny.task import make_rows
    from gspo_mcore.platform.launch import torchrun_prefix

    with open(os.path.join(ROOT, "examples", "tiny", "config.yaml")) as f:
        cfg = yaml.safe_load(f)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in make_rows(64, seed=3)))
    run_dir = tmp_path / "run"
    cfg.update(steps=2)
    cfg["model"] = {"hf_dir": base_dir, "load_hf_weights": True}
    cfg["data"]["paths"] = [str(data)]
    cfg["log"] = {"output_dir": str(run_dir), "progress_bar": False, "tensorboard": False}
    cfg["rollout"].update(prompts_per_step=8, group_size=4, drop_zero_advantage_groups=False)
    cfg["checkpoint"] = {"save_every": 1}
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    log = tmp_path / "train.log"
    with open(log, "wb") as f:
        proc = subprocess.run(
            [*torchrun_prefix(2), "-m", "gspo_mcore.train", "--config", str(cfg_path)],
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=900,
            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
        )
    assert proc.returncode == 0, log.read_text(errors="replace")[-8000:]
    return str(run_dir)


def test_server_on_an_exported_training_checkpoint_gives_the_learners_logprobs(
    sglang_server, learner, tmp_path, figures
):
    run_dir = _train(sglang_server.base_dir, tmp_path)
    exported = str(tmp_path / "exported")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "convert_mcore_to_hf.py"), "--run", run_dir, "--out", exported],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-8000:]
    step_dir = os.path.join(run_dir, "checkpoints", "step_1")
    assert json.loads(open(os.path.join(exported, "gspo_mcore_export.json")).read())["checkpoint"] == step_dir

    log_dir = str(tmp_path / "server_logs")
    os.makedirs(log_dir)
    procs, seconds = launch([server_config(exported, log_dir)], log_dir)
    figures("server on the exported folder: start to healthy (s)", seconds)
    server = procs[0]
    try:
        assert get_json(server.url + "/model_info").get("model_path", exported) == exported
        report = learner(
            {
                "hf_dir": sglang_server.base_dir,
                "urls": [server.url],
                "steps": [
                    {"op": "snapshot", "name": "base"},
                    {"op": "load_checkpoint", "path": step_dir},
                    {"op": "generate", "name": "t1", "prompts": PROMPTS, "n": 2, "params": PARAMS},
                    {"op": "score", "name": "t1"},
                    {"op": "restore", "name": "base"},
                    {"op": "score", "name": "t1", "label": "base weights"},
                ],
            },
            what="export-serve",
        )
    finally:
        server.shutdown()
    assert report["loaded"] == [{"path": step_dir, "step": 1}]
    score, control = report["score"]["t1"], report["score"]["base weights"]
    figures("exported server vs learner at step 1: max |logp diff|", score["max_abs_diff"])
    figures("exported server vs base weights (control): max |logp diff|", control["max_abs_diff"])
    assert score["num_tokens"] == len(PROMPTS) * 2 * PARAMS["max_new_tokens"]
    assert score["max_abs_diff"] <= LOGPROB_TOL, score["max_abs_diff"]
    assert control["max_abs_diff"] > 100 * LOGPROB_TOL, control["max_abs_diff"]
