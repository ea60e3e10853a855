"""The loss adapter: the policy loss of one micro-batch as Megatron's schedule calls it, and its metrics.

:func:`policy_loss_func` turns the last stage's output into per-token log-probs (:mod:`.forward`) and those
into :func:`gspo_mcore.algo.policy_loss` (plus the off-policy weights and the regularisers) with ``N`` = the
number of sequences in the whole mini-batch (all micro-batches, all DP ranks). Megatron divides each
micro-batch's loss by the number of micro-batches and averages gradients over DP ranks; our loss already carries
the global ``1/N``, so the caller passes ``scale = num_microbatches * dp_size`` and the mini-batch gradient is
the exact sum of the micro-batch terms. With context parallelism the policy loss completes its per-sequence sums
over the CP group, and Megatron's own CP handling (the loss multiplied by CP, gradients averaged over DP x CP)
leaves that scale unchanged (docs/context-parallel.md).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from gspo_mcore import algo
from gspo_mcore.learner.forward import microbatch_logprobs
from gspo_mcore.learner.parallel import Layout

# Layout of the per-micro-batch statistics vector (summed over micro-batches and ranks).
_SUMS = (
    "loss",
    "clipped_tokens",
    "clipped_sequences",
    "ratio_sum",
    "ratio_weight",
    "nonfinite_tokens",
    "num_tokens",
    "num_sequences",
    "entropy_sum",
    "kl_sum",
    "is_weight_sum",
    "is_weight_count",
    "is_masked",
    "mu_kl_sum",
    "mu_kl_count",
    "gate_sum",
    "gate_near_zero",
)
_MAXES = ("neg_ratio_min", "ratio_max", "neg_is_weight_min", "is_weight_max")


def policy_loss_func(layout, loss_cfg, temperature, num_sequences, scale, head, mb, logits, *, num_tokens=None):
    """Megatron's loss function of one micro-batch (bind every argument but ``mb`` and ``logits`` with
    ``functools.partial``): the policy loss plus the regularisers, scaled by ``scale``, and the statistics
    :func:`reduce_metrics` sums over micro-batches and ranks."""
    out = microbatch_logprobs(mb, logits, layout, temperature, loss_cfg.needs_entropy, head)
    logp, entropy = out if loss_cfg.needs_entropy else (out, None)
    zero = logp.new_zeros((), dtype=torch.float32)
    weights, off = None, {}
    cp_group = layout.cp_group if layout.cp_size > 1 else None
    if mb.behaviour_logprobs is not None:
        level = algo.RATIO_LEVEL[loss_cfg.variant]
        w, off = algo.off_policy_weights(
            mb.old_logprobs,
            mb.behaviour_logprobs,
            mb.cu_seqlens,
            mb.loss_mask,
            mode=loss_cfg.off_policy.mode,
            cap=loss_cfg.off_policy.cap,
            level=level,
            cp_group=cp_group,
        )
        weights = w if loss_cfg.off_policy.mode != "none" else None
    advantages = mb.token_advantages if mb.token_advantages is not None else mb.advantages
    loss, m = algo.policy_loss(
        logp,
        mb.old_logprobs,
        advantages,
        mb.cu_seqlens,
        mb.loss_mask,
        variant=loss_cfg.variant,
        eps_low=loss_cfg.eps_low,
        eps_high=loss_cfg.eps_high,
        num_sequences=num_sequences,
        num_tokens=num_tokens,
        tau_pos=loss_cfg.sapo_tau_pos,
        tau_neg=loss_cfg.sapo_tau_neg,
        weights=weights,
        cp_group=cp_group,
    )
    extra, r = algo.regularizer_loss(
        logp,
        mb.cu_seqlens,
        mb.loss_mask,
        num_sequences=num_sequences,
        ref_logp=mb.ref_logprobs,
        kl_coef=loss_cfg.kl_coef,
        kl_estimator=loss_cfg.kl_estimator,
        entropy=entropy if loss_cfg.entropy_coef > 0 else None,
        entropy_coef=loss_cfg.entropy_coef,
        cp_group=cp_group,
    )
    loss = loss + extra
    weight = m["num_tokens"] if algo.RATIO_LEVEL[loss_cfg.variant] == "token" else m["num_sequences"]
    none = weight == 0
    # masked (environment, prompt) tokens add nothing, even a non-finite entropy
    entropy_sum = torch.where(mb.loss_mask.bool(), entropy.detach(), 0.0).sum() if entropy is not None else zero
    sums = torch.stack(
        [
            loss.detach(),
            m["clip_fraction"] * m["num_tokens"],
            m["clipped_sequence_fraction"] * m["num_sequences"],
            m["ratio_mean"] * weight,
            weight,
            m["nonfinite_tokens"],
            m["num_tokens"],
            m["num_sequences"],
            entropy_sum,
            r.get("kl_sum", zero),
            *(off.get(k, zero) for k in ("is_weight_sum", "is_weight_count", "is_masked", "mu_kl_sum", "mu_kl_count")),
            *(m.get(k, zero) * m["num_tokens"] for k in ("gate_mean", "gate_near_zero_fraction")),
        ]
    )
    no_w = off.get("is_weight_count", zero) == 0
    maxes = torch.stack(
        [
            torch.where(none, -math.inf, -m["ratio_min"]),
            torch.where(none, -math.inf, m["ratio_max"]),
            torch.where(no_w, -math.inf, -off.get("is_weight_min", zero)),
            torch.where(no_w, -math.inf, off.get("is_weight_max", zero)),
        ]
    )
    return loss * scale, {"sums": sums, "maxes": maxes}


def reduce_metrics(
    store, layout: Layout, *, with_kl: bool = False, with_off_policy: bool = False, with_gate: bool = False
) -> dict[str, float]:
    """The step's metrics from the loss functions' statistics (``store``: the schedule's output), reduced over
    CP, PP and DP; every rank returns them."""
    sums = torch.zeros(len(_SUMS), dtype=torch.float32, device=layout.device)
    maxes = torch.full((len(_MAXES),), -math.inf, dtype=torch.float32, device=layout.device)
    for item in store if layout.is_last_stage else []:
        sums += item["sums"].float()
        maxes = torch.maximum(maxes, item["maxes"].float())
    if layout.cp_size > 1:  # every CP rank holds the complete per-sequence sums, but only its tokens' entropy
        k = _SUMS.index("entropy_sum")
        dist.all_reduce(sums[k : k + 1], group=layout.cp_group)
    for group, size in ((layout.pp_group, layout.pp_size), (layout.dp_group, layout.dp_size)):
        if size > 1:
            dist.all_reduce(sums, group=group)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
    s = dict(zip(_SUMS, sums.tolist()))
    mx = dict(zip(_MAXES, maxes.tolist()))
    ratio_known = s["ratio_weight"] > 0
    out = {
        "loss": s["loss"],
        "clip_fraction": s["clipped_tokens"] / max(s["num_tokens"], 1.0),
        "clipped_sequence_fraction": s["clipped_sequences"] / max(s["num_sequences"], 1.0),
        "ratio_mean": s["ratio_sum"] / s["ratio_weight"] if ratio_known else 1.0,
        "ratio_min": -mx["neg_ratio_min"] if ratio_known else 1.0,
        "ratio_max": mx["ratio_max"] if ratio_known else 1.0,
        "nonfinite_tokens": s["nonfinite_tokens"],
        "num_tokens": s["num_tokens"],
        "num_sequences": s["num_sequences"],
        "entropy": s["entropy_sum"] / max(s["num_tokens"], 1.0),
    }
    if with_off_policy:  # the batch carried behaviour log-probs (see train_step)
        known = s["is_weight_count"] > 0
        out.update(
            is_weight_mean=s["is_weight_sum"] / s["is_weight_count"] if known else 1.0,
            is_weight_min=-mx["neg_is_weight_min"] if known else 1.0,
            is_weight_max=mx["is_weight_max"] if known else 1.0,
            is_masked_fraction=s["is_masked"] / max(s["is_weight_count"], 1.0),
            kl_behaviour_prox=s["mu_kl_sum"] / max(s["mu_kl_count"], 1.0),
        )
    if with_kl:
        out["kl"] = s["kl_sum"] / max(s["num_sequences"], 1.0)
    if with_gate:  # SAPO: its soft gate's mean and how many tokens it nearly shuts (docs/gspo.md)
        out["gate_mean"] = s["gate_sum"] / s["num_tokens"] if s["num_tokens"] > 0 else 1.0
        out["gate_near_zero_fraction"] = s["gate_near_zero"] / max(s["num_tokens"], 1.0)
    return out
