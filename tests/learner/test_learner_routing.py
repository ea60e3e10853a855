"""Routing Replay and routing volatility (gspo_mcore.learner.routing).

Unit tests of the pure functions, then the learner on the toy MoE model on 1 and 2 gloo ranks
(routing_worker.py): the recorded experts do not depend on the layout or the micro-batch plan, a
replayed forward routes every token to its recorded experts (checked from the routers' own outputs),
and replaying the current routing changes nothing.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers.launch import run_ranks

from gspo_mcore.learner.batching import TrainSample
from gspo_mcore.learner.routing import RoutingConfig, microbatch_routing, routing_change


def _sample(length: int, response: int) -> TrainSample:
    mask = torch.zeros(length)
    mask[length - response :] = 1
    return TrainSample(tokens=torch.arange(length), loss_mask=mask, advantage=1.0)


def test_routing_change_counts_sets_not_order_and_only_scored_moe_positions():
    s = _sample(5, 2)  # scored positions: 2 and 3 (they predict tokens 3 and 4)
    before = torch.tensor([[[0, 1], [-1, -1]]] * 5, dtype=torch.int32)  # layer 1 is dense
    after = before.clone()
    after[2, 0] = torch.tensor([1, 0])  # same set, other order: unchanged
    after[3, 0] = torch.tensor([1, 2])  # one of two experts changed
    after[0, 0] = torch.tensor([2, 3])  # a prompt position: not scored
    after[4, 0] = torch.tensor([2, 3])  # the last position predicts nothing: not scored
    m = routing_change([before], [after], [s])
    assert m["routing_changed_fraction"] == pytest.approx(1 / 2)
    assert m["routing_expert_change_fraction"] == pytest.approx(1 / 4)
    assert routing_change([before], [before.clone()], [s])["routing_changed_fraction"] == 0.0


def test_routing_change_refuses_mismatched_recordings():
    s = _sample(5, 2)
    with pytest.raises(ValueError, match="differ in shape"):
        routing_change([torch.zeros(5, 2, 2, dtype=torch.int32)], [torch.zeros(4, 2, 2, dtype=torch.int32)], [s])


def test_microbatch_routing_is_sequence_major_with_distinct_padding_experts():
    a = torch.arange(3 * 1 * 2).view(3, 1, 2)  # sample a: L=3
    b = 100 + torch.arange(2 * 1 * 2).view(2, 1, 2)  # sample b: L=2
    padded = microbatch_routing([a, b], [3, 2], packing="padded", width=4, topk=2, num_experts=4)
    assert padded.shape == (4, 2, 1, 2)  # (S, R, layers, k)
    assert torch.equal(padded[:3, 0], a) and torch.equal(padded[:2, 1], b)
    # placeholders of router position q = s * R + r: experts (2q, 2q + 1) mod 4
    assert torch.equal(padded[3, 0, 0], torch.tensor([0, 1])) and torch.equal(padded[2, 1, 0], torch.tensor([2, 3]))
    assert torch.equal(padded[3, 1, 0], torch.tensor([2, 3]))
    packed = microbatch_routing([a, b], [3, 2], packing="block_diagonal", width=6, topk=2, num_experts=4)
    assert packed.shape == (6, 1, 1, 2)
    assert torch.equal(packed[:5, 0], torch.cat([a, b])) and torch.equal(packed[5, 0, 0], torch.tensor([2, 3]))
    assert microbatch_routing([a, None], [3, 2], packing="padded", width=4, topk=2, num_experts=4) is None


def test_sample_routed_experts_shape_is_checked():
    with pytest.raises(ValueError, match="routed_experts"):
        TrainSample(
            tokens=torch.arange(4),
            loss_mask=torch.ones(4),
            advantage=0.0,
            routed_experts=torch.zeros(3, 2, 2, dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="routed_experts"):
        TrainSample(tokens=torch.arange(4), loss_mask=torch.ones(4), advantage=0.0, routed_experts=torch.zeros(4, 2, 2))


def test_routing_config_rejects_negative_interval():
    with pytest.raises(ValueError, match="measure_every"):
        RoutingConfig(measure_every=-1)


ONE_RANK = [
    dict(name="ref", save=True),
    dict(name="1rank-mb30", max_tokens=30),
    dict(name="1rank-bd-mb50", packing="block_diagonal", max_tokens=50),
]
TWO_RANKS = [
    dict(name="dp2"),
    dict(name="ep2", ep=2),
    dict(name="pp2", pp=2),
    dict(name="dp2-mb40", max_tokens=40, replay_max_tokens=25),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ref = str(tmp_path_factory.mktemp("routing"))
    out = {}
    for cases, nproc in ((ONE_RANK, 1), (TWO_RANKS, 2)):
        path = os.path.join(ref, f"r{nproc}.jsonl")
        run_ranks(
            "learner/routing_worker.py", nproc, ["--cases", json.dumps(cases), "--ref", ref, "--out", path], timeout=900
        )
        with open(path) as f:
            out.update({r["case"]: r for r in map(json.loads, f)})
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("name", [c["name"] for c in ONE_RANK + TWO_RANKS])
def test_recorded_routing_is_layout_and_packing_invariant(results, name):
    r = results[name]
    assert r["record_mismatch"] == 0
    assert r["record_min"] >= 0 and r["record_max"] <= 3, "every layer is MoE (4 experts): no -1, ids in range"


@pytest.mark.distributed
@pytest.mark.parametrize("name", [c["name"] for c in ONE_RANK + TWO_RANKS])
def test_replay_forces_the_recorded_experts(results, name):
    r = results[name]
    assert r["replay_samples_seen"] == 12, "every sample passed through a hooked router once"
    assert r["replay_wrong_tokens"] == 0
    assert r["free_wrong_tokens"] > 0, "the update must change some routing, or the replay check proves nothing"


@pytest.mark.distributed
@pytest.mark.parametrize("name", [c["name"] for c in ONE_RANK + TWO_RANKS])
def test_replaying_the_current_routing_changes_nothing(results, name):
    assert results[name]["noop_loss_diff"] <= 1e-6


@pytest.mark.distributed
@pytest.mark.parametrize("name", [c["name"] for c in ONE_RANK + TWO_RANKS])
def test_rollout_routing_is_replayed_in_the_old_logprob_and_training_forwards(results, name):
    """R3: every position but the last goes to the given experts under any layout and packing (EP2, PP2...)."""
    r = results[name]
    for forward in ("logprobs", "train"):
        assert r[f"r3_{forward}_replay_seen"] == 12, "every sample passed through a hooked router once"
        assert r[f"r3_{forward}_replay_wrong"] == 0
        assert r[f"r3_{forward}_free_wrong"] > 0, "random experts differ from the router's, or this proves nothing"
    assert 0 < r["r3_disagreement"] <= 1 and r["r3_loss_finite"]


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["ref", "ep2", "pp2"])
def test_rollout_routing_with_an_unrouted_inner_position_is_refused(results, name):
    assert (
        "routing.replay=rollout: sample 3 has no valid experts at position 1 in MoE layer 0"
        in (results[name]["r3_bad_error"])
    )


def test_microbatch_routing_gives_unrouted_positions_the_placeholder_experts():
    a = torch.arange(3 * 2 * 2).view(3, 2, 2) % 4
    a[-1] = -1  # the engine did not route the last position
    a[:, 1] = -1  # a dense layer
    padded = microbatch_routing([a], [3], packing="padded", width=5, topk=2, num_experts=4)
    assert int(padded.min()) >= 0, "no -1 reaches a router"
    assert torch.equal(padded[:2, 0, 0], a[:2, 0].long())
    for row in (2, 3, 4):  # the unrouted last position and the padding: experts (2q, 2q + 1) mod 4
        assert torch.equal(padded[row, 0, 0], torch.tensor([2 * row % 4, (2 * row + 1) % 4]))


def test_padding_placeholders_are_spread_over_every_expert():
    """A micro-batch that is mostly padding does not pile its placeholder slots onto the first experts (and so
    onto the first expert-parallel rank): every expert gets the same count, up to one, and no position repeats
    an expert."""
    a = torch.zeros(2, 1, 2, dtype=torch.int64)
    a[:, 0, 1] = 1
    out = microbatch_routing([a, a[:1]], [2, 1], packing="padded", width=37, topk=2, num_experts=8)
    pad = torch.ones(37, 2, dtype=torch.bool)
    pad[:2, 0] = pad[:1, 1] = False
    slots = out[pad][:, 0]  # (positions, k)
    assert all(len(set(row.tolist())) == 2 for row in slots)
    counts = torch.bincount(slots.flatten(), minlength=8)
    assert int(counts.max() - counts.min()) <= 1, counts.tolist()
    with pytest.raises(ValueError, match="topk=3"):
        microbatch_routing([a], [2], packing="padded", width=3, topk=3, num_experts=2)


def _rollout_sample(length=5):
    r = torch.zeros(length, 2, 2, dtype=torch.int32)
    r[..., 1] = 1
    r[-1] = -1
    return TrainSample(tokens=torch.arange(length), loss_mask=torch.ones(length), advantage=0.0, routed_experts=r)


def test_check_rollout_routing_names_the_sample_and_position():
    from gspo_mcore.learner.routing import check_rollout_routing

    kw = dict(num_layers=2, topk=2, num_experts=4, moe_layers=[0, 1])
    good = _rollout_sample()
    check_rollout_routing([good], **kw)
    with pytest.raises(ValueError, match="sample 1 carries no routed_experts"):
        check_rollout_routing([good, TrainSample(tokens=torch.arange(4), loss_mask=torch.ones(4), advantage=0.0)], **kw)
    with pytest.raises(ValueError, match=r"sample 0 has routed_experts of shape \(5, 2, 2\), expected \[L=5, num_l"):
        check_rollout_routing([good], **dict(kw, num_layers=3))
    bad = _rollout_sample()
    bad.routed_experts[2, 1, 0] = 4
    with pytest.raises(ValueError, match="sample 0 has no valid experts at position 2 in MoE layer 1"):
        check_rollout_routing([bad], **kw)
    dense = _rollout_sample()
    dense.routed_experts[:, 1] = -1
    check_rollout_routing([dense], **dict(kw, moe_layers=[0]))  # -1 in a dense layer is fine
    with pytest.raises(ValueError, match="position 0 in MoE layer 1"):
        check_rollout_routing([dense], **kw)


def test_routing_config_reads_old_booleans_and_refuses_unknown_modes():
    assert RoutingConfig(replay=True).replay == "learner" and RoutingConfig(replay=False).replay == "off"
    assert RoutingConfig(replay="rollout").enabled and not RoutingConfig().enabled
    with pytest.raises(ValueError, match="routing.replay must be one of"):
        RoutingConfig(replay="engine")
