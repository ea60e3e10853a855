"""Policy losses: GSPO and its family (the formulas, defaults and papers are in docs/gspo.md).

- GSPO (arXiv 2507.18071) clips the length-normalised sequence ratio ``s_i = exp(mean_t(log pi - log pi_old))``;
  GSPO-token clips ``sg[s_i] * pi / sg[pi]`` per token (equal to GSPO when a sequence has one advantage);
  GRPO clips each token's ratio. Every sequence contributes ``A_i`` times its clipped term.
- SAPO (arXiv 2511.20347) replaces the clip by a soft gate ``f(r) = (4 / tau) sigmoid(tau (r - 1))`` of each
  token ratio, ``tau`` = ``tau_pos`` for ``A > 0`` and ``tau_neg`` otherwise.
- CISPO (MiniMax-M1, arXiv 2506.13585) weights each token's ``grad log pi`` by the clipped, stop-gradient
  token ratio ``sg[clip(r, 1 - eps_low, 1 + eps_high)]``: no token's gradient is dropped. Its normaliser is
  the mini-batch's counted-token count ``M`` (the paper's ``1 / sum_i |o_i|``), not ``N``.
- GMPO (arXiv 2507.20673) maximises ``A_i`` times the geometric mean of the token ratios, each clipped in
  log space to ``log r <= eps_high`` (``A > 0``) or ``log r >= -eps_low`` (``A < 0``) before the mean.

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
from gspo_mcore.ops._checks import check_cu_seqlens, check_length, check_tensor

VARIANTS = ("gspo", "gspo_token", "grpo", "sapo", "cispo", "gmpo")
DEFAULT_EPS = {
    "gspo": (3e-4, 4e-4),
    "gspo_token": (3e-4, 4e-4),
    "grpo": (0.2, 0.27),
    "sapo": (None, None),  # no clip: a soft gate (SAPO_DEFAULT_TAU)
    "cispo": (1.0, 3.0),  # importance-weight bounds [1 - eps_low, 1 + eps_high] = [0, 4]: no lower bound
    "gmpo": (0.4, 0.4),  # log space: token ratios kept within [exp(-0.4), exp(0.4)]
}
"""Each variant's clip range ``(eps_low, eps_high)`` when none is given: the papers' values (GSPO, GRPO, GMPO);
CISPO's paper sets no lower bound and tunes ``eps_high`` without publishing it (docs/gspo.md)."""
SAPO_DEFAULT_TAU = (1.0, 1.05)
"""SAPO's gate temperatures ``(tau_pos, tau_neg)`` for positive / non-positive advantages (the paper's)."""
SAPO_GATE_NEAR_ZERO = 0.1
"""A SAPO token counts in ``gate_near_zero_fraction`` when its gradient gate ``4 p (1 - p)`` is below this."""
RATIO_LEVEL = {
    "gspo": "sequence",
    "gspo_token": "sequence",
    "grpo": "token",
    "sapo": "token",
    "cispo": "token",
    "gmpo": "sequence",
}
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
            bounds ``[-eps_low, eps_high]``; SAPO has none (refused when given).
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
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
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
    if advantages.shape[0] not in ((B, T) if variant == "gspo_token" else (B,)):
        expected = f"[B]={B} or [T]={T}" if variant == "gspo_token" else f"[B]={B} (one per sequence)"
        raise ValueError(
            f"advantages must have shape {expected} for variant {variant!r}, got {tuple(advantages.shape)}"
        )
    inv_n = _inverse_normaliser("num_sequences", num_sequences, B, device)
    inv_m = _inverse_normaliser("num_tokens", num_tokens, None, device)
    token_level = RATIO_LEVEL[variant] == "token"
    if weights is not None:
        n_w = T if token_level else B
        check_tensor("weights", weights, dim=1, dtypes=_FLOAT, device=device)
        check_length("weights", weights, n_w, f"[T] (per token, {variant})" if token_level else "[B] (per sequence)")
        weights = weights.detach().float()

    mask = loss_mask.to(torch.float32)
    log_ratio = logp.float() - old_logp.detach().float()  # (T,)
    seq_sum = ops.segment_sum(log_ratio, cu_seqlens, mask)  # (B,)  differentiable
    counts = ops.segment_sum(mask, cu_seqlens, mask)  # (B,)
    nonfinite = ops.segment_sum((~torch.isfinite(log_ratio.detach())).float(), cu_seqlens, mask)
    seq_sum, counts, nonfinite = ops.all_reduce_sum(seq_sum, counts, nonfinite, group=cp_group)
    valid = counts > 0
    # A counted token whose log-ratio is not finite makes its sequence's term NaN, as documented: exp()
    # alone would turn -inf into a silently finite ratio of 0, and +inf into a clipped (finite) term.
    poison = torch.where(nonfinite > 0, math.nan, 0.0)  # (B,)  0 or NaN, constant
    # Masked-out tokens are zeroed BEFORE any per-token arithmetic: their terms are dropped by the
    # segment sums, but a NaN there would still turn the zero gradient into 0 * NaN = NaN.
    counted = mask != 0
    extra = {}

    if variant == "gspo":
        term, ratio, clipped, _ = ops.gspo_sequence_terms(
            seq_sum + poison, counts, advantages.float(), eps_low, eps_high
        )
        if weights is not None:
            term = term * weights
        loss = term.sum() * inv_n
        clipped_tokens = (clipped * counts).sum()
        clipped_seqs = clipped.sum()
        ratio_stats = _masked_stats(ratio, valid)
    elif variant == "gmpo":
        adv_tok = torch.where(counted, _expand(advantages.float(), cu_seqlens, T), 0.0)
        d = torch.where(counted, log_ratio, 0.0)  # (T,)
        tok_clipped = ((adv_tok > 0) & (d > eps_high)) | ((adv_tok < 0) & (d < -eps_low))
        d_kept = torch.where(tok_clipped, d.detach().clamp(-eps_low, eps_high), d)  # clipped: constant
        clipped_sum = ops.segment_sum(d_kept, cu_seqlens, mask)  # (B,)
        seq_clipped = ops.segment_sum(tok_clipped.float(), cu_seqlens, mask)
        clipped_sum, seq_clipped = ops.all_reduce_sum(clipped_sum, seq_clipped, group=cp_group)
        geo = torch.exp(clipped_sum / counts.clamp(min=1.0))  # the clipped geometric-mean ratio
        term = torch.where(valid, -advantages.float() * geo, 0.0) + poison
        if weights is not None:
            term = term * weights
        loss = term.sum() * inv_n
        clipped_tokens = seq_clipped.sum()
        clipped_seqs = (seq_clipped > 0).float().sum()
        ratio_stats = _masked_stats(torch.exp(seq_sum.detach() / counts.clamp(min=1.0)), valid)
    else:
        adv_tok = None
        if variant == "gspo_token":
            # s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]: value s_i, gradient s_i * grad logp_t
            s_seq = torch.where(valid, torch.exp(seq_sum.detach() / counts.clamp(min=1.0)), 1.0)  # (B,)
            own = torch.where(counted, logp.float() - logp.detach().float(), 0.0)  # (T,) value 0
            ratio_tok = _expand(s_seq, cu_seqlens, T) * torch.exp(own)
            # a [T] tensor is per token (it wins if T == B); a [B] tensor is broadcast over each sequence
            per_token = advantages.shape[0] == T
            adv_tok = advantages.float() if per_token else _expand(advantages.float(), cu_seqlens, T)
        else:  # token ratios r_i,t = exp(logp - old_logp)
            ratio_tok = torch.exp(torch.where(counted, log_ratio, 0.0))
            adv_tok = _expand(advantages.float(), cu_seqlens, T)
        adv_tok = torch.where(counted, adv_tok, 0.0)
        if variant == "sapo":
            tok_term, gate = _sapo_token_terms(ratio_tok, adv_tok, tau_pos, tau_neg)
            tok_clipped = torch.zeros_like(tok_term)
        elif variant == "cispo":
            tok_term, tok_clipped = _cispo_token_terms(logp, ratio_tok, adv_tok, counted, eps_low, eps_high)
        else:
            tok_term, tok_clipped = _clipped_token_terms(ratio_tok, adv_tok, eps_low, eps_high)
        if weights is not None:
            w_tok = weights if token_level else _expand(weights, cu_seqlens, T)
            tok_term = tok_term * torch.where(counted, w_tok, 0.0)
        parts = [ops.segment_sum(tok_term, cu_seqlens, mask), ops.segment_sum(tok_clipped, cu_seqlens, mask)]
        if token_level:
            parts.append(ops.segment_sum(ratio_tok.detach(), cu_seqlens, mask))
        if variant == "sapo":
            parts += [
                ops.segment_sum(gate, cu_seqlens, mask),
                ops.segment_sum((gate < SAPO_GATE_NEAR_ZERO).float(), cu_seqlens, mask),
            ]
        parts = ops.all_reduce_sum(*parts, group=cp_group)  # partial per-sequence sums, completed
        seq_term, seq_clipped = parts[0] + poison, parts[1]
        if variant == "cispo":  # a token sum over the mini-batch's M counted tokens
            loss = torch.where(valid, seq_term, 0.0).sum() * _inv_m_or_local(inv_m, counts)
        else:
            loss = torch.where(valid, seq_term / counts.clamp(min=1.0), 0.0).sum() * inv_n
        clipped_tokens = seq_clipped.sum()
        clipped_seqs = (seq_clipped > 0).float().sum()
        if token_level:
            ratio_stats = _token_ratio_stats(ratio_tok.detach(), mask, parts[2], counts, cp_group)
        else:
            ratio_stats = _masked_stats(s_seq, valid)
        if variant == "sapo":
            n_tok = counts.sum().clamp(min=1.0)
            extra = {"gate_mean": parts[3].sum() / n_tok, "gate_near_zero_fraction": parts[4].sum() / n_tok}

    num_tokens_here = counts.sum()
    num_valid = valid.float().sum()
    metrics = {
        "clip_fraction": clipped_tokens / num_tokens_here.clamp(min=1.0),
        "clipped_sequence_fraction": clipped_seqs / num_valid.clamp(min=1.0),
        "ratio_mean": ratio_stats[0],
        "ratio_min": ratio_stats[1],
        "ratio_max": ratio_stats[2],
        "nonfinite_tokens": nonfinite.sum(),
        "num_tokens": num_tokens_here,
        "num_sequences": num_valid,
        **extra,
    }
    return loss, {k: v.detach() for k, v in metrics.items()}


