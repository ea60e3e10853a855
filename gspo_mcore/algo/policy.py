"""Policy losses: GSPO and its family (the formulas, defaults and papers are in docs/gspo.md).

- GSPO (arXiv 2507.18071) clips the length-normalised sequence ratio ``s_i = exp(mean_t(log pi - log pi_old))``;
  GSPO-token clips ``sg[s_i] * pi / sg[pi]`` per token (equal to GSPO when a sequence has one advantage);
  GRPO clips each token's ratio. Every sequence contributes ``A_i`` times its clipped term.
- SAPO (arXiv 2511.20347) replaces the clip by a soft gate ``f(r) = (4 / tau) sigmoid(tau (r - 1))`` of each
  token ratio, ``tau`` = ``tau_pos`` for ``A > 0`` and ``tau_neg`` otherwise.
- CISPO (MiniMax-M1, arXiv 2506.13585) weights each token's ``grad log pi`` by the clipped, stop-gradient
  token ratio ``sg[clip(r, 1 - eps_low, 1 + eps_high)]``: no token's gradient is dropped; the loss reported
  is the paper's objective ``-(1/M) sum sg[r_hat] A log pi``. Its normaliser is the mini-batch's
  counted-token count ``M`` (the paper's ``1 / sum_i |o_i|``), not ``N``.
- GMPO (arXiv 2507.20673) maximises ``A_i`` times the geometric mean of the token ratios, each clipped in
  log space to ``log r <= eps`` (``A > 0``) or ``log r >= -eps`` (``A < 0``) before the mean; one ``eps``
  (``eps_low == eps_high``), as the authors'.

Each variant is a term function in :mod:`.variants`, chosen by its row of ``LOSS_VARIANTS``; this module
holds what they share (checks, masking, off-policy weights, normalisers, metrics).

All but CISPO are means over sequences: ``loss = -(1/N) sum_i J_i`` with ``N`` global to the optimisation
mini-batch (all micro-batches and data-parallel ranks), so that splitting a mini-batch into micro-batches
and summing their gradients gives the gradient of the whole mini-batch; CISPO's ``M`` is global likewise.
Every per-sequence mean, ratio and metric is over the counted tokens (``loss_mask`` 1: the policy's own
tokens); prompt and environment tokens, wherever they lie in a sequence, never count.
"""

from __future__ import annotations

import math
import warnings

import torch

from gspo_mcore import ops
from gspo_mcore.algo.variants import LOSS_VARIANTS, TermInputs, Variant, expand
from gspo_mcore.algo.variants import SAPO_GATE_NEAR_ZERO as SAPO_GATE_NEAR_ZERO  # re-exported
from gspo_mcore.ops._checks import check_cu_seqlens, check_length, check_tensor

