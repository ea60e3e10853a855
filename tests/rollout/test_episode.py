"""The episode driver on the in-process engine (the recompute model: exact, no cache): token-exact
trajectories, masks, limits and environment failures. The KV-cache engine and the learner's log-probs over
the same episodes: tests/trainer/test_episode_learner.py."""

import threading
import time

import pytest
import torch
from helpers.scripted_chat import TOK, call, chars, lookup, scripted_model

from gspo_mcore.envs import ChatRenderer, EpisodeConfig, Reset, Step, ToolEnv
from gspo_mcore.rollout import InProcessEngine, SamplingParams
from gspo_mcore.rollout.episode import EpisodeDriver

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=80)


def test_policy_spans_are_the_sampled_ids_where_retokenising_would_change_them():
    turns = [call("lookup", key="ab"), "cab ab"]
    engine = InProcessEngine(scripted_model(turns), eos_token_id=TOK.eos_token_id)
    env = ToolEnv([lookup])
    driver = EpisodeDriver(env, ChatRenderer(TOK), EpisodeConfig(max_turns=4, max_total_tokens=400))
    row = {"prompt": "find ab", "metadata": {"table": {"ab": "ab-42"}}}
    [[s]] = driver.run(engine, [row], 1, GREEDY, seed=0)
    assert s.episode.end == "done" and s.episode.turns == 2
    assert s.episode.tool_calls == 1 and s.episode.tool_errors == 0 and s.episode.env_tokens > 0
    # the policy spans are exactly the sampled ids (one per character, 'a' and 'b' apart), mask 1 on them only
    spans, cur, prev = [], [], 0
    for t, m in zip(s.response_ids, s.response_mask):
        if m and not prev:
            cur = []
            spans.append(cur)
        if m:
            cur.append(t)
        prev = m
    assert spans == [chars(t) + [TOK.eos_token_id] for t in turns]
    assert s.episode.policy_tokens == sum(len(x) for x in spans)
    assert all(lp == 0.0 for lp, m in zip(s.response_logprobs, s.response_mask) if not m)
    assert all(lp < 0 for lp, m in zip(s.response_logprobs, s.response_mask) if m)
    # the text is the whole conversation as the template renders it ...
    start = env.reset(row)
    messages = list(start.observation) + [
        {"role": "assistant", "content": turns[0]},
        {"role": "tool", "name": "lookup", "content": "ab-42"},
        {"role": "assistant", "content": turns[1]},
    ]
    text = TOK.apply_chat_template(messages, tools=list(start.tools), tokenize=False) + ""
    ours = list(s.prompt_ids + s.response_ids)
    assert TOK.decode(ours) == text.removesuffix("\n")  # the episode ends at the final EOS
    # ... but re-tokenising it changes the ids (the merged 'ab'); ours kept what was sampled
    retokenised = TOK(TOK.decode(ours), add_special_tokens=False)["input_ids"]
    assert retokenised != ours and len(retokenised) < len(ours)
    ab = TOK.convert_tokens_to_ids("ab")
    assert retokenised.count(ab) > [t for t, m in zip(ours[len(s.prompt_ids) :], s.response_mask) if not m].count(ab)
    assert ab not in [t for t, m in zip(s.response_ids, s.response_mask) if m]
    assert TOK.decode(list(s.episode.final_turn), skip_special_tokens=True) == "cab ab"


class DoneAtOnce:
    def reset(self, row):
        return Reset(observation=row["prompt"])

    def step(self, state, action):
        return Step(done=True, reward=0.5)


class PlainRenderer:
    """Text as one id per byte (a model without a tokenizer)."""

    def first(self, observation, tools=()):
        return [5 + (ord(c) % 20) for c in observation]

    def after_turn(self, observation, last):
        return self.first(observation)

    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


def bigram(V=32, seed=3):
    table = torch.randn(V, V, generator=torch.Generator().manual_seed(seed)) * 2

    def fn(tokens):
        return table[tokens]

    return fn


def test_one_turn_episodes_are_the_single_turn_samples():
    engine = InProcessEngine(bigram(), eos_token_id=2, max_batch_size=5)
    params = SamplingParams(temperature=0.9, max_new_tokens=12, seed=11)
    driver = EpisodeDriver(DoneAtOnce(), PlainRenderer(), EpisodeConfig(max_turns=3, max_total_tokens=100))
    rows = [{"prompt": p} for p in ["abc", "hello", "x"]]
    got = driver.run(engine, rows, 3, params, seed=11, prompt_offset=4)
    ref = engine.generate_sync([PlainRenderer().first(r["prompt"]) for r in rows], 3, params, prompt_offset=4)
    for g, r in zip(got, ref):
        for a, b in zip(g, r):
            assert a.prompt_ids == b.prompt_ids and a.response_ids == b.response_ids
            assert a.response_logprobs == pytest.approx(b.response_logprobs, abs=1e-6)
            assert a.response_mask == (1,) * len(a.response_ids)
            assert a.episode.end == "done" and a.episode.env_reward == 0.5 and a.episode.turns == 1


