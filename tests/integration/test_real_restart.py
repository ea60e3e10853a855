"""Engines that come back right, on real SGLang servers: a launched server killed with SIGKILL is restarted by the
engine, loads the last disk sync and reports its version before it serves again; a server restarted from outside
on the base weights is not sent a request until it holds the current ones."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from sglang_cpu import get_json, server_config

from gspo_mcore.rollout import SamplingParams, SGLangClientConfig, SGLangEngine
from gspo_mcore.rollout.sglang_server import RestartPolicy

pytestmark = pytest.mark.sglang

PROMPTS = [[4 + (i * 5 + k) % 23 for k in range(12)] for i in range(8)]


def test_a_killed_server_is_restarted_and_resynced_before_it_serves(tiny_ckpt, tmp_path):
    configs = [server_config(tiny_ckpt, str(tmp_path)) for _ in range(2)]
    engine = SGLangEngine.launch(
        configs, log_dir=str(tmp_path), restart=RestartPolicy(attempts=1, backoff_s=0.1), config=SGLangClientConfig()
    )
    try:
        asyncio.run(engine.update_weights_from_disk(tiny_ckpt, 5))  # the same weights, tagged version 5
        victim = engine.worker_urls[1]
        proc = engine._launched[victim][0]
        os.killpg(proc.popen.pid, signal.SIGKILL)
        proc.popen.wait(30)
        out = asyncio.run(engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=4, seed=1)))
        assert engine.restarted == 1 and engine._down == {}, engine._down
        assert get_json(victim + "/model_info")["weight_version"] == "5"
        assert {s.weight_version for g in out for s in g} == {5}

        # restarted from outside on the base weights: simulated by tagging it back (the version is what is checked)
        asyncio.run(engine.control.post(victim, "/update_weight_version", {"new_version": "0"}, 60))
        engine.control.last_disk_update = None  # as after a tensor sync: it must wait for the next update
        out = asyncio.run(engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=4, seed=2)))
        assert "serves weight version 0, not 5" in engine._down[victim]
        assert {s.weight_version for g in out for s in g} == {5}
        asyncio.run(engine.update_weights_from_disk(tiny_ckpt, 6))
        asyncio.run(engine.generate(PROMPTS, 1, SamplingParams(max_new_tokens=2, seed=3)))
        assert engine._down == {} and get_json(victim + "/model_info")["weight_version"] == "6"
    finally:
        asyncio.run(engine.close())
