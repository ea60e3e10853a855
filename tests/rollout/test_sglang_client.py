"""The SGLang client over real sockets, against stand-in servers (sglang_standin.py; NOT SGLang).

Invariant checked throughout: ``generate`` returns, for every prompt ``i``, exactly ``n`` samples whose
tokens are the stand-in's deterministic answer for ``(prompt_i, j)`` - so a dropped, duplicated or
misplaced sample would show - or it raises an error naming the server URL.
"""

import asyncio
import threading
import time

import pytest
import torch
from sglang_standin import expected_response

from gspo_mcore.rollout import RolloutError, SamplingParams, SGLangClientConfig, SGLangEngine, WeightUpdateError

FAST = dict(
    request_timeout_s=5.0,
    connect_timeout_s=5.0,
    control_timeout_s=5.0,
    weight_update_timeout_s=5.0,
    probe_timeout_s=5.0,
    flush_poll_s=0.01,
    flush_timeout_s=2.0,
)
PARAMS = SamplingParams(max_new_tokens=4, temperature=0.8, stop_token_ids=(500,))
PROMPTS = [[i + 1, 2 * i + 3, 7] for i in range(12)]


def engine(servers, **config):
    return SGLangEngine([s.url for s in servers], config=SGLangClientConfig(**{**FAST, **config}))


def generate(eng, prompts=PROMPTS, n=3, params=PARAMS):
    return asyncio.run(eng.generate(prompts, n, params))


def assert_complete(out, prompts, n, params=PARAMS, version=0):
    assert len(out) == len(prompts)
    for i, (group, prompt) in enumerate(zip(out, prompts)):
        assert len(group) == n
        for j, s in enumerate(group):
            ids, lps, finish = expected_response(prompt, j, params.max_new_tokens, params.stop_token_ids)
            assert (s.prompt_index, s.sample_index) == (i, j)
            assert s.prompt_ids == tuple(prompt)
            assert s.response_ids == tuple(ids)
            assert s.response_logprobs == pytest.approx(lps)
            assert s.finish_reason == finish
            assert s.weight_version == version


def generate_calls(server):
    return [b for p, b in server.calls if p == "/generate"]


# ----------------------------------------------------------------------------------- generation
def test_generate_spreads_prompts_over_servers(standins):
    a, b = standins(delay_s=0.02), standins(delay_s=0.02)
    out = generate(engine([a, b]))
    assert_complete(out, PROMPTS, 3)
    assert a.generate_served > 0 and b.generate_served > 0
    assert a.generate_served + b.generate_served == len(PROMPTS)  # one request per prompt, none repeated
    for body in generate_calls(a) + generate_calls(b):
        assert body["return_logprob"] is True and "text" not in body
        assert body["input_ids"] in PROMPTS and body["sampling_params"]["n"] == 3


def test_seeded_generation_one_seed_per_sample(standins):
    a = standins()
    params = SamplingParams(max_new_tokens=4, seed=1234)
    out = generate(engine([a]), prompts=PROMPTS[:3], n=2, params=params)
    assert_complete(out, PROMPTS[:3], 2, params)
    seeds = [sp["sampling_seed"] for body in generate_calls(a) for sp in body["sampling_params"]]
    assert len(set(seeds)) == 6


def test_empty_batch_and_bad_arguments(standins):
    eng = engine([standins()])
    assert generate(eng, prompts=[]) == []
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(eng, prompts=[[1], []])


def test_server_dying_mid_batch_is_retried_elsewhere(standins):
    """Server A answers two requests, then dies (drops the connection and stops listening): its
    in-flight and later requests go to B, and every prompt still gets exactly its n samples."""
    a, b = standins(delay_s=0.05), standins(delay_s=0.05)
    a.misbehave, a.misbehave_after = "die", 2
    eng = engine([a, b])
    out = generate(eng)
    assert_complete(out, PROMPTS, 3)
    assert a.url in eng._down
    prompts_done_by_b = [body["input_ids"] for body in generate_calls(b)]
    assert len(prompts_done_by_b) == len(PROMPTS) - 2


def test_hanging_server_times_out_and_is_retried_elsewhere(standins):
    a, b = standins(), standins()
    a.misbehave = "hang"
    eng = engine([a, b], request_timeout_s=0.5)
    t0 = time.monotonic()
    out = generate(eng)
    assert time.monotonic() - t0 < 5
    assert_complete(out, PROMPTS, 3)
    assert "no complete response within 0.5s" in eng._down[a.url]


def test_truncated_response_is_retried_elsewhere(standins):
    a, b = standins(), standins()
    a.misbehave = "truncate"
    out = generate(engine([a, b]))
    assert_complete(out, PROMPTS, 3)


