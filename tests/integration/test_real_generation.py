"""Generation through the project's SGLang client against a real SGLang 0.5.23 server, and log-prob parity
with the Megatron learner on the same weights.

The tolerance, ``sglang_cpu.LOGPROB_TOL`` (1.5e-5 nats), and why: see sglang_cpu.py.
"""

from __future__ import annotations

import pytest
from sglang_cpu import LOGPROB_TOL, PROMPTS, check_samples

pytestmark = pytest.mark.sglang


CASES = {
    "t1.0": dict(temperature=1.0, max_new_tokens=24, ignore_eos=True),
    "t0.7": dict(temperature=0.7, max_new_tokens=24),
    "t0.8_top_p0.9_top_k20": dict(temperature=0.8, top_p=0.9, top_k=20, max_new_tokens=24),
    "greedy": dict(temperature=0.0, max_new_tokens=24),
    "seeded_t1.3": dict(temperature=1.3, max_new_tokens=16, seed=11),
}
N = 4


def test_n_samples_logprobs_match_learner(server, learner, figures):
    steps = []
    for name, params in CASES.items():
        steps += [
            {"op": "generate", "name": name, "prompts": PROMPTS, "n": N, "params": params},
            {"op": "score", "name": name},
        ]
    report = learner({"hf_dir": server.base_dir, "urls": [server.url], "steps": steps}, what="parity")

    for name, params in CASES.items():
        gen, score = report["generate"][name], report["score"][name]
        check_samples(gen, params, N, PROMPTS, version=0)
        figures(f"parity max |logp_sglang - logp_learner|, {name}", score["max_abs_diff"])
        figures(f"parity mean |logp_sglang - logp_learner|, {name}", score["mean_abs_diff"])
        assert score["num_tokens"] == sum(len(s["response_ids"]) for g in gen["groups"] for s in g)
        assert score["max_abs_diff"] <= LOGPROB_TOL, (
            f"{name}: SGLang's log-probs differ from the learner's by up to {score['max_abs_diff']:.3g} "
            f"(mean {score['mean_abs_diff']:.3g}) over {score['num_tokens']} tokens"
        )
        # the check has teeth: the log-probs span a real range, not a near-uniform distribution
        assert score["min_logprob"] < -2.0

    # n > 1 really samples n times (groups differ) except when greedy (all n identical)
    sampled = report["generate"]["t1.0"]["groups"]
    assert any(len({tuple(s["response_ids"]) for s in g}) > 1 for g in sampled)
    for g in report["generate"]["greedy"]["groups"]:
        assert len({tuple(s["response_ids"]) for s in g}) == 1
