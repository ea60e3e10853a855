"""Worker: the :class:`~gspo_mcore.learner.Learner` verbs against the functions underneath, on one rank.

One toy model, a sampling temperature of 0.7 and a KL metric (so the reference policy exists). Checks, in
order, and prints ``LEARNER_API_OK`` when all hold:

- ``logprobs`` equals :func:`forward_logprobs` at the learner's temperature, bit for bit, and differs from the
  temperature-1 log-probs (the temperature reaches the forward);
- ``train`` makes ``batch.num_minibatches`` updates, each reporting ``kl`` (the reference reached the step);
- ``export_weights`` yields exactly the tensors of ``export_plan``, in order, with their shapes;
- ``save`` then ``load`` (after another update) restores the saved parameters exactly.
"""

from __future__ import annotations

import argparse

import torch
from helpers import learner_toy as toy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from gspo_mcore.algo import LossConfig
    from gspo_mcore.learner.checkpoint import CheckpointConfig, Checkpointer
    from gspo_mcore.learner.forward import forward_logprobs
    from gspo_mcore.learner.learner import Learner
    from gspo_mcore.learner.model_config import load_hf_config
    from gspo_mcore.learner.parallel import destroy_parallel
    from gspo_mcore.learner.step import BatchConfig

    arch = load_hf_config(toy.DENSE)
    learner = Learner.build(
        arch,
        loss=LossConfig(kl_metric=True),
        batch=BatchConfig(num_minibatches=2, max_tokens_per_microbatch=64),
        temperature=0.7,
        recompute_old_logprobs=True,
    )
    samples = toy.toy_samples(num_samples=8)

    got = learner.logprobs(samples)
    kw = dict(max_tokens=64, packing="padded")
    want = forward_logprobs(learner.model, samples, learner.layout, temperature=0.7, **kw)
    at_one = forward_logprobs(learner.model, samples, learner.layout, temperature=1.0, **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), "logprobs != forward_logprobs at the temperature"
    assert not all(torch.equal(a, b) for a, b in zip(got, at_one)), "logprobs ignore the temperature"

    updates = learner.train(samples)
    assert len(updates) == 2, f"{len(updates)} updates, expected batch.num_minibatches = 2"
    assert all("kl" in u and u["update_successful"] == 1.0 for u in updates), updates

    plan = learner.export_plan()
    items = [(n, tuple(t.shape)) for bucket in learner.export_weights(bucket_bytes=4096) for n, t in bucket]
    assert items == [(it.name, tuple(it.shape)) for it in plan], "export_weights does not follow export_plan"

    checkpoints = Checkpointer(CheckpointConfig(save_every=1), args.out, learner.layout, run_config={}, total_steps=3)
    learner.save(checkpoints, 0, extra={"note": "step 0"})
    saved = [p.detach().clone() for p in learner.model[0].parameters()]
    learner.train(samples)
    assert any(not torch.equal(a, p) for a, p in zip(saved, learner.model[0].parameters())), "no update happened"
    resumed = learner.load(
        Checkpointer(CheckpointConfig(resume=True), args.out, learner.layout, run_config={}, total_steps=3)
    )
    assert resumed is not None and resumed.step == 0 and resumed.extra["note"] == "step 0", resumed
    assert all(torch.equal(a, p) for a, p in zip(saved, learner.model[0].parameters())), "load did not restore"
    destroy_parallel()
    print("LEARNER_API_OK", flush=True)


if __name__ == "__main__":
    main()
