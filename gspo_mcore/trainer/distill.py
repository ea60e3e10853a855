"""On-policy distillation in the training loop (docs/distill.md): the ``distill:`` section, its start-up
checks, and the step's part: the teacher scores the rollout batch and the samples get per-token advantages.

Start-up (:func:`plan`, before any process group or model): the teacher's ``config.json`` must be a
supported architecture, its tokenizer must be the student's (same vocabulary, same special tokens: refused
naming the first difference), its vocabulary must hold every token id, and (in-process) the learner's layout
must split it. After the student is built, :meth:`DistillPlan.build` builds the teacher in-process (forward
only), or launches / connects the SGLang servers that score (:mod:`gspo_mcore.trainer.sglang_teacher`). Each
step, :meth:`Distiller.apply` computes the teacher's log-probs of the batch and sets every sample's
``token_advantages`` (:func:`gspo_mcore.algo.distill.distill_advantages`; the student's log-probs are the
behaviour log-probs the engine sampled with), which ``loss.variant: gspo_token`` trains on.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from gspo_mcore.algo import LOSS_VARIANTS
from gspo_mcore.algo.distill import distill_advantages, distill_kl
from gspo_mcore.config import check_literals
from gspo_mcore.learner.step import BatchConfig
from gspo_mcore.rollout.sglang_server import SGLangServers

logger = logging.getLogger(__name__)

TOKEN_ADVANTAGE_VARIANTS = tuple(name for name, row in LOSS_VARIANTS.items() if row.token_advantages)
"""The loss variants that take per-token advantages (the loss table says which)."""
"""The ``loss.variant`` values that train on per-token advantages (the others refuse them)."""


@dataclass(frozen=True, kw_only=True)
class DistillConfig:
    """On-policy distillation: a frozen teacher scores the student's own samples token by token."""

    teacher_dir: str
    """The teacher: a Hugging Face directory (``config.json``, safetensors weights, tokenizer files) of any
    supported architecture and size, with the student's tokenizer (checked at start-up)."""
    engine: Literal["inprocess", "sglang"] = "inprocess"
    """Where the teacher runs: ``inprocess`` (a second, forward-only Megatron model on the learner's ranks,
    sharded under the same layout) or ``sglang`` (SGLang servers scoring the student's token ids, see
    ``sglang``; ``teacher_temperature`` must then be 1)."""
    sglang: SGLangServers = field(default_factory=SGLangServers)
    """``engine: sglang``: the teacher's servers (connected by URL, or launched on ``teacher_dir``)."""
    kl_coef: float = 1.0
    """Weight of the teacher term ``log p_teacher(y_t) - log p_student(y_t)`` in every token's advantage (> 0)."""
    reward_weight: float = 0.0
    """Weight of the task reward's advantage added to it (0: pure distillation; the reward is still computed
    and reported)."""
    teacher_temperature: float = 1.0
    """The teacher's log-probs are ``log softmax(logits / teacher_temperature)``."""

    def __post_init__(self):
        check_literals(self)
        if not self.teacher_dir:
            raise ValueError("distill.teacher_dir must be set (the teacher's Hugging Face directory)")
        for key, lo, strict in (
            ("kl_coef", 0.0, True),
            ("reward_weight", 0.0, False),
            ("teacher_temperature", 0.0, True),
        ):
            v = getattr(self, key)
            ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
            if not ok or (v <= lo if strict else v < lo):
                raise ValueError(f"distill.{key} must be a finite number {'>' if strict else '>='} {lo}, got {v!r}")
        if self.engine == "sglang" and self.teacher_temperature != 1:
            raise ValueError(
                f"distill.teacher_temperature={self.teacher_temperature} with distill.engine=sglang: SGLang "
                "0.5.23 scores input tokens with the raw logits' log-softmax (no temperature), so only 1 is possible"
            )
        if self.engine == "inprocess" and self.sglang.urls:
            raise ValueError("distill.sglang.urls is set but distill.engine=inprocess: set distill.engine=sglang")


