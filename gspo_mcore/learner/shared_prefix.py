"""Shared-prompt training: the samples of a group that share a prompt run it through the model once.

Detection (:func:`find_units`, no group ids needed): a sample's prompt is its tokens before the first counted
token (``loss_mask == 1``); samples of the mini-batch with the same prompt (at least :data:`MIN_SHARED`
tokens, and at least one token after it) form a *unit*. Everything after the prompt (the response, and in a
multi-turn episode the environment's spans, masked as always) stays per sample. A unit longer than the
micro-batch budget is cut into smaller units, each with its own copy of the prompt; a sample that shares with
nobody is a unit of its own, laid out as without sharing.

Layout ("star", :func:`build_shared_microbatch`): a shared unit is one physical sequence, the prompt's ``P``
tokens, then sample 1's tokens ``P..L1-1``, then sample 2's ``P..L2-1``, ...; its position ids are ``0..P-1``
then ``P..Lk-1`` for every suffix (RoPE sees each sample's own positions: :func:`explicit_positions`). In the
mask (True = masked) the prompt is causal and each suffix sees the whole prompt and, causally, itself. With
``"padded"`` packing every unit is a row (``[R, 1, S, S]`` mask), with ``"block_diagonal"`` the units lie back
to back in one row (``[1, 1, S, S]``).

Scoring: the per-token fields (targets, loss mask, old / behaviour / reference log-probs, token advantages) are
laid out per sample as without sharing (``cu_seqlens``), except that a unit's other samples start at their
position ``P-1`` (the prompt's last token, which predicts each sample's own first token). ``MicroBatch.score_index``
maps every such position to its physical position, so the loss gathers ``logits[score_index]``: position ``P-1``
fans out to every sample of the unit, and the prompt's positions before it are scored once (their loss mask is
0 in every sample). GSPO's per-sequence sums, length normalisation and token masks are unchanged, and the
gradients of all samples flow into the one copy of the prompt.

Not supported (refused naming ``batch.share_prompt``): Transformer Engine (THD packing), context parallelism,
and a MoE auxiliary loss (it would see the prompt once instead of once per sample). With Routing Replay the
prompt's experts are those of the unit's first sample (identical in every sample of the unit: same tokens,
same prefix).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, replace

import torch

logger = logging.getLogger(__name__)

MIN_SHARED = 2
"""The shortest prompt worth sharing (a 1-token prompt saves nothing)."""


@dataclass(frozen=True)
class Unit:
    """Samples laid out together: ``samples`` (indices into the sample list) sharing their first ``prompt``
    tokens (``prompt == 0``: one sample, not shared)."""

    samples: tuple[int, ...]
    prompt: int
    length: int
    """Tokens the unit occupies: ``P + sum(Lk - P)``, or the sample's length."""

    @property
    def shared(self) -> bool:
        return self.prompt > 0


def prompt_length(sample) -> int:
    """The tokens before the sample's first counted token (its whole length when none counts)."""
    counted = sample.loss_mask[1:].nonzero()
    return int(counted[0]) + 1 if counted.numel() else sample.length


def find_units(samples, max_tokens: int) -> list[Unit]:
    """The samples as units, in the order of their first sample; every sample in exactly one unit."""
    buckets: dict[tuple, list[int]] = {}
    units: list[tuple[int, Unit | None]] = []  # (first sample, unit) or a bucket's key order
    keys: list[tuple[int, tuple]] = []
    for i, s in enumerate(samples):
        p = prompt_length(s)
        if p < MIN_SHARED or p >= s.length:
            units.append((i, Unit((i,), 0, s.length)))
            continue
        key = (p, tuple(s.tokens[:p].tolist()))
        if key not in buckets:
            buckets[key] = []
            keys.append((i, key))
        buckets[key].append(i)
    for _, key in keys:
        p = key[0]
        for chunk in _chunks(buckets[key], p, [samples[i].length for i in buckets[key]], max_tokens):
            if len(chunk) == 1:
                units.append((chunk[0], Unit((chunk[0],), 0, samples[chunk[0]].length)))
            else:
                units.append((chunk[0], Unit(tuple(chunk), p, p + sum(samples[i].length - p for i in chunk))))
    return [u for _, u in sorted(units, key=lambda x: x[0])]


def _chunks(members, p, lengths, max_tokens):
    """``members`` cut greedily (in order) into runs whose shared layout fits ``max_tokens``."""
    out, cur, cost = [], [], p
    for i, n in zip(members, lengths):
        if cur and cost + n - p > max_tokens:
            out.append(cur)
            cur, cost = [], p
        cur.append(i)
        cost += n - p
    out.append(cur)
    return out


