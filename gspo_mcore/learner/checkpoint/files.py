"""The on-disk format of training checkpoints: names, manifest, checksums, atomic writes, validation, retention.

A checkpoint root holds ``step_<N>`` directories (complete checkpoints, renamed into place), ``latest``,
and possibly leftovers of an interrupted save (``*.tmp-<id>``) or deletion (``*.deleting-<id>``) and
rejected checkpoints set aside for inspection (``*.rejected-<id>``). ``manifest.json`` lists every file of
a checkpoint with its size and sha256; it is written last, so its presence and agreement with the files
is what makes a checkpoint valid. Functions named collective must run on every rank.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import typing
import uuid

from gspo_mcore.learner.checkpoint import _log
from gspo_mcore.learner.checkpoint._dist import all_gather_object, barrier, rank, world

FORMAT_VERSION = 1
"""The version of this layout, in ``manifest.json`` and ``trainer_state.json``."""
VerifyMode = typing.Literal["sha256", "size"]
VERIFY_MODES = typing.get_args(VerifyMode)
"""What loading checks: sizes and checksums, or sizes only."""

STEP_DIR = re.compile(r"^step_(\d+)$")
MANIFEST = "manifest.json"
STATE = "trainer_state.json"
CONFIG = "config.yaml"
MEGATRON = "megatron"
RNG = "rng"
LATEST = "latest"
_HASH_CHUNK = 8 << 20


# ---- validation and discovery --------------------------------------------------------------------------


def validate(path: str, *, verify: str = "sha256") -> list[str]:
    """Problems of checkpoint ``path`` (empty: valid). Collective: every rank checks a share of the files."""
    problems: list[str] = []
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
        files = manifest["files"]
        if not isinstance(files, dict) or manifest.get("format") != FORMAT_VERSION:
            raise ValueError("unexpected content")
    except FileNotFoundError:
        problems.append("no manifest.json (incomplete checkpoint)")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        problems.append(f"manifest.json unreadable: {type(exc).__name__}: {exc}")
    if not problems:
        names = sorted(files)
        for name in names[rank() :: world()]:
            problems.extend(_check_file(path, name, files[name], verify))
        for required in (STATE, f"{MEGATRON}/metadata.json"):
            if required not in files and rank() == 0:
                problems.append(f"{required} missing from the manifest")
    return sorted({p for part in all_gather_object(problems) for p in part})


def find_latest_valid(root: str, *, verify: str = "sha256") -> tuple[str | None, list[tuple[str, list[str]]]]:
    """The newest valid checkpoint under ``root`` (or ``None``) and the newer ones rejected, with reasons."""
    rejected = []
    for _, path in sorted(complete_checkpoints(root), reverse=True):
        problems = validate(path, verify=verify)
        if not problems:
            return path, rejected
        rejected.append((path, problems))
    return None, rejected


def _check_file(root: str, name: str, entry: dict, verify: str) -> list[str]:
    full = os.path.join(root, name)
    try:
        size = os.path.getsize(full)
    except OSError:
        return [f"{name} missing"]
    if size != entry["size"]:
        kind = "truncated" if size < entry["size"] else "longer than recorded"
        return [f"{name} {kind} ({size} bytes, manifest says {entry['size']})"]
    if verify == "sha256" and _sha256(full) != entry["sha256"]:
        return [f"{name} corrupted (sha256 mismatch)"]
    return []


def complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every ``step_<N>`` directory (renamed into place, so complete when written)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        m = STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            out.append((int(m.group(1)), os.path.join(root, name)))
    return out


def is_checkpoint_dir(path: str) -> bool:
    """Whether ``path`` names one checkpoint (``.../step_<N>`` or a directory with a manifest), not a root."""
    return bool(STEP_DIR.match(os.path.basename(path.rstrip(os.sep)))) or os.path.exists(os.path.join(path, MANIFEST))


# ---- leftovers and retention ---------------------------------------------------------------------------


def remove_leftovers(root: str) -> None:
    """Remove what interrupted saves and deletions left in ``root`` (rank 0 only)."""
    for name in os.listdir(root):
        if (".tmp-" in name or ".deleting-" in name) and os.path.isdir(os.path.join(root, name)):
            _log.info(f"removing {os.path.join(root, name)} (left by an interrupted save or deletion)")
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def set_aside(path: str) -> str:
    """Move a rejected checkpoint out of the ``step_<N>`` namespace (kept for inspection, never deleted).

    Collective: rank 0 renames, every rank gets the new path."""
    aside = f"{path}.rejected-{uuid.uuid4().hex[:12]}"
    if rank() == 0:
        os.rename(path, aside)
    barrier()
    return aside


def delete_dir(path: str) -> None:
    """Rename out of the ``step_<N>`` namespace first, so a crash mid-delete leaves no half checkpoint."""
    doomed = f"{path}.deleting-{uuid.uuid4().hex[:12]}"
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def retain(root: str, *, keep_last: int, keep: str) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints of ``root``; never ``keep`` (just written)."""
    others = [path for _, path in sorted(complete_checkpoints(root), reverse=True) if path != keep]
    for path in others[keep_last - 1 :]:
        delete_dir(path)


# ---- files, hashing ------------------------------------------------------------------------------------


def list_files(root: str) -> list[str]:
    """Every file under ``root``, as sorted paths relative to it."""
    out = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            out.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(out)


def _sha256(path: str, *, fsync: bool = False) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
        if fsync:
            os.fsync(f.fileno())
    return h.hexdigest()


def gather_digests(root: str, files: list[str], *, fsync: bool) -> dict[str, dict]:
    """``{name: {size, sha256}}`` for every file; each rank fsyncs and hashes a share. Collective."""
    mine = {
        name: {
            "size": os.path.getsize(os.path.join(root, name)),
            "sha256": _sha256(os.path.join(root, name), fsync=fsync),
        }
        for name in files[rank() :: world()]
    }
    out = {}
    for part in all_gather_object(mine):
        out.update(part)
    return dict(sorted(out.items()))


def write_file(path: str, write) -> None:
    """Create ``path``, let ``write(f)`` fill it (binary), flush and fsync it."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_text(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` atomically (tmp file, fsync, ``os.replace``, fsync of the directory)."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
    write_file(tmp, lambda f: f.write(text.encode()))
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- the run's configuration ---------------------------------------------------------------------------


def config_hash(run_config: dict) -> str:
    """sha256 of the run's configuration (as canonical JSON), recorded in the manifest."""
    return hashlib.sha256(json.dumps(run_config, sort_keys=True, default=str).encode()).hexdigest()


def config_yaml(data) -> str:
    """``config.yaml``'s text: ``data`` as plain YAML (values JSON cannot hold become strings)."""
    import yaml

    return yaml.safe_dump(json.loads(json.dumps(data, default=str)), sort_keys=False)
