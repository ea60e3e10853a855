"""Start-up checks: every input a run reads, checked before any model is built or anything is written.

:func:`check` runs once at the top of :func:`gspo_mcore.trainer.run`, on every rank, reading only (besides a
probe file, created and removed, and rank 0's lock on the run folder, released when the run ends). In order:
the model folder (``config.json``; with ``model.load_hf_weights`` its ``*.safetensors`` and their tensor
names and shapes), the parallel layout against the world size, the tokenizer, the environment
(``rollout.env``: imported, its methods and keyword arguments checked, built once, the tool format against
the chat template), the training data, the evaluation sets (each file must exist; errors name
``eval.datasets[i]``), prompt lengths, the rewards (every row's fields), the distillation teacher
(``distill``: its folder, ``config.json``, fit to the layout, tokenizer and, for the in-process teacher, its
weights' names and shapes; errors name ``distill.teacher_dir``), the run folder (:mod:`.run_dir`: no
mixing of two runs; writable, found by creating a probe file; locked by rank 0 so that a second run started
in the same folder is refused) and, for a resume, the checkpoint it would load (one whose files have the sizes its
manifest records; the checksums are verified when it loads).

A failure keeps its exception type and gets an ``input_kind`` attribute (``model``, ``config``,
``tokenizer``, ``data``, ``eval``, ``reward``, ``distill``, ``run folder``, ``checkpoint``): ``gspo-train`` prints it
as one line, ``gspo-train: <kind> error: <message>`` (:func:`input_kind_of`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

from gspo_mcore.config import ConfigError, to_dict
from gspo_mcore.data.dataset import PromptDataset
from gspo_mcore.data.template import PromptTemplate, load_tokenizer
from gspo_mcore.envs import ChatRenderer, load_env
from gspo_mcore.learner.checkpoint import CheckpointError
from gspo_mcore.learner.model_config import load_hf_config
from gspo_mcore.rewards import check_reward_setup
from gspo_mcore.rewards.resolve import RewardSetupError
from gspo_mcore.trainer import distill, run_dir
from gspo_mcore.trainer.config import TrainConfig
from gspo_mcore.trainer.evaluation import EvalSet

logger = logging.getLogger(__name__)

INPUT_KINDS = {ConfigError: "config", CheckpointError: "checkpoint", RewardSetupError: "reward"}
"""Exception types that are input errors wherever they are raised, and their kind. (A reward that fails while
the run trains, ``RewardFailure``, is not one: it keeps its traceback.)"""


class InputError(ValueError):
    """An input problem found by these checks; the message names the input (key, file, row)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.input_kind = kind


@dataclass(frozen=True)
class Inputs:
    """What the checks read, for the run to use (nothing is read twice)."""

    arch: object
    """The model's architecture (:class:`~gspo_mcore.learner.ModelArch`)."""
    tokenizer: object
    template: PromptTemplate
    dataset: PromptDataset
    eval_sets: list[EvalSet]
    rewards: object
    """The training reward runner."""
    run_dir: run_dir.RunDirPlan
    env: object = None
    """The environment ``rollout.env`` names, built with ``rollout.env_kwargs`` (``None``: single-turn)."""
    distill: distill.DistillPlan | None = None
    """The checked distillation teacher (``None`` without ``distill``)."""
    data_files: dict | None = None
    """Every data file's size and sha256 (:func:`gspo_mcore.trainer.run_dir.data_fingerprint`), saved with each
    checkpoint and checked at resume."""
    lock: run_dir.RunLock | None = None
    """Rank 0's lock on ``log.output_dir``, taken before the run folder is checked; the run releases it at its
    end (:func:`gspo_mcore.trainer.run_dir.lock_folder`)."""


def input_kind_of(exc: BaseException) -> str | None:
    """The kind of input error ``exc`` is (``None``: not an input error, e.g. a bug)."""
    kind = getattr(exc, "input_kind", None)
    if kind is not None:
        return kind
    return next((k for t, k in INPUT_KINDS.items() if isinstance(exc, t)), None)


