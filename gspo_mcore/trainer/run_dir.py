"""One run per folder: what a run may find in ``log.output_dir`` (and its checkpoint directory) at start-up.

A run's traces are ``config.yaml``, ``metrics.jsonl`` (and ``metrics.jsonl.previous``), ``metrics.png``,
``episodes.jsonl``, ``tensorboard/``, ``eval_samples/`` and the checkpoints (``step_<N>`` in ``checkpoint.dir``).
Other files (a prepared model or dataset, like ``make demo``'s) are not a run's and are never touched.

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

import json
import os
import shutil
from dataclasses import dataclass

from gspo_mcore.learner.checkpoint.errors import CheckpointError
from gspo_mcore.learner.checkpoint.files import (
    CONFIG,
    MANIFEST,
    complete_checkpoints,
    config_hash,
    is_checkpoint_dir,
    validate,
)

RUN_FILES = (
    "config.yaml",
    "metrics.jsonl",
    "metrics.jsonl.previous",
    "metrics.png",
    "tensorboard",
    "eval_samples",
    "episodes.jsonl",
)
"""What a run writes into ``log.output_dir`` besides its checkpoints."""

RESUME_MAY_DIFFER = (
    "steps",
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
    """The paths of a run's traces in ``output_dir`` and ``checkpoint_dir`` (empty: a clean folder)."""
    found = [os.path.join(output_dir, f) for f in RUN_FILES if os.path.exists(os.path.join(output_dir, f))]
    if complete_checkpoints(checkpoint_dir):
        found.append(checkpoint_dir)
    return found


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
    traces = run_traces(output_dir, checkpoint_dir)
    if resume is False:
        if traces and not overwrite:
            shown = ", ".join(os.path.relpath(t, output_dir) for t in traces)
            raise RunDirError(
                f"{output_dir} already holds a run ({shown}); set checkpoint.resume=true to continue it, "
                "log.overwrite=true to replace it, or choose another log.output_dir"
            )
        return RunDirPlan(output_dir=output_dir, clear=tuple(traces))
    saved = _saved_config(output_dir, checkpoint_dir, resume)
    if saved is not None:
        _check_same_run(run_config, *saved)
    return RunDirPlan(output_dir=output_dir, compared_with=saved[0] if saved else None)


def prepare(plan: RunDirPlan, run_config: dict) -> None:
    """Rank 0, once every input is checked: delete the previous run's traces (``log.overwrite``), then write
    ``config.yaml``: the first write of this run into its folder."""
    for path in plan.clear:
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
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


def _may_differ(key: str) -> bool:
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
