"""The in-process engine's sampling, on a tiny deterministic bigram 'model' (logits depend on the last token).

The real model is exercised in tests/trainer (log-probs vs a learner forward pass). Here the logits
function is exact and cheap, so each property can be checked precisely.
"""

import asyncio

import pytest
import torch

from gspo_mcore.rollout import InProcessEngine, RolloutError, SamplingParams

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
    torch.testing.assert_close(torch.tensor(out[0][0].response_logprobs), expected_logprobs(out[0][0], 1.0), rtol=0,
                               atol=1e-6)


def test_top_k_one_always_draws_the_argmax():
    out = engine().generate_sync([[5]], 3, SamplingParams(temperature=1.3, top_k=1, max_new_tokens=4, seed=0,
                                                          ignore_eos=True))
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
            torch.testing.assert_close(torch.tensor(s.response_logprobs), expected_logprobs(s, 2.0, 20), rtol=0,
                                       atol=1e-6)
    assert any(s.finish_reason == "stop" for g in out for s in g)


def test_order_and_shapes_with_chunked_batches():
    out = engine(max_batch_size=3).generate_sync([[5], [6, 7], [8]], 4, SamplingParams(max_new_tokens=3, seed=1))
    assert [[(s.prompt_index, s.sample_index) for s in g] for g in out] == [[(i, j) for j in range(4)] for i in range(3)]
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
