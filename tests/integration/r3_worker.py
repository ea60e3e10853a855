"""The learner side of the R3 test (test_real_routed_experts.py): one gloo rank, the main venv.

Run as ``python r3_worker.py SPEC.json REPORT.json``. It builds the Megatron learner on the tiny Qwen3-MoE
checkpoint the SGLang server serves, generates through the project's client with ``routed_experts`` asked for
(:class:`gspo_mcore.rollout.SGLangEngine`), turns the samples into the learner's rows the way the trainer does
(:func:`gspo_mcore.trainer.batch.learner_samples`), and measures how often the learner's routers choose other
experts than SGLang did, per (token, MoE layer):

- ``free``: the learner's own routing (recorded by :func:`forward_logprobs_with_routing`): R3 off;
- ``replayed``: what the routers actually did (forward hooks on every ``TopKRouter``, independent of
  ``gspo_mcore.learner.routing``) in the old-log-prob forward (``forward_logprobs(replay_routing=True)``)
  and in a training forward (``forward_backward(replay_routing=True)``): R3 on;

before and after one optimizer update of the learner (the server keeps the old weights: the rollout policy).
Then one ``train_step`` with ``RoutingConfig(replay="rollout")`` as the trainer runs it.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import replace

import torch

from gspo_mcore.algo.loss_config import LossConfig
from gspo_mcore.learner.forward import forward_logprobs, forward_logprobs_with_routing
from gspo_mcore.learner.hf.load import load_hf_weights
from gspo_mcore.learner.model import ModelOptions, build_model, unwrap
from gspo_mcore.learner.model_config import load_hf_config
from gspo_mcore.learner.optimizer import OptimConfig, build_optimizer, optimizer_step, zero_grads
from gspo_mcore.learner.parallel import ParallelConfig, init_parallel
from gspo_mcore.learner.routing import RoutingConfig, routing_change
from gspo_mcore.learner.schedule import microbatches_for_rank
from gspo_mcore.learner.step import BatchConfig, StepSettings, forward_backward, train_step
from gspo_mcore.rollout import SamplingParams, SGLangClientConfig, SGLangEngine
from gspo_mcore.trainer.batch import learner_samples

MAX_TOKENS = 4096  # one padded micro-batch per forward


def hooked(model):
    """``(calls, remove)``: every router's ``routing_map`` in call order, as ``(layer, map)``."""
    calls, handles = [], []
    for module in unwrap(model[0]).modules():
        if type(module).__name__ == "TopKRouter":
            layer = int(module.layer_number) - 1
            handles.append(
                module.register_forward_hook(lambda m, a, out, layer=layer: calls.append((layer, out[1].clone())))
            )
    return calls, lambda: [h.remove() for h in handles]


def disagreement_of_maps(calls, mbs, samples, engine_routing) -> dict:
    """The fraction of (position, MoE layer) pairs whose hooked expert set differs from the engine's: over the
    scored positions (as ``routing_change`` counts) and over every position the engine routed (prompt too)."""
    counts = {"scored": [0, 0], "all": [0, 0]}
    assert len(mbs) == 1, "one micro-batch: every router is called once"
    for mb in mbs:
        rows, width = mb.tokens.shape
        for layer, rmap in calls:
            grid = rmap.view(width, rows, -1)
            for r, i in enumerate(mb.sample_indices):
                n = samples[i].length - 1  # the engine does not route the last token
                want = torch.zeros_like(grid[:n, r])
                want.scatter_(1, engine_routing[i][:n, layer].long(), True)
                differ = (grid[:n, r] != want).any(-1)
                scored = samples[i].loss_mask[1 : n + 1] > 0
                counts["all"][0] += int(differ.sum())
                counts["all"][1] += n
                counts["scored"][0] += int(differ[scored].sum())
                counts["scored"][1] += int(scored.sum())
    return {key: c[0] / max(c[1], 1) for key, c in counts.items()} | {"pairs": counts["all"][1]}


