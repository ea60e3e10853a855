"""Multi-turn episodes on real SGLang (``rollout.env`` with ``rollout.engine: sglang``).

The episode driver (:class:`gspo_mcore.rollout.episode.EpisodeDriver`, the same as in-process) runs 3-turn episodes
of a small echo environment (``learner_worker.EchoEnv``: each observation depends on the turn's action) over
:meth:`SGLangEngine.generate_turns`, each turn a ``/generate`` request whose ``input_ids`` are the whole episode so
far. Checked: the sample's ids are exactly the prompt, then what SGLang returned and the environment spans the driver
appended, in order (nothing decoded and re-tokenised); the environment spans are masked out (mask 0, log-prob 0);
every policy token's SGLang log-prob equals the learner's forward over the whole episode within ``LOGPROB_TOL``.
"""

from __future__ import annotations

import pytest
from sglang_cpu import LOGPROB_TOL

pytestmark = pytest.mark.sglang

ROWS = [{"prompt": p} for p in ("rev:407>", "add:3+4=", "hello world:")]
N, TURNS = 2, 3


@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_three_turn_episodes_are_token_exact_and_match_the_learner(server, learner, figures, tau):
    params = dict(temperature=tau, max_new_tokens=8, seed=3)
    steps = [
        {
            "op": "episodes",
            "name": "ep",
            "rows": ROWS,
            "n": N,
            "params": params,
            "max_turns": TURNS,
            "max_total_tokens": 512,
        }
    ]
    report = learner({"hf_dir": server.base_dir, "urls": [server.url], "steps": steps}, what=f"episodes t{tau}")
    ep = report["episodes"]["ep"]
    figures(f"SGLang episodes (t={tau}): max |logp_sglang - logp_learner| on policy tokens", ep["max_abs_diff"])
    figures(f"SGLang episodes (t={tau}): seconds for {len(ROWS) * N} 3-turn episodes", ep["seconds"])
    samples, turn_log = ep["samples"], ep["turn_log"]
    assert len(samples) == len(ROWS) * N == len(turn_log)
    for k, (s, log) in enumerate(zip(samples, turn_log)):
        assert s["turns"] == TURNS and s["end"] == "max_turns", (k, s["turns"], s["end"])
        # policy, env, policy, env, policy: the driver appended exactly what SGLang returned and what the env gave
        assert [kind for kind, _ in log] == ["policy", "env"] * (TURNS - 1) + ["policy"], log
        assert s["response_ids"] == [t for _, ids in log for t in ids], k
        assert s["response_mask"] == [int(kind == "policy") for kind, ids in log for _ in ids], k
        env_lps = [lp for lp, m in zip(s["response_logprobs"], s["response_mask"]) if not m]
        assert env_lps and all(lp == 0.0 for lp in env_lps), k
        assert s["weight_version"] == 0 and s["token_versions"] is None
    assert ep["env_tokens"] > 0 and ep["policy_tokens"] > 0
    assert ep["max_abs_diff"] <= LOGPROB_TOL, ep["max_abs_diff"]
