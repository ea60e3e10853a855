"""Worker for the resharding tests: checkpoints saved at one layout, loaded at another (1 or 2 ranks).

Cases run in order, each on a toy model of the learner tests (dense or MoE; 4 layers, hidden 64, vocab 128):

- ``save``: build (init seed 7), one rollout batch of 2 GSPO updates (batch A), save ``step_0``; record
  the parameter shards, the full-vocabulary logits of fixed tokens, then continue with one more rollout
  batch (batch B, 2 updates): its losses and the parameter shards after it.
- ``load``: build with other weights (seed 99), resume from a saved case's ``step_0`` at this case's
  layout; compare with the saver: parameters (exact), logits, then batch B's losses and the parameters
  after it. Control: the same continuation from the loaded weights with a fresh optimizer and schedule
  must land far away (the comparison sees the optimizer state).
- ``refuse``: the load must fail with a :class:`CheckpointError` (its message is recorded).
- ``model``: load the model only; compare parameters (exact) and logits with the saver's.

Rank 0 appends one JSON line per case to ``--out``.

    python -m torch.distributed.run --nproc_per_node 2 reshard_worker.py --dir D --out F --cases '[...]'
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from helpers import learner_toy as toy
from helpers.worker_cases import run_cases

MAX_TOKENS = 1000
OPTIM = dict(lr=1e-3, clip_grad=1.0, weight_decay=0.01, adam_eps=1e-6, lr_warmup_steps=3)  # see invariance_worker


def build(case, seed):
    from gspo_mcore.learner.model import build_model
    from gspo_mcore.learner.model_config import load_hf_config
    from gspo_mcore.learner.optimizer import OptimConfig, build_optimizer
    from gspo_mcore.learner.parallel import ParallelConfig, init_parallel

    arch = load_hf_config(toy.MODELS[case.get("model", "dense")])
    pc = ParallelConfig(tensor=case.get("tp", 1), expert=case.get("ep", 1))
    layout = init_parallel(pc, arch, seed=1234)
    distopt = case.get("distopt", False)
    model = build_model(arch, pc, seed=seed, use_distributed_optimizer=distopt)
    optimizer, scheduler = build_optimizer(model, OptimConfig(**OPTIM, use_distributed_optimizer=distopt))
    return arch, layout, model, optimizer, scheduler


def rollout_batch(model, optimizer, scheduler, layout, seed):
    from gspo_mcore.algo.loss_config import LossConfig
    from gspo_mcore.learner.forward import forward_logprobs
    from gspo_mcore.learner.step import BatchConfig, StepSettings, train_step

    samples = toy.toy_samples(vocab=128, seed=seed)
    logp = forward_logprobs(model, samples, layout, max_tokens=MAX_TOKENS)
    batch = toy.with_offset_old_logprobs(samples, logp, "gspo")
    metrics = train_step(
        model,
        optimizer,
        scheduler,
        batch,
        layout,
        StepSettings(loss=LossConfig(), batch=BatchConfig(num_minibatches=2, max_tokens_per_microbatch=MAX_TOKENS)),
    )
    return [m["loss"] for m in metrics], [m["grad_norm"] for m in metrics]


def logits(model, layout):
    from gspo_mcore.learner.inference import logits_fn

    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))
    return logits_fn(model, layout)(tokens)  # (2, 12, 128)


def saved(args, name):
    """The saver's shards (all ranks' merged into full tensors) and its rank-0 record."""
    files = sorted(f for f in os.listdir(os.path.join(args.dir, name)) if f.startswith("rank"))
    parts = [torch.load(os.path.join(args.dir, name, f), weights_only=False) for f in files]
    return (
        {k: toy.assemble([s for p in parts for s in p[k]]) for k in ("at_save", "after")},
        next(p for p in parts if "logits" in p),
    )


def run_case(case, args):
    from gspo_mcore.learner.checkpoint import CheckpointConfig, Checkpointer, CheckpointError, load_model_and_optimizer

    name = case["name"]
    if case["phase"] == "save":
        _, layout, model, optimizer, scheduler = build(case, seed=7)
        rollout_batch(model, optimizer, scheduler, layout, seed=0)
        cfg = CheckpointConfig(optimizer_format=case.get("format", "dp_reshardable"))
        ckpt = Checkpointer(cfg, os.path.join(args.dir, name, "ckpt"), layout)
        ckpt.save(0, model, optimizer, scheduler, extra={})
        record = {"at_save": toy.local_shards(model)}
        if layout.rank == 0:
            record["logits"] = logits(model, layout)
        else:
            logits(model, layout)
        record["losses"], record["grad_norms"] = rollout_batch(model, optimizer, scheduler, layout, seed=1)
        record["after"] = toy.local_shards(model)
        torch.save(record, os.path.join(args.dir, name, f"rank{layout.rank}.pt"))
        return dict(case=name, save_s=ckpt.last_save_s)

    source = os.path.join(args.dir, case["from"], "ckpt", "step_0")
    _, layout, model, optimizer, scheduler = build(case, seed=99)
    ckpt = Checkpointer(CheckpointConfig(resume=source), os.path.join(args.dir, name, "ckpt"), layout)
    if case["phase"] == "refuse":
        try:
            ckpt.resume(model, optimizer, scheduler)
        except CheckpointError as exc:
            return dict(case=name, refused=str(exc))
        return dict(case=name, refused=None)
    ref, ref_record = saved(args, case["from"])
    if case["phase"] == "model":
        with open(os.path.join(source, "trainer_state.json")) as f:
            state = json.load(f)
        load_model_and_optimizer(
            os.path.join(source, "megatron"),
            model,
            None,
            saved_optimizer=state["optimizer"],
            saved_layout=state["layout"],
            layout=state["layout"],
        )
        load_diff, _ = toy.max_diff_vs(toy.local_shards(model), ref["at_save"])
        return dict(
            case=name,
            load_param_diff=load_diff,
            logits_diff=float((logits(model, layout) - ref_record["logits"]).abs().max()),
        )
    resumed = ckpt.resume(model, optimizer, scheduler)
    load_diff, _ = toy.max_diff_vs(toy.local_shards(model), ref["at_save"])
    out = logits(model, layout)
    losses, grad_norms = rollout_batch(model, optimizer, scheduler, layout, seed=1)
    after_diff, _ = toy.max_diff_vs(toy.local_shards(model), ref["after"])

    # control: same weights, fresh optimizer state and LR schedule
    _, layout, model2, optimizer2, scheduler2 = build(case, seed=99)
    state = resumed.trainer_state
    load_model_and_optimizer(
        os.path.join(source, "megatron"),
        model2,
        None,
        saved_optimizer=state["optimizer"],
        saved_layout=state["layout"],
        layout=state["layout"],
    )
    rollout_batch(model2, optimizer2, scheduler2, layout, seed=1)
    control_diff, _ = toy.max_diff_vs(toy.local_shards(model2), ref["after"])
    diffs = torch.tensor([load_diff, after_diff, control_diff])
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    return dict(
        case=name,
        load_s=ckpt.last_load_s,
        load_param_diff=float(diffs[0]),
        logits_diff=float((out - ref_record["logits"]).abs().max()),
        losses=losses,
        ref_losses=ref_record["losses"],
        grad_norms=grad_norms,
        ref_grad_norms=ref_record["grad_norms"],
        after_param_diff=float(diffs[1]),
        control_param_diff=float(diffs[2]),
    )


if __name__ == "__main__":
    run_cases(run_case, {"--dir": "folder of the checkpoints"}, append=True)