def _tail(sample, start: int):
    """The sample's per-token fields from position ``start`` on (the part its score segment holds)."""
    sample = replace(sample, routed_experts=None)
    if start == 0:
        return sample
    cut = {
        name: getattr(sample, name)[start:]
        for name in ("old_logprobs", "token_advantages", "behaviour_logprobs", "ref_logprobs")
        if getattr(sample, name) is not None
    }
    return replace(sample, tokens=sample.tokens[start:], loss_mask=sample.loss_mask[start:], **cut)


def build_shared_microbatch(
    samples,
    units: list[Unit],
    *,
    packing: str = "padded",
    pad_multiple: int = 1,
    device: torch.device | str = "cpu",
    num_experts: int | None = None,
):
    """Lay out ``units`` as one micro-batch (see the module docstring); without a shared unit, exactly
    :func:`~gspo_mcore.learner.batching.build_microbatch` of their samples."""
    from gspo_mcore.learner.batching import _round_up, build_microbatch

    order = [i for u in units for i in u.samples]
    if not any(u.shared for u in units):
        return build_microbatch(
            samples, order, packing=packing, pad_multiple=pad_multiple, device=device, num_experts=num_experts
        )
    if packing not in ("padded", "block_diagonal"):
        raise ValueError(f"batch.share_prompt needs packing 'padded' or 'block_diagonal', got {packing!r}")
    starts, sources, local, seqs = [], [], [], []  # per sample; per unit: (tokens, positions, segments, routing)
    for u in units:
        first = len(starts)
        if not u.shared:
            s = samples[u.samples[0]]
            starts.append(0)
            sources.append(first)
            local.append(torch.arange(s.length))
            seqs.append((s.tokens, torch.arange(s.length), torch.zeros(s.length, dtype=torch.int64), s.routed_experts))
            continue
        p, head = u.prompt, samples[u.samples[0]]
        tokens, positions, segments = [head.tokens[:p]], [torch.arange(p)], [torch.zeros(p, dtype=torch.int64)]
        routed = [None if head.routed_experts is None else head.routed_experts[:p]]
        offset = p
        for k, i in enumerate(u.samples):
            s, n = samples[i], samples[i].length - p
            tokens.append(s.tokens[p:])
            positions.append(torch.arange(p, s.length))
            segments.append(torch.full((n,), k + 1, dtype=torch.int64))
            routed.append(None if s.routed_experts is None else s.routed_experts[p:])
            starts.append(0 if k == 0 else p - 1)
            sources.append(first)
            # the first sample's positions are the unit's first Lk; the others' start at the prompt's last token
            local.append(
                torch.arange(s.length) if k == 0 else torch.cat([torch.tensor([p - 1]), offset + torch.arange(n)])
            )
            offset += n
        unit_routing = None if any(r is None for r in routed) else torch.cat(routed)
        seqs.append((torch.cat(tokens), torch.cat(positions), torch.cat(segments), unit_routing))
    lengths = [t.shape[0] for t, *_ in seqs]
    scores = build_microbatch(
        [_tail(samples[i], st) for i, st in zip(order, starts)], list(range(len(order))), packing="thd", device=device
    )
    unit_of = [j for j, u in enumerate(units) for _ in u.samples]
    if packing == "padded":
        width = _round_up(max(lengths), pad_multiple)
        rows = [_row([seq], width) for seq in seqs]
        bases = [j * width for j in range(len(seqs))]
    else:
        width = _round_up(sum(lengths), pad_multiple)
        rows = [_row(seqs, width)]
        bases = torch.tensor([0] + lengths[:-1]).cumsum(0).tolist()
    score_index = torch.cat([bases[unit_of[k]] + idx for k, idx in enumerate(local)])
    routing = None
    if all(r is not None for *_, r in seqs):
        from gspo_mcore.learner.routing import microbatch_routing

        if num_experts is None:
            raise ValueError("build_shared_microbatch: samples carry routed_experts, so num_experts is needed")
        routing = microbatch_routing(
            [r for *_, r in seqs],
            lengths,
            packing=packing,
            width=width,
            topk=int(seqs[0][3].shape[-1]),
            num_experts=num_experts,
        ).to(device)
    return replace(
        scores,
        tokens=torch.stack([r[0] for r in rows]).to(device),
        position_ids=torch.stack([r[1] for r in rows]).to(device),
        attention_mask=torch.stack([r[2] for r in rows])[:, None].to(device),
        packed_seq_params=None,
        sample_indices=order,
        routing=routing,
        score_index=score_index.to(device),
        score_starts=starts,
        prompt_sources=sources,
    )


