"""Worker for the aggregation-invariance tests: runs several layouts in one launch (1, 2 or 4 ranks).

For each case: build the toy model (layout-independent init), recompute old log-probs forward-only,
check them against the training forward, then one rollout batch of 2 mini-batches (2 optimizer steps).
A case with ``"save": true`` (1 rank) saves its results and full parameters as the reference for its
model and variant; every other case compares every rank's parameter shards with that reference. Rank 0
writes one JSON line per case.

    python -m torch.distributed.run --nproc_per_node 2 invariance_worker.py --ref DIR --out FILE \
        --cases '[{"name": "tp2", "model": "dense", "tp": 2, "variant": "gspo"}]'
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from helpers import learner_toy as toy
from helpers.worker_cases import run_cases

MAX_TOKENS = 1000  # one micro-batch per rank unless a case asks for less
# Adam divides by sqrt(v) + eps: with eps = 1e-8 an element whose gradient is ~1e-8 (the rounding level of
# its sum) moves by a large fraction of lr whatever its sign; 1e-6 keeps the update well conditioned so
# that parameters can be compared at fp32 level (with 1e-8, DP2 vs 1 rank differed by 2.7e-5 = 2.7% lr).
ADAM_EPS = 1e-6


def ref_name(case):
    return f"{case['model']}-{case['variant']}"


def run_case(case, args):
    from gspo_mcore.learner import (BatchConfig, LossConfig, OptimConfig, ParallelConfig, build_model, build_optimizer,
                                    forward_backward, forward_logprobs, init_parallel, load_hf_config, train_step)
    from gspo_mcore.learner.optimizer import zero_grads

    t0 = time.time()
    shape = load_hf_config(toy.MODELS[case["model"]])
    pc = ParallelConfig(tensor=case.get("tp", 1), pipeline=case.get("pp", 1), expert=case.get("ep", 1))
    layout = init_parallel(pc, shape, seed=1234)
    distopt = case.get("distopt", False)
    model = build_model(shape, pc, seed=7, use_distributed_optimizer=distopt)
    optim = OptimConfig(lr=1e-3, clip_grad=1.0, weight_decay=0.01, adam_eps=ADAM_EPS, use_distributed_optimizer=distopt)
    optimizer, scheduler = build_optimizer(model, optim)
    max_tokens = case.get("max_tokens", MAX_TOKENS)
    packing = case.get("packing", "padded")
    initial = toy.local_shards(model)
    samples = toy.toy_samples(vocab=shape.vocab_size)

    logp = forward_logprobs(model, samples, layout, max_tokens=max_tokens, packing=packing)
    # Forward-only log-probs vs the training forward: with old = forward-only log-probs, GRPO's token
    # ratios exp(logp_train - logp_fwd) are 1 up to rounding; their min/max bound every counted token.
    check = forward_backward(model, [replace(s, old_logprobs=lp) for s, lp in zip(samples, logp)], layout,
                             LossConfig(variant="grpo"), max_tokens=max_tokens, packing=packing)
    zero_grads(model, optimizer)
    fwd_vs_train = max(abs(math.log(check["ratio_min"])), abs(math.log(check["ratio_max"])))

    variant = case["variant"]
    batch = toy.with_offset_old_logprobs(samples, logp, variant)
    metrics = train_step(model, optimizer, scheduler, batch, layout, LossConfig(variant=variant),
                         BatchConfig(num_minibatches=2, max_tokens_per_microbatch=max_tokens, packing=packing))
    result = dict(case=case["name"], world=layout.world_size, dp=layout.dp_size,
                  losses=[m["loss"] for m in metrics], grad_norms=[m["grad_norm"] for m in metrics],
                  clip_fraction=[m["clip_fraction"] for m in metrics],
                  num_microbatches=[m["num_microbatches"] for m in metrics], fwd_vs_train_logp=fwd_vs_train,
                  seconds=0.0)
    final = toy.local_shards(model)
    flat_logp = torch.cat(logp)
    if case.get("save"):
        torch.save({"initial": toy.assemble(initial), "final": toy.assemble(final), "logp": flat_logp,
                    "result": result}, os.path.join(args.ref, ref_name(case) + ".pt"))
    else:
        ref = torch.load(os.path.join(args.ref, ref_name(case) + ".pt"))
        init_diff, keys = toy.max_diff_vs(initial, ref["initial"])
        final_diff, _ = toy.max_diff_vs(final, ref["final"])
        diffs = torch.tensor([init_diff, final_diff, float((flat_logp - ref["logp"]).abs().max())])
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
        all_keys = [None] * dist.get_world_size()
        dist.all_gather_object(all_keys, keys)
        covered = sorted(set().union(*all_keys))
        result.update(init_param_diff=float(diffs[0]), param_diff=float(diffs[1]), logp_diff=float(diffs[2]),
                      keys_missing=sorted(set(ref["initial"]) - set(covered)),
                      ref_losses=ref["result"]["losses"], ref_grad_norms=ref["result"]["grad_norms"])
    result["seconds"] = round(time.time() - t0, 2)
    return result


if __name__ == "__main__":
    run_cases(run_case, {"--ref": "folder of the 1-rank reference results"})
