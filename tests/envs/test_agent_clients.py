"""Real agent clients through the served endpoint (issue 38 item 9): the openai SDK (sync, async, streaming),
langchain-openai (invoke, ``.stream()``), the OpenAI Agents SDK (its chat-completions model, ``Runner.run`` and
``Runner.run_streamed``) and litellm (``completion``, ``stream=True``), each driving a 3-turn tool loop that
makes the same call twice, on the scripted chat policy; and think blocks, two calls in a turn, an empty assistant
turn, a client timeout shorter than a turn. The clients are pinned in requirements.txt; under ``CI=true`` a
missing one fails.

Each agent below is the snippet docs/agents.md shows for its client (test_the_documented_snippets_are_these)."""

import asyncio
import importlib
import inspect
import json
import os
import re
import time
import typing
import urllib.request
from pathlib import Path

import pytest
from helpers.scripted_chat import call, lookup, scripted_model

from gspo_mcore.envs import AgentEnv, ChatRenderer, EpisodeConfig, Tool
from gspo_mcore.rollout import InProcessEngine, SamplingParams
from gspo_mcore.rollout.episode import EpisodeDriver

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm: no network fetch at import


def _need(module: str):
    """The client module; skipped when it is not installed, except under CI=true (pinned: it must be there)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{module} is pinned in requirements.txt but cannot be imported under CI=true: {e}")
        pytest.skip(f"{module} is not installed")


ROW = {"prompt": "find ab", "metadata": {"table": {"ab": "ab-42"}, "expect": "cab ab"}}
TURNS = [call("lookup", key="ab"), call("lookup", key="ab"), "cab ab"]  # the same call twice, then the answer
TOOLS = [Tool.from_function(lookup).schema]


# -- the agents (docs/agents.md shows each; the test reads them from here) ------------------------------------
def openai_sync(client, row):
    from openai import OpenAI

    llm = OpenAI(base_url=client.base_url, api_key=client.api_key)
    messages = [{"role": "user", "content": row["prompt"]}]
    while True:
        reply = llm.chat.completions.create(model=client.model, messages=messages, tools=TOOLS).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            return 1.0 if reply.content == row["metadata"]["expect"] else 0.0
        for c in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": c.id, "content": row["metadata"]["table"]["ab"]})


async def openai_async(client, row):
    from openai import AsyncOpenAI

    llm = AsyncOpenAI(base_url=client.base_url, api_key=client.api_key)
    messages = [{"role": "user", "content": row["prompt"]}]
    while True:
        answer = await llm.chat.completions.create(model=client.model, messages=messages, tools=TOOLS)
        reply = answer.choices[0].message
        messages.append(reply.model_dump())
        if not reply.tool_calls:
            return 1.0 if reply.content == row["metadata"]["expect"] else 0.0
        for c in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": c.id, "content": row["metadata"]["table"]["ab"]})


def openai_stream(client, row):
    from openai import OpenAI

    llm = OpenAI(base_url=client.base_url, api_key=client.api_key)
    messages = [{"role": "user", "content": row["prompt"]}]
    while True:
        with llm.chat.completions.stream(
            model=client.model, messages=messages, tools=TOOLS, stream_options={"include_usage": True}
        ) as stream:
            answer = stream.get_final_completion()
        assert answer.usage.completion_tokens > 0
        reply = answer.choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            return 1.0 if reply.content == row["metadata"]["expect"] else 0.0
        for c in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": c.id, "content": row["metadata"]["table"]["ab"]})


def langchain_invoke(client, row, stream=False):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=client.model, base_url=client.base_url, api_key=client.api_key).bind_tools(TOOLS)
    messages = [HumanMessage(row["prompt"])]
    while True:
        if stream:  # .stream(): the chunks added up are the message
            reply = None
            for chunk in llm.stream(messages):
                reply = chunk if reply is None else reply + chunk
        else:
            reply = llm.invoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            return 1.0 if reply.content == row["metadata"]["expect"] else 0.0
        for c in reply.tool_calls:
            messages.append(ToolMessage(row["metadata"]["table"][c["args"]["key"]], tool_call_id=c["id"]))


def langchain_stream(client, row):
    return langchain_invoke(client, row, stream=True)


async def openai_agents(client, row, streamed=False):
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # the SDK would upload traces to OpenAI

    @function_tool
    def lookup(key: str) -> str:
        """Look a key up.

        Args:
            key: the key.
        """
        return row["metadata"]["table"][key]

    llm = AsyncOpenAI(base_url=client.base_url, api_key=client.api_key)
    agent = Agent(name="finder", tools=[lookup], model=OpenAIChatCompletionsModel(client.model, openai_client=llm))
    if streamed:
        result = Runner.run_streamed(agent, row["prompt"])
        async for _ in result.stream_events():
            pass
    else:
        result = await Runner.run(agent, row["prompt"])
    return 1.0 if result.final_output == row["metadata"]["expect"] else 0.0


async def openai_agents_streamed(client, row):
    return await openai_agents(client, row, streamed=True)


def _finder(client, row, responses=False, **openai_kwargs):
    """The Agents SDK's lookup agent (as ``openai_agents`` builds it) over an ``AsyncOpenAI`` client with
    ``openai_kwargs``: its chat-completions model, or its default Responses model."""
    from agents import Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    @function_tool
    def lookup(key: str) -> str:
        """Look a key up.

        Args:
            key: the key.
        """
        return row["metadata"]["table"][key]

    llm = AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, **openai_kwargs)
    model = (OpenAIResponsesModel if responses else OpenAIChatCompletionsModel)(client.model, openai_client=llm)
    return Agent(name="finder", tools=[lookup], model=model)


async def _run_agent(agent, inputs, streamed=False):
    """``Runner.run``, or ``Runner.run_streamed`` with its events drained."""
    from agents import Runner

    if not streamed:
        return await Runner.run(agent, inputs)
    result = Runner.run_streamed(agent, inputs)
    async for _ in result.stream_events():
        pass
    return result


async def openai_agents_responses(client, row, streamed=False):
    result = await _run_agent(_finder(client, row, responses=True), row["prompt"], streamed)
    return 1.0 if result.final_output == row["metadata"]["expect"] else 0.0


async def openai_agents_responses_streamed(client, row):
    return await openai_agents_responses(client, row, streamed=True)


def openai_responses(client, row):
    """The Responses API with previous_response_id: each request sends only what is new."""
    from openai import OpenAI

    llm = OpenAI(base_url=client.base_url, api_key=client.api_key)
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    answer = llm.responses.create(model=client.model, input=row["prompt"], tools=tools)
    while True:
        calls = [item for item in answer.output if item.type == "function_call"]
        if not calls:
            return 1.0 if answer.output_text == row["metadata"]["expect"] else 0.0
        results = [{"type": "function_call_output", "call_id": c.call_id, "output": "ab-42"} for c in calls]
        answer = llm.responses.create(model=client.model, input=results, tools=tools, previous_response_id=answer.id)


def openai_responses_stream(client, row):
    """The Responses API streamed (the SDK's ``responses.stream`` helper), with previous_response_id."""
    from openai import OpenAI

    llm = OpenAI(base_url=client.base_url, api_key=client.api_key)
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    inputs, previous = row["prompt"], None
    while True:
        with llm.responses.stream(
            model=client.model, input=inputs, tools=tools, previous_response_id=previous
        ) as stream:
            answer = stream.get_final_response()
        assert answer.usage.output_tokens > 0
        calls = [item for item in answer.output if item.type == "function_call"]
        if not calls:
            return 1.0 if answer.output_text == row["metadata"]["expect"] else 0.0
        inputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "ab-42"} for c in calls]
        previous = answer.id


