"""Shared-prompt training (gspo_mcore/learner/shared_prefix.py): the star layout's mask, positions and score
index against a plain per-sequence loop, in float64, on a small pure-torch attention model with RoPE; the
detection of units; the refusals.

The model: embedding, two pre-norm-free attention blocks (RoPE applied as Megatron's ``_apply_rotary_pos_emb_bshd``
does, with the embedding of :func:`shared_prefix.rotary_from_positions`), an output head. Run per sample (causal,
positions ``0..L-1``) and in the star layout (the micro-batch's rows, mask and position ids, logits gathered at
``score_index``), it must give the same per-token log-probs and the same gradient of a masked, per-sequence
weighted sum of them (the shape of every policy loss). The break-checks run the same comparison with physical
positions and without the fan-out of the prompt's last position, and must see a difference.
"""

from __future__ import annotations

import types

import pytest
import torch
from helpers import learner_toy as toy

from gspo_mcore.learner import shared_prefix, shared_prefix_thd
from gspo_mcore.learner.batching import TrainSample, build_microbatch

V, D, H, HD = 32, 16, 2, 8


def _params():
    g = torch.Generator().manual_seed(3)
    shapes = dict(emb=(V, D), out=(D, V))
    for layer in range(2):
        shapes.update({f"q{layer}": (D, H * HD), f"k{layer}": (D, H * HD), f"v{layer}": (D, H * HD)})
        shapes[f"o{layer}"] = (H * HD, D)
    return {k: (torch.randn(s, generator=g, dtype=torch.float64) * 0.3).requires_grad_() for k, s in shapes.items()}


ROTARY = types.SimpleNamespace(
    inv_freq=1.0 / (10000 ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD)),
    seq_len_interpolation_factor=None,
    rotary_interleaved=False,
)


def _rope(t, emb):  # t: (S, R, H, HD), emb: (S, R, 1, HD), as Megatron's non-interleaved bshd path
    x1, x2 = t.chunk(2, dim=-1)
    return t * torch.cos(emb) + torch.cat((-x2, x1), dim=-1) * torch.sin(emb)


def _forward(p, tokens, positions, mask, attention=None):
    """Logits ``[R, S, V]`` of rows ``tokens`` ``[R, S]`` at ``positions``; ``mask`` ``[R, 1, S, S]`` True = masked.
    ``attention(q, k, v)`` (``[S, H, HD]`` each, one row) replaces the masked softmax when given."""
    emb = shared_prefix.rotary_from_positions(ROTARY, positions)  # (S, R, 1, HD)
    x = p["emb"][tokens].transpose(0, 1)  # (S, R, D)
    S, R = x.shape[:2]
    for layer in range(2):
        q, k, v = ((x @ p[f"{n}{layer}"]).view(S, R, H, HD) for n in ("q", "k", "v"))  # (S, R, H, HD)
        q, k = _rope(q, emb), _rope(k, emb)
        if attention is not None:
            att = attention(q[:, 0], k[:, 0], v[:, 0]).reshape(S, R, H * HD)
        else:
            scores = torch.einsum("srhd,trhd->rhst", q, k) / HD**0.5
            scores = scores.masked_fill(mask, -1e4)
            att = torch.einsum("rhst,trhd->srhd", scores.softmax(-1), v).reshape(S, R, H * HD)
        x = x + att @ p[f"o{layer}"]
    return (x @ p["out"]).transpose(0, 1)  # (R, S, V)


def _causal(n):
    return ~torch.ones(n, n, dtype=torch.bool).tril()[None, None]


def _per_sample(p, samples, coef):
    """Per sample alone: ``[L-1]`` log-probs and the weighted sum of the counted ones."""
    logps, loss = [], 0.0
    for s, c in zip(samples, coef):
        logits = _forward(p, s.tokens[None], torch.arange(s.length)[None], _causal(s.length))[0, :-1]
        lp = logits.log_softmax(-1).gather(-1, s.tokens[1:, None])[:, 0]
        logps.append(lp)
        loss = loss + c * (lp * s.loss_mask[1:]).sum()
    return logps, loss


def _shared(p, samples, units, coef, packing, *, break_positions=False, break_fanout=False, attention=None):
    mb = shared_prefix.build_shared_microbatch(samples, units, packing=packing)
    positions = mb.position_ids
    if break_positions:  # physical positions: each row's 0..S-1
        positions = torch.arange(positions.shape[1]).expand_as(positions)
    mask = mb.attention_mask if mb.attention_mask is not None else _causal(mb.tokens.shape[1])
    logits = _forward(p, mb.tokens, positions, mask, attention).reshape(-1, V)
    index = mb.score_index if mb.score_index is not None else torch.arange(mb.num_tokens)
    if break_fanout:  # every sample's segment scored at its own physical positions only (no P-1 fan-out)
        index = index.clone()
        starts = mb.cu_seqlens[:-1][torch.tensor(mb.score_starts) > 0]
        index[starts] = index[starts + 1] - 1
    lp = logits[index].log_softmax(-1).gather(-1, mb.targets[:, None])[:, 0]
    seg = torch.repeat_interleave(torch.arange(len(mb.sample_indices)), mb.cu_seqlens.diff())
    c = torch.tensor([coef[i] for i in mb.sample_indices], dtype=torch.float64)[seg]
    loss = (lp * mb.loss_mask * c).sum()
    logps = [None] * len(samples)
    for k, i in enumerate(mb.sample_indices):
        logps[i] = lp[shared_prefix.sample_positions(mb, k, samples[i].length - 1)]
    return logps, loss, mb


