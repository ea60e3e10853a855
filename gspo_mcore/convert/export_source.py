"""What an export to Hugging Face reads: the distributed checkpoint to load, and the Hugging Face files
(``config.json``, tokenizer) that describe its model.

:func:`locate` accepts any of:

- a training run folder (``log.output_dir``: its ``config.yaml`` names ``checkpoint.dir``, by default
  ``<run>/checkpoints``), or a training checkpoint directory (the folder holding ``step_<N>`` and
  ``latest``): the newest checkpoint that validates (manifest sizes and sha256; newer damaged ones are
  skipped and reported);
- one training checkpoint ``.../step_<N>`` (validated the same way; a damaged one is refused);
- a folder written by ``tools/convert_hf_to_mcore.py`` (``OUT/model`` + ``config.json``);
- a bare distributed checkpoint (``metadata.json``) with ``config.json`` beside it.

A training checkpoint carries the run's ``config.yaml``; ``config.json`` comes from its ``model.hf_dir``
and the tokenizer from its ``template.tokenizer_dir`` (default ``model.hf_dir``), unless ``config_dir``
names the folder to take both from. Nothing here imports megatron or needs a process group.
"""

from __future__ import annotations

import json
import os
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
    checkpoint there is usable."""
    if _is_step_dir(path):
        problems = [] if verify == "none" else validate(path, verify=verify)
        if problems:
            raise ExportSourceError(f"checkpoint {path} is not valid: {'; '.join(problems)}")
        return _read(path, ())
    root = _checkpoint_root(path)
    if root is None:
        return None
    if verify == "none":
        steps = sorted(complete_checkpoints(root), reverse=True)
        if not steps:
            raise ExportSourceError(f"{root} holds no checkpoint (step_<N>)")
        return _read(steps[0][1], ())
    found, rejected = find_latest_valid(root, verify=verify)
    skipped = tuple((bad, tuple(problems)) for bad, problems in rejected)
    if found is None:
        if rejected:
            reasons = "; ".join(f"{os.path.basename(b)}: {', '.join(p)}" for b, p in skipped)
            raise ExportSourceError(f"no valid checkpoint in {root}: every one was rejected ({reasons})")
        raise ExportSourceError(f"{root} holds no checkpoint (step_<N>) yet")
    return _read(found, skipped)


def _is_step_dir(path: str) -> bool:
    return bool(STEP_DIR.match(os.path.basename(path.rstrip(os.sep)))) and (
        os.path.isfile(os.path.join(path, STATE)) or os.path.isfile(os.path.join(path, MANIFEST))
    )


def _checkpoint_root(path: str) -> str | None:
    """The checkpoint directory ``path`` is, or that the run folder ``path`` names; ``None`` otherwise."""
    if os.path.isfile(os.path.join(path, LATEST)) or complete_checkpoints(path):
        return path
    run_config = os.path.join(path, RUN_CONFIG)
    if os.path.isfile(run_config):
        configured = (_load_yaml(run_config).get("checkpoint") or {}).get("dir")
        if configured:
            root = configured if os.path.isabs(configured) else _existing(configured, path)
            if root is not None:
                return root
    default = os.path.join(path, DEFAULT_CHECKPOINT_SUBDIR)
    if os.path.isdir(default):
        return default
    if os.path.isfile(run_config):
        raise ExportSourceError(f"the run folder {path} holds no checkpoint directory ({default} does not exist)")
    return None


def _existing(relative: str, run_dir: str) -> str | None:
    """A relative path from a run's config.yaml: relative to the working directory the run was started in
    (unknown), so tried against this one and against the run folder's parent."""
    for base in (os.getcwd(), os.path.dirname(run_dir)):
        candidate = os.path.join(base, relative)
        if os.path.isdir(candidate):
            return os.path.abspath(candidate)
    return None


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
    )


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
