"""The algorithm layer: pure tensor functions (no host syncs in the loss path) and the loss's own small config
(:class:`LossConfig`), which the learner reads."""

from gspo_mcore.algo.advantages import group_advantages, zero_advantage_groups
from gspo_mcore.algo.loss_config import LossConfig, OffPolicyConfig
from gspo_mcore.algo.off_policy import off_policy_weights
from gspo_mcore.algo.policy import (
    DEFAULT_EPS,
    RATIO_LEVEL,
    SAPO_DEFAULT_TAU,
    VARIANTS,
    check_clip_range,
    check_sapo_tau,
    policy_loss,
)
from gspo_mcore.algo.regularizers import kl_per_token, regularizer_loss
from gspo_mcore.algo.variants import LOSS_VARIANTS

__all__ = [
    "DEFAULT_EPS",
    "LOSS_VARIANTS",
    "LossConfig",
    "OffPolicyConfig",
    "RATIO_LEVEL",
    "SAPO_DEFAULT_TAU",
    "VARIANTS",
    "check_clip_range",
    "check_sapo_tau",
    "group_advantages",
    "kl_per_token",
    "off_policy_weights",
    "policy_loss",
    "regularizer_loss",
    "zero_advantage_groups",
]