def _samples(env_spans=False):
    return [
        TrainSample(tokens=s.tokens % V, loss_mask=s.loss_mask, advantage=s.advantage)
        for s in toy.toy_samples(vocab=V, num_samples=11, prompt_only=(3,), shared_prompts=True, env_spans=env_spans)
    ]


def _compare(samples, units, packing, **breaks):
    p = _params()
    coef = torch.linspace(0.5, 1.5, len(samples), dtype=torch.float64).tolist()
    want, loss_a = _per_sample(p, samples, coef)
    grads_a = torch.autograd.grad(loss_a, list(p.values()))
    got, loss_b, mb = _shared(p, samples, units, coef, packing, **breaks)
    grads_b = torch.autograd.grad(loss_b, list(p.values()))
    logp_diff = max(float((a - b).detach().abs().max()) for a, b in zip(want, got))
    grad_diff = max(float((a - b).abs().max()) for a, b in zip(grads_a, grads_b))
    return logp_diff, float(loss_a - loss_b), grad_diff, mb


@pytest.mark.parametrize("packing", ["padded", "block_diagonal"])
@pytest.mark.parametrize("env_spans", [False, True], ids=["single-turn", "multi-turn"])
@pytest.mark.parametrize("max_tokens", [1000, 30])
def test_star_layout_equals_the_per_sequence_loop(packing, env_spans, max_tokens):
    samples = _samples(env_spans)
    units = shared_prefix.find_units(samples, max_tokens)
    assert any(len(u.samples) > 2 for u in units) or max_tokens < 100
    assert any(u.shared for u in units)
    assert sum(len(u.samples) for u in units) == len(samples)
    logp_diff, loss_diff, grad_diff, mb = _compare(samples, units, packing)
    assert mb.score_index is not None
    assert logp_diff < 1e-12 and abs(loss_diff) < 1e-12 and grad_diff < 1e-12, (logp_diff, loss_diff, grad_diff)


@pytest.mark.parametrize("breaks", [{"break_positions": True}, {"break_fanout": True}], ids=["physical", "no-fanout"])
def test_the_comparison_catches_a_broken_layout(breaks):
    """Physical positions instead of the continued ones, or each sample's first own token scored from the
    position before its suffix (another sample's last token) instead of the prompt's last: both must differ."""
    samples = _samples()
    units = shared_prefix.find_units(samples, 1000)
    logp_diff, _, grad_diff, _ = _compare(samples, units, "padded", **breaks)
    assert logp_diff > 1e-3 and grad_diff > 1e-4, (logp_diff, grad_diff)


def _two_part(samples, units, *, align="bottom_right", gather=True):
    """The two-part attention of :mod:`shared_prefix_thd` for the block-diagonal row of ``units``; the breaks:
    ``align="top_left"`` (causal from each segment's first key) or ``gather=False`` (no K/V gather: the
    physical keys of each query segment only)."""
    layout = shared_prefix_thd.two_part_layout(units, [s.length for s in samples])
    if not gather:
        layout = shared_prefix_thd.TwoPartLayout(
            layout.cu_seqlens_q, layout.cu_seqlens_q, torch.arange(int(layout.cu_seqlens_q[-1])), 0, 0
        )
    if align == "top_left":  # drop the alignment: each segment's keys cut to its query count, from the front
        kv = [
            layout.kv_index[int(layout.cu_seqlens_kv[i]) :][: int(layout.cu_seqlens_q[i + 1] - layout.cu_seqlens_q[i])]
            for i in range(layout.cu_seqlens_q.numel() - 1)
        ]
        layout = shared_prefix_thd.TwoPartLayout(layout.cu_seqlens_q, layout.cu_seqlens_q, torch.cat(kv), 0, 0)
    return lambda q, k, v: shared_prefix_thd.reference_attention(q, k, v, layout, HD**-0.5)


@pytest.mark.parametrize("env_spans", [False, True], ids=["single-turn", "multi-turn"])
@pytest.mark.parametrize("max_tokens", [1000, 30])
def test_two_part_attention_equals_the_per_sequence_loop(env_spans, max_tokens):
    """The GPU form (varlen query / key-value segments, the prompt's K/V gathered before each sample's, causal
    aligned to the bottom right), on the block-diagonal row: the same log-probs and gradients as per sample."""
    samples = _samples(env_spans)
    units = shared_prefix.find_units(samples, max_tokens)
    assert any(u.shared for u in units) and any(not u.shared for u in units)
    attention = _two_part(samples, units)
    logp_diff, loss_diff, grad_diff, _ = _compare(samples, units, "block_diagonal", attention=attention)
    assert logp_diff < 1e-12 and abs(loss_diff) < 1e-12 and grad_diff < 1e-12, (logp_diff, loss_diff, grad_diff)


