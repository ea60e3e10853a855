"""Group-relative advantages (as in GRPO and GSPO)."""

from __future__ import annotations

import math

import torch

from gspo_mcore.ops._checks import check_tensor


def group_advantages(rewards: torch.Tensor, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6):
    """``A_i = (r_i - mean_group r) / (std_group r + eps)`` for consecutive groups of ``group_size``.

    ``rewards`` is ``[B]`` with the ``G = group_size`` samples of each prompt next to each other. The
    standard deviation is the sample one (Bessel-corrected, ``torch.std``'s default, as in TRL and verl).
    A group whose rewards are all equal gets ``A = 0``. Returns float32 ``[B]``.
    """
    _check_groups(rewards, group_size)
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    r = rewards.float().view(-1, group_size)  # (num_groups, G)
    centred = r - r.mean(dim=1, keepdim=True)
    if normalize_std:
        centred = centred / (r.std(dim=1, keepdim=True) + eps)
    # The float mean of G equal rewards need not equal them (8 x 0.1 in float32 leaves ~1e-9), and
    # dividing that residue by a std of the same size gives O(1) advantages; all-equal groups are 0.
    same = (r == r[:, :1]).all(dim=1, keepdim=True)  # (num_groups, 1)
    return torch.where(same, 0.0, centred).reshape(-1)


def zero_advantage_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Boolean ``[num_groups]``: groups whose rewards are all equal (no learning signal)."""
    _check_groups(rewards, group_size)
    r = rewards.float().view(-1, group_size)
    return (r == r[:, :1]).all(dim=1)


def _check_groups(rewards, group_size):
    check_tensor("rewards", rewards, dim=1)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size must be an int >= 2 (samples per prompt), got {group_size!r}")
    if rewards.shape[0] % group_size != 0:
        raise ValueError(f"rewards has {rewards.shape[0]} entries, not a multiple of group_size={group_size}")