def litellm_agent(client, row):
    import litellm

    messages = [{"role": "user", "content": row["prompt"]}]
    while True:
        answer = litellm.completion(
            model=f"openai/{client.model}",
            api_base=client.base_url,
            api_key=client.api_key,
            messages=messages,
            tools=TOOLS,
        )
        reply = answer.choices[0].message
        messages.append(reply.model_dump())
        if not reply.tool_calls:
            return 1.0 if reply.content == row["metadata"]["expect"] else 0.0
        for c in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": c.id, "content": row["metadata"]["table"]["ab"]})


def litellm_stream(client, row):
    import litellm

    messages = [{"role": "user", "content": row["prompt"]}]
    while True:
        chunks = litellm.completion(
            model=f"openai/{client.model}",
            api_base=client.base_url,
            api_key=client.api_key,
            messages=messages,
            tools=TOOLS,
            stream=True,
            stream_options={"include_usage": True},
        )
        answer = litellm.stream_chunk_builder(list(chunks), messages=messages)  # the chunks as one response
        assert answer.usage.completion_tokens > 0
        reply = answer.choices[0].message
        messages.append(reply.model_dump())
        if not reply.tool_calls:
            return 1.0 if reply.content == row["metadata"]["expect"] else 0.0
        for c in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": c.id, "content": row["metadata"]["table"]["ab"]})