@contextlib.contextmanager
def input_kind(kind: str):
    """Mark an error raised inside as an input error of ``kind`` (its type and message unchanged)."""
    try:
        yield
    except (ValueError, OSError, LookupError, RuntimeError) as exc:
        if input_kind_of(exc) is None:
            exc.input_kind = kind
        raise


def check(cfg: TrainConfig) -> Inputs:
    """Check every input of the resolved configuration ``cfg`` (see the module docstring); reads only, besides
    the probe file and rank 0's lock (:attr:`Inputs.lock`, which the caller releases)."""
    with input_kind("model"):
        arch = load_hf_config(os.path.join(cfg.model.hf_dir, "config.json"))
        if cfg.routing.replay == "rollout" and not arch.is_moe:
            raise ValueError(
                f"routing.replay=rollout needs a MoE model, and {cfg.model.hf_dir}/config.json describes a dense "
                f"{arch.model_type!r} model (no router to replay)"
            )
        if cfg.model.load_hf_weights:
            check_weights(cfg.model.hf_dir, arch)
    with input_kind("config"):
        _check_layout(cfg, arch)
    with input_kind("tokenizer"):
        tokenizer = load_tokenizer(cfg.template.tokenizer_dir)
        template = PromptTemplate(cfg.template, tokenizer)
    with input_kind("config"):
        env = check_env(cfg.rollout, tokenizer)
    with input_kind("data"):
        missing = [p for p in cfg.data.paths if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(f"data.paths: {missing[0]} does not exist")
        dataset = PromptDataset(cfg.data)
    eval_sets = [eval_set(i, s, template) for i, s in enumerate(cfg.eval.datasets)]
    with input_kind("data"):
        check_lengths(cfg, arch, dataset, template, eval_sets)
    with input_kind("reward"):
        rewards = check_reward_setup(cfg.reward, dataset)  # names, sandbox, every row's fields
    with input_kind("distill"):
        distill_plan = check_distill(cfg, arch, tokenizer)
    with input_kind("run folder"):
        run_dir.check_writable(cfg.log.output_dir, cfg.checkpoint.dir)
        lock = run_dir.lock_folder(cfg.log.output_dir) if int(os.environ.get("RANK", "0")) == 0 else None
        try:
            plan = run_dir.check(
                to_dict(cfg),
                output_dir=cfg.log.output_dir,
                checkpoint_dir=cfg.checkpoint.dir,
                resume=cfg.checkpoint.resume,
                overwrite=cfg.log.overwrite,
            )
            with input_kind("data"):
                data_files = run_dir.data_fingerprint(cfg)
                _check_resumed_data(cfg, data_files)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
    return Inputs(
        arch=arch,
        tokenizer=tokenizer,
        template=template,
        dataset=dataset,
        eval_sets=eval_sets,
        rewards=rewards,
        run_dir=plan,
        env=env,
        distill=distill_plan,
        lock=lock,
        data_files=data_files,
    )


def _check_resumed_data(cfg: TrainConfig, data_files: dict) -> None:
    """A resume of this run's own checkpoint reads the data files it recorded (``allow_data_change``)."""
    if cfg.checkpoint.resume is False:
        return
    candidate = run_dir.resume_candidate(os.path.abspath(cfg.checkpoint.dir), cfg.checkpoint.resume)
    if candidate is None or os.path.dirname(candidate) != os.path.abspath(cfg.checkpoint.dir):
        return  # nothing to resume, or another folder's checkpoint: a new run from its weights
    for line in run_dir.check_data_unchanged(candidate, data_files, allow=cfg.allow_data_change):
        logger.warning("allow_data_change=true: %s", line)


def check_distill(cfg: TrainConfig, arch, tokenizer) -> distill.DistillPlan | None:
    """``distill``: the teacher's folder and shape, its fit to the layout and its tokenizer
    (:func:`gspo_mcore.trainer.distill.plan`), and the weights the in-process teacher loads (file headers only;
    SGLang loads its own). Errors name ``distill.teacher_dir``."""
    d = cfg.distill
    if d is None:
        return None
    if not os.path.isdir(d.teacher_dir):
        raise InputError("distill", f"distill.teacher_dir={d.teacher_dir}: no such folder (no config.json)")
    plan = distill.plan(cfg, arch, tokenizer)
    if d.engine == "inprocess":
        check_weights(d.teacher_dir, plan.arch, key="distill.teacher_dir", kind="distill")
    return plan


def check_env(rollout_cfg, tokenizer):
    """``rollout.env``: the class imported, its ``reset``/``step`` and keyword arguments checked, and built
    (errors name ``rollout.env``); ``rollout.episode.tool_format`` against the tokenizer's chat template.
    Returns the environment, or ``None`` without ``rollout.env``."""
    if not rollout_cfg.env:
        return None
    env = load_env(rollout_cfg.env, rollout_cfg.env_kwargs)
    try:
        ChatRenderer(tokenizer, tool_format=rollout_cfg.episode.tool_format)
    except ValueError as exc:
        raise InputError("config", f"rollout.episode.tool_format={rollout_cfg.episode.tool_format}: {exc}") from None
    return env


def check_weights(hf_dir: str, arch, *, key: str = "model.hf_dir", kind: str = "model") -> None:
    """``model.load_hf_weights`` (or a teacher's folder, ``key``): the folder's safetensors hold every tensor the
    architecture needs, with its shape (file headers only)."""
    from gspo_mcore.learner.hf.folder import HFCheckpoint
    from gspo_mcore.learner.hf.load import check_checkpoint

    try:
        reader = HFCheckpoint(hf_dir)
    except FileNotFoundError as exc:
        needs = " with model.load_hf_weights=true" if key == "model.hf_dir" else ""
        raise InputError(kind, f"{key}={hf_dir}{needs}: {exc}") from None
    try:
        check_checkpoint(reader, arch)
    except (KeyError, ValueError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        raise InputError(kind, f"{key}={hf_dir}: {message}") from None


def _check_layout(cfg: TrainConfig, arch) -> None:
    """The parallel layout against the launch's world size (torchrun's ``WORLD_SIZE``; 1 without it)."""
    import torch

    from gspo_mcore.learner.parallel import validate_layout

    world = int(os.environ.get("WORLD_SIZE", "1"))
    validate_layout(cfg.parallel, world, arch, on_gpu=torch.cuda.is_available())


def eval_set(index: int, cfg, template: PromptTemplate) -> EvalSet:
    """Evaluation set ``eval.datasets[index]``, read and its reward checked; errors name it."""
    where = f"eval.datasets[{index}] ({cfg.name})"
    missing = [p for p in cfg.data.paths if not os.path.isfile(p)]
    if missing:
        raise InputError("eval", f"{where}: data.paths: {missing[0]} does not exist")
    with input_kind("eval"):
        try:
            dataset = PromptDataset(cfg.data)
        except (ValueError, OSError) as exc:
            raise InputError("eval", f"{where}: {exc}") from exc
        rows = list(dataset)[: cfg.max_prompts] if cfg.max_prompts else list(dataset)
        return EvalSet(
            name=cfg.name,
            prompts=[template.encode(r) for r in rows],
            metadata=[r.metadata for r in rows],
            rewards=check_reward_setup(cfg.reward, rows),
            rows=rows,
        )


def check_lengths(cfg: TrainConfig, arch, dataset, template, eval_sets) -> None:
    """Refuse prompts that cannot fit ``max_position_embeddings`` with their ``max_new_tokens``."""
    limit = arch.max_position_embeddings
    checks = [("data", cfg.rollout.sampling.max_new_tokens, ((r.source, template.encode(r)) for r in dataset))]
    checks += [
        (
            f"eval.datasets[{s.name}]",
            cfg.eval.sampling.max_new_tokens,
            ((f"prompt {i}", p) for i, p in enumerate(s.prompts)),
        )
        for s in eval_sets
    ]
    for what, new_tokens, rows in checks:
        for where, ids in rows:
            if len(ids) + new_tokens > limit:
                raise ValueError(
                    f"{what}: {where}: the prompt has {len(ids)} tokens; with max_new_tokens "
                    f"{new_tokens} that exceeds the model's max_position_embeddings {limit}"
                )