def test_truncated_response_error_names_the_server(standins):
    a = standins()
    a.misbehave = "truncate"
    with pytest.raises(RolloutError, match=rf"{a.url}: response truncated: got \d+ of \d+ body bytes"):
        generate(engine([a], max_attempts=2), prompts=PROMPTS[:1])


def test_single_hanging_server_fails_the_step_naming_it(standins):
    a = standins()
    a.misbehave = "hang"
    with pytest.raises(RolloutError) as e:
        generate(engine([a], request_timeout_s=0.3), prompts=PROMPTS[:2])
    msg = str(e.value)
    assert a.url in msg and "no complete response within 0.3s" in msg and "prompt" in msg


def test_all_servers_dead_fails_naming_every_url(standins):
    a, b = standins(), standins()
    a.misbehave = b.misbehave = "die"
    with pytest.raises(RolloutError) as e:
        generate(engine([a, b]))
    assert a.url in str(e.value) and b.url in str(e.value)


def test_server_never_up_is_a_clear_connect_error(standins):
    a = standins()
    a.stop()
    with pytest.raises(RolloutError, match=rf"{a.url}: cannot connect"):
        generate(engine([a], max_attempts=1), prompts=PROMPTS[:1])


def test_http_500_is_retried_elsewhere_but_not_counted_as_down(standins):
    a, b = standins(), standins()
    a.misbehave = "http500"
    eng = engine([a, b])
    assert_complete(generate(eng), PROMPTS, 3)
    assert a.url not in eng._down


def test_malformed_response_fails_at_once_with_a_clear_error(standins):
    a, b = standins(), standins()
    a.misbehave = b.misbehave = "malformed"
    with pytest.raises(RolloutError) as e:
        generate(engine([a, b]), prompts=PROMPTS[:1])
    msg = str(e.value)
    assert "malformed response from http://127.0.0.1:" in msg and "/generate to prompt 0" in msg
    assert "output_token_logprobs" in msg
    assert a.generate_served + b.generate_served == 1  # not retried


def test_rejected_request_reports_the_server_message(standins, monkeypatch):
    """A 4xx is not retried: the step fails with the server's own message (here: an unknown key)."""
    import gspo_mcore.rollout.sglang_api as api

    a = standins()
    original = api.sampling_params_json
    monkeypatch.setattr(api, "sampling_params_json", lambda *args, **kw: {**original(*args, **kw), "bogus_key": 1})
    with pytest.raises(
        RolloutError, match=rf"{a.url}/generate rejected prompt 0 .*HTTP 400: unknown field `bogus_key`"
    ):
        generate(engine([a]), prompts=PROMPTS[:1])
    assert a.generate_served == 1


def test_abort_finish_reason_is_passed_through(standins):
    a = standins()
    a.misbehave = "abort"
    out = generate(engine([a]), prompts=PROMPTS[:2], n=2)
    assert all(s.finish_reason == "abort" for g in out for s in g)
    assert [len(g) for g in out] == [2, 2]


def test_failed_server_is_readmitted_after_a_health_probe(standins):
    a, b = standins(), standins()
    a.misbehave = "drop"
    eng = engine([a, b])
    assert_complete(generate(eng), PROMPTS, 3)
    assert a.url in eng._down
    a.misbehave = None
    served = a.generate_served
    assert_complete(generate(eng), PROMPTS, 3)  # probed /health_generate at the start, then used again
    assert a.url not in eng._down and a.generate_served > served
    assert "/health_generate" in a.paths()


def test_health(standins):
    a, b = standins(), standins()
    b.health_status = 503
    assert asyncio.run(engine([a, b]).health()) == {a.url: True, b.url: False}


def test_router_url_takes_generate_traffic_and_workers_take_control(standins):
    worker = standins()
    router = standins(proxy_to=worker.url)
    eng = SGLangEngine([worker.url], router_url=router.url, config=SGLangClientConfig(**FAST))
    assert_complete(generate(eng, prompts=PROMPTS[:4]), PROMPTS[:4], 3)
    assert router.generate_served == 4
    asyncio.run(eng.pause())
    assert "/pause_generation" in worker.paths() and "/pause_generation" not in router.paths()


def test_concurrency_limit_per_server(standins):
    a = standins(delay_s=0.1)
    eng = engine([a], max_inflight_per_server=4)
    t0 = time.monotonic()
    assert_complete(generate(eng, prompts=PROMPTS[:8], n=1), PROMPTS[:8], 1)
    assert time.monotonic() - t0 >= 0.2  # 8 requests, 4 at a time, 0.1 s each


