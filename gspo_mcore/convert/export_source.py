"""What an export to Hugging Face reads: the distributed checkpoint to load, and the Hugging Face files
(``config.json``, tokenizer) that describe its model.

:func:`locate` accepts any of:

- a training run folder (``log.output_dir``), or a training checkpoint directory (the folder holding
  ``step_<N>`` and ``latest``): the newest checkpoint that validates (manifest sizes and sha256; newer damaged
  ones are skipped and reported). A run folder's checkpoints are its own, as a resume finds them however the
  folder was copied or moved (:data:`gspo_mcore.trainer.run_dir.RESUME_MAY_DIFFER`): the folder itself,
  ``<run>/checkpoints``, or the ``checkpoint.dir`` its ``config.yaml`` records when that lies inside the
  recorded ``log.output_dir`` (taken at the same place inside this folder). Only when the folder holds no
  checkpoint is a ``checkpoint.dir`` outside it followed (:attr:`TrainingCheckpoint.found_via` says so): an
  absolute one as it is, a relative one against the folder the run was started in, which is this folder's
  path less the recorded relative ``log.output_dir`` (never the current directory: from there it may name
  another run, such as the live original of a backup); when the folder's path does not end with it (moved or
  renamed) a relative ``checkpoint.dir`` is not followed;
- one training checkpoint ``.../step_<N>`` (or a copy of one under another name: a folder holding its
  ``manifest.json`` and ``trainer_state.json``), validated the same way; a damaged one is refused. An
  unfinished one is refused by name whatever ``verify`` says: an interrupted save (``step_<N>.tmp-*``), a
  deletion (``*.deleting-*``), a checkpoint set aside as damaged (``*.rejected-*``), or one without its
  ``manifest.json`` (written last);
- a folder written by ``tools/convert_hf_to_mcore.py`` (``OUT/model`` + ``config.json``);
- a bare distributed checkpoint (``metadata.json``) with ``config.json`` beside it.

A training checkpoint carries the run's ``config.yaml``; ``config.json`` comes from its ``model.hf_dir``
and the tokenizer from its ``template.tokenizer_dir`` (default ``model.hf_dir``), unless ``config_dir``
names the folder to take both from. Nothing here imports megatron or needs a process group.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass

from gspo_mcore.learner.checkpoint.files import (
    CONFIG,
    LATEST,
    MANIFEST,
    MEGATRON,
    STATE,
    STEP_DIR,
    VERIFY_MODES,
    complete_checkpoints,
    find_latest_valid,
    validate,
)

CONVERTED_MODEL_DIR = "model"
"""Where ``tools/convert_hf_to_mcore.py`` puts the distributed checkpoint inside its output folder."""
RUN_CONFIG = "config.yaml"
"""The resolved configuration a training run writes into ``log.output_dir``."""
DEFAULT_CHECKPOINT_SUBDIR = "checkpoints"
UNFINISHED = re.compile(r"^step_\d+\.(?P<kind>tmp|deleting|rejected)-")
"""The names the checkpointer gives a step while it is written, deleted, or set aside as damaged."""
_UNFINISHED_WHY = {
    "tmp": "an interrupted or running save",
    "deleting": "a checkpoint being deleted",
    "rejected": "a checkpoint set aside as damaged",
}


class ExportSourceError(FileNotFoundError):
    """The path given to export does not lead to a usable checkpoint or its Hugging Face files."""


@dataclass(frozen=True)
class TrainingCheckpoint:
    """One complete training checkpoint (``gspo_mcore.learner.checkpoint``'s ``step_<N>``)."""

    path: str
    step: int
    """The (0-based) step it was saved after."""
    run_config: dict
    """The run's configuration (its ``config.yaml``)."""
    trainer_state: dict
    """Its ``trainer_state.json`` (layout, optimizer kind, LR schedule)."""
    config_sha256: str | None
    """The run configuration's hash from the manifest."""
    skipped: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """Newer checkpoints that were passed over, with why (damaged or incomplete)."""
    manifest_sha256: str | None = None
    """The sha256 of its ``manifest.json`` (which lists every file's size and sha256): names its content."""
    found_via: str | None = None
    """Set when a run folder held no checkpoint and its ``config.yaml``'s ``checkpoint.dir`` outside it was
    followed: a line naming that directory, for the user."""

    @property
    def megatron_dir(self) -> str:
        return os.path.join(self.path, MEGATRON)


@dataclass(frozen=True)
class ExportSource:
    """A distributed checkpoint and the Hugging Face files that go with it."""

    ckpt_dir: str
    """The ``dist_checkpointing`` folder (holds ``metadata.json``)."""
    side_dir: str
    """The folder of ``config.json`` (and of the other Hugging Face side files)."""
    tokenizer_dir: str | None = None
    """A separate folder to take the tokenizer files from (``None``: ``side_dir``'s)."""
    training: TrainingCheckpoint | None = None
    """Set when ``ckpt_dir`` is a training checkpoint's (its model part is loaded, the optimizer skipped)."""


def locate(path: str, *, config_dir: str | None = None, verify: str = "sha256") -> ExportSource:
    """The :class:`ExportSource` for ``path`` (see the module docstring); ``verify``: ``sha256``, ``size``
    or ``none`` (how training checkpoints are checked before use). Raises :class:`ExportSourceError`
    naming the path and what is missing."""
    if verify not in (*VERIFY_MODES, "none"):
        raise ValueError(f"verify must be one of {(*VERIFY_MODES, 'none')}, got {verify!r}")
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise ExportSourceError(f"{path} does not exist (or is not a folder)")
    if config_dir is not None and not os.path.isfile(os.path.join(config_dir, "config.json")):
        raise ExportSourceError(f"no config.json in {config_dir} (--config)")
    training = find_training_checkpoint(path, verify=verify)
    if training is not None:
        side, tokenizer = _training_hf_dirs(training, config_dir)
        return ExportSource(ckpt_dir=training.megatron_dir, side_dir=side, tokenizer_dir=tokenizer, training=training)
    candidates = (os.path.join(path, CONVERTED_MODEL_DIR), path)
    ckpt = next((c for c in candidates if os.path.isfile(os.path.join(c, "metadata.json"))), None)
    if ckpt is None:
        raise ExportSourceError(
            f"no Megatron distributed checkpoint (metadata.json) in any of {list(candidates)}, and {path} is not a "
            "training run folder, checkpoint directory or step_<N> checkpoint"
        )
    for side in [config_dir] if config_dir else [path, os.path.dirname(ckpt)]:
        if os.path.isfile(os.path.join(side, "config.json")):
            return ExportSource(ckpt_dir=ckpt, side_dir=side)
    raise ExportSourceError(f"no config.json next to the checkpoint {ckpt} (pass the Hugging Face folder as --config)")


def find_training_checkpoint(path: str, *, verify: str = "sha256") -> TrainingCheckpoint | None:
    """The training checkpoint ``path`` leads to (a step directory, a checkpoint directory or a run folder),
    or ``None`` when ``path`` is none of these. Raises :class:`ExportSourceError` when it is one but no
    checkpoint there is usable, or an unfinished one."""
    _refuse_unfinished(path)
    if _is_step_dir(path):
        problems = [] if verify == "none" else validate(path, verify=verify)
        if problems:
            raise ExportSourceError(f"checkpoint {path} is not valid: {'; '.join(problems)}")
        return _read(path, ())
    root, found_via = _checkpoint_root(path)
    if root is None:
        return None
    if verify == "none":
        steps = sorted(complete_checkpoints(root), reverse=True)
        if not steps:
            raise ExportSourceError(f"{root} holds no checkpoint (step_<N>)")
        _refuse_unfinished(steps[0][1])
        return dataclasses.replace(_read(steps[0][1], ()), found_via=found_via)
    found, rejected = find_latest_valid(root, verify=verify)
    skipped = tuple((bad, tuple(problems)) for bad, problems in rejected)
    if found is None:
        if rejected:
            reasons = "; ".join(f"{os.path.basename(b)}: {', '.join(p)}" for b, p in skipped)
            raise ExportSourceError(f"no valid checkpoint in {root}: every one was rejected ({reasons})")
        raise ExportSourceError(f"{root} holds no checkpoint (step_<N>) yet")
    return dataclasses.replace(_read(found, skipped), found_via=found_via)


def _refuse_unfinished(path: str) -> None:
    """Refuse an unfinished checkpoint by its name, or a checkpoint without its manifest (written last)."""
    name = os.path.basename(path.rstrip(os.sep))
    m = UNFINISHED.match(name)
    if m:
        raise ExportSourceError(
            f"{path} is an unfinished checkpoint ({name}: {_UNFINISHED_WHY[m['kind']]}); export a complete "
            "step_<N> (or the run folder, for its newest valid one)"
        )
    if os.path.isfile(os.path.join(path, STATE)) and not os.path.isfile(os.path.join(path, MANIFEST)):
        raise ExportSourceError(
            f"{path} is an unfinished checkpoint: it holds {STATE} but no {MANIFEST} (written last, when a save "
            "completes); export a complete step_<N>"
        )


def _is_step_dir(path: str) -> bool:
    """One checkpoint: ``step_<N>`` with its state or manifest, or a folder (a renamed copy) holding both."""
    state, manifest = os.path.isfile(os.path.join(path, STATE)), os.path.isfile(os.path.join(path, MANIFEST))
    return (state and manifest) or (bool(STEP_DIR.match(os.path.basename(path.rstrip(os.sep)))) and (state or manifest))


def _checkpoint_root(path: str) -> tuple[str | None, str | None]:
    """(the checkpoint directory ``path`` is or holds, a line when it was found outside ``path``), or
    ``(None, None)`` when ``path`` is neither a checkpoint directory nor a run folder (module docstring)."""
    if os.path.isfile(os.path.join(path, LATEST)) or complete_checkpoints(path):
        return path, None
    run_config = os.path.join(path, RUN_CONFIG)
    if not os.path.isfile(run_config):
        default = os.path.join(path, DEFAULT_CHECKPOINT_SUBDIR)
        return (default, None) if os.path.isdir(default) else (None, None)
    saved = _load_yaml(run_config)
    configured = (saved.get("checkpoint") or {}).get("dir")
    output_dir = (saved.get("log") or {}).get("output_dir")
    own = [os.path.join(path, DEFAULT_CHECKPOINT_SUBDIR)]
    inside = _inside(configured, output_dir)
    if inside is not None:
        own.insert(0, os.path.normpath(os.path.join(path, inside)))
    for root in own:
        if complete_checkpoints(root):
            return root, None
    elsewhere = _outside(configured, output_dir, path) if configured and inside is None else None
    if elsewhere is not None and complete_checkpoints(elsewhere):
        return elsewhere, (
            f"{path} holds no checkpoint; using checkpoint.dir={elsewhere} named by its {RUN_CONFIG} "
            f"(recorded as {configured!r})"
        )
    where = " or ".join(dict.fromkeys(own))
    raise ExportSourceError(
        f"the run folder {path} holds no checkpoint (none in {where})"
        + (f", nor does its checkpoint.dir {elsewhere}" if elsewhere else "")
        + (
            f"; its config.yaml's relative checkpoint.dir {configured!r} is not followed: {path} does not end "
            f"with the recorded log.output_dir {output_dir!r}"
            if configured and inside is None and elsewhere is None
            else ""
        )
        + "; pass the checkpoint as --mcore"
    )


def _inside(configured: str | None, output_dir: str | None) -> str | None:
    """``checkpoint.dir`` relative to ``log.output_dir`` when it lies inside it (both as recorded), else None."""
    if not configured or not output_dir or os.path.isabs(configured) != os.path.isabs(output_dir):
        return None
    rel = os.path.relpath(os.path.normpath(configured), os.path.normpath(output_dir))
    return None if rel == os.pardir or rel.startswith(os.pardir + os.sep) else rel


def _outside(configured: str, output_dir: str | None, run_dir: str) -> str | None:
    """A ``checkpoint.dir`` outside the run folder: absolute as recorded; relative, against the folder the run
    was started in (``run_dir`` less the recorded relative ``log.output_dir``), or None when that is unknown."""
    if os.path.isabs(configured):
        return os.path.normpath(configured)
    if not output_dir or os.path.isabs(output_dir):
        return None
    parts = os.path.normpath(output_dir).split(os.sep)
    if parts == [os.curdir]:
        return os.path.normpath(os.path.join(run_dir, configured))
    tail = os.path.normpath(run_dir).split(os.sep)
    if os.pardir in parts or tail[-len(parts) :] != parts:
        return None
    return os.path.normpath(os.path.join(os.sep.join(tail[: -len(parts)]) or os.sep, configured))


def _read(step_dir: str, skipped) -> TrainingCheckpoint:
    step_dir = os.path.abspath(step_dir)
    try:
        with open(os.path.join(step_dir, STATE)) as f:
            state = json.load(f)
    except (OSError, ValueError) as exc:
        raise ExportSourceError(f"checkpoint {step_dir}: cannot read {STATE}: {exc}") from None
    manifest = {}
    if os.path.isfile(os.path.join(step_dir, MANIFEST)):
        with open(os.path.join(step_dir, MANIFEST)) as f:
            manifest = json.load(f)
    config_file = os.path.join(step_dir, CONFIG)
    return TrainingCheckpoint(
        path=step_dir,
        step=int(state["step"]),
        run_config=_load_yaml(config_file) if os.path.isfile(config_file) else {},
        trainer_state=state,
        config_sha256=manifest.get("config_sha256"),
        skipped=skipped,
        manifest_sha256=_file_sha256(os.path.join(step_dir, MANIFEST)),
    )


def _file_sha256(path: str) -> str | None:
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _training_hf_dirs(ckpt: TrainingCheckpoint, config_dir: str | None) -> tuple[str, str | None]:
    """(folder of config.json, separate tokenizer folder or None) for a training checkpoint."""
    if config_dir is not None:
        return os.path.abspath(config_dir), None
    model = ckpt.run_config.get("model") or {}
    hf_dir = model.get("hf_dir")
    if not hf_dir:
        raise ExportSourceError(
            f"{ckpt.path}/{CONFIG} names no model.hf_dir; pass the model's Hugging Face folder as --config"
        )
    side = _resolve_dir(hf_dir)
    if side is None or not os.path.isfile(os.path.join(side, "config.json")):
        raise ExportSourceError(
            f"the run's model.hf_dir {hf_dir!r} (from {ckpt.path}/{CONFIG}) has no config.json seen from "
            f"{os.getcwd()}; pass that model folder as --config"
        )
    tokenizer = (ckpt.run_config.get("template") or {}).get("tokenizer_dir")
    tokenizer = _resolve_dir(tokenizer) if tokenizer else None
    return side, tokenizer if tokenizer not in (None, side) else None


def _resolve_dir(path: str) -> str | None:
    path = os.path.abspath(path)
    return path if os.path.isdir(path) else None


def _load_yaml(path: str) -> dict:
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f)
    return data if isinstance(data, dict) else {}