def _inv_m_or_local(inv_m, counts):
    """CISPO's ``1 / M``: the given global count, or this call's counted tokens."""
    return inv_m if inv_m is not None else 1.0 / counts.sum().clamp(min=1.0)


def _sapo_token_terms(ratio, adv, tau_pos, tau_neg):
    """``-f(r) A`` per token with SAPO's gate ``f(r) = (4 / tau) sigmoid(tau (r - 1))``, ``tau`` by the sign of
    ``A``; and the gradient gate ``4 p (1 - p)`` (``d f / d r``, 1 at ``r = 1``), detached, for the metrics."""
    # float64 for the gate alone (elementwise over T): autograd's sigmoid slope p (1 - p) loses ~1e-4 of its
    # relative accuracy in float32 where the gate nearly shuts (p ~ 0.9996), exactly the tokens SAPO is about
    tau = torch.where(adv > 0, tau_pos, tau_neg).double()  # (T,)
    p = torch.sigmoid(tau * (ratio.double() - 1.0))
    term = (-(4.0 / tau) * p * adv.double()).float()
    q = p.detach()
    gate = (4.0 * q * torch.sigmoid(-tau * (ratio.detach().double() - 1.0))).float()  # 4 p (1 - p), 1 - p exact
    return term, gate


def _cispo_token_terms(logp, ratio, adv, counted, eps_low, eps_high):
    """``-sg[clip(r, lo, hi)] A pi / sg[pi]`` per token: value ``-r_hat A``, gradient ``-r_hat A grad logp``
    (the paper's ``sg[r_hat] A log pi`` has the same gradient); and whether the weight was clipped."""
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    r = ratio.detach()
    clipped = counted & ((r > hi) | (r < lo))
    own = torch.where(counted, logp.float() - logp.detach().float(), 0.0)  # value 0, gradient 1
    term = -(r.clamp(lo, hi) * adv) * torch.exp(own)
    return term, clipped.float()


