"""Launch a worker script on 1, 2 or 4 gloo ranks (``torch.distributed.run``), with a timeout; on failure
the child's output is shown."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gspo_mcore.platform.launch import torchrun_prefix as torchrun
from helpers import ROOT, TESTS, worker_env


def run_ranks(script: str, nproc: int, args: list[str], *, timeout: float, env: dict[str, str] | None = None) -> str:
    """Run ``script`` (a path relative to ``tests/``, e.g. ``"learner/grad_worker.py"``, or absolute) on
    ``nproc`` ranks, from the script's folder; returns its combined output. ``env``: extra variables."""
    path = os.path.join(TESTS, script)
    cmd = [sys.executable, path, *args] if nproc == 1 else [*torchrun(nproc), path, *args]
    try:
        proc = subprocess.run(
            cmd,
            cwd=os.path.dirname(path),
            env=worker_env(**(env or {})),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = (exc.stderr or b"").decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        pytest.fail(
            f"{script} on {nproc} rank(s) timed out after {timeout} s\n--- stdout\n{out[-4000:]}\n"
            f"--- stderr\n{err[-8000:]}"
        )
    if proc.returncode != 0:
        pytest.fail(
            f"{script} on {nproc} rank(s) failed (exit {proc.returncode})\n--- stdout\n{proc.stdout[-4000:]}\n"
            f"--- stderr\n{proc.stderr[-8000:]}"
        )
    return proc.stdout + proc.stderr


def prepare_tiny(out, num_prompts: int, *extra: str) -> None:
    """The tiny job's inputs in ``out`` (``python -m examples.tiny.prepare``: model, prompts, held-out set)."""
    subprocess.run(
        [sys.executable, "-m", "examples.tiny.prepare", "--out", str(out), "--num-prompts", str(num_prompts), *extra],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )


def run_tool(args: list[str], *, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``python <args>`` (a tool such as ``tools/bench_engine.py`` and its flags) from the repository root
    with one OpenMP thread and warnings off; returns the finished process (its output captured, not checked)."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
    )
