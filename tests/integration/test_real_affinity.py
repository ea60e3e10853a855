"""Episode affinity measured on two real SGLang servers: 3-turn episodes (each turn sends the whole conversation so
far), with affinity on (every turn on the episode's server) and off (each turn to the least busy server). Figures:
the share of prompt tokens the servers' prefix caches served (SGLang's ``meta_info.cached_tokens``) and the
generation time. Both servers' caches are flushed before each run."""

from __future__ import annotations

import asyncio
import time

import pytest
from sglang_cpu import server_config

from gspo_mcore.rollout import SamplingParams, SGLangClientConfig, SGLangEngine

pytestmark = pytest.mark.sglang

ROWS, TURNS, PROMPT_LEN, SPAN = 16, 3, 48, 8


def run(engine) -> tuple[float, float, float]:
    """(cached share of the prompt tokens, the largest share a cache could serve, seconds) of ``ROWS`` episodes of
    ``TURNS`` turns: all but the first prompt and the new environment spans could come from the cache."""
    done = [0] * ROWS

    def on_turns(ends):
        for e in ends:
            done[e.row] += 1
        return [None if done[e.row] == TURNS else [4 + (e.row + k) % 20 for k in range(SPAN)] for e in ends]

    prompts = [[4 + (r * 7 + k) % 23 for k in range(PROMPT_LEN)] for r in range(ROWS)]
    engine.prompt_tokens = engine.cached_tokens = 0
    t0 = time.perf_counter()
    asyncio.run(
        engine.generate_turns(
            prompts, SamplingParams(max_new_tokens=8, seed=3), keys=range(ROWS), max_total_tokens=256, on_turns=on_turns
        )
    )
    seconds = time.perf_counter() - t0
    assert done == [TURNS] * ROWS
    best = 1 - ROWS * (PROMPT_LEN + (TURNS - 1) * SPAN) / engine.prompt_tokens
    return engine.cached_tokens / engine.prompt_tokens, best, seconds


def test_affinity_keeps_the_conversation_in_the_prefix_cache(tiny_ckpt, tmp_path, figures):
    configs = [server_config(tiny_ckpt, str(tmp_path)) for _ in range(2)]
    engine = SGLangEngine.launch(configs, log_dir=str(tmp_path))
    try:
        results = {}
        for on in (False, True, False, True):  # interleaved, so a drift in the machine's load hits both
            engine.config = SGLangClientConfig(episode_affinity=on)
            asyncio.run(engine.control.flush_cache())
            results.setdefault(on, []).append(run(engine))
    finally:
        asyncio.run(engine.close())
    for on, label in ((True, "on"), (False, "off")):
        for i, (share, best, seconds) in enumerate(results[on]):
            figures(f"affinity {label}, run {i}: cached share of prompt tokens (best {best:.3f})", share)
            figures(f"affinity {label}, run {i}: generation time of {ROWS}x{TURNS}-turn episodes (s)", seconds)
    # with affinity every later turn finds its conversation cached; without, it depends on which server was less
    # busy when the turn was sent (measured: from as good to far worse)
    assert all(share >= 0.95 * best for share, best, _ in results[True]), results