def _clipped_token_terms(ratio, adv, eps_low, eps_high):
    """``-min(r A, clip(r) A)`` per token, written as a selection so no gradient splits on ties."""
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    clipped = ((adv > 0) & (ratio > hi)) | ((adv < 0) & (ratio < lo))
    term = torch.where(clipped, -ratio.detach().clamp(lo, hi) * adv, -ratio * adv)
    return term, clipped.float()


def _expand(per_seq, cu_seqlens, num_tokens):
    """Broadcast ``[B]`` values to their sequences' tokens: ``[T]``."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(per_seq, lengths, output_size=num_tokens)


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
    """The clip range ``(eps_low, eps_high)`` of ``variant`` as floats (``None`` each for SAPO, which has none),
    ``None`` replaced by :data:`DEFAULT_EPS`; a bad value raises ``ValueError`` naming ``prefix + key``."""
    if variant not in VARIANTS:
        raise ValueError(f"{prefix}variant must be one of {VARIANTS}, got {variant!r}")
    if variant == "sapo":
        for name, eps in (("eps_low", eps_low), ("eps_high", eps_high)):
            if eps is not None:
                raise ValueError(
                    f"{prefix}{name}={eps!r}: sapo has no clip range (a soft gate); leave it unset and set "
                    f"{prefix}sapo_tau_pos / {prefix}sapo_tau_neg instead"
                )
        return None, None
    d_low, d_high = DEFAULT_EPS[variant]
    eps_low = d_low if eps_low is None else eps_low
    eps_high = d_high if eps_high is None else eps_high
    for name, eps in (("eps_low", eps_low), ("eps_high", eps_high)):
        if isinstance(eps, bool) or not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
            raise ValueError(f"{prefix}{name} must be a finite number >= 0, got {eps!r}")
    if variant == "cispo":
        if eps_low > 1:
            raise ValueError(
                f"{prefix}eps_low must be <= 1 for cispo (the importance weight's lower bound 1 - eps_low must "
                f"stay >= 0; 1 means no lower bound, the paper's choice), got {eps_low}"
            )
    elif variant != "gmpo" and eps_low >= 1:
        raise ValueError(
            f"{prefix}eps_low must be < 1 (the lower clip bound 1 - eps_low must stay positive), got {eps_low}"
        )
    if warn and variant in ("gspo", "gspo_token") and max(eps_low, eps_high) >= 0.05:
        warnings.warn(
            f"{variant} with eps_low={eps_low}, eps_high={eps_high}: sequence ratios sit very close to 1, "
            "so a token-level clip range makes clipping a no-op (the paper uses 3e-4/4e-4)",
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