VARIANTS = tuple(LOSS_VARIANTS)
"""The ``loss.variant`` names, in :data:`~gspo_mcore.algo.variants.LOSS_VARIANTS`' order."""
DEFAULT_EPS = {name: (None, None) if isinstance(v.clip, str) else v.clip.default for name, v in LOSS_VARIANTS.items()}
"""Each variant's clip range ``(eps_low, eps_high)`` when none is given: the papers' values (GSPO, GRPO, GMPO);
CISPO's paper sets no lower bound and tunes ``eps_high`` without publishing it (docs/gspo.md); SAPO has none."""
SAPO_DEFAULT_TAU = (1.0, 1.05)
"""SAPO's gate temperatures ``(tau_pos, tau_neg)`` for positive / non-positive advantages (the paper's)."""
RATIO_LEVEL = {name: v.level for name, v in LOSS_VARIANTS.items()}
"""Whether a variant's ratio (and its off-policy weight, and its ``ratio_*`` metrics) is per sequence or per token."""
_FLOAT = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    cu_seqlens: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    variant: str = "gspo",
    eps_low: float | None = None,
    eps_high: float | None = None,
    num_sequences: int | torch.Tensor | None = None,
    num_tokens: int | torch.Tensor | None = None,
    tau_pos: float | None = None,
    tau_neg: float | None = None,
    weights: torch.Tensor | None = None,
    cp_group=None,
):
    """The policy-gradient loss of one (micro-)batch of packed sequences.

    Args:
        logp: ``[T]`` log-probs of the sampled tokens under the current policy (differentiable).
        old_logp: ``[T]`` log-probs under the behaviour policy (treated as constants).
        advantages: ``[B]`` per sequence; for ``gspo_token`` also ``[T]`` per token.
        cu_seqlens: ``[B+1]`` int32/int64 offsets of the packed sequences.
        loss_mask: ``[T]`` 1 for tokens that count (the policy's own tokens), 0 otherwise (prompt, and
            environment / tool tokens anywhere inside a sequence): bool, or a float / int tensor holding
            only 0 and 1 (any other value, e.g. a 0.5 weight, is refused: the loss is a mean over counted
            tokens, not a weighted mean).
        variant: one of :data:`VARIANTS` (docs/gspo.md).
        eps_low, eps_high: the clip range; ``None``: the variant's :data:`DEFAULT_EPS`. GSPO, GSPO-token,
            GRPO: ratios in ``[1 - eps_low, 1 + eps_high]``; CISPO: the importance weight's bounds
            ``[1 - eps_low, 1 + eps_high]`` (``eps_low`` up to 1, i.e. no lower bound); GMPO: log-ratio
            bounds ``[-eps_low, eps_high]``, one range (``eps_low == eps_high``); SAPO has none (refused when
            given). The rules are each variant's ``ClipRange`` (:func:`check_clip_range`).
        num_sequences: the global normaliser ``N`` (int or 0-d tensor); default: the ``B`` passed here.
            Every variant but CISPO divides by it.
        num_tokens: CISPO's global normaliser ``M``, the counted tokens of the whole mini-batch (int or 0-d
            tensor); default: the counted tokens passed here. Only CISPO uses it.
        tau_pos, tau_neg: SAPO's gate temperatures for ``A > 0`` and ``A <= 0`` (finite, > 0); ``None``: the
            paper's :data:`SAPO_DEFAULT_TAU`. Checked for every variant, used by SAPO only.
        weights: constant importance weights (the off-policy correction, see :mod:`.off_policy`): ``[B]``
            per sequence for the sequence-level variants, ``[T]`` per token for the token-level ones
            (:data:`RATIO_LEVEL`); each multiplies its sequence's (token's) term. ``None``: all 1.
        cp_group: context-parallel group: each rank holds part of every sequence; per-sequence partial
            sums are all-reduced (one scalar per sequence).

    Returns:
        ``(loss, metrics)``: a 0-d float32 loss (to minimise) and a dict of 0-d float32 tensors, computed
        without any host synchronisation: ``clip_fraction`` (fraction of counted tokens whose term is
        clipped; for GSPO, the tokens of clipped sequences; for CISPO, tokens whose importance weight is
        clipped; for GMPO, tokens whose log-ratio is clipped; 0 for SAPO), ``clipped_sequence_fraction``
        (sequences with a clipped term), ``ratio_mean/min/max`` (sequence ratios ``s_i`` for the
        sequence-level variants, token ratios for the token-level ones; 1 when nothing counts),
        ``nonfinite_tokens`` (counted tokens whose log-ratio is NaN or inf), ``num_tokens`` and
        ``num_sequences`` (counted tokens and sequences with at least one). SAPO adds ``gate_mean`` (the mean
        over counted tokens of the gradient gate ``4 p (1 - p)``, ``p = sigmoid(tau (r - 1))``: 1 on policy,
        towards 0 far off it) and ``gate_near_zero_fraction`` (tokens whose gate is below
        :data:`SAPO_GATE_NEAR_ZERO`).

    NaN/inf: a counted token whose ``logp - old_logp`` is not finite makes its sequence's term, and so
    the loss, NaN; ``nonfinite_tokens`` counts such tokens. Masked-out tokens never matter, even if NaN.
    """
    spec = _variant(variant)
    eps_low, eps_high = check_clip_range(variant, eps_low, eps_high, warn=True)
    tau_pos, tau_neg = check_sapo_tau(tau_pos, tau_neg)
    check_tensor("logp", logp, dim=1, dtypes=_FLOAT)
    T, device = logp.shape[0], logp.device
    check_tensor("old_logp", old_logp, dim=1, dtypes=_FLOAT, device=device)
    check_length("old_logp", old_logp, T, "logp")
    check_tensor("loss_mask", loss_mask, dim=1, device=device)
    check_length("loss_mask", loss_mask, T, "logp")
    _check_binary_mask(loss_mask)
    check_cu_seqlens(cu_seqlens, T, device)
    B = cu_seqlens.shape[0] - 1
    check_tensor("advantages", advantages, dim=1, dtypes=_FLOAT, device=device)
    if advantages.shape[0] not in ((B, T) if spec.token_advantages else (B,)):
        expected = f"[B]={B} or [T]={T}" if spec.token_advantages else f"[B]={B} (one per sequence)"
        raise ValueError(
            f"advantages must have shape {expected} for variant {variant!r}, got {tuple(advantages.shape)}"
        )
    inv_n = _inverse_normaliser("num_sequences", num_sequences, B, device)
    inv_m = _inverse_normaliser("num_tokens", num_tokens, None, device)
    token_level = spec.level == "token"
    if weights is not None:
        check_tensor("weights", weights, dim=1, dtypes=_FLOAT, device=device)
        check_length(
            "weights",
            weights,
            T if token_level else B,
            f"[T] (per token, {variant})" if token_level else "[B] (per sequence)",
        )
        weights = weights.detach().float()

    mask = loss_mask.to(torch.float32)
    log_ratio = logp.float() - old_logp.detach().float()  # (T,)
    seq_sum = ops.segment_sum(log_ratio, cu_seqlens, mask)  # (B,)  differentiable
    counts = ops.segment_sum(mask, cu_seqlens, mask)  # (B,)
    nonfinite = ops.segment_sum((~torch.isfinite(log_ratio.detach())).float(), cu_seqlens, mask)
    seq_sum, counts, nonfinite = ops.all_reduce_sum(seq_sum, counts, nonfinite, group=cp_group)
    # A counted token whose log-ratio is not finite makes its sequence's term NaN, as documented: exp()
    # alone would turn -inf into a silently finite ratio of 0, and +inf into a clipped (finite) term.
    # Masked-out tokens are zeroed BEFORE any per-token arithmetic (the term functions' job): their terms are
    # dropped by the segment sums, but a NaN there would still turn the zero gradient into 0 * NaN = NaN.
    x = TermInputs(
        logp=logp,
        log_ratio=log_ratio,
        counted=mask != 0,
        mask=mask,
        cu_seqlens=cu_seqlens,
        advantages=advantages.float(),
        per_token_advantages=spec.token_advantages and advantages.shape[0] == T,  # [T] wins if T == B
        seq_log_ratio=seq_sum,
        counts=counts,
        poison=torch.where(nonfinite > 0, math.nan, 0.0),  # (B,)  0 or NaN, constant
        eps_low=eps_low,
        eps_high=eps_high,
        tau_pos=tau_pos,
        tau_neg=tau_neg,
        cp_group=cp_group,
    )
    terms = spec.term(x)
    seq_term, seq_clipped, token_sums = _sequence_terms(spec, x, terms, weights)
    valid = x.valid
    seq_term = torch.where(valid, seq_term, 0.0) + x.poison
    inv = inv_n if spec.normaliser == "sequences" else _inv_m_or_local(inv_m, counts)
    loss = seq_term.sum() * inv

    if token_level:  # token ratios: their per-sequence sums came with the terms' (one all-reduce)
        ratio_stats = _token_ratio_stats(terms.ratio.detach(), mask, token_sums[0], counts, cp_group)
        token_sums = token_sums[1:]
    else:
        ratio_stats = _masked_stats(terms.ratio, valid)
    num_tokens_here = counts.sum()
    num_valid = valid.float().sum()
    metrics = {
        "clip_fraction": seq_clipped.sum() / num_tokens_here.clamp(min=1.0),
        "clipped_sequence_fraction": (seq_clipped > 0).float().sum() / num_valid.clamp(min=1.0),
        "ratio_mean": ratio_stats[0],
        "ratio_min": ratio_stats[1],
        "ratio_max": ratio_stats[2],
        "nonfinite_tokens": nonfinite.sum(),
        "num_tokens": num_tokens_here,
        "num_sequences": num_valid,
        **{name: s.sum() / num_tokens_here.clamp(min=1.0) for name, s in zip(terms.token_means, token_sums)},
    }
    return loss, {k: v.detach() for k, v in metrics.items()}


