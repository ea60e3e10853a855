"""Episode affinity through the real sglang-router 0.3.2 (from the SGLang environment): with ``--policy manual``,
every turn of an episode carrying its routing key (:data:`sglang_api.ROUTING_KEY_HEADER`) reaches one worker.
The workers are stand-ins (tests/rollout/sglang_standin.py; NOT SGLang: the router is what is tested here), so
the test takes seconds."""

from __future__ import annotations

import asyncio
import collections
import os
import sys

import pytest
from sglang_cpu import PYTHON

from gspo_mcore.rollout import RouterConfig, SamplingParams, SGLangClientConfig, SGLangEngine
from gspo_mcore.rollout import sglang_api as api
from gspo_mcore.rollout.sglang_server import launch_router

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "rollout"))
from sglang_standin import StandIn  # noqa: E402

pytestmark = pytest.mark.sglang


def test_router_keeps_each_episode_on_one_worker(tmp_path):
    workers = [StandIn(), StandIn()]
    for w in workers:
        w.start()
    cfg = RouterConfig(python=PYTHON, policy="manual", extra_args=("--assignment-mode", "min_load"))
    router = launch_router(cfg, [w.url for w in workers], log_dir=str(tmp_path))
    try:
        engine = SGLangEngine([w.url for w in workers], router_url=router.url, config=SGLangClientConfig())
        rows, done = 12, [0] * 12

        def on_turns(ends):
            for e in ends:
                done[e.row] += 1
            return [None if done[e.row] == 3 else [50 + e.row] for e in ends]

        prompts = [[100 + r, r] for r in range(rows)]
        asyncio.run(
            engine.generate_turns(
                prompts, SamplingParams(max_new_tokens=3), keys=range(rows), max_total_tokens=64, on_turns=on_turns
            )
        )
        where = collections.defaultdict(set)
        for k, w in enumerate(workers):
            for path, body in w.calls:
                if path == api.GENERATE:
                    where[body["input_ids"][0] - 100].add(k)
        assert done == [3] * rows and sorted(where) == list(range(rows))
        assert {r: ws for r, ws in where.items() if len(ws) != 1} == {}, f"episodes split: {dict(where)}"
    finally:
        router.shutdown(timeout_s=10)
        for w in workers:
            w.stop()