CLIENTS = {
    "openai-sync": ("openai", openai_sync),
    "openai-async": ("openai", openai_async),
    "openai-stream": ("openai", openai_stream),
    "langchain-invoke": ("langchain_openai", langchain_invoke),
    "langchain-stream": ("langchain_openai", langchain_stream),
    "agents-chat": ("agents", openai_agents),
    "agents-run-streamed": ("agents", openai_agents_streamed),
    "litellm": ("litellm", litellm_agent),
    "litellm-stream": ("litellm", litellm_stream),
    "agents-responses": ("agents", openai_agents_responses),
    "agents-responses-streamed": ("agents", openai_agents_responses_streamed),
    "openai-responses": ("openai", openai_responses),
    "openai-responses-stream": ("openai", openai_responses_stream),
}


def _in_process(client, row):
    """The reference: the same loop through client.chat (no HTTP)."""
    messages = [{"role": "user", "content": row["prompt"]}]
    while True:
        reply = client.chat(messages, tools=TOOLS)
        messages.append(reply)
        if not reply.get("tool_calls"):
            return 1.0 if reply["content"] == row["metadata"]["expect"] else 0.0
        for c in reply["tool_calls"]:
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": "ab-42"})


def _run(env, turns=TURNS, model=None):
    from helpers.scripted_chat import TOK

    engine = InProcessEngine(model or scripted_model(turns), eos_token_id=TOK.eos_token_id)
    driver = EpisodeDriver(env, ChatRenderer(TOK), EpisodeConfig(max_turns=5, max_total_tokens=2000, step_timeout_s=60))
    params = SamplingParams(temperature=0.0, max_new_tokens=200)
    try:
        return [s for g in driver.run(engine, [ROW], 2, params, seed=3) for s in g]
    finally:
        env.close()


# -- the same loops with other client settings (the snippets above stay whole: users copy them) --------------------
def _openai_loop(client, row, go_on=False, **openai_kwargs):
    """``openai_sync``'s loop over ``OpenAI(**openai_kwargs)``; ``go_on``: an empty answer is followed by
    :data:`GO_ON`."""
    from openai import OpenAI

    llm = OpenAI(base_url=client.base_url, api_key=client.api_key, **openai_kwargs)
    messages = [{"role": "user", "content": row["prompt"]}]
    while True:
        reply = llm.chat.completions.create(model=client.model, messages=messages, tools=TOOLS).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if go_on and not reply.tool_calls and not reply.content:
            messages.append(GO_ON)
            continue
        if not reply.tool_calls:
            return 1.0 if reply.content == row["metadata"]["expect"] else 0.0
        for c in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": c.id, "content": row["metadata"]["table"]["ab"]})


def _langchain_loop(client, row, go_on=False, **chat_kwargs):
    """``langchain_invoke``'s loop over ``ChatOpenAI(**chat_kwargs)``; ``go_on`` as :func:`_openai_loop`."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=client.model, base_url=client.base_url, api_key=client.api_key, **chat_kwargs)
    llm = llm.bind_tools(TOOLS)
    messages = [HumanMessage(row["prompt"])]
    while True:
        reply = llm.invoke(messages)
        messages.append(reply)
        if go_on and not reply.tool_calls and not reply.content:
            messages.append(HumanMessage(GO_ON["content"]))
            continue
        if not reply.tool_calls:
            return 1.0 if reply.content == row["metadata"]["expect"] else 0.0
        for c in reply.tool_calls:
            messages.append(ToolMessage(row["metadata"]["table"][c["args"]["key"]], tool_call_id=c["id"]))


def _litellm_loop(client, row, go_on=False, **completion_kwargs):
    """``litellm_agent``'s loop with ``completion(**completion_kwargs)``; ``go_on`` as :func:`_openai_loop`."""
    import litellm

    messages = [{"role": "user", "content": row["prompt"]}]
    while True:
        answer = litellm.completion(
            model=f"openai/{client.model}",
            api_base=client.base_url,
            api_key=client.api_key,
            messages=messages,
            tools=TOOLS,
            **completion_kwargs,
        )
        reply = answer.choices[0].message
        messages.append(reply.model_dump())
        if go_on and not reply.tool_calls and not reply.content:
            messages.append(GO_ON)
            continue
        if not reply.tool_calls:
            return 1.0 if reply.content == row["metadata"]["expect"] else 0.0
        for c in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": c.id, "content": row["metadata"]["table"]["ab"]})


