"""tools/slurm/gspo_mcore.sbatch without a Slurm cluster: its syntax, the commands it builds for given allocations
(``GSPO_DRY_RUN=1``), its one-line errors for missing variables, and (``distributed``) a real tiny run through it
with stand-in ``srun``/``scontrol`` commands that run each task on this machine. Not tested here: a real
slurmctld/slurmd (see docs/slurm.md)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "slurm" / "gspo_mcore.sbatch"
sys.path.insert(0, str(ROOT / "tests"))


def run(env: dict, cwd=ROOT, timeout=60) -> subprocess.CompletedProcess:
    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run(
        ["bash", str(SCRIPT)], env={**base, **env}, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def slurm(nodes: str, **more) -> dict:
    n = len(nodes.split(","))
    return {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": nodes, "SLURM_JOB_NUM_NODES": str(n), **more}


def test_syntax():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", "-S", "warning", str(SCRIPT)], check=True)


def test_dry_run_splits_the_nodes_between_learner_and_servers():
    env = slurm("n1,n2,n3,n4", GSPO_CONFIG="c.yaml", GSPO_SGLANG_NODES="2", GSPO_SGLANG_MODEL="/m", GSPO_DRY_RUN="1")
    proc = run({**env, "GSPO_OVERRIDES": "steps=5 seed=1", "GSPO_GPUS_PER_NODE": "4", "GSPO_SGLANG_TP": "2"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 3
    for line, node in zip(lines[:2], ("n3", "n4")):
        assert line.startswith(f"srun --nodes=1 --ntasks=1 -w {node} python -m sglang.launch_server --model-path /m")
        assert "--tp-size 2 --host 0.0.0.0 --port 30000" in line
    learner = lines[2]
    assert learner.startswith("srun --nodes=2 --ntasks=2 --ntasks-per-node=1 -w n1\\,n2 ")
    for part in (
        "-m torch.distributed.run --nnodes=2 --nproc_per_node=4",
        "--rdzv-backend=c10d --rdzv-endpoint=n1:29500 --rdzv-id=42",
        "-m gspo_mcore.train --config c.yaml steps=5 seed=1 rollout.sglang.urls=\\[http://n3:30000\\,http://n4:30000\\]",
    ):
        assert part in learner


def test_dry_run_all_learner_nodes_by_default():
    proc = run(slurm("a,b", GSPO_CONFIG="c.yaml", GSPO_DRY_RUN="1", SLURM_GPUS_ON_NODE="8"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == 1 and "--nnodes=2 --nproc_per_node=8" in proc.stdout
    assert "rollout.sglang.urls" not in proc.stdout


@pytest.mark.parametrize(
    "env, message",
    [
        ({}, "SLURM_JOB_ID is not set: submit this script with sbatch"),
        (slurm("n1"), "GSPO_CONFIG is not set"),
        (slurm("n1", GSPO_CONFIG="/no/such.yaml"), "GSPO_CONFIG=/no/such.yaml is not a file"),
        (slurm("n1,n2", GSPO_CONFIG="c", GSPO_DRY_RUN="1", GSPO_SGLANG_NODES="2"), "GSPO_SGLANG_NODES=2 leaves no"),
        (slurm("n1,n2", GSPO_CONFIG="c", GSPO_DRY_RUN="1", GSPO_SGLANG_NODES="1"), "GSPO_SGLANG_MODEL is not set"),
        (slurm("n1", GSPO_CONFIG="c", GSPO_DRY_RUN="1", GSPO_GPUS_PER_NODE="two"), "GSPO_GPUS_PER_NODE=two is not"),
        ({**slurm("n1,n2", GSPO_CONFIG="c", GSPO_DRY_RUN="1"), "SLURM_JOB_NUM_NODES": "3"}, "has 2 node(s)"),
    ],
)
def test_missing_or_bad_variables_are_one_line_errors(env, message):
    proc = run(env)
    assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


FAKE_SRUN = """#!/usr/bin/env bash
# stand-in srun (one node: this machine): drop srun's options, run the task once
while [[ $# -gt 0 && "$1" == -* ]]; do
    case "$1" in -w) shift 2 ;; *) shift ;; esac
done
exec "$@"
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
[[ "$1 $2" == "show hostnames" ]] && tr ',' '\\n' <<<"$3"
"""


@pytest.mark.distributed
def test_a_tiny_run_through_the_script_on_one_node(tmp_path):
    from helpers.launch import prepare_tiny

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    prepare_tiny(tmp_path, 32)
    out = tmp_path / "run"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    overrides = (
        f"steps=2 model.hf_dir={tmp_path}/model data.paths=[{tmp_path}/prompts.jsonl] log.output_dir={out} "
        "rollout.prompts_per_step=4 rollout.group_size=2 log.progress_bar=false"
    )
    env = {
        **slurm("localhost"),
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "GSPO_CONFIG": "examples/tiny/config.yaml",
        "GSPO_GPUS_PER_NODE": "2",
        "GSPO_OVERRIDES": overrides,
        "GSPO_PYTHON": sys.executable,
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
    }
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
