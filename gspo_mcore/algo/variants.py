"""The policy-loss variants: one small term function each, and the table that names them (docs/gspo.md).

A term function reads the shared inputs (:class:`TermInputs`: log-ratios, counts, advantages, the clip range,
computed once by :func:`gspo_mcore.algo.policy_loss`) and returns its :class:`Terms`: the loss term of each
token (summed per sequence by the caller) or of each sequence, what it clipped and the ratio its metrics
describe. Everything else (input checks, masking, the off-policy weights, the context-parallel sums, the
normaliser, the metrics) is :func:`~gspo_mcore.algo.policy_loss`'s, written once; what differs between
variants beyond the term (ratio level, normaliser, per-token advantages, clip-range rules) is a field of the
variant's :class:`Variant` row in :data:`LOSS_VARIANTS`.

Adding a variant: one term function here, one row in :data:`LOSS_VARIANTS`, one float64 reference in
:mod:`.reference` (tests hold the two together), one entry in docs/gspo.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

import torch

from gspo_mcore import ops

SAPO_GATE_NEAR_ZERO = 0.1
"""A SAPO token counts in ``gate_near_zero_fraction`` when its gradient gate ``4 p (1 - p)`` is below this."""


@dataclass(frozen=True, kw_only=True)
class TermInputs:
    """What every term function may read; computed once per call, the costlier parts only when first read.

    ``B`` sequences packed into ``T`` tokens; per-sequence values are complete (all-reduced over the
    context-parallel group), per-token values are this rank's part."""

    logp: torch.Tensor
    """``[T]`` the current policy's log-probs as given (differentiable, any float dtype)."""
    log_ratio: torch.Tensor
    """``[T]`` float32 ``logp - sg[old_logp]`` (differentiable; masked-out tokens may hold anything)."""
    counted: torch.Tensor
    """``[T]`` bool: the token counts (``loss_mask`` 1)."""
    mask: torch.Tensor
    """``[T]`` float32 ``loss_mask``."""
    cu_seqlens: torch.Tensor
    advantages: torch.Tensor
    """float32, ``[B]``, or ``[T]`` when :attr:`per_token_advantages`."""
    per_token_advantages: bool
    seq_log_ratio: torch.Tensor
    """``[B]`` the summed log-ratio of each sequence's counted tokens (differentiable)."""
    counts: torch.Tensor
    """``[B]`` counted tokens of each sequence."""
    poison: torch.Tensor
    """``[B]`` NaN for a sequence with a non-finite counted log-ratio, else 0 (constant)."""
    eps_low: float | None
    eps_high: float | None
    tau_pos: float
    tau_neg: float
    cp_group: object = None

    @property
    def num_tokens(self) -> int:
        return self.logp.shape[0]

    @cached_property
    def valid(self) -> torch.Tensor:
        """``[B]`` bool: the sequence has a counted token."""
        return self.counts > 0

    @cached_property
    def token_advantages(self) -> torch.Tensor:
        """``[T]`` each counted token's advantage (a ``[B]`` advantage broadcast over its sequence), 0 elsewhere."""
        adv = (
            self.advantages if self.per_token_advantages else expand(self.advantages, self.cu_seqlens, self.num_tokens)
        )
        return torch.where(self.counted, adv, 0.0)

    @cached_property
    def token_ratio(self) -> torch.Tensor:
        """``[T]`` token ratios ``exp(logp - old_logp)`` (1 on masked-out tokens), differentiable."""
        return torch.exp(torch.where(self.counted, self.log_ratio, 0.0))

    @cached_property
    def sequence_ratio(self) -> torch.Tensor:
        """``[B]`` length-normalised sequence ratios ``exp(mean_t(logp - old_logp))`` (1 when nothing counts),
        constant."""
        s = torch.exp(self.seq_log_ratio.detach() / self.counts.clamp(min=1.0))
        return torch.where(self.valid, s, 1.0)

    def sums(self, *token_values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each ``[T]`` value summed over each sequence's counted tokens: ``[B]`` each, complete over the
        context-parallel group (one all-reduce for all of them)."""
        if not token_values:
            return ()
        parts = [ops.segment_sum(v, self.cu_seqlens, self.mask) for v in token_values]
        return tuple(ops.all_reduce_sum(*parts, group=self.cp_group))


@dataclass(kw_only=True)
class Terms:
    """A term function's result: exactly one of ``token`` and ``sequence``."""

    token: torch.Tensor | None = None
    """``[T]`` each token's loss term; the caller weights, sums and normalises them per sequence."""
    sequence: torch.Tensor | None = None
    """``[B]`` each sequence's loss term, when it is not a sum of token terms."""
    clipped: torch.Tensor
    """With ``token``: ``[T]`` 1.0 where a token's term is clipped; with ``sequence``: ``[B]`` the number of
    clipped counted tokens of each sequence."""
    ratio: torch.Tensor
    """The ratio the ``ratio_*`` metrics describe: ``[B]`` for a sequence-level variant, ``[T]`` for a
    token-level one (:attr:`Variant.level`)."""
    token_means: dict[str, torch.Tensor] = field(default_factory=dict)
    """Extra metrics: ``name -> [T]`` values reported as their mean over the counted tokens."""


@dataclass(frozen=True, kw_only=True)
class ClipRange:
    """A variant's clip range ``(eps_low, eps_high)``: the papers' default and the rules a given one follows
    (checked by :func:`gspo_mcore.algo.check_clip_range`)."""

    default: tuple[float, float]
    eps_low_max: float | None = 1.0
    """``eps_low`` must stay below this (``None``: no limit)."""
    eps_low_max_allowed: bool = False
    """``eps_low`` may equal :attr:`eps_low_max`."""
    eps_low_rule: str = "the lower clip bound 1 - eps_low must stay positive"
    """Why the limit, for the error message."""
    symmetric: str | None = None
    """Set: the variant has one clip range, ``eps_low`` must equal ``eps_high``; the text says why."""
    no_op_at: float | None = None
    """Warn when ``max(eps_low, eps_high)`` reaches this (a range so wide that clipping does nothing)."""


@dataclass(frozen=True, kw_only=True)
class Variant:
    """One row of :data:`LOSS_VARIANTS`."""

    term: Callable[[TermInputs], Terms]
    level: Literal["sequence", "token"]
    """Whether the ratio (its off-policy weight: ``[B]`` or ``[T]``, and its ``ratio_*`` metrics) is per
    sequence or per token."""
    clip: ClipRange | str
    """The clip range, or a text saying why there is none and what to set instead (``eps_low`` / ``eps_high``
    are then refused; ``{prefix}`` in it becomes the config key's prefix)."""
    normaliser: Literal["sequences", "tokens"] = "sequences"
    """``sequences``: the loss is ``(1/N) sum_i`` of each sequence's term (token terms: their mean over the
    sequence); ``tokens``: ``(1/M) sum`` of all token terms, ``M`` the counted tokens (token terms only)."""
    token_advantages: bool = False
    """Advantages may also be per token (``[T]``)."""


def gspo(x: TermInputs) -> Terms:
    """``-min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)`` per sequence (the compiled sequence op)."""
    term, ratio, clipped, _ = ops.gspo_sequence_terms(
        x.seq_log_ratio + x.poison, x.counts, x.advantages, x.eps_low, x.eps_high
    )
    return Terms(sequence=term, clipped=clipped * x.counts, ratio=ratio)


def gspo_token(x: TermInputs) -> Terms:
    """GRPO's clipped token term with the token ratio ``s_i,t = sg[s_i] pi(y_t) / sg[pi(y_t)]``: value ``s_i``,
    gradient ``s_i grad logp_t``."""
    own = torch.where(x.counted, x.logp.float() - x.logp.detach().float(), 0.0)  # (T,) value 0
    ratio_tok = expand(x.sequence_ratio, x.cu_seqlens, x.num_tokens) * torch.exp(own)
    term, clipped = clipped_token_terms(ratio_tok, x.token_advantages, x.eps_low, x.eps_high)
    return Terms(token=term, clipped=clipped, ratio=x.sequence_ratio)


def grpo(x: TermInputs) -> Terms:
    """``-min(r_t A_i, clip(r_t, 1 - eps_low, 1 + eps_high) A_i)`` per token."""
    term, clipped = clipped_token_terms(x.token_ratio, x.token_advantages, x.eps_low, x.eps_high)
    return Terms(token=term, clipped=clipped, ratio=x.token_ratio)


def sapo(x: TermInputs) -> Terms:
    """``-f(r_t) A_i`` per token with SAPO's gate ``f(r) = (4 / tau) sigmoid(tau (r - 1))``, ``tau`` by the sign
    of ``A``; reports the gradient gate ``4 p (1 - p)`` (``d f / d r``, 1 at ``r = 1``)."""
    ratio, adv = x.token_ratio, x.token_advantages
    # float64 for the gate alone (elementwise over T): autograd's sigmoid slope p (1 - p) loses ~1e-4 of its
    # relative accuracy in float32 where the gate nearly shuts (p ~ 0.9996), exactly the tokens SAPO is about
    tau = torch.where(adv > 0, x.tau_pos, x.tau_neg).double()  # (T,)
    p = torch.sigmoid(tau * (ratio.double() - 1.0))
    term = (-(4.0 / tau) * p * adv.double()).float()
    q = p.detach()
    gate = (4.0 * q * torch.sigmoid(-tau * (ratio.detach().double() - 1.0))).float()  # 4 p (1 - p), 1 - p exact
    return Terms(
        token=term,
        clipped=torch.zeros_like(term),
        ratio=ratio,
        token_means={"gate_mean": gate, "gate_near_zero_fraction": (gate < SAPO_GATE_NEAR_ZERO).float()},
    )


def cispo(x: TermInputs) -> Terms:
    """MiniMax-M1's ``-sg[clip(r_t, 1 - eps_low, 1 + eps_high)] A_i log pi_t`` per token: its value is the
    paper's objective, its gradient ``-r_hat A grad logp``; clipped: the weight was."""
    lo, hi = 1.0 - x.eps_low, 1.0 + x.eps_high
    r = x.token_ratio.detach()
    clipped = x.counted & ((r > hi) | (r < lo))
    # log pi written as sg[log pi] + (pi / sg[pi] - 1): the value log pi, the gradient of log pi, and a
    # non-finite log pi makes its token's gradient NaN (as pi / sg[pi] alone did), never silently finite
    own = torch.where(x.counted, x.logp.float() - x.logp.detach().float(), 0.0)  # (T,) value 0, gradient 1
    log_pi = torch.where(x.counted, x.logp.detach().float(), 0.0) + (torch.exp(own) - 1.0)
    term = -(r.clamp(lo, hi) * x.token_advantages) * log_pi
    return Terms(token=term, clipped=clipped.float(), ratio=x.token_ratio)


def gmpo(x: TermInputs) -> Terms:
    """``-A_i exp(mean_t d~_t)``: the geometric mean of the token ratios, each log-ratio clipped one-sided by the
    advantage's sign before the mean (``d <= eps`` for ``A > 0``, ``d >= -eps`` for ``A < 0``; one ``eps``,
    the authors' form: :attr:`ClipRange.symmetric`)."""
    adv_tok = x.token_advantages
    d = torch.where(x.counted, x.log_ratio, 0.0)  # (T,)
    tok_clipped = ((adv_tok > 0) & (d > x.eps_high)) | ((adv_tok < 0) & (d < -x.eps_low))
    d_kept = torch.where(tok_clipped, d.detach().clamp(-x.eps_low, x.eps_high), d)  # clipped: constant
    clipped_sum, seq_clipped = x.sums(d_kept, tok_clipped.float())  # (B,) each
    geo = torch.exp(clipped_sum / x.counts.clamp(min=1.0))  # the clipped geometric-mean ratio
    return Terms(sequence=-x.advantages * geo, clipped=seq_clipped, ratio=x.sequence_ratio)


_RATIO_CLIP = dict(eps_low_max=1.0, eps_low_rule="the lower clip bound 1 - eps_low must stay positive")
_GSPO_CLIP = ClipRange(default=(3e-4, 4e-4), no_op_at=0.05, **_RATIO_CLIP)

LOSS_VARIANTS: dict[str, Variant] = {
    "gspo": Variant(term=gspo, level="sequence", clip=_GSPO_CLIP),
    "gspo_token": Variant(term=gspo_token, level="sequence", clip=_GSPO_CLIP, token_advantages=True),
    "grpo": Variant(term=grpo, level="token", clip=ClipRange(default=(0.2, 0.27), **_RATIO_CLIP)),
    "sapo": Variant(
        term=sapo, level="token", clip="a soft gate; set {prefix}sapo_tau_pos / {prefix}sapo_tau_neg instead"
    ),
    "cispo": Variant(
        term=cispo,
        level="token",
        # importance-weight bounds [1 - eps_low, 1 + eps_high] = [0, 4]: the paper sets no lower bound
        clip=ClipRange(
            default=(1.0, 3.0),
            eps_low_max_allowed=True,
            eps_low_rule="the importance weight's lower bound 1 - eps_low must stay >= 0; 1 means no lower "
            "bound, the paper's choice",
        ),
        normaliser="tokens",
    ),
    "gmpo": Variant(
        term=gmpo,
        level="sequence",
        # log space: token ratios kept within [exp(-0.4), exp(0.4)]
        clip=ClipRange(
            default=(0.4, 0.4),
            eps_low_max=None,
            symmetric="the authors' clip has one bound, applied to rho^sgn(A); docs/gspo.md",
        ),
    ),
}
"""Every policy-loss variant by its ``loss.variant`` name: its term function and its properties."""


def clipped_token_terms(ratio, adv, eps_low, eps_high):
    """``-min(r A, clip(r) A)`` per token, written as a selection so no gradient splits on ties; and whether
    each was clipped (float)."""
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    clipped = ((adv > 0) & (ratio > hi)) | ((adv < 0) & (ratio < lo))
    term = torch.where(clipped, -ratio.detach().clamp(lo, hi) * adv, -ratio * adv)
    return term, clipped.float()


def expand(per_seq, cu_seqlens, num_tokens):
    """Broadcast ``[B]`` values to their sequences' tokens: ``[T]``."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(per_seq, lengths, output_size=num_tokens)
