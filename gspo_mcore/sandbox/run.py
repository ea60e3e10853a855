"""Run untrusted Python (model-written code) in a sandboxed subprocess.

What holds, and where (``SandboxResult.layers`` says, per run, which layers were applied; the
launcher's steps are in ``_launcher.py``):

=========================  ========================================  ======================================
threat                     as root (this project's hosts)            as a normal user
=========================  ========================================  ======================================
infinite loop              RLIMIT_CPU (SIGXCPU), wall-clock kill     same
memory bomb                RLIMIT_AS per process; a memory cgroup    RLIMIT_AS per process only (a tree
                           (v2 or v1, ``cgroups.py``) bounds the     of N processes may use N x memory_mb)
                           whole tree, tmpfs files included          unless ``cgroup_parent`` is delegated
CPU hogging (threads)      RLIMIT_CPU counts all threads; cgroup     same
                           ``cpu.max`` / CFS quota: ``cpu_cores``
fork bomb                  RLIMIT_NPROC on a fresh uid of its own    RLIMIT_NPROC counts all the user's
                           (the count starts at 0), pids cgroup      tasks: set to current + limit (weaker)
leftover / escaped         PID namespace: the kernel kills every     same with a user namespace; else the
processes                  process in it when its init exits; else   process group only (setsid escapes)
                           kill(-1) as the sandbox uid
network                    network namespace (no interfaces; even    same with a user namespace; else a
                           loopback is down; abstract Unix sockets   socket block in the interpreter that
                           are per namespace)                        is NOT a boundary (ctypes, _socket)
reading host files         a private root (pivot_root): only /usr,   same with a user namespace; else it
                           /bin, /lib*, the interpreter's prefix,    can read what the sandbox uid can
                           a few /dev nodes, a fresh /proc (PID
                           namespace only) and a tmpfs /tmp, with
                           the work directory in it; nothing else
                           of the host (datasets, /proc of host
                           processes, Unix sockets) is reachable
writing outside its dir    the root and every bind mount read-only;  same with a user namespace (it runs as
filling the host disk      the work directory and /tmp live in one   the caller's user, mapped to root in
                           tmpfs of ``tmpfs_mb``; stdout / stderr    the namespace); else it can write what
                           capped by RLIMIT_FSIZE                    the user can
signalling host processes  different uid; PID namespace              PID namespace via a user namespace
big files / output         RLIMIT_FSIZE per file, capped tmpfs,      same
                           output read back is truncated
secrets in the environment clean environment (PATH, LANG, HOME)      same
setuid binaries            no_new_privs                              same
=========================  ========================================  ======================================

Also: a seccomp allow-list (``syscalls.py``), a UTS namespace with its own hostname, a cgroup namespace, and the
launcher's plan passed through descriptors (docs/rewards.md). Not covered: kernel exploits through the allowed
system calls, the contents of the read-only system directories
(/usr ...), and disk-bandwidth contention. Verdicts never depend on the program's honesty: see
``rewards/code.py`` and ``rewards/asserts.py``.

By default a run is refused (``SandboxUnavailable``) unless the network namespace, privilege
separation ('privilege': a uid drop, or a user namespace with a read-only filesystem) and the private
root hold; ``SandboxConfig.require=()`` accepts weaker isolation. Without any cgroup layer a warning is
logged once per process (``startup_check``); ``require_cgroup=True`` refuses such hosts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from gspo_mcore.sandbox import cgroups, syscalls

_LAUNCHER_SOURCE = Path(__file__).with_name("_launcher.py").read_bytes()
# The launcher's command line: its source and plan come through descriptors (argv: source fd, plan fd,
# status fd), so the sandbox's /proc/1/cmdline holds no host path or pid.
_BOOT = (
    "import os, sys\nfd = int(sys.argv[1])\nsrc = b''\nwhile c := os.read(fd, 65536):\n    src += c\n"
    "os.close(fd)\nexec(compile(src, '<sandbox launcher>', 'exec'))"
)
_PY_FLAGS = ("-E", "-s", "-S", "-B")
_LAUNCHER_OVERHEAD_MB = 64
_NO_REPORT = "the launcher died before reporting"
_KNOWN_LAYERS = frozenset(
    {
        "netns",
        "mountns",
        "pidns",
        "ipcns",
        "utsns",
        "userns",
        "uid",
        "privilege",
        "readonly_fs",
        "private_tmp",
        "private_proc",
        "private_root",
        "cgroup",
        "cgroupns",
        "hostname",
        "rlimits",
        "no_new_privs",
        "no_caps",
        "seccomp",
    }
)
# Read-only in the private root: the system's programs and libraries (and the interpreter's prefix).
_ROOT_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache", "/etc/localtime")
_SOCKET_GUARD = """\
import runpy, socket, sys
def _deny(*a, **k):
    raise PermissionError("network access is disabled in the reward sandbox")
