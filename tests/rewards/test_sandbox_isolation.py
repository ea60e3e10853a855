"""The system-call allow-list, samples scored side by side, what the sandbox shows of the host, and capabilities.

Each attack runs with the layer that stops it (it fails) and without it (the control: it succeeds), so
every test can fail. Two samples of a group are scored concurrently by the runner; the collusion tests
run a publisher and a reader at the same time through every channel of shared kernel state we know of.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import subprocess
import threading
import uuid

import pytest

from gspo_mcore.sandbox import SandboxConfig, SandboxUnavailable, probe, run_python, startup_check, syscalls
from gspo_mcore.sandbox import run as sandbox_mod

SMALL = SandboxConfig(cpu_time_s=5, wall_time_s=30, memory_mb=256, max_processes=8, max_file_mb=1, tmpfs_mb=8)
LAYERS = set(probe(SMALL))
NO_FILTER = dataclasses.replace(SMALL, seccomp=False)
NO_NAMESPACES = dataclasses.replace(SMALL, namespaces=False, require=())


def needs(*layers):
    missing = set(layers) - LAYERS
    return pytest.mark.skipif(bool(missing), reason=f"host cannot provide {sorted(missing)} (have {sorted(LAYERS)})")


# ----------------------------------------------------------------------------------- system-call filter

SYSCALLS = r"""
import ctypes, errno, fcntl, os
libc = ctypes.CDLL(None, use_errno=True)
def call(name, fn):
    try:
        rc = fn()
    except OSError as e:
        print(name, errno.errorcode[e.errno]); return
    err = ctypes.get_errno()
    print(name, "ok" if rc >= 0 else errno.errorcode.get(err, err))
f = open(os.__file__, "rb")
call("flock", lambda: fcntl.flock(f, fcntl.LOCK_SH) or 0)
call("posix_lock", lambda: fcntl.lockf(f, fcntl.LOCK_SH) or 0)
call("inotify", lambda: libc.inotify_init1(0))
call("ptrace", lambda: libc.ptrace(16, os.getppid(), 0, 0))  # PTRACE_ATTACH
call("unshare_user", lambda: libc.unshare(0x10000000))
call("keyctl", lambda: libc.syscall(250, 0, -3))  # keyctl(KEYCTL_GET_KEYRING_ID, session)
call("inet_socket", lambda: libc.socket(2, 1, 0))
"""


@needs("seccomp")
def test_the_filter_refuses_what_no_program_needs_and_the_control_allows_it():
    r = run_python(SYSCALLS, config=SMALL)
    assert r.ok, r.stderr
    got = dict(line.split() for line in r.stdout.decode().splitlines())
    assert got == {name: "EPERM" for name in got} and len(got) == 7, got
    control = run_python(SYSCALLS, config=NO_FILTER)
    seen = dict(line.split() for line in control.stdout.decode().splitlines())
    # as the sandbox uid in its namespaces: locks and inotify work, keyrings exist; ptrace of a root
    # process, a user namespace inside a chroot-like root, and AF_INET without the filter differ by host
    assert seen["flock"] == seen["posix_lock"] == seen["inotify"] == "ok", seen


@needs("seccomp")
def test_cpython_and_its_library_run_under_the_filter():
    src = (
        "import json, sqlite3, ssl, decimal, asyncio, threading, multiprocessing, subprocess, sys, tempfile, shutil\n"
        "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
        "asyncio.run(asyncio.sleep(0))\n"
        "d = tempfile.mkdtemp(); open(d + '/a', 'w').write('x'); shutil.copy2(d + '/a', d + '/b')\n"
        "print(subprocess.run([sys.executable, '-S', '-c', 'print(6 * 7)'], capture_output=True).stdout.decode())\n"
        "print(sqlite3.connect(':memory:').execute('select 1').fetchone())\n"
    )
    r = run_python(src, config=SMALL)
    assert r.ok, r.stderr
    assert r.stdout.decode().split() == ["thread", "42", "(1,)"]


def test_without_a_filter_the_sandbox_warns_once_and_require_seccomp_refuses(monkeypatch, caplog):
    monkeypatch.setattr(syscalls, "availability", lambda: (None, "pyseccomp missing (test)"))
    monkeypatch.setattr(syscalls, "_warned", threading.Event())
    cfg = dataclasses.replace(SMALL, require=())
    with caplog.at_level(logging.WARNING, logger="gspo_mcore.sandbox.syscalls"):
        layers = startup_check(cfg)  # the start-up probe reports per layer
        r = run_python("print(1)", config=cfg)
    assert r.ok and "seccomp" not in layers and "seccomp" not in r.layers
    warnings = [rec for rec in caplog.records if "NO SYSTEM-CALL FILTER" in rec.getMessage()]
    assert len(warnings) == 1 and "pyseccomp missing (test)" in warnings[0].getMessage()
    with pytest.raises(SandboxUnavailable, match="require_seccomp"):
        run_python("print(2)", config=dataclasses.replace(cfg, require_seccomp=True))


def test_a_filter_the_kernel_refuses_is_refused_when_required(monkeypatch):
    """A filter that cannot be loaded (here: a malformed program) stops a run that requires it, before
    the program starts; without the requirement the run goes on without the layer."""
    monkeypatch.setattr(syscalls, "availability", lambda: (b"\x00" * 8, ""))
    r = run_python("print('ran')", config=dataclasses.replace(SMALL, require=()))
    assert r.ok and "seccomp" not in r.layers
    with pytest.raises(SandboxUnavailable, match="seccomp"):
        run_python("print('ran')", config=dataclasses.replace(SMALL, require=(), require_seccomp=True))


# --------------------------------------------------------------------- samples scored at the same time

PUBLISH = r"""
import fcntl, os, sys, time
lib = os.path.dirname(os.__file__)
done = []
f = open(os.path.join(lib, "this.py"), "rb")          # a file every sandbox sees (read-only bind)
try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB); done.append("flock")
except OSError:
    pass