def openai_impatient(client, row):
    """The openai SDK with a timeout shorter than the policy's turn: it re-sends the request (retries)."""
    return _openai_loop(client, row, timeout=0.5, max_retries=5)


def _slow_first_turn(turns, seconds):
    script, slept = scripted_model(turns), []

    def model(tokens):
        if not slept:
            slept.append(time.sleep(seconds))
        return script(tokens)

    return model


def langchain_impatient(client, row):
    """LangChain with a timeout shorter than the policy's turn (its openai client retries)."""
    return _langchain_loop(client, row, timeout=0.5, max_retries=5)


async def agents_impatient(client, row):
    """The Agents SDK over an AsyncOpenAI client whose timeout is shorter than the policy's turn."""
    result = await _run_agent(_finder(client, row, timeout=0.5, max_retries=5), row["prompt"])
    return 1.0 if result.final_output == row["metadata"]["expect"] else 0.0


def litellm_impatient(client, row):
    """litellm with a timeout shorter than the policy's turn, retrying."""
    return _litellm_loop(client, row, timeout=0.5, num_retries=5)


THINK = ["<think>\nlook it up\n</think>\n\n" + call("lookup", key="ab"), "<think>\nfound\n</think>\n\ncab ab"]
TWO_CALLS = [call("lookup", key="ab") + call("lookup", key="ab"), "cab ab"]


@pytest.mark.parametrize(
    "name, agent, turns, calls, slow",
    [
        ("litellm", litellm_agent, THINK, 1, 0),  # litellm moves the think block into reasoning_content
        ("openai", openai_sync, TWO_CALLS, 2, 0),
        ("langchain_openai", langchain_invoke, TWO_CALLS, 2, 0),
        ("agents", openai_agents, TWO_CALLS, 2, 0),
        ("openai", openai_impatient, TURNS, 2, 1.5),  # a client timeout shorter than the first turn
        ("langchain_openai", langchain_impatient, TURNS, 2, 1.5),
        ("agents", agents_impatient, TURNS, 2, 1.5),
        ("litellm", litellm_impatient, TURNS, 2, 1.5),
    ],
    ids=[
        "litellm-think",
        "openai-two-calls",
        "langchain-two-calls",
        "agents-two-calls",
        "openai-timeout",
        "langchain-timeout",
        "agents-timeout",
        "litellm-timeout",
    ],
)
def test_real_clients_with_think_blocks_two_calls_a_turn_and_retries(name, agent, turns, calls, slow, caplog):
    _need(name)
    model = _slow_first_turn(turns, slow) if slow else None
    with caplog.at_level("INFO", logger="gspo_mcore.envs.agent"):
        got = _run(AgentEnv(agent, serve=True), turns=turns, model=model)
    if slow:  # the client gave up on the first turn at least once and re-sent it: one answer, no second turn
        assert any("hung up before its answer" in r.getMessage() for r in caplog.records), caplog.text
    for s in got:
        assert s.episode.end == "done", s.episode.error
        assert (s.episode.turns, s.episode.tool_calls) == (len(turns), calls)
    if name != "agents":
        assert [s.episode.env_reward for s in got] == [1.0, 1.0] or name == "litellm"


# -- empty assistant turns: the policy answers nothing (no text, no call); the agent asks again -------------------
EMPTY_FIRST = ["", call("lookup", key="ab"), "cab ab"]
GO_ON = {"role": "user", "content": "go on"}


def openai_empty(client, row):
    return _openai_loop(client, row, go_on=True)


