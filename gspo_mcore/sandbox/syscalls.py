"""The sandbox's system-call allow-list: a seccomp filter built by libseccomp (through ``pyseccomp``).

Default deny: a system call not named here fails with ``ENOSYS`` (so the C library falls back where it
can, e.g. ``clone3`` -> ``clone``), and the ones named in ``_DENIED`` fail with ``EPERM``. Allowed: what
CPython, its standard library and the test harness use (files, memory, signals, timers, threads, fork
and exec, pipes, ``epoll``, Unix sockets); several only with safe arguments (``clone`` without namespace
flags, ``fcntl`` without locks, leases or directory notifications, a few terminal ``ioctl``s, ``prctl``
for the dumpable flag and thread names, ``socket`` for ``AF_UNIX`` only, ``prlimit64`` on itself).
Not allowed, among the rest: file locks (``flock``, ``fcntl`` locks), inotify / fanotify / dnotify,
``ptrace`` and ``process_vm_*``, new namespaces (``unshare``, ``setns``, namespace flags of ``clone``),
keyrings, ``mount`` and friends, ``bpf``, ``perf_event_open``, ``userfaultfd``, ``io_uring``,
``mincore`` (page-cache residency of shared files).

The filter is built once per process on the host and handed to the launcher as the BPF program
libseccomp exported (``build``); the launcher only loads it (``prctl(PR_SET_SECCOMP)``), after
``no_new_privs`` and right before ``execve``, so the program and everything it starts run under it.
"""

from __future__ import annotations

import errno
import logging
import tempfile
import threading
from functools import lru_cache

logger = logging.getLogger(__name__)
_warned = threading.Event()

_ALLOWED = """
read write readv writev pread64 pwrite64 lseek open openat close close_range
stat fstat lstat newfstatat statx statfs fstatfs access faccessat faccessat2 readlink readlinkat
getdents64 getcwd chdir fchdir mkdir mkdirat rmdir unlink unlinkat rename renameat renameat2
link linkat symlink symlinkat chmod fchmod fchmodat utimensat truncate ftruncate fsync fdatasync umask
getxattr lgetxattr fgetxattr listxattr llistxattr flistxattr sendfile copy_file_range
dup dup2 dup3 pipe pipe2 poll ppoll select pselect6
epoll_create epoll_create1 epoll_ctl epoll_wait epoll_pwait epoll_pwait2
mmap munmap mprotect mremap brk madvise
rt_sigaction rt_sigprocmask rt_sigreturn rt_sigsuspend rt_sigtimedwait rt_sigpending sigaltstack
pause alarm setitimer getitimer nanosleep clock_nanosleep clock_gettime clock_getres gettimeofday time
restart_syscall exit exit_group wait4 waitid fork vfork execve kill tgkill tkill
getpid getppid gettid getuid geteuid getgid getegid getgroups getresuid getresgid
getpgrp getpgid getsid setsid setpgid
futex set_robust_list get_robust_list set_tid_address rseq arch_prctl
sched_yield sched_getaffinity sched_getparam sched_getscheduler getcpu
getrandom uname sysinfo getrusage times getrlimit
connect bind listen accept accept4 sendto recvfrom sendmsg recvmsg shutdown
getsockname getpeername getsockopt setsockopt
""".split()

# Allowed only when argument ``index`` is one of ``values``.
_F = {"F_DUPFD": 0, "F_GETFD": 1, "F_SETFD": 2, "F_GETFL": 3, "F_SETFL": 4, "F_DUPFD_CLOEXEC": 1030}
_IOCTL = {"TCGETS": 0x5401, "TIOCGWINSZ": 0x5413, "FIONREAD": 0x541B, "FIONBIO": 0x5421, "FIONCLEX": 0x5450}
_IOCTL["FIOCLEX"] = 0x5451
_PRCTL = {"PR_GET_DUMPABLE": 3, "PR_SET_DUMPABLE": 4, "PR_SET_NAME": 15, "PR_GET_NAME": 16}
# fcntl commands refused with EPERM (the rest of those not allowed: ENOSYS): locks, leases, dnotify, owners
_F_DENIED = (5, 6, 7, 36, 37, 38, 1024, 1025, 1026, 8, 10, 15, 16)
_AF_UNIX = 1
_BY_ARGUMENT = {
    "fcntl": (1, tuple(_F.values())),
    "ioctl": (1, tuple(_IOCTL.values())),
    "prctl": (0, tuple(_PRCTL.values())),
    "socket": (0, (_AF_UNIX,)),
    "socketpair": (0, (_AF_UNIX,)),
    "prlimit64": (0, (0,)),  # its own limits (pid 0) only
}
# clone: any flags but new namespaces (CLONE_NEWTIME, NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET)
_CLONE_NAMESPACES = 0x80 | 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000

