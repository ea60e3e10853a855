"""The two-turn tiny episode (``examples.agent_tiny.agent.two_turns``) written with each agent library the endpoint
serves (docs/agents.md, "Real agent clients"): the prompt, a policy turn, ``hint`` as the next user message, a
second turn; ``bonus`` when the first turn was not empty. Every one gives the same token sequences as
``examples.agent_tiny.env:TwoTurns`` (tests/trainer/test_agent_clients_run.py trains 2 steps with each and checks
the losses against it). Run one with the tiny job (``AGENT`` one of the functions below):

    python -m examples.tiny.prepare --out runs/tiny
    torchrun --nproc-per-node 1 -m gspo_mcore.train --config examples/tiny/config.yaml \\
      rollout.env=gspo_mcore.envs:AgentEnv \\
      "rollout.env_kwargs={agent: examples.agent_tiny.clients:AGENT, agent_kwargs: {hint: ' ok '}, serve: true}" \\
      rollout.episode.max_turns=3 rollout.episode.max_total_tokens=96

The libraries are pinned in requirements.txt. Each function imports its own, so one missing library stops only
the runs that use it.
"""

from __future__ import annotations

import asyncio
import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm: no price list fetched at import


def _score(first: str | None, bonus: float) -> float:
    return bonus if (first or "").strip() else 0.0


def openai_sync(client, row, hint: str = "\n", bonus: float = 0.0) -> float:
    from openai import OpenAI

    llm = OpenAI(base_url=client.base_url, api_key=client.api_key)
    messages = [{"role": "user", "content": row["prompt"]}]
    first = llm.chat.completions.create(model=client.model, messages=messages).choices[0].message
    messages += [first.model_dump(exclude_none=True), {"role": "user", "content": hint}]
    llm.chat.completions.create(model=client.model, messages=messages)
    return _score(first.content, bonus)


async def openai_async(client, row, hint: str = "\n", bonus: float = 0.0) -> float:
    from openai import AsyncOpenAI

    llm = AsyncOpenAI(base_url=client.base_url, api_key=client.api_key)
    messages = [{"role": "user", "content": row["prompt"]}]
    first = (await llm.chat.completions.create(model=client.model, messages=messages)).choices[0].message
    messages += [first.model_dump(), {"role": "user", "content": hint}]
    await llm.chat.completions.create(model=client.model, messages=messages)
    return _score(first.content, bonus)


def openai_stream(client, row, hint: str = "\n", bonus: float = 0.0) -> float:
    """``stream=True``, the chunks' text joined (the SDK's ``chat.completions.stream`` helper raises
    LengthFinishReasonError on a turn cut by a length limit, which the tiny job's turns often are)."""
    from openai import OpenAI

    llm = OpenAI(base_url=client.base_url, api_key=client.api_key)
    messages = [{"role": "user", "content": row["prompt"]}]
    texts = []
    for _ in range(2):
        chunks = llm.chat.completions.create(model=client.model, messages=messages, stream=True)
        texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
        messages += [{"role": "assistant", "content": texts[-1]}, {"role": "user", "content": hint}]
    return _score(texts[0], bonus)


def openai_responses(client, row, hint: str = "\n", bonus: float = 0.0) -> float:
    from openai import OpenAI

    llm = OpenAI(base_url=client.base_url, api_key=client.api_key)
    first = llm.responses.create(model=client.model, input=row["prompt"])
    llm.responses.create(model=client.model, input=hint, previous_response_id=first.id)
    return _score(first.output_text, bonus)


def openai_responses_stream(client, row, hint: str = "\n", bonus: float = 0.0) -> float:
    """The Responses API streamed (``stream=True``): the last event's response (``response.completed``, or
    ``response.incomplete`` for a turn cut by a length limit) is the answer."""
    from openai import OpenAI

    llm = OpenAI(base_url=client.base_url, api_key=client.api_key)
    first = None
    for inputs in (row["prompt"], hint):
        previous = {"previous_response_id": first.id} if first is not None else {}
        events = list(llm.responses.create(model=client.model, input=inputs, stream=True, **previous))
        first = first or events[-1].response
    return _score(first.output_text, bonus)