def langchain_empty(client, row):
    return _langchain_loop(client, row, go_on=True)


def litellm_empty(client, row):
    return _litellm_loop(client, row, go_on=True)


async def agents_empty(client, row):
    """Two runs of the Agents SDK: the first ends on the empty answer; the second goes on from
    ``to_input_list()``, which leaves the empty assistant turn out."""
    agent = _finder(client, row)
    first = await _run_agent(agent, row["prompt"])
    assert not first.final_output, first.final_output
    history = first.to_input_list()
    assert not any(item.get("role") == "assistant" for item in history), history  # the empty turn left out
    result = await _run_agent(agent, [*history, GO_ON])
    return 1.0 if result.final_output == row["metadata"]["expect"] else 0.0


@pytest.mark.parametrize(
    "name, agent",
    [
        ("openai", openai_empty),
        ("langchain_openai", langchain_empty),
        ("litellm", litellm_empty),
        ("agents", agents_empty),
    ],
    ids=["openai", "langchain", "litellm", "agents"],
)
def test_real_clients_go_on_after_an_empty_assistant_turn(name, agent):
    _need(name)
    got = _run(AgentEnv(agent, serve=True), turns=EMPTY_FIRST)
    for s in got:
        assert s.episode.end == "done", s.episode.error
        assert (s.episode.turns, s.episode.tool_calls, s.episode.env_reward) == (3, 1, 1.0)


@pytest.mark.parametrize("name", list(CLIENTS))
def test_a_real_client_drives_a_three_turn_tool_loop(name):
    module, agent = CLIENTS[name]
    _need(module)
    got = _run(AgentEnv(agent, serve=True))
    for s in got:
        assert s.episode.end == "done", s.episode.error
        assert (s.episode.turns, s.episode.tool_calls, s.episode.env_reward) == (3, 2, 1.0)
    if module != "agents":  # the Agents SDK sends its own tool schema (and system prompt): other prompt tokens
        ref = _run(AgentEnv(_in_process))
        assert [(s.prompt_ids, s.response_ids, s.response_mask) for s in got] == [
            (s.prompt_ids, s.response_ids, s.response_mask) for s in ref
        ]


def test_the_documented_snippets_are_these():
    """docs/agents.md's client sections show these functions' source, verbatim."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "agents.md").read_text()
    shown = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    for fn in (
        openai_sync,
        openai_async,
        openai_stream,
        langchain_invoke,
        openai_agents,
        openai_responses,
        litellm_agent,
    ):
        assert inspect.getsource(fn) in shown, f"docs/agents.md does not show {fn.__name__} as tested"


def test_a_missing_client_fails_under_ci_and_skips_elsewhere(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="pinned in requirements.txt"):
        _need("no_such_client_module")
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception):
        _need("no_such_client_module")


# -- the Responses API streamed, and a turn cut by a length limit -------------------------------------------------
def _sse(url, body, key):
    """A streamed answer as its server-sent events: ``(event name, data)`` each."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=10) as r:
        text = r.read().decode()
    events = []
    for block in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((fields.get("event"), json.loads(fields["data"])))
    return events


def _post(url, body, key):
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=10) as r:
        return json.loads(r.read())


CALL_EVENTS = ["output_item.added", "function_call_arguments.delta", "function_call_arguments.done", "output_item.done"]
TEXT_EVENTS = ["output_item.added", "content_part.added", "output_text.delta", "output_text.done"]
TEXT_EVENTS += ["content_part.done", "output_item.done"]


