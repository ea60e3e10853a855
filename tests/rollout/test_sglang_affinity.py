"""Episode affinity of the SGLang engine (:meth:`SGLangEngine.generate_turns`): every turn of an episode goes to the
server that answered its previous turn, while that server is up; behind a router, each turn carries the episode's
routing key. Over real sockets against stand-in servers (sglang_standin.py; NOT SGLang), which record what they got.
Single-turn groups keep the least-busy balancing (tests/rollout/test_sglang_client.py)."""

from __future__ import annotations

import asyncio
import collections

from gspo_mcore.rollout import SamplingParams, SGLangClientConfig, SGLangEngine
from gspo_mcore.rollout import sglang_api as api

FAST = dict(request_timeout_s=5.0, connect_timeout_s=2.0, probe_timeout_s=2.0, max_attempts=3)
ROWS = 8
PROMPTS = [[100 + r, r, 7] for r in range(ROWS)]
PARAMS = SamplingParams(max_new_tokens=3, seed=1)


def run_episodes(engine, turns=3, on_round=None):
    """``ROWS`` episodes of ``turns`` turns each (an environment span of one token between turns);
    ``on_round(turns done per row)`` after each batch of turn ends."""
    done = [0] * ROWS

    def on_turns(ends):
        answers = []
        for e in ends:
            done[e.row] += 1
            answers.append(None if done[e.row] == turns else [50 + e.row])
        if on_round is not None:
            on_round(done)  # before the next turns are sent
        return answers

    asyncio.run(engine.generate_turns(PROMPTS, PARAMS, keys=range(ROWS), max_total_tokens=64, on_turns=on_turns))
    assert done == [turns] * ROWS


def served(servers):
    """row -> the servers (by position) that answered its turns, in order of arrival."""
    rows = collections.defaultdict(list)
    for k, s in enumerate(servers):
        for path, body in s.calls:
            if path == api.GENERATE:
                rows[body["input_ids"][0] - 100].append(k)
    return rows


def test_every_turn_of_an_episode_goes_to_its_first_server(standins):
    # the slow server finishes its turns all at once, when the fast one is idle: least-busy picking alone would
    # send many of their next turns to the fast server, away from their cached prefixes
    slow, fast = standins(delay_s=0.2), standins()
    engine = SGLangEngine([slow.url, fast.url], config=SGLangClientConfig(**FAST))
    run_episodes(engine)
    rows = served([slow, fast])
    assert sorted(rows) == list(range(ROWS)) and all(len(v) == 3 for v in rows.values())
    assert {r: set(v) for r, v in rows.items() if len(set(v)) != 1} == {}, "an episode moved between servers"
    firsts = collections.Counter(v[0] for v in rows.values())
    assert firsts[0] > 0 and firsts[1] > 0  # the first turns are still spread over both servers
    assert engine.episode_moves == 0


def test_an_episode_whose_server_fails_moves_to_the_least_busy_and_stays(standins):
    a, b = standins(), standins()
    engine = SGLangEngine([a.url, b.url], config=SGLangClientConfig(**FAST))

    def kill_a(done):
        if min(done) == 1 and a.misbehave is None:  # every first turn answered: a drops the next request and stops
            a.misbehave, a.misbehave_after = "die", 0

    run_episodes(engine, turns=4, on_round=kill_a)
    rows = served([a, b])
    answered_by_a = [r for r, v in rows.items() if v[0] == 0]
    assert answered_by_a, "no episode started on server a"
    for r, v in rows.items():
        if r in answered_by_a:  # its turns on a (one request perhaps dropped there), then on b for good
            assert v == sorted(v) and v[-1] == 1, (r, v)
        else:
            assert set(v) == {1}, (r, v)
    assert engine.episode_moves == len(answered_by_a)
    assert a.url in engine._down


def test_behind_a_router_each_turn_carries_its_episodes_routing_key(standins):
    worker = standins()
    router = standins(proxy_to=worker.url)  # stands in for sglang-router: passes /generate on
    engine = SGLangEngine([worker.url], router_url=router.url, config=SGLangClientConfig(**FAST))
    run_episodes(engine)
    keys = collections.defaultdict(set)
    for (path, body), headers in zip(router.calls, router.headers):
        if path == api.GENERATE:
            keys[body["input_ids"][0] - 100].add(headers.get(api.ROUTING_KEY_HEADER.lower()))
    assert dict(keys) == {r: {f"episode-{r}"} for r in range(ROWS)}
    # single-turn groups keep the router's own balancing: no key
    asyncio.run(engine.generate([[1, 2]], 2, PARAMS))
    assert api.ROUTING_KEY_HEADER.lower() not in router.headers[-1]


def test_affinity_can_be_switched_off(standins):
    slow, fast = standins(delay_s=0.2), standins()
    engine = SGLangEngine([slow.url, fast.url], config=SGLangClientConfig(**FAST, episode_affinity=False))
    run_episodes(engine)
    rows = served([slow, fast])
    assert any(len(set(v)) > 1 for v in rows.values()), "without affinity some episodes change server"
    assert engine.prompt_tokens > 0  # the stand-in reports prompt_tokens (and cached_tokens 0)
