"""When and how a run saves and resumes its checkpoints: :class:`CheckpointConfig` and :class:`Checkpointer`.

The on-disk format is :mod:`.files`'s, the model and optimizer state :mod:`.megatron_state`'s, the RNG
states :mod:`.rng`'s; this module orders them into an atomic save and a validated resume.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from dataclasses import dataclass

import torch

from gspo_mcore.learner.checkpoint import _log
from gspo_mcore.learner.checkpoint._dist import barrier, broadcast_object, rank, world
from gspo_mcore.learner.checkpoint.errors import CheckpointError
from gspo_mcore.learner.checkpoint.files import (
    CONFIG,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    MEGATRON,
    RNG,
    STATE,
    VERIFY_MODES,
    VerifyMode,
    atomic_write_text,
    complete_checkpoints,
    config_hash,
    config_yaml,
    delete_dir,
    find_latest_valid,
    fsync_dir,
    gather_digests,
    is_checkpoint_dir,
    list_files,
    remove_leftovers,
    retain,
    set_aside,
    validate,
    write_file,
)
from gspo_mcore.learner.checkpoint.megatron_state import (
    OPTIMIZER_FORMATS,
    OptimizerFormat,
    layout_dict,
    load_model_and_optimizer,
    model_part,
    sharded_state_dict,
    sub_optimizers,
    uses_distributed_optimizer,
)
from gspo_mcore.learner.checkpoint.rng import rng_state, set_rng_state
from gspo_mcore.platform.megatron_checkpoint import in_process_write_results

CRASH_ENV = "GSPO_MCORE_TEST_CRASH_IN_SAVE"
"""Test-only: see :func:`_maybe_crash`."""
CRASH_POINTS = ("write", "manifest", "rename")


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
    optimizer_format: OptimizerFormat = "dp_reshardable"
    """Distributed-optimizer state: ``dp_reshardable`` (fast; reloads at any DP size, same TP/PP/EP) or
    ``fully_reshardable`` (gathered per DP group when saving; reloads into any layout)."""
    verify: VerifyMode = "sha256"
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
            raise ValueError(
                f"CheckpointConfig.optimizer_format must be one of {OPTIMIZER_FORMATS}, got {self.optimizer_format!r}"
            )
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"CheckpointConfig.verify must be one of {VERIFY_MODES}, got {self.verify!r}")


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

    def __init__(
        self,
        cfg: CheckpointConfig,
        root: str,
        layout,
        *,
        run_config: dict | None = None,
        total_steps: int | None = None,
    ):
        self.cfg = cfg
        self.root = os.path.abspath(root)
        self.layout = layout
        self.run_config = run_config or {}
        self.total_steps = total_steps
        self.last_save_s: float | None = None
        self.last_load_s: float | None = None
        self._save_strategy = None
        self._validated_once = False
        if rank() == 0 and os.path.isdir(self.root):
            remove_leftovers(self.root)
        barrier()

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
        me = rank()
        final = os.path.join(self.root, f"step_{step}")
        tmp = broadcast_object(f"{final}.tmp-{uuid.uuid4().hex[:12]}" if me == 0 else None)
        if me == 0:
            os.makedirs(self.root, exist_ok=True)
            os.makedirs(os.path.join(tmp, MEGATRON))
            os.makedirs(os.path.join(tmp, RNG))
        barrier()
        distributed = uses_distributed_optimizer(optimizer)
        opt_format = self.cfg.optimizer_format if distributed else None
        part = model_part(model)  # LoRA: the adapters only (the base is rebuilt at resume as at the start)
        sharded = sharded_state_dict(model, optimizer, opt_format, is_loading=False, part=part)
        with in_process_write_results():
            dist_checkpointing.save(
                sharded,
                os.path.join(tmp, MEGATRON),
                sharded_strategy=self._strategy(),
                validate_access_integrity=not self._validated_once,
            )
        self._validated_once = True
        write_file(os.path.join(tmp, RNG, f"rank_{me}.pt"), lambda f: torch.save(rng_state(), f))
        t_write = time.perf_counter()
        if me == 0:
            state = {
                "format": FORMAT_VERSION,
                "step": step,
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "layout": layout_dict(self.layout),
                "model": part,
                "optimizer": {
                    "distributed": distributed,
                    "format": opt_format,
                    "parts": len(sub_optimizers(optimizer)),
                },
                "versions": _versions(),
                "extra": extra or {},
            }
            write_file(os.path.join(tmp, STATE), lambda f: f.write(json.dumps(state, indent=1).encode()))
            write_file(os.path.join(tmp, CONFIG), lambda f: f.write(config_yaml(self.run_config).encode()))
        _maybe_crash(step, "write")
        barrier()
        files = broadcast_object(list_files(tmp) if me == 0 else None)
        digests = gather_digests(tmp, files, fsync=True)
        if me == 0:
            manifest = {
                "format": FORMAT_VERSION,
                "step": step,
                "config_sha256": config_hash(self.run_config),
                "world_size": world(),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "files": digests,
            }
            write_file(os.path.join(tmp, MANIFEST), lambda f: f.write(json.dumps(manifest, indent=1).encode()))
            fsync_dir(tmp)
            for sub in (MEGATRON, RNG):
                fsync_dir(os.path.join(tmp, sub))
        _maybe_crash(step, "manifest")
        if me == 0:
            if os.path.exists(final):  # this run resumed from an earlier checkpoint than the newest
                _log.info(f"replacing the existing {final}")
                delete_dir(final)
            os.rename(tmp, final)
            fsync_dir(self.root)
        _maybe_crash(step, "rename")
        if me == 0:
            atomic_write_text(os.path.join(self.root, LATEST), os.path.basename(final) + "\n")
            retain(self.root, keep_last=self.cfg.keep_last, keep=final)
        barrier()
        self.last_save_s = time.perf_counter() - t0
        _log.info(
            f"saved {final} in {self.last_save_s:.2f} s (shards {t_write - t0:.2f} s, "
            f"checksums + manifest {self.last_save_s - (t_write - t0):.2f} s)"
        )
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
            existing = complete_checkpoints(self.root) if self.cfg.save_every > 0 else []
            if existing:  # this run's checkpoints would mix with them
                newest = max(existing)[1]
                raise CheckpointError(
                    f"{self.root} already holds checkpoints (newest: {newest}); set "
                    "checkpoint.resume=true to continue that run, or use another directory"
                )
            return None
        if isinstance(mode, str) and mode != "auto":
            path = os.path.abspath(mode)
            if not os.path.isdir(path):
                raise CheckpointError(f"checkpoint.resume={mode!r}: {path} does not exist")
            if is_checkpoint_dir(path):
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
            where = f"; moved to {set_aside(bad)}" if path is not None and root == self.root else ""
            _log.warning(f"WARNING: skipping checkpoint {bad}, it is not valid: {'; '.join(problems)}{where}")
        if path is None:
            if rejected:
                raise CheckpointError(f"no valid checkpoint in {root}: every one was rejected (see above)")
            if root == self.root:
                _log.info(f"no checkpoint in {root} yet: starting at step 0")
                return None
            raise CheckpointError(f"checkpoint.resume={mode!r} but {root} holds no checkpoint")
        return self.load(path, model, optimizer, scheduler)

    def load(self, path: str, model, optimizer, scheduler) -> Resumed:
        """Load checkpoint ``path`` (validated by the caller) into model, optimizer, scheduler, RNGs."""
        t0 = time.perf_counter()
        with open(os.path.join(path, STATE)) as f:
            state = json.load(f)
        if state.get("format") != FORMAT_VERSION:
            raise CheckpointError(
                f"{path}: checkpoint format {state.get('format')!r}, this code reads {FORMAT_VERSION}"
            )
        saved = state["layout"]
        here = layout_dict(self.layout)
        load_model_and_optimizer(
            os.path.join(path, MEGATRON),
            model,
            optimizer,
            saved_optimizer=state["optimizer"],
            saved_layout=saved,
            layout=here,
            part=state.get("model", "all"),
        )
        if scheduler is not None and state.get("scheduler") is not None:
            try:
                scheduler.load_state_dict(state["scheduler"])
            except AssertionError as exc:
                raise CheckpointError(
                    f"{path}: the LR schedule differs from the checkpoint's ({exc}); keep "
                    "optim.lr/min_lr/lr_warmup_steps/lr_decay_steps as they were to resume"
                ) from None
        if saved == here:
            set_rng_state(torch.load(os.path.join(path, RNG, f"rank_{rank()}.pt"), weights_only=False))
        else:
            _log.info(f"RNG states not restored: saved with layout {saved}, running {here} (fresh seeds from here)")
        self._report_config_changes(path)
        self.last_load_s = time.perf_counter() - t0
        _log.info(f"resumed from {path} (step {state['step']}) in {self.last_load_s:.2f} s")
        return Resumed(step=int(state["step"]), path=path, trainer_state=state)

    def _report_config_changes(self, path: str) -> None:
        if rank() != 0 or not self.run_config:
            return
        import yaml

        with open(os.path.join(path, CONFIG)) as f:
            before = yaml.safe_load(f) or {}
        changes = [
            f"{k}: {a!r} -> {b!r}"
            for k, (a, b) in sorted(_diff(before, self.run_config).items())
            if k not in ("steps", "checkpoint.resume")
        ]
        if changes:
            _log.info("resuming with a changed configuration: " + "; ".join(changes))


def _diff(a, b, prefix: str = "") -> dict[str, tuple]:
    """``{dotted key: (a's value, b's value)}`` where the nested plain data ``a`` and ``b`` differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = {}
        for key in sorted(set(a) | set(b), key=str):
            out.update(_diff(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else str(key)))
        return out
    a = list(a) if isinstance(a, tuple) else a
    b = list(b) if isinstance(b, tuple) else b
    return {} if a == b else {prefix: (a, b)}


def _versions() -> dict:
    import megatron.core

    return {"megatron_core": getattr(megatron.core, "__version__", "unknown"), "torch": torch.__version__}


def _maybe_crash(step: int, point: str) -> None:
    """TEST-ONLY crash hook: never set :data:`CRASH_ENV` outside tests.

    ``GSPO_MCORE_TEST_CRASH_IN_SAVE=<step>[:<point>]`` makes rank 0 SIGKILL itself while it saves
    checkpoint ``<step>``, at ``point``: ``write`` (default; the shards are written, no manifest yet),
    ``manifest`` (manifest written, not yet renamed) or ``rename`` (renamed, ``latest`` not yet updated).
    The crash tests use it to show that an interrupted save leaves either no ``step_<N>`` or a complete one.
    """
    spec = os.environ.get(CRASH_ENV)
    if not spec or rank() != 0:
        return
    want_step, _, want_point = spec.partition(":")
    if int(want_step) == step and (want_point or "write") == point:
        _log.info(f"{CRASH_ENV}={spec}: killing rank 0 during the save of step {step} ({point})")
        os.kill(os.getpid(), signal.SIGKILL)