def check_distill(cfg) -> None:
    """The cross-section rules of a :class:`~gspo_mcore.trainer.config.TrainConfig` with ``distill``."""
    d = cfg.distill
    if d is None:
        return
    if cfg.loss.variant not in TOKEN_ADVANTAGE_VARIANTS:
        raise ValueError(
            f"distill needs a loss.variant that takes per-token advantages ({', '.join(TOKEN_ADVANTAGE_VARIANTS)}); "
            f"loss.variant is {cfg.loss.variant!r}"
        )
    r = cfg.rollout
    if d.reward_weight == 0 and (r.drop_zero_advantage_groups or r.dynamic_sampling):
        key = "dynamic_sampling" if r.dynamic_sampling else "drop_zero_advantage_groups"
        raise ValueError(
            f"distill.reward_weight=0 with rollout.{key}=true: groups would be chosen by the task reward, which "
            "pure distillation does not train on (every sample has the teacher's signal); set it false"
        )


def check_same_tokenizer(student, teacher, *, student_dir: str, teacher_dir: str) -> None:
    """Raise ``ValueError`` naming the first difference between two tokenizers' vocabularies (token -> id)
    and special tokens: the teacher scores the student's token ids, so they must mean the same tokens."""
    where = f"distill.teacher_dir={teacher_dir}: the teacher's tokenizer differs from the student's ({student_dir})"
    sv, tv = student.get_vocab(), teacher.get_vocab()
    for token, i in sorted(sv.items(), key=lambda kv: kv[1]):
        if token not in tv:
            raise ValueError(f"{where}: the student's token {token!r} (id {i}) is not in the teacher's vocabulary")
        if tv[token] != i:
            raise ValueError(f"{where}: token {token!r} has id {i} for the student and {tv[token]} for the teacher")
    extra = sorted((i, t) for t, i in tv.items() if t not in sv)
    if extra:
        i, t = extra[0]
        raise ValueError(
            f"{where}: the teacher's vocabulary has {len(tv)} tokens, the student's {len(sv)}; e.g. {t!r} (id {i}) "
            "is only the teacher's"
        )
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id"):
        a, b = getattr(student, attr, None), getattr(teacher, attr, None)
        if a != b:
            raise ValueError(f"{where}: {attr} is {a} for the student and {b} for the teacher")
    sa, ta = sorted(student.all_special_tokens), sorted(teacher.all_special_tokens)
    if sa != ta:
        raise ValueError(f"{where}: special tokens {sa} for the student, {ta} for the teacher")


@dataclass(frozen=True)
class DistillPlan:
    """What start-up checked (:func:`plan`); :meth:`build` makes the teacher."""

    cfg: DistillConfig
    arch: object
    """The teacher's :class:`~gspo_mcore.learner.ModelArch`."""

    output_dir: str = "."
    """The run's folder (launched teacher servers log under it)."""

    batch: BatchConfig = BatchConfig()
    """The run's batching: the in-process teacher's micro-batches are the learner's."""

    def build(self, parallel, layout, options=None) -> Distiller:
        """Build the teacher on this rank (after the student; every rank calls this)."""
        from gspo_mcore.learner.teacher import Teacher
        from gspo_mcore.trainer import sglang_teacher

        if self.cfg.engine == "sglang":
            log_dir = sglang_teacher.log_dir(self.output_dir)
            teacher = sglang_teacher.SGLangTeacher(
                self.cfg.sglang, teacher_dir=self.cfg.teacher_dir, layout=layout, log_dir=log_dir
            )
            if layout.rank == 0:
                where = ", ".join(self.cfg.sglang.urls) or f"{self.cfg.sglang.num_servers} launched server(s)"
                logger.info("distillation teacher %s served by SGLang (%s)", self.cfg.teacher_dir, where)
            return Distiller(self.cfg, teacher)
        teacher = Teacher(
            self.cfg.teacher_dir,
            self.arch,
            parallel,
            layout,
            options,
            max_tokens=self.batch.max_tokens_per_microbatch,
            packing=self.batch.packing,
            temperature=self.cfg.teacher_temperature,
        )
        if layout.rank == 0:
            logger.info(
                "distillation teacher %s (%s, %d layers): %.1f MiB of parameters per rank",
                self.cfg.teacher_dir,
                self.arch.model_type,
                self.arch.num_hidden_layers,
                teacher.nbytes / 2**20,
            )
        return Distiller(self.cfg, teacher)