@pytest.mark.parametrize("breaks", [{"align": "top_left"}, {"gather": False}], ids=["top-left", "no-gather"])
def test_the_two_part_comparison_catches_a_broken_mask(breaks):
    samples = _samples()
    units = shared_prefix.find_units(samples, 1000)
    attention = _two_part(samples, units, **breaks)
    logp_diff, _, grad_diff, _ = _compare(samples, units, "block_diagonal", attention=attention)
    assert logp_diff > 1e-3 and grad_diff > 1e-4, (logp_diff, grad_diff)


def test_two_part_layout_segments():
    """Two shared samples on a 3-token prompt (lengths 5 and 4) and one unshared of 2: the queries keep the
    physical order; each shared sample's keys are the prompt's then its own."""
    units = [
        shared_prefix.Unit(samples=(0, 1), prompt=3, length=6),
        shared_prefix.Unit(samples=(2,), prompt=0, length=2),
    ]
    layout = shared_prefix_thd.two_part_layout(units, [5, 4, 2])
    assert layout.cu_seqlens_q.tolist() == [0, 3, 5, 6, 8]
    assert layout.cu_seqlens_kv.tolist() == [0, 3, 8, 12, 14]
    assert layout.kv_index.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7]
    assert (layout.max_seqlen_q, layout.max_seqlen_kv) == (3, 5)


def test_units_follow_the_prompts():
    samples = _samples()
    units = shared_prefix.find_units(samples, 1000)
    for u in units:
        prompts = {tuple(samples[i].tokens[: shared_prefix.prompt_length(samples[i])].tolist()) for i in u.samples}
        assert len(prompts) == 1
        if u.shared:
            assert u.prompt == shared_prefix.prompt_length(samples[u.samples[0]]) >= shared_prefix.MIN_SHARED
            assert u.length == u.prompt + sum(samples[i].length - u.prompt for i in u.samples)
    # the prompt-only sample (3) shares with nobody: its "prompt" is all of it
    assert next(u for u in units if 3 in u.samples).samples == (3,)
    # a budget cuts a unit into smaller ones, each within it (or one sample alone)
    for u in shared_prefix.find_units(samples, 25):
        assert u.length <= 25 or len(u.samples) == 1


def test_nothing_shared_is_the_plain_layout():
    """Per-sample prompts (as with group size 1): the micro-batch is exactly ``build_microbatch``'s."""
    samples = [
        TrainSample(tokens=s.tokens % V, loss_mask=s.loss_mask, advantage=s.advantage)
        for s in toy.toy_samples(vocab=V, num_samples=6)
    ]
    units = shared_prefix.find_units(samples, 1000)
    assert not any(u.shared for u in units)
    for packing in ("padded", "block_diagonal"):
        a = shared_prefix.build_shared_microbatch(samples, units, packing=packing)
        b = build_microbatch(samples, list(range(len(samples))), packing=packing)
        assert a.score_index is None and a.sample_indices == b.sample_indices
        for name in ("tokens", "position_ids", "targets", "loss_mask", "cu_seqlens"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name


def _fake(cp=1, aux=0.0):
    return dict(
        model=[torch.nn.Linear(1, 1)],
        layout=types.SimpleNamespace(cp_size=cp, rank=0),
        arch=types.SimpleNamespace(router_aux_loss_coef=aux),
    )


def test_resolve_refuses_what_is_not_supported():
    assert shared_prefix.resolve(None, **_fake()) is True
    assert shared_prefix.resolve(False, **_fake()) is False
    assert shared_prefix.resolve(None, **_fake(cp=2)) is False  # auto: off where unsupported
    with pytest.raises(ValueError, match=r"batch\.share_prompt.*parallel\.context=2"):
        shared_prefix.resolve(True, **_fake(cp=2))
    with pytest.raises(ValueError, match=r"batch\.share_prompt.*router_aux_loss_coef"):
        shared_prefix.resolve(True, **_fake(aux=0.01))
    assert shared_prefix.resolve(None, **_fake(aux=0.01)) is False


def test_batch_share_prompt_is_a_config_key():
    from gspo_mcore.config import from_dict
    from gspo_mcore.learner.step import BatchConfig, StepSettings

    assert from_dict(BatchConfig, {"share_prompt": False}).share_prompt is False
    assert BatchConfig().share_prompt is None
    assert StepSettings(batch=BatchConfig(share_prompt=True)).forward_options()["share_prompt"] is True
    assert StepSettings().forward_options()["share_prompt"] is False  # unresolved: off (Learner.build resolves)
