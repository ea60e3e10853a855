"""Asynchronous rollouts' bookkeeping (gspo_mcore.trainer.asynchronous) and the SGLang backend's background
generation, against the stand-in server of the client tests (tests/rollout/sglang_standin.py; NOT SGLang):
the staleness bound, the in-flight batch and the data position a checkpoint saves, and the start-up
refusals."""

import dataclasses
import time
from types import SimpleNamespace

import pytest
import torch
from rollout.sglang_standin import StandIn

from gspo_mcore.data.sampler import PromptSampler, SamplerConfig
from gspo_mcore.rollout import SamplingParams
from gspo_mcore.rollout.sglang_control import SGLangClientConfig
from gspo_mcore.trainer.asynchronous import Prefetcher, fresh_groups
from gspo_mcore.trainer.backends import SGLangConfig, SGLangRollout
from gspo_mcore.trainer.batch import staleness_metrics
from gspo_mcore.trainer.config import RolloutConfig, TrainConfig
from gspo_mcore.trainer.dynamic_sampling import collect


def _group(*versions):
    return [SimpleNamespace(weight_version=v) for v in versions]


def test_fresh_groups_drop_a_group_with_any_sample_older_than_the_bound():
    groups = [_group(5, 5), _group(4, 5), _group(3, 5), _group(6, 6)]
    assert fresh_groups(groups, version=5, max_staleness=1).tolist() == [True, True, False, True]
    assert fresh_groups(groups, version=5, max_staleness=2).tolist() == [True, True, True, True]
    assert fresh_groups(groups, version=6, max_staleness=0).tolist() == [False, False, False, True]
    # the lags the step reports (trainer.batch.staleness_metrics): 0, 0 | 1, 0 | 2, 0
    lags = staleness_metrics(groups[:3], current_version=5)
    assert lags == {
        "staleness_max": 2.0,
        "staleness_mean": 0.5,
        "staleness_lag_0": pytest.approx(4 / 6),
        "staleness_lag_1": pytest.approx(1 / 6),
        "staleness_lag_2": pytest.approx(1 / 6),
    }


def test_stale_groups_are_never_kept_and_are_counted():
    versions = {0: 4, 1: 2, 2: 4, 3: 4}  # prompt 1 was made on weights 2 versions older

    def roll(prompts, round_):
        rewards = torch.tensor([[0.0, 1.0]] * len(prompts)).reshape(-1)
        return [_group(versions.get(p, 4), 4) for p in prompts], rewards, rewards

    usable = lambda g: fresh_groups(g, version=5, max_staleness=1)  # noqa: E731
    for dynamic in (False, True):
        sampler = PromptSampler(100, SamplerConfig(shuffle=False, epochs=None))
        batch = collect(sampler.take, roll, target=4, group_size=2, dynamic=dynamic, max_rounds=2, usable=usable)
        assert batch.keep.tolist()[:4] == [True, False, True, True] and batch.unusable == 1
        assert int(batch.keep.sum()) == (4 if dynamic else 3)  # dynamic sampling refills the dropped group


class _Loader:
    """The PromptLoader's interface over a real PromptSampler (items carry their index as the prompt)."""

    def __init__(self):
        self.sampler = PromptSampler(50, SamplerConfig(seed=1, epochs=None))

    def next_batch(self, n):
        return [SimpleNamespace(index=i, input_ids=[i + 1, 7]) for i in self.sampler.take(n)]

    def state_dict(self):
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state):
        self.sampler.load_state_dict(state["sampler"])


def _fake_engine(log):
    def start(ids, seed):
        log.append(("start", seed))
        return SimpleNamespace(groups=[[("sample", tuple(p), seed)] for p in ids], seconds=0.5)

    def finish(handle):
        log.append(("finish",))
        return handle.groups

    return start, finish


def test_prefetcher_hands_the_batch_to_its_step_and_checkpoints_the_position_before_it():
    loader, log = _Loader(), []
    pre = Prefetcher(loader, *_fake_engine(log))
    assert pre.take(0) is None  # nothing in flight at the first step
    before = loader.state_dict()
    pre.start(1, 3, seed=11)
    assert pre.loader_state() == before != loader.state_dict()  # a checkpoint now resumes before those prompts
    with pytest.raises(RuntimeError, match="already in flight"):
        pre.start(2, 3, seed=12)
    with pytest.raises(RuntimeError, match="for step 1, not 2"):
        pre.take(2)
    pre.wait()
    pre.wait()  # idempotent: the generation is finished once
    prompts, groups = pre.take(1)
    assert log == [("start", 11), ("finish",)] and pre.seconds == 0.5  # the handle's generation time
    assert [g[0][1] for g in groups] == [tuple(p.input_ids) for p in prompts]
    assert pre.loader_state() == loader.state_dict()


def test_a_run_resumed_from_the_checkpointed_position_draws_the_in_flight_prompts_again():
    def run(steps, loader):
        pre, drawn = Prefetcher(loader, *_fake_engine([])), []
        for step in range(steps):
            first = pre.take(step)
            drawn.append([p.index for p in (first[0] if first else loader.next_batch(2))])
            pre.start(step + 1, 2, seed=step)
            pre.wait()
        return drawn, pre.loader_state()

    whole, _ = run(4, _Loader())
    head, state = run(2, _Loader())
    resumed = _Loader()
    resumed.load_state_dict(state)
    tail, _ = run(2, resumed)
    assert head + tail == whole


