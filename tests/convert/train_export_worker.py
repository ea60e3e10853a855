"""Worker for the export-from-training tests: real training checkpoints in the layouts the trainer saves.

For each case, on every rank (2 gloo ranks): start from a tiny Hugging Face model (``load_hf_weights``, as
``model.load_hf_weights: true`` does), train one GSPO rollout batch (2 optimizer steps: ``train_step``, the
trainer's own update), save it with the trainer's :class:`~gspo_mcore.learner.checkpoint.Checkpointer`
(step 0, into ``<case>/checkpoints``, the default checkpoint directory of a run folder ``<case>``), and
record the learner's full-vocabulary logits for the reference tokens at that moment, at the training
layout. Rank 0 writes ``<case>/learner_logits.pt`` and one JSON line per case.

    python -m torch.distributed.run --nproc_per_node 2 train_export_worker.py --cases JSON --root DIR --out FILE
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from convert_worker import megatron_logits
from helpers import learner_toy as toy
from helpers.worker_cases import run_cases

MAX_TOKENS = 1000
OPTIM = dict(lr=1e-3, clip_grad=1.0, weight_decay=0.01, adam_eps=1e-6, lr_warmup_steps=0)


def learner_logits(model, layout, toks: torch.Tensor) -> torch.Tensor | None:
    """[B, L, V] on rank 0 (None elsewhere): through the in-process engine's forward where it applies
    (it pads for sequence parallelism), through Megatron's pipeline schedule for PP."""
    if layout.pp_size > 1:
        logits = megatron_logits(model, layout, toks)
        box = [logits]
        dist.broadcast_object_list(box, src=dist.get_world_size() - 1)  # the last stage holds them
        return box[0] if layout.rank == 0 else None
    from gspo_mcore.learner.inference import logits_fn

    logits = logits_fn(model, layout)(toks)
    return logits if layout.rank == 0 else None


def run_case(case, args):
    from gspo_mcore.algo.loss_config import LossConfig
    from gspo_mcore.learner.checkpoint import CheckpointConfig, Checkpointer
    from gspo_mcore.learner.hf.load import load_hf_weights
    from gspo_mcore.learner.model import build_model
    from gspo_mcore.learner.model_config import load_hf_config
    from gspo_mcore.learner.optimizer import OptimConfig, build_optimizer
    from gspo_mcore.learner.parallel import ParallelConfig, init_parallel
    from gspo_mcore.learner.step import BatchConfig, StepSettings, train_step

    hf_dir = case["hf"]
    arch = load_hf_config(hf_dir)
    pc = ParallelConfig(
        tensor=case.get("tp", 1), pipeline=case.get("pp", 1), expert=case.get("ep", 1), expert_tensor=case.get("etp")
    )
    layout = init_parallel(pc, arch, seed=1234)
    distopt = case.get("distopt", False)
    model = build_model(arch, pc, seed=None, use_distributed_optimizer=distopt)
    load_hf_weights(model, hf_dir, arch, layout=layout)
    optimizer, scheduler = build_optimizer(model, OptimConfig(**OPTIM, use_distributed_optimizer=distopt))
    ref = torch.load(os.path.join(hf_dir, "ref.pt"))
    samples = toy.toy_samples(vocab=arch.vocab_size, seed=3)
    metrics = train_step(
        model,
        optimizer,
        scheduler,
        samples,
        layout,
        StepSettings(
            loss=LossConfig(),
            batch=BatchConfig(num_minibatches=2, max_tokens_per_microbatch=MAX_TOKENS),
            recompute_old_logprobs=True,
        ),
    )
    run_dir = os.path.join(args.root, case["name"])
    cfg = CheckpointConfig(save_every=1, optimizer_format=case.get("format", "dp_reshardable"))
    run_config = {"model": {"hf_dir": hf_dir}, "parallel": {"tensor": pc.tensor, "pipeline": pc.pipeline}}
    ckpt = Checkpointer(cfg, os.path.join(run_dir, "checkpoints"), layout, run_config=run_config, total_steps=1)
    path = ckpt.save(0, model, optimizer, scheduler, extra={})
    logits = learner_logits(model, layout, ref["tokens"])
    if layout.rank == 0:
        torch.save(logits, os.path.join(run_dir, "learner_logits.pt"))
    return dict(
        case=case["name"],
        checkpoint=path,
        losses=[m["loss"] for m in metrics],
        # how far one batch of training moved the model from the Hugging Face weights it started from
        trained_vs_initial=float((logits - ref["logits"]).abs().max()) if logits is not None else None,
    )


if __name__ == "__main__":  # the checkpoint writer may re-import this module in a helper process
    run_cases(run_case, {"--root": "folder of the cases' run folders"})
