"""From a rollout batch (groups of engine samples) to what the reward and the learner take.

Pure functions of the samples: decoding for the reward, DAPO's overlong shaping of the rewards, and the
learner's :class:`~gspo_mcore.learner.TrainSample` rows with their advantages and behaviour log-probs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gspo_mcore.algo.length_penalty import LengthPenaltyConfig, length_penalties
from gspo_mcore.learner.batching import TrainSample
from gspo_mcore.rollout.types import Sample


def decode_responses(groups: Sequence[Sequence[Sample]], tokenizer) -> list[str]:
    """The response text of every sample, group after group (special tokens such as EOS dropped); for a
    multi-turn episode, its final policy turn."""
    return [
        tokenizer.decode(
            list(s.episode.final_turn if s.episode is not None else s.response_ids), skip_special_tokens=True
        )
        for g in groups
        for s in g
    ]


def episode_rewards(groups: Sequence[Sequence[Sample]]) -> torch.Tensor:
    """The environments' own reward terms per sample, ``(num_groups * G,)`` (0 for single-turn samples)."""
    return torch.tensor(
        [s.episode.env_reward if s.episode is not None else 0.0 for g in groups for s in g], dtype=torch.float32
    )


def episode_metrics(groups: Sequence[Sequence[Sample]], *, max_error_fraction: float) -> dict[str, float]:
    """Multi-turn episodes' figures (empty without episodes): turns, tool calls and errors, environment
    seconds per episode; policy and environment tokens; the fraction ended by each cause; environment errors
    per cause; requests per field an agent endpoint let through unhonoured (``episode_ignored_fields/<field>``).
    More than ``max_error_fraction`` of the episodes ended by an environment error stops the run (``RuntimeError``
    naming the first such episode and its cause)."""
    eps = [(s, s.episode) for g in groups for s in g if s.episode is not None]
    if not eps:
        return {}
    n = len(eps)
    out = {
        "episode_turns_mean": sum(e.turns for _, e in eps) / n,
        "episode_tool_calls_mean": sum(e.tool_calls for _, e in eps) / n,
        "episode_tool_errors_mean": sum(e.tool_errors for _, e in eps) / n,
        "episode_env_s_mean": sum(e.env_s for _, e in eps) / n,
        "episode_policy_tokens_mean": sum(e.policy_tokens for _, e in eps) / n,
        "episode_env_tokens_mean": sum(e.env_tokens for _, e in eps) / n,
        "episode_tool_use_fraction": sum(e.tool_calls > 0 for _, e in eps) / n,
    }
    for end in ("done", "max_turns", "max_total_tokens", "error"):
        out[f"episode_end_{end}"] = sum(e.end == end for _, e in eps) / n
    for _, e in eps:  # request fields an agent endpoint let through unhonoured (rollout.env_kwargs.ignore_fields)
        for name, count in (getattr(e, "ignored_fields", None) or {}).items():
            out[f"episode_ignored_fields/{name}"] = out.get(f"episode_ignored_fields/{name}", 0) + count
    errors = [(s, e) for s, e in eps if e.end == "error"]
    for _, e in errors:
        cause = (e.error or "unknown").split(":")[0]
        out[f"episode_env_errors/{cause}"] = out.get(f"episode_env_errors/{cause}", 0) + 1
    if errors and len(errors) / n > max_error_fraction:
        s, e = errors[0]
        raise RuntimeError(
            f"{len(errors)} of {n} episodes ended by an environment error, more than reward.max_error_fraction="
            f"{max_error_fraction}; e.g. episode (prompt {s.prompt_index}, sample {s.sample_index}): {e.error}"
        )
    return out


def overlong_penalties(
    groups: Sequence[Sequence[Sample]], *, max_new_tokens: int, buffer: int, penalty: float
) -> torch.Tensor:
    """DAPO's soft overlong punishment per sample, ``(num_groups * G,)``: 0 up to ``max_new_tokens - buffer``
    tokens, then falling linearly to ``-penalty`` at ``max_new_tokens``. All zeros when ``buffer == 0``."""
    lengths = torch.tensor([len(s.response_ids) for g in groups for s in g], dtype=torch.float32)
    if buffer == 0:
        return torch.zeros_like(lengths)
    excess = (lengths - (max_new_tokens - buffer)).clamp(min=0)
    return -penalty * excess / buffer


def episode_counts(groups: Sequence[Sequence[Sample]]) -> dict[str, torch.Tensor]:
    """Per sample, ``(num_groups * G,)`` each: policy tokens, policy turns and tool calls (a single-turn response:
    its tokens, one turn, no call)."""
    samples = [s for g in groups for s in g]
    return {
        "token": torch.tensor([s.episode.policy_tokens if s.episode else len(s.response_ids) for s in samples]),
        "turn": torch.tensor([s.episode.turns if s.episode else 1 for s in samples]),
        "tool_call": torch.tensor([s.episode.tool_calls if s.episode else 0 for s in samples]),
    }


def length_penalty_terms(
    groups: Sequence[Sequence[Sample]], group_size: int, config: LengthPenaltyConfig
) -> dict[str, torch.Tensor]:
    """``rollout.length_penalty``'s terms per sample (float64 ``(num_groups * G,)`` each); empty when it is off."""
    if not config.enabled:
        return {}
    return length_penalties(episode_counts(groups), group_size, config)