class _NoSocket(socket.socket):
    def __init__(self, *a, **k):
        _deny()
socket.socket = _NoSocket
for _n in ("create_connection", "create_server", "getaddrinfo", "gethostbyname", "socketpair", "fromfd"):
    setattr(socket, _n, _deny)
del _n
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


class SandboxUnavailable(RuntimeError):
    """The isolation that ``SandboxConfig.require`` asks for cannot be applied on this host."""


@dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    cpu_time_s: int = 5
    """CPU seconds per process (RLIMIT_CPU): SIGXCPU at this, SIGKILL one second later."""
    wall_time_s: float = 10.0
    """Wall-clock limit of the whole run; then every process of the run is killed."""
    memory_mb: int = 1024
    """Address space per process (RLIMIT_AS); also the whole run's memory where a cgroup is available."""
    max_processes: int = 16
    """Processes and threads of the run together (RLIMIT_NPROC on the run's own uid; pids cgroup)."""
    max_file_mb: int = 16
    """Largest file the program may write (RLIMIT_FSIZE), stdout and stderr included."""
    max_open_files: int = 256
    """RLIMIT_NOFILE."""
    tmpfs_mb: int = 64
    """Size of each private tmpfs mounted over /tmp, /var/tmp, /dev/shm, /run/lock."""
    max_output_bytes: int = 1 << 20
    """How much of stdout and of stderr is read back (each)."""
    python: str | None = None
    """Interpreter for the untrusted program; None: the first of this Python, the system ``python3``,
    that the sandbox uid can execute. Runs with ``-E -s -S -B``: no site-packages (standard library
    only), no PYTHON* variables, files next to ``main.py`` importable."""
    uid_range: tuple[int, int] = (1_500_000_000, 1_500_100_000)
    """When running as root: each run takes a fresh uid (and gid) from ``[lo, hi)``, owning no file on
    the host and no other process (so RLIMIT_NPROC counts only this run's processes)."""
    namespaces: bool = True
    """Enter namespaces (network, mount, PID, IPC, UTS). False leaves rlimits, the uid drop and the
    in-interpreter socket block: for hosts that forbid ``unshare``, and to test that fallback."""
    private_root: bool = True
    """Give the program a private root (pivot_root) holding only the system directories and its work
    directory; False keeps the host's tree visible, read-only (for hosts where pivot_root fails)."""
    use_cgroup: bool = True
    """Put each run in fresh cgroups (v2, else v1; see ``cgroups.py``) bounding the whole process tree's
    memory (``memory_mb``), processes (``max_processes``) and CPU bandwidth (``cpu_cores``)."""
    require_cgroup: bool = False
    """Refuse to run (``SandboxUnavailable``) when no cgroup layer can be set up on this host."""
    cgroup_parent: str | None = None
    """A cgroup v2 directory delegated to the sandbox (the memory and pids controllers enabled in its
    ``cgroup.subtree_control``, writable by this process); None: this process's own cgroup (v2), or
    its v1 groups."""
    cpu_cores: float | None = 1.0
    """CPU bandwidth of the whole run in cores (cgroup ``cpu.max`` / CFS quota); None: no bandwidth cap
    (RLIMIT_CPU still bounds the CPU time)."""
    seccomp: bool = True
    """Load the system-call allow-list (``syscalls.py``, built with libseccomp) before the program starts."""
    require_seccomp: bool = False
    """Refuse to run (``SandboxUnavailable``) when the allow-list cannot be built or loaded on this host
    (False: one loud warning per process, and runs go on without it)."""
    hostname: str = "sandbox"
    """Hostname (and NIS domain name) inside the run's UTS namespace: the host's stays hidden."""
    require: tuple[str, ...] = ("netns", "privilege", "private_root")
    """Layers without which a run is refused (before the program starts). 'privilege': a uid drop, or a
    user namespace with a read-only filesystem; 'private_root': host files outside the work directory
    and the system directories are invisible."""

    def __post_init__(self):
        for name in (
            "cpu_time_s",
            "memory_mb",
            "max_processes",
            "max_file_mb",
            "max_open_files",
            "tmpfs_mb",
            "max_output_bytes",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"SandboxConfig.{name} must be an int >= 1, got {v!r}")
        if not self.wall_time_s > 0:
            raise ValueError(f"SandboxConfig.wall_time_s must be > 0, got {self.wall_time_s!r}")
        lo, hi = self.uid_range
        if not 0 < lo < hi <= 2**32 - 2:
            raise ValueError(f"SandboxConfig.uid_range must be 0 < lo < hi < 2**32-1, got {self.uid_range!r}")
        if self.cpu_cores is not None and not (isinstance(self.cpu_cores, (int, float)) and self.cpu_cores >= 0.01):
            raise ValueError(f"SandboxConfig.cpu_cores must be >= 0.01 or None, got {self.cpu_cores!r}")
        name = self.hostname
        if not (isinstance(name, str) and 0 < len(name.encode()) <= 64 and name.isprintable()):
            raise ValueError(f"SandboxConfig.hostname must be 1-64 printable bytes, got {self.hostname!r}")
        object.__setattr__(self, "require", tuple(self.require))
        unknown = set(self.require) - _KNOWN_LAYERS
        if unknown:
            raise ValueError(
                f"SandboxConfig.require has unknown layers {sorted(unknown)}; known: {sorted(_KNOWN_LAYERS)}"
            )


