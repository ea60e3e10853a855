"""Crash-safe training checkpoints: model, optimizer, LR schedule, RNG states, data position, step, config.

One checkpoint is one directory; the model and the optimizer go through Megatron-Core ``dist_checkpointing``
(``torch_dist`` format), so a checkpoint loads into a different TP/PP/EP/DP layout (see "Resharding")::

    <dir>/step_<N>/               the state after (0-based) step N; the loop resumes at N + 1
        megatron/                 model + optimizer (dist_checkpointing: .metadata, *.distcp, common.pt, ...)
        trainer_state.json        step, LR schedule, data position, weight version, layout, optimizer format
        rng/rank_<r>.pt           rank r's RNG states (python, numpy, torch CPU/CUDA, Megatron's TP tracker)
        config.yaml               the run's configuration
        manifest.json             written last: every file with its size and sha256, the step, the config hash
    <dir>/latest                  the newest complete checkpoint's name (for people and tools)

Atomicity. Every rank writes into ``step_<N>.tmp-<id>``; after a barrier the files are fsynced and hashed
(each rank a share), rank 0 writes and fsyncs ``manifest.json``, renames the directory to ``step_<N>``
(atomic on POSIX) and fsyncs the parent, then replaces ``latest`` (tmp file + ``os.replace``). A crash
at any point leaves either no ``step_<N>`` or a complete one; leftover ``*.tmp-*`` directories are removed
by the next run. Older checkpoints beyond ``keep_last`` are deleted only after the new one is complete.

Validation on load. A ``step_<N>`` whose manifest is missing or unreadable, or whose files are missing,
truncated or corrupted (size or sha256 mismatch), is rejected with the reason, and resuming falls back to
the previous complete checkpoint. Everything runs on every rank (collectively) so all ranks pick the same.

Resharding. Model tensors and the non-distributed optimizer's state are saved as global tensors and load
into any TP/PP/EP/DP layout. The distributed optimizer's state is saved ``dp_reshardable`` by default
(fast, fully parallel; loads into any DP size but the same TP/PP/EP) or ``fully_reshardable``
(gathered per DP group at save; loads into any layout). Not supported: a MoE layout change that changes
how Megatron splits the optimizer into dense and expert sub-optimizers (e.g. EP2 -> EP1): the model
loads, the optimizer state is refused with a clear error. RNG states are restored only into the same
layout (otherwise the run continues with the freshly seeded generators, and says so).

Test-only hook: ``GSPO_MCORE_TEST_CRASH_IN_SAVE=<step>[:<point>]`` makes rank 0 SIGKILL itself while it
saves checkpoint ``<step>``: ``write`` (default; the shards are written, no manifest yet), ``manifest``
(manifest written, not yet renamed) or ``rename`` (renamed, ``latest`` not yet updated). Never set it
outside tests.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

FORMAT_VERSION = 1
OPTIMIZER_FORMATS = ("dp_reshardable", "fully_reshardable")
VERIFY_MODES = ("sha256", "size")
CRASH_ENV = "GSPO_MCORE_TEST_CRASH_IN_SAVE"
CRASH_POINTS = ("write", "manifest", "rename")

_STEP_DIR = re.compile(r"^step_(\d+)$")
_MANIFEST = "manifest.json"
_STATE = "trainer_state.json"
_CONFIG = "config.yaml"
_MEGATRON = "megatron"
_RNG = "rng"
_LATEST = "latest"
_HASH_CHUNK = 8 << 20


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """When to save training checkpoints, how many to keep, and whether to resume."""

    save_every: int = 0
    """Save after every ``save_every``-th step and after the last step (0: never)."""
    keep_last: int = 2
    """Complete checkpoints kept; older ones are deleted once a new one is complete."""
    resume: bool | str = False
    """``false``: start fresh (refused when saving into a directory that holds checkpoints); ``true`` (or
    ``"auto"``): the newest valid checkpoint of the directory, or a fresh start when it holds none yet (so
    a job relaunched with the same command continues); a path: that checkpoint (``.../step_<N>``, which
    must be valid) or the newest valid one in that checkpoint directory."""
    dir: str | None = None
    """Checkpoint directory (default: ``<log.output_dir>/checkpoints``)."""
    optimizer_format: str = "dp_reshardable"
    """Distributed-optimizer state: ``dp_reshardable`` (fast; reloads at any DP size, same TP/PP/EP) or
    ``fully_reshardable`` (gathered per DP group when saving; reloads into any layout)."""
    verify: str = "sha256"
    """Check on load: ``sha256`` (sizes and checksums) or ``size`` (sizes only: faster for huge checkpoints).
    Checksums are always written."""

    def __post_init__(self):
        for name in ("save_every", "keep_last"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"CheckpointConfig.{name} must be an int >= 0, got {value!r}")
        if self.keep_last < 1:
            raise ValueError(f"CheckpointConfig.keep_last must be >= 1, got {self.keep_last}")
        if isinstance(self.resume, str) and not self.resume:
            raise ValueError("CheckpointConfig.resume must be true, false, 'auto' or a checkpoint path, got ''")
        if self.optimizer_format not in OPTIMIZER_FORMATS:
            raise ValueError(f"CheckpointConfig.optimizer_format must be one of {OPTIMIZER_FORMATS}, "
                             f"got {self.optimizer_format!r}")
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"CheckpointConfig.verify must be one of {VERIFY_MODES}, got {self.verify!r}")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (invalid, incompatible, or none found); the message says why."""


