"""OpenAI's chat-completions shapes for the agent endpoint: a request's fields checked, an answered turn as a
completion (or as server-sent-event chunks). Plain data in and out (no HTTP: :mod:`gspo_mcore.envs.endpoint`
serves them).

Fields the trainer cannot honour without changing the policy's distribution are refused naming the field
(:data:`REFUSABLE`), unless the run lists them in ``rollout.env_kwargs.ignore_fields``. ``max_tokens`` /
``max_completion_tokens`` are honoured (:data:`CAPS`): they cap the turn below the run's limits, which still
apply (the smallest wins); a capped turn ends ``length``, each of its tokens drawn as without the cap. ``stop``
(up to :data:`MAX_STOP` strings) is honoured: the engine ends the turn at the first sampled token whose text
completes one (that token kept, nothing sampled after it), the answer's content ends before the string and the
finish reason is ``stop``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

REFUSABLE: dict[str, str] = {
    "temperature": "the run's rollout.sampling.temperature samples every turn",
    "top_p": "the run's rollout.sampling decides",
    "top_k": "the run's rollout.sampling decides",
    "min_p": "the run's rollout.sampling decides",
    "seed": "every episode samples from its own key (derive_sample_seed)",
    "frequency_penalty": "penalties change the policy's distribution",
    "presence_penalty": "penalties change the policy's distribution",
    "repetition_penalty": "penalties change the policy's distribution",
    "logit_bias": "it changes the policy's distribution",
    "tool_choice": "only 'auto' (the model decides) leaves the policy's distribution as it is",
    "parallel_tool_calls": "the model decides how many calls a turn makes",
    "response_format": "only free text ('text') leaves the policy's distribution as it is",
    "n": "an episode is one sequence: n must be 1",
    "top_logprobs": "the engine records only the sampled tokens' log-probs",
}
"""Each field the endpoint refuses when a request sets it (to something other than its neutral value), and why."""

CAPS = ("max_completion_tokens", "max_tokens")
"""The fields that cap a chat turn's tokens (honoured: ``ChatRequest.max_tokens``)."""
MAX_STOP = 4
"""The most stop strings a request may send (OpenAI's limit)."""


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
    stream: bool = False
    include_usage: bool = False
    """``stream_options.include_usage``: a last chunk with the usage."""
    logprobs: bool = False
    max_tokens: int | None = None
    """The request's cap on the turn's tokens (``max_completion_tokens`` or ``max_tokens``; ``None``: none). The
    run's ``rollout.sampling.max_new_tokens`` and the room under ``rollout.episode.max_total_tokens`` still apply."""
    ignored: tuple[str, ...] = field(default=())
    """Fields set in the request that the run's ``ignore_fields`` let through."""
    stop: tuple[str, ...] = ()
    """The request's stop strings (``stop``: the turn ends where its text completes one; ``()``: none)."""


def neutral(name: str, value) -> bool:
    """Whether a field's value leaves the policy's turn as the trainer samples it."""
    if value is None:
        return True
    if name == "n":
        return value == 1
    if name == "top_logprobs":
        return value == 0
    if name == "tool_choice":
        return value == "auto"
    if name == "parallel_tool_calls":
        return value is True
    if name == "response_format":
        return isinstance(value, Mapping) and value.get("type") == "text"
    if name == "logit_bias":
        return value == {}
    return False


def parse_request(body: Any, ignore: Sequence[str] = ()) -> ChatRequest:
    """The request's messages, tools and answer options; :class:`FieldRefused` naming a field that cannot be
    honoured (one listed in ``ignore`` is let through and named in ``ChatRequest.ignored``)."""
    if not isinstance(body, Mapping) or not isinstance(body.get("messages"), list):
        raise FieldRefused("messages", "the body must be a JSON object with a 'messages' list")
    ignored = []
    for name, why in REFUSABLE.items():
        if name in body and not neutral(name, body[name]):
            if name not in ignore or name == "n":
                raise FieldRefused(
                    name,
                    f"{name}={body[name]!r} cannot be honoured: {why} (list it in rollout.env_kwargs.ignore_fields "
                    "to have it ignored)",
                )
            ignored.append(name)
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        raise FieldRefused("tools", "tools must be a list of tool objects")
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping):
        raise FieldRefused("stream_options", "stream_options must be an object")
    caps = {name: cap(body, name) for name in CAPS if body.get(name) is not None}
    if len(set(caps.values())) > 1:
        raise FieldRefused("max_tokens", f"max_tokens and max_completion_tokens differ ({caps}): send one")
    return ChatRequest(
        messages=body["messages"],
        tools=tools,
        stream=bool(body.get("stream")),
        include_usage=bool(options.get("include_usage")),
        logprobs=bool(body.get("logprobs")),
        max_tokens=next(iter(caps.values()), None),
        ignored=tuple(ignored),
        stop=stop_strings(body.get("stop")),
    )


