"""The algorithm layer: pure tensor functions (no host syncs in the loss path) and the loss's own small config
(:class:`LossConfig`), which the learner reads."""

from gspo_mcore.algo.advantages import group_advantages, zero_advantage_groups
from gspo_mcore.algo.loss_config import LossConfig, OffPolicyConfig
from gspo_mcore.algo.off_policy import off_policy_weights
from gspo_mcore.algo.policy import DEFAULT_EPS, VARIANTS, policy_loss
from gspo_mcore.algo.regularizers import kl_per_token, regularizer_loss

__all__ = [
    "DEFAULT_EPS",
    "LossConfig",
    "OffPolicyConfig",
    "VARIANTS",
    "group_advantages",
    "kl_per_token",
    "off_policy_weights",
    "policy_loss",
    "regularizer_loss",
    "zero_advantage_groups",
]
