"""The in-process engine's sampling, on a tiny deterministic bigram 'model' (logits depend on the last token),
and its KV-cache protocol on a one-layer torch attention model.

The real model is exercised in tests/trainer (log-probs vs a learner forward pass, with a KV cache).
Here the logits are exact and cheap, so each property can be checked precisely.
"""

import asyncio

import pytest
import torch

from gspo_mcore.rollout import InProcessEngine, RolloutError, SamplingParams
from gspo_mcore.rollout.inprocess import RecomputeModel, _uniforms, draw_tokens, truncated_logits

V = 40
TABLE = torch.randn(V, V, generator=torch.Generator().manual_seed(0)) * 2  # (V, V) bigram logits


def bigram_logits(tokens):  # (B, L) -> (B, L, V)
    return TABLE[tokens]


def engine(**kw):
    return InProcessEngine(bigram_logits, eos_token_id=2, **kw)


def expected_logprobs(sample, tau, vocab_size=V):
    prev = torch.tensor((sample.prompt_ids[-1],) + sample.response_ids[:-1])
    z = TABLE[prev].clone()
    z[:, vocab_size:] = -torch.inf
    return torch.log_softmax(z / tau, -1).gather(1, torch.tensor(sample.response_ids)[:, None]).squeeze(1)


@pytest.mark.parametrize("tau", [1.0, 0.7, 1.6])
def test_logprobs_are_of_the_temperature_scaled_untruncated_softmax(tau):
    params = SamplingParams(temperature=tau, top_k=5, top_p=0.8, max_new_tokens=7, seed=3)
    out = engine().generate_sync([[5, 6], [7], [8, 9, 10]], 4, params)
    for group in out:
        for s in group:
            torch.testing.assert_close(torch.tensor(s.response_logprobs), expected_logprobs(s, tau), rtol=0, atol=1e-6)


def test_same_seed_same_samples_other_seed_other_samples():
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=11)
    a = engine().generate_sync([[5, 6], [7]], 3, params)
    b = engine().generate_sync([[5, 6], [7]], 3, params)
    c = engine().generate_sync([[5, 6], [7]], 3, SamplingParams(temperature=1.0, max_new_tokens=8, seed=12))
    ids = lambda out: [s.response_ids for g in out for s in g]  # noqa: E731
    assert ids(a) == ids(b)
    assert ids(a) != ids(c)


def test_temperature_zero_is_greedy_with_tau_one_logprobs():
    out = engine().generate_sync([[5]], 2, SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True))
    tok = 5
    for s in out[0]:
        assert s.finish_reason == "length"
    for t in out[0][0].response_ids:
        assert t == int(TABLE[tok].argmax())
        tok = t
    assert out[0][0].response_ids == out[0][1].response_ids
    torch.testing.assert_close(
        torch.tensor(out[0][0].response_logprobs), expected_logprobs(out[0][0], 1.0), rtol=0, atol=1e-6
    )


def test_top_k_one_always_draws_the_argmax():
    out = engine().generate_sync(
        [[5]], 3, SamplingParams(temperature=1.3, top_k=1, max_new_tokens=4, seed=0, ignore_eos=True)
    )
    greedy = engine().generate_sync([[5]], 1, SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))
    assert all(s.response_ids == greedy[0][0].response_ids for s in out[0])


def test_eos_stops_and_is_kept_and_padded_vocabulary_is_never_drawn():
    params = SamplingParams(temperature=2.0, max_new_tokens=30, seed=5)
    out = engine(vocab_size=20).generate_sync([[3], [4], [5], [6]], 8, params)
    for g in out:
        for s in g:
            assert all(t < 20 for t in s.response_ids)
            if s.finish_reason == "stop":
                assert s.response_ids[-1] == 2 and 2 not in s.response_ids[:-1]
            else:
                assert len(s.response_ids) == 30 and 2 not in s.response_ids
            torch.testing.assert_close(
                torch.tensor(s.response_logprobs), expected_logprobs(s, 2.0, 20), rtol=0, atol=1e-6
            )
    assert any(s.finish_reason == "stop" for g in out for s in g)