def stop_strings(value) -> tuple[str, ...]:
    """A request's ``stop``: a string or a list of up to :data:`MAX_STOP` non-empty strings (``None``, ``""`` or
    ``[]``: none)."""
    if value is None or value == "" or value == []:
        return ()
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or not all(isinstance(s, str) and s for s in strings):
        raise FieldRefused("stop", f"stop must be a string or a list of non-empty strings, got {value!r:.100}")
    if len(strings) > MAX_STOP:
        raise FieldRefused("stop", f"stop has {len(strings)} strings, at most {MAX_STOP} are taken")
    return tuple(dict.fromkeys(strings))


def cap(body: Mapping, name: str) -> int | None:
    """A request's cap on the turn's tokens (``body[name]``): a positive integer, or ``None`` when unset."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise FieldRefused(name, f"{name} must be a positive integer, got {value!r}")
    return value


def finish_reason(turn) -> str:
    """``length`` for a turn cut by a limit, ``tool_calls`` for a turn of calls, else ``stop``."""
    if turn.meta.get("finish_reason") == "length":
        return "length"
    return "tool_calls" if turn.answer.get("tool_calls") else "stop"


def usage(turn) -> dict | None:
    """Prompt and completion tokens as the trainer counted them (None when the driver did not say)."""
    if "prompt_tokens" not in turn.meta:
        return None
    p, c = turn.meta["prompt_tokens"], len(turn.meta["ids"])
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def logprobs(turn) -> dict | None:
    """Every sampled id's recorded log-prob (the stop token included: the learner trains on it too)."""
    if "ids" not in turn.meta:
        return None
    content = [
        {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
        for t, lp in zip(turn.meta["tokens"], turn.meta["logprobs"])
    ]
    return {"content": content, "refusal": None}


def completion(model: str, episode: str, turn, request: ChatRequest) -> dict:
    """An answered turn (``turn.answer``, the assistant message) as a ``chat.completion``."""
    return {
        "id": f"chatcmpl-{episode}-{turn.number}",
        "object": "chat.completion",
        "created": turn.created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": turn.answer,
                "finish_reason": finish_reason(turn),
                "logprobs": logprobs(turn) if request.logprobs else None,
            }
        ],
        "usage": usage(turn),
    }


def chunks(model: str, episode: str, turn, request: ChatRequest) -> list[dict]:
    """An answered turn as ``chat.completion.chunk`` events (``stream: true``), sent once the turn is sampled:
    the role, the text, one delta per tool call (whole), the finish reason, and with
    ``stream_options.include_usage`` a last chunk with the usage."""
    head = {"id": f"chatcmpl-{episode}-{turn.number}", "object": "chat.completion.chunk", "created": turn.created}
    head["model"] = model

    def chunk(delta: dict, finish: str | None = None, logprobs_: dict | None = None) -> dict:
        out = {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs_}]}
        if request.include_usage:
            out["usage"] = None
        return out

    message = turn.answer
    out = [chunk({"role": "assistant", "content": ""})]
    if message.get("content"):
        out.append(chunk({"content": message["content"]}, logprobs_=logprobs(turn) if request.logprobs else None))
    for k, call in enumerate(message.get("tool_calls", ())):
        out.append(chunk({"tool_calls": [{"index": k, **call}]}))
    out.append(chunk({}, finish_reason(turn)))
    if request.include_usage:
        out.append({**head, "choices": [], "usage": usage(turn)})
    return out