@dataclass(frozen=True)
class SandboxResult:
    returncode: int
    """The program's exit status; negative: killed by that signal (-SIGXCPU: CPU limit)."""
    stdout: bytes
    stderr: bytes
    timed_out: bool
    """Killed by the wall-clock limit."""
    wall_s: float
    layers: tuple[str, ...] = ()
    """Isolation that held for this run (see the module docstring)."""
    notes: tuple[str, ...] = field(default=(), repr=False)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    @property
    def cpu_limited(self) -> bool:
        """Killed by the CPU limit (SIGXCPU, or SIGKILL a second later; rarely the cgroup's OOM kill)."""
        return self.returncode == -signal.SIGXCPU or (self.returncode == -signal.SIGKILL and not self.timed_out)


def run_python(
    source: str,
    *,
    stdin: bytes = b"",
    files: dict[str, str | bytes] | None = None,
    args: tuple[str, ...] = (),
    config: SandboxConfig = SandboxConfig(),
) -> SandboxResult:
    """Run ``source`` as ``main.py`` in a fresh directory (with ``files`` next to it) inside the sandbox.

    Never raises for anything the program does; raises ``SandboxUnavailable`` when the required
    isolation cannot be applied (before the program runs).
    """
    as_root = os.geteuid() == 0
    python = config.python or _default_python(as_root)
    outer = tempfile.mkdtemp(prefix="gspo-sandbox-")  # holds the stdio files, the work dir, the new root
    os.chmod(outer, 0o711)  # the sandbox uid may pass through (to its own 0700 work dir), not list
    uid = None
    groups = None
    notes: list[str] = []
    try:
        work = os.path.join(outer, "work")
        os.mkdir(work, 0o700)
        os.mkdir(os.path.join(outer, "root"), 0o700)
        for name, content in {**(files or {}), "main.py": source}.items():
            _write_file(work, name, content)
        if as_root:
            uid = _UIDS.acquire(config.uid_range)
            _chown_tree(work, uid)
        if config.use_cgroup:
            groups, why = _make_cgroups(config)
            if why:
                notes.append(why)
        if groups is None:
            cgroups.warn_once_if_unavailable(config.cgroup_parent)
            if config.require_cgroup:
                raise SandboxUnavailable(
                    f"sandbox.require_cgroup is set but no cgroup layer is available: "
                    f"{notes[-1] if notes else 'use_cgroup is false'}"
                )
        bpf = None
        if config.seccomp:
            bpf, why = syscalls.availability()
            if bpf is None:
                syscalls.warn_once_if_unavailable()
                if config.require_seccomp:
                    raise SandboxUnavailable(f"sandbox.require_seccomp is set but no filter can be built: {why}")
        elif config.require_seccomp:
            raise SandboxUnavailable("sandbox.require_seccomp is set but sandbox.seccomp is false")
        plan = _plan(config, python, args, uid, groups, os.path.join(outer, "root"), bpf)
        paths = {k: os.path.join(outer, k) for k in ("stdin", "stdout", "stderr")}
        for k in paths:  # only the launcher's inherited descriptors reach them, never a path
            os.close(os.open(paths[k], os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600))
        Path(paths["stdin"]).write_bytes(stdin)
        try:
            status, timed_out, wall, report = _launch(plan, paths, work, config.wall_time_s)
        except BaseException:
            if uid is not None:
                _kill_uid(python, uid)
            raise
        layers = tuple(report.get("layers", ()))
        if uid is not None and "pidns" not in layers:
            _kill_uid(python, uid)  # no PID namespace: kill(-1) as the sandbox uid ends what is left
        if timed_out and report.get("refused") == _NO_REPORT:  # the wall clock ran out while it set up
            report = {"layers": [], "notes": ["killed by the wall clock before the program started"]}
        if report.get("refused"):
            raise SandboxUnavailable(f"{report['refused']} (notes: {notes + list(report.get('notes', ()))})")
        return SandboxResult(
            returncode=-signal.SIGKILL if status is None else os.waitstatus_to_exitcode(status),
            stdout=_head(paths["stdout"], config.max_output_bytes),
            stderr=_head(paths["stderr"], config.max_output_bytes),
            timed_out=timed_out,
            wall_s=wall,
            layers=layers + (("privilege",) if _privileged_apart(layers) else ()),
            notes=tuple(notes) + tuple(report.get("notes", ())),
        )
    finally:
        for d in reversed(groups.dirs if groups else ()):
            cgroups.remove(d)
        shutil.rmtree(outer, ignore_errors=True)
        if uid is not None:
            _UIDS.release(uid)


