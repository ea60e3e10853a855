"""Worker for the Routing Replay tests (1 or 2 gloo ranks): several checks per launch, one JSON line each.

Checks, on the toy MoE model (layout-independent init):
- ``record``: the experts recorded with the old log-probs, per sample ``[L, layers, topk]``, for this
  layout and micro-batch plan. Case ``save`` writes them as the reference; the others compare with it.
- ``replay``: after one large optimizer step (so the router chooses differently), a replayed training
  forward, packed with ANOTHER micro-batch plan, must route every token to its recorded experts. The
  routers' actual decisions are captured by forward hooks (``routing_map``) and mapped back to samples
  here, independently of ``gspo_mcore.learner.routing``; the same forward without replay must differ
  (so the check can fail).
- ``noop``: replaying the model's own current routing leaves loss and gradient norm unchanged.
- ``rollout`` (R3): given routing that is not the model's (random experts, the last position ``-1`` as an
  engine returns it), the old-log-prob forward (``forward_logprobs(replay_routing=True)``) and a training
  forward, both packed with other micro-batch plans, route every position but the last to exactly those
  experts (hooked routers again); the same forwards without replay disagree with them. ``train_step`` with
  ``RoutingConfig(replay="rollout")`` then runs and reports ``routing_rollout_disagreement`` > 0.

    python -m torch.distributed.run --nproc_per_node 2 routing_worker.py --ref DIR --out FILE \
        --cases '[{"name": "ep2", "ep": 2}]'
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import torch.distributed as dist
from helpers import learner_toy as toy
from helpers.worker_cases import run_cases


def capture_routing(model):
    """Forward hooks on every router; returns (calls, remove): calls = [(layer, routing_map)] in call order."""
    from gspo_mcore.learner.model import unwrap

    calls, handles = [], []
    capture_routing.num_local = 0
    for module in unwrap(model[0]).modules():
        if type(module).__name__ == "TopKRouter":
            layer = int(module.layer_number) - 1

            def hook(mod, args, output, layer=layer):
                calls.append((layer, output[1].detach().clone()))

            handles.append(module.register_forward_hook(hook))
            capture_routing.num_local += 1
    return calls, lambda: [h.remove() for h in handles]


def routed_sets_by_sample(calls, mbs, num_layers):
    """{sample index: bool [L, layers, E]} from the hooked routing maps, for padded micro-batches."""
    out = {}
    per_mb = [c for c in calls]
    k = 0
    for mb in mbs:
        rows, width = mb.tokens.shape
        for _ in range(num_layers):
            layer, rmap = per_mb[k]
            k += 1
            grid = rmap.view(width, rows, -1)  # router order: sequence-major
            for r, i in enumerate(mb.sample_indices):
                n = int(mb.cu_seqlens[r + 1] - mb.cu_seqlens[r])  # the padded row width
                out.setdefault(i, {})[layer] = grid[:, r][:n]
    return out


def run_case(case, args):
    from gspo_mcore.algo.loss_config import LossConfig
    from gspo_mcore.learner.forward import forward_logprobs_with_routing
    from gspo_mcore.learner.model import build_model
    from gspo_mcore.learner.model_config import load_hf_config
    from gspo_mcore.learner.optimizer import OptimConfig, build_optimizer, optimizer_step, zero_grads
    from gspo_mcore.learner.parallel import ParallelConfig, init_parallel
    from gspo_mcore.learner.schedule import microbatches_for_rank
    from gspo_mcore.learner.step import forward_backward

    arch = load_hf_config(toy.MODELS["moe"])
    pc = ParallelConfig(expert=case.get("ep", 1), pipeline=case.get("pp", 1))
    layout = init_parallel(pc, arch, seed=1234)
    model = build_model(arch, pc, seed=7)
    optimizer, scheduler = build_optimizer(model, OptimConfig(lr=5e-2, clip_grad=0.0, weight_decay=0.0))
    samples = toy.toy_samples(vocab=arch.vocab_size)
    packing = case.get("packing", "padded")
    logp, recorded = forward_logprobs_with_routing(
        model, samples, layout, max_tokens=case.get("max_tokens", 1000), packing=packing
    )
    result = dict(case=case["name"], world=layout.world_size)
    flat = torch.cat([r.reshape(-1) for r in recorded])
    if case.get("save"):
        torch.save(recorded, os.path.join(args.ref, "routing.pt"))
        result["record_mismatch"] = 0
    else:
        ref = torch.load(os.path.join(args.ref, "routing.pt"))
        result["record_mismatch"] = int(sum(int((a != b).sum()) for a, b in zip(recorded, ref)))
    result["record_min"] = int(flat.min())
    result["record_max"] = int(flat.max())

    batch = [replace(s, old_logprobs=lp, routed_experts=r) for s, lp, r in zip(samples, logp, recorded)]
    loss_cfg = LossConfig(variant="grpo")
    # noop: replaying the current routing changes nothing
    plain = forward_backward(model, batch, layout, loss_cfg, max_tokens=60)
    zero_grads(model, optimizer)
    replayed = forward_backward(model, batch, layout, loss_cfg, max_tokens=45, replay_routing=True)
    zero_grads(model, optimizer)
    result["noop_loss_diff"] = abs(plain["loss"] - replayed["loss"])

    # one large update, then a replayed forward with another micro-batch plan
    forward_backward(model, batch, layout, loss_cfg, max_tokens=1000)
    optimizer_step(optimizer, scheduler)
    zero_grads(model, optimizer)
    max_tokens = case.get("replay_max_tokens", 40)
    mbs = microbatches_for_rank(batch, layout, max_tokens, model=model, packing="padded")
    counts = {}
    for mode in ("replay", "free"):
        calls, remove = capture_routing(model)
        forward_backward(model, batch, layout, loss_cfg, max_tokens=max_tokens, replay_routing=mode == "replay")
        remove()
        zero_grads(model, optimizer)
        got = routed_sets_by_sample(calls, mbs, capture_routing.num_local)  # this stage's MoE layers
        wrong = 0
        for i, per_layer in got.items():
            n = samples[i].length
            for layer, rmap in per_layer.items():
                want = torch.zeros_like(rmap[:n])
                want.scatter_(1, recorded[i][:, layer].long(), True)
                wrong += int((rmap[:n] != want).any(-1).sum())
        first_stage = layout.pp_rank == 0  # count each sample once: on one stage
        covered = torch.tensor([wrong, len(got) if first_stage else 0], dtype=torch.int64)
        dist.all_reduce(covered)
        counts[mode] = covered.tolist()
    result["replay_wrong_tokens"], result["replay_samples_seen"] = counts["replay"]
    result["free_wrong_tokens"], _ = counts["free"]
    result.update(check_rollout_replay(model, optimizer, scheduler, samples, layout, arch))
    return result


def rollout_routing(samples, num_layers, topk, num_experts, seed=0):
    """Per sample ``[L, layers, topk]``: distinct random experts per position, ``-1`` at the last one."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in samples:
        r = torch.stack([torch.randperm(num_experts, generator=g)[:topk] for _ in range(s.length * num_layers)])
        r = r.view(s.length, num_layers, topk).to(torch.int32)
        r[-1] = -1
        out.append(r)
    return out


