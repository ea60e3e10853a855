"""Worker (1 or 2 ranks): the in-process engine's log-probs vs the learner's forward-only log-probs.

Usage: inprocess_worker.py LAYOUT TEMPERATURE   (LAYOUT: 1, dp2, tp2, or 1-megatron-cache: 1 rank with the
KV cache in Megatron's StaticInferenceContext, the path taken with Transformer Engine's attention). Prints one
JSON line per rank.

The engine runs on a KV cache (prompts of different lengths, left-padded in one batch; stop
tokens end rows at different steps, so finished rows are dropped from the cache mid-batch) and, for
comparison, through full recompute of every sequence at every step, and with one prefill row per sample
(``share_prefill=False``) instead of one per distinct prompt copied to its samples by ``select``.
"""

import json
import os
import sys

import torch
from helpers.learner_toy import toy_engine_setup


def main():
    layout_name, tau = sys.argv[1], float(sys.argv[2])
    from gspo_mcore.learner.batching import TrainSample
    from gspo_mcore.learner.forward import forward_logprobs
    from gspo_mcore.learner.inference import MegatronDecodeModel, decode_model
    from gspo_mcore.learner.model import unwrap
    from gspo_mcore.learner.parallel import destroy_parallel
    from gspo_mcore.rollout import InProcessEngine, SamplingParams

    layout, _, model, kw = toy_engine_setup(layout_name)
    if layout_name == "1-megatron-cache":
        kv_model = MegatronDecodeModel(unwrap(model[0]), layout, megatron_cache=True)
        assert not kv_model.own_cache
    else:
        kv_model = decode_model(model, layout)
        assert kv_model.own_cache  # the local layer spec: the session's own cache
    engine = InProcessEngine(kv_model, **kw)
    prefills = []  # the token ids' shape of every multi-token embedding call: the prefills ([B, s] steps are s = 1)
    kv_model.gpt.embedding.register_forward_hook(
        lambda module, args, kwargs, out: (
            prefills.append(list(kwargs["input_ids"].shape)) if kwargs["input_ids"].shape[1] > 1 else None
        ),
        with_kwargs=True,
    )
    recompute = InProcessEngine(decode_model(model, layout, kv_cache=False), **kw)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16], [17]]
    params = SamplingParams(temperature=tau, max_new_tokens=16, seed=123, stop_token_ids=tuple(range(20, 32)))
    groups = engine.generate_sync(prompts, 3, params)
    again = engine.generate_sync(prompts, 3, params)
    engine_prefills = list(prefills)
    # one prefill row per sample: its session is never given repeated rows by select
    unshared = InProcessEngine(kv_model, share_prefill=False, **kw).generate_sync(prompts, 3, params)
    baseline = recompute.generate_sync(prompts, 3, params)
    samples, engine_lp = [], []
    for g in groups:
        for s in g:
            p, r = len(s.prompt_ids), len(s.response_ids)
            tokens = torch.tensor(s.prompt_ids + s.response_ids)
            mask = torch.cat([torch.zeros(p, dtype=torch.long), torch.ones(r, dtype=torch.long)])
            samples.append(TrainSample(tokens=tokens, loss_mask=mask, advantage=0.0))
            engine_lp.append(torch.tensor(s.response_logprobs))
    learner_lp = forward_logprobs(model, samples, layout, max_tokens=256, temperature=tau)
    diff = max(
        float((lp[len(s.tokens) - 1 - len(e) :] - e).abs().max()) for s, lp, e in zip(samples, learner_lp, engine_lp)
    )
    ids = [list(s.response_ids) for g in groups for s in g]
    reasons = [s.finish_reason for g in groups for s in g]
    line = (
        json.dumps(
            {
                "rank": layout.rank,
                "max_abs_diff": diff,
                "ids": ids,
                "reproducible": ids == [list(s.response_ids) for g in again for s in g],
                "same_as_recompute": ids == [list(s.response_ids) for g in baseline for s in g],
                "same_as_unshared": ids == [list(s.response_ids) for g in unshared for s in g],
                "unshared_max_abs_diff": max(
                    abs(a - b)
                    for g, h in zip(groups, unshared)
                    for x, y in zip(g, h)
                    for a, b in zip(x.response_logprobs, y.response_logprobs)
                ),
                "num_stop": reasons.count("stop"),
                "num_length": reasons.count("length"),
                "num_tokens": sum(len(e) for e in engine_lp),
                "prefills": engine_prefills,
            }
        )
        + "\n"
    )
    os.write(1, line.encode())  # one write (< PIPE_BUF): the ranks' lines never interleave
    destroy_parallel()  # barrier + teardown: no rank exits while a peer still talks to it


if __name__ == "__main__":
    main()
