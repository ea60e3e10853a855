"""The learner side of the multi-turn R3 test (``test_real_routed_experts.py``): one gloo rank, the main venv.

Run as ``python r3_episodes_worker.py SPEC.json REPORT.json``. It runs multi-turn episodes of the echo environment
(``learner_worker.EchoEnv``) through the episode driver over :meth:`SGLangEngine.generate_turns` with routed experts
asked for, recording every turn's ``routed_experts`` as SGLang returned it. The sample keeps the last turn's; the
report says, per sample, whether it has one row per position SGLang computed (prompt, every policy turn, every
environment span; ``-1`` only on the last token, which nothing routed), whether every earlier turn's rows equal the
last turn's on the positions that turn computed, and, on the learner loaded with the served weights, how often its
routers (hooked, as in ``r3_worker.py``) choose other experts than SGLang did: free and replayed, over every position
and over the environment spans alone, and the policy tokens' log-probs against SGLang's. Then the same after one
optimizer update (the server keeps the rollout weights).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import torch
from learner_worker import CharRenderer, EchoEnv
from r3_worker import disagreement_of_maps, hooked, served_learner

from gspo_mcore.algo.loss_config import LossConfig
from gspo_mcore.envs import EpisodeConfig
from gspo_mcore.learner.forward import forward_logprobs
from gspo_mcore.learner.optimizer import optimizer_step, zero_grads
from gspo_mcore.learner.schedule import microbatches_for_rank
from gspo_mcore.learner.step import forward_backward
from gspo_mcore.rollout import SamplingParams, SGLangEngine
from gspo_mcore.rollout.episode import EpisodeDriver
from gspo_mcore.trainer.batch import learner_samples

MAX_TOKENS = 4096  # one padded micro-batch per forward


def env_positions(sample) -> torch.Tensor:
    """Boolean over the sample's routed positions (all but the last token): inside an environment span."""
    mask = torch.tensor([1] * len(sample.prompt_ids) + list(sample.response_mask))
    env = torch.zeros_like(mask, dtype=torch.bool)
    env[len(sample.prompt_ids) :] = mask[len(sample.prompt_ids) :] == 0
    return env[:-1]


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    _, layout, model, optimizer, scheduler, config = served_learner(spec)
    turns: dict[int, list] = {}  # row -> [(sequence length before the turn, the turn's TurnEnd)]

    class Recorded:
        async def generate_turns(_, prompts, params, *, keys, max_total_tokens, on_turns, caps=None, stops=None):
            lengths = {b: len(p) for b, p in enumerate(prompts)}

            def on(ends):
                answers = on_turns(ends)
                for e, more in zip(ends, answers):
                    turns.setdefault(e.row, []).append((lengths[e.row], e))
                    lengths[e.row] += len(e.ids) + (len(more) if more is not None else 0)
                return answers

            async with SGLangEngine(spec["urls"], config=config) as engine:
                await engine.check_routed_experts()
                await engine.generate_turns(
                    prompts, params, keys=keys, max_total_tokens=max_total_tokens, on_turns=on, caps=caps, stops=stops
                )

    sp = SamplingParams(**spec["params"])
    driver = EpisodeDriver(EchoEnv(), CharRenderer(), EpisodeConfig(max_turns=spec["turns"], max_total_tokens=512))
    groups = driver.run(Recorded(), [{"prompt": p} for p in spec["rows"]], spec["n"], sp, seed=sp.seed or 0)
    flat = [s for g in groups for s in g]
    rows_of = sorted(turns)  # the driver's rows in sample order (one episode per row)
    assert len(rows_of) == len(flat), (len(rows_of), len(flat))
    advantages = torch.randn(len(flat), generator=torch.Generator().manual_seed(0))
    samples, _ = learner_samples(groups, advantages, torch.ones(len(groups), dtype=torch.bool))
    engine_routing = [s.routed_experts for s in samples]
    per_sample = []
    for k, (s, t) in enumerate(zip(flat, samples)):
        length = len(s.prompt_ids) + len(s.response_ids)
        r = t.routed_experts
        log = turns[rows_of[k]]
        earlier = [  # every turn's rows equal the final ones on the positions that turn computed
            bool(torch.equal(e.routed_experts[: start + len(e.ids) - 1], r[: start + len(e.ids) - 1]))
            for start, e in log
        ]
        per_sample.append(
            {
                "length": length,
                "rows": int(r.shape[0]),
                "last_row_unrouted": bool((r[-1] == -1).all()),
                "routed_rows_valid": int(r[:-1].min()) >= 0,
                "turns": len(log),
                "env_rows": int(env_positions(s).sum()),
                "earlier_turns_agree": earlier,
            }
        )
    report = {"samples": per_sample}
    mbs = microbatches_for_rank(samples, layout, MAX_TOKENS, model=model, packing="padded")
    env_only = [env_scored(s, t) for s, t in zip(flat, samples)]

    def measure(label: str) -> None:
        for name, replay in (("free", False), ("replayed", True)):
            calls, remove = hooked(model)
            lps = forward_logprobs(model, samples, layout, max_tokens=MAX_TOKENS, replay_routing=replay)
            remove()
            report[f"{label}_{name}"] = disagreement_of_maps(calls, mbs, samples, engine_routing)
            report[f"{label}_{name}_env"] = disagreement_of_maps(calls, mbs, env_only, engine_routing)["scored"]
            diffs = [float(((lp - t.old_logprobs).abs() * t.loss_mask[1:]).max()) for t, lp in zip(samples, lps)]
            report[f"{label}_logprob_maxdiff_{name}"] = max(diffs)

    measure("before")
    zero_grads(model, optimizer)
    forward_backward(model, samples, layout, LossConfig(variant="grpo"), max_tokens=MAX_TOKENS)
    optimizer_step(optimizer, scheduler)
    zero_grads(model, optimizer)
    measure("after")
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)
    return 0


def env_scored(sample, train_sample):
    """``train_sample`` with its loss mask on the environment spans instead (``disagreement_of_maps`` then counts
    them as its "scored" positions)."""
    env = env_positions(sample)
    mask = torch.zeros_like(train_sample.loss_mask)
    mask[1 : len(env) + 1] = env.to(mask.dtype)
    return replace(train_sample, loss_mask=mask)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