def test_the_responses_stream_is_openais_event_sequence():
    """Each event validates as the openai SDK's typed event (every required field), is named by its type, and
    numbered in order; the final response is the one a request without ``stream`` gets (a retry: the same turn)."""
    _need("openai")
    from openai.types.responses import ResponseStreamEvent

    union = typing.get_args(typing.get_args(ResponseStreamEvent)[0])  # Annotated[Union[...], discriminator]
    typed = {typing.get_args(c.model_fields["type"].annotation)[0]: c for c in union}
    got = {}
    tools = [{"type": "function", **t["function"]} for t in TOOLS]

    def agent(client, row):
        url = client.base_url + "/responses"
        body = {"model": client.model, "input": row["prompt"], "tools": tools, "stream": True}
        first = _sse(url, body, client.api_key)
        final = first[-1][1]["response"]
        whole = _post(url, dict(body, stream=False), client.api_key)
        [call_] = final["output"]
        results = [{"type": "function_call_output", "call_id": call_["call_id"], "output": "ab-42"}]
        body = dict(body, input=results, previous_response_id=final["id"])
        got[client.episode] = first, whole, _sse(url, body, client.api_key)
        return 1.0

    samples = _run(AgentEnv(agent, serve=True), turns=[TURNS[0], TURNS[2]])
    assert [s.episode.end for s in samples] == ["done"] * 2, samples[0].episode.error
    first, whole, second = next(iter(got.values()))
    for events, items in ((first, CALL_EVENTS), (second, TEXT_EVENTS)):
        assert [name for name, _ in events] == [e["type"] for _, e in events]
        assert [e["type"] for _, e in events] == [
            "response.created",
            "response.in_progress",
            *(f"response.{t}" for t in items),
            "response.completed",
        ]
        assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
        for _, e in events:
            typed[e["type"]].model_validate(e)  # raises naming a missing or mistyped field
        final = events[-1][1]["response"]
        assert final["status"] == "completed" and final["usage"]["output_tokens"] > 0
    assert first[-1][1]["response"] == whole
    assert second[-1][1]["response"]["output"][0]["content"][0]["text"] == "cab ab"
    assert second[4][1]["delta"] == "cab ab"


CUT = 3  # max_output_tokens: the first turn (a tool call) is cut


def _cut_stream(client, row):
    """The raw stream of a cut turn."""
    url = client.base_url + "/responses"
    body = {"model": client.model, "input": row["prompt"], "max_output_tokens": CUT, "stream": True}
    return _sse(url, body, client.api_key)


async def _cut_agents_sdk(client, row, responses=True, streamed=False):
    """The Agents SDK with its Responses (or chat-completions) model capped at ``CUT`` tokens: the error it raises,
    or its final output."""
    from agents import ModelSettings
    from agents.exceptions import ModelBehaviorError

    agent = _finder(client, row, responses=responses).clone(model_settings=ModelSettings(max_tokens=CUT))
    try:
        return (await _run_agent(agent, row["prompt"], streamed)).final_output
    except ModelBehaviorError as e:
        return e


@pytest.mark.parametrize(
    "how",
    ["stream", "agents-responses", "agents-responses-streamed", "agents-chat"],
)
def test_a_length_cut_responses_turn_is_incomplete_as_openai_answers_it(how):
    """A turn cut by ``max_output_tokens`` is ``incomplete`` (reason ``max_output_tokens``), whole or streamed
    (``response.incomplete`` ends the stream), as OpenAI answers it. The Agents SDK's Responses model raises
    ``ModelBehaviorError`` on such a response (``agents/models/openai_responses.py``: a ``failed`` or
    ``incomplete`` status raises, against OpenAI too), in ``Runner.run`` and ``run_streamed``; its
    chat-completions model takes the cut turn (finish reason ``length``) as the answer."""
    _need("openai" if how == "stream" else "agents")
    got = []

    def agent(client, row):
        if how == "stream":
            got.append(_cut_stream(client, row))
        else:
            responses, streamed = how != "agents-chat", how.endswith("streamed")
            got.append(asyncio.run(_cut_agents_sdk(client, row, responses, streamed)))
        return 1.0

    samples = _run(AgentEnv(agent, serve=True))
    for s in samples:  # the episode's one turn, cut; the agent returned
        assert (s.episode.end, s.episode.turns, s.finish_reason) == ("done", 1, "length"), s.episode.error
    for answer in got:
        if how == "stream":
            names = [name for name, _ in answer]
            assert names[-1] == "response.incomplete" and "response.completed" not in names
            final = answer[-1][1]["response"]
            assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
            assert final["output"][0]["status"] == "incomplete" and final["usage"]["output_tokens"] == CUT
        elif how == "agents-chat":
            assert answer == TURNS[0][:CUT]
        else:
            from agents.exceptions import ModelBehaviorError

            assert isinstance(answer, ModelBehaviorError), answer
            assert "status=incomplete" in str(answer) and "max_output_tokens" in str(answer), answer
