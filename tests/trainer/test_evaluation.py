"""Held-out evaluation: the pass@k estimator, the per-set metrics, the schedule."""

import itertools
import json
import random
from math import comb

import pytest
import torch

from gspo_mcore.data.dataset import DataConfig
from gspo_mcore.rollout.types import Sample, SamplingParams
from gspo_mcore.trainer import EvalConfig, EvalSetConfig
from gspo_mcore.trainer.backends import RolloutBackend
from gspo_mcore.trainer.evaluation import EvalSet, Evaluator, pass_at_k, summarize


def brute_force_pass_at_k(outcomes: list[bool], k: int) -> float:
    """The fraction of all k-subsets of the n samples that hold at least one pass."""
    subsets = list(itertools.combinations(range(len(outcomes)), k))
    return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_equals_enumeration_over_subsets(n):
    rng = random.Random(n)
    for _ in range(20):
        outcomes = [rng.random() < 0.4 for _ in range(n)]
        for k in range(1, n + 1):
            assert pass_at_k(n, sum(outcomes), k) == pytest.approx(brute_force_pass_at_k(outcomes, k), abs=1e-12)


def test_pass_at_k_edges_and_bad_arguments():
    assert pass_at_k(10, 0, 3) == 0.0 and pass_at_k(10, 10, 1) == 1.0 and pass_at_k(10, 8, 3) == 1.0
    assert pass_at_k(100, 1, 1) == pytest.approx(0.01)
    assert pass_at_k(200, 3, 50) == pytest.approx(1 - comb(197, 50) / comb(200, 50))
    for n, c, k in [(4, 0, 5), (4, 5, 1), (4, -1, 1), (4, 1, 0)]:
        with pytest.raises(ValueError, match="pass_at_k needs"):
            pass_at_k(n, c, k)


def test_summarize_averages_per_prompt():
    # 2 prompts x 4 samples: prompt 0 passes 1 of 4, prompt 1 passes 4 of 4
    rewards = torch.tensor([1.0, 0.2, 0.0, 0.5, 1.0, 1.0, 1.0, 1.0])
    lengths = torch.tensor([3, 4, 5, 6, 3, 3, 3, 3])
    truncated = torch.tensor([False, False, False, True, False, False, False, False])
    m = summarize(rewards, lengths, truncated, n=4, pass_k=(1, 2, 4), threshold=1.0)
    assert m["pass@1"] == pytest.approx((0.25 + 1.0) / 2)
    assert m["pass@2"] == pytest.approx((0.5 + 1.0) / 2)
    assert m["pass@4"] == pytest.approx(1.0)
    assert m["reward_mean"] == pytest.approx(float(rewards.mean()))
    assert m["response_length_mean"] == pytest.approx(3.75)
    assert m["truncated_fraction"] == pytest.approx(1 / 8)
    assert m["num_prompts"] == 2
    # per-prompt pass rates 0.25 and 1.0: sample std 0.75 / sqrt(2), over sqrt(2) prompts
    assert m["pass@1_stderr"] == pytest.approx(0.375)
    half = summarize(rewards, lengths, truncated, n=4, pass_k=(1,), threshold=0.5)
    assert half["pass@1"] == pytest.approx((0.5 + 1.0) / 2)


class _EvalBackend(RolloutBackend):
    """A backend the evaluator only generates from (its weights never change)."""

    def sync_weights(self, learner, version):
        raise AssertionError("the evaluator does not sync weights")

    def restore_weights(self, learner, version):
        raise AssertionError("the evaluator does not restore weights")