def test_order_and_shapes_with_chunked_batches():
    out = engine(max_batch_size=3).generate_sync([[5], [6, 7], [8]], 4, SamplingParams(max_new_tokens=3, seed=1))
    assert [[(s.prompt_index, s.sample_index) for s in g] for g in out] == [
        [(i, j) for j in range(4)] for i in range(3)
    ]
    assert [g[0].prompt_ids for g in out] == [(5,), (6, 7), (8,)]


def test_async_interface_pause_and_weight_version():
    e = engine()
    e.set_weight_version(7)
    out = asyncio.run(e.generate([[5]], 2, SamplingParams(max_new_tokens=2, seed=0)))
    assert all(s.weight_version == 7 for s in out[0])
    asyncio.run(e.pause())
    with pytest.raises(RolloutError, match="paused"):
        e.generate_sync([[5]], 1, SamplingParams())
    asyncio.run(e.resume())
    assert asyncio.run(e.health()) == {"in-process": True}
    with pytest.raises(RolloutError, match="live parameters"):
        asyncio.run(e.update_weights([], 1))


def test_bad_inputs():
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine().generate_sync([[5], []], 1, SamplingParams())
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        engine().generate_sync([[5]], 0, SamplingParams())
    bad = InProcessEngine(lambda t: torch.zeros(1, 1, V), eos_token_id=2)
    with pytest.raises(RolloutError, match="logits_fn returned shape"):
        bad.generate_sync([[5], [6]], 1, SamplingParams(max_new_tokens=2))


def ids_of(out):
    return [[s.response_ids for s in g] for g in out]


def test_samples_do_not_depend_on_batch_chunking_or_the_split_of_prompts():
    prompts = [[5, 6], [7], [8, 9, 10], [11], [12, 13]]
    params = SamplingParams(temperature=1.2, top_p=0.9, max_new_tokens=12, seed=42)
    whole = engine(max_batch_size=64).generate_sync(prompts, 4, params)
    assert ids_of(engine(max_batch_size=3).generate_sync(prompts, 4, params)) == ids_of(whole)
    # two data-parallel shares: the second starts at global prompt index 2
    first = engine(max_batch_size=5).generate_sync(prompts[:2], 4, params, prompt_offset=0)
    second = engine(max_batch_size=7).generate_sync(prompts[2:], 4, params, prompt_offset=2)
    assert ids_of(first) + ids_of(second) == ids_of(whole)
    for a, b in zip(first + second, whole):
        assert [s.response_logprobs for s in a] == [s.response_logprobs for s in b]
    # the offset matters: the same prompts at another global index are other draws
    shifted = engine().generate_sync(prompts[2:], 4, params, prompt_offset=0)
    assert ids_of(shifted) != ids_of(whole[2:])


@pytest.mark.parametrize("top_k, top_p", [(3, 1.0), (-1, 0.6), (6, 0.7)])
def test_every_drawn_token_is_inside_the_top_k_and_nucleus_sets(top_k, top_p):
    tau = 1.5
    params = SamplingParams(temperature=tau, top_k=top_k, top_p=top_p, max_new_tokens=20, seed=9, ignore_eos=True)
    out = engine().generate_sync([[p] for p in range(V)], 4, params)
    allowed = []  # per previous token: the tokens it may be followed by
    for p in range(V):
        z = TABLE[p] / tau
        order = torch.argsort(z, descending=True).tolist()
        keep = set(order[:top_k]) if top_k > 0 else set(order)
        if top_p < 1.0:  # the smallest prefix of the sorted distribution with mass >= top_p
            mass = torch.softmax(z, -1)[order].cumsum(0)
            keep &= set(order[: int((mass < top_p).sum()) + 1])
        allowed.append(keep)
    drawn = 0
    for g in out:
        for s in g:
            prev = (s.prompt_ids[-1],) + s.response_ids[:-1]
            for p, t in zip(prev, s.response_ids):
                assert t in allowed[p], (p, t, sorted(allowed[p]))
                drawn += 1
    assert drawn == V * 4 * 20