g = open(os.path.join(lib, "antigravity.py"), "rb")
try:
    fcntl.lockf(g, fcntl.LOCK_SH | fcntl.LOCK_NB); done.append("posix_lock")
except OSError:
    pass
import _socket
try:
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    s.bind("\0" + sys.argv[2]); s.listen(); done.append("abstract_socket")
except OSError:
    pass
print("published", *done, flush=True)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:                          # file opens the reader's inotify would see
    open(os.path.join(lib, "__phello__", "spam.py"), "rb").close()
    time.sleep(0.02)
"""

READ = r"""
import ctypes, fcntl, os, struct, sys, time
lib = os.path.dirname(os.__file__)
libc = ctypes.CDLL(None, use_errno=True)
seen = set()
ino = libc.inotify_init1(os.O_NONBLOCK)
if ino >= 0:
    libc.inotify_add_watch(ino, os.path.join(lib, "__phello__").encode(), 0x20)  # IN_OPEN
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end and len(seen) < 4:
    with open(os.path.join(lib, "this.py"), "rb") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno == 11:
                seen.add("flock")
    with open(os.path.join(lib, "antigravity.py"), "rb") as g:
        try:
            got = fcntl.fcntl(g, fcntl.F_GETLK, struct.pack("hhqqi", fcntl.F_WRLCK, 0, 0, 0, 0))
            if struct.unpack("hhqqi", got)[0] != fcntl.F_UNLCK:
                seen.add("posix_lock")
        except OSError:
            pass
    if ino >= 0:
        try:
            if os.read(ino, 4096):
                seen.add("inotify")
        except BlockingIOError:
            pass
    import _socket
    try:
        c = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        c.connect("\0" + sys.argv[2]); seen.add("abstract_socket")
    except OSError:
        pass
    time.sleep(0.05)