def plan(cfg, student_arch, tokenizer) -> DistillPlan | None:
    """Start-up checks of ``cfg.distill`` (``None`` without it), before any process group or model: the
    teacher's architecture, its fit to the layout, its tokenizer and vocabulary size, its context length."""
    from gspo_mcore.data.template import load_tokenizer
    from gspo_mcore.learner.teacher import check_teacher_fits

    d = cfg.distill
    if d is None:
        return None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if d.engine == "sglang":  # served apart from the learner: its layout does not apply
        arch = served_teacher_arch(d.teacher_dir)
    else:
        arch = check_teacher_fits(d.teacher_dir, cfg.parallel, world, where="distill.teacher_dir")
    try:
        teacher_tok = load_tokenizer(d.teacher_dir)
    except (OSError, ValueError) as exc:
        raise ValueError(f"distill.teacher_dir={d.teacher_dir}: cannot load its tokenizer: {exc}") from None
    check_same_tokenizer(
        tokenizer, teacher_tok, student_dir=cfg.template.tokenizer_dir or cfg.model.hf_dir, teacher_dir=d.teacher_dir
    )
    if len(tokenizer) > arch.vocab_size:
        raise ValueError(
            f"distill.teacher_dir={d.teacher_dir}: config.json's vocab_size {arch.vocab_size} is smaller than the "
            f"tokenizer ({len(tokenizer)} tokens)"
        )
    if arch.max_position_embeddings < student_arch.max_position_embeddings:
        raise ValueError(
            f"distill.teacher_dir={d.teacher_dir}: the teacher's max_position_embeddings "
            f"{arch.max_position_embeddings} is below the student's {student_arch.max_position_embeddings}, so it "
            "could not score the student's longest sequences"
        )
    return DistillPlan(d, arch, output_dir=cfg.log.output_dir, batch=cfg.batch)


def served_teacher_arch(teacher_dir: str):
    """The shape of a teacher SGLang serves (``teacher_dir/config.json``), errors naming ``distill.teacher_dir``."""
    from gspo_mcore.learner.model_config import load_hf_config

    try:
        return load_hf_config(os.path.join(teacher_dir, "config.json"))
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"distill.teacher_dir={teacher_dir}: {exc}") from exc


class Distiller:
    """The step's distillation: teacher log-probs of the rollout batch -> per-token advantages."""

    def __init__(self, cfg: DistillConfig, teacher):
        self.cfg = cfg
        self.teacher = teacher
        """A :class:`~gspo_mcore.learner.teacher.Teacher` or a
        :class:`~gspo_mcore.trainer.sglang_teacher.SGLangTeacher` (both: ``logprobs(samples)``)."""

    def apply(self, samples) -> tuple[list, dict]:
        """``samples`` (the learner's, with the engine's log-probs as ``old_logprobs``) with
        ``token_advantages`` set, and the metrics ``distill_kl`` (per-token ``KL(student || teacher)`` over
        the policy tokens, ``loss_mask == 1``) and ``time_teacher_s``."""
        t0 = time.perf_counter()
        if not samples:
            return samples, {}
        missing = next((i for i, s in enumerate(samples) if s.old_logprobs is None), None)
        if missing is not None:
            raise ValueError(f"distillation needs the engine's log-probs of every sample; sample {missing} has none")
        teacher = self.teacher.logprobs(samples)
        out, kl_sum, count = [], 0.0, 0
        for s, t in zip(samples, teacher):
            mask = s.loss_mask[1:]
            reward = s.token_advantages if s.token_advantages is not None else torch.full_like(t, s.advantage)
            adv = distill_advantages(
                t,
                s.old_logprobs,
                mask,
                kl_coef=self.cfg.kl_coef,
                reward_advantages=reward,
                reward_weight=self.cfg.reward_weight,
            )
            k, n = distill_kl(t, s.old_logprobs, mask)
            kl_sum, count = kl_sum + k, count + n
            out.append(replace(s, token_advantages=adv))
        return out, {"distill_kl": kl_sum / max(count, 1), "time_teacher_s": time.perf_counter() - t0}

    def close(self) -> None:
        """Release the teacher (launched SGLang servers are stopped)."""
        close = getattr(self.teacher, "close", None)
        if close is not None:
            close()


def step_metrics(metrics: dict, record: dict) -> dict:
    """The step's distillation metrics, with ``teacher_time_fraction`` (the teacher's share of
    ``time_step_s``)."""
    if not metrics:
        return {}
    step_s = record.get("time_step_s", 0.0)
    return dict(metrics, teacher_time_fraction=metrics["time_teacher_s"] / step_s if step_s > 0 else 0.0)