def check_rollout_replay(model, optimizer, scheduler, samples, layout, arch):
    """R3: replay routing the model would not choose, in the old-log-prob and training forwards."""
    from gspo_mcore.algo.loss_config import LossConfig
    from gspo_mcore.learner.forward import forward_logprobs
    from gspo_mcore.learner.optimizer import zero_grads
    from gspo_mcore.learner.routing import RoutingConfig
    from gspo_mcore.learner.schedule import microbatches_for_rank
    from gspo_mcore.learner.step import BatchConfig, StepSettings, forward_backward, train_step

    given = rollout_routing(samples, arch.num_hidden_layers, arch.num_experts_per_tok, arch.num_experts)
    batch = [replace(s, routed_experts=r) for s, r in zip(samples, given)]
    loss_cfg = LossConfig(variant="grpo")
    out = {}
    for name, max_tokens in (("logprobs", 35), ("train", 50)):
        mbs = microbatches_for_rank(batch, layout, max_tokens, model=model, packing="padded")
        for mode in ("replay", "free"):
            calls, remove = capture_routing(model)
            if name == "logprobs":
                old = forward_logprobs(model, batch, layout, max_tokens=max_tokens, replay_routing=mode == "replay")
                with_old = [replace(s, old_logprobs=lp) for s, lp in zip(batch, old)]
            else:
                forward_backward(
                    model, with_old, layout, loss_cfg, max_tokens=max_tokens, replay_routing=mode == "replay"
                )
                zero_grads(model, optimizer)
            remove()
            got = routed_sets_by_sample(calls, mbs, capture_routing.num_local)
            wrong = 0
            for i, per_layer in got.items():
                n = samples[i].length - 1  # the last position is not routed by the engine
                for layer, rmap in per_layer.items():
                    want = torch.zeros_like(rmap[:n])
                    want.scatter_(1, given[i][:n, layer].long(), True)
                    wrong += int((rmap[:n] != want).any(-1).sum())
            first_stage = layout.pp_rank == 0
            covered = torch.tensor([wrong, len(got) if first_stage else 0], dtype=torch.int64)
            dist.all_reduce(covered)
            out[f"r3_{name}_{mode}_wrong"], out[f"r3_{name}_{mode}_seen"] = covered.tolist()
    metrics = train_step(
        model,
        optimizer,
        scheduler,
        batch,
        layout,
        StepSettings(
            loss=loss_cfg,
            batch=BatchConfig(max_tokens_per_microbatch=45, num_minibatches=2),
            routing=RoutingConfig(replay="rollout"),
            recompute_old_logprobs=True,
        ),
        measure_routing=True,
    )
    out["r3_disagreement"] = metrics[0]["routing_rollout_disagreement"]
    out["r3_loss_finite"] = all(torch.isfinite(torch.tensor(m["loss"])).item() for m in metrics)
    bad = [replace(s, routed_experts=r.clone()) for s, r in zip(batch, given)]
    bad[3].routed_experts[1, 0, 0] = -1  # an unrouted position that is not the last
    try:
        settings = StepSettings(loss=loss_cfg, routing=RoutingConfig(replay="rollout"))
        train_step(model, optimizer, scheduler, bad, layout, settings)
        out["r3_bad_error"] = ""
    except ValueError as e:
        out["r3_bad_error"] = str(e)
    return out


if __name__ == "__main__":
    run_cases(run_case, {"--ref": "folder of the 1-rank reference recording"})
