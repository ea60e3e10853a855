"""Request building and response parsing against SGLang 0.5.23's documented shapes.

The responses are the hand-written exchanges in data/ (see data/README.md), not recordings.
"""

import base64
import json
import pickle

import pytest
import torch
from sglang_standin import SAMPLING_KEYS, load_exchange

from gspo_mcore.rollout import sglang_api as api
from gspo_mcore.rollout._http import HttpResponse
from gspo_mcore.rollout.types import SamplingParams, derive_sample_seed


def _resp(exchange: dict) -> HttpResponse:
    body = exchange["body"]
    raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    return HttpResponse(exchange["status"], {"content-type": "application/json"}, raw)


def _parse(body, prompts, n, initial=0):
    groups = api.split_generate_outputs(body, len(prompts), n)
    return [
        [
            api.parse_generate_output(
                item, prompt_ids=prompts[i], prompt_index=i, sample_index=j, initial_weight_version=initial
            )
            for j, item in enumerate(g)
        ]
        for i, g in enumerate(groups)
    ]


# ------------------------------------------------------------------------------------ requests
def test_generate_request_sends_token_ids_and_asks_for_logprobs():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=16, stop_token_ids=(2,))
    body = api.build_generate_request((101, 7592), 4, params, prompt_index=3)
    assert body == {
        "input_ids": [101, 7592],
        "sampling_params": {
            "max_new_tokens": 16,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "n": 4,
            "stop_token_ids": [2],
        },
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": False,
    }
    assert "text" not in body
    json.dumps(body)  # JSON-ready


def test_generate_request_uses_only_documented_sampling_keys():
    """SGLang rejects unknown sampling_params keys with HTTP 400 (data/error_unknown_sampling_param.json)."""
    documented = load_exchange("error_unknown_sampling_param.json")["body"]["error"]
    params = SamplingParams(stop_token_ids=(1,), ignore_eos=True, seed=3)
    for n in (1, 3):
        sp = api.build_generate_request((1,), n, params, prompt_index=0)["sampling_params"]
        for d in sp if isinstance(sp, list) else [sp]:
            assert set(d) <= SAMPLING_KEYS
            assert all(f"`{k}`" in documented for k in d)


def test_seeded_request_gives_every_sample_its_own_seed():
    """SGLang copies one request's sampling_seed to all n parallel samples, so a seeded group is sent
    as a batch of n copies of the prompt, one derived seed each; the response order is the batch order."""
    params = SamplingParams(seed=11, max_new_tokens=4)
    body = api.build_generate_request([5, 6], 3, params, prompt_index=2)
    assert body["input_ids"] == [[5, 6]] * 3
    seeds = [sp["sampling_seed"] for sp in body["sampling_params"]]
    assert seeds == [derive_sample_seed(11, 2, j) & api.SEED_MASK for j in range(3)]
    assert all(sp["n"] == 1 for sp in body["sampling_params"])

    single = api.build_generate_request([5, 6], 1, params, prompt_index=2)
    assert single["input_ids"] == [5, 6]
    assert single["sampling_params"]["sampling_seed"] == derive_sample_seed(11, 2, 0) & api.SEED_MASK


def test_seeds_fit_both_sglang_and_sglang_router():
    """SGLang reads sampling_seed as i64, sglang-router 0.3.2 as u64 (HTTP 422 for a negative one)."""
    negative = next(s for s in range(100) if derive_sample_seed(s, 0, 0) < 0)
    sp = api.build_generate_request([1], 1, SamplingParams(seed=negative), prompt_index=0)["sampling_params"]
    assert 0 <= sp["sampling_seed"] < 2**63


def test_greedy_request_sends_temperature_zero():
    sp = api.build_generate_request([1], 1, SamplingParams(temperature=0), prompt_index=0)["sampling_params"]
    assert sp["temperature"] == 0.0 and sp["top_k"] == -1


# ----------------------------------------------------------------------------------- responses
def test_parse_single_prompt_n1():
    ex = load_exchange("generate_single_n1.json")
    [[s]] = _parse(ex["body"], [ex["request"]["input_ids"]], 1)
    assert s.prompt_ids == (101, 7592, 2088)
    assert s.response_ids == (2157, 1012, 2)  # the matched stop token (2) is included
    assert s.response_logprobs == pytest.approx((-0.6931471805599453, -1.2039728043259361, -0.10536051565782628))
    assert s.finish_reason == "stop"
    assert s.weight_version == 0
    assert (s.prompt_index, s.sample_index) == (0, 0)


