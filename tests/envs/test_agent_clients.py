"""Real agent clients through the served endpoint (issue 38 item 9): the openai SDK (sync, async, streaming),
langchain-openai (invoke, ``.stream()``), the OpenAI Agents SDK (its chat-completions model, ``Runner.run`` and
``Runner.run_streamed``) and litellm (``completion``, ``stream=True``), each driving a 3-turn tool loop that
makes the same call twice, on the scripted chat policy; and think blocks, two calls in a turn, an empty assistant
turn, a client timeout shorter than a turn. The clients are pinned in requirements.txt; under ``CI=true`` a
missing one fails.

Each agent below is the snippet docs/agents.md shows for its client (test_the_documented_snippets_are_these)."""

import importlib
import inspect
import os
import re
import time
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


async def openai_agents_responses(client, row):
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    @function_tool
    def lookup(key: str) -> str:
        """Look a key up.

        Args:
            key: the key.
        """
        return row["metadata"]["table"][key]

    llm = AsyncOpenAI(base_url=client.base_url, api_key=client.api_key)
    agent = Agent(name="finder", tools=[lookup], model=OpenAIResponsesModel(client.model, openai_client=llm))
    result = await Runner.run(agent, row["prompt"])
    return 1.0 if result.final_output == row["metadata"]["expect"] else 0.0


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
    "openai-responses": ("openai", openai_responses),
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


def openai_impatient(client, row):
    """The openai SDK with a timeout shorter than the policy's turn: it re-sends the request (retries)."""
    from openai import OpenAI

    llm = OpenAI(base_url=client.base_url, api_key=client.api_key, timeout=0.5, max_retries=5)
    messages = [{"role": "user", "content": row["prompt"]}]
    while True:
        reply = llm.chat.completions.create(model=client.model, messages=messages, tools=TOOLS).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            return 1.0 if reply.content == row["metadata"]["expect"] else 0.0
        for c in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": c.id, "content": row["metadata"]["table"]["ab"]})


def _slow_first_turn(turns, seconds):
    script, slept = scripted_model(turns), []

    def model(tokens):
        if not slept:
            slept.append(time.sleep(seconds))
        return script(tokens)

    return model


def langchain_impatient(client, row):
    """LangChain with a timeout shorter than the policy's turn (its openai client retries)."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=client.model, base_url=client.base_url, api_key=client.api_key, timeout=0.5, max_retries=5
    ).bind_tools(TOOLS)
    messages = [HumanMessage(row["prompt"])]
    while True:
        reply = llm.invoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            return 1.0 if reply.content == row["metadata"]["expect"] else 0.0
        for c in reply.tool_calls:
            messages.append(ToolMessage(row["metadata"]["table"][c["args"]["key"]], tool_call_id=c["id"]))


async def agents_impatient(client, row):
    """The Agents SDK over an AsyncOpenAI client whose timeout is shorter than the policy's turn."""
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    @function_tool
    def lookup(key: str) -> str:
        """Look a key up.

        Args:
            key: the key.
        """
        return row["metadata"]["table"][key]

    llm = AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, timeout=0.5, max_retries=5)
    agent = Agent(name="finder", tools=[lookup], model=OpenAIChatCompletionsModel(client.model, openai_client=llm))
    result = await Runner.run(agent, row["prompt"])
    return 1.0 if result.final_output == row["metadata"]["expect"] else 0.0


def litellm_impatient(client, row):
    """litellm with a timeout shorter than the policy's turn, retrying."""
    import litellm

    messages = [{"role": "user", "content": row["prompt"]}]
    while True:
        answer = litellm.completion(
            model=f"openai/{client.model}",
            api_base=client.base_url,
            api_key=client.api_key,
            messages=messages,
            tools=TOOLS,
            timeout=0.5,
            num_retries=5,
        )
        reply = answer.choices[0].message
        messages.append(reply.model_dump())
        if not reply.tool_calls:
            return 1.0 if reply.content == row["metadata"]["expect"] else 0.0
        for c in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": c.id, "content": row["metadata"]["table"]["ab"]})


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
    from openai import OpenAI

    llm = OpenAI(base_url=client.base_url, api_key=client.api_key)
    messages = [{"role": "user", "content": row["prompt"]}]
    while True:
        reply = llm.chat.completions.create(model=client.model, messages=messages, tools=TOOLS).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls and not reply.content:
            messages.append(GO_ON)
            continue
        if not reply.tool_calls:
            return 1.0 if reply.content == row["metadata"]["expect"] else 0.0
        for c in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": c.id, "content": row["metadata"]["table"]["ab"]})


def langchain_empty(client, row):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=client.model, base_url=client.base_url, api_key=client.api_key).bind_tools(TOOLS)
    messages = [HumanMessage(row["prompt"])]
    while True:
        reply = llm.invoke(messages)
        messages.append(reply)
        if not reply.tool_calls and not reply.content:
            messages.append(HumanMessage(GO_ON["content"]))
            continue
        if not reply.tool_calls:
            return 1.0 if reply.content == row["metadata"]["expect"] else 0.0
        for c in reply.tool_calls:
            messages.append(ToolMessage(row["metadata"]["table"][c["args"]["key"]], tool_call_id=c["id"]))


def litellm_empty(client, row):
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
        if not reply.tool_calls and not reply.content:
            messages.append(GO_ON)
            continue
        if not reply.tool_calls:
            return 1.0 if reply.content == row["metadata"]["expect"] else 0.0
        for c in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": c.id, "content": row["metadata"]["table"]["ab"]})


async def agents_empty(client, row):
    """Two runs of the Agents SDK: the first ends on the empty answer; the second goes on from
    ``to_input_list()``, which leaves the empty assistant turn out."""
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    @function_tool
    def lookup(key: str) -> str:
        """Look a key up.

        Args:
            key: the key.
        """
        return row["metadata"]["table"][key]

    llm = AsyncOpenAI(base_url=client.base_url, api_key=client.api_key)
    agent = Agent(name="finder", tools=[lookup], model=OpenAIChatCompletionsModel(client.model, openai_client=llm))
    first = await Runner.run(agent, row["prompt"])
    assert not first.final_output, first.final_output
    history = first.to_input_list()
    assert not any(item.get("role") == "assistant" for item in history), history  # the empty turn left out
    result = await Runner.run(agent, [*history, GO_ON])
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