def _langchain(client, row, hint, bonus, stream):
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=client.model, base_url=client.base_url, api_key=client.api_key)
    messages, replies = [HumanMessage(row["prompt"])], []
    for _ in range(2):
        if stream:
            reply = None
            for chunk in llm.stream(messages):
                reply = chunk if reply is None else reply + chunk
        else:
            reply = llm.invoke(messages)
        replies.append(reply)
        messages += [reply, HumanMessage(hint)]
    return _score(replies[0].content, bonus)


def langchain_invoke(client, row, hint: str = "\n", bonus: float = 0.0) -> float:
    return _langchain(client, row, hint, bonus, stream=False)


def langchain_stream(client, row, hint: str = "\n", bonus: float = 0.0) -> float:
    return _langchain(client, row, hint, bonus, stream=True)


async def _agents(client, row, hint, bonus, model_kind, streamed):
    from agents import Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # the SDK would upload traces to OpenAI
    llm = AsyncOpenAI(base_url=client.base_url, api_key=client.api_key)
    model = (OpenAIChatCompletionsModel if model_kind == "chat" else OpenAIResponsesModel)(
        client.model, openai_client=llm
    )
    agent = Agent(name="tiny", model=model)

    async def run(inputs):
        if not streamed:
            return await Runner.run(agent, inputs)
        result = Runner.run_streamed(agent, inputs)
        async for _ in result.stream_events():
            pass
        return result

    from agents.exceptions import ModelBehaviorError

    try:
        first = await run(row["prompt"])  # the second run goes on from the first's history (to_input_list)
    except ModelBehaviorError:  # the Responses model refuses an 'incomplete' answer (a turn cut by a length limit)
        return 0.0  # the episode ends after its first turn
    try:
        await run([*first.to_input_list(), {"role": "user", "content": hint}])
    except ModelBehaviorError:
        pass
    return _score(first.final_output, bonus)


def agents_chat(client, row, hint: str = "\n", bonus: float = 0.0) -> float:
    return asyncio.run(_agents(client, row, hint, bonus, "chat", streamed=False))


def agents_run_streamed(client, row, hint: str = "\n", bonus: float = 0.0) -> float:
    return asyncio.run(_agents(client, row, hint, bonus, "chat", streamed=True))


def agents_responses(client, row, hint: str = "\n", bonus: float = 0.0) -> float:
    return asyncio.run(_agents(client, row, hint, bonus, "responses", streamed=False))


def agents_responses_streamed(client, row, hint: str = "\n", bonus: float = 0.0) -> float:
    return asyncio.run(_agents(client, row, hint, bonus, "responses", streamed=True))


def litellm_completion(client, row, hint: str = "\n", bonus: float = 0.0, stream: bool = False) -> float:
    import litellm

    messages, replies = [{"role": "user", "content": row["prompt"]}], []
    for _ in range(2):
        kwargs = dict(model=f"openai/{client.model}", api_base=client.base_url, api_key=client.api_key)
        if stream:
            chunks = litellm.completion(**kwargs, messages=messages, stream=True)
            answer = litellm.stream_chunk_builder(list(chunks), messages=messages)
        else:
            answer = litellm.completion(**kwargs, messages=messages)
        replies.append(answer.choices[0].message)
        messages += [replies[-1].model_dump(), {"role": "user", "content": hint}]
    return _score(replies[0].content, bonus)


def litellm_stream(client, row, hint: str = "\n", bonus: float = 0.0) -> float:
    return litellm_completion(client, row, hint, bonus, stream=True)


CLIENTS = {
    "openai_sync": "openai",
    "openai_async": "openai",
    "openai_stream": "openai",
    "openai_responses": "openai",
    "openai_responses_stream": "openai",
    "langchain_invoke": "langchain_openai",
    "langchain_stream": "langchain_openai",
    "agents_chat": "agents",
    "agents_run_streamed": "agents",
    "agents_responses": "agents",
    "agents_responses_streamed": "agents",
    "litellm_completion": "litellm",
    "litellm_stream": "litellm",
}
"""Each agent function here and the module it needs."""
