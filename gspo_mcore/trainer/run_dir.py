"""One run per folder: what a run may find in ``log.output_dir`` (and its checkpoint directory) at start-up.

A run's traces are ``config.yaml``, ``metrics.jsonl`` (and ``metrics.jsonl.previous``), ``metrics.png``,
``episodes.jsonl``, the TensorBoard events (``tensorboard/events.out.tfevents.*``), the evaluation samples
(``eval_samples/step_<N>.jsonl``) and the checkpoints (``step_<N>``, ``latest`` and an interrupted save's
``*.tmp-*`` in ``checkpoint.dir``). Other files (a prepared model or dataset, like ``make demo``'s, or anything
a user put there, also inside ``tensorboard/`` or ``checkpoint.dir``) are not a run's and are never touched:
``log.overwrite`` deletes those paths one by one, and a folder only once it is empty and is not the run folder.
``checkpoint.dir`` may be ``log.output_dir`` itself, but not a folder above it (another run's checkpoints would
mix with this one's): that is refused naming both keys.

- A fresh run (``checkpoint.resume: false``) in a folder holding another run's traces is refused, naming the
  folder and what it holds, unless ``log.overwrite: true``: then those traces are deleted before the run
  writes anything (:func:`prepare`).
- A resumed run (``checkpoint.resume: true``/``auto``, or a checkpoint of this run's checkpoint directory)
  must be the same run: its configuration is compared with the one saved in the checkpoint it will resume
  (or, before the first checkpoint, with the folder's ``config.yaml``): the hashes first, then key by key,
  and any difference outside :data:`RESUME_MAY_DIFFER` is refused, naming the keys. A checkpoint of
  ANOTHER folder (``checkpoint.resume: /other/run/checkpoints/step_N``) starts a new run from those weights:
  its differences are reported, not refused.

:func:`check` only reads (every rank may call it, before any process group exists); :func:`prepare` is the
first write into the folder, by rank 0, after every input has been checked.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from dataclasses import dataclass

from gspo_mcore.learner.checkpoint.errors import CheckpointError
from gspo_mcore.learner.checkpoint.files import (
    CONFIG,
    MANIFEST,
    STATE,
    complete_checkpoints,
    config_hash,
    is_checkpoint_dir,
    validate,
)

RUN_FILES = ("config.yaml", "metrics.jsonl", "metrics.jsonl.previous", "metrics.png", "episodes.jsonl")
"""The files a run writes into ``log.output_dir`` besides its events, evaluation samples and checkpoints."""
RUN_SUBDIR_FILES = {
    "tensorboard": re.compile(r"^events\.out\.tfevents\."),
    "eval_samples": re.compile(r"^step_\d+\.jsonl$"),
}
"""The folders of ``log.output_dir`` a run writes into, and the names of the files it writes there."""
CHECKPOINT_FILES = re.compile(r"^(step_\d+|step_\d+\.(tmp|deleting)-[0-9a-f]+|latest)$")
"""What a run writes into ``checkpoint.dir``: checkpoints, ``latest`` and the leftovers of an interrupted save or
deletion (a rejected checkpoint set aside, ``*.rejected-*``, is kept for inspection)."""

RESUME_MAY_DIFFER = (
    "steps",
    "allow_data_change",
    "log.output_dir",
    "checkpoint.dir",
    "checkpoint.resume",
    "checkpoint.save_every",
    "checkpoint.keep_last",
    "checkpoint.verify",
    "checkpoint.optimizer_format",
    "log.progress_bar",
    "log.tensorboard",
    "log.wandb_project",
    "log.overwrite",
    "eval",
    "parallel",
    "model.options",
    "batch.max_tokens_per_microbatch",
    "rollout.max_batch_size",
    "rollout.sglang",
)
"""Keys (and whole sections) a resumed run may change. They say where the run folder is now (``log.output_dir``,
``checkpoint.dir``: a run folder moved or copied elsewhere is still that run, since a resume only looks in this
run's own checkpoint directory), how long the run goes, how often it saves and
what it prints (``steps``, ``checkpoint.*``, ``log.*``), what it measures
(``eval``: evaluations draw nothing from the training streams), and how the same computation is laid out
(``parallel``: checkpoints reshard; ``model.options``; the micro-batch and engine batch sizes; the SGLang
servers' addresses and launch): these change results by floating-point rounding at most. Everything else
(model, data, reward, loss, optimizer, rollout, seeds, template, sampler) defines the run and must match."""


RESUME_MUST_MATCH = ("model.options.cpu_bf16",)
"""Keys inside a :data:`RESUME_MAY_DIFFER` section that still define the run: the model's dtype on a CPU
(``model.options.cpu_bf16``) changes every later sample and update by far more than rounding."""


class RunDirError(ValueError):
    """The run folder holds what this run may not mix with; the message names the folder and the way out."""


@dataclass(frozen=True)
class RunDirPlan:
    """What :func:`check` found: the traces to delete before writing (``log.overwrite``), and the saved
    configuration a resume was checked against."""

    output_dir: str
    clear: tuple[str, ...] = ()
    """Paths of the previous run's traces that :func:`prepare` deletes (``log.overwrite: true``)."""
    compared_with: str | None = None
    """The ``config.yaml`` the resumed configuration was compared with."""


def run_traces(output_dir: str, checkpoint_dir: str) -> list[str]:
    """The paths of a run's traces in ``output_dir`` and ``checkpoint_dir`` (empty: a clean folder): files and
    checkpoint directories the run wrote, each by name, never a folder that holds anything else."""
    found = [os.path.join(output_dir, f) for f in RUN_FILES if os.path.exists(os.path.join(output_dir, f))]
    for sub, pattern in RUN_SUBDIR_FILES.items():
        found += [os.path.join(output_dir, sub, f) for f in _names(os.path.join(output_dir, sub)) if pattern.match(f)]
    found += [os.path.join(checkpoint_dir, f) for f in _names(checkpoint_dir) if CHECKPOINT_FILES.match(f)]
    return found


def _names(folder: str) -> list[str]:
    try:
        return sorted(os.listdir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _shown(traces: list[str], output_dir: str) -> str:
    """The traces as the folder's entries that hold them (``tensorboard``, ``checkpoints``), in order."""
    tops = []
    for t in traces:
        rel = os.path.relpath(t, output_dir)
        top = rel if rel.startswith("..") else rel.split(os.sep)[0]
        if top not in tops:
            tops.append(top)
    return ", ".join(tops)


def check(run_config: dict, *, output_dir: str, checkpoint_dir: str, resume, overwrite: bool) -> RunDirPlan:
    """Refuse a run that would mix with another in ``output_dir`` (see the module docstring); reads only.

    ``run_config``: the run's resolved configuration as plain data (``to_dict``), as saved in checkpoints.
    Raises :class:`RunDirError`."""
    output_dir = os.path.abspath(output_dir)
    checkpoint_dir = os.path.abspath(checkpoint_dir)
    if resume is not False and overwrite:
        raise RunDirError(
            f"log.overwrite=true deletes the run in {output_dir}, checkpoint.resume={resume!r} continues one: "
            "set one of them"
        )
    if checkpoint_dir != output_dir and output_dir.startswith(checkpoint_dir.rstrip(os.sep) + os.sep):
        raise RunDirError(
            f"checkpoint.dir={checkpoint_dir} contains log.output_dir={output_dir}: the checkpoints of every run "
            "below it would mix; set checkpoint.dir to the run folder, a folder inside it (the default "
            "<log.output_dir>/checkpoints) or a folder of its own"
        )
    traces = run_traces(output_dir, checkpoint_dir)
    if resume is False:
        if traces and not overwrite:
            shown = _shown(traces, output_dir)
            raise RunDirError(
                f"{output_dir} already holds a run ({shown}); set checkpoint.resume=true to continue it, "
                "log.overwrite=true to replace it, or choose another log.output_dir"
            )
        return RunDirPlan(output_dir=output_dir, clear=tuple(traces))
    _check_lora_matches(run_config, checkpoint_dir, resume)
    saved = _saved_config(output_dir, checkpoint_dir, resume)
    if saved is not None:
        _check_same_run(run_config, *saved)
    return RunDirPlan(output_dir=output_dir, compared_with=saved[0] if saved else None)


def prepare(plan: RunDirPlan, run_config: dict) -> None:
    """Rank 0, once every input is checked: delete the previous run's traces (``log.overwrite``), then write
    ``config.yaml``: the first write of this run into its folder."""
    for path in plan.clear:  # each one a file or checkpoint the run wrote (run_traces)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)
    for folder in {os.path.dirname(p) for p in plan.clear} - {plan.output_dir}:
        with contextlib.suppress(OSError):  # emptied: the run made it; anything left in it is kept, and it too
            os.rmdir(folder)
    os.makedirs(plan.output_dir, exist_ok=True)
    from gspo_mcore.learner.checkpoint.files import config_yaml

    tmp = os.path.join(plan.output_dir, f"{CONFIG}.tmp")
    with open(tmp, "w") as f:
        f.write(config_yaml(run_config))
    os.replace(tmp, os.path.join(plan.output_dir, CONFIG))


def resume_candidate(checkpoint_dir: str, resume) -> str | None:
    """The checkpoint a resume will most likely load: the newest of ``checkpoint_dir`` (or of the directory
    ``resume`` names) whose files have the sizes its manifest records, or ``resume`` itself when it names one
    checkpoint. Cheap (no checksums): the trainer's checkpointer still verifies it fully when it loads.
    Raises :class:`~gspo_mcore.learner.checkpoint.CheckpointError` naming the directory when checkpoints exist
    but none is usable, or when ``resume`` names what does not exist."""
    root = checkpoint_dir
    if isinstance(resume, str) and resume != "auto":
        path = os.path.abspath(resume)
        if not os.path.isdir(path):
            raise CheckpointError(f"checkpoint.resume={resume!r}: {path} does not exist")
        if is_checkpoint_dir(path):
            problems = validate(path, verify="size")
            if problems:
                raise CheckpointError(
                    f"checkpoint.resume={resume!r}: {path} is not a valid checkpoint: {'; '.join(problems)}"
                )
            return path
        root = path
    steps = sorted(complete_checkpoints(root), reverse=True)
    reasons = []
    for _, path in steps:
        problems = validate(path, verify="size")
        if not problems:
            return path
        reasons.append(f"{os.path.basename(path)}: {'; '.join(problems)}")
    if reasons:
        raise CheckpointError(f"no usable checkpoint to resume in {root}: every one is damaged ({' | '.join(reasons)})")
    if root != checkpoint_dir:
        raise CheckpointError(f"checkpoint.resume={resume!r}: {root} holds no checkpoint")
    return None


def _saved_config(output_dir: str, checkpoint_dir: str, resume) -> tuple[str, dict, str | None] | None:
    """(where, the configuration a resume must match, its recorded hash), or None when there is nothing to
    match: a fresh folder, or a checkpoint of another folder (a new run from its weights)."""
    candidate = resume_candidate(checkpoint_dir, resume)
    if candidate is not None:
        if os.path.dirname(candidate) != checkpoint_dir:
            return None
        path = os.path.join(candidate, CONFIG)
        recorded = None
        if os.path.isfile(os.path.join(candidate, MANIFEST)):
            with open(os.path.join(candidate, MANIFEST)) as f:
                recorded = json.load(f).get("config_sha256")
    else:
        path, recorded = os.path.join(output_dir, CONFIG), None
    if not os.path.isfile(path):
        return None
    import yaml

    with open(path) as f:
        return path, yaml.safe_load(f) or {}, recorded


def _check_same_run(run_config: dict, where: str, saved: dict, recorded: str | None) -> None:
    if recorded is not None and recorded == config_hash(run_config):
        return
    changed = {k: v for k, v in diff(saved, run_config).items() if not _may_differ(k)}
    if changed:
        shown = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(changed.items())[:8])
        more = f" (and {len(changed) - 8} more)" if len(changed) > 8 else ""
        raise RunDirError(
            f"checkpoint.resume: this configuration differs from the run it would continue ({where}) in "
            f"{len(changed)} key(s) that define the run: {shown}{more}. Resume with the same values, or start a "
            "new run (another log.output_dir) from that checkpoint with checkpoint.resume=<its step_<N> path>"
        )


def _check_lora_matches(run_config: dict, checkpoint_dir: str, resume) -> None:
    """A checkpoint (of this run or of another folder) whose parameters are another kind than this run's model's:
    a LoRA checkpoint into a full fine-tuning run or the reverse, or adapters of another rank or targets."""
    candidate = resume_candidate(checkpoint_dir, resume)
    if candidate is None or not os.path.isfile(os.path.join(candidate, CONFIG)):
        return
    import yaml

    with open(os.path.join(candidate, CONFIG)) as f:
        saved = yaml.safe_load(f) or {}
    problem = lora_mismatch(saved.get("lora"), run_config.get("lora"))
    if problem is None and _holds_adapters_only(candidate):
        problem = base_mismatch(saved.get("model"), run_config.get("model"))
    if problem:
        raise RunDirError(f"checkpoint.resume: {candidate} {problem}")


def _holds_adapters_only(checkpoint: str) -> bool:
    """Whether a checkpoint holds LoRA adapters only (its ``trainer_state.json``'s ``model``), not its base."""
    try:
        with open(os.path.join(checkpoint, STATE)) as f:
            return json.load(f).get("model") == "adapters"
    except (OSError, ValueError):
        return False  # the checkpointer reports an unreadable state when it loads


def base_mismatch(then: dict | None, now: dict | None) -> str | None:
    """Why LoRA adapters trained on the base of the ``model`` section ``then`` cannot resume on the base of ``now``
    (plain data), or ``None``: the same Hugging Face weights (``model.load_hf_weights`` and the folder
    ``model.hf_dir``, compared as real paths) or the same random base (``model.init_seed``). An adapter-only
    checkpoint holds no base: the run rebuilds it at its start, so a different one would silently apply the
    adapters to other weights."""
    then, now = then or {}, now or {}

    def base(section):
        if section.get("load_hf_weights"):
            return f"the weights of model.hf_dir={os.path.realpath(str(section.get('hf_dir')))}"
        return f"a random base from model.init_seed={section.get('init_seed', 1234)} (model.load_hf_weights=false)"

    a, b = base(then), base(now)
    if a == b:
        return None
    return (
        f"holds LoRA adapters trained on {a}, and this run's base is {b}: adapters apply only to the base they were "
        "trained on; resume with the same model.hf_dir, model.load_hf_weights and model.init_seed"
    )


def lora_mismatch(then: dict | None, now: dict | None) -> str | None:
    """Why a checkpoint written with the ``lora`` section ``then`` cannot be loaded into a run with ``now`` (plain
    data; ``None``: no section, full fine-tuning), or ``None`` when its parameters match this run's."""
    from gspo_mcore.learner.lora import ALL_LINEAR, HF_TARGETS

    def kind(section):
        section = section or {}
        rank = int(section.get("rank") or 0)
        targets = list(section.get("target_modules") or []) if rank else []
        return rank, sorted(HF_TARGETS if ALL_LINEAR in targets else targets)

    def words(k):
        return f"LoRA (lora.rank={k[0]}, lora.target_modules={k[1]})" if k[0] else "full fine-tuning (lora.rank=0)"

    a, b = kind(then), kind(now)
    if a == b:
        return None
    return (
        f"was written by a {words(a)} run and this run is {words(b)}: the checkpoint holds other parameters than "
        "this model; resume with the same lora section, or start from Hugging Face weights"
    )


def _may_differ(key: str) -> bool:
    if key in RESUME_MUST_MATCH:
        return False
    return any(key == k or key.startswith(k + ".") for k in RESUME_MAY_DIFFER)


def diff(a, b, prefix: str = "") -> dict[str, tuple]:
    """``{dotted key: (a's value, b's value)}`` where the nested plain data ``a`` and ``b`` differ (tuples
    compare as lists, as they are saved)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = {}
        for key in sorted(set(a) | set(b), key=str):
            out.update(diff(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else str(key)))
        return out
    a, b = _plain(a), _plain(b)
    return {} if a == b else {prefix: (a, b)}


def _plain(value):
    """JSON's view of ``value`` (tuples become lists, recursively), as config.yaml stores it."""
    return json.loads(json.dumps(value, default=str))


# ---- start-up: a writable folder, held by one run; a full disk named at the write -----------------------------

LOCK_FILE = ".gspo_mcore.lock"
"""The lock file of a running run in ``log.output_dir`` (removed when the run ends)."""
LOW_SPACE_BYTES = 16 << 20
"""Below this much free space, a write that failed is taken for a full disk (torch's zip writer does not say
ENOSPC: it reports ``unexpected pos N vs M``)."""


def _existing_ancestor(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def check_writable(output_dir: str, checkpoint_dir: str) -> None:
    """Refuse a run whose ``log.output_dir`` or ``checkpoint.dir`` cannot be written (a read-only mount, no
    permission, a full disk): a probe file is created and removed in each (or in its nearest existing parent
    folder, which the run would create it in). Raises :class:`RunDirError` naming the key and folder."""
    import errno
    import tempfile

    for key, folder in (("log.output_dir", output_dir), ("checkpoint.dir", checkpoint_dir)):
        where = _existing_ancestor(folder)
        try:
            fd, probe = tempfile.mkstemp(prefix=".gspo_mcore-probe-", dir=where)
        except OSError as exc:
            why = {errno.EROFS: "read-only file system", errno.ENOSPC: "disk full", errno.EACCES: "permission denied"}
            raise RunDirError(
                f"{key}={os.path.abspath(folder)}: cannot create a file in {where} "
                f"({why.get(exc.errno, exc.strerror or type(exc).__name__)}); choose a writable folder"
            ) from None
        os.close(fd)
        os.remove(probe)


class RunLock:
    """An exclusive ``flock`` on ``<log.output_dir>/.gspo_mcore.lock`` (:func:`lock_folder`), held until
    :meth:`release` (or the process's exit: the kernel drops it)."""

    def __init__(self, path: str, fd: int, created: list[str]):
        self.path, self.fd, self.created = path, fd, created

    def release(self) -> None:
        """Remove the lock file and drop the lock; remove the folders made for it if they are still empty."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.remove(self.path)
        os.close(self.fd)
        self.fd = None
        for folder in reversed(self.created):
            with contextlib.suppress(OSError):
                os.rmdir(folder)


def lock_folder(output_dir: str) -> RunLock:
    """Lock the run folder for this run (rank 0, from the start-up check of the folder to the run's end): a
    second run started in the same folder meanwhile is refused (:class:`RunDirError`, naming the holder's pid).
    Creates the folder if needed (removed again on :meth:`RunLock.release` if nothing else was written)."""
    import fcntl

    output_dir = os.path.abspath(output_dir)
    created, parent = [], output_dir
    while not os.path.isdir(parent):
        created.append(parent)
        parent = os.path.dirname(parent)
    os.makedirs(output_dir, exist_ok=True)
    created.reverse()
    path = os.path.join(output_dir, LOCK_FILE)
    for _ in range(10):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            for folder in reversed(created):
                with contextlib.suppress(OSError):
                    os.rmdir(folder)
            raise RunDirError(
                f"log.output_dir={output_dir} is in use by another run (pid {holder}, holding {path}); wait for it "
                "to end, or choose another log.output_dir"
            ) from None
        try:  # the holder may have removed the file between our open and lock: lock the one in place
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return RunLock(path, fd, created)
        os.close(fd)
    raise RunDirError(f"log.output_dir={output_dir}: cannot take the lock {path} (it keeps being replaced)")


@contextlib.contextmanager
def disk_full_named(folder: str, key: str, what: str):
    """Around a write into ``folder`` (``key``: its configuration key): a failure for want of space (ENOSPC
    anywhere in the exception's chain, or any OSError/RuntimeError with under :data:`LOW_SPACE_BYTES` free
    there, as torch's writer reports it) becomes ``OSError(ENOSPC, 'disk full: ...')`` naming the folder and
    ``what`` was being written; other errors pass unchanged."""
    import errno

    try:
        yield
    except (OSError, RuntimeError) as exc:
        if not _disk_full(exc, folder):
            raise
        raise OSError(
            errno.ENOSPC,
            f"disk full: no space left in {key}={os.path.abspath(folder)} while {what} ({type(exc).__name__}: "
            f"{exc}); free space there and resume (checkpoint.resume=true)",
        ) from exc


def _disk_full(exc: BaseException, folder: str) -> bool:
    import errno

    seen = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        return shutil.disk_usage(_existing_ancestor(folder)).free < LOW_SPACE_BYTES
    except OSError:
        return False


# ---- the data a run trains on: recorded with each checkpoint, checked at resume ------------------------------


class DataChangedError(ValueError):
    """A resume's data file differs from the one the checkpoint recorded."""


def data_fingerprint(cfg) -> dict[str, dict]:
    """``{key: {path, size, sha256}}`` of every training (``data.paths[i]``) and evaluation
    (``eval.datasets[<name>].data.paths[i]``) data file of the resolved configuration ``cfg``."""
    files = {f"data.paths[{i}]": p for i, p in enumerate(cfg.data.paths)}
    for s in cfg.eval.datasets:
        files |= {f"eval.datasets[{s.name}].data.paths[{i}]": p for i, p in enumerate(s.data.paths)}
    return {key: _file_print(path) for key, path in files.items()}


def _file_print(path: str) -> dict:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return {"path": path, "size": os.path.getsize(path), "sha256": h.hexdigest()}


def check_data_unchanged(checkpoint: str, current: dict[str, dict], *, allow: bool) -> list[str]:
    """Compare the data files a resume reads with those checkpoint ``checkpoint`` recorded (its
    ``trainer_state.json``'s ``extra.data_files``; nothing to compare for a checkpoint without them): a file at
    the same key and path whose size or sha256 differs is refused (:class:`DataChangedError`, naming it) unless
    ``allow``. Returns the differences found (logged when allowed)."""
    from gspo_mcore.learner.checkpoint.files import STATE

    try:
        with open(os.path.join(checkpoint, STATE)) as f:
            recorded = (json.load(f).get("extra") or {}).get("data_files") or {}
    except (OSError, ValueError):
        return []  # the checkpointer reports an unreadable state when it loads
    changed = []
    for key, then in sorted(recorded.items()):
        now = current.get(key)
        if now is None or now["path"] != then.get("path"):
            continue  # another file: a configuration change, compared key by key (check)
        if (now["size"], now["sha256"]) != (then.get("size"), then.get("sha256")):
            how = f"{then.get('size')} -> {now['size']} bytes" if now["size"] != then.get("size") else "sha256 differs"
            changed.append(f"{key}: {now['path']} changed since the checkpoint {checkpoint} ({how})")
    if changed and not allow:
        raise DataChangedError(
            f"{'; '.join(changed)}: a resume would continue on other data than the run trained on; restore the "
            "file, start a new run, or set allow_data_change=true"
        )
    return changed