def test_parse_n2_list_and_finish_reasons():
    ex = load_exchange("generate_single_n2.json")
    [[a, b]] = _parse(ex["body"], [ex["request"]["input_ids"]], 2)
    assert (a.finish_reason, a.response_ids, a.weight_version) == ("length", (64, 65, 66, 67), 7)
    assert (b.finish_reason, b.response_ids, b.response_logprobs) == ("stop", (88, 13), (-0.5, -0.125))
    assert [a.sample_index, b.sample_index] == [0, 1]


def test_parse_batch_is_prompt_major():
    ex = load_exchange("generate_batch2_n2.json")
    out = _parse(ex["body"], ex["request"]["input_ids"], 2)
    assert [[s.response_ids[0] for s in g] for g in out] == [[10, 12], [20, 22]]
    assert [s.prompt_ids for s in out[1]] == [(4, 5), (4, 5)]
    assert out[1][1].finish_reason == "stop"


def test_parse_abort_keeps_partial_tokens():
    [[s]] = _parse(load_exchange("generate_abort.json")["body"], [[1, 2, 3, 4]], 1)
    assert s.finish_reason == "abort"
    assert s.response_ids == (31, 32) and s.response_logprobs == (-0.75, -1.25)
    assert s.weight_version == 3


def test_weight_version_spans_give_the_oldest_version():
    [[s]] = _parse(load_exchange("generate_weight_versions.json")["body"], [[1, 2]], 1)
    assert s.weight_version == 4
    assert s.token_versions == (4, 4, 5, 5)  # each token's own version, from the spans


def test_one_span_or_none_means_one_version_for_every_token():
    body = load_exchange("generate_weight_versions.json")["body"]
    body["meta_info"]["weight_versions"] = [{"version": "5", "start": 0, "end": 4}]
    [[s]] = _parse(body, [[1, 2]], 1)
    assert (s.weight_version, s.token_versions) == (5, None)
    del body["meta_info"]["weight_versions"]
    [[s]] = _parse(body, [[1, 2]], 1)
    assert (s.weight_version, s.token_versions) == (5, None)


@pytest.mark.parametrize(
    "spans",
    [
        [{"version": "4", "start": 0, "end": 2}, {"version": "5", "start": 3, "end": 4}],  # a gap
        [{"version": "4", "start": 0, "end": 2}, {"version": "5", "start": 2, "end": 5}],  # past the end
        [{"version": "4", "start": 0, "end": 2}],  # short
        [{"version": "4", "start": 0, "end": 2}, {"version": "5", "start": 2}],  # no end
    ],
)
def test_spans_that_do_not_tile_the_output_are_refused(spans):
    body = load_exchange("generate_weight_versions.json")["body"]
    body["meta_info"]["weight_versions"] = spans
    with pytest.raises(api.ProtocolError, match="do not tile the 4 output tokens"):
        _parse(body, [[1, 2]], 1)


def test_default_weight_version_maps_to_initial():
    body = load_exchange("generate_single_n1.json")["body"]
    body["meta_info"]["weight_version"] = "default"
    assert _parse(body, [[1]], 1, initial=12)[0][0].weight_version == 12
    body["meta_info"]["weight_version"] = "tensor-file_system"
    with pytest.raises(api.ProtocolError, match="not a training step"):
        _parse(body, [[1]], 1)


def _broken(edit):
    body = load_exchange("generate_single_n1.json")["body"]
    edit(body)
    return body


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda b: b.pop("meta_info"), "missing 'meta_info'"),
        (lambda b: b["meta_info"].pop("output_token_logprobs"), "output_token_logprobs"),
        (lambda b: b["meta_info"]["output_token_logprobs"].__setitem__(1, [-1.0]), r"output_token_logprobs\[1\]"),
        (lambda b: b["meta_info"]["output_token_logprobs"].__setitem__(0, [None, 2157, None]), "logprob None"),
        (lambda b: b["meta_info"]["output_token_logprobs"].__setitem__(0, [-1.0, "x", None]), "token id"),
        (lambda b: b.__setitem__("output_ids", [2157, 1012]), "disagree"),
        (lambda b: b["meta_info"].__setitem__("finish_reason", {"type": "eos"}), "unknown finish_reason"),
        (lambda b: b["meta_info"].__setitem__("finish_reason", None), "finish_reason is None"),
        (lambda b: b["meta_info"].pop("weight_version"), "weight_version"),
    ],
)
def test_malformed_output_is_a_clear_error(edit, message):
    with pytest.raises(api.ProtocolError, match=message):
        _parse(_broken(edit), [[1]], 1)


def test_wrong_number_of_outputs_is_a_clear_error():
    body = load_exchange("generate_single_n2.json")["body"]
    with pytest.raises(api.ProtocolError, match=r"expected 3 outputs \(1 prompt\(s\) x n=3\), got 2"):
        api.split_generate_outputs(body, 1, 3)
    with pytest.raises(api.ProtocolError, match="JSON object or list"):
        api.split_generate_outputs("oops", 1, 1)


