"""OpenAI's chat-completions shapes for the agent endpoint: a request's fields checked, an answered turn as a
completion. Plain data in and out (no HTTP: :mod:`gspo_mcore.envs.endpoint` serves them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class FieldRefused(ValueError):
    """A request field the trainer cannot honour (HTTP 400 naming the field)."""

    http_status, http_code = 400, "unsupported_field"

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChatRequest:
    """What the endpoint takes from a chat-completions body."""

    messages: list
    tools: list


def parse_request(body: Any) -> ChatRequest:
    """The request's messages and tools; :class:`FieldRefused` naming a field that cannot be honoured."""
    if not isinstance(body, Mapping):
        raise FieldRefused("messages", "the body must be a JSON object with a 'messages' list")
    if not isinstance(body.get("messages"), list):
        raise FieldRefused("messages", "the body must be a JSON object with a 'messages' list")
    if body.get("stream"):
        raise FieldRefused("stream", "stream is not supported: the trainer answers each turn whole")
    if body.get("n", 1) not in (1, None):
        raise FieldRefused("n", "n must be 1: an episode is one sequence")
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        raise FieldRefused("tools", "tools must be a list of tool objects")
    return ChatRequest(messages=body["messages"], tools=tools)


def completion(model: str, episode: str, turn) -> dict:
    """An answered turn (``turn.answer``, the assistant message) as a ``chat.completion``."""
    message = turn.answer
    finish = "tool_calls" if message.get("tool_calls") else "stop"
    return {
        "id": f"chatcmpl-{episode}-{turn.number}",
        "object": "chat.completion",
        "created": turn.created,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
    }
