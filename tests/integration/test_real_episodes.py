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


TAUS = (1.0, 0.7)


def test_three_turn_episodes_are_token_exact_and_match_the_learner(server, learner, figures):
    steps = [
        {
            "op": "episodes",
            "name": f"t{tau}",
            "rows": ROWS,
            "n": N,
            "params": dict(temperature=tau, max_new_tokens=8, seed=3),
            "max_turns": TURNS,
            "max_total_tokens": 512,
        }
        for tau in TAUS
    ]
    report = learner({"hf_dir": server.base_dir, "urls": [server.url], "steps": steps}, what="episodes")
    for tau in TAUS:
        _check_episodes(report["episodes"][f"t{tau}"], tau, figures)


def _check_episodes(ep: dict, tau: float, figures) -> None:
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
    assert ep["max_abs_diff"] <= LOGPROB_TOL, (tau, ep["max_abs_diff"])


def test_tiny_gspo_run_with_episodes_on_sglang(server, tmp_path, figures):
    """The trainer end to end with ``rollout.env`` on SGLang (``SGLangAgentRollout``): 2 steps of the tiny job with
    2-turn episodes (examples/agent_tiny/env.py), 2 ranks, weights pushed from disk in float32 after every step.
    The learner's recompute of every policy token matches SGLang's log-probs (``logprob_mismatch`` at the parity
    level on both steps: the second step's episodes ran on the weights of the first), and the episode metrics
    count 2 turns per episode with environment tokens masked in."""
    from test_real_gspo_run import _run_tiny

    overrides = {
        "rollout": {
            "env": "examples.agent_tiny.env:TwoTurns",
            "env_kwargs": {"hint": " ok ", "bonus": 0.25},
            "episode": {"max_turns": 3, "max_total_tokens": 96},
        },
        "eval": {"datasets": []},
    }
    what = "tiny GSPO run, 2 steps, 2-turn episodes on SGLang (s)"
    rows = _run_tiny(server, tmp_path, figures, what, "disk", steps=2, overrides=overrides)
    for r in rows:
        assert r["episode_turns_mean"] == 2.0 and r["episode_end_done"] == 1.0, r
        assert r["episode_env_tokens_mean"] > 0 and r["episode_policy_tokens_mean"] > 0
        figures("episodes on SGLang: logprob_mismatch, worst step", r["logprob_mismatch"])
        assert r["logprob_mismatch"] < LOGPROB_TOL, (r["step"], r["logprob_mismatch"])
