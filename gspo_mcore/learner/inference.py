"""The learner's own model as a sampler, for the in-process rollout engine.

:func:`decode_model` returns what :class:`gspo_mcore.rollout.inprocess.InProcessEngine` samples from, over the
live ``GPTModel`` of this rank: a prefill of left-padded prompts, then one token per step over a KV cache
(:class:`MegatronDecodeModel`). :func:`logits_fn` returns ``tokens [B, L] -> logits
[B, L, V]`` (float32 on the CPU), one full causal forward, for the recompute baseline and for tests.
Unlike training, the vocabulary-parallel logits ARE gathered over the tensor-parallel group here:
sampling needs the whole distribution. Every rank of the TP group must make the same calls with the
same tokens. Pipeline parallelism is not supported for in-process sampling (use SGLang for PP > 1).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from gspo_mcore.learner.model import unwrap
from gspo_mcore.learner.parallel import Layout


def logits_fn(model, layout: Layout):
    """A callable for :class:`gspo_mcore.rollout.InProcessEngine` bound to ``model`` (Megatron's list)."""
    if layout.pp_size > 1:
        raise ValueError(
            f"in-process sampling needs pipeline parallel size 1, got {layout.pp_size}; "
            "use the SGLang engine with pipeline parallelism"
        )
    if len(model) != 1:
        raise ValueError("in-process sampling needs a single model chunk (no virtual pipeline stages)")
    gpt = unwrap(model[0])
    if layout.cp_size > 1:
        raise ValueError(
            f"full-recompute in-process sampling does not split over context-parallel ranks (CP={layout.cp_size}); "
            "use the KV-cache decode model (decode_model(kv_cache=True)), which runs whole sequences on every CP rank"
        )
    pad_multiple = layout.tp_size if gpt.config.sequence_parallel else 1

    @torch.no_grad()
    def fn(tokens: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        B, L = tokens.shape
        width = -(-L // pad_multiple) * pad_multiple  # right padding keeps causal outputs unchanged
        padded = torch.zeros((B, width), dtype=torch.long)
        padded[:, :L] = tokens
        padded = padded.to(layout.device)
        positions = torch.arange(width, device=layout.device).expand(B, width)
        mask = torch.triu(torch.ones(width, width, dtype=torch.bool, device=layout.device), diagonal=1)
        was_training = gpt.training
        gpt.eval()
        try:
            logits = gpt(padded, positions, mask[None, None])  # (B, W, V/TP)
        finally:
            gpt.train(was_training)
        if layout.tp_size > 1:
            logits = gather_from_tensor_model_parallel_region(logits)  # (B, W, V)
        return logits[:, :L].float().cpu()

    return fn


def decode_model(model, layout: Layout, *, kv_cache: bool = True):
    """A :class:`gspo_mcore.rollout.inprocess.DecodeModel` over the live ``GPTModel`` of this rank.

    ``kv_cache=True``: :class:`MegatronDecodeModel` (prefill, then one token per step over a KV
    cache). ``kv_cache=False``, or a model with sequence parallelism (a single decode token
    cannot be split over the sequence): every step recomputes the batch through :func:`logits_fn`.
    """
    gpt = unwrap(model[0])
    if layout.cp_size > 1:
        # context parallelism: every CP rank decodes the whole sequences, the CPU CP attention's layers running
        # as local attention (the same results as one rank); Transformer Engine's CP attention cannot
        from gspo_mcore.platform.cp_attention import core_attention_class

        if not kv_cache or any(
            type(layer.self_attention.core_attention) is not core_attention_class() for layer in gpt.decoder.layers
        ):
            raise ValueError(
                f"in-process sampling with CP={layout.cp_size} needs the KV-cache decode model and the CPU "
                "context-parallel attention (no Transformer Engine); use SGLang otherwise"
            )
        return MegatronDecodeModel(gpt, layout)
    fn = logits_fn(model, layout)  # checks the layout
    if not kv_cache or gpt.config.sequence_parallel:
        return fn  # the engine recomputes the whole batch through it every step
    return MegatronDecodeModel(gpt, layout)


class MegatronDecodeModel:
    """Prefill and one-token decode steps of a Megatron ``GPTModel`` with a KV cache.

    The model's own modules run in order (embedding, decoder block, output layer on the last position only,
    vocabulary gathered over TP), so any ``GPTModel`` with rotary positions works (dense or MoE, any norm or
    MLP). Left-padded prompts of different lengths share a batch exactly: each row's positions count from
    its first real token, and padded keys are masked out of every attention (a padded query attends to
    itself only, so that nothing non-finite arises). The model is in ``eval()`` during each pass.

    Rotary embeddings are applied to the new queries and keys right after their projection (each row at
    its own positions, with Megatron's ``apply_rotary_pos_emb`` and the model's own angle table), so the
    cache holds rotated keys and no step re-rotates it.

    The KV cache: where every layer's core attention is Megatron's local ``DotProductAttention`` (no
    Transformer Engine, no softmax offset, window or extra scaling) or the CPU context-parallel attention,
    the session owns it, one ``[2, B, groups, S, dim]`` tensor per layer, and each layer's core attention
    runs as one ``scaled_dot_product_attention`` over the cache's valid prefix (the query heads of each KV
    group folded together; nothing is copied per step but the new keys and values). Otherwise (Transformer
    Engine) Megatron's ``StaticInferenceContext`` holds it and the model's own core attention reads it;
    ``megatron_cache=True`` forces that path (tests).
    """

    def __init__(self, gpt, layout: Layout, *, megatron_cache: bool = False):
        if gpt.position_embedding_type not in ("rope", "none"):
            raise ValueError(
                f"in-process KV decoding supports rotary or no position embedding, not {gpt.position_embedding_type!r}"
            )
        config = gpt.config
        if getattr(config, "flash_decode", False) or getattr(config, "multi_latent_attention", False):
            raise ValueError("in-process KV decoding does not support flash_decode or multi-latent attention")
        self.gpt, self.layout = gpt, layout
        self.attentions = [layer.self_attention for layer in gpt.decoder.layers]
        self.modules = list(gpt.modules())
        self.own_cache = not megatron_cache and all(_plain_core_attention(a.core_attention) for a in self.attentions)

    def start(self, tokens: torch.Tensor, lengths: torch.Tensor, max_new_tokens: int):
        B, P = tokens.shape
        S = P + max_new_tokens - 1  # the last drawn token is never fed back
        dev = self.layout.device
        lengths = lengths.long().to(dev)
        pad = P - lengths  # (B,)
        slots = torch.arange(S, device=dev)
        session = _MegatronSession(
            self,
            B,
            S,
            positions=(slots[None] - pad[:, None]).clamp(min=0),  # (B, S)
            valid=slots[None] >= pad[:, None],  # (B, S): key holds a real token
        )
        tokens = tokens.to(dev)
        if session.ctx is None:
            return session, session.prefill(tokens, lengths)
        causal = slots[None, :P] > slots[:P, None]  # (P, P)
        mask = causal[None] | (~session.valid[:, None, :P] & ~torch.eye(P, dtype=torch.bool, device=dev))
        logits = session.forward(tokens, mask[:, None])  # mask (B, 1, P, P)
        session.ctx.enable_decode_mode()
        return session, logits


class _MegatronSession:
    def __init__(self, owner: MegatronDecodeModel, B: int, S: int, *, positions: torch.Tensor, valid: torch.Tensor):
        from megatron.core.inference.contexts import StaticInferenceContext

        self.owner, self.gpt, self.layout = owner, owner.gpt, owner.layout
        self.positions, self.valid = positions, valid  # (B, S) each
        self.length, self.offset = S, 0  # cache slots, slots filled
        self.ctx = None if owner.own_cache else StaticInferenceContext(B, S)
        self.cache: list[torch.Tensor | None] = [None] * len(owner.attentions)  # own cache: [2, B, ng, S, hn]
        self.packed: _Packed | None = None  # during the own cache's prefill: the distinct prompts, packed
        self.ragged: _Ragged | None = None  # during an extend: the rows' new tokens, packed
        self.fill: torch.Tensor | None = None  # (B,) once rows are extended: the slots each row has filled
        self.table = None  # (S, D): the rotary angles of positions 0..S-1
        self.freqs = None  # (S, B, 1, D): each row's rotary angles at each cache slot
        if self.gpt.position_embedding_type == "rope":
            # (S, 1, 1, D), positions 0..S-1; packed_seq: the whole table, never a CP rank's slice
            self.table = self.gpt.rotary_pos_emb(S, packed_seq=True)[:, 0, 0]
            self.freqs = self.table[positions].transpose(0, 1)[:, :, None].contiguous()
        # (id(config), mscale) -> (config, the pass's rotation), one per distinct pair: see _decode_attention
        self.rotations: dict[tuple[int, float], tuple] = {}
        self.overrides = _overrides(self)

    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The own cache's prefill of ``tokens [B, P]`` (left-padded, ``lengths [B]``) -> logits ``[B, V]``.

        Each distinct prompt runs once (the samples of a group share theirs), and only its real tokens: the
        prompts are packed into one sequence ``[T, 1]`` for everything but attention, which runs per prompt
        over its left-padded keys (:meth:`_prefill_attention`); every row's keys and values are then copied
        from its prompt's."""
        P = tokens.shape[1]
        distinct, inverse = torch.unique(torch.cat([lengths[:, None], tokens], 1), dim=0, return_inverse=True)
        U = distinct.shape[0]
        slots = torch.arange(P, device=tokens.device)
        pad = P - distinct[:, 0]  # (U,)
        real = slots[None] >= pad[:, None]  # (U, P)
        T = int(real.sum())
        index = torch.full((U, P), T, dtype=torch.long, device=tokens.device)  # T: a zero row (padding)
        index[real] = torch.arange(T, device=tokens.device)
        causal = slots[None] > slots[:, None]  # (P, P)
        masked = causal[None] | (~real[:, None] & ~torch.eye(P, dtype=torch.bool, device=tokens.device))
        positions = (slots[None] - pad[:, None])[real]  # (T,)
        self.packed = _Packed(inverse=inverse, real=real, index=index, keep=~masked[:, None])
        freqs = None if self.table is None else self.table[positions][:, None, None]  # (T, 1, 1, D)
        last = real.sum(1).cumsum(0) - 1  # (U,): each prompt's last token in the packed sequence
        try:  # hidden (T, 1, H) -> each prompt's last (1, U, H)
            logits = self._run(
                distinct[:, 1:][real][None], positions[None], None, freqs, lambda h: h[last].transpose(0, 1)
            )
        finally:
            self.packed = None
        self.offset = P
        return logits[inverse.cpu()]  # (B, V); _run's logits are on the CPU, inverse on the model's device

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``tokens [B, s]`` at cache slots ``offset .. offset+s-1``, ``mask [B, 1, s, offset+s]`` (True:
        masked) -> next-token logits ``[B, V]`` float32 on the CPU."""
        start, s = self.offset, tokens.shape[1]
        freqs = None if self.freqs is None else self.freqs[start : start + s]  # (s, B, 1, D)
        logits = self._run(tokens, self.positions[:, start : start + s], mask, freqs, lambda h: h[-1:])
        self.offset += s
        if self.ctx is not None:
            self.ctx.increment_sequence_len_offset(s)
        return logits

    def _run(self, tokens: torch.Tensor, positions: torch.Tensor, mask, freqs, last) -> torch.Tensor:
        """Embedding, decoder and output layer over ``tokens [b, s]`` -> the logits ``[b', V]`` (float32 on the CPU,
        the vocabulary gathered over TP) of the positions ``last(hidden [s, b, H]) -> [1, b', H]`` picks. The
        model in eval mode, the attentions in decoding mode (``freqs [s, b, 1, D]`` or None: no rotary
        embedding), under ``torch.inference_mode`` (the cache is made of inference tensors; the logits are not)."""
        gpt = self.gpt
        # what gpt.eval() does (no dropout; Megatron's attention also refuses an inference context in training),
        # without its recursion over the module tree and nn.Module.__setattr__'s checks at every step
        training = [m for m in self.owner.modules if m.training]
        for m in training:
            object.__setattr__(m, "training", False)
        try:
            with torch.inference_mode(), _decode_attention(self, freqs):
                hidden = gpt.embedding(input_ids=tokens, position_ids=positions)  # (s, b, H)
                hidden = gpt.decoder(
                    hidden_states=hidden, attention_mask=mask, inference_context=self.ctx, rotary_pos_emb=None
                )  # (s, b, H), final norm applied
                weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
                logits, _ = gpt.output_layer(last(hidden), weight=weight, runtime_gather_output=True)  # (1, b', V)
        finally:
            for m in training:
                object.__setattr__(m, "training", True)
        return logits[0].float().cpu().clone()  # a normal tensor: the caller may write into it

    def extend(self, tokens) -> torch.Tensor:
        """Multi-turn: append ``tokens[b]`` (a list of ids, possibly empty) after row ``b``'s filled slots, in one
        pass over the packed new tokens (nothing already cached is recomputed) -> the logits after each row's
        last token ``[B, V]``. Needs the session's own cache (Megatron's ``StaticInferenceContext`` advances
        every row by the same count)."""
        if self.ctx is not None:
            raise RuntimeError(
                "multi-turn episodes (rollout.env) with the in-process engine need its own KV cache, which "
                "Transformer Engine's attention does not allow; use the local layer spec or SGLang"
            )
        dev = self.layout.device
        B = len(tokens)
        if self.fill is None:
            self.fill = torch.full((B,), self.offset, dtype=torch.long, device=dev)
        k = torch.tensor([len(t) for t in tokens], dtype=torch.long, device=dev)  # (B,)
        flat = torch.tensor([int(x) for t in tokens for x in t], dtype=torch.long, device=dev)  # (T,)
        T = flat.numel()
        if T == 0:
            raise RuntimeError("extend: no row was given a token")
        rows = torch.repeat_interleave(torch.arange(B, device=dev), k)  # (T,)
        starts = k.cumsum(0) - k  # (B,)
        j = torch.arange(T, device=dev) - starts[rows]  # (T,): index within the row's new tokens
        slots = self.fill[rows] + j  # (T,)
        end = int((self.fill + k).max())
        if end > self.length:
            raise RuntimeError(f"extend: {end} cache slots needed, the session has {self.length}")
        s = int(k.max())
        # query j of row b sits at slot fill_b + j; padded queries (j >= k_b) repeat the row's last real one (a row
        # given nothing: its last filled slot), so every query attends to at least one real key
        qslot = self.fill[:, None] + torch.minimum(torch.arange(s, device=dev)[None], k[:, None] - 1)  # (B, s)
        key_slots = torch.arange(end, device=dev)
        keep = self.valid[:, None, :end] & (key_slots[None, None] <= qslot[:, :, None])  # (B, s, end)
        self.ragged = _Ragged(rows=rows, j=j, slots=slots, keep=keep[:, None], width=s, end=end)
        freqs = None if self.freqs is None else self.freqs[slots, rows][:, None]  # (T, 1, 1, D)
        last = (k.cumsum(0) - 1).clamp(0, T - 1)  # (B,): each row's last new token in the packed sequence
        try:  # hidden (T, 1, H) -> each row's last (1, B, H)
            logits = self._run(
                flat[None], self.positions[rows, slots][None], None, freqs, lambda h: h[last].transpose(0, 1)
            )
        finally:
            self.ragged = None
        self.fill = self.fill + k
        return logits  # (B, V)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = ~self.valid[:, None, None, : self.offset + 1]  # (B, 1, 1, end)
        return self.forward(tokens.to(self.layout.device)[:, None], mask)

    def select(self, rows: torch.Tensor) -> None:
        rows = rows.to(self.layout.device)
        self.cache = [None if kv is None else kv[:, rows] for kv in self.cache]  # advanced indexing: a copy
        if self.ctx is not None:
            memory = self.ctx.key_value_memory_dict
            for layer, (k, v) in memory.items():  # (S, B, groups, dim) each
                memory[layer] = (k[:, rows].contiguous(), v[:, rows].contiguous())
            self.ctx.max_batch_size = len(rows)
        self.positions, self.valid = self.positions[rows], self.valid[rows]
        if self.fill is not None:
            self.fill = self.fill[rows]
        if self.freqs is not None:
            self.freqs = self.freqs[:, rows].contiguous()

    def attend(self, index: int, query, key, value, attention_mask, scale: float) -> torch.Tensor:
        """Layer ``index``'s core attention over the own cache: ``query [sq, b, np, hn]``, this pass's ``key,
        value [sq, b, ng, hn]``, ``attention_mask [b, 1, sq, sk]`` bool (True: masked; sk = the cache's filled
        slots after this pass) -> ``[sq, b, np*hn]``."""
        if self.packed is not None:
            return self._prefill_attention(index, query, key, value, scale)
        if self.ragged is not None:
            return self._extend_attention(index, query, key, value, scale)
        keys, values = self._store(index, key, value)  # (B, ng, sk, hn) each
        sq, B, nh, hn = query.shape
        out = _grouped_attention(query.permute(1, 2, 0, 3), keys, values, ~attention_mask, scale)  # (B, np, sq, hn)
        return out.permute(2, 0, 1, 3).reshape(sq, B, nh * hn)  # (sq, B, np*hn)

    def _store(self, index: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this pass's ``key, value [s, B, ng, hn]`` of layer ``index`` at slots ``offset..offset+s-1``
        -> the cache's filled prefix, keys and values ``[B, ng, offset+s, hn]`` each (views)."""
        end = self.offset + key.shape[0]
        kv = self.cache[index]
        kv[0, :, :, self.offset : end] = key.permute(1, 2, 0, 3)
        kv[1, :, :, self.offset : end] = value.permute(1, 2, 0, 3)
        return kv[0, :, :, :end], kv[1, :, :, :end]

    def _prefill_attention(self, index: int, query, key, value, scale: float) -> torch.Tensor:
        """The packed prefill's attention: ``query [T, 1, np, hn]``, ``key, value [T, 1, ng, hn]`` -> ``[T, 1,
        np*hn]``. Each distinct prompt attends over its own keys, left-padded to ``P`` (zeros at the padding,
        masked); the cache's first ``P`` slots of every row get its prompt's keys and values."""
        packed = self.packed
        P = packed.index.shape[1]
        T, _, nh, hn = query.shape

        def padded(x):  # [T, 1, n, hn] -> [U, n, P, hn], zeros at the padding
            x = torch.cat([x[:, 0], x.new_zeros((1, *x.shape[2:]))])  # (T + 1, n, hn)
            return x[packed.index].transpose(1, 2)

        keys, values = padded(key), padded(value)  # (U, ng, P, hn) each
        ng = keys.shape[1]
        B = packed.inverse.shape[0]
        kv = self.cache[index] = keys.new_zeros((2, B, ng, self.length, hn))  # zeros: masked slots stay finite
        kv[0, :, :, :P] = keys[packed.inverse]
        kv[1, :, :, :P] = values[packed.inverse]
        out = _grouped_attention(padded(query), keys, values, packed.keep, scale)  # (U, np, P, hn)
        return out.transpose(1, 2)[packed.real].reshape(T, 1, nh * hn)

    def _extend_attention(self, index: int, query, key, value, scale: float) -> torch.Tensor:
        """An extend's attention: ``query [T, 1, np, hn]``, ``key, value [T, 1, ng, hn]`` (the rows' new tokens,
        packed) -> ``[T, 1, np*hn]``. The new keys and values go to each row's next slots; each row's queries,
        padded to the widest row, attend over its cached prefix and its new tokens up to themselves."""
        rg = self.ragged
        T, _, nh, hn = query.shape
        kv = self.cache[index]  # (2, B, ng, S, hn)
        kv[0][rg.rows, :, rg.slots] = key[:, 0]
        kv[1][rg.rows, :, rg.slots] = value[:, 0]
        q = query.new_zeros((kv.shape[1], rg.width, nh, hn))  # (B, s, np, hn)
        q[rg.rows, rg.j] = query[:, 0]
        out = _grouped_attention(q.transpose(1, 2), kv[0, :, :, : rg.end], kv[1, :, :, : rg.end], rg.keep, scale)
        return out.transpose(1, 2)[rg.rows, rg.j].reshape(T, 1, nh * hn)  # out (B, np, s, hn)


def _grouped_attention(query, keys, values, keep, scale: float) -> torch.Tensor:
    """Softmax attention with grouped KV heads: ``query [N, np, s, hn]`` over ``keys, values [N, ng, sk, hn]``,
    ``keep [N, 1, s, sk]`` bool (True: attend) -> ``[N, np, s, hn]``. Megatron's query head h reads KV group
    h // r (r = np / ng): each group's r heads are stacked along the query rows, so SDPA sees ng heads."""
    N, nh, s, hn = query.shape
    r = nh // keys.shape[1]
    q = query.reshape(N, keys.shape[1], r * s, hn)  # row i*s + t is (head i of the group, t)
    if r > 1 and s > 1:
        keep = keep.repeat(1, 1, r, 1)  # (N, 1, r*s, sk); a single row broadcasts as it is
    out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=keep, scale=scale)
    return out.reshape(N, nh, s, hn)


class _Packed(NamedTuple):
    """The own cache's prefill: ``U`` distinct prompts of the ``B`` rows, packed into ``T`` tokens."""

    inverse: torch.Tensor  # (B,): each row's prompt
    real: torch.Tensor  # (U, P) bool: a real token of the left-padded prompt (packed in row-major order)
    index: torch.Tensor  # (U, P): the packed position of each real token, T at the padding
    keep: torch.Tensor  # (U, 1, P, P) bool: the prompt's attention mask (True: attend)


class _Ragged(NamedTuple):
    """An extend of the own cache: ``T`` new tokens of ``B`` rows, packed."""

    rows: torch.Tensor  # (T,): each new token's row
    j: torch.Tensor  # (T,): its index among its row's new tokens
    slots: torch.Tensor  # (T,): its cache slot
    keep: torch.Tensor  # (B, 1, width, end) bool: the padded queries' attention mask (True: attend)
    width: int  # the most new tokens of a row
    end: int  # cache slots read: the largest fill after the pass


def _plain_core_attention(core) -> bool:
    """Whether ``core`` computes plain softmax attention that :func:`_cached_attention` can replace."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from gspo_mcore.platform import cpu_attention
    from gspo_mcore.platform.cp_attention import core_attention_class

    if type(core) is core_attention_class():  # CP: whole sequences on every rank, local attention
        return True
    return (
        type(core) in (DotProductAttention, cpu_attention.core_attention_class())
        and core.softmax_offset is None
        and core.scale_mask_softmax.scale is None
        and core.scale_mask_softmax.window_size is None
    )


def _overrides(session: _MegatronSession) -> list[tuple[torch.nn.Module, str, object]]:
    """The session's per-layer overrides, made once: ``(module, attribute, function)``. The query and key
    projections rotate by the pass's rotation in ``session.rotations`` (none without rotary embedding)
    and, with the session's own cache, each core attention runs over it."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config,
    )

    out = []
    for index, attn in enumerate(session.owner.attentions):
        if session.table is not None:
            mscale = _yarn_get_concentration_factor_from_config(attn.config)
            session.rotations[id(attn.config), mscale] = (attn.config, None)
            out.append((attn, "get_query_key_value_tensors", _rotating_qkv(session, attn, (id(attn.config), mscale))))
        if session.ctx is None:
            out.append((attn.core_attention, "forward", _cached_attention(session, index, attn.core_attention)))
    return out


@contextlib.contextmanager
def _decode_attention(session: _MegatronSession, freqs: torch.Tensor | None):
    """While decoding: rotate new queries and keys at their projection (``freqs [s, b, 1, D]``; None: no
    rotary embedding) and, with the session's own cache, run each core attention over it. Each override is
    an instance attribute, removed on exit (the training forward never sees one)."""
    for key, (config, _) in session.rotations.items():
        session.rotations[key] = (config, _rotation(freqs, config, key[1]))
    try:
        for module, name, fn in session.overrides:
            module.__dict__[name] = fn  # what setattr does for a plain function, without nn.Module's checks
        yield
    finally:
        for module, name, _ in session.overrides:
            module.__dict__.pop(name, None)
        for key, (config, _) in session.rotations.items():
            session.rotations[key] = (config, None)


def _rotation(freqs: torch.Tensor, config, mscale: float):
    """``rotate(t)``: Megatron's ``apply_rotary_pos_emb(t, freqs, config, mscale=mscale)`` for ``t [s, b, n,
    hn]``. Unfused, it is ``t * cos + rotate_half(t) * sin`` on the first ``D`` channels: cos and sin are computed
    here once per pass, as Megatron computes them, instead of twice in every layer."""
    from megatron.core.models.common.embeddings.rope_utils import _rotate_half, apply_rotary_pos_emb

    if config.apply_rope_fusion:
        return lambda t: apply_rotary_pos_emb(t, freqs, config=config, mscale=mscale)
    cos, sin = torch.cos(freqs) * mscale, torch.sin(freqs) * mscale  # (s, b, 1, D)
    D, interleaved = freqs.shape[-1], config.rotary_interleaved

    def rotate(t: torch.Tensor) -> torch.Tensor:
        x = t[..., :D]
        x = (x * cos.to(t.dtype)) + (_rotate_half(x, interleaved) * sin.to(t.dtype))
        return x if D == t.shape[-1] else torch.cat((x, t[..., D:]), dim=-1)

    return rotate


def _rotating_qkv(session: _MegatronSession, attn, key: tuple[int, float]):
    qkv_fn = attn.get_query_key_value_tensors  # the class's method (no override is installed yet)

    def fn(*args, **kwargs):
        out = qkv_fn(*args, **kwargs)  # query [s, b, np, hn], key [s, b, ng, hn], value, (gate)
        rotate = session.rotations[key][1]
        return (rotate(out[0]), rotate(out[1]), *out[2:])

    return fn


def _cached_attention(session: _MegatronSession, index: int, core):
    scale = core.softmax_scale

    def forward(query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        return session.attend(index, query, key, value, attention_mask, scale)

    return forward
