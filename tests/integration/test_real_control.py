"""Pause/continue, aborts, a weight update in the middle of a batch, and servers killed mid-batch, through the
project's SGLang client against real SGLang 0.5.23 servers.

What the client promises (gspo_mcore/rollout/sglang.py, sglang_control.py, types.py):

- ``pause()`` in ``abort`` mode (the default, and what a weight update does) returns the running requests at
  once with ``finish_reason == "abort"`` and their partial tokens, each with its log-prob; ``retract`` keeps
  them, and they finish normally after ``resume()``;
- while paused, new requests wait; ``resume()`` lets them run;
- a weight update during a batch (pause -> flush -> update -> continue): ``abort`` returns the batch
  aborted with the old version; ``retract`` finishes it after the update, reported with the oldest version
  that produced it. (SGLang's ``in_place`` mode is refused by ``SGLangClientConfig``: this tier measured that
  SGLang refuses the update's flush while requests are held in place, so every update failed; see
  ``tests/rollout/test_sglang_client.py::test_in_place_pause_mode_is_refused_naming_the_key``.)
- a request that fails in transport (a killed server) is retried on another server and the dead one taken
  out of rotation; with no server left, ``generate`` raises :class:`RolloutError` naming the server URL
  and the request, quickly, not after the request timeout. Either every prompt gets its ``n`` samples or
  the call raises.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from sglang_cpu import PROMPTS, get_json, launch, server_config

from gspo_mcore.rollout import RolloutError, SamplingParams

pytestmark = pytest.mark.sglang

LONG = SamplingParams(temperature=1.0, max_new_tokens=2000, ignore_eos=True)
SHORT = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)


async def wait_running(url: str, at_least: int, timeout_s: float = 120.0) -> int:
    """Poll the server's ``/v1/loads`` until ``at_least`` requests are decoding (test-side inspection)."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = await asyncio.to_thread(get_json, url + "/v1/loads?include=core")
        running = sum(int(x.get("num_running_reqs", 0)) for x in loads["loads"])
        if running >= at_least:
            return running
        if time.monotonic() > deadline:
            raise AssertionError(f"{url}: only {running} running requests after {timeout_s} s: {loads}")
        await asyncio.sleep(0.05)


def check_group_shapes(groups, prompts, n):
    assert len(groups) == len(prompts)
    for i, g in enumerate(groups):
        assert [(s.prompt_index, s.sample_index) for s in g] == [(i, j) for j in range(n)]
        for s in g:
            assert len(s.response_logprobs) == len(s.response_ids)


def test_pause_abort_returns_partial_samples_and_new_requests_wait(server, figures):
    async def main():
        async with server.engine(pause_mode="abort") as eng:
            prompts = PROMPTS[:4]
            task = asyncio.create_task(eng.generate(prompts, 2, LONG))
            await wait_running(server.url, 8)
            await asyncio.sleep(0.3)  # some tokens decoded
            t0 = time.monotonic()
            await eng.pause()
            groups = await asyncio.wait_for(task, 60)
            figures("pause(abort) until the batch returned (s)", time.monotonic() - t0)
            check_group_shapes(groups, prompts, 2)
            for g in groups:
                for s in g:
                    assert s.finish_reason == "abort", s.finish_reason
                    assert len(s.response_ids) < LONG.max_new_tokens
                    assert s.weight_version == 0
            assert sum(len(s.response_ids) for g in groups for s in g) > 0  # partial tokens come back

            # paused: a new request waits; resume lets it through
            waiting = asyncio.create_task(eng.generate(PROMPTS[:1], 2, SHORT))
            await asyncio.sleep(2.0)
            assert not waiting.done(), "a request ran while the server was paused"
            await eng.resume()
            (g,) = await asyncio.wait_for(waiting, 60)
            assert [s.finish_reason for s in g] == ["length", "length"]
            assert all(len(s.response_ids) == SHORT.max_new_tokens for s in g)

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["retract"])
def test_pause_keeps_requests_in_place_and_retract_modes(mode, server):
    params = SamplingParams(temperature=1.0, max_new_tokens=600, ignore_eos=True)

    async def main():
        async with server.engine(pause_mode=mode) as eng:
            prompts = PROMPTS[:3]
            task = asyncio.create_task(eng.generate(prompts, 2, params))
            await wait_running(server.url, 6)
            await eng.pause()
            await asyncio.sleep(1.5)
            assert not task.done(), f"pause({mode}) ended the running requests"
            await eng.resume()
            groups = await asyncio.wait_for(task, 300)
            check_group_shapes(groups, prompts, 2)
            for g in groups:
                for s in g:
                    assert s.finish_reason == "length"
                    assert len(s.response_ids) == params.max_new_tokens

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["abort", "retract"])
def test_weight_update_during_a_batch(mode, server):
    """The trainer's update while a rollout runs. ``abort`` (the default): the running requests come back
    aborted with the old version. ``retract``: they are put back in the queue and finish after the update,
    reported with the oldest version that produced them (0). Later requests carry the new version."""
    server.holds_base = False
    params = SamplingParams(temperature=1.0, max_new_tokens=1500, ignore_eos=True)

    async def main():
        async with server.engine(pause_mode=mode, flush_timeout_s=5.0) as eng:
            task = asyncio.create_task(eng.generate(PROMPTS[:2], 2, params))
            try:
                await wait_running(server.url, 4)
                await eng.update_weights_from_disk(server.base_dir, 7)
                old = await asyncio.wait_for(task, 120)
            finally:
                if not task.done():  # a failed update leaves the server paused: let the batch finish
                    await eng.resume()
                    await asyncio.wait_for(task, 120)
            for g in old:
                for s in g:
                    assert s.weight_version == 0
                    if mode == "abort":
                        assert s.finish_reason == "abort" and len(s.response_ids) < params.max_new_tokens
                    else:
                        assert s.finish_reason == "length" and len(s.response_ids) == params.max_new_tokens
            assert eng.weight_version == 7
            (g,) = await eng.generate(PROMPTS[:1], 2, SHORT)
            assert [s.weight_version for s in g] == [7, 7]
        assert get_json(server.url + "/model_info")["weight_version"] == "7"

    asyncio.run(main())