def test_inverse_cdf_draws_follow_the_truncated_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0, -2.0, 1.5]])  # (1, 8)
    params = SamplingParams(temperature=0.8, top_k=5)
    n = 40_000
    keys = torch.arange(n, dtype=torch.int64).numpy().view("uint64")
    u = _uniforms(keys, 0)
    assert float(u.min()) >= 0 and float(u.max()) < 1
    counts = torch.bincount(draw_tokens(logits.expand(n, 8), params, u), minlength=8).double()
    p = torch.softmax(truncated_logits(logits, params)[0].double(), -1)
    assert bool((counts[p == 0] == 0).all())
    sigma = (n * p * (1 - p)).sqrt()
    assert bool(((counts - n * p).abs() <= 5 * sigma + 1).all()), (counts / n, p)


def test_a_target_at_the_total_mass_draws_the_last_kept_token_not_past_the_vocabulary():
    # u rounded up to 1: the target equals the cdf's total and no cdf value exceeds it (searchsorted gives V); the
    # draw is then the last token with a positive probability, even with excluded tokens after it
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.5, -4.0, -5.0], [1.0, 0.0, 2.0, -1.0, 0.5, 3.0]])  # (2, 6)
    params = SamplingParams(temperature=1.0, top_k=3)  # row 0 keeps 1, 2, 3; row 1 keeps 0, 2, 5
    u = torch.tensor([1.0, 1.0], dtype=torch.float64)
    assert draw_tokens(logits, params, u).tolist() == [3, 5]
    assert draw_tokens(logits, params, torch.zeros(2, dtype=torch.float64)).tolist() == [1, 0]


class TinyAttention(torch.nn.Module):
    """One causal attention layer with learned positions: a real full forward, and a KV-cache
    :class:`DecodeModel` over left-padded prompts (positions from each row's first real token)."""

    def __init__(self, vocab=V, dim=16, max_len=64):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.emb = torch.randn(vocab, dim, generator=g)
        self.pos = torch.randn(max_len, dim, generator=g) * 0.5
        self.qkv = torch.randn(dim, 3 * dim, generator=g) / dim**0.5
        self.out = torch.randn(dim, vocab, generator=g) * 2 / dim**0.5

    def layer(self, x, pos, k_cache=None, v_cache=None, key_mask=None):
        h = self.emb[x] + self.pos[pos]  # (B, s, D)
        q, k, v = (h @ self.qkv).chunk(3, -1)
        if k_cache is not None:
            k, v = torch.cat([k_cache, k], 1), torch.cat([v_cache, v], 1)
        scores = (q @ k.transpose(1, 2)).masked_fill(key_mask, -torch.inf)  # (B, s, S)
        return (h + torch.softmax(scores, -1) @ v) @ self.out, k, v

    def logits_fn(self, tokens):  # (B, L) right padded -> (B, L, V)
        L = tokens.shape[1]
        causal = torch.ones(L, L, dtype=torch.bool).triu(1)[None]
        return self.layer(tokens, torch.arange(L).expand_as(tokens), key_mask=causal)[0]

    def start(self, tokens, lengths, max_new_tokens):
        P = tokens.shape[1]
        pad = P - lengths
        slots = torch.arange(P + max_new_tokens)
        sess = _TinySession(self, (slots[None] - pad[:, None]).clamp(min=0), slots[None] < pad[:, None])
        mask = (slots[None, :P] > slots[:P, None])[None] | (sess.padded[:, None, :P] & ~torch.eye(P, dtype=bool))
        logits, sess.k, sess.v = self.layer(tokens, sess.positions[:, :P], key_mask=mask)
        return sess, logits[:, -1]


class _TinySession:
    def __init__(self, model, positions, padded):
        self.model, self.positions, self.padded = model, positions, padded  # (B, S) each

    def step(self, tokens):
        t = self.k.shape[1]
        logits, self.k, self.v = self.model.layer(
            tokens[:, None], self.positions[:, t : t + 1], self.k, self.v, self.padded[:, None, : t + 1]
        )
        return logits[:, -1]

    def select(self, rows):
        self.positions, self.padded, self.k, self.v = (a[rows] for a in (self.positions, self.padded, self.k, self.v))


