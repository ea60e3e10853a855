"""Turn-level length control (gspo_mcore.algo.length_penalty): the absolute and group-relative penalties in
float64 against a direct evaluation of the formula, the batch's counts per episode, the metrics, and the refused
settings."""

import random

import pytest
import torch

from gspo_mcore.algo.length_penalty import LengthPenaltyConfig, length_penalties
from gspo_mcore.config import from_dict
from gspo_mcore.rollout.turns import EpisodeStats
from gspo_mcore.rollout.types import Sample
from gspo_mcore.trainer.batch import episode_counts, length_penalty_metrics, length_penalty_terms
from gspo_mcore.trainer.config import RolloutConfig


def _reference(xs, G, c, relative):
    """The module docstring's formula, one sample at a time in Python floats (IEEE doubles)."""
    out = []
    for g in range(0, len(xs), G):
        group = xs[g : g + G]
        mean = sum(group) / G
        out += [-c * (max(0.0, x - mean) if relative else x) for x in group]
    return out


@pytest.mark.parametrize("relative", [False, True])
def test_penalties_match_the_formula_in_float64(relative):
    rng = random.Random(0)
    G, n = 4, 24
    counts = {
        "token": torch.tensor([rng.randint(1, 300) for _ in range(n)]),
        "turn": torch.tensor([rng.randint(1, 5) for _ in range(n)]),
        "tool_call": torch.tensor([rng.randint(0, 4) for _ in range(n)]),
    }
    cfg = LengthPenaltyConfig(per_token=1e-3, per_turn=0.05, per_tool_call=0.1, relative_to_group=relative)
    terms = length_penalties(counts, G, cfg)
    for name, c in cfg.coefficients.items():
        assert terms[name].dtype == torch.float64
        want = _reference([float(x) for x in counts[name].tolist()], G, c, relative)
        torch.testing.assert_close(terms[name], torch.tensor(want, dtype=torch.float64), rtol=1e-15, atol=1e-15)
        assert (terms[name] <= 0).all()


def test_group_relative_charges_only_the_longer_than_siblings():
    cfg = LengthPenaltyConfig(per_tool_call=0.5, relative_to_group=True)
    calls = torch.tensor([1, 1, 1, 1, 1, 2, 3, 6])  # an equal group; a group with mean 3
    t = length_penalties({"token": calls, "turn": calls, "tool_call": calls}, 4, cfg)
    assert t["tool_call"].tolist() == [0, 0, 0, 0, 0, 0, 0, -1.5]
    assert t["token"].abs().sum() == 0  # coefficient 0
    shifted = length_penalties({k: calls + 100 for k in ("token", "turn", "tool_call")}, 4, cfg)
    assert torch.equal(shifted["tool_call"], t["tool_call"])  # only the spread within a group counts


def _episode(j, turns, calls, tokens):
    stats = EpisodeStats(turns=turns, end="done", tool_calls=calls, policy_tokens=tokens, final_turn=(7,))
    return Sample(
        prompt_index=0,
        sample_index=j,
        prompt_ids=(1,),
        response_ids=(5,) * (tokens + 2),  # 2 environment tokens, not the policy's
        response_logprobs=(0.0,) * (tokens + 2),
        finish_reason="stop",
        weight_version=0,
        episode=stats,
    )


def test_batch_counts_policy_tokens_turns_and_calls_and_reports_each_term():
    groups = [[_episode(0, 2, 1, 10), _episode(1, 3, 2, 20)]]
    counts = episode_counts(groups)
    assert {k: v.tolist() for k, v in counts.items()} == {"token": [10, 20], "turn": [2, 3], "tool_call": [1, 2]}
    single = Sample(
        prompt_index=0,
        sample_index=0,
        prompt_ids=(1,),
        response_ids=(4, 4, 4),
        response_logprobs=(0.0,) * 3,
        finish_reason="stop",
        weight_version=0,
    )
    assert [v.tolist() for v in episode_counts([[single]]).values()] == [[3], [1], [0]]
    assert length_penalty_terms(groups, 2, LengthPenaltyConfig()) == {}  # off by default
    terms = length_penalty_terms(groups, 2, LengthPenaltyConfig(per_turn=0.25, relative_to_group=True))
    m = length_penalty_metrics(terms)
    assert m["length_penalty/turn_mean"] == -0.0625 and m["length_penalty/total_mean"] == -0.0625
    assert m["length_penalty/charged_fraction"] == 0.5


@pytest.mark.parametrize("key", ["per_token", "per_turn", "per_tool_call"])
def test_a_wrong_sign_is_refused_naming_the_key(key):
    with pytest.raises(ValueError, match=rf"rollout.length_penalty.{key} must be >= 0"):
        from_dict(RolloutConfig, {"length_penalty": {key: -0.01}})
    with pytest.raises(ValueError, match=rf"rollout.length_penalty.{key} must be a finite"):
        LengthPenaltyConfig(**{key: float("inf")})