# ------------------------------------------------------------------------------- weight updates
def test_update_from_disk_pauses_flushes_updates_and_continues(standins):
    a, b = standins(), standins()
    a.busy_flushes = 2  # requests still running: /flush_cache answers 400 twice
    eng = engine([a, b])
    asyncio.run(eng.update_weights_from_disk("/ckpt/step_5", 5))
    assert eng.weight_version == 5
    for s in (a, b):
        ops = [p for p in s.paths() if p != "/generate"]
        assert ops[0] == "/pause_generation" and ops[-2:] == ["/update_weights_from_disk", "/continue_generation"]
        assert "/begin_weight_update" not in ops
    assert a.paths().count("/flush_cache") == 3
    body = dict(a.calls)["/update_weights_from_disk"]
    assert body["model_path"] == "/ckpt/step_5" and body["weight_version"] == "5"
    assert_complete(generate(eng), PROMPTS, 3, version=5)


def _buckets():
    return [
        [("model.embed_tokens.weight", torch.arange(6.0).view(3, 2))],
        [("model.norm.weight", torch.ones(2)), ("lm_head.weight", torch.full((3, 2), 2.0))],
    ]


def test_update_from_tensor_runs_in_a_session(standins, file_system_sharing):
    a, b = standins(tp_size=2), standins()
    eng = engine([a, b])
    asyncio.run(eng.update_weights(_buckets(), 7))
    assert eng.weight_version == 7
    ops = [p for p in a.paths() if p not in ("/generate", "/server_info")]
    assert ops == [
        "/pause_generation",
        "/flush_cache",
        "/begin_weight_update",
        "/update_weights_from_tensor",
        "/update_weights_from_tensor",
        "/end_weight_update",
        "/continue_generation",
    ]
    updates = [body for p, body in a.calls if p == "/update_weights_from_tensor"]
    assert [u["flush_cache"] for u in updates] == [False, True]
    assert ["weight_version" in u for u in updates] == [False, True] and updates[1]["weight_version"] == "7"
    assert [len(u["serialized_named_tensors"]) for u in updates] == [2, 2]  # one payload per TP rank
    got = [(n, t) for bucket in a.received_tensors for n, t in bucket]
    want = [(n, t) for bucket in _buckets() for n, t in bucket]
    assert [n for n, _ in got] == [n for n, _ in want]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(got, want))
    assert_complete(generate(eng), PROMPTS, 3, version=7)


def test_update_from_tensor_without_session_endpoints(standins, file_system_sharing):
    """Servers older than 0.5.23 answer 404 to /begin_weight_update: update without a session."""
    a = standins(has_session=False)
    eng = engine([a])
    asyncio.run(eng.control.update_from_tensor(_buckets(), 2))
    assert "/end_weight_update" not in a.paths() and a.paths().count("/update_weights_from_tensor") == 2
    assert eng.weight_version == 2


def test_failed_update_raises_closes_the_session_and_stays_paused(standins, file_system_sharing):
    a = standins()
    a.fail_update = "/update_weights_from_tensor"
    eng = engine([a])
    with pytest.raises(WeightUpdateError, match=rf"{a.url}/update_weights_from_tensor failed: HTTP 400: stand-in told"):
        asyncio.run(eng.control.update_from_tensor(_buckets(), 3))
    assert a.paths()[-1] == "/end_weight_update" and "/continue_generation" not in a.paths()
    assert eng.weight_version == 0


def test_no_buckets_is_an_error(standins):
    eng = engine([standins()])
    with pytest.raises(ValueError, match="no weight buckets"):
        asyncio.run(eng.control.update_from_tensor([], 1))


def test_distributed_group_and_broadcast(standins):
    """Rank 0 is the trainer; server i gets rank_offset 1 + sum of earlier servers' tp x pp. Each
    server's request only completes once the trainer side runs (the stand-in waits for it), so this
    also shows the client runs the trainer callbacks while the requests are open."""
    a, b = standins(tp_size=1), standins(tp_size=2)
    eng = engine([a, b])
    seen = {}

    def trainer_init(world_size):
        seen["world"] = world_size
        a.trainer_collective(), b.trainer_collective()

    def broadcast(bucket):
        seen.setdefault("broadcast", []).append([n for n, _ in bucket])
        a.trainer_collective(), b.trainer_collective()

    async def run():
        world = await eng.control.init_group(
            master_address="127.0.0.1",
            master_port=29555,
            trainer_init=trainer_init,
            broadcast=broadcast,
            group_name="g0",
            backend="gloo",
        )
        await eng.update_weights(_buckets(), 4)
        return world

    assert asyncio.run(run()) == 4 and seen["world"] == 4
    inits = {s.url: dict(s.calls)["/init_weights_update_group"] for s in (a, b)}
    assert [inits[a.url]["rank_offset"], inits[b.url]["rank_offset"]] == [1, 2]
    assert all(i["world_size"] == 4 and i["group_name"] == "g0" and i["backend"] == "gloo" for i in inits.values())
    assert seen["broadcast"] == [["model.embed_tokens.weight"], ["model.norm.weight", "lm_head.weight"]]
    metas = [body for p, body in b.calls if p == "/update_weights_from_distributed"]
    assert [m["names"] for m in metas] == seen["broadcast"]
    assert metas[1]["dtypes"] == ["float32", "float32"] and metas[1]["shapes"] == [[2], [3, 2]]
    assert [m.get("weight_version") for m in metas] == [None, "4"]
    assert eng.weight_version == 4
    assert_complete(generate(eng), PROMPTS, 3, version=4)


