"""Policy losses: GSPO (sequence level), GSPO-token and GRPO (the formulas are written out in docs/gspo.md).

GSPO (arXiv 2507.18071) clips the length-normalised sequence ratio ``s_i = exp(mean_t(log pi - log pi_old))``
of each response, GSPO-token clips ``sg[s_i] * pi / sg[pi]`` per token (equal to GSPO when a sequence has
one advantage), GRPO clips each token's ratio; every sequence contributes ``A_i`` times its clipped term.

All three are means over sequences: ``loss = -(1/N) sum_i J_i`` with ``N`` global to the optimisation
mini-batch (all micro-batches and data-parallel ranks), so that splitting a mini-batch into micro-batches
and summing their gradients gives the gradient of the whole mini-batch.
"""

from __future__ import annotations

import math
import warnings

import torch

from gspo_mcore import ops
from gspo_mcore.ops._checks import check_cu_seqlens, check_length, check_tensor

VARIANTS = ("gspo", "gspo_token", "grpo")
DEFAULT_EPS = {"gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "grpo": (0.2, 0.27)}
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
    weights: torch.Tensor | None = None,
    cp_group=None,
):
    """The clipped policy-gradient loss of one (micro-)batch of packed sequences.

    Args:
        logp: ``[T]`` log-probs of the sampled tokens under the current policy (differentiable).
        old_logp: ``[T]`` log-probs under the behaviour policy (treated as constants).
        advantages: ``[B]`` per sequence; for ``gspo_token`` also ``[T]`` per token.
        cu_seqlens: ``[B+1]`` int32/int64 offsets of the packed sequences.
        loss_mask: ``[T]`` 1 for tokens that count (response tokens), 0 otherwise: bool, or a float / int
            tensor holding only 0 and 1 (any other value, e.g. a 0.5 weight, is refused: the loss is a
            mean over counted tokens, not a weighted mean).
        variant: ``"gspo"``, ``"gspo_token"`` or ``"grpo"``.
        eps_low, eps_high: clip range ``[1 - eps_low, 1 + eps_high]``; defaults 3e-4/4e-4 for the GSPO
            variants and 0.2/0.27 for GRPO.
        num_sequences: the global normaliser ``N`` (int or 0-d tensor); default: the ``B`` passed here.
        weights: constant importance weights (the off-policy correction, see :mod:`.off_policy`): ``[B]``
            per sequence for the GSPO variants, ``[T]`` per token for GRPO; each multiplies its sequence's
            (token's) clipped term. ``None``: all 1.
        cp_group: context-parallel group: each rank holds part of every sequence; per-sequence partial
            sums are all-reduced (one scalar per sequence).

    Returns:
        ``(loss, metrics)``: a 0-d float32 loss (to minimise) and a dict of 0-d float32 tensors, computed
        without any host synchronisation: ``clip_fraction`` (fraction of counted tokens whose term is
        clipped; for GSPO, the tokens of clipped sequences), ``clipped_sequence_fraction`` (sequences with
        a clipped term), ``ratio_mean/min/max`` (sequence ratios ``s_i`` for GSPO variants, token ratios
        for GRPO; 1 when nothing counts), ``nonfinite_tokens`` (counted tokens whose log-ratio is NaN or
        inf), ``num_tokens`` and ``num_sequences`` (counted tokens and sequences with at least one).

    NaN/inf: a counted token whose ``logp - old_logp`` is not finite makes its sequence's term, and so
    the loss, NaN; ``nonfinite_tokens`` counts such tokens. Masked-out tokens never matter, even if NaN.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    eps_low, eps_high = _clip_range(variant, eps_low, eps_high)
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
    inv_n = _inverse_normaliser(num_sequences, B, device)
    if weights is not None:
        n_w = T if variant == "grpo" else B
        check_tensor("weights", weights, dim=1, dtypes=_FLOAT, device=device)
        check_length("weights", weights, n_w, "[T] (per token, grpo)" if variant == "grpo" else "[B] (per sequence)")
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
    else:
        # Masked-out tokens are zeroed BEFORE any per-token arithmetic: their terms are dropped by the
        # segment sums, but a NaN there would still turn the zero gradient into 0 * NaN = NaN.
        counted = mask != 0
        if variant == "gspo_token":
            # s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]: value s_i, gradient s_i * grad logp_t
            s_seq = torch.where(valid, torch.exp(seq_sum.detach() / counts.clamp(min=1.0)), 1.0)  # (B,)
            own = torch.where(counted, logp.float() - logp.detach().float(), 0.0)  # (T,) value 0
            ratio_tok = _expand(s_seq, cu_seqlens, T) * torch.exp(own)
            # a [T] tensor is per token (it wins if T == B); a [B] tensor is broadcast over each sequence
            per_token = advantages.shape[0] == T
            adv_tok = advantages.float() if per_token else _expand(advantages.float(), cu_seqlens, T)
        else:  # grpo: token ratio w_i,t = exp(logp - old_logp)
            ratio_tok = torch.exp(torch.where(counted, log_ratio, 0.0))
            adv_tok = _expand(advantages.float(), cu_seqlens, T)
        adv_tok = torch.where(counted, adv_tok, 0.0)
        tok_term, tok_clipped = _clipped_token_terms(ratio_tok, adv_tok, eps_low, eps_high)
        if weights is not None:
            w_tok = weights if variant == "grpo" else _expand(weights, cu_seqlens, T)
            tok_term = tok_term * torch.where(counted, w_tok, 0.0)
        seq_term = ops.segment_sum(tok_term, cu_seqlens, mask)  # partial per-sequence sums
        seq_clipped = ops.segment_sum(tok_clipped, cu_seqlens, mask)
        if variant == "grpo":
            ratio_sum = ops.segment_sum(ratio_tok.detach(), cu_seqlens, mask)
            seq_term, seq_clipped, ratio_sum = ops.all_reduce_sum(seq_term, seq_clipped, ratio_sum, group=cp_group)
        else:
            seq_term, seq_clipped = ops.all_reduce_sum(seq_term, seq_clipped, group=cp_group)
        seq_term = seq_term + poison
        loss = torch.where(valid, seq_term / counts.clamp(min=1.0), 0.0).sum() * inv_n
        clipped_tokens = seq_clipped.sum()
        clipped_seqs = (seq_clipped > 0).float().sum()
        if variant == "grpo":
            ratio_stats = _token_ratio_stats(ratio_tok.detach(), mask, ratio_sum, counts, cp_group)
        else:
            ratio_stats = _masked_stats(s_seq, valid)

    num_tokens = counts.sum()
    num_valid = valid.float().sum()
    metrics = {
        "clip_fraction": clipped_tokens / num_tokens.clamp(min=1.0),
        "clipped_sequence_fraction": clipped_seqs / num_valid.clamp(min=1.0),
        "ratio_mean": ratio_stats[0],
        "ratio_min": ratio_stats[1],
        "ratio_max": ratio_stats[2],
        "nonfinite_tokens": nonfinite.sum(),
        "num_tokens": num_tokens,
        "num_sequences": num_valid,
    }
    return loss, {k: v.detach() for k, v in metrics.items()}


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


def _clip_range(variant, eps_low, eps_high):
    d_low, d_high = DEFAULT_EPS[variant]
    eps_low = d_low if eps_low is None else eps_low
    eps_high = d_high if eps_high is None else eps_high
    for name, eps in (("eps_low", eps_low), ("eps_high", eps_high)):
        if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {eps!r}")
    if eps_low >= 1:
        raise ValueError(f"eps_low must be < 1 (the lower clip bound 1 - eps_low must stay positive), got {eps_low}")
    if variant != "grpo" and max(eps_low, eps_high) >= 0.05:
        warnings.warn(
            f"{variant} with eps_low={eps_low}, eps_high={eps_high}: sequence ratios sit very close to 1, "
            "so a token-level clip range makes clipping a no-op (the paper uses 3e-4/4e-4)",
            stacklevel=3,
        )
    return float(eps_low), float(eps_high)


def _inverse_normaliser(num_sequences, batch_size, device):
    if num_sequences is None:
        return 1.0 / max(batch_size, 1)
    if isinstance(num_sequences, torch.Tensor):
        if num_sequences.numel() != 1:
            raise ValueError(f"num_sequences must be a scalar, got shape {tuple(num_sequences.shape)}")
        return 1.0 / num_sequences.to(device=device, dtype=torch.float32).reshape(())
    if isinstance(num_sequences, bool) or not isinstance(num_sequences, int) or num_sequences <= 0:
        raise ValueError(
            f"num_sequences must be a positive int (the mini-batch's global sequence count), got {num_sequences!r}"
        )
    return 1.0 / num_sequences
