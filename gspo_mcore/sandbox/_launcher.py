"""Sandbox launcher: a script, never imported by the package (it must run with ``python -I -S``).

``run.py`` starts it in a fresh session with the run's work directory as cwd, as
``python -I -S -B -c BOOT <source fd> <plan fd> <status fd>``: its own source and the JSON plan come
through inherited descriptors (read, then closed), never on the command line, so ``/proc/1/cmdline``
in the sandbox shows no host pid or path; a pipe for the report is the status fd. It then, in this order:

0. dies with its caller (parent-death signal) and joins the run's cgroups, if any;
1. enters new namespaces where the kernel lets it: network (no interfaces but a down loopback), mount,
   PID, IPC, UTS (then sets the hostname ``plan["hostname"]``: the host's stays hidden), cgroup (the
   run's cgroup is the root of what ``/proc/self/cgroup`` shows); as a non-root user through a user
   namespace;
2. in the mount namespace (made private first, so nothing propagates to the host) builds a private
   root: a small tmpfs holding read-only binds of the plan's ``root_paths`` (/usr, /bin, /lib*, the
   interpreter's prefix), a few device nodes, an empty /proc, and a ``tmpfs_bytes`` tmpfs at /tmp
   with a copy of the work directory at ``/tmp/sandbox``; then ``pivot_root`` into it and detaches the
   host's tree (nothing else of the host stays reachable; the run writes nothing to the host's disk).
   Where that fails: remounts every mount read-only, mounts private, size-capped tmpfs over the
   world-writable directories (``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run/lock``) and bind-mounts
   the work directory, writable, at ``/tmp/sandbox`` (no 'private_root' layer);
3. becomes a child subreaper and forks; with a PID namespace the child is the namespace's PID 1, an
   init that mounts a fresh ``/proc`` (host processes become invisible) and forks the program (when
   PID 1 exits the kernel kills every process left in the namespace, including ones that left the
   process group; PID 1 then points its standard descriptors at ``/dev/null``); without one the child
   is the program;
4. in the program's process: joins the cgroups the plan names, sets the resource limits, drops to the
   sandbox uid/gid with no supplementary groups when it runs as root (first it empties the capability
   bounding, ambient and inheritable sets: as root in a user namespace, the program gets no capability
   on ``execve``, and nothing it starts can regain one), sets ``no_new_privs`` (setuid
   binaries cannot regain root) and a parent-death signal, loads the system-call allow-list the plan
   carries (``syscalls.py``: a BPF program exported by libseccomp on the host), writes the report of
   what held to the pipe, and ``execve``s the program with a clean environment (the pipe is
   close-on-exec);
5. the program's parent writes its raw wait status to the pipe (``{"status": ...}``) and exits.

A layer the plan marks as required that cannot be applied stops the run before any untrusted code runs
(exit code 125, with the reason in the report).
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_NOATIME, MS_NODIRATIME = 1, 2, 4, 8, 32, 1024, 2048
MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 4096, 16384, 1 << 18, 1 << 21, 1 << 24
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 22, 36, 38
PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
SECCOMP_MODE_FILTER = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203, "s390x": 217}
DEVICES = ("null", "zero", "full", "random", "urandom")
REFUSED = 125
WRITABLE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
SANDBOX_DIR = "/tmp/sandbox"

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _unshare(flags):
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def _mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _pivot_root(new, old):
    nr = SYS_PIVOT_ROOT.get(os.uname().machine)
    if nr is None:
        raise OSError(0, f"pivot_root: unknown syscall number on {os.uname().machine}")
    _check(_libc.syscall(ctypes.c_long(nr), new.encode(), old.encode()), "pivot_root")


def _prctl(option, value):
    _check(_libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0), "prctl")


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _load_seccomp(bpf_hex, report):
    """Load the allow-list (needs no_new_privs); from here on every syscall of this process is filtered."""
    program = bytes.fromhex(bpf_hex)
    buf = ctypes.create_string_buffer(program, len(program))
    prog = _SockFprog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
    _check(_libc.prctl(PR_SET_SECCOMP, ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.byref(prog), 0, 0), "seccomp")
    report["layers"].append("seccomp")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _drop_capabilities(report):
    """Empty the capability bounding set, the ambient set and the inheritable set: a program started as
    root (in its user namespace) gets no capability on ``execve``, and nothing it starts can regain one."""
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
    except (OSError, ValueError):
        last = 63  # PR_CAPBSET_DROP of a capability this kernel lacks fails with EINVAL: stop there
    for cap in range(last + 1):
        if _libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0) != 0:
            if ctypes.get_errno() == 22 and cap > 0:  # EINVAL: past the kernel's last capability
                break
            _check(-1, f"PR_CAPBSET_DROP {cap}")
    _check(_libc.prctl(PR_CAP_AMBIENT, ctypes.c_ulong(PR_CAP_AMBIENT_CLEAR_ALL), 0, 0, 0), "PR_CAP_AMBIENT")
    header, data = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    _check(_libc.capget(ctypes.byref(header), data), "capget")
    for d in data:
        d.inheritable = 0
    _check(_libc.capset(ctypes.byref(header), data), "capset")
    report["layers"].append("no_caps")


def _set_hostname(name, report):
    raw = name.encode()
    try:
        _check(_libc.sethostname(raw, ctypes.c_size_t(len(raw))), "sethostname")
        _check(_libc.setdomainname(raw, ctypes.c_size_t(len(raw))), "setdomainname")
        report["layers"].append("hostname")
    except OSError as e:
        report["notes"].append(str(e))


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _enter_namespaces(plan, report):
    """Namespaces first all at once, then one by one (a kernel may allow some and not others)."""
    wanted = {
        "net": CLONE_NEWNET,
        "mount": CLONE_NEWNS,
        "pid": CLONE_NEWPID,
        "ipc": CLONE_NEWIPC,
        "uts": CLONE_NEWUTS,
        "cgroup": CLONE_NEWCGROUP,
    }
    need_user = os.geteuid() != 0  # without root, namespaces need a user namespace of our own
    uid, gid = os.geteuid(), os.getegid()
    try:
        _unshare((CLONE_NEWUSER if need_user else 0) | sum(wanted.values()))
        got = set(wanted)
    except OSError as e:
        report["notes"].append(f"unshare(all): {e}")
        got = set()
        for name, flag in wanted.items():
            user = CLONE_NEWUSER if need_user and not got else 0  # the user namespace only once
            try:
                _unshare(user | flag)
                got.add(name)
            except OSError as e2:
                report["notes"].append(f"unshare({name}): {e2}")
    if need_user and got:  # map ourselves to root inside the new user namespace, with caps only there
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"0 {uid} 1")
        _write("/proc/self/gid_map", f"0 {gid} 1")
        report["layers"].append("userns")
    report["layers"] += [f"{n}ns" for n in sorted(got)]
    if "uts" in got:
        _set_hostname(plan["hostname"], report)
    return got


def _mount_points():
    """(mount point, per-mount flags to keep) of every mount, from /proc/self/mountinfo."""
    keep = {
        "nosuid": MS_NOSUID,
        "nodev": MS_NODEV,
        "noexec": MS_NOEXEC,
        "noatime": MS_NOATIME,
        "nodiratime": MS_NODIRATIME,
        "relatime": MS_RELATIME,
        "strictatime": MS_STRICTATIME,
    }
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")  # \040 etc.
            out.append((point, sum(keep.get(o, 0) for o in fields[5].split(",")), "ro" in fields[5].split(",")))
    return out


def _read_only_everywhere(report):
    """Remount every mount of this (private) namespace read-only: the host filesystem cannot be written."""
    failed = []
    for point, flags, already in _mount_points():
        if already:
            continue
        try:
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
        except OSError as e:
            failed.append(f"{point}: {e.strerror}")
    if failed:
        report["notes"].append(f"not remounted read-only: {failed}")
    else:
        report["layers"].append("readonly_fs")


def _mount_flags_of(path, mounts):
    """Flags of the mount holding ``path`` (a user namespace may not drop them on a bind remount)."""
    best = ("", 0)
    for point, flags, _ in mounts:
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best[0]):
            best = (point, flags)
    return best[1]


def _read_tree(top):
    out = {}
    for root, _, names in os.walk(top):
        for n in names:
            p = os.path.join(root, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, top)] = f.read()
    return out


def _private_root(plan, report):
    """A fresh root with only the system directories (read-only), /dev nodes, /proc and a capped /tmp."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # first: nothing below may propagate to the host
    files = _read_tree(".")
    mounts = _mount_points()
    new = plan["root_dir"]
    _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for src in plan["root_paths"]:
        dst = new + src
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if os.path.islink(src):
            os.symlink(os.readlink(src), dst)
            continue
        if os.path.isdir(src):
            os.mkdir(dst)
        else:
            open(dst, "w").close()
        _mount(src, dst, None, MS_BIND | MS_REC)
        _mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | _mount_flags_of(src, mounts))
    os.mkdir(new + "/dev", 0o755)
    for name in DEVICES:
        open(f"{new}/dev/{name}", "w").close()
        _mount(f"/dev/{name}", f"{new}/dev/{name}", None, MS_BIND)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("shm", "/tmp"),
    ):
        os.symlink(target, f"{new}/dev/{name}")
    os.mkdir(new + "/proc", 0o555)
    os.makedirs(new + "/var", 0o755)
    os.symlink("/tmp", new + "/var/tmp")
    os.mkdir(new + "/tmp")
    _mount("tmpfs", new + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={plan['tmpfs_bytes']},mode=1777")
    work = new + SANDBOX_DIR
    os.mkdir(work, 0o700)
    owner = (plan["uid"], plan["gid"]) if os.geteuid() == 0 and plan["uid"] is not None else None
    for rel, data in files.items():
        path = os.path.join(work, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    if owner:
        for root, dirs, names in os.walk(work):
            for n in [root] + [os.path.join(root, x) for x in dirs + names]:
                os.chown(n, *owner)
    os.chdir(new)
    _pivot_root(".", ".")  # the old root is stacked on the new one: detach it
    _check(_libc.umount2(b".", ctypes.c_int(MNT_DETACH)), "umount old root")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(SANDBOX_DIR)
    report["layers"] += ["private_root", "readonly_fs", "private_tmp"]
    report["cwd"] = SANDBOX_DIR


def _private_mounts(plan, report):
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # first: nothing below may propagate to the host
    _read_only_everywhere(report)
    size = f"size={plan['tmpfs_bytes']},mode=1777"
    for d in WRITABLE_DIRS:
        if os.path.isdir(d) and not os.path.islink(d):
            try:
                _mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, size)
            except OSError as e:
                report["notes"].append(str(e))
    # cwd still refers to the work directory even if a tmpfs now hides its path: bind it back.
    os.makedirs(SANDBOX_DIR, exist_ok=True)
    os.chmod(SANDBOX_DIR, 0o755)
    _mount(".", SANDBOX_DIR, None, MS_BIND)
    _mount(None, SANDBOX_DIR, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)  # writable again
    os.chdir(SANDBOX_DIR)
    report["layers"].append("private_tmp")
    report["cwd"] = SANDBOX_DIR


def _set_limits(plan):
    lim = plan["limits"]
    cpu = int(lim["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at cpu, SIGKILL a second later
    resource.setrlimit(resource.RLIMIT_AS, (lim["as_bytes"], lim["as_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (lim["fsize_bytes"], lim["fsize_bytes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (lim["nofile"], lim["nofile"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NPROC, (lim["nproc"], lim["nproc"]))


def _join_cgroups(plan, report):
    """Move this launcher (and so everything it starts) into the run's cgroups, before any namespace."""
    if not plan.get("cgroup_procs"):
        return
    for path in plan["cgroup_procs"]:
        try:
            _write(path, str(os.getpid()))
        except OSError as e:
            report["notes"].append(f"cgroup {path}: {e}")
            return
    report["layers"].append("cgroup")


def _program(plan, report, status_fd):
    """In the process that becomes the program: limits, privilege drop, report, exec."""
    try:  # under memory pressure the kernel kills the program's processes first, not the launcher's
        _write("/proc/self/oom_score_adj", "1000")
    except OSError as e:
        report["notes"].append(f"oom_score_adj: {e}")
    _set_limits(plan)
    report["layers"].append("rlimits")
    try:  # before the uid drop, which needs no capability but ends the right to change the bounding set
        _drop_capabilities(report)
    except OSError as e:
        report["notes"].append(str(e))
    if os.geteuid() == 0 and "userns" not in report["layers"]:
        os.setgroups([])
        os.setgid(plan["gid"])
        os.setuid(plan["uid"])  # irreversible: real, effective and saved uid
        report["layers"].append("uid")
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
    report["layers"].append("no_new_privs")
    if plan.get("seccomp_bpf"):
        try:
            _load_seccomp(plan["seccomp_bpf"], report)
        except OSError as e:
            report["notes"].append(str(e))
    missing = [layer for layer in plan["require"] if not _holds(layer, report["layers"])]
    if missing:
        report["refused"] = f"required isolation unavailable: {missing}"
    _send(status_fd, report)
    if missing:
        os._exit(REFUSED)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    # Without a network namespace: a socket block inside the interpreter (best effort, not a boundary).
    argv = plan["argv"] if "netns" in report["layers"] else plan["guard_argv"]
    os.execve(argv[0], argv, {**plan["env"], "HOME": os.getcwd()})  # the status pipe is close-on-exec


def _init(plan, report, status_fd):
    """PID 1 of the new PID namespace: fresh /proc, then the program as its child; reports its status.

    The program must not be PID 1 itself: the kernel drops signals to a namespace's init that it has no
    handler for, SIGXCPU (the CPU limit) included. When this process exits, the kernel kills every
    process left in the namespace.
    """
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if "private_tmp" in report["layers"]:  # mounts are private (never propagate to the host)
        try:
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            report["layers"].append("private_proc")
        except OSError as e:
            report["notes"].append(str(e))
    pid = os.fork()
    if pid == 0:
        _guarded(_program, plan, report, status_fd)
    null = os.open("/dev/null", os.O_RDWR)  # nothing of the run's stdio stays reachable through PID 1
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    _send(status_fd, {"status": _wait(pid)})
    os._exit(0)


def _guarded(fn, plan, report, status_fd):
    """Run a forked child's part; any failure is reported and ends the child before the program runs."""
    try:
        fn(plan, report, status_fd)
    except BaseException as e:  # noqa: BLE001 - fail closed, never run the program half-set-up
        try:
            report["refused"] = f"launcher failed: {type(e).__name__}: {e}"
            _send(status_fd, report)
        finally:
            os._exit(REFUSED)
    os._exit(REFUSED)


def _send(fd, obj):
    os.write(fd, json.dumps(obj).encode() + b"\n")


def _wait(pid):
    while True:
        try:
            return os.waitpid(pid, 0)[1]
        except InterruptedError:
            continue


def _holds(layer, layers):
    if layer == "privilege":  # the program cannot act on the host as the caller's user
        return "uid" in layers or {"userns", "readonly_fs"} <= set(layers)
    return layer in layers


def _reap_orphans(block):
    """As a child subreaper we inherit the program's orphans: reap them (all dead with a PID namespace)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        except InterruptedError:
            continue
        if pid == 0:
            return


def _read_fd(fd):
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def main():
    plan = json.loads(_read_fd(int(sys.argv[2])))
    status_fd = int(sys.argv[3])
    os.set_inheritable(status_fd, False)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the caller died: so do we (and PID 1, and the namespace)
    if os.getppid() != plan["caller_pid"]:
        os._exit(REFUSED)  # it died before the line above
    report = {"layers": [], "notes": [], "cwd": os.getcwd()}
    _join_cgroups(plan, report)
    namespaces = _enter_namespaces(plan, report) if plan["namespaces"] else set()
    if "mount" in namespaces:
        try:
            if not plan["private_root"]:
                raise OSError(0, "not asked for")
            _private_root(plan, report)
        except OSError as e:
            report["notes"].append(f"private root: {e}")
            try:
                _private_mounts(plan, report)
            except OSError as e2:
                report["notes"].append(f"private mounts: {e2}")
    try:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
    except OSError as e:
        report["notes"].append(str(e))
    pid = os.fork()
    if pid == 0:
        _guarded(_init if "pid" in namespaces else _program, plan, report, status_fd)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda s, f: os.kill(pid, signal.SIGKILL))
    status = _wait(pid)
    if "pid" not in namespaces:
        _send(status_fd, {"status": status})
    _reap_orphans(block="pid" in namespaces)
    os._exit(0)


if __name__ == "__main__":
    main()
