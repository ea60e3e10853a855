"""Observations -> token ids with the model's own chat template, appending only what is new.

The prompt (the first observation) is rendered whole. After a policy turn, only the new messages are
rendered, with the template's own framing around them, and their ids appended: the sampled ids are never
decoded and re-tokenised (re-tokenising a conversation can change ids at turn boundaries, so the learner
would score tokens the engine never sampled).

How the framing is found: the template renders ``[user, assistant MARK]`` and ``[user, assistant MARK, *new]``
(a fixed probe conversation, ``MARK`` a marker string); the text after ``MARK`` in the second is the end of
the assistant's turn followed by the new messages and the next assistant header. The policy's turn ended
with its stop token (whose text, e.g. ``<|im_end|>``, starts that string) or was cut by a length limit;
the environment span is the rest of the string after the stop token's text, or the whole string.

Tools: with a template that takes ``tools`` (its source mentions them), the schemas go to it and tool
results are ``tool`` messages. Otherwise (the fallback format) the schemas are described in a system
message (:data:`FALLBACK_TOOL_PROMPT`: the same ``<tool_call>{json}</tool_call>`` call syntax) and each
tool result becomes a ``user`` message ``<tool_response>...</tool_response>``.

Plain text (a tokenizer without a chat template): observations are text, appended as they are.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from gspo_mcore.envs.base import Observation

MARK = "\u2063\u2063MARK\u2063\u2063"
FALLBACK_TOOL_PROMPT = (
    "You can call these tools:\n{tools}\n"
    'To call one, write <tool_call>{{"name": NAME, "arguments": {{...}}}}</tool_call>; '
    "its result comes back in <tool_response></tool_response>. Without a tool call, your reply is final."
)


class ChatRenderer:
    """Token ids for observations, with a Hugging Face tokenizer (see the module docstring).

    Args:
        tokenizer: a ``transformers`` tokenizer.
        tool_format: ``"auto"`` (the template's tools when it takes them, else the fallback), ``"template"``
            (refuse a template without tools) or ``"fallback"``.
    """

    def __init__(self, tokenizer, *, tool_format: str = "auto"):
        if tool_format not in ("auto", "template", "fallback"):
            raise ValueError(f"tool_format must be 'auto', 'template' or 'fallback', got {tool_format!r}")
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None) or ""
        self.chat = bool(template)
        takes_tools = "tools" in template
        if tool_format == "template" and not takes_tools:
            raise ValueError("tool_format 'template': the tokenizer's chat template does not take tools")
        self.template_tools = takes_tools and tool_format != "fallback"

    def first(self, observation: Observation, tools: Sequence[Mapping[str, Any]] = ()) -> list[int]:
        """The prompt's ids, ending with the assistant header (generation starts the reply)."""
        if not self.chat:
            return self._encode(_as_text(observation))
        messages = [dict(m) for m in _as_messages(observation)]
        kwargs = {}
        if tools and self.template_tools:
            kwargs["tools"] = [dict(t) for t in tools]
        elif tools:
            messages = _with_fallback_tools(messages, tools)
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        return self._encode(text)

    def after_turn(self, observation: Observation, last_policy_ids: Sequence[int]) -> list[int]:
        """The ids to append after a policy turn that ended with ``last_policy_ids[-1]``: the rest of the
        assistant turn's framing, the new messages, and the next assistant header."""
        if not self.chat:
            return self._encode(_as_text(observation))
        new = [self._fallback_message(dict(m)) for m in _as_messages(observation)]
        probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": MARK}]
        text = self.tokenizer.apply_chat_template(probe + new, tokenize=False, add_generation_prompt=True)
        if text.count(MARK) != 1:
            raise ValueError("the chat template does not render the assistant's content verbatim")
        tail = text.split(MARK, 1)[1]  # end of the assistant turn + new messages + the next header
        stop_text = self.tokenizer.decode([last_policy_ids[-1]]) if last_policy_ids else ""
        if stop_text and tail.startswith(stop_text):
            tail = tail[len(stop_text) :]
        return self._encode(tail)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _fallback_message(self, m: dict) -> dict:
        if m.get("role") == "tool" and not self.template_tools:
            return {"role": "user", "content": f"<tool_response>\n{m.get('content', '')}\n</tool_response>"}
        return m

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def _with_fallback_tools(messages: list[dict], tools: Sequence[Mapping[str, Any]]) -> list[dict]:
    lines = "\n".join(json.dumps(t.get("function", t)) for t in tools)
    prompt = FALLBACK_TOOL_PROMPT.format(tools=lines)
    if messages and messages[0].get("role") == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{prompt}"}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _as_messages(observation: Observation) -> list[Mapping[str, Any]]:
    return [{"role": "user", "content": observation}] if isinstance(observation, str) else list(observation)


def _as_text(observation: Observation) -> str:
    if isinstance(observation, str):
        return observation
    return "".join(str(m.get("content", "")) for m in observation)