@pytest.mark.parametrize("compact_below", [0.0, 0.75, 1.0])
def test_kv_cache_protocol_matches_recompute_with_mixed_lengths_and_finished_rows(compact_below):
    m = TinyAttention()
    params = SamplingParams(temperature=1.0, max_new_tokens=14, seed=4, stop_token_ids=tuple(range(30, 40)))
    prompts = [[5, 6, 7, 8, 9], [9], [11, 12, 13], [3, 4], [20, 21, 22, 23, 24, 25, 26]]
    kv = InProcessEngine(m, eos_token_id=2, compact_below=compact_below, max_batch_size=16).generate_sync(
        prompts, 3, params
    )
    full = InProcessEngine(m.logits_fn, eos_token_id=2).generate_sync(prompts, 3, params)
    assert ids_of(kv) == ids_of(full)
    reasons = [s.finish_reason for g in kv for s in g]
    assert "stop" in reasons and "length" in reasons
    for a, b in zip(kv, full):
        for x, y in zip(a, b):
            # each sample alone, unpadded, through the full forward
            seq = torch.tensor(x.prompt_ids + x.response_ids)
            logp = torch.log_softmax(m.logits_fn(seq[None])[0, len(x.prompt_ids) - 1 : -1], -1)  # (R, V)
            ref = logp.gather(1, torch.tensor(x.response_ids)[:, None]).squeeze(1)
            torch.testing.assert_close(torch.tensor(x.response_logprobs), ref, rtol=0, atol=2e-5)
            torch.testing.assert_close(torch.tensor(y.response_logprobs), ref, rtol=0, atol=2e-5)


class PrefillLog:
    """A :class:`DecodeModel` that records the prompts of every prefill and hands it to ``inner``."""

    def __init__(self, inner):
        self.inner, self.prefills = inner, []
        self.own_cache = True

    def start(self, tokens, lengths, max_new_tokens):
        self.prefills.append([tuple(row[len(row) - n :].tolist()) for row, n in zip(tokens, lengths.tolist())])
        return self.inner.start(tokens, lengths, max_new_tokens)


# prompts 0 and 3 are the same, so a batch of them shares one prefill across groups too
SHARED_PROMPTS = [[5, 6, 7, 8, 9], [9], [11, 12, 13], [5, 6, 7, 8, 9], [20, 21, 22, 23, 24, 25, 26]]


@pytest.mark.parametrize("kind", ["kv", "recompute"])
@pytest.mark.parametrize("compact_below", [0.0, 0.75])
def test_shared_prefill_prefills_each_distinct_prompt_once_and_samples_as_unshared(kind, compact_below):
    m = TinyAttention()
    params = SamplingParams(temperature=1.0, max_new_tokens=14, seed=4, stop_token_ids=tuple(range(30, 40)))
    runs = {}
    for share in (True, False):
        log = PrefillLog(m if kind == "kv" else RecomputeModel(m.logits_fn))
        e = InProcessEngine(log, eos_token_id=2, compact_below=compact_below, max_batch_size=7, share_prefill=share)
        runs[share] = (e.generate_sync(SHARED_PROMPTS, 3, params), log.prefills)
    (shared, shared_prefills), (unshared, unshared_prefills) = runs[True], runs[False]
    # 15 rows in chunks of 7: prompt rows 0 0 0 1 1 1 2 | 2 2 3 3 3 4 4 | 4, prompts 0 and 3 the same
    p = [tuple(x) for x in SHARED_PROMPTS]
    assert shared_prefills == [[p[0], p[1], p[2]], [p[2], p[0], p[4]], [p[4]]]
    assert unshared_prefills == [[p[i] for i in rows] for rows in ([0, 0, 0, 1, 1, 1, 2], [2, 2, 3, 3, 3, 4, 4], [4])]
    assert ids_of(shared) == ids_of(unshared)
    reasons = [s.finish_reason for g in shared for s in g]
    assert "stop" in reasons and "length" in reasons
    worst = max(
        max((abs(a - b) for a, b in zip(x.response_logprobs, y.response_logprobs)), default=0.0)
        for g, h in zip(shared, unshared)
        for x, y in zip(g, h)
    )
    # the same rows' logits from a prefill of 1 row or of n identical rows: equal here (measured 0.0); a real
    # model's rounding may differ with the batch's row count by about 1e-7
    assert worst <= 1e-6, worst
    # the groups still differ from one another: each row decodes its own prompt
    assert ids_of(shared)[0] != ids_of(shared)[1]


