"""Turn-level length control: reward terms per policy token, per turn and per tool call.

DAPO's overlong penalty (``rollout.overlong_buffer``) only acts on a response near its length limit. An agent that
loops on a tool, takes turns it does not need, or pads its answers stays far from that limit; these terms charge it
for every policy token, turn or tool call (prime-rl's token and turn penalties), or, with ``relative_to_group``,
only for what it spends beyond its group's mean (NeMo-RL's group length penalty), so a group whose episodes are
equally long pays nothing and a prompt that needs three calls is not charged against one that needs one::

    absolute:        p_i = -c * x_i
    group-relative:  p_i = -c * max(0, x_i - mean_{j in group(i)} x_j)

for ``x`` the episode's policy tokens, policy turns or tool calls and ``c`` its coefficient. The terms are added
to the task reward before the group advantages are taken (like the overlong penalty); the task reward itself
(``reward_mean``, pass@k) is unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TERMS = ("token", "turn", "tool_call")


@dataclass(frozen=True, kw_only=True)
class LengthPenaltyConfig:
    """``rollout.length_penalty``: the size of each penalty (subtracted from the reward, so >= 0); all 0: off."""

    per_token: float = 0.0
    """Subtracted per policy token (a multi-turn episode's sampled tokens, the environment's not counted)."""
    per_turn: float = 0.0
    """Subtracted per policy turn (a single-turn response is one turn)."""
    per_tool_call: float = 0.0
    """Subtracted per tool call (as the environment counted them; 0 for a single-turn response)."""
    relative_to_group: bool = False
    """Charge only the excess over the mean of the episode's group (episodes no longer than their siblings pay 0)."""

    def __post_init__(self):
        for name in ("per_token", "per_turn", "per_tool_call"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"rollout.length_penalty.{name} must be a finite number, got {v!r}")
            if v < 0:
                raise ValueError(
                    f"rollout.length_penalty.{name} must be >= 0 (the size of a penalty, subtracted from the "
                    f"reward; a negative one would pay for length), got {v}"
                )
        if not isinstance(self.relative_to_group, bool):
            raise ValueError(
                f"rollout.length_penalty.relative_to_group must be true or false, got {self.relative_to_group!r}"
            )

    @property
    def enabled(self) -> bool:
        return any(c > 0 for c in self.coefficients.values())

    @property
    def coefficients(self) -> dict[str, float]:
        return {"token": self.per_token, "turn": self.per_turn, "tool_call": self.per_tool_call}


def length_penalties(
    counts: dict[str, torch.Tensor], group_size: int, config: LengthPenaltyConfig
) -> dict[str, torch.Tensor]:
    """Each term's penalty per sample, float64 ``[B]`` (``<= 0``), for ``counts`` ``{"token", "turn", "tool_call"}``
    each ``[B]`` with the ``group_size`` samples of a prompt next to each other (see the module docstring)."""
    out = {}
    for name, c in config.coefficients.items():
        x = counts[name].to(torch.float64)  # (B,)
        if x.dim() != 1 or x.shape[0] % group_size:
            raise ValueError(
                f"length_penalties: counts[{name!r}] of shape {tuple(x.shape)} is not [groups * {group_size}]"
            )
        if config.relative_to_group:
            g = x.view(-1, group_size)  # (num_groups, G)
            x = (g - g.mean(dim=1, keepdim=True)).clamp(min=0).reshape(-1)
        out[name] = -c * x
    return out