def _sequence_terms(spec: Variant, x: TermInputs, terms, weights):
    """``(term [B], clipped tokens [B], token sums)`` from a term function's result: token terms weighted
    (the off-policy weight of their token, or of their sequence) and summed per sequence, together with the
    token ratios (token-level variants) and the ``token_means`` in one all-reduce; a token-mean variant's sum
    divided by its sequence's counted tokens; sequence terms weighted."""
    token_level = spec.level == "token"
    extra = [terms.ratio.detach()] if token_level else []
    extra += list(terms.token_means.values())
    if terms.token is None:
        seq_term = terms.sequence if weights is None else terms.sequence * weights
        return seq_term, terms.clipped, x.sums(*extra)
    tok_term = terms.token
    if weights is not None:
        w_tok = weights if token_level else expand(weights, x.cu_seqlens, x.num_tokens)
        tok_term = tok_term * torch.where(x.counted, w_tok, 0.0)
    seq_term, seq_clipped, *token_sums = x.sums(tok_term, terms.clipped, *extra)
    if spec.normaliser == "sequences":  # the mean over the sequence's counted tokens
        seq_term = seq_term / x.counts.clamp(min=1.0)
    return seq_term, seq_clipped, token_sums


def _variant(variant: str, prefix: str = "") -> Variant:
    if variant not in LOSS_VARIANTS:
        raise ValueError(f"{prefix}variant must be one of {VARIANTS}, got {variant!r}")
    return LOSS_VARIANTS[variant]


