"""``stop`` strings through a real SGLang server (issue 38 item 6): an agent request's ``stop`` reaches SGLang as
``sampling_params.stop`` through :meth:`SGLangEngine.generate_turns` (the agent endpoint's path), and the turn ends
at the token whose text completes the string (that token kept, finish reason ``stop``).

Greedy (the same ids whenever the same turn is sampled: SGLang ignores ``sampling_seed`` unless started with
``--enable-deterministic-inference``, so only greedy turns repeat): each stopped turn is checked against the same turn
sampled without the stop string. Its ids are exactly the free turn's first ids, up to and including the first token
whose decoded text completes the string; their log-probs are the free turn's (within ``LOGPROB_TOL``: what was
recorded is what was sampled, token for token). The control: without the stop string the turn goes on past that
point to ``max_new_tokens``. At temperature 1, with the most frequent character of free turns as the stop string:
every turn either ends at the first token that completes it (finish ``stop``) or runs to ``max_new_tokens`` without
it, and most end early.
"""

from __future__ import annotations

import asyncio

import pytest
from sglang_cpu import LOGPROB_TOL, PROMPTS

pytestmark = pytest.mark.sglang

MAX_NEW = 40


def _decode(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)  # as SGLang decodes for its stop check


def _pick_stop(text: str) -> str | None:
    """A string that first occurs at character 3 or later with text after it: 2 characters, else 1 (a greedy turn of
    a random model may loop), else None."""
    for width, first in ((2, 3), (1, 2)):
        for p in range(first, len(text) - width - 1):
            s = text[p : p + width]
            if s.strip() == s and text.find(s) == p:
                return s
    return None


def _turns(engine, prompts, params, stops):
    """One policy turn per row through ``generate_turns``: ``{row: TurnEnd}``."""
    ends = {}

    def on_turns(batch):
        ends.update((t.row, t) for t in batch)
        return [None] * len(batch)

    async def run():
        keys = list(range(len(prompts)))
        await engine.generate_turns(prompts, params, keys=keys, max_total_tokens=512, on_turns=on_turns, stops=stops)
        return ends

    return run()


def _stops(tokenizer, strings: dict):
    from gspo_mcore.rollout.turns import TurnStop

    def stops(b):
        s = strings.get(b)
        return None if s is None else TurnStop((s,), lambda ids: s in _decode(tokenizer, ids))

    return stops


def test_a_stop_string_ends_a_greedy_turn_at_the_token_that_completes_it(server, figures):
    from transformers import AutoTokenizer

    from gspo_mcore.rollout import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(server.base_dir)
    params = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)

    async def run():
        async with server.engine() as engine:
            free = await _turns(engine, PROMPTS, params, None)
            strings = {b: _pick_stop(_decode(tokenizer, free[b].ids)) for b in free}
            strings = {b: s for b, s in strings.items() if s is not None}
            return free, strings, await _turns(engine, PROMPTS, params, _stops(tokenizer, strings))

    free, strings, stopped = asyncio.run(run())
    assert len(strings) >= 3, {b: _decode(tokenizer, t.ids) for b, t in free.items()}
    worst = 0.0
    for b, t in stopped.items():
        f = free[b]
        assert f.finish_reason == "length" and len(f.ids) == MAX_NEW  # the control: it goes on
        if b not in strings:
            assert list(t.ids) == list(f.ids) and t.finish_reason == "length"  # no stop string: the same turn
            continue
        s = strings[b]
        where = f"row {b}, stop {s!r}, free turn {_decode(tokenizer, f.ids)!r}"
        end = next(k + 1 for k in range(len(f.ids)) if s in _decode(tokenizer, f.ids[: k + 1]))
        assert end < len(f.ids), where
        assert t.finish_reason == "stop", f"{where}: finish {t.finish_reason!r}, {_decode(tokenizer, t.ids)!r}"
        assert list(t.ids) == list(f.ids[:end]), f"{where}: stopped turn {_decode(tokenizer, t.ids)!r}"
        assert s in _decode(tokenizer, t.ids) and s not in _decode(tokenizer, t.ids[:-1]), where
        assert len(t.logprobs) == len(t.ids) == len(t.versions) and set(t.versions) == {0}, where
        diff = max(abs(a - c) for a, c in zip(t.logprobs, f.logprobs[:end]))
        worst = max(worst, diff)
        assert diff <= LOGPROB_TOL, f"{where}: log-probs differ from the free turn's by {diff:.3g}"
    figures("stop strings (greedy): max |logp stopped turn - logp free turn|", worst)


def test_a_stop_string_ends_sampled_turns_at_its_first_completion(server, figures):
    from collections import Counter

    from transformers import AutoTokenizer

    from gspo_mcore.rollout import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(server.base_dir)
    params = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, ignore_eos=True)
    prompts = [p for p in PROMPTS for _ in range(2)]

    async def run():
        async with server.engine() as engine:
            free = await _turns(engine, prompts, params, None)
            counts = Counter(c for t in free.values() for c in _decode(tokenizer, t.ids) if c.strip())
            s = counts.most_common(1)[0][0]
            return s, await _turns(engine, prompts, params, _stops(tokenizer, dict.fromkeys(range(len(prompts)), s)))

    s, stopped = asyncio.run(run())
    early = 0
    for b, t in stopped.items():
        text, where = _decode(tokenizer, t.ids), f"row {b}, stop {s!r}"
        assert len(t.logprobs) == len(t.ids) and all(lp <= 1e-6 for lp in t.logprobs), where
        if t.finish_reason == "stop":
            early += 1
            assert s in text and s not in _decode(tokenizer, t.ids[:-1]), f"{where}: {text!r}"
            assert len(t.ids) < MAX_NEW or text.endswith(s), where
        else:
            assert t.finish_reason == "length" and len(t.ids) == MAX_NEW and s not in text, f"{where}: {text!r}"
    figures("stop strings (t=1): turns ended by the stop string, of 10", early)
    assert early >= len(prompts) // 2, f"only {early} of {len(prompts)} turns ended at {s!r}"
