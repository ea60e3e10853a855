"""The learner's batch format and its packing into micro-batches by token budget.

A :class:`TrainSample` is one rollout: ``tokens`` (prompt + response ids), ``loss_mask`` (1 on response tokens),
a scalar ``advantage`` and optionally ``old_logprobs``. The learner scores positions ``0..L-2``: position
``t`` predicts ``tokens[t+1]``, so a sample's log-probs, old log-probs and counted positions are all
aligned with ``tokens[1:]`` (length ``L-1``), and position ``t`` counts when ``loss_mask[t+1] == 1``.

Planning (:func:`plan_microbatches`): samples are spread over data-parallel ranks (balancing tokens),
then packed first-fit-decreasing into micro-batches of at most ``max_tokens`` tokens (padding included).
A sample is never split (a sample longer than the budget gets a micro-batch of its own), and every DP
rank gets the same number of micro-batches (bins are split, or an empty micro-batch is added, to even
the count).

A :class:`MicroBatch` lays its samples out one of three ways (``packing``): on GPU with Transformer
Engine, back to back in one ``[1, T]`` THD packed sequence (``PackedSeqParams`` with ``cu_seqlens``); on
CPU either one right-padded row per sample (``"padded"``, the default: attention costs ``sum L_i^2``)
or back to back in one row with a block-diagonal causal mask (``"block_diagonal"``: no padding, but
attention costs ``T^2``). Either way the loss sees the flattened positions, with ``cu_seqlens``
delimiting the samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class TrainSample:
    """One rollout sample (see the module docstring for the alignment of the per-token fields)."""

    tokens: torch.Tensor
    """``[L]`` int64: prompt + response token ids, ``L >= 2``."""
    loss_mask: torch.Tensor
    """``[L]``: 1 on response tokens (the tokens the policy generated), 0 on prompt/tool tokens."""
    advantage: float
    """The sequence advantage ``A_i``."""
    old_logprobs: torch.Tensor | None = None
    """``[L-1]`` float32: log-prob of ``tokens[1:]`` under the behaviour policy (``None``: the learner
    recomputes it before the first update)."""
    routed_experts: torch.Tensor | None = None
    """MoE only: ``[L, num_layers, topk]`` integer expert ids each token was routed to under the behaviour
    policy (``-1`` in dense layers), replayed by Routing Replay (see :mod:`gspo_mcore.learner.routing`)."""
    token_advantages: torch.Tensor | None = None
    """``[L-1]`` float32 per-token advantages ``A_i,t`` aligned with ``tokens[1:]`` (only the counted positions
    matter), used by ``loss.variant: gspo_token``; ``None``: ``advantage`` on every token."""
    behaviour_logprobs: torch.Tensor | None = None
    """``[L-1]`` float32: the engine's log-probs (the behaviour policy mu) when ``old_logprobs`` holds the
    learner's recompute (pi_prox); set by :func:`~gspo_mcore.learner.step.train_step` for the off-policy
    correction and its metrics."""
    ref_logprobs: torch.Tensor | None = None
    """``[L-1]`` float32: log-probs under the frozen reference policy (for the KL term)."""

    def __post_init__(self):
        if not isinstance(self.tokens, torch.Tensor) or self.tokens.dim() != 1 or self.tokens.dtype != torch.int64:
            raise ValueError("TrainSample.tokens must be a 1-D int64 tensor")
        if self.tokens.shape[0] < 2:
            raise ValueError(
                f"TrainSample.tokens needs at least 2 tokens (prompt and response), got {self.tokens.shape[0]}"
            )
        if not isinstance(self.loss_mask, torch.Tensor) or self.loss_mask.shape != self.tokens.shape:
            raise ValueError(f"TrainSample.loss_mask must have the shape of tokens {tuple(self.tokens.shape)}")
        if self.old_logprobs is not None and (
            not isinstance(self.old_logprobs, torch.Tensor) or self.old_logprobs.shape != (self.tokens.shape[0] - 1,)
        ):
            raise ValueError(
                f"TrainSample.old_logprobs must be [L-1] = [{self.tokens.shape[0] - 1}] (aligned with tokens[1:])"
            )
        for name in ("token_advantages", "behaviour_logprobs", "ref_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, torch.Tensor) or v.shape != (self.tokens.shape[0] - 1,)):
                shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                raise ValueError(
                    f"TrainSample.{name} must be [L-1] = [{self.tokens.shape[0] - 1}] (aligned with tokens[1:]), "
                    f"got {shape}"
                )
        r = self.routed_experts
        if r is not None and (
            not isinstance(r, torch.Tensor)
            or r.dim() != 3
            or r.shape[0] != self.tokens.shape[0]
            or r.is_floating_point()
        ):
            shape = tuple(r.shape) if isinstance(r, torch.Tensor) else type(r).__name__
            raise ValueError(
                f"TrainSample.routed_experts must be an integer [L={self.tokens.shape[0]}, num_layers, topk] "
                f"tensor, got {shape}"
            )

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_response_tokens(self) -> int:
        return int(self.loss_mask[1:].count_nonzero())


def count_sequences(samples) -> int:
    """``N``: the number of samples with at least one counted (response) token."""
    return sum(1 for s in samples if s.num_response_tokens > 0)


def split_minibatches(num_samples: int, num_minibatches: int) -> list[range]:
    """Split ``range(num_samples)`` into ``num_minibatches`` contiguous, near-equal mini-batches."""
    if num_minibatches < 1 or num_minibatches > num_samples:
        raise ValueError(
            f"num_minibatches must be in [1, {num_samples}] (the number of samples), got {num_minibatches}"
        )
    base, extra = divmod(num_samples, num_minibatches)
    out, start = [], 0
    for i in range(num_minibatches):
        size = base + (i < extra)
        out.append(range(start, start + size))
        start += size
    return out


PACKINGS = ("padded", "block_diagonal", "thd")


def plan_microbatches(
    lengths: list[int], *, dp_size: int, max_tokens: int, padded: bool = False
) -> list[list[list[int]]]:
    """Per DP rank, a list of micro-batches, each a list of sample indices; equal counts on all ranks.

    A micro-batch costs the sum of its lengths, or (``padded``) its size times its longest length, and
    holds at most ``max_tokens`` unless one sample alone is longer. Deterministic, so every rank computes
    the same plan without communicating.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    per_rank: list[list[int]] = [[] for _ in range(dp_size)]
    load = [0] * dp_size
    for i in order:  # longest first to the least loaded rank
        r = min(range(dp_size), key=lambda k: (load[k], k))
        per_rank[r].append(i)
        load[r] += lengths[i]
    plans = [_first_fit_decreasing(idx, lengths, max_tokens, padded) for idx in per_rank]
    target = max(len(p) for p in plans)
    for plan in plans:
        while len(plan) < target:
            splittable = [b for b in range(len(plan)) if len(plan[b]) > 1]
            if not splittable:
                plan.append([])  # an empty micro-batch: a masked dummy row
                continue
            b = max(splittable, key=lambda k: (sum(lengths[i] for i in plan[k]), -k))
            bin_ = plan.pop(b)
            half = len(bin_) // 2
            plan[b:b] = [bin_[:half], bin_[half:]]
    return plans