print("seen", *sorted(seen))
"""
CHANNELS = {"flock", "posix_lock", "inotify", "abstract_socket"}


def _side_by_side(config: SandboxConfig, seconds: float = 6.0) -> tuple[set[str], set[str]]:
    """A publisher and a reader run at the same time; what each managed."""
    out = {}
    name = f"gspo-collude-{uuid.uuid4().hex}"

    def run(key, src):
        out[key] = run_python(src, args=(str(seconds), name), config=config)

    threads = [threading.Thread(target=run, args=(k, s)) for k, s in (("pub", PUBLISH), ("read", READ))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out["pub"].ok and out["read"].ok, (out["pub"].stderr, out["read"].stderr)
    return {w.decode() for w in out["pub"].stdout.split()[1:]}, {w.decode() for w in out["read"].stdout.split()[1:]}


@needs("seccomp", "netns")
def test_two_samples_at_once_share_no_kernel_state():
    published, seen = _side_by_side(SMALL)
    # the filter refuses locks and inotify outright; a socket name is published, in the run's own namespace
    assert published == {"abstract_socket"} and seen == set(), (published, seen)
    # The controls: the filter off, locks and inotify carry data between the two runs ...
    _, seen_unfiltered = _side_by_side(NO_FILTER)
    assert {"flock", "posix_lock", "inotify"} <= seen_unfiltered, seen_unfiltered
    # ... and without the network namespaces (and the filter) so does an abstract Unix socket.
    _, seen_shared_net = _side_by_side(dataclasses.replace(NO_NAMESPACES, seccomp=False))
    assert "abstract_socket" in seen_shared_net, seen_shared_net


# ------------------------------------------------------------------------------- what shows of the host

IDENTITY = r"""
import os
print(os.uname().nodename)
print(open("/proc/1/cmdline", "rb").read().decode(errors="replace").replace("\0", " ").replace("\n", " "))
print(open("/proc/self/cgroup").read().replace("\n", " "))
print(open("/proc/self/mountinfo").read().replace("\n", " "))
"""


@needs("utsns", "hostname", "pidns", "private_proc", "cgroupns")
def test_the_host_is_hidden_hostname_launcher_arguments_and_cgroup_paths():
    host = socket.gethostname()
    r = run_python(IDENTITY, config=SMALL)
    assert r.ok, r.stderr
    nodename, cmdline, cgroup, mounts = r.stdout.decode().split("\n")[:4]
    assert cmdline.startswith("sandbox-launcher") and "os.read(fd" in cmdline  # all of it (its -c code has newlines)
    assert nodename == "sandbox" != host
    seen = cmdline + cgroup + mounts
    leaks = [f"gspo-sandbox-{os.getpid()}", "gspo-sandbox-", os.path.dirname(sandbox_mod.__file__)]
    assert not [x for x in leaks if x in seen], (seen, leaks)
    assert "sandbox-launcher" in cmdline  # PID 1: the launcher, without its plan
    control = run_python(IDENTITY, config=NO_NAMESPACES)  # the host's UTS name and cgroup paths
    c_nodename, _, c_cgroup = control.stdout.decode().split("\n")[:3]
    assert c_nodename == host
    if "cgroup" in LAYERS:
        assert f"gspo-sandbox-{os.getpid()}-" in c_cgroup


# ---------------------------------------------------------------------------------------- capabilities

CAPS = r"""
import os
try:
    with open("/proc/self/status") as f:
        print(" ".join(line.split(":")[0] + "=" + line.split()[1] for line in f if line.startswith("Cap")))
except OSError:
    print("no-proc")
with open("mode-000", "w") as f:
    f.write("x")
os.chmod("mode-000", 0)
try:
    open("mode-000").close()
    print("dac_override")      # only a process holding CAP_DAC_OVERRIDE opens a mode-000 file
except PermissionError:
    print("no_dac_override")