def _inv_m_or_local(inv_m, counts):
    """CISPO's ``1 / M``: the given global count, or this call's counted tokens."""
    return inv_m if inv_m is not None else 1.0 / counts.sum().clamp(min=1.0)


def _masked_stats(values, valid):
    """(mean, min, max) of ``values`` where ``valid``; 1 when nothing is valid (no host sync)."""
    v = values.detach()
    n = valid.float().sum()
    any_valid = n > 0
    mean = torch.where(valid, v, 0.0).sum() / n.clamp(min=1.0)
    vmin = torch.where(valid, v, math.inf).amin() if v.numel() else v.new_tensor(1.0)
    vmax = torch.where(valid, v, -math.inf).amax() if v.numel() else v.new_tensor(1.0)
    one = v.new_tensor(1.0)
    return (torch.where(any_valid, mean, one), torch.where(any_valid, vmin, one), torch.where(any_valid, vmax, one))


def _token_ratio_stats(ratio_tok, mask, ratio_sum, counts, cp_group):
    counted = mask != 0
    total = counts.sum()
    mean = ratio_sum.sum() / total.clamp(min=1.0)
    vmin = torch.where(counted, ratio_tok, math.inf).amin() if ratio_tok.numel() else ratio_tok.new_tensor(math.inf)
    vmax = torch.where(counted, ratio_tok, -math.inf).amax() if ratio_tok.numel() else ratio_tok.new_tensor(-math.inf)
    if cp_group is not None:
        import torch.distributed as dist

        extremes = torch.stack([-vmin, vmax])
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=cp_group)
        vmin, vmax = -extremes[0], extremes[1]
    one = ratio_tok.new_tensor(1.0)
    any_counted = total > 0
    return (
        torch.where(any_counted, mean, one),
        torch.where(any_counted, vmin, one),
        torch.where(any_counted, vmax, one),
    )


