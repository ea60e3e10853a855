"""``stop`` honoured by the agent endpoint (issue 38 item 6), through the real openai SDK on the scripted chat
policy: the engine ends the turn at the token whose text completes a stop string (that token kept, nothing
sampled after it), the answer's content ends before the string (finish reason ``stop``), the next request's
history (carrying that content) is accepted, and the recorded ids and log-probs are those sampled."""

import pytest
from helpers.scripted_chat import TOK, chars, scripted_model

from gspo_mcore.envs import AgentEnv, ChatRenderer, EpisodeConfig
from gspo_mcore.rollout import InProcessEngine, SamplingParams
from gspo_mcore.rollout.episode import EpisodeDriver

AB = TOK.convert_tokens_to_ids("ab")
FIRST = chars("xy") + [AB] + chars("cd hello STOP world <end>")  # the merged 'ab' id: one token, two characters
TURNS = [FIRST, "done"]
ROW = {"prompt": "go"}
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=60)  # drawn from the keys; the script wins
END = TOK.convert_tokens_to_ids("<|im_end|>")


def _episode(agent, turns=TURNS):
    env = AgentEnv(agent, serve=True)
    engine = InProcessEngine(scripted_model(turns), eos_token_id=TOK.eos_token_id)
    driver = EpisodeDriver(env, ChatRenderer(TOK), EpisodeConfig(max_turns=4, max_total_tokens=400))
    try:
        [[sample]] = driver.run(engine, [ROW], 1, PARAMS, seed=11)
    finally:
        env.close()
    return sample


def _two_turns(stop, answers):
    """The openai SDK: a turn with ``stop``, its reply re-sent as history, then a second turn."""

    def agent(client, row):
        from openai import OpenAI

        llm = OpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0)
        messages = [{"role": "user", "content": row["prompt"]}]
        kwargs = {"stop": stop} if stop is not None else {}
        first = llm.chat.completions.create(model=client.model, messages=messages, logprobs=True, **kwargs)
        answers.append(first)
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        answers.append(llm.chat.completions.create(model=client.model, messages=messages))
        return 1.0

    return agent


def _policy_turns(sample):
    """The sample's policy spans (ids, log-probs), in order."""
    spans, ids, lps = [], [], []
    for t, m, lp in zip(sample.response_ids, sample.response_mask, sample.response_logprobs):
        if m:
            ids.append(t)
            lps.append(lp)
        elif ids:
            spans.append((ids, lps))
            ids, lps = [], []
    return spans + ([(ids, lps)] if ids else [])


@pytest.fixture(scope="module")
def reference():
    """The same episode without ``stop``: the first turn whole."""
    pytest.importorskip("openai")
    answers = []
    sample = _episode(_two_turns(None, answers))
    assert sample.episode.end == "done" and answers[0].choices[0].message.content == "xyabcd hello STOP world <end>"
    return sample


@pytest.mark.parametrize(
    "stop, content, kept",
    [
        ("a", "xy", 3),  # 'a' ends inside the merged 'ab' token: that token kept, its 'b' not shown
        (["STOP"], "xyabcd hello ", len(FIRST) - len(" world <end>")),  # ends at a token boundary
        (["zz", "lo", " w"], "xyabcd hel", len(FIRST) - len(" STOP world <end>")),  # the first to complete
        # the kept token '<' is where the template's end of turn starts: it is no stop token, so kept as well
        ("<", "xyabcd hello STOP world ", len(FIRST) - len("end>")),
    ],
    ids=["inside-a-token", "at-a-token-boundary", "several-strings", "the-template's-first-character"],
)
def test_a_stop_string_ends_the_turn_where_its_text_completes(stop, content, kept, reference):
    answers = []
    sample = _episode(_two_turns(stop, answers))
    assert sample.episode.end == "done", sample.episode.error  # the next request's history was accepted
    first, second = answers
    choice = first.choices[0]
    assert (choice.message.content, choice.finish_reason) == (content, "stop")
    assert second.choices[0].message.content == "done"
    # the ids trained on: the sampled ones through the token that completed the string, no later one
    (ids, lps), (ids2, _) = _policy_turns(sample)
    (ref_ids, ref_lps), _ = _policy_turns(reference)
    assert ids == FIRST[:kept] and ids == ref_ids[:kept] and lps == ref_lps[:kept]
    assert ids2 == chars("done") + [END]
    # the template closes the turn after the kept token (no stop token was sampled to close it)
    assert sample.response_ids[kept] == END and sample.response_mask[kept] == 0
    assert first.usage.completion_tokens == kept and len(choice.logprobs.content) == kept
    assert [t.logprob for t in choice.logprobs.content] == lps


def test_stop_in_process_and_its_retry():
    """``client.chat(stop=...)`` is the same; a retry with the same stop strings gets the same answer."""
    answers = []

    def agent(client, row):
        messages = [{"role": "user", "content": row["prompt"]}]
        answers.append(client.chat(messages, stop=["STOP"]))
        answers.append(client.chat(messages, stop=("STOP",)))  # the same request again: the same answer
        client.chat([*messages, answers[0], {"role": "user", "content": "more"}])
        return 1.0

    sample = _episode(agent)
    assert sample.episode.end == "done" and sample.episode.turns == 2, sample.episode.error
    assert answers[0] == answers[1] == {"role": "assistant", "content": "xyabcd hello "}


@pytest.mark.parametrize(
    "stop, why",
    [
        (["a", "b", "c", "d", "e"], "at most 4"),
        ([""], "non-empty strings"),
        ([3], "non-empty strings"),
    ],
)
def test_a_stop_field_it_cannot_take_is_refused_naming_it(stop, why):
    import openai

    answers = []

    def agent(client, row):
        llm = openai.OpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0)
        messages = [{"role": "user", "content": row["prompt"]}]
        with pytest.raises(openai.BadRequestError) as refused:
            llm.chat.completions.create(model=client.model, messages=messages, stop=stop)
        answers.append(refused.value.body)
        llm.chat.completions.create(model=client.model, messages=messages, stop=[])  # none: taken
        return 1.0

    sample = _episode(agent)
    assert sample.episode.end == "done", sample.episode.error
    assert answers[0]["param"] == "stop" and why in answers[0]["message"], answers


def test_stop_cannot_be_listed_as_ignored():
    with pytest.raises(ValueError, match=r"\['stop'\] are honoured"):
        AgentEnv(lambda client, row: 0.0, ignore_fields=["stop"])