print(os.getuid())
"""
_NO_CAP_DROP = (b"        _drop_capabilities(report)\n", b"        pass\n")


def _caps(stdout: bytes) -> tuple[dict[str, str], str, int]:
    status, dac, uid = stdout.decode().split("\n")[:3]
    caps = dict(kv.split("=") for kv in status.split()) if status != "no-proc" else {}
    return caps, dac, int(uid)


@needs("no_caps")
def test_the_program_holds_no_capability_and_its_bounding_set_is_empty(monkeypatch):
    r = run_python(CAPS, config=SMALL)
    assert r.ok, r.stderr
    caps, dac, _ = _caps(r.stdout)
    assert dac == "no_dac_override"
    if "private_proc" in LAYERS:
        assert set(caps.values()) == {"0" * 16} and len(caps) == 5, caps  # CapBnd included: none to regain
    source = sandbox_mod._LAUNCHER_SOURCE
    assert _NO_CAP_DROP[0] in source
    monkeypatch.setattr(sandbox_mod, "_LAUNCHER_SOURCE", source.replace(*_NO_CAP_DROP))  # the control
    control = run_python(CAPS, config=SMALL)
    caps, dac, uid = _caps(control.stdout)
    assert "no_caps" not in control.layers
    if caps:  # the bounding set stays full (as root the uid drop still empties the others)
        assert caps["CapBnd"] != "0" * 16, caps
    if uid == 0:  # root in a user namespace: it holds every capability there
        assert dac == "dac_override"


AS_USER = r"""
import sys, types
tree, weaken = sys.argv[1], sys.argv[2] == "1"
for name in ("gspo_mcore", "gspo_mcore.sandbox"):  # the sandbox alone (no torch, no package __init__)
    pkg = types.ModuleType(name)
    pkg.__path__ = [tree + "/" + name.replace(".", "/")]
    sys.modules[name] = pkg
from gspo_mcore.sandbox import run as sandbox
if weaken:
    step = b"        _drop_capabilities(report)\n"
    assert step in sandbox._LAUNCHER_SOURCE
    sandbox._LAUNCHER_SOURCE = sandbox._LAUNCHER_SOURCE.replace(step, b"        pass\n")
cfg = sandbox.SandboxConfig(cpu_time_s=5, wall_time_s=30, memory_mb=256, max_processes=8, use_cgroup=False)
r = sandbox.run_python(sys.stdin.read(), config=cfg)
sys.stdout.write(" ".join(r.layers) + "\n" + r.stdout.decode())
"""


def _as_nobody(weaken: bool) -> tuple[set[str], dict[str, str], str, int]:
    tree = os.path.dirname(os.path.dirname(sandbox_mod.__file__)).rsplit("/", 1)[0]
    r = subprocess.run(
        ["/usr/bin/python3", "-I", "-c", AS_USER, tree, str(int(weaken))],
        input=CAPS.encode(),
        capture_output=True,
        user=65534,
        group=65534,
        extra_groups=[],
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    layers, rest = r.stdout.split(b"\n", 1)
    return set(layers.decode().split()), *_caps(rest)


def _nobody_can_run_the_sandbox() -> bool:
    if os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK):
        return False
    recent = "import sys; sys.exit(sys.version_info < (3, 10))"  # what the package's sources need
    if subprocess.run(["/usr/bin/python3", "-I", "-c", recent], capture_output=True).returncode != 0:
        return False
    tree = os.path.dirname(os.path.dirname(sandbox_mod.__file__))
    return subprocess.run(["test", "-r", tree + "/sandbox/run.py"], user=65534, cwd="/").returncode == 0


@pytest.mark.skipif(
    not _nobody_can_run_the_sandbox(), reason="needs root, /usr/bin/python3 (3.10+) and a world-readable tree"
)
def test_in_user_namespace_mode_root_in_the_sandbox_holds_no_capability():
    """As a normal user the program runs as root of its own user namespace: without the dropped bounding
    set it would hold every capability there (the control opens a mode-000 file); with it, none."""
    layers, caps, dac, uid = _as_nobody(weaken=False)
    if "userns" not in layers:
        pytest.skip(f"no user namespace for a normal user here (layers {sorted(layers)})")
    assert uid == 0 and "no_caps" in layers and dac == "no_dac_override", (layers, caps, dac)
    if caps:
        assert set(caps.values()) == {"0" * 16}, caps
    _, _, c_dac, c_uid = _as_nobody(weaken=True)
    assert (c_uid, c_dac) == (0, "dac_override")
