"""Launch SGLang servers (and optionally ``sglang-router``) as subprocesses, wait for health, shut down.

Each process runs in its own session (process group), so shutting it down also ends the scheduler and
detokenizer processes SGLang spawns. Output goes to one log file per process; if a process exits
before it is healthy, the error carries the tail of its log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from gspo_mcore.platform.launch import free_port
from gspo_mcore.rollout.sglang_control import SGLangClientConfig

_TRUTHY = ("1", "true", "yes", "on")


class ServerLaunchError(RuntimeError):
    """A server process exited or did not become healthy in time (the message has its log tail)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SGLangServerConfig:
    """One ``python -m sglang.launch_server`` process."""

    model_path: str
    """HF-format model directory (or anything SGLang's ``--model-path`` takes)."""
    port: int | None = None
    """HTTP port; None picks a free one."""
    host: str = "127.0.0.1"
    """Address to bind; loopback unless the trainer runs on another machine."""
    gpu_ids: tuple[int, ...] | None = None
    """Devices for this server (sets ``CUDA_VISIBLE_DEVICES``); None leaves the environment alone."""
    tp_size: int = 1
    weight_version: int = 0
    """Initial ``--weight-version`` (the training step of the weights at ``model_path``)."""
    extra_args: tuple[str, ...] = ()
    """More command-line arguments, e.g. ``("--mem-fraction-static", "0.7")``."""
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Extra environment variables for the process."""
    log_path: str | None = None
    """Where stdout and stderr go; None means ``sglang-<port>.log`` in the current log directory."""
    health_path: str = "/health_generate"
    startup_timeout_s: float = 900.0
    python: str = sys.executable
    module: str = "sglang.launch_server"
    """The module run with ``python -m`` (tests substitute a stand-in)."""

    def __post_init__(self):
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.gpu_ids is not None and len(self.gpu_ids) != self.tp_size:
            raise ValueError(f"{len(self.gpu_ids)} gpu_ids given for tp_size={self.tp_size}")
        if str(self.env.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "")).lower() in _TRUTHY:
            raise ValueError(
                "SGLANG_RETURN_ORIGINAL_LOGPROB makes SGLang return log-probs before temperature scaling, "
                "which breaks the project's log-prob convention (see gspo_mcore.rollout.types)"
            )

    def command(self, port: int) -> list[str]:
        cmd = [
            self.python,
            "-m",
            self.module,
            "--model-path",
            self.model_path,
            "--host",
            self.host,
            "--port",
            str(port),
            "--weight-version",
            str(self.weight_version),
        ]
        if self.tp_size != 1:
            cmd += ["--tp-size", str(self.tp_size)]
        return cmd + list(self.extra_args)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RestartPolicy:
    """How the rollout engine brings back the servers it launched (see ``SGLangServers.restart_*``)."""

    attempts: int = 0
    backoff_s: float = 5.0
    after_s: float = 60.0
    min_servers: int = 1
    probe_interval_s: float = 0.0
    """Seconds between the background monitor's checks of the launched servers (0: no monitor; a dead server is then
    noticed when the next generation or weight update starts)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SGLangServers:
    """The SGLang servers a run uses: connect to ``urls``, or launch ``num_servers`` on a model directory. The
    settings every user of SGLang servers shares (the rollout's ``rollout.sglang`` adds its weight sync; the
    distillation teacher's ``distill.sglang`` is this alone)."""

    urls: tuple[str, ...] = ()
    """Running servers to use (``http://host:port``; they must serve the model the run expects, which is not
    checked). Empty: launch ``num_servers`` on the model directory."""
    num_servers: int = 1
    """Servers to launch when ``urls`` is empty (on loopback; GPU ids from ``gpu_offset`` on)."""
    server_tp_size: int = 1
    """Tensor parallel size of each launched server."""
    gpu_offset: int = 0
    """First GPU id of the launched servers (GPUs the learner and any other servers do not use)."""
    extra_args: tuple[str, ...] = ()
    """Extra ``sglang.launch_server`` arguments (e.g. ``--mem-fraction-static 0.5``)."""
    python: str = ""
    """Interpreter that runs the launched servers (SGLang often lives in its own environment); empty: this one."""
    env: dict = dataclasses.field(default_factory=dict)
    """Extra environment variables of the launched servers."""
    client: SGLangClientConfig = dataclasses.field(default_factory=SGLangClientConfig)
    """Timeouts, retries and concurrency of the requests."""
    restart_attempts: int | None = None
    """Launched servers only: how many times a server whose process died (or that failed its health probes for
    ``restart_after_s``) is restarted, on its port, before it is given up (then the run goes on if ``min_servers``
    are left, else stops with the server's last log lines). A restarted server gets the current weights and its
    weight version is checked before it serves again. None: 2 for launched servers, 0 for ``urls`` (which this run
    cannot restart)."""
    restart_backoff_s: float = 5.0
    """Wait before restart attempt ``k`` (``k * restart_backoff_s``)."""
    restart_after_s: float = 60.0
    """A launched server still out of rotation (failing its health probe) this long is restarted."""
    min_servers: int = 1
    """Servers that must stay in rotation (serving the current weights); fewer stops the run."""
    restart_probe_interval_s: float = 10.0
    """Launched servers that may be restarted: every this many seconds a background thread checks that each one's
    process runs and that it answers ``/health``; a server whose process died, or that has not answered for
    ``restart_after_s``, is restarted then, while the learner trains, so it is ready for the next step (it still gets
    the current weights, and its version is checked, before it serves). 0: no background checks (a dead server is
    noticed, and restarted, when the next generation or weight update starts)."""

    def __post_init__(self):
        object.__setattr__(self, "urls", tuple(self.urls))
        object.__setattr__(self, "extra_args", tuple(self.extra_args))
        for key in ("num_servers", "server_tp_size"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{key} must be an integer >= 1, got {v!r}")
        if isinstance(self.gpu_offset, bool) or not isinstance(self.gpu_offset, int) or self.gpu_offset < 0:
            raise ValueError(f"gpu_offset must be an integer >= 0, got {self.gpu_offset!r}")
        bad = [u for u in self.urls if not (isinstance(u, str) and u.startswith("http://"))]
        if bad:
            raise ValueError(f"urls: {bad[0]!r} is not an http:// URL")
        n = len(self.urls) or self.num_servers
        if isinstance(self.min_servers, bool) or not isinstance(self.min_servers, int) or not 1 <= self.min_servers:
            raise ValueError(f"min_servers must be an integer >= 1, got {self.min_servers!r}")
        if self.min_servers > n:
            raise ValueError(f"min_servers={self.min_servers} is more than the {n} server(s) configured")
        if self.restart_attempts is not None:
            if not isinstance(self.restart_attempts, int) or isinstance(self.restart_attempts, bool):
                raise ValueError(f"restart_attempts must be an integer >= 0, got {self.restart_attempts!r}")
            if self.restart_attempts < 0:
                raise ValueError(f"restart_attempts must be an integer >= 0, got {self.restart_attempts!r}")
            if self.restart_attempts > 0 and self.urls:
                raise ValueError(
                    f"restart_attempts={self.restart_attempts}: the servers at urls were not launched by this run, "
                    "so it cannot restart them (set restart_attempts: 0, or leave urls empty to launch servers)"
                )
        for key in ("restart_backoff_s", "restart_after_s", "restart_probe_interval_s"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"{key} must be a number >= 0, got {v!r}")

    def restart_policy(self) -> RestartPolicy:
        """The restart settings of the launched servers."""
        attempts = self.restart_attempts if self.restart_attempts is not None else (0 if self.urls else 2)
        return RestartPolicy(
            attempts=attempts,
            backoff_s=float(self.restart_backoff_s),
            after_s=float(self.restart_after_s),
            min_servers=self.min_servers,
            probe_interval_s=float(self.restart_probe_interval_s),
        )

    def launch_configs(self, model_path: str, *, gpus: bool | None = None) -> list[SGLangServerConfig]:
        """The ``num_servers`` servers to launch on ``model_path``: server ``i`` on GPUs ``gpu_offset + i * tp``
        onwards (``tp = server_tp_size``) when ``gpus`` (default: when CUDA is available), else no GPU ids."""
        if gpus is None:
            import torch

            gpus = torch.cuda.is_available()
        tp, first = self.server_tp_size, self.gpu_offset
        extra = {"python": self.python} if self.python else {}
        return [
            SGLangServerConfig(
                model_path=model_path,
                tp_size=tp,
                extra_args=self.extra_args,
                env=dict(self.env),
                gpu_ids=tuple(range(first + i * tp, first + (i + 1) * tp)) if gpus else None,
                **extra,
            )
            for i in range(self.num_servers)
        ]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """One ``python -m sglang_router.launch_router`` process in front of the servers."""

    port: int | None = None
    host: str = "127.0.0.1"
    policy: str = "cache_aware"
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    log_path: str | None = None
    health_path: str = "/health"
    startup_timeout_s: float = 120.0
    python: str = sys.executable
    module: str = "sglang_router.launch_router"

    def command(self, port: int, worker_urls: Sequence[str]) -> list[str]:
        return [
            self.python,
            "-m",
            self.module,
            "--worker-urls",
            *worker_urls,
            "--host",
            self.host,
            "--port",
            str(port),
            "--policy",
            self.policy,
            *self.extra_args,
        ]


class ManagedProcess:
    """A launched server or router: its URL, process and log file."""

    def __init__(self, name: str, url: str, popen: subprocess.Popen, log_path: Path, health_path: str):
        self.name, self.url, self.popen, self.log_path, self.health_path = name, url, popen, log_path, health_path

    def __repr__(self):
        return f"ManagedProcess({self.name!r}, {self.url!r}, pid={self.popen.pid})"

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as e:
            return f"(cannot read {self.log_path}: {e})"
        return "\n".join(text.splitlines()[-lines:])

    def wait_healthy(self, timeout_s: float, poll_s: float = 0.5) -> None:
        """Poll ``GET url + health_path`` until 200; fail fast with the log tail if the process exits."""
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while True:
            code = self.popen.poll()
            if code is not None:
                raise ServerLaunchError(
                    f"{self.name} ({self.url}) exited with code {code} before becoming healthy; "
                    f"last lines of {self.log_path}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + self.health_path, timeout=max(poll_s, 5.0)) as r:
                    if r.status == 200:
                        return
                    last = f"HTTP {r.status}"
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}"
            except (urllib.error.URLError, OSError) as e:
                last = str(getattr(e, "reason", e))
            if time.monotonic() >= deadline:
                self.shutdown()
                raise ServerLaunchError(
                    f"{self.name} ({self.url}) not healthy after {timeout_s:g}s ({self.health_path}: {last}); "
                    f"last lines of {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(poll_s)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the process group, then SIGKILL what is left after ``timeout_s``."""
        if self.popen.poll() is None:
            _signal_group(self.popen, signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        # Children may outlive the leader; the group id is the leader's pid (start_new_session).
        _signal_group(self.popen, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5.0)


def _signal_group(popen: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, sig)


def _url(host: str, port: int) -> str:
    connect_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    return f"http://{connect_host}:{port}"


def _spawn(name: str, cmd: list[str], env_extra: Mapping[str, str], log_path: Path) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update({k: str(v) for k, v in env_extra.items()})
    with open(log_path, "ab") as log:
        log.write(f"# {name}: {' '.join(cmd)}\n".encode())
        log.flush()
        return subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )


def start_server(
    config: SGLangServerConfig,
    *,
    log_dir: str | os.PathLike = ".",
    name: str | None = None,
    avoid_ports: frozenset[int] = frozenset(),
) -> ManagedProcess:
    """Start one server (does not wait for it)."""
    port = config.port
    while port is None or (config.port is None and port in avoid_ports):
        port = free_port(config.host)
    name = name or f"sglang-{port}"
    env = dict(config.env)
    if config.gpu_ids is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in config.gpu_ids)
    if (
        os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in _TRUTHY
        and "SGLANG_RETURN_ORIGINAL_LOGPROB" not in env
    ):
        env["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "0"  # the inherited setting would break the log-prob convention
    log_path = Path(config.log_path) if config.log_path else Path(log_dir) / f"{name}.log"
    popen = _spawn(name, config.command(port), env, log_path)
    return ManagedProcess(name, _url(config.host, port), popen, log_path, config.health_path)


def launch_servers(configs: Sequence[SGLangServerConfig], *, log_dir: str | os.PathLike = ".") -> list[ManagedProcess]:
    """Start all servers, then wait until every one is healthy; on any failure stop them all."""
    procs: list[ManagedProcess] = []
    try:
        used = frozenset(c.port for c in configs if c.port is not None)
        for i, cfg in enumerate(configs):
            procs.append(start_server(cfg, log_dir=log_dir, name=f"sglang-{i}", avoid_ports=used))
            used |= {int(procs[-1].url.rsplit(":", 1)[1])}
        for proc, cfg in zip(procs, configs):
            proc.wait_healthy(cfg.startup_timeout_s)
    except BaseException:
        for p in procs:
            p.shutdown(timeout_s=5.0)
        raise
    return procs


def launch_router(
    config: RouterConfig, worker_urls: Sequence[str], *, log_dir: str | os.PathLike = "."
) -> ManagedProcess:
    """Start ``sglang-router`` in front of ``worker_urls`` and wait until it answers its health check."""
    port = config.port or free_port(config.host)
    log_path = Path(config.log_path) if config.log_path else Path(log_dir) / "sglang-router.log"
    popen = _spawn("sglang-router", config.command(port, worker_urls), config.env, log_path)
    proc = ManagedProcess("sglang-router", _url(config.host, port), popen, log_path, config.health_path)
    try:
        proc.wait_healthy(config.startup_timeout_s)
    except BaseException:
        proc.shutdown(timeout_s=5.0)
        raise
    return proc