def startup_check(config: SandboxConfig = SandboxConfig()) -> tuple[str, ...]:
    """Run a trivial program with ``config``'s requirements; its layers, or ``SandboxUnavailable``.

    Logs (once per process, as a warning) when no cgroup layer or no system-call filter is available.
    """
    cgroups.warn_once_if_unavailable(config.cgroup_parent)
    if config.seccomp:
        syscalls.warn_once_if_unavailable()
    result = run_python("pass", config=config)
    if not result.ok:
        raise SandboxUnavailable(
            f"a trivial program failed in the sandbox (status {result.returncode}): "
            f"{result.stderr.decode(errors='replace')[-500:]}"
        )
    return result.layers


def _privileged_apart(layers: tuple[str, ...]) -> bool:
    """The program cannot act on the host as the caller's user (same rule as the launcher's)."""
    return "uid" in layers or {"userns", "readonly_fs"} <= set(layers)


def _plan(
    config: SandboxConfig, python: str, args: tuple[str, ...], uid: int | None, groups, root_dir: str, bpf: bytes | None
) -> dict:
    """What the launcher is to do (it runs with ``-I -S`` and takes this as JSON)."""
    nproc = config.max_processes if uid is not None else _user_tasks(os.getuid()) + config.max_processes
    return {
        "caller_pid": os.getpid(),
        "namespaces": config.namespaces,
        "tmpfs_bytes": config.tmpfs_mb << 20,
        "uid": uid,
        "gid": uid,
        "limits": {
            "cpu_s": config.cpu_time_s,
            "as_bytes": config.memory_mb << 20,
            "fsize_bytes": config.max_file_mb << 20,
            "nofile": config.max_open_files,
            "nproc": nproc,
        },
        "cgroup_procs": groups.procs if groups else [],
        "private_root": config.private_root,
        "root_dir": root_dir,
        "root_paths": _root_paths(python),
        "require": list(config.require) + (["seccomp"] if config.require_seccomp else []),
        "hostname": config.hostname,
        "seccomp_bpf": bpf.hex() if bpf else None,
        "argv": [python, *_PY_FLAGS, "main.py", *args],
        "guard_argv": [python, *_PY_FLAGS, "-c", _SOCKET_GUARD, "main.py", *args],
        "env": {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "TMPDIR": "/tmp", "PYTHONHASHSEED": "0"},
    }


