"""The algorithm's configuration: which policy-loss variant, its clip range, the off-policy correction and the
regularisers. Plain validated values; the learner turns them into calls of :func:`gspo_mcore.algo.policy_loss`,
:func:`gspo_mcore.algo.off_policy_weights` and :func:`gspo_mcore.algo.regularizer_loss`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from gspo_mcore.config import check_literals


@dataclass(frozen=True, kw_only=True)
class OffPolicyConfig:
    """The decoupled off-policy correction (docs/loss.md): the clipped ratio is taken against the learner's
    recompute pi_prox, and a constant weight ``pi_prox / mu`` (length-normalised per sequence for the GSPO
    variants, per token for GRPO) corrects for the engine's behaviour policy mu."""

    mode: Literal["none", "tis", "mis"] = "none"
    """``none``: no weight (the plain objective); ``tis``: ``min(w, cap)``; ``mis``: samples (GRPO: tokens)
    with ``w`` outside ``[1/cap, cap]`` get no gradient. Needs ``rollout.old_logprobs: recompute``."""
    cap: float = 2.0
    """``C`` (> 1)."""

    def __post_init__(self):
        check_literals(self)
        if isinstance(self.cap, bool) or not (isinstance(self.cap, (int, float)) and math.isfinite(self.cap)):
            raise ValueError(f"loss.off_policy.cap must be a finite number > 1, got {self.cap!r}")
        if self.cap <= 1:
            raise ValueError(f"loss.off_policy.cap must be > 1 (the weights are kept in [1/cap, cap]), got {self.cap}")


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """The policy loss. (Its temperature is the rollout's sampling temperature: ``train_step(temperature=)``.)"""

    REMOVED_KEYS: ClassVar[dict[str, str]] = {
        "temperature": "the policy's temperature is defined once, by rollout.sampling.temperature",
        "recompute_old_logprobs": "set rollout.old_logprobs (recompute or rollout)",
    }

    variant: Literal["gspo", "gspo_token", "grpo"] = "gspo"
    """``"gspo"`` (sequence ratio), ``"gspo_token"`` (GSPO-token) or ``"grpo"`` (token ratios)."""
    eps_low: float | None = None
    """Clip range ``[1 - eps_low, 1 + eps_high]``; ``None``: the variant's paper default."""
    eps_high: float | None = None
    compute_entropy: bool = True
    """Report the mean entropy of the counted tokens."""
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)
    """The train/inference (and staleness) correction; off by default."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the frozen initial policy (0: none, as in the paper)."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """Per-token KL estimator: ``k1 = logp - ref``, ``k3 = exp(ref - logp) - (ref - logp) - 1``."""
    kl_metric: bool = False
    """Report ``kl`` (to the initial policy) even when ``kl_coef`` is 0 (costs the reference forward)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (the loss subtracts ``entropy_coef`` x the sequence-mean entropy)."""
    fused_lm_head: bool = False
    """Compute the log-probs from the last hidden states and the output weight in vocabulary chunks
    (:func:`gspo_mcore.ops.linear_token_logprobs`): the ``[T, V/TP]`` logits and their gradient are never
    built (the output layer's matmul is recomputed per chunk in backward)."""
    fused_lm_head_chunk: int = 4096
    """Vocabulary columns per chunk of the fused LM head: at most ``[T, chunk]`` logits exist at once."""

    def __post_init__(self):
        if self.fused_lm_head_chunk < 1:
            raise ValueError(f"loss.fused_lm_head_chunk must be >= 1, got {self.fused_lm_head_chunk}")
        check_literals(self)
        for key in ("kl_coef", "entropy_coef"):
            v = getattr(self, key)
            if isinstance(v, bool) or not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"loss.{key} must be a finite number >= 0, got {v!r}")

    @property
    def uses_reference(self) -> bool:
        """Whether the reference policy's log-probs are needed (KL penalty or metric)."""
        return self.kl_coef > 0 or self.kl_metric

    @property
    def needs_entropy(self) -> bool:
        return self.compute_entropy or self.entropy_coef > 0
