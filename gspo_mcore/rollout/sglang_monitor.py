"""A background watch over the SGLang servers a run launched: a server that dies between steps is restarted while the
learner trains, so it is ready (or nearly) for the next step instead of being noticed, and restarted, when that step
starts.

One daemon thread checks every ``interval_s`` seconds each server :class:`ServerMonitor` is given: its process still
running (``popen.poll()``), and ``GET /health`` answering 200 within ``probe_timeout_s``. SGLang answers ``/health``
from its HTTP process without generating, so the probe costs nothing and is answered while the server is paused for a
weight update. A server whose process exited, or whose ``/health`` has failed for ``after_s``, is handed to
``restart(url, why)`` in the monitor's thread; what a restart does (and how the engine learns of it) is the engine's
business (:class:`~gspo_mcore.rollout.sglang.SGLangEngine`). A scheduler that hangs while the HTTP process answers is
not seen here; the engine's request timeouts see it.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

HEALTH_PATH = "/health"


class ServerMonitor:
    """Watch servers from a daemon thread; ``targets()`` gives the servers to watch now (``url -> ManagedProcess``, read
    every round, so a restarted server's new process is watched), ``restart(url, why)`` is called for a dead or silent
    one (and blocks the monitor while it runs)."""

    def __init__(
        self,
        targets: Callable[[], Mapping[str, object]],
        restart: Callable[[str, str], None],
        *,
        interval_s: float,
        after_s: float,
        probe_timeout_s: float = 5.0,
    ):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.targets, self.restart = targets, restart
        self.interval_s, self.after_s, self.probe_timeout_s = float(interval_s), float(after_s), float(probe_timeout_s)
        self._stop = threading.Event()
        self._failing_since: dict[str, float] = {}
        self._thread = threading.Thread(target=self._main, name="gspo-sglang-monitor", daemon=True)

    def start(self) -> ServerMonitor:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 0.0) -> None:
        """Ask the thread to end (it finishes a restart in progress first); wait for it up to ``timeout_s``."""
        self._stop.set()
        if timeout_s > 0 and self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def _main(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - a monitor that dies silently would hide every later failure
                log.exception("SGLang server monitor: a check failed; checking again in %g s", self.interval_s)

    def check(self) -> list[str]:
        """One round: restart each dead or silent server; returns the URLs handed to ``restart``."""
        handed = []
        targets = dict(self.targets())
        for url in [u for u in self._failing_since if u not in targets]:  # not watched now (being restarted)
            del self._failing_since[url]
        for url, proc in targets.items():
            if self._stop.is_set():
                break
            why = self._why_restart(url, proc)
            if why is None:
                continue
            log.warning("SGLang server %s: %s; restarting it in the background", url, why)
            self._failing_since.pop(url, None)
            self.restart(url, why)
            handed.append(url)
        return handed

    def _why_restart(self, url: str, proc) -> str | None:
        code = proc.popen.poll()
        if code is not None:
            return f"its process exited with code {code}"
        problem = _probe(url + HEALTH_PATH, self.probe_timeout_s)
        now = time.monotonic()
        if problem is None:
            self._failing_since.pop(url, None)
            return None
        since = self._failing_since.setdefault(url, now)
        if now - since >= self.after_s:
            return f"has not answered {HEALTH_PATH} for {now - since:.0f} s ({problem})"
        return None


def _probe(url: str, timeout_s: float) -> str | None:
    """None when ``GET url`` answers 200, else what went wrong."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return None if r.status == 200 else f"HTTP {r.status}"
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return str(getattr(e, "reason", e))