class Echo:
    """Answers every turn with a fixed observation; fails or hangs on request."""

    def __init__(self, obs="ok", fail_at=None, hang_at=None):
        self.obs, self.fail_at, self.hang_at = obs, fail_at, hang_at

    def reset(self, row):
        return Reset(observation=row["prompt"], state={"turn": 0})

    def step(self, state, action):
        state["turn"] += 1
        if state["turn"] == self.fail_at:
            raise KeyError("broken tool")
        if state["turn"] == self.hang_at:
            time.sleep(3)
        return Step(observation=self.obs, info={"tool_calls": 1, "tool_errors": 1})


@pytest.mark.parametrize(
    "env, cfg, end, turns, error",
    [
        (Echo(), EpisodeConfig(max_turns=3, max_total_tokens=500), "max_turns", 3, None),
        (Echo("o" * 30), EpisodeConfig(max_turns=9, max_total_tokens=60), "max_total_tokens", None, None),
        (Echo(fail_at=2), EpisodeConfig(max_turns=5, max_total_tokens=500), "error", 2, "KeyError: 'broken tool'"),
        (Echo(hang_at=1), EpisodeConfig(max_turns=5, max_total_tokens=500, step_timeout_s=0.2), "error", 1, "timeout"),
    ],
)
def test_limits_and_environment_failures_end_episodes_cleanly(env, cfg, end, turns, error):
    engine = InProcessEngine(bigram(), eos_token_id=2)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=1)
    out = EpisodeDriver(env, PlainRenderer(), cfg).run(engine, [{"prompt": "go"}] * 2, 2, params, seed=1)
    for s in (s for g in out for s in g):
        assert s.episode.end == end and s.episode.error == error
        if turns is not None:
            assert s.episode.turns == turns
        assert len(s.prompt_ids) + len(s.response_ids) <= cfg.max_total_tokens
        assert s.episode.tool_calls == s.episode.tool_errors == s.episode.turns - (end == "error")
        assert s.episode.policy_tokens + s.episode.env_tokens == len(s.response_ids)
        # the mask alternates policy and environment spans, starting and ending with policy tokens
        assert s.response_mask[0] == 1 and s.response_mask[-1] == 1
        spans = sum(1 for a, b in zip((0,) + s.response_mask, s.response_mask) if b and not a)
        assert spans == s.episode.turns


def test_an_episode_that_cannot_fit_its_prompt_ends_as_an_error_naming_the_key():
    engine = InProcessEngine(bigram(), eos_token_id=2)
    driver = EpisodeDriver(Echo(), PlainRenderer(), EpisodeConfig(max_total_tokens=4))
    [[a, b], [c, d]] = driver.run(engine, [{"prompt": "too long"}, {"prompt": "ok"}], 2, GREEDY, seed=0)
    for s in (a, b):
        assert s.episode.end == "error" and s.episode.error.startswith("PromptTooLong: the first observation has 8")
        assert "rollout.episode.max_total_tokens=4" in s.episode.error
        assert s.prompt_ids == s.response_ids == () and s.finish_reason == "abort" and s.episode.turns == 0
    assert c.episode.turns == d.episode.turns == 1 and c.response_ids


class Fails:
    """Resets per row: ``raise`` (a broken reset), ``hang``, ``huge`` (a 2 MB prompt), ``none`` (a None content
    the template cannot render), ``marker`` (a message holding the renderer's marker), ``slow`` (0.5 s); steps
    answer per row too (``bad-tool``: a tool message with None content)."""

    def reset(self, row):
        kind = row["prompt"]
        if kind == "raise":
            raise KeyError("no such task")
        if kind == "hang":
            time.sleep(3)
        if kind == "slow":
            time.sleep(0.5)
        if kind == "huge":
            return Reset(observation="x" * 2_000_000)
        if kind == "none":
            return Reset(observation=[{"role": "user", "content": None}])
        if kind == "not-a-reset":
            return {"observation": "x"}
        return Reset(observation=[{"role": "user", "content": kind}], state=kind)

    def step(self, state, action):
        if state == "bad-tool":
            return Step(observation=[{"role": "tool", "name": "t", "content": None}])
        return Step(done=True)


