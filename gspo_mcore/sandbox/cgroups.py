"""Per-run cgroups for the sandbox: memory, process count and CPU bandwidth of the whole process tree.

Each run gets fresh cgroups below the caller's own (a delegated subtree), removed after the run:

- **cgroup v2** (a ``cgroup2`` mount whose cgroup has the ``memory`` and ``pids`` controllers enabled
  for its children, or ``SandboxConfig.cgroup_parent``): one cgroup with ``memory.max`` (and
  ``memory.swap.max = 0``), ``pids.max`` and ``cpu.max`` (when the ``cpu`` controller is there too).
- **cgroup v1** (``memory`` and ``pids`` hierarchies mounted and writable): a group in each with
  ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes`` where swap is accounted),
  ``pids.max``, and ``cpu.cfs_quota_us`` in the ``cpu`` hierarchy when it is there.

A limit that cannot be written makes the layer unavailable (the groups are removed again), never a
group without its limit. ``availability()`` says, once per process, which version is used or why none.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger(__name__)
_CPU_PERIOD_US = 100_000
_warned = threading.Event()


@dataclass(frozen=True)
class Limits:
    memory_bytes: int
    pids: int
    cpu_cores: float | None


@dataclass(frozen=True)
class RunGroups:
    """The cgroups of one run: the launcher writes its pid into each ``procs`` file."""

    version: int
    dirs: tuple[str, ...]

    @property
    def procs(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]


class CgroupUnavailable(OSError):
    pass


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(mount root, mount point, fstype, super options) of the cgroup mounts."""
    out = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(rfields) >= 3 and rfields[0] in ("cgroup", "cgroup2"):
            out.append((fields[3], fields[4], rfields[0], set(rfields[2].split(","))))
    return out


def _own_paths() -> dict[str, str]:
    """Controller (``""`` for v2) -> this process's cgroup path, from /proc/self/cgroup."""
    out = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def _below(mount_root: str, mount_point: str, own: str) -> str:
    rel = own[len(mount_root) :] if mount_root != "/" and own.startswith(mount_root) else own
    return os.path.join(mount_point, rel.lstrip("/"))


@lru_cache(maxsize=None)
def _plan(parent_override: str | None) -> tuple[int, dict[str, str]] | str:
    """``(version, {controller: parent dir})``, or the reason there is no usable cgroup layer."""
    if os.geteuid() != 0 and parent_override is None:
        return "not running as root (give SandboxConfig.cgroup_parent: a cgroup v2 directory delegated to you)"
    reasons = []
    mounts, own = _mounts(), _own_paths()
    v2_parents = (
        [parent_override]
        if parent_override
        else [_below(root, point, own.get("", "/")) for root, point, fs, _ in mounts if fs == "cgroup2"]
    )
    for parent in v2_parents:
        why = _usable_v2(parent)
        if why is None:
            return 2, {"": parent}
        reasons.append(f"cgroup v2 {parent}: {why}")
    if parent_override:
        return "; ".join(reasons)
    v1 = {}
    for root, point, fs, opts in mounts:
        for c in ("memory", "pids", "cpu"):
            if fs == "cgroup" and c in opts and c in own:
                v1[c] = _below(root, point, own[c])
    if "cpu" in v1 and not os.access(v1["cpu"], os.W_OK):
        del v1["cpu"]  # no CPU bandwidth limit, the rest still holds
    missing = [c for c in ("memory", "pids") if c not in v1]
    if not missing and all(os.access(d, os.W_OK) for d in v1.values()):
        return 1, v1
    reasons.append(f"cgroup v1: {'no ' + '/'.join(missing) + ' hierarchy' if missing else 'not writable'}")
    return "; ".join(reasons) or "no cgroup filesystem mounted"