def test_sglang_backend_generates_in_the_background_what_generate_returns(tmp_path):
    server = StandIn(delay_s=0.2)
    server.start()
    try:
        cfg = SGLangConfig(urls=(server.url,), colocate=False, client=SGLangClientConfig(request_timeout_s=10.0))
        backend = SGLangRollout(
            cfg, model_dir=str(tmp_path), output_dir=str(tmp_path), layout=SimpleNamespace(rank=0, world_size=1)
        )
        prompts, params = [[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=4, temperature=0.8)
        t0 = time.perf_counter()
        handle = backend.start_generate(prompts, 2, params, seed=9)
        started = time.perf_counter() - t0
        out = backend.finish_generate(handle)
        assert started < 0.1 < time.perf_counter() - t0  # returned at once; the answers took the stand-in's delay
        assert [[dataclasses.astuple(s) for s in g] for g in out] == [
            [dataclasses.astuple(s) for s in g] for g in backend.generate(prompts, 2, params, seed=9)
        ]
        server.stop()
        with pytest.raises(Exception):  # a failure in the background thread reaches the caller
            backend.finish_generate(backend.start_generate(prompts, 2, params, seed=9))
        backend.close()
    finally:
        server.stop()


def test_max_staleness_is_refused_where_it_cannot_work_naming_the_key():
    with pytest.raises(ValueError, match="max_staleness"):
        RolloutConfig(max_staleness=-1)
    model = SimpleNamespace(load_hf_weights=True)
    base = dict(model=model, data=SimpleNamespace())
    with pytest.raises(ValueError, match="rollout.max_staleness=1 needs rollout.engine=sglang"):
        TrainConfig(**base, rollout=RolloutConfig(max_staleness=1))
    with pytest.raises(ValueError, match="rollout.sglang.colocate=false"):
        TrainConfig(
            **base, rollout=RolloutConfig(max_staleness=1, engine="sglang", sglang=SGLangConfig(urls=("http://x:1",)))
        )
    TrainConfig(
        **base,
        rollout=RolloutConfig(
            max_staleness=1, engine="sglang", sglang=SGLangConfig(urls=("http://x:1",), colocate=False)
        ),
    )


def test_partial_rollouts_are_refused_where_they_cannot_work_naming_the_keys():
    with pytest.raises(ValueError, match="partial_rollouts must be true or false"):
        RolloutConfig(partial_rollouts="yes")
    base = dict(model=SimpleNamespace(load_hf_weights=True), data=SimpleNamespace())

    def sglang(pause_mode):
        return SGLangConfig(urls=("http://x:1",), colocate=False, client=SGLangClientConfig(pause_mode=pause_mode))

    with pytest.raises(ValueError, match="rollout.partial_rollouts=true needs rollout.max_staleness >= 1"):
        TrainConfig(**base, rollout=RolloutConfig(partial_rollouts=True, engine="sglang", sglang=sglang("retract")))
    with pytest.raises(ValueError, match="needs rollout.sglang.client.pause_mode=retract, got 'abort'"):
        TrainConfig(
            **base,
            rollout=RolloutConfig(partial_rollouts=True, max_staleness=1, engine="sglang", sglang=sglang("abort")),
        )
    ok = RolloutConfig(partial_rollouts=True, max_staleness=1, engine="sglang", sglang=sglang("retract"))
    assert TrainConfig(**base, rollout=ok).rollout.partial_rollouts


@pytest.mark.parametrize("pause_mode", ["retract", "abort"])
def test_a_weight_update_while_the_next_batch_generates(pause_mode, tmp_path):
    """rollout.partial_rollouts: the trainer pushes the weights (here version 1) while the background
    generation is in flight. With ``retract`` every response is continued: tokens of both versions, each
    known (``token_versions``), the sample's version its oldest token's, so the staleness bound still sees
    it. With ``abort`` (why partial rollouts refuse it) the responses come back cut short, still on version 0.
    The stand-in models the two modes (tests/rollout/sglang_standin.py; NOT SGLang)."""
    server = StandIn(delay_s=2.0)
    server.start()
    try:
        client = SGLangClientConfig(request_timeout_s=10.0, pause_mode=pause_mode)
        cfg = SGLangConfig(urls=(server.url,), colocate=False, client=client)
        backend = SGLangRollout(
            cfg, model_dir=str(tmp_path), output_dir=str(tmp_path), layout=SimpleNamespace(rank=0, world_size=1)
        )
        prompts, params = [[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=6, temperature=0.8)
        handle = backend.start_generate(prompts, 2, params, seed=9)
        deadline = time.monotonic() + 30
        while server.generate_served < len(prompts) and time.monotonic() < deadline:
            time.sleep(0.01)  # until both requests (one per prompt) are in flight
        time.sleep(0.1)
        backend._run(backend.engine.update_weights_from_disk(str(tmp_path), 1))  # what sync_weights does
        assert handle._thread.is_alive() and handle.seconds is None, "the update waited for the batch"
        groups = backend.finish_generate(handle)
        assert handle.seconds >= 2.0
        samples = [s for g in groups for s in g]
        assert all(s.weight_version == 0 for s in samples)
        if pause_mode == "retract":
            for s in samples:
                n = len(s.response_ids)
                assert s.finish_reason != "abort"
                assert s.token_versions == (0,) * (n // 2) + (1,) * (n - n // 2)
            assert fresh_groups(groups, version=1, max_staleness=1).all()  # lag 1: its oldest token's
            assert not fresh_groups(groups, version=2, max_staleness=1).any()
        else:
            assert all(s.finish_reason == "abort" and s.token_versions is None for s in samples)
        backend.close()
    finally:
        server.stop()
