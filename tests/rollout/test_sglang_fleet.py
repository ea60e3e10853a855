"""The SGLang engine's fleet upkeep: weight versions checked before every generation, returning servers re-synced
before they serve, launched servers restarted when their process dies. Real sockets and real processes: in-process
stand-ins and stand-in server processes (sglang_standin.py; NOT SGLang) launched by the project's launcher."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import time
import urllib.request

import pytest
import torch

from gspo_mcore.rollout import (
    RolloutError,
    SamplingParams,
    SGLangClientConfig,
    SGLangEngine,
    SGLangServers,
    WeightUpdateError,
)
from gspo_mcore.rollout import sglang_api as api
from gspo_mcore.rollout.sglang_server import RestartPolicy, SGLangServerConfig

HERE = os.path.dirname(os.path.abspath(__file__))
FAST = dict(request_timeout_s=5.0, connect_timeout_s=2.0, control_timeout_s=5.0, probe_timeout_s=2.0)
PARAMS = SamplingParams(max_new_tokens=3)
PROMPTS = [[i + 1, 7] for i in range(8)]


def generate(engine):
    out = asyncio.run(engine.generate(PROMPTS, 2, PARAMS))
    assert [len(g) for g in out] == [2] * len(PROMPTS)
    return out


def served(server) -> int:
    return sum(p == api.GENERATE for p, _ in server.calls)


def test_a_server_on_other_weights_is_not_used_until_the_next_sync(standins, file_system_sharing):
    a, b = standins(), standins()
    engine = SGLangEngine([a.url, b.url], config=SGLangClientConfig(**FAST))
    bucket = [("w", torch.zeros(2))]
    asyncio.run(engine.update_weights([bucket], 3))
    b.weight_version = "default"  # restarted from outside on the base weights
    before = served(b)
    out = generate(engine)
    assert served(b) == before, "a server on stale weights was sent requests"
    assert {s.weight_version for g in out for s in g} == {3}
    assert "serves weight version 0, not 3" in engine._down[b.url]
    asyncio.run(engine.update_weights([bucket], 4))  # the next sync reaches it (it answers), then it is checked
    assert b.weight_version == "4"
    generate(engine)
    assert served(b) > before and engine._down == {}


def test_a_returning_server_reloads_the_last_disk_sync_before_it_serves(standins, tmp_path):
    a, b = standins(), standins()
    engine = SGLangEngine([a.url, b.url], config=SGLangClientConfig(**FAST))
    asyncio.run(engine.update_weights_from_disk(str(tmp_path), 5))
    b.weight_version = "2"
    generate(engine)
    disk = [body for p, body in b.calls if p == api.UPDATE_FROM_DISK]
    assert [d["weight_version"] for d in disk] == ["5", "5"]  # the sync, then the re-sync of b alone
    assert b.weight_version == "5" and served(b) > 0 and engine._down == {}


def test_a_server_that_misses_a_sync_is_left_out_then_caught_up(standins, tmp_path):
    a, b = standins(), standins()
    engine = SGLangEngine([a.url, b.url], config=SGLangClientConfig(**FAST))
    b.misbehave = "die"  # its next /generate: the connection drops and it stops listening
    generate(engine)
    assert b.url in engine.control.excluded
    asyncio.run(engine.update_weights_from_disk(str(tmp_path), 1))  # goes to a only; b is unreachable
    assert a.weight_version == "1" and b.weight_version == "0"


def test_a_worker_lost_before_a_tensor_update_is_dropped_from_it_while_any_remains(standins, file_system_sharing):
    a, b, c = standins(), standins(), standins()
    engine = SGLangEngine(
        [a.url, b.url, c.url], config=SGLangClientConfig(**FAST), restart=RestartPolicy(min_servers=2)
    )
    bucket = [("w", torch.zeros(2))]
    asyncio.run(engine.update_weights([bucket], 3))  # /server_info is read (and kept) while all three answer
    c.stop()  # refuses connections from now on
    asyncio.run(engine.update_weights([bucket], 4))  # pause, flush, session, update, continue go to a and b
    assert a.weight_version == b.weight_version == "4" and engine.control.version == 4
    assert c.url in engine.control.excluded and "lost during a weight update" in engine._down[c.url]
    b.stop()  # one worker left, below min_servers: the update still goes on (min_servers is checked when serving)
    asyncio.run(engine.update_weights([bucket], 5))
    assert a.weight_version == "5" and b.url in engine.control.excluded
    a.stop()  # no worker left: the update fails, as before
    with pytest.raises(WeightUpdateError, match=rf"{a.url}/pause_generation failed"):
        asyncio.run(engine.update_weights([bucket], 6))


def launch(n, tmp_path, **restart):
    cfg = SGLangServerConfig(
        model_path="stand-in", module="sglang_standin", env={"PYTHONPATH": HERE}, startup_timeout_s=20.0
    )
    return SGLangEngine.launch(
        [cfg] * n,
        config=SGLangClientConfig(**FAST),
        log_dir=str(tmp_path),
        restart=RestartPolicy(**{"attempts": 2, "backoff_s": 0.05, **restart}),
    )


def model_info_version(url):
    with urllib.request.urlopen(url + api.MODEL_INFO, timeout=5) as r:
        return json.load(r)["weight_version"]


def test_a_killed_launched_server_comes_back_with_the_current_weights(tmp_path):
    engine = launch(2, tmp_path)
    try:
        asyncio.run(engine.update_weights_from_disk(str(tmp_path), 7))
        victim, pid = engine.worker_urls[1], engine._launched[engine.worker_urls[1]][0].popen.pid
        os.killpg(pid, signal.SIGKILL)
        engine._launched[victim][0].popen.wait(5)
        out = generate(engine)
        new = engine._launched[victim][0]
        assert new.popen.pid != pid and new.popen.poll() is None and engine.restarted == 1
        assert model_info_version(victim) == "7"  # re-synced before it was used again
        assert {s.weight_version for g in out for s in g} == {7} and engine._down == {}
    finally:
        asyncio.run(engine.close())
    assert all(p.popen.poll() is not None for p, _ in engine._launched.values())


def test_a_server_that_cannot_be_restarted_stops_the_run_below_min_servers(tmp_path):
    engine = launch(2, tmp_path, min_servers=2)
    try:
        victim = engine.worker_urls[0]
        proc, cfg = engine._launched[victim]
        engine._launched[victim][1] = dataclasses.replace(cfg, model_path="EXIT_AT_START")  # it will not start
        os.killpg(proc.popen.pid, signal.SIGKILL)
        proc.popen.wait(5)
        with pytest.raises(
            RolloutError,
            match=r"(?s)only 1 SGLang server\(s\) in rotation, min_servers is 2.*"
            r"2 restart attempt\(s\) failed.*told to exit at start-up",
        ):
            generate(engine)
        engine.restart = dataclasses.replace(engine.restart, min_servers=1)
        generate(engine)  # enough servers left: the run goes on
    finally:
        asyncio.run(engine.close())


def wait_for_background_restart(engine, url, old, timeout_s: float) -> None:
    """Until the monitor has put a new, healthy process on ``url`` (and its restart is over)."""
    deadline = time.monotonic() + timeout_s
    while engine._launched[url][0] is old or engine._restart_locks[url].locked():
        assert time.monotonic() < deadline, f"{url} was not restarted in the background within {timeout_s} s"
        time.sleep(0.05)


def test_a_server_that_dies_between_steps_is_restarted_in_the_background(tmp_path):
    engine = launch(2, tmp_path, probe_interval_s=0.2)
    try:
        asyncio.run(engine.update_weights_from_disk(str(tmp_path), 7))
        victim = engine.worker_urls[1]
        old = engine._launched[victim][0]
        os.killpg(old.popen.pid, signal.SIGKILL)
        # no generation or weight update runs: the monitor alone brings it back, healthy, on the base weights
        wait_for_background_restart(engine, victim, old, 30.0)
        new = engine._launched[victim][0]
        assert old.popen.poll() is not None and new.popen.poll() is None
        assert model_info_version(victim) == "0"
        out = generate(engine)  # the next step takes it back (re-synced first) without restarting it again
        assert engine._launched[victim][0] is new and engine.restarted == 1
        assert model_info_version(victim) == "7"
        assert {s.weight_version for g in out for s in g} == {7} and engine._down == {}
    finally:
        asyncio.run(engine.close())
    assert all(p.popen.poll() is not None for p, _ in engine._launched.values())


def test_a_server_that_stops_answering_is_restarted_in_the_background(tmp_path, caplog):
    engine = launch(1, tmp_path, probe_interval_s=0.2, after_s=1.0)
    engine.monitor.probe_timeout_s = 0.5
    try:
        url = engine.worker_urls[0]
        old = engine._launched[url][0]
        os.kill(old.popen.pid, signal.SIGSTOP)  # alive, but answers nothing
        with caplog.at_level("WARNING", logger="gspo_mcore.rollout.sglang_monitor"):
            wait_for_background_restart(engine, url, old, 60.0)
        assert "has not answered /health" in caplog.text
        assert old.popen.poll() is not None  # stopped, then killed by the restart
        generate(engine)
        assert engine.restarted == 1 and engine._down == {}
    finally:
        asyncio.run(engine.close())


def test_no_background_monitor_unless_asked():
    servers = SGLangServers()
    assert servers.restart_policy().probe_interval_s == servers.restart_probe_interval_s > 0
    assert RestartPolicy(attempts=2).probe_interval_s == 0  # the engine's own default: checks before each step only
    with pytest.raises(ValueError, match="restart_probe_interval_s must be a number >= 0"):
        SGLangServers(restart_probe_interval_s=-1)


def test_fleet_settings_are_checked_naming_the_key():
    with pytest.raises(ValueError, match=r"min_servers=3 is more than the 2 server\(s\)"):
        SGLangServers(num_servers=2, min_servers=3)
    with pytest.raises(ValueError, match=r"restart_attempts=1: the servers at urls were not launched by this run"):
        SGLangServers(urls=("http://127.0.0.1:1",), restart_attempts=1)
    assert SGLangServers(urls=("http://127.0.0.1:1",)).restart_policy().attempts == 0
    assert SGLangServers().restart_policy().attempts == 2


def kill(engine, url) -> None:
    """SIGKILL the launched server at ``url`` (its process group) and wait until it is gone."""
    proc = engine._launched[url][0]
    os.killpg(proc.popen.pid, signal.SIGKILL)
    proc.popen.wait(5)


def test_a_server_killed_between_the_process_look_and_the_version_check_is_restarted(tmp_path):
    # Issue 40, bug A: the pre-generation upkeep looked at the processes first; a server that died after that look
    # failed its /model_info, was marked down, and (no background restart under way) min_servers stopped the run.
    engine = launch(2, tmp_path, min_servers=2)
    victim = engine.worker_urls[1]
    look = engine._restart_dead
    looks = []

    async def look_then_kill():
        await look()
        looks.append(1)
        if len(looks) == 1:
            kill(engine, victim)

    try:
        asyncio.run(engine.update_weights_from_disk(str(tmp_path), 7))
        engine._restart_dead = look_then_kill  # the generation's first look: the victim dies right after it
        out = generate(engine)
        assert len(looks) == 2  # looked again before giving up
        assert engine.restarted == 1 and engine._launched[victim][0].popen.poll() is None
        assert model_info_version(victim) == "7"  # re-synced before it served
        assert {s.weight_version for g in out for s in g} == {7} and engine._down == {}
    finally:
        asyncio.run(engine.close())


def test_a_server_being_restarted_in_the_background_is_left_out_of_a_weight_update(tmp_path):
    # Issue 40, bug B: the update skipped restarting a server the monitor was restarting, but still sent it the
    # pause, which failed (connection refused) and stopped the run. It is left out whatever min_servers says (like a
    # server already out of rotation), not dropped when its pause fails (that needs min_servers left, see below).
    engine = launch(2, tmp_path, min_servers=2)
    victim = engine.worker_urls[1]
    try:
        kill(engine, victim)
        lock = engine._restart_locks[victim]
        lock.acquire()  # what the monitor holds while it restarts the server
        try:
            asyncio.run(engine.update_weights_from_disk(str(tmp_path), 7))
        finally:
            lock.release()
        assert engine.control.version == 7 and victim in engine._down
        out = generate(engine)  # the dead server is restarted and re-synced before it serves
        assert engine.restarted == 1 and model_info_version(victim) == "7"
        assert {s.weight_version for g in out for s in g} == {7} and engine._down == {}
    finally:
        asyncio.run(engine.close())


@pytest.mark.parametrize("min_servers", [1, 2])
def test_a_server_that_dies_just_before_a_weight_update_is_dropped_from_it(tmp_path, min_servers):
    # Issue 40, bug B: a server dying after the update's look at the processes failed its pause_generation
    # (connection lost) and stopped the run; it is dropped from the update (while any server remains, whatever
    # min_servers says: the next generation restarts and re-syncs it before anything is served).
    engine = launch(2, tmp_path, min_servers=min_servers)
    victim = engine.worker_urls[1]
    before = engine._before_update

    async def before_then_kill():
        await before()
        kill(engine, victim)

    engine._before_update = before_then_kill
    try:
        asyncio.run(engine.update_weights_from_disk(str(tmp_path), 7))
        assert engine.control.version == 7 and "lost during a weight update" in engine._down[victim]
        engine._before_update = before
        out = generate(engine)
        assert engine.restarted == 1 and model_info_version(victim) == "7"
        assert {s.weight_version for g in out for s in g} == {7} and engine._down == {}
    finally:
        asyncio.run(engine.close())