def _usable_v2(parent: str) -> str | None:
    try:
        available = Path(parent, "cgroup.controllers").read_text().split()
    except OSError as e:
        return f"unreadable ({e.strerror})"
    if not {"memory", "pids"} <= set(available):
        return f"controllers {available}: memory and pids are not available (bound to cgroup v1?)"
    enabled = Path(parent, "cgroup.subtree_control").read_text().split()
    want = [c for c in ("memory", "pids", "cpu") if c in available and c not in enabled]
    if want:
        try:
            Path(parent, "cgroup.subtree_control").write_text(" ".join("+" + c for c in want))
        except OSError as e:
            if {"memory", "pids"} - set(enabled):
                return (
                    f"cannot enable {want} for child cgroups ({e.strerror}; a cgroup with processes cannot: "
                    f"run in a delegated subtree and set SandboxConfig.cgroup_parent)"
                )
    if not os.access(parent, os.W_OK):
        return "not writable"
    return None


def availability(parent: str | None = None) -> tuple[int | None, str]:
    """``(version, where)`` of the cgroup layer, or ``(None, why not)``."""
    plan = _plan(parent)
    if isinstance(plan, str):
        return None, plan
    version, parents = plan
    return version, ", ".join(f"{c or 'unified'}: {d}" for c, d in parents.items())


def warn_once_if_unavailable(parent: str | None = None) -> None:
    version, why = availability(parent)
    if version is None and not _warned.is_set():
        _warned.set()
        logger.warning(
            "REWARD SANDBOX: NO CGROUP LAYER (%s). Memory is bounded per process only (a tree of N "
            "processes may use N x memory_mb), there is no CPU bandwidth limit, and the process count "
            "is bounded by RLIMIT_NPROC alone. Set sandbox.require_cgroup: true to refuse such hosts.",
            why,
        )


def make(limits: Limits, parent: str | None = None) -> RunGroups:
    """Fresh cgroups for one run, limits written; ``CgroupUnavailable`` (nothing left behind) if not."""
    plan = _plan(parent)
    if isinstance(plan, str):
        raise CgroupUnavailable(plan)
    version, parents = plan
    name = f"gspo-sandbox-{os.getpid()}-{random.randrange(1 << 30)}"
    if version == 2:
        settings = {
            "": {
                "memory.max": limits.memory_bytes,
                "memory.swap.max": 0,
                "pids.max": limits.pids,
                "cpu.max": _cpu_max(limits),
            }
        }
        optional = {"memory.swap.max", "cpu.max"}
    else:
        quota = None if limits.cpu_cores is None else max(1000, int(limits.cpu_cores * _CPU_PERIOD_US))
        settings = {
            "memory": {
                "memory.limit_in_bytes": limits.memory_bytes,
                "memory.memsw.limit_in_bytes": limits.memory_bytes,
            },
            "pids": {"pids.max": limits.pids},
            "cpu": {"cpu.cfs_period_us": _CPU_PERIOD_US, "cpu.cfs_quota_us": quota},
        }
        optional = {"memory.memsw.limit_in_bytes"}
    made: list[str] = []
    try:
        for controller, values in settings.items():
            if controller not in parents:
                continue
            d = os.path.join(parents[controller], name)
            os.mkdir(d)
            made.append(d)
            for key, value in values.items():
                if value is None:
                    continue
                path = Path(d, key)
                if key in optional and not path.exists():
                    continue  # swap accounting off, or no cpu controller: that limit does not apply
                path.write_text(str(value))
    except OSError as e:
        for d in reversed(made):
            remove(d)
        raise CgroupUnavailable(f"cgroup v{version}: {e}") from None
    return RunGroups(version, tuple(made))


def _cpu_max(limits: Limits) -> str | None:
    if limits.cpu_cores is None:
        return None
    return f"{max(1000, int(limits.cpu_cores * _CPU_PERIOD_US))} {_CPU_PERIOD_US}"


def remove(d: str) -> None:
    """Remove an (emptied) run cgroup; its processes are dead or dying, so retry briefly."""
    for _ in range(200):
        try:
            os.rmdir(d)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)
    logger.warning("could not remove sandbox cgroup %s", d)