def served_learner(spec: dict):
    """1 gloo rank holding the served weights (``spec["hf_dir"]``), its optimizer at ``spec["lr"]``, and the
    SGLang client's config asking for routed experts. Returns ``(arch, layout, model, optimizer, scheduler,
    client_config)``."""
    arch = load_hf_config(os.path.join(spec["hf_dir"], "config.json"))
    layout = init_parallel(ParallelConfig(), arch, seed=0)
    model = build_model(arch, ParallelConfig(), ModelOptions(use_te=False), seed=None)
    load_hf_weights(model, spec["hf_dir"])
    optimizer, scheduler = build_optimizer(model, OptimConfig(lr=spec["lr"], clip_grad=0.0, weight_decay=0.0))
    dims = (arch.num_hidden_layers, arch.num_experts_per_tok)
    config = SGLangClientConfig(request_timeout_s=600.0, max_attempts=1, routed_experts=dims)
    return arch, layout, model, optimizer, scheduler, config


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    arch, layout, model, optimizer, scheduler, config = served_learner(spec)

    async def generate():
        async with SGLangEngine(spec["urls"], config=config) as engine:
            await engine.check_routed_experts()
            return await engine.generate(spec["prompts"], spec["n"], SamplingParams(**spec["params"]))

    groups = asyncio.run(generate())
    rewards = torch.randn(len(groups) * spec["n"], generator=torch.Generator().manual_seed(0))
    advantages = (rewards.view(len(groups), -1) - rewards.view(len(groups), -1).mean(1, keepdim=True)).reshape(-1)
    samples, _ = learner_samples(groups, advantages, torch.ones(len(groups), dtype=torch.bool))
    engine_routing = [s.routed_experts for s in samples]
    report = {
        "num_samples": len(samples),
        "tokens": sum(s.length for s in samples),
        "engine_rows_checked": all(bool((r[-1] == -1).all()) and int(r[:-1].min()) >= 0 for r in engine_routing),
    }
    loss_cfg = LossConfig(variant="grpo")
    mbs = microbatches_for_rank(samples, layout, MAX_TOKENS, model=model, packing="padded")

    def measure(label: str) -> None:
        logp, free = forward_logprobs_with_routing(model, samples, layout, max_tokens=MAX_TOKENS)
        report[f"{label}_free"] = routing_change(engine_routing, free, samples)["routing_changed_fraction"]
        calls, remove = hooked(model)
        replayed_logp = forward_logprobs(model, samples, layout, max_tokens=MAX_TOKENS, replay_routing=True)
        remove()
        report[f"{label}_replayed_logprobs"] = disagreement_of_maps(calls, mbs, samples, engine_routing)
        batch = [replace(s, old_logprobs=lp) for s, lp in zip(samples, replayed_logp)]
        calls, remove = hooked(model)
        forward_backward(model, batch, layout, loss_cfg, max_tokens=MAX_TOKENS, replay_routing=True)
        remove()
        zero_grads(model, optimizer)
        report[f"{label}_replayed_train"] = disagreement_of_maps(calls, mbs, samples, engine_routing)
        # SGLang's log-probs against the learner's, free and replayed (counted tokens)
        for name, lps in (("free", logp), ("replayed", replayed_logp)):
            diff = [
                float(((lp - s.old_logprobs).abs() * s.loss_mask[1:]).max()) for s, lp in zip(samples, lps)
            ]  # old_logprobs: SGLang's
            report[f"{label}_logprob_maxdiff_{name}"] = max(diff)

    measure("before")
    # one optimizer update of the learner, without replay (the server keeps the rollout weights)
    zero_grads(model, optimizer)
    forward_backward(model, samples, layout, loss_cfg, max_tokens=MAX_TOKENS)
    optimizer_step(optimizer, scheduler)
    zero_grads(model, optimizer)
    measure("after")
    metrics = train_step(
        model,
        optimizer,
        scheduler,
        samples,
        layout,
        StepSettings(
            loss=loss_cfg,
            batch=BatchConfig(max_tokens_per_microbatch=MAX_TOKENS, num_minibatches=2),
            routing=RoutingConfig(replay="rollout"),
            recompute_old_logprobs=True,
        ),
        measure_routing=True,
    )
    report["train_step"] = metrics
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