def _first_fit_decreasing(indices, lengths, max_tokens, padded):
    bins: list[list[int]] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        for b in bins:  # samples arrive longest first: a bin's first sample is its longest
            cost = (len(b) + 1) * lengths[b[0]] if padded else sum(lengths[j] for j in b) + lengths[i]
            if cost <= max_tokens:
                b.append(i)
                break
        else:
            bins.append([i])
    return bins


@dataclass
class MicroBatch:
    """Samples of one micro-batch as ``[R, S]`` rows, and their flattened ``[R*S]`` positions for the loss.

    ``"padded"``: one row per sample, right-padded to the longest (causal attention needs no mask: real
    tokens never see the padding). ``"block_diagonal"``: one row, samples back to back, a block-diagonal
    causal mask. ``"thd"``: one row as a Transformer Engine packed sequence. In the flattened positions,
    sample ``k`` starts at ``cu_seqlens[k]``; positions past a sample's end are never counted.
    """

    tokens: torch.Tensor  # (R, S) int64
    position_ids: torch.Tensor  # (R, S) int64, restarting at 0 in every sample
    attention_mask: torch.Tensor | None  # (1, 1, S, S) bool, True = masked out ("block_diagonal" only)
    packed_seq_params: object | None  # Megatron PackedSeqParams ("thd" only)
    targets: torch.Tensor  # (T,) int64: the next token within each sample (0 where nothing follows)
    loss_mask: torch.Tensor  # (T,) float32
    old_logprobs: torch.Tensor  # (T,) float32 (0 where unknown or not counted)
    advantages: torch.Tensor  # (B,) float32
    cu_seqlens: torch.Tensor  # (B+1,) int64 offsets of the samples in [0, T)
    sample_indices: list[int] = field(default_factory=list)
    """Indices of the samples (in the list given to :func:`build_microbatch`), in order."""
    token_advantages: torch.Tensor | None = None
    """(T,) float32 per-token advantages, when some sample carries them (the others' ``advantage`` repeated)."""
    behaviour_logprobs: torch.Tensor | None = None
    """(T,) float32 behaviour (engine) log-probs, when every sample carries them."""
    ref_logprobs: torch.Tensor | None = None
    """(T,) float32 reference-policy log-probs, when every sample carries them."""
    routing: torch.Tensor | None = None
    """Routing Replay target ``[S, R, num_layers, topk]`` int64 in the routers' (sequence-major) token
    order, when every sample carries ``routed_experts``."""
    cp_positions: torch.Tensor | None = None
    """Context parallelism: the positions (into the unsplit micro-batch's ``T``) this CP rank holds, in
    its local order (see :mod:`gspo_mcore.learner.context_parallel`); ``None`` when not split."""
    unsplit_cu_seqlens: torch.Tensor | None = None
    """Context parallelism: the unsplit micro-batch's ``cu_seqlens``."""
    score_index: torch.Tensor | None = None
    """Shared prompts (:mod:`gspo_mcore.learner.shared_prefix`): ``(T,)`` int64, the physical position (into the
    flattened ``R*S`` rows) of each of the ``T`` scored positions; ``None``: the first ``T`` row positions."""
    score_starts: list[int] | None = None
    """Shared prompts: per sample, the sample position its segment starts at (``P-1`` for a unit's samples after
    the first, 0 otherwise)."""
    prompt_sources: list[int] | None = None
    """Shared prompts: per sample, the sample (its order in the micro-batch) whose segment holds its prompt."""

    @property
    def num_tokens(self) -> int:
        """``T``: the flattened positions the loss sees (the first ``T`` of the ``R*S`` row positions, or those
        ``score_index`` names)."""
        return int(self.targets.shape[0])