def _check_binary_mask(loss_mask: torch.Tensor) -> None:
    """A non-bool mask must hold only 0 and 1: at once on CPU, queued with ``_assert_async`` elsewhere."""
    if loss_mask.dtype == torch.bool or loss_mask.numel() == 0:
        return
    bad = (loss_mask != 0) & (loss_mask != 1)  # (T,)
    if loss_mask.device.type == "cpu":
        if bool(bad.any()):
            t = int(torch.nonzero(bad)[0, 0])
            raise ValueError(
                f"loss_mask must hold only 0 and 1 (or be bool), but loss_mask[{t}]={loss_mask[t].item()!r}"
            )
    else:
        torch._assert_async(~bad.any(), "loss_mask must hold only 0 and 1 (or be bool)")


def check_clip_range(variant: str, eps_low, eps_high, *, warn: bool = False, prefix: str = ""):
    """The clip range ``(eps_low, eps_high)`` of ``variant`` as floats (``None`` each for a variant without one,
    SAPO), ``None`` replaced by the default; a bad value raises ``ValueError`` naming ``prefix + key``. The
    rules are the variant's :class:`~gspo_mcore.algo.variants.ClipRange`."""
    clip = _variant(variant, prefix).clip
    if isinstance(clip, str):  # no clip range: the text says what to set instead
        for name, eps in (("eps_low", eps_low), ("eps_high", eps_high)):
            if eps is not None:
                raise ValueError(
                    f"{prefix}{name}={eps!r}: {variant} has no clip range; leave it unset ("
                    + clip.format(prefix=prefix)
                    + ")"
                )
        return None, None
    eps_low = clip.default[0] if eps_low is None else eps_low
    eps_high = clip.default[1] if eps_high is None else eps_high
    for name, eps in (("eps_low", eps_low), ("eps_high", eps_high)):
        if isinstance(eps, bool) or not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
            raise ValueError(f"{prefix}{name} must be a finite number >= 0, got {eps!r}")
    limit = clip.eps_low_max
    if limit is not None and (eps_low > limit if clip.eps_low_max_allowed else eps_low >= limit):
        op = "<=" if clip.eps_low_max_allowed else "<"
        raise ValueError(f"{prefix}eps_low must be {op} {limit:g} for {variant} ({clip.eps_low_rule}), got {eps_low}")
    if clip.symmetric and eps_low != eps_high:
        raise ValueError(
            f"{prefix}eps_low={eps_low} and {prefix}eps_high={eps_high} differ, but {variant} takes one clip range "
            f"({clip.symmetric}): set both to the same value, or leave both unset ({clip.default[1]:g})"
        )
    if warn and clip.no_op_at is not None and max(eps_low, eps_high) >= clip.no_op_at:
        warnings.warn(
            f"{variant} with eps_low={eps_low}, eps_high={eps_high}: sequence ratios sit very close to 1, "
            "so a token-level clip range makes clipping a no-op "
            f"(the paper uses {clip.default[0]:g}/{clip.default[1]:g})",
            stacklevel=3,
        )
    return float(eps_low), float(eps_high)


def check_sapo_tau(tau_pos, tau_neg, *, prefix: str = ""):
    """SAPO's temperatures as floats (``None``: :data:`SAPO_DEFAULT_TAU`); each must be finite and > 0."""
    out = []
    for name, tau, default in (
        ("sapo_tau_pos", tau_pos, SAPO_DEFAULT_TAU[0]),
        ("sapo_tau_neg", tau_neg, SAPO_DEFAULT_TAU[1]),
    ):
        tau = default if tau is None else tau
        if isinstance(tau, bool) or not (isinstance(tau, (int, float)) and math.isfinite(tau) and tau > 0):
            raise ValueError(f"{prefix}{name} must be a finite number > 0 (the gate's temperature), got {tau!r}")
        out.append(float(tau))
    return tuple(out)


def _inverse_normaliser(name, value, default, device):
    """``1 / value``; ``None``: ``1 / max(default, 1)``, or ``None`` when ``default`` is ``None`` too."""
    if value is None:
        return None if default is None else 1.0 / max(default, 1)
    what = "sequence" if name == "num_sequences" else "counted-token"
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got shape {tuple(value.shape)}")
        return 1.0 / value.to(device=device, dtype=torch.float32).reshape(())
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int (the mini-batch's global {what} count), got {value!r}")
    return 1.0 / value
