"""Run the tiny GSPO job (2 gloo ranks) or a worker script in a subprocess, with a timeout; kill one with
SIGKILL (the launcher and every rank, as a machine failure would); read its metrics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import psutil
import pytest

from helpers import ROOT, worker_env
from helpers.launch import run_ranks, torchrun

TINY_CONFIG = os.path.join(ROOT, "examples", "tiny", "config.yaml")
ENV = worker_env()
ENV.pop("GSPO_MCORE_TEST_CRASH_IN_SAVE", None)
STEPS = 6
"""Steps of the tiny job in the checkpoint tests."""
DISTOPT = "optim.use_distributed_optimizer=true"


def tiny_command(data_dir: str, out_dir: str, *overrides: str) -> list[str]:
    return [
        *torchrun(2),
        "-m",
        "gspo_mcore.train",
        "--config",
        TINY_CONFIG,
        f"model.hf_dir={data_dir}/model",
        f"data.paths=[{data_dir}/prompts.jsonl]",
        f"log.output_dir={out_dir}",
        "log.progress_bar=false",
        "log.tensorboard=false",
        *overrides,
    ]


def start_tiny(data_dir: str, out_dir: str, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    """Start the job; its output goes to ``<out_dir>/launch-<n>.log`` (``proc.log_path``)."""
    os.makedirs(out_dir, exist_ok=True)
    log_path = os.path.join(out_dir, f"launch-{time.monotonic_ns()}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            tiny_command(data_dir, out_dir, *overrides),
            cwd=ROOT,
            env=dict(ENV, **(env or {})),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    proc.log_path = log_path
    return proc


def wait(proc: subprocess.Popen, *, timeout: float) -> tuple[int, str]:
    """Wait for ``proc``; returns ``(returncode, output)``. Fails the test (killing it) on timeout."""
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        pytest.fail(f"{proc.args} timed out after {timeout} s\n{_output(proc)[-6000:]}")
    return rc, _output(proc)


def run_tiny(
    data_dir: str, out_dir: str, *overrides: str, env: dict | None = None, timeout: float = 300, check: bool = True
) -> str:
    rc, out = wait(start_tiny(data_dir, out_dir, *overrides, env=env), timeout=timeout)
    if check and rc != 0:
        pytest.fail(f"the tiny job failed (exit {rc})\n{out[-8000:]}")
    return out


def kill_tree(proc: subprocess.Popen) -> list[int]:
    """SIGKILL the launcher and all its descendants (the ranks run in their own sessions)."""
    try:
        parent = psutil.Process(proc.pid)
        victims = parent.children(recursive=True) + [parent]
    except psutil.NoSuchProcess:
        victims = []
    for p in victims:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)
    return [p.pid for p in victims]


def _output(proc: subprocess.Popen) -> str:
    with open(proc.log_path) as f:
        return f.read()


def metrics(out_dir: str) -> list[dict]:
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass
    return rows


def run_worker(script: str, nproc: int, args: list[str], *, timeout: float) -> str:
    """Run ``script`` (a file in tests/checkpoint) on ``nproc`` ranks; returns its combined output."""
    return run_ranks(os.path.join("checkpoint", script), nproc, args, timeout=timeout)