@lru_cache(maxsize=None)
def _root_paths(python: str) -> list[str]:
    """Host paths bound read-only into the private root: system directories and the interpreter's prefix."""
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(python)))  # /usr for /usr/bin/python3.11
    paths = [p for p in _ROOT_PATHS if os.path.lexists(p)]
    if not any(prefix == p or prefix.startswith(p + "/") for p in paths) and prefix != "/":
        paths.append(prefix)
    return paths


def _launch(plan: dict, paths: dict[str, str], work: str, wall_time_s: float):
    """Start the launcher, enforce the wall clock, kill what is left; ``(status, timed_out, wall, report)``."""
    status_r, status_w = os.pipe()
    source_fd, plan_fd = _pipe_with(_LAUNCHER_SOURCE), _pipe_with(json.dumps(plan).encode())
    proc = None
    try:
        t0 = time.monotonic()
        try:
            with (
                open(paths["stdin"], "rb") as fin,
                open(paths["stdout"], "wb") as fout,
                open(paths["stderr"], "wb") as ferr,
            ):
                proc = subprocess.Popen(
                    ["sandbox-launcher", "-I", "-S", "-B", "-c", _BOOT, str(source_fd), str(plan_fd), str(status_w)],
                    executable=sys.executable,  # argv[0] names no host path (CPython finds its prefix anyway)
                    stdin=fin,
                    stdout=fout,
                    stderr=ferr,
                    cwd=work,
                    env={"PATH": "/usr/bin:/bin"},
                    start_new_session=True,
                    pass_fds=(source_fd, plan_fd, status_w),
                    close_fds=True,
                )
        finally:
            for fd in (source_fd, plan_fd, status_w):
                os.close(fd)
        timed_out = not _wait_exit(proc.pid, wall_time_s)
        if timed_out:  # the launcher kills the program's tree and reaps it (no zombies for the host)
            _signal(proc.pid, signal.SIGTERM)
            _wait_exit(proc.pid, 2.0)
        _signal(-proc.pid, signal.SIGKILL)  # the group; before reaping, so its id cannot be reused yet
        proc.wait()
        wall = time.monotonic() - t0
    except BaseException:
        if proc is not None:
            _signal(-proc.pid, signal.SIGKILL)
            proc.wait()
        os.close(status_r)
        raise
    report, status = _read_report(status_r)
    return status, timed_out, wall, report


def _pipe_with(data: bytes) -> int:
    """The read end of a pipe that holds ``data`` (then EOF)."""
    r, w = os.pipe()
    try:
        if len(data) > 65536:  # a pipe's default capacity: grow it (the launcher reads only after it starts)
            import fcntl

            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << (len(data) - 1).bit_length())
        view = memoryview(data)
        while view:
            view = view[os.write(w, view) :]
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    return r


def probe(config: SandboxConfig = SandboxConfig()) -> tuple[str, ...]:
    """The isolation layers a trivial run gets on this host (nothing is required)."""
    cfg = dataclasses.replace(config, require=())
    return run_python("pass", config=cfg).layers


