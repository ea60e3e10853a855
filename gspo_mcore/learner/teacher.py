"""A frozen teacher model on the learner's ranks (on-policy distillation, docs/distill.md): forward only.

The teacher is any supported Hugging Face checkpoint (Qwen3, Qwen3-MoE, Llama, Qwen2; any size), built as a
second Megatron ``GPTModel`` under the learner's own parallel layout (the same TP/PP/EP/CP groups, so its
weights are sharded like the student's) and filled by :func:`~gspo_mcore.learner.hf.load.load_hf_weights`.
It has no optimizer and no gradients: every parameter has ``requires_grad=False``, so its Megatron DDP
wrapper (needed only for the schedule's ``no_sync``) allocates no gradient buffer. Its log-probs come from
:func:`~gspo_mcore.learner.forward.forward_logprobs`, through the same schedule and micro-batching as the learner's
old-policy log-probs.

:func:`check_teacher_fits` refuses, before anything is built, a teacher that the layout cannot split
(e.g. TP does not divide its heads), naming the reason.
"""

from __future__ import annotations

import torch

from gspo_mcore.learner.model import ModelOptions, build_model
from gspo_mcore.learner.model_config import ModelArch, load_hf_config
from gspo_mcore.learner.parallel import Layout, ParallelConfig, validate_layout
from gspo_mcore.ops.logprobs import check_temperature


def check_teacher_fits(
    hf_dir: str, parallel: ParallelConfig, world_size: int, *, where: str = "teacher", on_gpu: bool | None = None
) -> ModelArch:
    """The teacher's shape, from ``hf_dir/config.json``; raises ``ValueError`` starting with ``where`` when
    the checkpoint is not a supported architecture or the layout ``parallel`` on ``world_size`` ranks
    cannot split it."""
    from gspo_mcore.learner.hf.folder import read_config
    from gspo_mcore.learner.hf.mapping import check_architecture

    try:
        config = read_config(hf_dir)
        check_architecture(config)
        arch = load_hf_config(config)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{where}={hf_dir}: {exc}") from exc
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    try:
        validate_layout(parallel, world_size, arch, on_gpu=on_gpu)
    except ValueError as exc:
        raise ValueError(
            f"{where}={hf_dir}: the teacher ({arch.model_type}, {arch.num_hidden_layers} layers, "
            f"{arch.num_attention_heads} heads) does not fit the learner's layout, which it shares: {exc}"
        ) from None
    return arch


class Teacher:
    """The frozen teacher of this rank: its model chunk(s), sharded under the current layout."""

    def __init__(
        self,
        hf_dir: str,
        arch: ModelArch,
        parallel: ParallelConfig,
        layout: Layout,
        options=None,
        *,
        max_tokens: int,
        packing: str = "padded",
        temperature: float = 1.0,
    ):
        """Build the teacher for ``arch`` (see :func:`check_teacher_fits`) and load ``hf_dir``'s weights.
        Call after :func:`~gspo_mcore.learner.parallel.init_parallel`, on every rank. Its forwards cut the
        samples into micro-batches of ``max_tokens`` (``packing``: see
        :class:`~gspo_mcore.learner.step.BatchConfig`) and score under ``softmax(logits / temperature)``."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        from gspo_mcore.learner.hf.load import load_hf_weights

        self.hf_dir = hf_dir
        self.arch = arch
        self.layout = layout
        self.options = dict(max_tokens=max_tokens, packing=packing, temperature=check_temperature(temperature))
        chunks = build_model(arch, parallel, options or ModelOptions(), seed=None, wrap_ddp=False)
        load_hf_weights(chunks, hf_dir, arch, layout=layout)
        for chunk in chunks:
            chunk.requires_grad_(False)
        # Megatron's schedule sets the model's no_sync; with no parameter needing a gradient the wrapper
        # allocates no gradient buffer
        ddp = DistributedDataParallelConfig(overlap_grad_reduce=False, use_distributed_optimizer=False)
        self.model = [DistributedDataParallel(config=c.config, ddp_config=ddp, module=c) for c in chunks]

    @property
    def nbytes(self) -> int:
        """This rank's parameter bytes."""
        return sum(p.numel() * p.element_size() for chunk in self.model for p in chunk.parameters())

    @torch.no_grad()
    def logprobs(self, samples) -> list[torch.Tensor]:
        """The teacher's log-probs of ``tokens[1:]`` for every sample (``[L-1]`` float32 on the CPU, every
        rank), under ``softmax(logits / temperature)``; ``samples`` is the same list on every rank."""
        from gspo_mcore.learner.forward import forward_logprobs

        return forward_logprobs(self.model, samples, self.layout, **self.options)
