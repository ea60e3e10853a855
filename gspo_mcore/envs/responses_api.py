"""OpenAI's Responses API (``POST /v1/responses``) for the agent endpoint: the subset the OpenAI Agents SDK's
default model uses, mapped onto the same chat turns (and the same token-exact history check) as
:mod:`gspo_mcore.envs.chat_api`. Plain data in and out.

Input items: messages (``input_text`` / ``output_text`` parts or a string; ``instructions`` as the system
message), ``function_call`` (joined to the assistant message before it), ``function_call_output`` (a tool
message), ``reasoning`` (its text merged into the next assistant message's think block). Function tools.
``previous_response_id``: a response of the same episode stands for its whole conversation (request and
output). ``store`` is taken either way (responses are kept for the episode's ``previous_response_id`` only).
Output items: a ``message`` with the turn's text (think block included, as sampled) and one ``function_call`` per
tool call (``call_id`` the chat answer's tool-call id). ``max_output_tokens`` caps the turn as chat completions'
``max_tokens`` does (a capped turn's response is ``incomplete``, reason ``max_output_tokens``, as OpenAI answers
it: the Agents SDK's Responses model raises ``ModelBehaviorError`` on it, against OpenAI too). ``stream: true``:
the answer as OpenAI's server-sent events once the turn is sampled (:func:`events`). Not served: built-in tools.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gspo_mcore.envs.chat_api import REFUSABLE, ChatRequest, FieldRefused, cap, neutral, usage

RESPONSES_REFUSABLE = {k: v for k, v in REFUSABLE.items() if k != "n"}
"""Each Responses field the endpoint refuses when set (to a non-neutral value), and why."""


def _text(content, what: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        out = []
        for p in content:
            if not isinstance(p, Mapping) or p.get("type") not in ("input_text", "output_text", "text"):
                raise FieldRefused("input", f"{what}: only text content parts are served, got {p!r:.100}")
            out.append(str(p.get("text", "")))
        return "".join(out)
    raise FieldRefused("input", f"{what}: content must be text or a list of text parts")


def to_chat(items: list, instructions: str | None) -> list[dict]:
    """Responses input items as chat messages (see the module docstring)."""
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    reasoning: list[str] = []
    for k, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise FieldRefused("input", f"input item {k} is not an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise FieldRefused("input", f"input item {k}: role {role!r} is not served")
            message = {"role": "system" if role == "developer" else role, "content": _text(item.get("content"), k)}
            if role == "assistant" and reasoning:
                message["reasoning_content"], reasoning = "".join(reasoning), []
            messages.append(message)
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            last = messages[-1] if messages else None  # the calls of one turn follow its message, if any
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                if reasoning:
                    last["reasoning_content"], reasoning = "".join(reasoning), []
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": _text(output, k)})
        elif kind == "reasoning":
            parts = [*(item.get("content") or ()), *(item.get("summary") or ())]
            reasoning.append("".join(str(p.get("text", "")) for p in parts if isinstance(p, Mapping)))
        else:
            raise FieldRefused("input", f"input item {k}: type {kind!r} is not served")
    return messages


def parse_request(body: Any, ignore, previous) -> ChatRequest:
    """A Responses body as the chat request it stands for; ``previous(id)``: the messages a stored response
    stands for (``None`` when unknown)."""
    if not isinstance(body, Mapping):
        raise FieldRefused("input", "the body must be a JSON object with 'input'")
    ignored = []
    for name, why in RESPONSES_REFUSABLE.items():
        if name in body and not neutral(name, body[name]):
            if name not in ignore:
                raise FieldRefused(name, f"{name}={body[name]!r} cannot be honoured: {why}")
            ignored.append(name)
    text = body.get("text")
    if isinstance(text, Mapping) and isinstance(text.get("format"), Mapping):
        if text["format"].get("type", "text") != "text":
            raise FieldRefused("text", "text.format other than 'text' cannot be honoured (it constrains the policy)")
    items = body.get("input")
    items = [{"role": "user", "content": items}] if isinstance(items, str) else items
    if not isinstance(items, list):
        raise FieldRefused("input", "input must be a string or a list of items")
    tools = []
    for t in body.get("tools") or ():
        if not isinstance(t, Mapping) or t.get("type") != "function":
            raise FieldRefused("tools", f"only function tools are served, got {t!r:.100}")
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        tools.append({"type": "function", "function": fn})
    prior = []
    if body.get("previous_response_id") is not None:
        prior = previous(body["previous_response_id"])
        if prior is None:
            raise FieldRefused("previous_response_id", f"no response {body['previous_response_id']!r} in this episode")
    instructions = None if prior else body.get("instructions")
    return ChatRequest(
        messages=[*prior, *to_chat(items, instructions)],
        tools=tools,
        max_tokens=cap(body, "max_output_tokens"),
        ignored=tuple(ignored),
        stream=bool(body.get("stream")),
    )


def response(model: str, episode: str, turn, request: ChatRequest, body: Mapping) -> dict:
    """An answered turn as a ``response`` object with its output items."""
    message, rid = turn.answer, response_id(episode, turn)
    cut = turn.meta.get("finish_reason") == "length"
    output = []
    if message.get("content"):
        output.append(
            {
                "type": "message",
                "id": f"msg_{episode}_{turn.number}",
                "role": "assistant",
                "status": "incomplete" if cut else "completed",
                "content": [{"type": "output_text", "text": message["content"], "annotations": []}],
            }
        )
    for k, c in enumerate(message.get("tool_calls", ())):
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{episode}_{turn.number}_{k}",
                "call_id": c["id"],
                "name": c["function"]["name"],
                "arguments": c["function"]["arguments"],
                "status": "completed",
            }
        )
    counts = usage(turn) or {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    return {
        "id": rid,
        "object": "response",
        "created_at": turn.created,
        "model": model,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None,
        "instructions": body.get("instructions"),
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": body.get("tools") or [],
        "temperature": None,
        "top_p": None,
        "previous_response_id": body.get("previous_response_id"),
        "store": body.get("store", True),
        "text": {"format": {"type": "text"}},
        "metadata": {},
        "usage": {
            "input_tokens": counts["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": counts["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": counts["total_tokens"],
        },
    }


def response_id(episode: str, turn) -> str:
    return f"resp_{episode}_{turn.number}"


def events(model: str, episode: str, turn, request: ChatRequest, body: Mapping) -> list[dict]:
    """An answered turn as the Responses API's stream events (``stream: true``), sent once the turn is sampled:
    ``response.created`` and ``response.in_progress`` (no output yet), per output item its ``output_item.added``,
    the text (``content_part.added``, one ``output_text.delta`` with the whole text, ``output_text.done``,
    ``content_part.done``) or the call's arguments (one ``function_call_arguments.delta``, ``.done``) and its
    ``output_item.done``; then ``response.completed`` with the usage (``response.incomplete`` for a turn cut by a
    length limit). Each event's ``type`` is also its SSE ``event:`` name; ``sequence_number`` counts from 0."""
    final = response(model, episode, turn, request, body)
    start = {**final, "status": "in_progress", "incomplete_details": None, "output": [], "usage": None}
    out = [
        {"type": "response.created", "response": start},
        {"type": "response.in_progress", "response": start},
    ]
    for k, item in enumerate(final["output"]):
        where = {"item_id": item["id"], "output_index": k}
        if item["type"] == "message":
            text = item["content"][0]["text"]
            part = {"type": "output_text", "text": "", "annotations": []}
            out += [
                {"type": "response.output_item.added", "output_index": k, "item": {**item, "content": []}},
                {"type": "response.content_part.added", **where, "content_index": 0, "part": part},
                {"type": "response.output_text.delta", **where, "content_index": 0, "delta": text, "logprobs": []},
                {"type": "response.output_text.done", **where, "content_index": 0, "text": text, "logprobs": []},
                {"type": "response.content_part.done", **where, "content_index": 0, "part": {**part, "text": text}},
            ]
        else:
            args = item["arguments"]
            added = {**item, "arguments": "", "status": "in_progress"}
            out += [
                {"type": "response.output_item.added", "output_index": k, "item": added},
                {"type": "response.function_call_arguments.delta", **where, "delta": args},
                {"type": "response.function_call_arguments.done", **where, "name": item["name"], "arguments": args},
            ]
        out.append({"type": "response.output_item.done", "output_index": k, "item": item})
    out.append({"type": f"response.{final['status']}", "response": final})
    return [{**e, "sequence_number": n} for n, e in enumerate(out)]
