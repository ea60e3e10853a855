"""The algorithm layer: pure tensor functions (no config objects, no host syncs in the loss path)."""

from gspo_mcore.algo.advantages import group_advantages, zero_advantage_groups
from gspo_mcore.algo.policy import DEFAULT_EPS, VARIANTS, policy_loss

__all__ = ["DEFAULT_EPS", "VARIANTS", "group_advantages", "policy_loss", "zero_advantage_groups"]
