"""What model code must not reach: host files, host processes' /proc, the host disk, host sockets, CPU.

Each attack is run twice where the host allows it: with the default sandbox (contained) and with the
layer that stops it turned off (the attack succeeds), so that each test can fail. A test skips only
when the host cannot provide the layer, with the reason.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

import gspo_mcore
from gspo_mcore.sandbox import SandboxConfig, SandboxUnavailable, cgroups, probe, run_python

SMALL = SandboxConfig(cpu_time_s=2, wall_time_s=20, memory_mb=256, max_processes=8, max_file_mb=1, tmpfs_mb=8)
LAYERS = set(probe(SMALL))
# The layer turned off: the program sees the host's tree (read-only) and, without namespaces, its /proc.
NO_ROOT = dataclasses.replace(SMALL, private_root=False, require=())
NO_NAMESPACES = dataclasses.replace(SMALL, namespaces=False, require=())
PROJECT = Path(gspo_mcore.__file__).resolve().parent.parent


def needs(*layers):
    missing = set(layers) - LAYERS
    return pytest.mark.skipif(bool(missing), reason=f"host cannot provide {sorted(missing)} (have {sorted(LAYERS)})")


def _reachable_by_others(path: Path) -> bool:
    return all(p.stat().st_mode & 0o001 for p in [path, *path.parents])


@pytest.fixture
def host_secret():
    """A world-readable file on the host, outside the sandbox's work directory (like a dataset): beside the
    project, or in /var/cache when the project lies under /tmp (the sandbox's private /tmp and /var/tmp hide
    those anyway, so the control run could not tell the private root's effect apart)."""
    private = (Path("/tmp"), Path("/var/tmp"))
    places = [
        p
        for p in (PROJECT, Path("/var/cache"))
        if _reachable_by_others(p) and not any(p.is_relative_to(q) for q in private) and os.access(p, os.W_OK)
    ]
    if not places:
        pytest.skip(f"neither {PROJECT} nor /var/cache is a writable, world-reachable folder outside /tmp")
    path = places[0] / f".sandbox-secret-{uuid.uuid4().hex}.jsonl"
    path.write_text('{"answer": "SECRET-ANSWER"}\n')
    path.chmod(0o644)
    yield path
    path.unlink()


READ = "import sys\ntry:\n    print(open(sys.argv[1]).read())\nexcept OSError as e:\n    print('denied', e.errno)"


@needs("private_root")
def test_host_files_outside_the_work_dir_are_invisible(host_secret):
    r = run_python(READ, args=(str(host_secret),), config=SMALL)
    assert r.ok, r.stderr
    assert b"SECRET-ANSWER" not in r.stdout and r.stdout.strip() == b"denied 2"  # ENOENT: not there at all
    control = run_python(READ, args=(str(host_secret),), config=NO_ROOT)
    assert b"SECRET-ANSWER" in control.stdout  # the file is readable by the sandbox uid: only the root hides it


@needs("private_root")
def test_the_interpreter_still_has_its_standard_library():
    src = "import json, sqlite3, ssl, decimal, multiprocessing, os\nprint(json.dumps(sorted(os.listdir('/'))))"
    r = run_python(src, config=SMALL)
    assert r.ok, r.stderr
    assert "work" not in r.stdout.decode() and "root" not in r.stdout.decode()


@needs("pidns", "private_proc")
def test_other_processes_proc_entries_are_invisible():
    tag = f"gspo-sentinel-{uuid.uuid4().hex}"
    sentinel = subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(60)", tag])
    src = f"""
import os
seen = []
for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
    try:
        if {tag!r}.encode() in open(f"/proc/{{pid}}/cmdline", "rb").read():
            seen.append(pid)
    except OSError:
        pass
print("SEEN" if seen else "unseen", len(os.listdir("/proc")) if os.path.isdir("/proc") else 0)
"""
    try:
        r = run_python(src, config=SMALL)
        assert r.ok and r.stdout.split()[0] == b"unseen", r.stdout + r.stderr
        control = run_python(src, config=NO_NAMESPACES)
        assert control.stdout.split()[0] == b"SEEN"  # the host's /proc shows it to the same program
    finally:
        sentinel.kill()
        sentinel.wait()


FILL = """
import errno, os
written, err = 0, None
try:
    for i in range(10_000):
        with open(f"fill-{i}", "wb") as f:
            for _ in range(4):
                f.write(b"x" * (240 << 10))  # files under RLIMIT_FSIZE (1 MiB)
                f.flush()
                written += 240 << 10
        if written > CAP:
            break
except OSError as e:
    err = errno.errorcode.get(e.errno, e.errno)
print(written >> 20, err)
"""


@needs("private_root")
def test_filling_the_disk_stops_at_the_tmpfs_cap():
    cap = 4 * SMALL.tmpfs_mb << 20  # the control stops here: 32 MiB of host disk at most
    r = run_python(f"CAP = {cap}\n" + FILL, config=SMALL)
    assert r.ok, r.stderr
    mib, err = r.stdout.split()
    assert err == b"ENOSPC" and int(mib) <= SMALL.tmpfs_mb
    control = run_python(f"CAP = {cap}\n" + FILL, config=NO_ROOT)  # the work dir on the host's disk
    assert control.stdout.split()[1] == b"None" and int(control.stdout.split()[0]) > SMALL.tmpfs_mb


CONNECT = """
import _socket, sys  # _socket: past any guard in the interpreter
for target in sys.argv[1:]:
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        s.connect(target.replace("@", "\\0", 1) if target.startswith("@") else target)
        print("CONNECTED", target)
    except OSError as e:
        print("refused", e.errno)
"""


@needs("netns", "private_root")
def test_unix_sockets_of_the_host_are_unreachable():
    if not _reachable_by_others(PROJECT):
        pytest.skip(f"{PROJECT} is not reachable by other users")
    path = PROJECT / f".s-{uuid.uuid4().hex[:8]}"
    abstract = f"gspo-test-{uuid.uuid4().hex}"
    servers = []
    try:
        for addr in (str(path), "\0" + abstract):
            srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            srv.bind(addr)
            srv.listen()
            srv.setblocking(False)
            servers.append(srv)
        path.chmod(0o777)
        targets = (str(path), "@" + abstract)
        r = run_python(CONNECT, args=targets, config=SMALL)
        assert r.ok, r.stderr
        assert b"CONNECTED" not in r.stdout and r.stdout.count(b"refused") == 2
        for srv in servers:
            with pytest.raises(BlockingIOError):
                srv.accept()
        control = run_python(CONNECT, args=targets, config=NO_NAMESPACES)
        assert control.stdout.count(b"CONNECTED") == 2  # reachable without the namespaces: the test can fail
    finally:
        for srv in servers:
            srv.close()
        path.unlink(missing_ok=True)


BURN = """
import hashlib, threading
data = b"x" * (1 << 20)
def burn():
    while True:
        hashlib.sha256(data).digest()  # releases the GIL: the threads run on every core
threads = [threading.Thread(target=burn, daemon=True) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


def test_a_multithreaded_cpu_burn_is_killed_by_the_cpu_limit():
    r = run_python(BURN, config=dataclasses.replace(SMALL, cpu_time_s=1, wall_time_s=60))
    assert r.cpu_limited and not r.timed_out and not r.ok


# ----------------------------------------------------------------------------------------------- cgroups

VERSION, WHERE = cgroups.availability()


@pytest.mark.skipif(VERSION is None, reason=f"no cgroup layer on this host: {WHERE}")
def test_run_cgroups_get_their_limits_and_are_removed():
    groups = cgroups.make(cgroups.Limits(memory_bytes=200 << 20, pids=7, cpu_cores=0.5))
    try:
        files = {}
        for d in groups.dirs:
            for name in ("memory.max", "memory.limit_in_bytes", "pids.max", "cpu.max", "cpu.cfs_quota_us"):
                if Path(d, name).exists():
                    files[name] = Path(d, name).read_text().strip()
        assert files.get("memory.max", files.get("memory.limit_in_bytes")) == str(200 << 20)
        assert files["pids.max"] == "7"
        if "cpu.max" in files or "cpu.cfs_quota_us" in files:
            assert files.get("cpu.max", files.get("cpu.cfs_quota_us")) in ("50000 100000", "50000")
        own = cgroups._own_paths()
        assert all(own.get("", own.get("memory", "")) in d or own.get("pids", "") in d for d in groups.dirs)
    finally:
        for d in groups.dirs:
            cgroups.remove(d)
    assert not any(os.path.exists(d) for d in groups.dirs)


@pytest.mark.skipif(VERSION is None, reason=f"no cgroup layer on this host: {WHERE}")
def test_no_cgroup_is_left_after_runs():
    parents = {
        os.path.dirname(d) for d in cgroups.make(cgroups.Limits(memory_bytes=1 << 30, pids=4, cpu_cores=None)).dirs
    }
    for p in parents:
        for d in Path(p).glob(f"gspo-sandbox-{os.getpid()}-*"):
            cgroups.remove(str(d))
    run_python("import os\nos.fork()", config=SMALL)
    assert [d for p in parents for d in Path(p).glob(f"gspo-sandbox-{os.getpid()}-*")] == []


def test_without_a_cgroup_layer_the_sandbox_warns_once_and_require_cgroup_refuses(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(cgroups, "_warned", threading.Event())
    bogus = SandboxConfig(cgroup_parent=str(tmp_path / "not-a-cgroup"), require=())
    with caplog.at_level(logging.WARNING, logger="gspo_mcore.sandbox.cgroups"):
        r1 = run_python("print(1)", config=bogus)
        r2 = run_python("print(2)", config=bogus)
    assert r1.ok and r2.ok and "cgroup" not in r1.layers
    warnings = [rec for rec in caplog.records if "NO CGROUP LAYER" in rec.getMessage()]
    assert len(warnings) == 1 and "not-a-cgroup" in warnings[0].getMessage()
    with pytest.raises(SandboxUnavailable, match="require_cgroup"):
        run_python("print(3)", config=dataclasses.replace(bogus, require_cgroup=True))