def build_microbatch(
    samples,
    indices: list[int],
    *,
    packing: str = "padded",
    pad_multiple: int = 1,
    segment_multiple: int = 1,
    device: torch.device | str = "cpu",
    num_experts: int | None = None,
) -> MicroBatch:
    """Lay out ``samples[i] for i in indices`` as one micro-batch; empty ``indices`` give a masked dummy.

    ``pad_multiple``: the row length is padded to a multiple of it (sequence parallelism needs TP, context
    parallelism 2 * CP). ``segment_multiple`` (``"thd"`` with context parallelism: 2 * CP): every sample's
    segment is padded to a multiple of it (masked positions after its last token). ``num_experts``: the MoE
    model's expert count, needed when the samples carry ``routed_experts`` (the replay target's placeholders
    for padding are spread over all experts).
    """
    if packing not in PACKINGS:
        raise ValueError(f"packing must be one of {PACKINGS}, got {packing!r}")
    chosen = [samples[i] for i in indices]
    if chosen:
        seqs = [(s.tokens, s.loss_mask[1:].float(), s.old_logprobs, float(s.advantage)) for s in chosen]
    else:
        seqs = [(torch.zeros(2, dtype=torch.int64), torch.zeros(1), None, 0.0)]
    if segment_multiple > 1 and packing != "padded":
        seqs = [_pad_sample(t, m, o, a, segment_multiple) for t, m, o, a in seqs]
    lengths = [t.shape[0] for t, *_ in seqs]
    # per sample, its positions: target = next token, mask/old log-prob of that token, 0 at the end
    targets = [torch.cat([t[1:], t.new_zeros(1)]) for t, *_ in seqs]
    masks = [torch.cat([m, torch.zeros(1)]) for _, m, _, _ in seqs]
    olds = [
        torch.cat([o.float() if o is not None else torch.zeros(n - 1), torch.zeros(1)]) * (m > 0)
        for (_, _, o, _), n, m in zip(seqs, lengths, masks)
    ]
    advantages = torch.tensor([a for *_, a in seqs], dtype=torch.float32)
    extra = {
        name: _token_field(chosen, name, masks)
        for name in ("behaviour_logprobs", "ref_logprobs")
        if chosen and all(getattr(s, name) is not None for s in chosen)
    }
    if any(s.token_advantages is not None for s in chosen):
        extra["token_advantages"] = [
            torch.cat(
                [
                    s.token_advantages.float() if s.token_advantages is not None else torch.full((n - 1,), a),
                    torch.zeros(n - (s.token_advantages.shape[0] if s.token_advantages is not None else n - 1)),
                ]
            )
            * (m > 0)
            for s, n, m, a in zip(chosen, lengths, masks, advantages.tolist())
        ]
    attention_mask = packed = None
    routed = [s.routed_experts for s in chosen]
    if packing == "padded":
        width = _round_up(max(lengths), pad_multiple)
        pad = [width - n for n in lengths]
        tokens = torch.stack([torch.cat([t, t.new_zeros(p)]) for (t, *_), p in zip(seqs, pad)])  # (R, S)
        position_ids = torch.arange(width).expand(len(seqs), width)
        targets, masks, olds = (
            [torch.cat([x, x.new_zeros(p)]) for x, p in zip(xs, pad)] for xs in (targets, masks, olds)
        )
        extra = {k: [torch.cat([x, x.new_zeros(p)]) for x, p in zip(xs, pad)] for k, xs in extra.items()}
        cu = torch.arange(len(seqs) + 1, dtype=torch.int64) * width
    else:
        total = sum(lengths)
        pad = _round_up(total, pad_multiple) - total
        seg_lengths = lengths + ([pad] if pad else [])
        tokens = torch.cat([t for t, *_ in seqs] + [torch.zeros(pad, dtype=torch.int64)])[None]  # (1, S)
        position_ids = torch.cat([torch.arange(n) for n in seg_lengths])[None]
        cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
        if packing == "thd":
            from megatron.core.packed_seq_params import PackedSeqParams

            cu32 = torch.tensor([0] + seg_lengths, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)
            packed = PackedSeqParams(
                qkv_format="thd",
                cu_seqlens_q=cu32,
                cu_seqlens_kv=cu32,
                max_seqlen_q=max(seg_lengths),
                max_seqlen_kv=max(seg_lengths),
            )
        else:
            attention_mask = block_causal_mask(seg_lengths).to(device)
    routing = None
    if chosen and all(r is not None for r in routed):
        from gspo_mcore.learner.routing import microbatch_routing

        if num_experts is None:
            raise ValueError(
                "build_microbatch: samples carry routed_experts, so num_experts (the MoE model's) is needed"
            )
        routing = microbatch_routing(
            routed,
            lengths,
            packing=packing,
            width=int(tokens.shape[-1]),
            topk=int(routed[0].shape[-1]),
            num_experts=num_experts,
        ).to(device)
    return MicroBatch(
        tokens=tokens.contiguous().to(device),
        position_ids=position_ids.contiguous().to(device),
        attention_mask=attention_mask,
        packed_seq_params=packed,
        targets=torch.cat(targets).to(device),
        loss_mask=torch.cat(masks).to(device),
        old_logprobs=torch.cat(olds).to(device),
        advantages=advantages.to(device),
        cu_seqlens=cu.to(device),
        **{k: torch.cat(xs).to(device) for k, xs in extra.items()},
        sample_indices=list(indices),
        routing=routing,
    )


