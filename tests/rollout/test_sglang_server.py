"""Launching servers as subprocesses: health wait, fail-fast with the log tail, shutdown.

The launched program is the stand-in (sglang_standin.py, NOT SGLang), started the way SGLang would be
(``python -m MODULE --model-path ... --host ... --port ... --weight-version ...``).
"""

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest
from sglang_standin import expected_response

from gspo_mcore.rollout import SamplingParams, SGLangClientConfig, SGLangEngine
from gspo_mcore.rollout.sglang_server import (
    RouterConfig,
    ServerLaunchError,
    SGLangServerConfig,
    SGLangServers,
    launch_servers,
    start_server,
)

HERE = str(Path(__file__).parent)
STANDIN = dict(module="sglang_standin", env={"PYTHONPATH": HERE}, startup_timeout_s=20.0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_command_line():
    cfg = SGLangServerConfig(
        model_path="/m",
        port=31000,
        tp_size=2,
        gpu_ids=(2, 3),
        weight_version=4,
        extra_args=("--mem-fraction-static", "0.7"),
    )
    assert cfg.command(31000) == [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/m",
        "--host",
        "127.0.0.1",
        "--port",
        "31000",
        "--weight-version",
        "4",
        "--tp-size",
        "2",
        "--mem-fraction-static",
        "0.7",
    ]
    router = RouterConfig(policy="round_robin")
    assert router.command(32000, ["http://a:1", "http://b:2"])[2:] == [
        "sglang_router.launch_router",
        "--worker-urls",
        "http://a:1",
        "http://b:2",
        "--host",
        "127.0.0.1",
        "--port",
        "32000",
        "--policy",
        "round_robin",
    ]


def test_config_validation():
    with pytest.raises(ValueError, match="gpu_ids"):
        SGLangServerConfig(model_path="/m", tp_size=2, gpu_ids=(0,))
    with pytest.raises(ValueError, match="SGLANG_RETURN_ORIGINAL_LOGPROB"):
        SGLangServerConfig(model_path="/m", env={"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"})
    servers = SGLangServers(num_servers=2, server_tp_size=2, gpu_offset=4, extra_args=["--x"], python="/py")
    cfgs = servers.launch_configs("/m", gpus=True)
    assert [c.gpu_ids for c in cfgs] == [(4, 5), (6, 7)] and {c.tp_size for c in cfgs} == {2}
    assert {(c.model_path, c.extra_args, c.python) for c in cfgs} == {("/m", ("--x",), "/py")}
    assert [c.gpu_ids for c in servers.launch_configs("/m", gpus=False)] == [None, None]
    assert SGLangServers().launch_configs("/m", gpus=False)[0].python == SGLangServerConfig(model_path="/m").python
    for bad, match in (
        ({"num_servers": 0}, "num_servers must be an integer >= 1"),
        ({"server_tp_size": True}, "server_tp_size must be an integer >= 1"),
        ({"gpu_offset": -1}, "gpu_offset must be an integer >= 0"),
        ({"urls": ["127.0.0.1:1"]}, "is not an http:// URL"),
    ):
        with pytest.raises(ValueError, match=match):
            SGLangServers(**bad)


def test_launch_generate_and_shut_down(tmp_path):
    cfgs = [SGLangServerConfig(model_path="/tiny", gpu_ids=(i,), weight_version=3, **STANDIN) for i in range(2)]
    eng = SGLangEngine.launch(cfgs, log_dir=str(tmp_path))
    pids = [p.popen.pid for p in eng._processes]
    try:
        assert eng.weight_version == 3
        out = asyncio.run(eng.generate([[1, 2], [3]], 2, SamplingParams(max_new_tokens=3)))
        for prompt, group in zip([[1, 2], [3]], out):
            for j, s in enumerate(group):
                assert list(s.response_ids) == expected_response(prompt, j, 3)[0] and s.weight_version == 3
        logs = sorted(p.name for p in tmp_path.iterdir())
        assert logs == ["sglang-0.log", "sglang-1.log"]
        text = (tmp_path / "sglang-1.log").read_text()
        assert "CUDA_VISIBLE_DEVICES=1" in text and "--weight-version 3" in text
    finally:
        asyncio.run(eng.close())
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids)


def test_launch_with_router(tmp_path):
    router = RouterConfig(module="sglang_standin", env={"PYTHONPATH": HERE}, startup_timeout_s=20.0)
    eng = SGLangEngine.launch(
        [SGLangServerConfig(model_path="/tiny", **STANDIN)],
        router=router,
        config=SGLangClientConfig(request_timeout_s=10),
        log_dir=str(tmp_path),
    )
    try:
        assert eng.router_url and eng.router_url not in eng.worker_urls
        out = asyncio.run(eng.generate([[5, 6]], 1, SamplingParams(max_new_tokens=2)))
        assert list(out[0][0].response_ids) == expected_response([5, 6], 0, 2)[0]
        assert "--worker-urls " + eng.worker_urls[0] in (tmp_path / "sglang-router.log").read_text()
    finally:
        asyncio.run(eng.close())


def test_process_exiting_at_start_fails_fast_with_log_tail(tmp_path):
    cfg = SGLangServerConfig(model_path="EXIT_AT_START", **STANDIN)
    t0 = time.monotonic()
    with pytest.raises(ServerLaunchError) as e:
        launch_servers([cfg], log_dir=tmp_path)
    assert time.monotonic() - t0 < 15
    msg = str(e.value)
    assert "exited with code 3 before becoming healthy" in msg and "told to exit at start-up" in msg
    assert "sglang-0.log" in msg


def test_never_healthy_times_out_and_is_killed(tmp_path):
    cfg = SGLangServerConfig(model_path="NEVER_HEALTHY", **{**STANDIN, "startup_timeout_s": 1.5})
    proc = start_server(cfg, log_dir=tmp_path)
    # the 1.5 s start only once the stand-in answers (its start-up alone can take longer on a loaded machine,
    # and then the last answer would be "connection refused" instead of the 503 this test is about)
    deadline = time.monotonic() + 120
    while "stand-in serving" not in Path(proc.log_path).read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(ServerLaunchError, match=r"not healthy after 1.5s \(/health_generate: HTTP 503\)"):
        proc.wait_healthy(cfg.startup_timeout_s, poll_s=0.1)
    assert proc.popen.poll() is not None


def test_failed_launch_stops_the_servers_already_started(tmp_path):
    good = SGLangServerConfig(model_path="/tiny", **STANDIN)
    bad = SGLangServerConfig(model_path="EXIT_AT_START", **STANDIN)
    before = set(_children())
    with pytest.raises(ServerLaunchError):
        launch_servers([good, bad], log_dir=tmp_path)
    time.sleep(0.2)
    assert not (set(_children()) - before)


def _children() -> list[int]:
    """Live (non-zombie) child processes of this test process."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            out.append(int(d.name))
    return out
