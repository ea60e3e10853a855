"""The background monitor of launched SGLang servers (:class:`~gspo_mcore.rollout.sglang_monitor.ServerMonitor`) on a
fake clock and fake probes: a server that is being restarted (its process still starting, so it answers nothing) is not
counted as silent, and silence seen before a restart is not carried past it. Both were seen in the real kill -9 run,
where a restart took over 90 s under load and the monitor took the starting server for a dead one (commit 39afff2).
The restarts themselves, with real processes, are in test_sglang_fleet.py."""

from __future__ import annotations

import asyncio
import types

import pytest

from gspo_mcore.rollout import SGLangEngine, sglang_monitor
from gspo_mcore.rollout.sglang_monitor import ServerMonitor
from gspo_mcore.rollout.sglang_server import RestartPolicy

URL = "http://127.0.0.1:30001"
AFTER_S = 10.0


class FakePopen:
    def poll(self):
        return None  # alive (a process that is still starting, or one that stopped answering)


class FakeProcess:
    """What the engine and the monitor read of a launched server's process."""

    def __init__(self, url: str):
        self.url, self.name, self.popen = url, "fake", FakePopen()
        self.log_path = "/dev/null"

    def shutdown(self, timeout_s: float = 0.0) -> None:
        pass

    def log_tail(self, lines: int = 20) -> str:
        return ""


@pytest.fixture
def world(monkeypatch):
    """A fake clock (``world.now``) and each URL's ``/health`` answer (``world.health[url]``: None is 200)."""
    w = types.SimpleNamespace(now=0.0, health={})
    monkeypatch.setattr(sglang_monitor, "time", types.SimpleNamespace(monotonic=lambda: w.now))
    monkeypatch.setattr(
        sglang_monitor, "_probe", lambda url, timeout_s: w.health[url.removesuffix(sglang_monitor.HEALTH_PATH)]
    )
    return w


def at(world, monitor, now: float, health: str | None) -> list[str]:
    """One monitor round at ``now`` with ``URL``'s /health answering ``health`` (None: 200)."""
    world.now, world.health[URL] = now, health
    return monitor.check()


def test_a_server_being_restarted_is_not_counted_as_silent(world):
    engine = SGLangEngine(
        [URL], launched=[(FakeProcess(URL), None)], restart=RestartPolicy(attempts=2, after_s=AFTER_S)
    )
    assert engine.monitor is None  # probe_interval_s 0: no thread; the rounds below are driven by hand
    handed = []
    monitor = ServerMonitor(
        engine._watched, lambda url, why: handed.append((url, why)), interval_s=1.0, after_s=AFTER_S
    )
    try:
        lock = engine._restart_locks[URL]
        assert lock.acquire(blocking=False)  # a restart is in progress (by the engine, or an earlier round)
        try:
            for now in (0.0, 5.0, 20.0, 60.0, 95.0):  # the new process takes 95 s to start: no answer meanwhile
                assert at(world, monitor, now, "connection refused") == []
            assert URL not in engine._watched()
        finally:
            lock.release()
        assert handed == [], "the monitor restarted a server that was being restarted"
        # the restart is over: the new process is watched from now on, and its silence counts from now
        assert URL in engine._watched()
        assert at(world, monitor, 96.0, "connection refused") == []
        assert at(world, monitor, 96.0 + AFTER_S - 1, "connection refused") == []
        assert at(world, monitor, 96.0 + AFTER_S, "connection refused") == [URL]  # the control: silence is seen
        assert handed == [(URL, f"has not answered /health for {AFTER_S:.0f} s (connection refused)")]
    finally:
        asyncio.run(engine.close())


def test_silence_before_a_restart_is_not_carried_past_it(world):
    targets = {URL: FakeProcess(URL)}
    handed = []
    monitor = ServerMonitor(lambda: targets, lambda url, why: handed.append(url), interval_s=1.0, after_s=AFTER_S)
    assert at(world, monitor, 0.0, "timed out") == []  # silent since 0
    watched = targets.pop(URL)  # the engine restarts it (its restart lock held): not watched meanwhile
    assert at(world, monitor, 5.0, "timed out") == []
    assert at(world, monitor, 30.0, "timed out") == []
    targets[URL] = watched  # restarted: a new process, which has not answered yet
    assert at(world, monitor, 31.0, "connection refused") == [], (
        "the silence seen before the restart (since 0 s) was counted against the new process"
    )
    assert at(world, monitor, 31.0 + AFTER_S - 1, "connection refused") == []
    assert at(world, monitor, 31.0 + AFTER_S, "connection refused") == [URL]  # the control: its own silence counts
    assert at(world, monitor, 50.0, None) == [] and handed == [URL]


def test_a_server_that_answers_again_starts_a_fresh_count(world):
    monitor = ServerMonitor(lambda: {URL: FakeProcess(URL)}, lambda url, why: None, interval_s=1.0, after_s=AFTER_S)
    assert at(world, monitor, 0.0, "timed out") == []
    assert at(world, monitor, AFTER_S - 1, None) == []  # answered: the silence is forgotten
    assert at(world, monitor, AFTER_S + 1, "timed out") == []
    assert at(world, monitor, 2 * AFTER_S + 1, "timed out") == [URL]
