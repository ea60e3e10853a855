"""``kill -9`` of an SGLang server in the middle of a real training run.

The tiny GSPO job (1 rank, ``weight_sync: disk``) launches two real SGLang servers itself (``rollout.sglang.python``
is the tier's SGLang environment), with restarts on (``restart_attempts: 2``, the background monitor every second)
and ``min_servers: 2``, so no step may go on without the killed server once it is being restarted: the step waits for
it, and it must come back with the weights of that step. Once step 0 is logged, a thread of the test sends SIGKILL to
one server's main process. What must hold:

- the run finishes every step;
- the killed server was restarted, and re-admitted only once it served the learner's current weight version (the
  trainer's log lines ``restarting SGLang server <url>`` and ``SGLang server <url> serves weight version N; back in
  rotation`` with N >= 1: a restarted server starts on the base weights, version 0), and it then served ``/generate``
  requests again (its log, appended to by the restarted process);
- every trained sample was sampled by the learner's version of that step: ``staleness_max`` 0 and ``staleness_lag_0``
  1 on every step (the recorded per-sample version equals the learner's), and ``logprob_mismatch`` at the parity
  level (the tokens' SGLang log-probs are the learner's own; a sample from a server on the base weights would be off by
  about a nat, see test_real_gspo_run.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time

import pytest
import yaml
from sglang_cpu import CPU_ARGS, CPU_ENV, LOGPROB_TOL, PYTHON, ROOT

pytestmark = pytest.mark.sglang

STEPS = 4


def _server_pid(log_path: str, stop: threading.Event) -> tuple[int, int]:
    """``(pid, port)`` of the launched server whose log is ``log_path`` (its first line is the launch command)."""
    while not stop.is_set():
        if os.path.exists(log_path):
            head = open(log_path, errors="replace").readline()
            port = re.search(r"--port (\d+)", head)
            if port:
                for pid in filter(str.isdigit, os.listdir("/proc")):
                    try:
                        cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
                    except OSError:
                        continue
                    if (
                        b"sglang.launch_server" in cmd
                        and port.group(1).encode() in cmd
                        and os.getpgid(int(pid)) == int(pid)
                    ):
                        return int(pid), int(port.group(1))
        stop.wait(0.2)
    raise RuntimeError("stopped")


def test_a_server_killed_mid_run_is_restarted_resynced_and_the_run_trains_on_policy(tiny_ckpt, tmp_path, figures):
    from examples.tiny.task import make_rows
    from gspo_mcore.platform.launch import torchrun_prefix

    with open(os.path.join(ROOT, "examples", "tiny", "config.yaml")) as f:
        cfg = yaml.safe_load(f)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in make_rows(64, seed=3)))
    out = tmp_path / "run"
    cfg.update(steps=STEPS)
    cfg["model"] = {"hf_dir": tiny_ckpt, "load_hf_weights": True}
    cfg["data"]["paths"] = [str(data)]
    cfg["log"] = {"output_dir": str(out), "progress_bar": False}
    cfg["rollout"].update(
        prompts_per_step=8, group_size=2, old_logprobs="recompute", max_staleness=0, drop_zero_advantage_groups=False
    )
    cfg["rollout"]["engine"] = "sglang"
    cfg["rollout"]["sglang"] = {
        "num_servers": 2,
        "python": PYTHON,
        "extra_args": list(CPU_ARGS),
        "env": dict(CPU_ENV),
        "colocate": False,
        "weight_sync": "disk",
        "sync_dtype": "float32",
        "bucket_mb": 1,
        "restart_attempts": 2,
        "restart_backoff_s": 1.0,
        "restart_probe_interval_s": 1.0,
        "min_servers": 2,
    }
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))

    killed: dict = {}
    stop = threading.Event()

    def kill_after_step_0() -> None:
        try:
            pid, port = _server_pid(str(out / "sglang_logs" / "sglang-1.log"), stop)
            metrics = out / "metrics.jsonl"
            while not stop.is_set() and not (metrics.exists() and metrics.read_text().strip()):
                stop.wait(0.2)
            if stop.is_set():
                return
            os.kill(pid, signal.SIGKILL)  # the server's main process (its HTTP server); SGLang's children follow
            killed.update(pid=pid, port=port, at=time.monotonic())
        except Exception as e:  # noqa: BLE001 - reported by the test below
            killed["error"] = repr(e)

    killer = threading.Thread(target=kill_after_step_0, daemon=True)
    cmd = [*torchrun_prefix(1), "-m", "gspo_mcore.train", "--config", str(cfg_path)]
    log_path = tmp_path / "train.log"
    t0 = time.monotonic()
    killer.start()
    try:
        with open(log_path, "wb") as log:  # a file, not a pipe (see conftest.learner)
            proc = subprocess.run(
                cmd,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=1500,
                env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
            )
    finally:
        stop.set()
        killer.join(10)
    text = log_path.read_text(errors="replace")
    server_log = (out / "sglang_logs" / "sglang-1.log").read_text(errors="replace")
    assert proc.returncode == 0, f"{text[-8000:]}\n--- killed server's log\n{server_log[-4000:]}"
    figures(f"kill -9 run: {STEPS} steps, 2 launched servers, 1 killed (s)", time.monotonic() - t0)
    assert "pid" in killed, f"the server was not killed: {killed}\n{text[-4000:]}"
    url = f"http://127.0.0.1:{killed['port']}"

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    for r in rows:
        assert r["staleness_max"] == 0 and r["staleness_lag_0"] == 1.0, r
        figures("kill -9 run: logprob_mismatch, worst step", r["logprob_mismatch"])
        assert r["logprob_mismatch"] < LOGPROB_TOL, (r["step"], r["logprob_mismatch"])

    assert f"restarting SGLang server {url}" in text, text[-4000:]
    back = [int(v) for v in re.findall(rf"SGLang server {re.escape(url)} serves weight version (\d+); back", text)]
    assert back and back[-1] >= 1, f"{url} was not re-admitted on the current weights\n{text[-4000:]}"
    # the restarted process (the log's last launch line) served generations again
    after_restart = server_log.rsplit("# sglang-1:", 1)[1]
    assert "POST /generate" in after_restart, after_restart[-3000:]