@dataclass(frozen=True)
class Resumed:
    """What the trainer restores itself after :meth:`Checkpointer.resume` loaded a checkpoint."""

    step: int
    """The step the checkpoint was saved after; the loop continues at ``step + 1``."""
    path: str
    trainer_state: dict
    """``trainer_state.json`` (with the caller's ``extra`` under ``"extra"``)."""

    @property
    def extra(self) -> dict:
        return self.trainer_state.get("extra", {})


class Checkpointer:
    """Saves and resumes one run's checkpoints; every method is called on every rank.

    ``layout`` is the learner's :class:`~gspo_mcore.learner.parallel.Layout`; ``run_config`` the run's
    configuration as plain data (saved with every checkpoint and compared on resume).
    """

    def __init__(self, cfg: CheckpointConfig, root: str, layout, *, run_config: dict | None = None,
                 total_steps: int | None = None):
        self.cfg = cfg
        self.root = os.path.abspath(root)
        self.layout = layout
        self.run_config = run_config or {}
        self.total_steps = total_steps
        self.last_save_s: float | None = None
        self.last_load_s: float | None = None
        self._save_strategy = None
        self._validated_once = False
        if _rank() == 0 and os.path.isdir(self.root):
            _remove_leftovers(self.root)
        _barrier()

    # ---- when ---------------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether to save after (0-based) ``step``: every ``save_every`` steps and after the last one."""
        if self.cfg.save_every <= 0:
            return False
        last = self.total_steps is not None and step == self.total_steps - 1
        return (step + 1) % self.cfg.save_every == 0 or last

    # ---- save ---------------------------------------------------------------------------------------

    def save(self, step: int, model, optimizer, scheduler, *, extra: dict | None = None) -> str:
        """Write checkpoint ``step_<step>`` atomically; returns its path (on every rank)."""
        from megatron.core import dist_checkpointing

        t0 = time.perf_counter()
        rank = _rank()
        final = os.path.join(self.root, f"step_{step}")
        tmp = _broadcast_object(f"{final}.tmp-{uuid.uuid4().hex[:12]}" if rank == 0 else None)
        if rank == 0:
            os.makedirs(self.root, exist_ok=True)
            os.makedirs(os.path.join(tmp, _MEGATRON))
            os.makedirs(os.path.join(tmp, _RNG))
        _barrier()
        distributed = _uses_distributed_optimizer(optimizer)
        opt_format = self.cfg.optimizer_format if distributed else None
        sharded = _sharded_state_dict(model, optimizer, opt_format, is_loading=False)
        with _in_process_write_results():
            dist_checkpointing.save(sharded, os.path.join(tmp, _MEGATRON), sharded_strategy=self._strategy(),
                                    validate_access_integrity=not self._validated_once)
        self._validated_once = True
        _write_file(os.path.join(tmp, _RNG, f"rank_{rank}.pt"), lambda f: torch.save(rng_state(), f))
        t_write = time.perf_counter()
        if rank == 0:
            state = {
                "format": FORMAT_VERSION,
                "step": step,
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "layout": _layout_dict(self.layout),
                "optimizer": {"distributed": distributed, "format": opt_format,
                              "parts": len(_sub_optimizers(optimizer))},
                "versions": _versions(),
                "extra": extra or {},
            }
            _write_file(os.path.join(tmp, _STATE), lambda f: f.write(json.dumps(state, indent=1).encode()))
            _write_file(os.path.join(tmp, _CONFIG), lambda f: f.write(_yaml(self.run_config).encode()))
        _maybe_crash(step, "write")
        _barrier()
        files = _broadcast_object(_list_files(tmp) if rank == 0 else None)
        digests = _gather_digests(tmp, files, fsync=True)
        if rank == 0:
            manifest = {"format": FORMAT_VERSION, "step": step, "config_sha256": config_hash(self.run_config),
                        "world_size": _world(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                        "files": digests}
            _write_file(os.path.join(tmp, _MANIFEST), lambda f: f.write(json.dumps(manifest, indent=1).encode()))
            _fsync_dir(tmp)
            for sub in (_MEGATRON, _RNG):
                _fsync_dir(os.path.join(tmp, sub))
        _maybe_crash(step, "manifest")
        if rank == 0:
            if os.path.exists(final):  # this run resumed from an earlier checkpoint than the newest
                _log(f"replacing the existing {final}")
                _delete_dir(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
        _maybe_crash(step, "rename")
        if rank == 0:
            _atomic_write_text(os.path.join(self.root, _LATEST), os.path.basename(final) + "\n")
            self._retain(keep=final)
        _barrier()
        self.last_save_s = time.perf_counter() - t0
        _log(f"saved {final} in {self.last_save_s:.2f} s (shards {t_write - t0:.2f} s, "
             f"checksums + manifest {self.last_save_s - (t_write - t0):.2f} s)")
        return final

    def _strategy(self):
        """torch_dist, with the writes of replicated tensors spread over the data-parallel ranks."""
        if self._save_strategy is None:
            from megatron.core import parallel_state as ps
            from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
            from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

            base = get_default_save_sharded_strategy()
            if self.layout.dp_size > 1:
                group = ps.get_data_parallel_group(with_context_parallel=True)
                base = FullyParallelSaveStrategyWrapper(base, group, do_cache_distribution=True)
            self._save_strategy = base
        return self._save_strategy

    def _retain(self, *, keep: str) -> None:
        """Delete all but the newest ``keep_last`` complete checkpoints; never ``keep`` (just written)."""
        others = [path for _, path in sorted(_complete_checkpoints(self.root), reverse=True) if path != keep]
        for path in others[self.cfg.keep_last - 1:]:
            _delete_dir(path)

    # ---- resume -------------------------------------------------------------------------------------

    def resume(self, model, optimizer, scheduler) -> Resumed | None:
        """Load the checkpoint ``cfg.resume`` asks for into model, optimizer, scheduler and the RNGs.

        Returns ``None`` when starting fresh. Invalid checkpoints are skipped (newest first) with the
        reason logged; raises :class:`CheckpointError` when checkpoints exist but none is valid, when an
        explicitly named checkpoint is missing or invalid, or when a fresh start would mix with existing
        checkpoints.
        """
        mode = self.cfg.resume
        if mode is False:
            existing = _complete_checkpoints(self.root) if self.cfg.save_every > 0 else []
            if existing:  # this run's checkpoints would mix with them
                newest = max(existing)[1]
                raise CheckpointError(f"{self.root} already holds checkpoints (newest: {newest}); set "
                                      "checkpoint.resume=true to continue that run, or use another directory")
            return None
        if isinstance(mode, str) and mode != "auto":
            path = os.path.abspath(mode)
            if not os.path.isdir(path):
                raise CheckpointError(f"checkpoint.resume={mode!r}: {path} does not exist")
            if _STEP_DIR.match(os.path.basename(path.rstrip(os.sep))) or os.path.exists(os.path.join(path, _MANIFEST)):
                problems = validate(path, verify=self.cfg.verify)
                if problems:
                    raise CheckpointError(f"checkpoint {path} is not valid: {'; '.join(problems)}")
                return self.load(path, model, optimizer, scheduler)
            root = path
        else:
            root = self.root
        path, rejected = find_latest_valid(root, verify=self.cfg.verify)
        for bad, problems in rejected:
            # set aside (out of the step_<N> names, kept for inspection) once a valid one is found; never
            # another run's, and never all of them: a relaunch would then start from scratch
            where = f"; moved to {_set_aside(bad)}" if path is not None and root == self.root else ""
            _log(f"WARNING: skipping checkpoint {bad}, it is not valid: {'; '.join(problems)}{where}")
        if path is None:
            if rejected:
                raise CheckpointError(f"no valid checkpoint in {root}: every one was rejected (see above)")
            if root == self.root:
                _log(f"no checkpoint in {root} yet: starting at step 0")
                return None
            raise CheckpointError(f"checkpoint.resume={mode!r} but {root} holds no checkpoint")
        return self.load(path, model, optimizer, scheduler)

    def load(self, path: str, model, optimizer, scheduler) -> Resumed:
        """Load checkpoint ``path`` (validated by the caller) into model, optimizer, scheduler, RNGs."""
        t0 = time.perf_counter()
        with open(os.path.join(path, _STATE)) as f:
            state = json.load(f)
        if state.get("format") != FORMAT_VERSION:
            raise CheckpointError(f"{path}: checkpoint format {state.get('format')!r}, "
                                  f"this code reads {FORMAT_VERSION}")
        saved = state["layout"]
        here = _layout_dict(self.layout)
        load_model_and_optimizer(os.path.join(path, _MEGATRON), model, optimizer, saved_optimizer=state["optimizer"],
                                 saved_layout=saved, layout=here)
        if scheduler is not None and state.get("scheduler") is not None:
            try:
                scheduler.load_state_dict(state["scheduler"])
            except AssertionError as exc:
                raise CheckpointError(f"{path}: the LR schedule differs from the checkpoint's ({exc}); keep "
                                      "optim.lr/min_lr/lr_warmup_steps/lr_decay_steps as they were to resume") from None
        if saved == here:
            set_rng_state(torch.load(os.path.join(path, _RNG, f"rank_{_rank()}.pt"), weights_only=False))
        else:
            _log(f"RNG states not restored: saved with layout {saved}, running {here} (fresh seeds from here)")
        self._report_config_changes(path)
        self.last_load_s = time.perf_counter() - t0
        _log(f"resumed from {path} (step {state['step']}) in {self.last_load_s:.2f} s")
        return Resumed(step=int(state["step"]), path=path, trainer_state=state)

    def _report_config_changes(self, path: str) -> None:
        if _rank() != 0 or not self.run_config:
            return
        import yaml

        with open(os.path.join(path, _CONFIG)) as f:
            before = yaml.safe_load(f) or {}
        changes = [f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(_diff(before, self.run_config).items())
                   if k not in ("steps", "checkpoint.resume")]
        if changes:
            _log("resuming with a changed configuration: " + "; ".join(changes))


# ---- model and optimizer through dist_checkpointing ---------------------------------------------------

def _model_keys(model) -> list[str]:
    return ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]  # Megatron-LM's keys


def _model_sharded_state_dict(model) -> dict:
    from gspo_mcore.learner.model import unwrap

    return {key: unwrap(chunk).sharded_state_dict() for key, chunk in zip(_model_keys(model), model)}


def _sharded_state_dict(model, optimizer, opt_format: str | None, *, is_loading: bool) -> dict:
    sharded = _model_sharded_state_dict(model)
    if optimizer is not None:
        model_sd = {}
        for part in sharded.values():
            model_sd.update(part)
        # model-space optimizer keys without a per-sub-optimizer prefix: they then do not depend on how the
        # parameters are split into sub-optimizers (dense / expert), which changes with EP
        metadata = {"chained_optim_avoid_prefix": True}
        if opt_format:
            metadata["distrib_optim_sharding_type"] = opt_format
        if opt_format == "fully_reshardable":
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = True  # gather over gloo, to DP rank 0
        sharded["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    return sharded


def _uses_distributed_optimizer(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(o, DistributedOptimizer) for o in _sub_optimizers(optimizer))


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def load_model_and_optimizer(megatron_dir: str, model, optimizer, *, saved_optimizer: dict, saved_layout: dict,
                             layout: dict) -> None:
    """Load the dist_checkpointing part into ``model`` (and ``optimizer`` unless ``None``).

    The optimizer kind must match the checkpoint's; a ``dp_reshardable`` distributed-optimizer state
    only loads into the same TP/PP/EP sizes.
    """
    from megatron.core import dist_checkpointing

    distributed = _uses_distributed_optimizer(optimizer) if optimizer is not None else saved_optimizer["distributed"]
    opt_format = saved_optimizer.get("format")
    if optimizer is not None:
        if distributed != saved_optimizer["distributed"]:
            raise CheckpointError(f"{megatron_dir}: saved with use_distributed_optimizer="
                                  f"{saved_optimizer['distributed']}, this run has {distributed}; resume with the "
                                  "same optim.use_distributed_optimizer")
        parts = len(_sub_optimizers(optimizer))
        if saved_optimizer.get("parts", parts) != parts:
            raise CheckpointError(
                f"{megatron_dir}: the optimizer state was saved as {saved_optimizer['parts']} sub-optimizers (Megatron "
                f"puts dense and expert parameters in separate ones for some expert layouts) at "
                f"{_fmt_layout(saved_layout, ('tp', 'ep', 'etp'))}, this run has {parts} at "
                f"{_fmt_layout(layout, ('tp', 'ep', 'etp'))}: that change of layout is not supported for the "
                "optimizer state (the model alone loads: load_model_and_optimizer(..., optimizer=None))")
        fixed = ("tp", "pp", "ep", "etp")
        if opt_format == "dp_reshardable" and any(saved_layout[k] != layout[k] for k in fixed):
            raise CheckpointError(
                f"{megatron_dir}: the distributed-optimizer state was saved dp_reshardable at "
                f"{_fmt_layout(saved_layout, fixed)}; it loads only at the same TP/PP/EP (any DP), this run is "
                f"{_fmt_layout(layout, fixed)}. Save with checkpoint.optimizer_format=fully_reshardable to change them")
    with torch.no_grad():
        if optimizer is not None and distributed:
            for sub in _sub_optimizers(optimizer):  # torch Adam has no state before its first step
                sub._init_optimizer_states_with_dummy_values()
        sharded = _sharded_state_dict(model, optimizer, opt_format if distributed else None, is_loading=True)
        # every requested key must be in the checkpoint; with the optimizer, also every saved key must be used
        loaded = dist_checkpointing.load(sharded, megatron_dir,
                                         strict="raise_all" if optimizer is not None else "raise_unexpected")
        for key, chunk in zip(_model_keys(model), model):
            chunk.load_state_dict(loaded[key], strict=True)
        if optimizer is not None:
            optimizer.load_state_dict(loaded["optimizer"])
            _check_adam_steps(optimizer, megatron_dir)


def _check_adam_steps(optimizer, where: str) -> None:
    """torch's Adam keeps a step counter per parameter: after a load each must be its own tensor holding
    the restored step. megatron-core 0.16.1's distributed optimizer breaks both (fixed on CPU hosts by
    :mod:`gspo_mcore.platform.megatron_cpu`); a silently restarted bias correction must not go unnoticed."""
    for sub in _sub_optimizers(optimizer):
        inner = getattr(sub, "optimizer", None)
        seen = set()
        for group in getattr(inner, "param_groups", []):
            for param in group["params"]:
                step = inner.state.get(param, {}).get("step")
                if not torch.is_tensor(step):
                    continue
                if id(step) in seen or ("step" in group and float(step) != float(group["step"])):
                    raise CheckpointError(f"{where}: after loading, torch Adam's per-parameter step counters are "
                                          "shared or stale (megatron-core's distributed optimizer with torch's Adam, "
                                          "i.e. without Apex/Transformer Engine): resuming would train wrongly")
                seen.add(id(step))


# ---- validation and discovery --------------------------------------------------------------------------

def validate(path: str, *, verify: str = "sha256") -> list[str]:
    """Problems of checkpoint ``path`` (empty: valid). Collective: every rank checks a share of the files."""
    problems: list[str] = []
    try:
        with open(os.path.join(path, _MANIFEST)) as f:
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
        for name in names[_rank()::_world()]:
            problems.extend(_check_file(path, name, files[name], verify))
        for required in (_STATE, f"{_MEGATRON}/metadata.json"):
            if required not in files and _rank() == 0:
                problems.append(f"{required} missing from the manifest")
    return sorted({p for part in _all_gather_object(problems) for p in part})


def find_latest_valid(root: str, *, verify: str = "sha256") -> tuple[str | None, list[tuple[str, list[str]]]]:
    """The newest valid checkpoint under ``root`` (or ``None``) and the newer ones rejected, with reasons."""
    rejected = []
    for _, path in sorted(_complete_checkpoints(root), reverse=True):
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


def _complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every ``step_<N>`` directory (renamed into place, so complete when written)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        m = _STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            out.append((int(m.group(1)), os.path.join(root, name)))
    return out


def _remove_leftovers(root: str) -> None:
    for name in os.listdir(root):
        if (".tmp-" in name or ".deleting-" in name) and os.path.isdir(os.path.join(root, name)):
            _log(f"removing {os.path.join(root, name)} (left by an interrupted save or deletion)")
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _set_aside(path: str) -> str:
    """Move a rejected checkpoint out of the ``step_<N>`` namespace (kept for inspection, never deleted)."""
    aside = f"{path}.rejected-{uuid.uuid4().hex[:12]}"
    if _rank() == 0:
        os.rename(path, aside)
    _barrier()
    return aside


def _delete_dir(path: str) -> None:
    """Rename out of the ``step_<N>`` namespace first, so a crash mid-delete leaves no half checkpoint."""
    doomed = f"{path}.deleting-{uuid.uuid4().hex[:12]}"
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


# ---- files, hashing ------------------------------------------------------------------------------------

def _list_files(root: str) -> list[str]:
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


def _gather_digests(root: str, files: list[str], *, fsync: bool) -> dict[str, dict]:
    """``{name: {size, sha256}}`` for every file; each rank fsyncs and hashes a share."""
    mine = {name: {"size": os.path.getsize(os.path.join(root, name)),
                   "sha256": _sha256(os.path.join(root, name), fsync=fsync)}
            for name in files[_rank()::_world()]}
    out = {}
    for part in _all_gather_object(mine):
        out.update(part)
    return dict(sorted(out.items()))


def _write_file(path: str, write) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
    _write_file(tmp, lambda f: f.write(text.encode()))
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _in_process_write_results():
    """Synchronous saves: collect the writer's results in an in-process queue.

    megatron-core's ``FileSystemWriterAsync`` hands its results back through a queue owned by a
    ``multiprocessing.Manager`` that it starts with ``spawn`` on first use: 3-12 s, and a re-import of
    the main module. A synchronous save runs the writer in this process, so a plain queue is enough.
    (Checked on megatron-core 0.16.1; without the attribute this does nothing and the save is slower.)
    """
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_results_queue"):
        yield
        return
    before = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = before


# ---- RNG -----------------------------------------------------------------------------------------------

def rng_state() -> dict:
    """This rank's RNG states: python, numpy, torch CPU (and CUDA), Megatron's model-parallel tracker."""
    import numpy as np
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "megatron_tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["megatron_tracker"])


# ---- small helpers -------------------------------------------------------------------------------------

def config_hash(run_config: dict) -> str:
    return hashlib.sha256(json.dumps(run_config, sort_keys=True, default=str).encode()).hexdigest()


def _diff(a, b, prefix: str = "") -> dict[str, tuple]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = {}
        for key in sorted(set(a) | set(b), key=str):
            out.update(_diff(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else str(key)))
        return out
    a = list(a) if isinstance(a, tuple) else a
    b = list(b) if isinstance(b, tuple) else b
    return {} if a == b else {prefix: (a, b)}


def _yaml(data) -> str:
    import yaml

    return yaml.safe_dump(json.loads(json.dumps(data, default=str)), sort_keys=False)


def _layout_dict(layout) -> dict:
    from megatron.core import parallel_state as ps

    return {"world_size": layout.world_size, "tp": layout.tp_size, "pp": layout.pp_size, "dp": layout.dp_size,
            "ep": layout.ep_size, "etp": ps.get_expert_tensor_parallel_world_size(), "cp": layout.cp_size}


def _fmt_layout(layout: dict, keys) -> str:
    return " ".join(f"{k.upper()}={layout[k]}" for k in keys)


def _versions() -> dict:
    import megatron.core

    return {"megatron_core": getattr(megatron.core, "__version__", "unknown"), "torch": torch.__version__}


def _maybe_crash(step: int, point: str) -> None:
    """Test-only: SIGKILL rank 0 at ``point`` of the save of ``step`` (see the module docstring)."""
    spec = os.environ.get(CRASH_ENV)
    if not spec or _rank() != 0:
        return
    want_step, _, want_point = spec.partition(":")
    if int(want_step) == step and (want_point or "write") == point:
        _log(f"{CRASH_ENV}={spec}: killing rank 0 during the save of step {step} ({point})")
        os.kill(os.getpid(), signal.SIGKILL)


def _log(message: str) -> None:
    if _rank() == 0:
        print(f"[gspo_mcore.checkpoint] {message}", file=sys.stderr, flush=True)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast_object(obj: Any) -> Any:
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_gather_object(obj: Any) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


__all__ = ["CRASH_ENV", "CheckpointConfig", "CheckpointError", "Checkpointer", "Resumed", "config_hash",
           "find_latest_valid", "load_model_and_optimizer", "rng_state", "set_rng_state", "validate"]