class _ScriptedBackend(_EvalBackend):
    """Test-only stand-in for a rollout backend: answers each prompt with the responses the test scripted
    (``"right"`` when sampled greedily). Records the calls, so the test sees what the evaluator asked for."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, n, params: SamplingParams, *, seed):
        self.calls.append((len(prompts), n, params.temperature, seed))
        out = []
        for i, p in enumerate(prompts):
            group = []
            for j in range(n):
                ids = (1,) if params.temperature == 0 or j == 0 else (2, 2)
                group.append(
                    Sample(
                        prompt_index=i,
                        sample_index=j,
                        prompt_ids=tuple(p),
                        response_ids=ids,
                        response_logprobs=(0.0,) * len(ids),
                        finish_reason="stop",
                        weight_version=0,
                    )
                )
            out.append(group)
        return out


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "right" if list(ids) == [1] else "wrong"


class _Reward:
    """Test-only stand-in for a RewardRunner: exact match, no per-term metrics."""

    def score_tokens(self, texts, metas, response_ids):
        assert len(response_ids) == len(texts)
        return [1.0 if t == m["answer"] else 0.0 for t, m in zip(texts, metas)], [None] * len(texts)

    def metrics(self, reset=True):
        return {}


def test_evaluator_reports_sampled_and_greedy_metrics_per_set():
    cfg = EvalConfig(
        datasets=(EvalSetConfig(name="h", data=DataConfig(paths=("h.jsonl",))),), n=4, pass_k=(1, 4), seed=7
    )
    backend = _ScriptedBackend()
    sets = [EvalSet(name="h", prompts=[[5, 6], [7]], metadata=[{"answer": "right"}] * 2, rewards=_Reward())]
    out = Evaluator(cfg, sets, backend, _Tok()).run()
    assert out["eval/h/pass@1"] == pytest.approx(0.25) and out["eval/h/pass@4"] == pytest.approx(1.0)
    assert out["eval/h/greedy_pass@1"] == 1.0 and out["eval/h/greedy_reward_mean"] == 1.0
    assert out["eval/h/num_prompts"] == 2
    assert backend.calls == [(2, 4, 1.0, 7), (2, 1, 0.0, 7)]  # the same eval seed for both, never a training one
    assert not any("/reward/" in k for k in out)  # one-term rewards report no per-term means


def test_evaluator_reports_each_term_of_a_composed_reward(tmp_path):
    """A weight-0 term is measured beside the one that decides pass@k (e.g. format beside correctness), on the
    same samples, for the sampled and the greedy responses; counts never leak between evaluations."""
    from gspo_mcore.rewards import RewardRunnerConfig, RewardTermConfig
    from gspo_mcore.rewards.preflight import check_reward_setup

    reward = RewardRunnerConfig(
        terms=(
            RewardTermConfig(name="correct", reward="exact", options={"use_boxed": False}),
            RewardTermConfig(name="format", reward="regex", weight=0.0, options={"patterns": ["^w"]}),
        )
    )
    metas = [{"answer": "right"}] * 2
    runner = check_reward_setup(reward, [("h.jsonl:1", m) for m in metas], check_sandbox=False)
    cfg = EvalConfig(datasets=(EvalSetConfig(name="h", data=DataConfig(paths=("h.jsonl",))),), n=4, pass_k=(1,))
    sets = [EvalSet(name="h", prompts=[[5, 6], [7]], metadata=metas, rewards=runner)]
    for step in range(2):  # the second evaluation reports the same: the runner's counts restart each time
        out = Evaluator(cfg, sets, _ScriptedBackend(), _Tok(), samples_dir=str(tmp_path)).run(step)
        assert out["eval/h/pass@1"] == pytest.approx(0.25)  # the weight-0 term does not count
        assert out["eval/h/reward/correct/mean"] == pytest.approx(0.25)
        assert out["eval/h/reward/format/mean"] == pytest.approx(0.75)  # 3 of 4 sampled responses say "wrong"
        assert out["eval/h/greedy_reward/correct/mean"] == 1.0
    # every response of an evaluation, with its reward, in step_<step>.jsonl
    rows = [json.loads(line) for line in open(tmp_path / "step_1.jsonl")]
    assert [(r["kind"], r["prompt_index"], r["sample_index"]) for r in rows] == [
        ("sampled", i, j) for i in range(2) for j in range(4)
    ] + [("greedy", 0, 0), ("greedy", 1, 0)]
    assert [r["response"] for r in rows[:4]] == ["right", "wrong", "wrong", "wrong"]
    assert [r["reward"] for r in rows[:4]] == [1.0, 0.0, 0.0, 0.0] and rows[-1]["response"] == "right"
    assert rows[0]["set"] == "h" and rows[0]["finish_reason"] == "stop" and rows[1]["length"] == 2


class _EpisodeBackend(_EvalBackend):
    """Test-only stand-in for a multi-turn backend: prompt 0's episodes call a tool then answer (2 turns),
    prompt 1's answer at once; ids 1 = the answer, 3 = a call, 4 = the tool's result (an environment token)."""

    runs_episodes = True

    def generate(self, rows, n, params, *, seed):
        from gspo_mcore.rollout.turns import EpisodeStats

        out = []
        for i, _ in enumerate(rows):
            ids, mask = ((3, 4, 1), (1, 0, 1)) if i == 0 else ((1,), (1,))
            stats = EpisodeStats(
                turns=len(ids) // 2 + 1,
                end="done",
                tool_calls=int(i == 0),
                policy_tokens=sum(mask),
                env_tokens=len(mask) - sum(mask),
                final_turn=(1,),
            )
            out.append(
                [
                    Sample(
                        prompt_index=i,
                        sample_index=j,
                        prompt_ids=(5,),
                        response_ids=ids,
                        response_logprobs=(0.0,) * len(ids),
                        finish_reason="stop",
                        weight_version=0,
                        response_mask=mask,
                        episode=stats,
                    )
                    for j in range(n)
                ]
            )
        return out


class _TranscriptTok:
    def decode(self, ids, skip_special_tokens=True):
        words = {1: "right", 3: "<call>", 4: "<result>"}
        return "".join(words[i] for i in ids if not (skip_special_tokens and i == 4))


def test_evaluator_reports_episode_figures_and_transcripts(tmp_path):
    """Under rollout.env the evaluation reports tool use like a training step, scores the final turn, and the
    samples file holds each episode's turns, calls, end and its whole transcript (environment tokens too)."""
    cfg = EvalConfig(datasets=(EvalSetConfig(name="h", data=DataConfig(paths=("h.jsonl",))),), n=2, pass_k=(1,))
    sets = [EvalSet(name="h", prompts=[[5], [5]], metadata=[{"answer": "right"}] * 2, rewards=_Reward(), rows=[{}, {}])]
    out = Evaluator(cfg, sets, _EpisodeBackend(), _TranscriptTok(), samples_dir=str(tmp_path)).run(0)
    assert out["eval/h/pass@1"] == 1.0  # the final turn is what the reward reads
    assert out["eval/h/episode_tool_use_fraction"] == 0.5 and out["eval/h/episode_turns_mean"] == 1.5
    assert out["eval/h/episode_env_tokens_mean"] == 0.5 and out["eval/h/episode_end_done"] == 1.0
    rows = [json.loads(line) for line in open(tmp_path / "step_0.jsonl")]
    sampled = [r for r in rows if r["kind"] == "sampled"]
    assert [(r["tool_calls"], r["turns"], r["end"]) for r in sampled] == [(1, 2, "done")] * 2 + [(0, 1, "done")] * 2
    assert [r["transcript"] for r in sampled] == ["<call><result>right"] * 2 + ["right"] * 2
    assert all(r["response"] == "right" for r in rows)


def test_schedule_depends_only_on_the_step():
    cfg = EvalConfig(datasets=(EvalSetConfig(name="h", data=DataConfig(paths=("h.jsonl",))),), every=3)
    ev = Evaluator(cfg, [object()], None, None)
    assert [s for s in range(10) if ev.due(s)] == [0, 3, 6, 9]
    assert not Evaluator(EvalConfig(), [], None, None).due(0)


def test_eval_config_refuses_k_larger_than_n_and_duplicate_names():
    with pytest.raises(ValueError, match="pass@5 needs at least 5 samples per prompt, but eval.n is 4"):
        EvalConfig(n=4, pass_k=(1, 5))
    h = EvalSetConfig(name="h", data=DataConfig(paths=("h.jsonl",)))
    with pytest.raises(ValueError, match="names must be unique"):
        EvalConfig(datasets=(h, h))
    with pytest.raises(ValueError, match="contain no '/'"):
        EvalSetConfig(name="a/b", data=DataConfig(paths=("h.jsonl",)))