def test_distributed_update_failure_while_trainer_is_blocked(standins):
    """If a server fails while the trainer's broadcast is still blocked, the error says so."""
    a = standins()
    eng = engine([a])
    stuck = threading.Event()

    async def run():
        await eng.control.init_group(
            master_address="127.0.0.1", master_port=1, group_name="g", trainer_init=lambda w: a.trainer_collective()
        )
        a.fail_update = "/update_weights_from_distributed"
        await eng.control.update_from_distributed(_buckets(), 1, broadcast=lambda bucket: stuck.wait(10))

    try:
        with pytest.raises(WeightUpdateError, match="still blocked in its thread"):
            asyncio.run(run())
    finally:
        stuck.set()


def test_trainer_side_failure_is_reported(standins):
    a = standins(collective_timeout_s=0.5)
    eng = engine([a])

    def trainer_init(world_size):
        raise RuntimeError("rendezvous refused")

    with pytest.raises(WeightUpdateError, match="rendezvous refused"):
        asyncio.run(eng.control.init_group(master_address="127.0.0.1", master_port=1, trainer_init=trainer_init))


@pytest.mark.parametrize(
    "bad", [{"request_timeout_s": 0}, {"max_attempts": 0}, {"max_inflight_per_server": 0}, {"pause_mode": "later"}]
)
def test_client_config_validates(bad):
    with pytest.raises(ValueError):
        SGLangClientConfig(**bad)


def test_in_place_pause_mode_is_refused_naming_the_key():
    """SGLang refuses /flush_cache while requests are held in place, so a weight update (pause, flush, ...)
    could never succeed in that mode (tests/integration/test_real_control.py measured it against SGLang
    0.5.23): the client refuses the mode when configured, directly and through the trainer's config."""
    from gspo_mcore.config import ConfigError
    from gspo_mcore.train import parse_config

    with pytest.raises(ValueError, match=r"pause_mode='in_place' cannot be used: .*/flush_cache"):
        SGLangClientConfig(pause_mode="in_place")
    with pytest.raises(ConfigError, match=r"rollout\.sglang\.client\.pause_mode"):
        parse_config(["--config", "examples/tiny/config.yaml", "rollout.sglang.client.pause_mode=in_place"])
    assert SGLangClientConfig(pause_mode="retract").pause_mode == "retract"


def test_release_and_resume_memory_for_colocated_mode(standins):
    a, b = standins(), standins()
    eng = engine([a, b])
    asyncio.run(eng.control.release_memory())
    asyncio.run(eng.control.resume_memory(("weights",)))
    for s in (a, b):
        assert s.paths() == ["/release_memory_occupation", "/resume_memory_occupation"]
        assert [body for _, body in s.calls] == [{"tags": ["weights", "kv_cache"]}, {"tags": ["weights"]}]
    with pytest.raises(ValueError, match="memory tags"):
        asyncio.run(eng.control.release_memory(("gpu",)))


def test_pause_resume_and_server_info(standins):
    a = standins(version="0.5.22")
    eng = engine([a])
    asyncio.run(eng.pause())
    asyncio.run(eng.resume())
    assert a.paths() == ["/pause_generation", "/continue_generation"]
    assert dict(a.calls)["/pause_generation"] == {"mode": "abort"}
    info = asyncio.run(eng.control.server_info())[a.url]
    assert info.version == "0.5.22"  # logged as a mismatch with SGLANG_VERSION, not an error


def test_control_reads_that_fail_name_the_url_and_path(standins):
    """``/model_info`` and ``/server_info`` share one read: a body of another shape and a status other than 200
    are each a RolloutError naming the server URL and the path."""
    a = standins(weight_version="v-bogus")
    eng = engine([a])
    with pytest.raises(RolloutError, match=f"{a.url}/model_info failed: .*'v-bogus' is not a training step"):
        asyncio.run(eng.control.weight_version_of(a.url))
    with pytest.raises(RolloutError, match=f"{a.url}/nowhere/model_info failed: HTTP 404"):
        asyncio.run(eng.control.weight_version_of(a.url + "/nowhere"))
    with pytest.raises(RolloutError, match=f"{a.url}/nowhere/server_info failed: HTTP 404"):
        asyncio.run(SGLangEngine([a.url + "/nowhere"], config=SGLangClientConfig(**FAST)).control.server_info())
