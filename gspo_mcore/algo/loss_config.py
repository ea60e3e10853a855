"""The algorithm's configuration: which policy-loss variant, its clip range, the off-policy correction and the
regularisers. Plain validated values; the learner turns them into calls of :func:`gspo_mcore.algo.policy_loss`,
:func:`gspo_mcore.algo.off_policy_weights` and :func:`gspo_mcore.algo.regularizer_loss`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from gspo_mcore.algo.policy import VARIANTS, check_clip_range, check_sapo_tau
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
    """The policy loss. (Its temperature is the rollout's sampling temperature: ``StepSettings.temperature``.)"""

    REMOVED_KEYS: ClassVar[dict[str, str]] = {
        "temperature": "the policy's temperature is defined once, by rollout.sampling.temperature",
        "recompute_old_logprobs": "set rollout.old_logprobs (recompute or rollout)",
    }

    variant: Literal[VARIANTS] = "gspo"  # the names of algo.variants.LOSS_VARIANTS
    """``"gspo"`` (sequence ratio), ``"gspo_token"`` (GSPO-token), ``"grpo"`` (token ratios), ``"sapo"`` (soft
    gate on token ratios), ``"cispo"`` (clipped stop-gradient token weights) or ``"gmpo"`` (geometric mean of
    log-space-clipped token ratios); docs/gspo.md."""
    eps_low: float | None = None
    """Clip range; ``None``: the variant's paper default (``algo.DEFAULT_EPS``). GSPO, GSPO-token, GRPO: ratios in
    ``[1 - eps_low, 1 + eps_high]``; CISPO: the importance weight's bounds ``[1 - eps_low, 1 + eps_high]``
    (``eps_low`` <= 1; default 1: no lower bound, as the paper); GMPO: log-ratios in ``[-eps_low, eps_high]``
    (one range, as the authors': the two must be equal; default 0.4); SAPO: must stay unset (no clip)."""
    eps_high: float | None = None
    """The upper side of the clip range (see ``eps_low``); ``None``: the variant's paper default."""
    sapo_tau_pos: float = 1.0
    """SAPO's gate temperature for tokens of sequences with ``A > 0`` (> 0; the paper's 1.0)."""
    sapo_tau_neg: float = 1.05
    """SAPO's gate temperature for ``A <= 0`` (> 0; the paper's 1.05: negative-advantage gradients fade faster)."""
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
        if self.variant not in VARIANTS:  # before check_literals: name the valid variants by the YAML key
            raise ValueError(f"loss.variant must be one of {VARIANTS}, got {self.variant!r}")
        check_literals(self)
        check_clip_range(self.variant, self.eps_low, self.eps_high, prefix="loss.")
        check_sapo_tau(self.sapo_tau_pos, self.sapo_tau_neg, prefix="loss.")
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