def _turns(model, prompts, share, max_batch_size=16):
    """3-turn episodes: each turn answered with tokens that depend on the row, the turn and the last action."""
    params = SamplingParams(temperature=1.0, max_new_tokens=5, seed=0, stop_token_ids=(30, 31, 32))
    done, ends = [0] * len(prompts), []

    def on_turns(turn_ends):
        ends.extend(turn_ends)
        out = []
        for e in turn_ends:
            done[e.row] += 1
            out.append(None if done[e.row] == 3 else [3 + (e.row + done[e.row] + e.ids[-1]) % 20] * (1 + e.row % 3))
        return out

    log = PrefillLog(model)
    e = InProcessEngine(log, eos_token_id=2, max_batch_size=max_batch_size, share_prefill=share)
    keys = [100 + i for i in range(len(prompts))]
    asyncio.run(e.generate_turns(prompts, params, keys=keys, max_total_tokens=40, on_turns=on_turns))
    return sorted(ends, key=lambda t: (t.row, len(t.ids))), log.prefills


def test_shared_prefill_of_multi_turn_episodes_gives_the_unshared_episodes():
    m = TinyAttention()
    group = [[5, 6, 7], [9, 10], [5, 6, 7]]  # episodes of 3 groups of 2: each group's episodes share its prompt
    prompts = [p for p in group for _ in range(2)]
    shared, shared_prefills = _turns(RecomputeModel(m.logits_fn), prompts, True)
    unshared, unshared_prefills = _turns(RecomputeModel(m.logits_fn), prompts, False)
    assert shared_prefills == [[(5, 6, 7), (9, 10)]]
    assert unshared_prefills == [[tuple(p) for p in prompts]]
    assert [(t.row, t.ids, t.finish_reason) for t in shared] == [(t.row, t.ids, t.finish_reason) for t in unshared]
    for a, b in zip(shared, unshared):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-6)
    assert len(shared) == 3 * len(prompts)  # every episode ran its 3 turns
    episodes = [sum((t.ids for t in shared if t.row == r), ()) for r in range(len(prompts))]
    assert len(set(episodes)) == len(prompts)  # every row decodes its own prompt and key


def test_a_prefill_that_returns_the_wrong_rows_is_refused():
    class Short(PrefillLog):
        def start(self, tokens, lengths, max_new_tokens):
            session, logits = self.inner.start(tokens, lengths, max_new_tokens)
            return session, logits[:1]

    e = InProcessEngine(Short(TinyAttention()), eos_token_id=2)
    with pytest.raises(RolloutError, match=r"prefill returned logits of shape \(1, 40\), expected \(2, V\)"):
        e.generate_sync([[5], [6]], 2, SamplingParams(max_new_tokens=2))


def test_a_rows_cap_cuts_its_turn_and_every_token_is_drawn_as_without_it():
    """``caps(row)``, asked as each turn starts (after ``on_turns`` answered the last one), shortens that turn
    (finish ``length``); the tokens it keeps, and their log-probs, are the uncapped turn's first ones (the same
    key stream). A cap above the run's ``max_new_tokens`` leaves the run's limit in force."""
    m = TinyAttention()
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=0, ignore_eos=True)
    prompts = [[5, 6, 7], [9, 10], [11]]

    def episodes(cap):
        ends, done = [], [0] * len(prompts)

        def on_turns(turn_ends):
            ends.extend(turn_ends)
            for e in turn_ends:
                done[e.row] += 1
                if cap is not None:
                    cap[e.row] = {0: 3}.get(e.row)  # the next turn's cap
            return [None if done[e.row] == 2 else [3, 4] for e in turn_ends]

        e = InProcessEngine(RecomputeModel(m.logits_fn), eos_token_id=2)
        caps = None if cap is None else cap.get
        asyncio.run(
            e.generate_turns(prompts, params, keys=[7, 8, 9], max_total_tokens=40, on_turns=on_turns, caps=caps)
        )
        return {r: [t for t in ends if t.row == r] for r in range(len(prompts))}

    free, got = episodes(None), episodes({0: 2, 1: 100})
    assert all(t.finish_reason == "length" and len(t.ids) == 6 for turns in free.values() for t in turns)
    assert [len(t.ids) for t in got[0]] == [2, 3] and all(t.finish_reason == "length" for t in got[0])
    assert got[0][0].ids == free[0][0].ids[:2] and got[0][0].logprobs == free[0][0].logprobs[:2]
    for row in (1, 2):  # a cap of 100 (the run's 6 apply), no cap: as uncapped (the batch's rounding aside)
        assert [t.ids for t in got[row]] == [t.ids for t in free[row]]
        for a, b in zip(got[row], free[row]):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-6)