# ----------------------------------------------------------------------------- a server killed mid-batch
@pytest.fixture
def doomed(tiny_ckpt, tmp_path):
    """One more server, which the test ends with SIGKILL."""
    log_dir = str(tmp_path / "logs")
    (proc,), seconds = launch([server_config(tiny_ckpt, log_dir)], log_dir)
    yield proc, seconds
    proc.shutdown(timeout_s=5.0)


def kill(proc) -> None:
    """SIGKILL the server's whole process group (HTTP front end, scheduler, detokenizer)."""
    os.killpg(proc.popen.pid, signal.SIGKILL)
    proc.popen.wait(30)


def test_server_killed_mid_batch(doomed, server, figures):
    """Two clients have a batch running on the victim when it is SIGKILLed: one that has only the victim
    raises RolloutError naming its URL (within seconds, not after the request timeout); one that also has the
    session's server retries the victim's prompts there, and every prompt still gets its n samples. Both
    then report the victim unhealthy."""
    from gspo_mcore.rollout import SGLangClientConfig, SGLangEngine

    victim, seconds = doomed
    figures("second server start to healthy (s)", seconds)
    params = SamplingParams(temperature=1.0, max_new_tokens=800, ignore_eos=True)
    config = SGLangClientConfig(request_timeout_s=300.0)

    async def main():
        async with (
            SGLangEngine([victim.url], config=config) as alone,
            SGLangEngine([server.url, victim.url], config=config) as pair,
        ):
            prompts = PROMPTS[:4]
            alone_task = asyncio.create_task(alone.generate(prompts, 2, LONG))
            pair_task = asyncio.create_task(pair.generate(prompts, 2, params))
            await wait_running(victim.url, 8 + 2)  # all of alone's batch and pair's share of its own
            t0 = time.monotonic()
            kill(victim)

            with pytest.raises(RolloutError) as info:
                await asyncio.wait_for(alone_task, 60)
            figures("killed server detected by generate (s)", time.monotonic() - t0)
            assert victim.url in str(info.value) and "prompt" in str(info.value), str(info.value)
            assert await alone.health() == {victim.url: False}

            groups = await asyncio.wait_for(pair_task, 300)
            figures("batch completed after fail-over (s)", time.monotonic() - t0)
            check_group_shapes(groups, prompts, 2)
            for g in groups:
                for s in g:
                    assert s.finish_reason == "length" and len(s.response_ids) == params.max_new_tokens
            assert await pair.health() == {server.url: True, victim.url: False}
            again = await pair.generate(prompts[:2], 2, SHORT)  # the next batch runs on the survivor alone
            check_group_shapes(again, prompts[:2], 2)

    asyncio.run(main())
