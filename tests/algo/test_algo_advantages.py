"""group_advantages / zero_advantage_groups: A_i = (r_i - mean_j r_j) / (std_j r_j + eps) per group of G."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from gspo_mcore.algo import group_advantages, zero_advantage_groups


def hand(rewards, G, normalize_std=True, eps=1e-6):
    """The spec with Python's statistics module (sample std, as torch.std / TRL / verl)."""
    out = []
    for g in range(0, len(rewards), G):
        grp = rewards[g : g + G]
        mu = statistics.fmean(grp)
        if len(set(grp)) == 1:
            out += [0.0] * G
            continue
        sd = statistics.stdev(grp)
        out += [(r - mu) / (sd + eps) if normalize_std else r - mu for r in grp]
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("G", [2, 4, 8])
def test_values_match_hand_computation(G, normalize_std):
    """Each group is centred on its own mean and (optionally) scaled by its own sample std + eps;
    groups are consecutive runs of G rewards."""
    rewards = torch.randn(3 * G).tolist()
    rewards[G : 2 * G] = [1.0] * (G // 2) + [0.0] * (G - G // 2)  # a binary (verifiable-reward) group
    got = group_advantages(torch.tensor(rewards), G, normalize_std=normalize_std)
    assert got.dtype == torch.float32 and got.shape == (3 * G,)
    torch.testing.assert_close(got.double(), hand(rewards, G, normalize_std), rtol=1e-5, atol=1e-6)
    # each group's advantages sum to 0
    assert bool((got.view(3, G).sum(1).abs() < 1e-5).all())


def test_binary_rewards_by_hand():
    """rewards [1, 0, 0, 0]: mean 1/4, sample std 1/2: A = [1.5, -0.5, -0.5, -0.5] (eps = 0)."""
    got = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, eps=0.0)
    torch.testing.assert_close(got, torch.tensor([1.5, -0.5, -0.5, -0.5]))
    got = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, eps=0.5)
    torch.testing.assert_close(got, torch.tensor([0.75, -0.25, -0.25, -0.25]))


@pytest.mark.parametrize("eps", [1e-6, 0.0])
@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, 0.3, 0.7, -2.5, 1 / 3])
@pytest.mark.parametrize("G", [2, 7, 8, 16])
def test_all_equal_group_gives_exactly_zero(G, value, eps):
    """A group whose rewards are all equal has no signal: A = 0 exactly, even when the float mean of G
    equal rewards is not the reward itself (8 x 0.1 in float32) and even with eps = 0 (no 0/0)."""
    rewards = torch.cat([torch.full((G,), value), torch.arange(G, dtype=torch.float32)])
    got = group_advantages(rewards, G, eps=eps)
    assert torch.equal(got[:G], torch.zeros(G))
    assert torch.isfinite(got).all() and got[G:].abs().max() > 0.5
    assert zero_advantage_groups(rewards, G).tolist() == [True, False]


def test_input_dtypes():
    """Integer / bool / float64 rewards are accepted and give float32 advantages."""
    for r in (
        torch.tensor([1, 0, 1, 1]),
        torch.tensor([True, False, True, True]),
        torch.tensor([1.0, 0, 1, 1]).double(),
    ):
        got = group_advantages(r, 4)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), hand([1.0, 0.0, 1.0, 1.0], 4), rtol=1e-5, atol=1e-6)


BAD = [
    ("group_size-1", (torch.zeros(4), 1), {}, ValueError, r"group_size must be an int >= 2"),
    ("group_size-0", (torch.zeros(4), 0), {}, ValueError, r"group_size must be an int >= 2"),
    ("group_size-negative", (torch.zeros(4), -2), {}, ValueError, r"group_size must be an int >= 2"),
    ("group_size-float", (torch.zeros(4), 2.0), {}, ValueError, r"group_size must be an int >= 2"),
    ("group_size-bool", (torch.zeros(4), True), {}, ValueError, r"group_size must be an int >= 2"),
    ("not-a-multiple", (torch.zeros(6), 4), {}, ValueError, r"rewards has 6 entries, not a multiple of group_size=4"),
    ("rewards-2d", (torch.zeros(2, 4), 4), {}, ValueError, r"rewards must be 1-D"),
    ("rewards-list", ([0.0, 1.0], 2), {}, TypeError, r"rewards must be a torch.Tensor"),
    ("eps-negative", (torch.zeros(4), 2), {"eps": -1e-3}, ValueError, r"eps must be a finite number >= 0"),
    ("eps-nan", (torch.zeros(4), 2), {"eps": math.nan}, ValueError, r"eps must be a finite number >= 0"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input(case):
    """Bad group sizes and shapes raise errors naming the argument."""
    _, args, kw, exc, match = case
    with pytest.raises(exc, match=match):
        group_advantages(*args, **kw)
    if "eps" not in kw:
        with pytest.raises(exc, match=match):
            zero_advantage_groups(*args)