class ThreadLog(PrefillLog):
    """:class:`PrefillLog` that also records torch's intra-op thread count at each prefill and decode step."""

    def __init__(self, inner):
        super().__init__(inner)
        self.threads: list[int] = []

    def start(self, tokens, lengths, max_new_tokens):
        self.threads.append(torch.get_num_threads())
        session, logits = super().start(tokens, lengths, max_new_tokens)
        log = self

        class Logged:
            def __getattr__(self, name):
                fn = getattr(session, name)
                if name not in ("step", "extend"):
                    return fn

                def counted(*args):
                    log.threads.append(torch.get_num_threads())
                    return fn(*args)

                return counted

        return Logged(), logits


def _same_draws(got, want):
    """The same tokens, and log-probs equal up to the float32 rounding of a matmul whose blocking follows the
    thread count (MKL on an AMD EPYC, Zen 4, differs by up to 5e-7 between 1 and 2 threads; an Intel Xeon by none)."""
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    for (_, a), (_, b) in zip(got, want):
        torch.testing.assert_close(
            torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64), rtol=0, atol=1e-5
        )


@pytest.mark.parametrize("threads", [1, 3])
def test_decode_threads_decode_with_that_count_restore_the_callers_and_draw_the_same_tokens(threads):
    """``decode_threads``: prefill and every decode step (one-turn and multi-turn) run with that many torch threads,
    the caller's count is back afterwards (also when decoding fails), and every token is drawn as without it."""
    before = torch.get_num_threads()
    caller = 2 if threads != 2 else 4
    torch.set_num_threads(caller)
    try:
        params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=7, stop_token_ids=(30, 31))
        prompts = [[5, 6], [7], [8, 9, 10]]
        runs = {}
        for k in (None, threads):
            log = ThreadLog(TinyAttention())
            e = InProcessEngine(log, eos_token_id=2, max_batch_size=4, decode_threads=k)
            out = e.generate_sync(prompts, 3, params)
            assert torch.get_num_threads() == caller
            assert set(log.threads) == {caller if k is None else k} and len(log.threads) > 3
            runs[k] = [(s.response_ids, s.response_logprobs) for g in out for s in g]
        _same_draws(runs[threads], runs[None])

        turns = {}
        for k in (None, threads):
            log = ThreadLog(RecomputeModel(TinyAttention().logits_fn))
            done = [0] * len(prompts)

            def on_turns(ends, done=done):
                for t in ends:
                    done[t.row] += 1
                return [None if done[t.row] == 2 else [3 + t.row] for t in ends]

            ends = []
            e = InProcessEngine(log, eos_token_id=2, decode_threads=k)
            asyncio.run(
                e.generate_turns(
                    prompts,
                    params,
                    keys=[1, 2, 3],
                    max_total_tokens=30,
                    on_turns=lambda x: ends.extend(x) or on_turns(x),
                )
            )
            assert torch.get_num_threads() == caller
            assert set(log.threads) == {caller if k is None else k}
            turns[k] = [(t.row, t.ids, t.logprobs) for t in ends]
        _same_draws([((row, ids), lps) for row, ids, lps in turns[threads]], [((r, i), lp) for r, i, lp in turns[None]])

        def fail(tokens):
            raise RuntimeError("model failed")

        with pytest.raises(RuntimeError, match="model failed"):
            InProcessEngine(fail, eos_token_id=2, decode_threads=threads).generate_sync([[5]], 1, params)
        assert torch.get_num_threads() == caller
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2"])
def test_decode_threads_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="decode_threads must be None or an integer >= 1"):
        engine(decode_threads=bad)