def _write_file(work: str, name: str, content: str | bytes) -> None:
    path = os.path.normpath(os.path.join(work, name))
    if os.path.isabs(name) or not path.startswith(work + os.sep):
        raise ValueError(f"sandbox file names must be relative paths inside the work dir, got {name!r}")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(content.encode() if isinstance(content, str) else content)


def _chown_tree(root_dir: str, uid: int) -> None:
    for root, dirs, fnames in os.walk(root_dir):
        for n in [root] + [os.path.join(root, x) for x in dirs + fnames]:
            os.chown(n, uid, uid)


class _UidPool:
    """Fresh uids for concurrent runs of this process (random in the range, never two at once here)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._used: set[int] = set()

    def acquire(self, uid_range: tuple[int, int]) -> int:
        with self._lock:
            for _ in range(1000):
                uid = random.randrange(*uid_range)
                if uid not in self._used:
                    self._used.add(uid)
                    return uid
        raise RuntimeError("no free sandbox uid")

    def release(self, uid: int) -> None:
        with self._lock:
            self._used.discard(uid)


_UIDS = _UidPool()


@lru_cache(maxsize=None)
def _default_python(as_root: bool) -> str:
    candidates = [sys.executable, getattr(sys, "_base_executable", sys.executable)]
    candidates += [p for p in (shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin"),) if p]
    for c in candidates:
        if not as_root or _world_executable(c):
            return os.path.realpath(c)
    raise SandboxUnavailable(
        f"no Python interpreter the sandbox uid may execute (tried {candidates}); set SandboxConfig.python"
    )


def _world_executable(path: str) -> bool:
    """True when 'other' users can reach and run ``path`` (every parent searchable)."""
    real = os.path.realpath(path)
    try:
        if not os.stat(real).st_mode & stat.S_IXOTH:
            return False
        parent = os.path.dirname(real)
        while True:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
            if parent == "/":
                return True
            parent = os.path.dirname(parent)
    except OSError:
        return False


def _wait_exit(pid: int, timeout: float) -> bool:
    """Wait (without reaping) until ``pid`` exits; False on timeout."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        try:
            return bool(select.select([fd], [], [], timeout)[0])
        finally:
            os.close(fd)
    deadline, delay = time.monotonic() + timeout, 0.001
    while True:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


def _signal(pid: int, sig: int) -> None:
    """``kill(pid, sig)``; a negative pid is a process group. Gone already is fine."""
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_uid(python: str, uid: int) -> None:
    """Without a PID namespace: kill(-1) as the sandbox uid reaches exactly that uid's processes."""
    code = "import os\ntry:\n    os.kill(-1, 9)\nexcept OSError:\n    pass"
    subprocess.run(
        [python, "-I", "-S", "-c", code],
        user=uid,
        group=uid,
        extra_groups=[],
        env={},
        cwd="/",
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=30,
    )


def _read_report(fd: int) -> tuple[dict, int | None]:
    """The launcher's report of what held, and the program's raw wait status (None: killed first)."""
    chunks = []
    try:
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    finally:
        os.close(fd)
    report, status = {"refused": _NO_REPORT}, None
    for line in b"".join(chunks).splitlines():
        if line.strip():
            obj = json.loads(line)
            if "status" in obj:
                status = obj["status"]
            else:
                report = obj
    return report, status


def _head(path: str, n: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


def _user_tasks(uid: int) -> int:
    """Tasks (processes and threads) ``uid`` runs now: RLIMIT_NPROC counts them all for a normal user."""
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    n += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                pass
    return n


def _make_cgroups(config: SandboxConfig):
    """``(RunGroups, None)``, or ``(None, why not)``: never a group whose limits could not be written."""
    limits = cgroups.Limits(
        memory_bytes=(config.memory_mb + _LAUNCHER_OVERHEAD_MB) << 20,  # launcher + PID 1
        pids=config.max_processes + 2,
        cpu_cores=config.cpu_cores,
    )
    try:
        return cgroups.make(limits, config.cgroup_parent), None
    except cgroups.CgroupUnavailable as e:
        return None, f"no cgroup: {e}"