_DENIED = """
flock inotify_init inotify_init1 inotify_add_watch fanotify_init fanotify_mark
ptrace process_vm_readv process_vm_writev kcmp pidfd_getfd
unshare setns mount umount2 pivot_root chroot open_tree move_mount fsopen fsmount fspick mount_setattr
keyctl add_key request_key bpf perf_event_open userfaultfd io_uring_setup io_uring_enter io_uring_register
mincore cachestat name_to_handle_at open_by_handle_at memfd_create memfd_secret
""".split()


class SeccompUnavailable(RuntimeError):
    """The allow-list filter cannot be built on this host (no ``pyseccomp`` or no libseccomp)."""


@lru_cache(maxsize=1)
def build() -> bytes:
    """The allow-list as a BPF program (``struct sock_filter`` array) for this machine's architecture."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError) as e:  # OSError: the module found no libseccomp
        raise SeccompUnavailable(f"pyseccomp / libseccomp unavailable: {type(e).__name__}: {e}") from None
    try:
        f = sc.SyscallFilter(sc.ERRNO(errno.ENOSYS))
        for name in _ALLOWED:
            _rule(sc, f, sc.ALLOW, name)
        for name, (index, values) in _BY_ARGUMENT.items():
            for v in values:
                _rule(sc, f, sc.ALLOW, name, sc.Arg(index, sc.EQ, v))
        for cmd in _F_DENIED:
            _rule(sc, f, sc.ERRNO(errno.EPERM), "fcntl", sc.Arg(1, sc.EQ, cmd))
        for name in ("socket", "socketpair"):  # other families: "not permitted", as without a network
            _rule(sc, f, sc.ERRNO(errno.EPERM), name, sc.Arg(0, sc.NE, _AF_UNIX))
        _rule(sc, f, sc.ALLOW, "clone", sc.Arg(0, sc.MASKED_EQ, _CLONE_NAMESPACES, 0))
        for name in _DENIED:
            _rule(sc, f, sc.ERRNO(errno.EPERM), name)
        with tempfile.TemporaryFile() as out:
            f.export_bpf(out)
            out.seek(0)
            program = out.read()
    except (OSError, ValueError, AttributeError) as e:
        raise SeccompUnavailable(f"libseccomp could not build the filter: {type(e).__name__}: {e}") from None
    if not program or len(program) % 8:
        raise SeccompUnavailable(f"libseccomp exported a malformed filter ({len(program)} bytes)")
    return program


def _rule(sc, f, action: int, name: str, *args) -> None:
    """Add one rule; a system call this architecture does not have is skipped."""
    try:
        number = sc.resolve_syscall(sc.Arch.NATIVE, name)
    except (OSError, ValueError):
        return
    if number < 0:
        return
    f.add_rule(action, number, *args)


def availability() -> tuple[bytes | None, str]:
    """``(bpf, "")`` or ``(None, why not)``."""
    try:
        return build(), ""
    except SeccompUnavailable as e:
        return None, str(e)


def warn_once_if_unavailable() -> None:
    """One loud warning per process when the filter cannot be built (runs go on without it)."""
    bpf, why = availability()
    if bpf is None and not _warned.is_set():
        _warned.set()
        logger.warning(
            "REWARD SANDBOX: NO SYSTEM-CALL FILTER (%s). Model-written code runs without a seccomp "
            "allow-list: concurrent samples may share kernel state (file locks, inotify), and kernel attack "
            "surface is not reduced. Install pyseccomp and libseccomp, or set "
            "reward.code.sandbox.require_seccomp: true to refuse such hosts.",
            why,
        )
