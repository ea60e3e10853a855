"""The real-SGLang integration tier: fixtures, the ``sglang`` marker, and the measured figures' summary.

The tier needs SGLang 0.5.23 in its own virtual environment (``.venv-sglang``; ``make test-sglang`` creates
it with ``setup_sglang_env.sh``). Without that environment every ``sglang``-marked test is skipped at
collection, at once (plain ``make test`` on a fresh clone). ``GSPO_SGLANG_TESTS=1`` (set by ``make
test-sglang``) turns that skip into a failure, so the tier cannot pass by skipping; ``GSPO_SGLANG_TESTS=0``
skips it even where the environment exists.

One server (launched by the project's own launcher, :mod:`gspo_mcore.rollout.sglang_server`, on loopback)
serves the whole session; tests that change its weights put the test checkpoint back before they start
(:meth:`Server.ensure_base`).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest
from sglang_cpu import HERE, ROOT, launch, learner_env, server_config, sglang_missing, write_tiny_checkpoint

_MODE = os.environ.get("GSPO_SGLANG_TESTS", "")


def pytest_configure(config):
    config.addinivalue_line("markers", "sglang: needs a real SGLang server (.venv-sglang; run with make test-sglang)")
    config._sglang_figures = {}


def pytest_collection_modifyitems(config, items):
    marked = [it for it in items if it.get_closest_marker("sglang")]
    if not marked:
        return
    if _MODE == "0":
        reason = "GSPO_SGLANG_TESTS=0"
    else:
        reason = sglang_missing()
        if reason and _MODE == "1":
            raise pytest.UsageError(f"GSPO_SGLANG_TESTS=1 but the SGLang tier cannot run: {reason}")
    if reason:
        skip = pytest.mark.skip(reason=f"real-SGLang tier: {reason}")
        for it in marked:
            it.add_marker(skip)


# ------------------------------------------------------------------------------------------ figures
@pytest.fixture
def figures(request):
    """``record(key, value)``: a measured figure (seconds, log-prob differences) for the closing summary."""
    store = request.config._sglang_figures

    def record(key: str, value: float, worst=max):
        store[key] = worst(store[key], float(value)) if key in store else float(value)

    return record


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    store = getattr(config, "_sglang_figures", {})
    if not store:
        return
    terminalreporter.section("real-SGLang tier: measured figures")
    for key in sorted(store):
        terminalreporter.write_line(f"{key:<64} {store[key]:>12.4g}")


# ------------------------------------------------------------------------------------- checkpoint, server
@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> str:
    """The tiny random Qwen3 checkpoint (with its character tokenizer) every test starts from."""
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("sglang_ckpt") / "base"))


class Server:
    """A launched SGLang server: ``url``, ``proc`` (:class:`ManagedProcess`) and the weights it holds."""

    def __init__(self, proc, base_dir: str, start_s: float):
        self.proc, self.url, self.base_dir, self.start_s = proc, proc.url, base_dir, start_s
        self.holds_base = True

    def engine(self, **config):
        from gspo_mcore.rollout import SGLangClientConfig, SGLangEngine

        return SGLangEngine([self.url], config=SGLangClientConfig(**config))

    def ensure_base(self) -> None:
        """Put the test checkpoint (weight version 0) back if an earlier test changed the weights."""
        if self.holds_base:
            return

        async def reload():
            async with self.engine() as eng:
                await eng.update_weights_from_disk(self.base_dir, 0)

        asyncio.run(reload())
        self.holds_base = True

    def log_tail(self, lines: int = 60) -> str:
        return self.proc.log_tail(lines)


@pytest.fixture(scope="session")
def sglang_server(tiny_ckpt, tmp_path_factory, request):
    """One real SGLang server on the tiny checkpoint for the whole session (stopped at the end)."""
    log_dir = str(tmp_path_factory.mktemp("sglang_logs"))
    procs, seconds = launch([server_config(tiny_ckpt, log_dir)], log_dir)
    request.config._sglang_figures["server start to healthy (s)"] = seconds
    server = Server(procs[0], tiny_ckpt, seconds)
    yield server
    server.proc.shutdown()


@pytest.fixture
def server(sglang_server):
    """The session's server, holding the test checkpoint's weights (version 0)."""
    sglang_server.ensure_base()
    return sglang_server


# ---------------------------------------------------------------------------------------- the learner
@pytest.fixture
def learner(tmp_path, sglang_server, figures):
    """``run(spec) -> report``: run ``learner_worker.py`` (the Megatron learner on 1 gloo rank, main venv)."""

    def run(spec: dict, *, timeout: float = 900.0, what: str = "learner") -> dict:
        spec_path, out_path = tmp_path / f"{what}.spec.json", tmp_path / f"{what}.report.json"
        spec_path.write_text(json.dumps(spec))
        env = learner_env()
        cmd = [sys.executable, os.path.join(HERE, "learner_worker.py"), str(spec_path), str(out_path)]
        log_path = tmp_path / f"{what}.log"
        t0 = time.monotonic()
        # Output to a file, not a pipe: the tensor sync starts torch's shared-memory manager daemon, which
        # inherits the worker's stdout/stderr and outlives it (until the server exits).
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                pytest.fail(
                    f"{what}: learner_worker timed out after {timeout} s\n--- output\n"
                    f"{_tail(log_path, 8000)}\n--- server log\n{sglang_server.log_tail()}"
                )
        if code != 0:
            pytest.fail(
                f"{what}: learner_worker failed (exit {code})\n--- output\n{_tail(log_path, 8000)}\n"
                f"--- server log\n{sglang_server.log_tail()}"
            )
        figures(f"learner worker wall time, {what} (s)", time.monotonic() - t0)
        return json.loads(out_path.read_text())

    return run


def _tail(path, chars: int) -> str:
    return path.read_text(errors="replace")[-chars:]