def length_penalty_metrics(terms: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each term's mean over the batch (``length_penalty/<term>_mean``), their sum's, and the share of samples
    that paid anything (``length_penalty/charged_fraction``)."""
    if not terms:
        return {}
    total = sum(terms.values())
    out = {f"length_penalty/{name}_mean": float(t.mean()) for name, t in terms.items()}
    out["length_penalty/total_mean"] = float(total.mean())
    out["length_penalty/charged_fraction"] = float((total < 0).double().mean())
    return out


def staleness_metrics(groups: Sequence[Sequence[Sample]], current_version: int) -> dict[str, float]:
    """The weight-version lag of the batch: ``staleness_max``, ``staleness_mean`` and a histogram
    ``staleness_lag_<k>`` (the fraction of samples made by weights ``k`` versions older than
    ``current_version``, the version the learner trains; a sample's lag is its oldest token's). With
    partial rollouts also ``partial_samples_fraction`` (samples with tokens of more than one version) and
    ``partial_newer_token_fraction`` (the batch's response tokens made by a newer version than their
    sample's oldest)."""
    lags = [current_version - s.weight_version for g in groups for s in g]
    if not lags:
        return {}
    out = {"staleness_max": float(max(lags)), "staleness_mean": sum(lags) / len(lags)}
    for k in sorted(set(lags)):
        out[f"staleness_lag_{k}"] = lags.count(k) / len(lags)
    # partial rollouts: responses continued across a weight update (tokens of more than one version)
    spanning = [s for g in groups for s in g if getattr(s, "token_versions", None) is not None]
    if spanning:
        out["partial_samples_fraction"] = len(spanning) / len(lags)
        newer = sum(sum(v != s.weight_version for v in s.token_versions) for s in spanning)
        out["partial_newer_token_fraction"] = newer / max(sum(len(s.response_ids) for g in groups for s in g), 1)
    return out


def token_advantages(
    advantage: float, shaping: Sequence[float] | None, num_prompt: int, num_response: int, where: str
) -> torch.Tensor | None:
    """``A_i,t = A_i + d_i,t`` aligned with ``tokens[1:]`` (``[p + r - 1]``): the group-normalised sequence
    advantage plus the per-response-token shaping term ``d`` (not normalised); ``None`` without ``d``."""
    if shaping is None:
        return None
    d = torch.as_tensor(shaping, dtype=torch.float32).reshape(-1)
    if d.shape[0] != num_response:
        raise ValueError(f"{where}: {d.shape[0]} per-token advantages for {num_response} response tokens")
    if not bool(torch.isfinite(d).all()):
        raise ValueError(f"{where}: per-token advantages must be finite")
    return torch.cat([torch.full((num_prompt - 1,), float(advantage)), float(advantage) + d])


def learner_samples(
    groups: Sequence[Sequence[Sample]],
    advantages: torch.Tensor,
    keep: torch.Tensor,
    *,
    mask_truncated: bool = False,
    token_shaping: Sequence[Sequence[float] | None] | None = None,
    dense_layers: Sequence[int] = (),
) -> tuple[list[TrainSample], int]:
    """The learner's samples of the kept groups, and how many responses were left out of the loss.

    ``advantages``: ``(num_groups * G,)``; ``keep``: ``(num_groups,)`` bool. Left out: responses with no
    token (an engine that returned nothing, e.g. an aborted request: they have nothing to train on) and,
    with ``mask_truncated``, responses cut at the length limit. Their group's advantages were taken with
    them, as the rewards were observed.

    ``token_shaping``: per sample (``num_groups * G``, group after group), ``None`` or one term per response
    token ``d_i,t``; the sample then carries ``token_advantages`` ``A_i + d_i,t`` (GSPO-token, docs/loss.md).
    A list of the wrong length fails naming the sample.

    Samples whose engine returned ``routed_experts`` (R3) keep them, with ``-1`` in ``dense_layers`` (the
    layers without a router, whatever the engine reported for them).
    """
    out, left_out = [], 0
    flat_adv = advantages.view(len(groups), -1)
    G = flat_adv.shape[1]
    if token_shaping is not None and len(token_shaping) != flat_adv.numel():
        raise ValueError(f"token_shaping has {len(token_shaping)} entries for {flat_adv.numel()} samples")
    for g, group in enumerate(groups):
        if not bool(keep[g]):
            continue
        for j, s in enumerate(group):
            if not s.response_ids or (mask_truncated and s.finish_reason == "length"):
                left_out += 1
                continue
            p, r = len(s.prompt_ids), len(s.response_ids)
            tokens = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)  # (p + r,)
            # (p + r,): 1 on the tokens the policy sampled (a multi-turn episode's environment spans are 0)
            response_mask = (
                torch.ones(r) if s.response_mask is None else torch.tensor(s.response_mask, dtype=torch.float32)
            )
            mask = torch.cat([torch.zeros(p), response_mask])
            # the engine's log-probs, aligned with tokens[1:]; with old_logprobs=recompute the learner
            # replaces them before the first update and reports the mismatch
            old = torch.cat([torch.zeros(p - 1), torch.tensor(s.response_logprobs, dtype=torch.float32)])
            adv = float(flat_adv[g, j])
            tok_adv = token_advantages(
                adv,
                token_shaping[g * G + j] if token_shaping is not None else None,
                p,
                r,
                where=f"sample (prompt {s.prompt_index}, sample {s.sample_index})",
            )
            routed = s.routed_experts
            if routed is not None and len(dense_layers):
                routed = routed.clone()
                routed[:, list(dense_layers)] = -1
            out.append(
                TrainSample(
                    tokens=tokens,
                    loss_mask=mask,
                    advantage=adv,
                    old_logprobs=old,
                    token_advantages=tok_adv,
                    routed_experts=routed,
                )
            )
    return out, left_out