def _token_field(chosen, name, masks):
    """Per sample, its ``[L-1]`` field at its ``len(mask)`` positions (0 at the end, where not counted and in
    any segment padding)."""
    out = []
    for s, m in zip(chosen, masks):
        x = getattr(s, name).float()
        out.append(torch.cat([x, x.new_zeros(m.shape[0] - x.shape[0])]) * (m > 0))
    return out


def _pad_sample(tokens, mask, old, advantage, multiple):
    """A sample's fields padded to a length that is a multiple of ``multiple`` (padding never counts)."""
    pad = _round_up(tokens.shape[0], multiple) - tokens.shape[0]
    if not pad:
        return tokens, mask, old, advantage
    old = None if old is None else torch.cat([old.float(), torch.zeros(pad)])
    return torch.cat([tokens, tokens.new_zeros(pad)]), torch.cat([mask, mask.new_zeros(pad)]), old, advantage


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def block_causal_mask(seg_lengths: list[int]) -> torch.Tensor:
    """``[1, 1, T, T]`` bool, True where attention is NOT allowed: causal within each segment only."""
    seg = torch.repeat_interleave(torch.arange(len(seg_lengths)), torch.tensor(seg_lengths))  # (T,)
    pos = torch.arange(seg.shape[0])
    allowed = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    return (~allowed)[None, None]
