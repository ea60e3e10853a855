"""Worker (1 or 2 ranks): 3-turn episodes on the in-process engine over the learner's own model.

Usage: episode_worker.py LAYOUT TEMPERATURE   (LAYOUT: 1 or tp2). Prints one JSON line per rank.

Episodes at different turns decode together over the session's own KV cache: every environment span is
prefilled onto the row's cache with the turn's last sampled token. The engine's log-prob of every policy
token must equal the learner's forward over the whole episode, and the KV engine must draw the same tokens
as the engine that recomputes every sequence at every step, and the same tokens and log-probs as the engine that
prefills each episode's prompt on its own row (``share_prefill=False``; by default a group's episodes share one).
With TP2 only rank 0 runs the environment and broadcasts what it answers (the driver's ``share``).
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from helpers.learner_toy import toy_engine_setup


class Counter:
    """Answers each turn with a few tokens that depend on the turn and the action; never done."""

    def reset(self, row):
        from gspo_mcore.envs import Reset

        return Reset(observation=row["prompt"], state={"turn": 0})

    def step(self, state, action):
        from gspo_mcore.envs import Step

        state["turn"] += 1
        return Step(observation="t" * (1 + state["turn"] + len(action) % 3), info={"tool_calls": 1})


class Ids:
    """Text <-> ids of the toy vocabulary (ids 40..100, away from the stop tokens)."""

    def first(self, observation, tools=()):
        return [40 + (ord(c) % 60) for c in observation]

    def after_turn(self, observation, last):
        return self.first(observation)

    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


def main():
    layout_name, tau = sys.argv[1], float(sys.argv[2])
    from gspo_mcore.envs import EpisodeConfig
    from gspo_mcore.learner.batching import TrainSample
    from gspo_mcore.learner.forward import forward_logprobs
    from gspo_mcore.learner.inference import decode_model
    from gspo_mcore.learner.parallel import destroy_parallel
    from gspo_mcore.rollout import InProcessEngine, SamplingParams
    from gspo_mcore.rollout.episode import EpisodeDriver

    layout, _, model, kw = toy_engine_setup(layout_name)
    kv_model = decode_model(model, layout)
    assert kv_model.own_cache
    engine = InProcessEngine(kv_model, **kw)
    recompute = InProcessEngine(decode_model(model, layout, kv_cache=False), **kw)

    def share(value):
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    runs_env = layout.rank == 0
    config = EpisodeConfig(max_turns=3, max_total_tokens=64)
    driver = EpisodeDriver(Counter(), Ids(), config, runs_env=runs_env, share=share if layout.tp_size > 1 else None)
    rows = [{"prompt": p} for p in ["abcd", "xy", "hello!", "q"]]
    params = SamplingParams(temperature=tau, max_new_tokens=6, seed=5, stop_token_ids=tuple(range(20, 32)))
    groups = driver.run(engine, rows, 3, params, seed=5)
    baseline = driver.run(recompute, rows, 3, params, seed=5)
    unshared = driver.run(InProcessEngine(kv_model, share_prefill=False, **kw), rows, 3, params, seed=5)
    samples, engine_lp, masks = [], [], []
    for s in (s for g in groups for s in g):
        p = len(s.prompt_ids)
        tokens = torch.tensor(s.prompt_ids + s.response_ids)
        mask = torch.cat([torch.zeros(p, dtype=torch.long), torch.tensor(s.response_mask, dtype=torch.long)])
        samples.append(TrainSample(tokens=tokens, loss_mask=mask, advantage=0.0))
        engine_lp.append(torch.tensor(s.response_logprobs))
        masks.append(torch.tensor(s.response_mask, dtype=torch.bool))
    learner_lp = forward_logprobs(model, samples, layout, max_tokens=512, temperature=tau)
    diff = max(
        float((lp[len(s.tokens) - 1 - len(e) :][m] - e[m]).abs().max())
        for s, lp, e, m in zip(samples, learner_lp, engine_lp, masks)
    )
    flat = [s for g in groups for s in g]
    line = json.dumps(
        {
            "rank": layout.rank,
            "max_abs_diff": diff,
            "ids": [list(s.response_ids) for s in flat],
            "same_as_recompute": [s.response_ids for s in flat] == [s.response_ids for g in baseline for s in g],
            "same_as_unshared": [(s.response_ids, s.response_logprobs) for s in flat]
            == [(s.response_ids, s.response_logprobs) for g in unshared for s in g],
            "turns": [s.episode.turns for s in flat],
            "ends": [s.episode.end for s in flat],
            "policy_tokens": sum(int(m.sum()) for m in masks),
            "env_tokens": sum(int((~m).sum()) for m in masks),
        }
    )
    os.write(1, (line + "\n").encode())
    destroy_parallel()


if __name__ == "__main__":
    main()