def test_truncated_or_non_json_body_is_a_clear_error():
    raw = json.dumps(load_exchange("generate_single_n1.json")["body"]).encode()
    with pytest.raises(api.ProtocolError, match="not JSON"):
        api.decode_json(HttpResponse(200, {}, raw[: len(raw) // 2]))


def test_error_messages_of_both_error_shapes():
    assert api.error_message(_resp(load_exchange("error_unknown_sampling_param.json"))).startswith(
        "unknown field `bogus_key`"
    )
    assert "longer than the model's context length" in api.error_message(
        _resp(load_exchange("error_generate_value_error.json"))
    )
    assert api.error_message(HttpResponse(502, {}, b"Bad Gateway")) == "Bad Gateway"


# ------------------------------------------------------------------------------------- control
def test_control_responses():
    assert api.check_control_response(_resp(load_exchange("control_update_weights_ok.json")))["success"] is True
    assert api.check_control_response(_resp(load_exchange("control_pause_ok.json")))["status"] == "ok"
    assert api.check_control_response(HttpResponse(200, {}, b"")) == {}
    with pytest.raises(api.ProtocolError, match="must run between begin_weight_update"):
        api.check_control_response(_resp(load_exchange("control_session_required.json")))
    with pytest.raises(api.ProtocolError, match="success=false: nope"):
        api.check_control_response(HttpResponse(200, {}, b'{"success": false, "message": "nope"}'))


def test_weight_update_bodies():
    assert api.update_from_disk_body("/ckpt/step_3", 3) == {
        "model_path": "/ckpt/step_3",
        "weight_version": "3",
        "flush_cache": True,
        "abort_all_requests": False,
    }
    bucket = [
        ("model.embed_tokens.weight", torch.zeros(4, 2, dtype=torch.bfloat16)),
        ("lm_head.weight", torch.zeros(4, 2)),
        ("model.norm.weight", torch.zeros(2, dtype=torch.float16)),
    ]
    body = api.update_from_distributed_body(bucket, group_name="g", version=None, flush_cache=False)
    assert body == {
        "names": ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"],
        "dtypes": ["bfloat16", "float32", "float16"],
        "shapes": [[4, 2], [4, 2], [2]],
        "group_name": "g",
        "flush_cache": False,
        "abort_all_requests": False,
    }
    assert (
        api.update_from_distributed_body(bucket, group_name="g", version=9, flush_cache=True)["weight_version"] == "9"
    )
    init = api.init_group_body(
        master_address="10.0.0.1", master_port=29600, rank_offset=3, world_size=5, group_name="g", backend="gloo"
    )
    assert init == {
        "master_address": "10.0.0.1",
        "master_port": 29600,
        "rank_offset": 3,
        "world_size": 5,
        "group_name": "g",
        "backend": "gloo",
    }
    with pytest.raises(ValueError):
        api.pause_body("later")


def test_serialized_named_tensors_round_trip(file_system_sharing):
    """One base64 ForkingPickler payload per TP rank, each unpickling to the [(name, tensor)] list."""
    bucket = [("a.weight", torch.arange(6.0).view(2, 3)), ("b.bias", torch.tensor([1, 2], dtype=torch.int32))]
    payloads = api.serialize_named_tensors(bucket, num_ranks=2)
    assert len(payloads) == 2 and all(isinstance(p, str) for p in payloads)
    for p in payloads:
        got = pickle.loads(base64.b64decode(p, validate=True))
        assert [n for n, _ in got] == ["a.weight", "b.bias"]
        for (_, x), (_, y) in zip(got, bucket):
            assert torch.equal(x, y) and x.dtype == y.dtype
    json.dumps(api.update_from_tensor_body(payloads, version=1, flush_cache=True))


def test_cpu_tensors_need_file_system_sharing():
    import torch.multiprocessing as tmp

    old = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_descriptor")
    try:
        with pytest.raises(RuntimeError, match="set_sharing_strategy\\('file_system'\\)"):
            api.serialize_named_tensors([("w", torch.zeros(2))], num_ranks=1)
    finally:
        tmp.set_sharing_strategy(old)


def test_parse_server_info():
    info = api.parse_server_info(load_exchange("server_info.json")["body"])
    assert (info.version, info.tp_size, info.num_gpus, info.weight_version) == ("0.5.23", 2, 2, "0")
    assert info.version == api.SGLANG_VERSION
    with pytest.raises(api.ProtocolError):
        api.parse_server_info([])
