"""The learner as one object: this rank's built training state and the few verbs a trainer needs.

:meth:`Learner.build` sets up the process groups, builds the model chunks (Megatron DDP), loads Hugging Face
weights if asked, builds the optimizer and LR schedule, and snapshots the KL reference when the loss needs one.
Then a trainer only calls verbs::

    learner = Learner.build(arch, parallel=cfg.parallel, optim=cfg.optim, loss=cfg.loss, batch=cfg.batch)
    old = learner.logprobs(samples)      # forward only: [L-1] float32 per sample, on every rank
    metrics = learner.train(samples)     # one step: old log-probs where needed, one update per mini-batch
    for bucket in learner.export_weights(dtype=torch.bfloat16):  # Hugging Face names and full tensors
        ...
    learner.save(checkpointer, step, extra={...}); resumed = learner.load(checkpointer)
    engine_model = learner.decode_model()  # the in-process rollout engine's view of the live model
    learner.close()                        # the process groups torn down, at the end of the run

Every rank calls every verb with the same arguments (the verbs run collectives).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import torch

from gspo_mcore.algo.loss_config import LossConfig
from gspo_mcore.learner import lm_head, shared_prefix
from gspo_mcore.learner.forward import forward_logprobs
from gspo_mcore.learner.kl_reference import ReferencePolicy
from gspo_mcore.learner.lora import LoraConfig
from gspo_mcore.learner.lora import check_layout as check_lora_layout
from gspo_mcore.learner.model import ModelOptions, build_model, have_transformer_engine
from gspo_mcore.learner.model_config import ModelArch
from gspo_mcore.learner.optimizer import OptimConfig, build_optimizer
from gspo_mcore.learner.parallel import Layout, ParallelConfig, destroy_parallel, init_parallel
from gspo_mcore.learner.routing import RoutingConfig
from gspo_mcore.learner.step import BatchConfig, StepSettings, train_step


class Learner:
    """This rank's model chunks, optimizer, LR schedule, parallel layout and architecture, with the settings every
    step is trained with (:class:`~gspo_mcore.learner.step.StepSettings`). Build it with :meth:`build`."""

    def __init__(
        self,
        *,
        model: list,
        optimizer,
        scheduler,
        layout: Layout,
        arch: ModelArch,
        settings: StepSettings = StepSettings(),
        reference: ReferencePolicy | None = None,
    ):
        self.model = model
        """Megatron's list of model chunks (one per virtual pipeline stage), each wrapped in DDP."""
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.layout = layout
        self.arch = arch
        """The model's architecture (from the Hugging Face ``config.json``)."""
        self.settings = settings
        """The loss, batching, routing, temperature and old-log-prob source of every step."""
        self.reference = reference
        """The frozen initial policy of the KL term (``None`` when the loss needs none)."""

    @classmethod
    def build(
        cls,
        arch: ModelArch,
        *,
        parallel: ParallelConfig = ParallelConfig(),
        options: ModelOptions = ModelOptions(),
        optim: OptimConfig = OptimConfig(),
        loss: LossConfig = LossConfig(),
        batch: BatchConfig = BatchConfig(),
        routing: RoutingConfig = RoutingConfig(),
        seed: int = 1234,
        init_seed: int = 1234,
        hf_weights: str | None = None,
        temperature: float = 1.0,
        recompute_old_logprobs: bool = False,
        progress: bool = False,
        lora: LoraConfig = LoraConfig(),
    ) -> Learner:
        """Set up the process groups (validating the layout first), build the model, and either initialise it
        from ``init_seed`` (layout independent) or load ``hf_weights`` (a Hugging Face directory's safetensors,
        any layout); then the optimizer and schedule, and the KL reference when ``loss`` needs one (the initial
        policy: built before any checkpoint is restored). ``seed``: the run's seed for Megatron's RNG set-up.
        ``loss``, ``batch``, ``routing``, ``temperature`` and ``recompute_old_logprobs`` make the
        :class:`~gspo_mcore.learner.step.StepSettings`. A fused LM head the model cannot serve is refused here,
        naming ``loss.fused_lm_head``; ``batch.share_prompt`` is resolved (see
        :func:`~gspo_mcore.learner.shared_prefix.resolve`). ``lora``: LoRA adapters (off by default; see
        :mod:`gspo_mcore.learner.lora`): the base weights frozen, the optimizer holding the adapters only; a layout
        LoRA cannot run with is refused first, naming the keys."""
        if lora.enabled:
            use_te = have_transformer_engine() if options.use_te is None else bool(options.use_te)
            check_lora_layout(lora, arch=arch, parallel=parallel, use_te=use_te)
        layout = init_parallel(parallel, arch, seed=seed)
        model = build_model(
            arch,
            parallel,
            options,
            seed=None if hf_weights else init_seed,
            use_distributed_optimizer=optim.use_distributed_optimizer,
            lora=lora,
        )
        # batch.share_prompt: None (on where supported) resolved, true refused where not supported
        share = shared_prefix.resolve(batch.share_prompt, model=model, layout=layout, arch=arch)
        settings = StepSettings(
            loss=loss,
            batch=replace(batch, share_prompt=share),
            routing=routing,
            temperature=temperature,
            recompute_old_logprobs=recompute_old_logprobs,
        )
        if hf_weights:
            from gspo_mcore.learner.hf.load import load_hf_weights

            load_hf_weights(model, hf_weights, arch, progress=progress, layout=layout)
        lm_head.fused_head(model, loss)  # refuses, naming the key, a model it cannot serve
        optimizer, scheduler = build_optimizer(model, optim)
        reference = ReferencePolicy(model, layout, **settings.forward_options()) if loss.uses_reference else None
        return cls(
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            layout=layout,
            arch=arch,
            settings=settings,
            reference=reference,
        )

    @property
    def is_writer(self) -> bool:
        """Whether this is global rank 0 (the one that writes files and logs)."""
        return self.layout.rank == 0

    def logprobs(self, samples) -> list[torch.Tensor]:
        """Forward only: the current policy's log-probs of ``tokens[1:]`` for every sample (``[L-1]`` float32 on
        the CPU, on every rank), through the training's schedule and micro-batching."""
        return forward_logprobs(self.model, samples, self.layout, **self.settings.forward_options())

    def train(self, samples, *, measure_routing: bool = False) -> list[dict[str, float]]:
        """One training step on the rollout batch ``samples`` (the same list on every rank): old log-probs where
        needed, then one optimizer update per mini-batch. Returns one metrics dict per mini-batch (see
        :func:`gspo_mcore.learner.step.train_step`)."""
        return train_step(
            self.model,
            self.optimizer,
            self.scheduler,
            samples,
            self.layout,
            self.settings,
            reference=self.reference,
            measure_routing=measure_routing,
        )

    def decode_model(self):
        """A decode model over this rank's live ``GPTModel`` (KV cache), for the in-process rollout engine (see
        :func:`gspo_mcore.learner.inference.decode_model`): it reads the current parameters, so it needs no
        weight sync."""
        from gspo_mcore.learner.inference import decode_model

        return decode_model(self.model, self.layout)

    def export_plan(self, *, dtype: torch.dtype | None = None) -> list:
        """What :meth:`export_weights` yields, in order: one item per Hugging Face tensor (name, shape, bytes)."""
        from gspo_mcore.learner.hf.export import export_plan

        return export_plan(self.model, self.arch, dtype=dtype, layout=self.layout)

    def export_weights(
        self, *, dtype: torch.dtype | None = None, bucket_bytes: int | None = None, plan=None
    ) -> Iterator:
        """The weights as Hugging Face tensors, in buckets of at most ``bucket_bytes`` (lists of ``(name,
        tensor)``), gathered over TP, PP and EP. Every rank must iterate to the end (the gathers are
        collectives); only rank 0's buckets hold the tensors to keep."""
        from gspo_mcore.learner.hf.export import DEFAULT_BUCKET_BYTES, hf_buckets

        return hf_buckets(
            self.model,
            self.arch,
            bucket_bytes=bucket_bytes or DEFAULT_BUCKET_BYTES,
            dtype=dtype,
            plan=plan,
            layout=self.layout,
        )

    def save(self, checkpointer, step: int, *, extra: dict | None = None) -> str:
        """Save model, optimizer, LR schedule and RNG states as checkpoint ``step`` (``checkpointer``: a
        :class:`~gspo_mcore.learner.checkpoint.Checkpointer`); ``extra``: the trainer's own state. Returns the
        checkpoint's path. With LoRA the model part is the adapters only: :meth:`load` puts them over the base
        that :meth:`build` made (``hf_weights`` or ``init_seed``), so build it as the run did."""
        return checkpointer.save(step, self.model, self.optimizer, self.scheduler, extra=extra)

    def load(self, checkpointer):
        """Restore the newest valid checkpoint, if any: a :class:`~gspo_mcore.learner.checkpoint.Resumed` (its
        step and the trainer's ``extra``), or ``None`` when there is nothing to resume."""
        return checkpointer.resume(self.model, self.optimizer, self.scheduler)

    def close(self) -> None:
        """Tear down the process groups (Megatron's and the default one), after a barrier: every rank calls it
        once, last, when the run is over."""
        destroy_parallel()
