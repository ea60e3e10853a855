"""R3: asking SGLang for the experts it routed each token to, and parsing ``meta_info.routed_experts``.

The encoding (base64 of int32 ``[seqlen - 1, num_layers, topk]``) is SGLang 0.5.23's, read from
``srt/state_capturer/base.py`` and ``srt/managers/detokenizer_manager.py``; the real-SGLang tier
(tests/integration/test_real_routed_experts.py) checks it against a live server.
"""

import base64

import numpy as np
import pytest
import torch
from sglang_standin import load_exchange

from gspo_mcore.rollout import sglang_api as api
from gspo_mcore.rollout.sglang_control import SGLangClientConfig
from gspo_mcore.rollout.types import Sample, SamplingParams

PROMPT = [1, 5, 6]


def _item(response_ids, routed: np.ndarray | None):
    item = load_exchange("generate_single_n1.json")["body"]
    item = dict(item, output_ids=list(response_ids))
    meta = dict(item["meta_info"], output_token_logprobs=[[-0.5, t, None] for t in response_ids])
    meta.pop("routed_experts", None)
    if routed is not None:
        meta["routed_experts"] = base64.b64encode(routed.astype("<i4").tobytes()).decode()
    item["meta_info"] = meta
    return item


def _parse(item, dims=(2, 2)):
    return api.parse_generate_output(
        item, prompt_ids=PROMPT, prompt_index=3, sample_index=1, initial_weight_version=0, routing_dims=dims
    )


def test_request_asks_for_the_whole_sequence_only_when_wanted():
    params = SamplingParams(max_new_tokens=4)
    body = api.build_generate_request(PROMPT, 2, params, prompt_index=0, routed_experts=True)
    assert body["return_routed_experts"] is True and body["routed_experts_start_len"] == 0
    plain = api.build_generate_request(PROMPT, 2, params, prompt_index=0)
    assert "return_routed_experts" not in plain and "routed_experts_start_len" not in plain


def test_routed_experts_are_aligned_with_the_tokens_and_the_last_row_is_unrouted():
    response = [7, 8]  # 3 + 2 tokens: SGLang routes 4 positions (the last token is never fed back)
    routed = np.arange(4 * 2 * 2).reshape(4, 2, 2) % 4
    s = _parse(_item(response, routed))
    assert s.routed_experts.dtype == torch.int32 and tuple(s.routed_experts.shape) == (5, 2, 2)
    assert torch.equal(s.routed_experts[:4], torch.from_numpy(routed).int())
    assert bool((s.routed_experts[4] == -1).all())


def test_without_dims_nothing_is_parsed():
    s = api.parse_generate_output(
        _item([7, 8], np.zeros((4, 2, 2))), prompt_ids=PROMPT, prompt_index=0, sample_index=0, initial_weight_version=0
    )
    assert s.routed_experts is None


@pytest.mark.parametrize(
    "routed, message",
    [
        (None, "missing 'meta_info.routed_experts'.*--enable-return-routed-experts"),
        (np.zeros((5, 2, 2)), "prompt 3 sample 1: meta_info.routed_experts has 80 bytes, expected 4 positions"),
        (np.zeros((4, 2, 1)), "expected 4 positions x 2 layers x top-2"),
    ],
)
def test_missing_or_misshapen_routing_is_a_clear_error_naming_the_sample(routed, message):
    with pytest.raises(api.ProtocolError, match=message):
        _parse(_item([7, 8], routed))


def test_non_base64_routing_is_a_clear_error():
    item = _item([7, 8], np.zeros((4, 2, 2)))
    item["meta_info"]["routed_experts"] = "not base64!"
    with pytest.raises(api.ProtocolError, match="not base64"):
        _parse(item)


def test_sample_checks_the_routing_length():
    with pytest.raises(ValueError, match=r"sample \(0, 0\): routed_experts of shape \(4, 2, 2\), expected \[5 tokens"):
        Sample(
            prompt_index=0,
            sample_index=0,
            prompt_ids=(1, 2, 3),
            response_ids=(4, 5),
            response_logprobs=(-1.0, -1.0),
            finish_reason="stop",
            weight_version=0,
            routed_experts=torch.zeros(4, 2, 2, dtype=torch.int32),
        )


def test_client_config_checks_the_dims():
    assert SGLangClientConfig(routed_experts=[2, 4]).routed_experts == (2, 4)
    for bad in ((2,), (0, 2), (2, 2.0), (True, 2)):
        with pytest.raises(ValueError, match="routed_experts must be"):
            SGLangClientConfig(routed_experts=bad)


def test_server_info_reports_whether_routed_experts_can_be_returned():
    body = load_exchange("server_info.json")["body"]
    assert not api.parse_server_info(body).routed_experts
    assert api.parse_server_info(dict(body, enable_return_routed_experts=True)).routed_experts


def test_a_recorded_response_parses_with_prompt_rows_shared_by_the_samples():
    """Recorded from a live server (data/generate_routed_experts_n2.json): 2 layers, top-2, 4 experts."""
    ex = load_exchange("generate_routed_experts_n2.json")
    prompt = ex["request"]["input_ids"]
    items = api.split_generate_outputs(ex["body"], 1, 2)[0]
    samples = [
        api.parse_generate_output(
            item, prompt_ids=prompt, prompt_index=0, sample_index=j, initial_weight_version=0, routing_dims=(2, 2)
        )
        for j, item in enumerate(items)
    ]
    for s in samples:
        r = s.routed_experts
        assert tuple(r.shape) == (len(prompt) + len(s.response_ids), 2, 2)
        assert int(r[:-1].min()) >= 0 and int(r[:-1].max()) <= 3 and bool((r[-1] == -1).all())
        assert bool((r[:-1, :, 0] != r[:-1, :, 1]).all()), "top-2 picks two distinct experts"
    # the prompt's rows come from the same prefill (a shared prefix): identical in both samples
    assert torch.equal(samples[0].routed_experts[: len(prompt)], samples[1].routed_experts[: len(prompt)])
    assert {s.finish_reason for s in samples} == {"stop", "length"}


def test_a_server_without_routed_experts_is_refused_by_name(standins):
    """The stand-in (tests/rollout/sglang_standin.py) reports no enable_return_routed_experts, like a server
    started without --enable-return-routed-experts; a client that does not ask does not check."""
    import asyncio

    from gspo_mcore.rollout import SGLangEngine
    from gspo_mcore.rollout.types import RolloutError

    s = standins()
    asking = SGLangEngine([s.url], config=SGLangClientConfig(routed_experts=(2, 2)))
    with pytest.raises(RolloutError, match=f"routing.replay=rollout: the SGLang server {s.url} was not started with"):
        asyncio.run(asking.check_routed_experts())
    asyncio.run(SGLangEngine([s.url]).check_routed_experts())
    # and a response without the key, if the check was skipped, names the missing key and the flag
    with pytest.raises(RolloutError, match="missing 'meta_info.routed_experts'.*--enable-return-routed-experts"):
        asyncio.run(asking.generate([[1, 2]], 1, SamplingParams(max_new_tokens=2)))


def test_an_aborted_output_without_routing_gives_a_sample_without_routing():
    item = _item([7, 8], None)
    item["meta_info"]["finish_reason"] = {"type": "abort", "message": "Aborted"}
    s = _parse(item)
    assert s.finish_reason == "abort" and s.routed_experts is None
    item = _item([7, 8], np.ones((4, 2, 2)))
    item["meta_info"]["finish_reason"] = {"type": "abort", "message": "Aborted"}
    assert int(_parse(item).routed_experts[0, 0, 0]) == 1  # when it is there, it is used