def test_reset_and_render_failures_end_their_episode_not_the_run():
    """Each failure ends only its episode, as ``error`` with its cause; the others run; the errors count
    against reward.max_error_fraction."""
    from gspo_mcore.trainer.batch import episode_metrics

    turns = [call("lookup", key="ab"), "done"]
    engine = InProcessEngine(scripted_model(turns), eos_token_id=TOK.eos_token_id)
    cfg = EpisodeConfig(max_turns=3, max_total_tokens=400, step_timeout_s=1.0)
    kinds = ["raise", "hang", "huge", "none", "not-a-reset", "bad-tool", "ok"]
    t0 = time.perf_counter()
    out = EpisodeDriver(Fails(), ChatRenderer(TOK), cfg).run(engine, [{"prompt": k} for k in kinds], 1, GREEDY, seed=0)
    seconds = time.perf_counter() - t0
    got = {k: g[0].episode for k, g in zip(kinds, out)}
    assert got["raise"].error == "KeyError: 'no such task'" and got["hang"].error == "timeout"
    assert got["huge"].error.startswith("PromptTooLong: the first observation has 2000000 characters")
    assert "message 0 (user): content None" in got["none"].error
    assert got["not-a-reset"].error == "TypeError: reset returned dict, not envs.Reset"
    assert "content None" in got["bad-tool"].error and got["bad-tool"].turns == 1
    assert all(got[k].end == "error" for k in kinds[:-1]) and got["ok"].end == "done"
    assert seconds < 60, "the 2 MB prompt is refused by its length, not tokenised"
    with pytest.raises(RuntimeError, match="6 of 7 episodes ended by an environment error"):
        episode_metrics(out, max_error_fraction=0.5)


class Meets:
    """Each reset waits until all ``n`` resets of the batch have started (a barrier): resets run one at a time
    break the barrier (BrokenBarrierError after its timeout), so their episodes end as errors."""

    def __init__(self, n: int, timeout_s: float):
        self.barrier = threading.Barrier(n, timeout=timeout_s)

    def reset(self, row):
        self.barrier.wait()
        return Reset(observation=[{"role": "user", "content": "meet"}])

    def step(self, state, action):
        return Step(done=True)


def test_resets_run_concurrently():
    """Six resets that can only finish together (a barrier of six) all finish: the driver starts every reset of
    the batch before waiting for any (no timing assertion: run one at a time, the first reset breaks the
    barrier and every episode ends as an error)."""
    n = 6
    engine = InProcessEngine(scripted_model(["ok"]), eos_token_id=TOK.eos_token_id)
    cfg = EpisodeConfig(max_turns=1, max_total_tokens=400, step_timeout_s=120)
    env = Meets(n, timeout_s=30)
    [group] = EpisodeDriver(env, ChatRenderer(TOK), cfg).run(engine, [{"prompt": "meet"}], n, GREEDY, seed=0)
    assert [s.episode.end for s in group] != ["error"] * n
    assert all(s.episode.end not in ("error", "timeout") for s in group), [s.episode.error for s in group]


class Capped:
    """Caps its first turn at 2 tokens and the next at 3 (``Reset`` / ``Step.max_new_tokens``), then ends;
    counts an ignored field per step."""

    def reset(self, row):
        return Reset(observation=row["prompt"], state={"turn": 0}, max_new_tokens=2)

    def step(self, state, action):
        state["turn"] += 1
        info = {"ignored_fields": {"temperature": 1}}
        return Step(done=state["turn"] == 2, observation="ok", info=info, max_new_tokens=3)


def test_an_environments_cap_ends_its_turns_early_on_every_rank():
    """The caps an environment sets reach the engine on the rank that runs it and, through ``share``, on a rank
    that does not (every rank of a tensor-parallel group feeds the engine the same tokens)."""
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=1, ignore_eos=True)
    cfg = EpisodeConfig(max_turns=5, max_total_tokens=500)
    shared = []

    def record(value):
        shared.append(value)
        return value

    mine = EpisodeDriver(Capped(), PlainRenderer(), cfg, share=record)
    out = mine.run(InProcessEngine(bigram(), eos_token_id=2), [{"prompt": "go"}], 2, params, seed=1)
    replay = iter(shared)
    other = EpisodeDriver(Capped(), PlainRenderer(), cfg, runs_env=False, share=lambda _: next(replay))
    theirs = other.run(InProcessEngine(bigram(), eos_token_id=2), [{"prompt": "go"}], 2, params, seed=1)
    for s, t in zip(out[0], theirs[0]):
        spans = [len(x) for x in "".join("p" if m else " " for m in s.response_mask).split()]
        assert spans == [2, 3] and s.finish_reason == "length" and s.episode.end == "done"
        assert s.response_ids == t.response_ids and s.response_mask == t.response_mask
        assert dict(s.episode.ignored_fields) == {"temperature": 2}


class BadCap(Capped):
    def step(self, state, action):
        return type("S", (), {"observation": "x", "done": False, "reward": 0.0, "info": {}, "max_new_tokens": 0})()


def test_a_bad_cap_ends_the_episode_naming_it():
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=1)
    [[s]] = EpisodeDriver(BadCap(), PlainRenderer(), EpisodeConfig(max_turns=5, max_total_tokens=500)).run(
        InProcessEngine(bigram(), eos_token_id=2), [{"prompt": "go"}], 1, params, seed=1
    )
    assert s.episode.end == "error" and "max_new_tokens=0, not a positive integer" in s.episode.error
    with pytest.raises(ValueError, match=r"Step.max_new_tokens must be a positive integer or None, got 0"):
        Step(observation="x", max_new_tokens=0)