def _row(seqs, width):
    """One physical row of ``seqs`` (``(tokens, positions, segments, _)`` each) right-padded to ``width``:
    tokens, position ids, and the ``[S, S]`` mask (True = masked): within one sequence, causal, a segment sees
    the prompt (segment 0) and itself; padding sees only padding."""
    n = sum(t.shape[0] for t, *_ in seqs)
    pad = width - n
    tokens = torch.cat([t for t, *_ in seqs] + [torch.zeros(pad, dtype=torch.int64)])
    positions = torch.cat([p for _, p, *_ in seqs] + [torch.arange(pad)])
    segments = torch.cat([s for *_, s, _ in seqs] + [torch.zeros(pad, dtype=torch.int64)])
    owner = torch.repeat_interleave(torch.arange(len(seqs) + 1), torch.tensor([t.shape[0] for t, *_ in seqs] + [pad]))
    q = torch.arange(width)
    allowed = (
        (owner[:, None] == owner[None, :])
        & (q[None, :] <= q[:, None])
        & ((segments[None, :] == 0) | (segments[None, :] == segments[:, None]))
    )
    return tokens, positions, ~allowed


def sample_positions(mb, k: int, length: int) -> torch.Tensor:
    """Where sample ``k`` of ``mb`` (its order in ``mb.sample_indices``) has its ``length`` positions in the
    micro-batch's score layout (``[T]``): its own segment, after its unit's prompt positions when shared."""
    cu = int(mb.cu_seqlens[k])
    start = mb.score_starts[k] if mb.score_starts is not None else 0
    own = cu + torch.arange(length - start)
    if start == 0:
        return own
    return torch.cat([int(mb.cu_seqlens[mb.prompt_sources[k]]) + torch.arange(start), own])


def rotary_from_positions(rotary, position_ids: torch.Tensor) -> torch.Tensor:
    """Megatron's rotary embedding (``[S, R, 1, dim]``) at explicit per-row positions ``[R, S]``: the frequencies
    of position ``p`` are ``p * inv_freq``, exactly as Megatron computes them for ``0..S-1``."""
    inv_freq = rotary.inv_freq.to(position_ids.device)
    seq = position_ids.to(inv_freq.dtype)
    if rotary.seq_len_interpolation_factor is not None:
        seq = seq * (1 / rotary.seq_len_interpolation_factor)
    freqs = seq[..., None] * inv_freq  # (R, S, dim/2)
    if rotary.rotary_interleaved:
        emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb.transpose(0, 1)[:, :, None, :].contiguous()


@contextlib.contextmanager
def explicit_positions(model_chunk, position_ids: torch.Tensor):
    """While active, the chunk's ``GPTModel`` applies RoPE at ``position_ids`` (``[R, S]``) instead of
    ``0..S-1`` (Megatron-Core's ``GPTModel`` uses ``position_ids`` only for learned absolute embeddings)."""
    from gspo_mcore.learner.model import unwrap

    gpt = unwrap(model_chunk)
    if getattr(gpt, "position_embedding_type", None) != "rope":
        raise ValueError("batch.share_prompt needs a RoPE model")
    original = gpt._preprocess

    def preprocess(*args, **kwargs):
        out = original(*args, **kwargs)
        return (out[0], rotary_from_positions(gpt.rotary_pos_emb, position_ids), *out[2:])

    gpt._preprocess = preprocess
    try:
        yield
    finally:
        del gpt._preprocess


def resolve(requested: bool | None, *, model, layout, arch) -> bool:
    """Whether to share prompts: ``requested`` (``batch.share_prompt``) checked against what the model and the
    layout support; ``None`` turns it on wherever supported (one logged line where not). Refuses ``True`` where
    it is not supported, naming the keys."""
    from gspo_mcore.learner.schedule import uses_transformer_engine

    reasons = []
    if uses_transformer_engine(model):
        reasons.append("the Transformer Engine layer spec (THD packing) is not supported yet")
    if layout.cp_size > 1:
        reasons.append(f"parallel.context={layout.cp_size} is not supported (the CP split assumes linear sequences)")
    if getattr(arch, "router_aux_loss_coef", 0.0) > 0:
        reasons.append(
            f"router_aux_loss_coef={arch.router_aux_loss_coef} (the model's config.json): the MoE auxiliary loss "
            "would see each shared prompt once instead of once per sample"
        )
    if not reasons:
        return requested is not False
    if requested:
        raise ValueError("batch.share_prompt=true: " + "; ".join(reasons) + " (set batch.share_prompt: false)")
    if requested is None and layout.rank == 0:
        logger.info("batch.share_prompt: off, %s", "; ".join(reasons))
    return False
