"""Observations -> token ids with the model's own chat template, appending only what is new.

The prompt (the first observation) is rendered whole. After a policy turn, only the new messages are
rendered, with the template's own framing around them, and their ids appended: the sampled ids are never
decoded and re-tokenised (re-tokenising a conversation can change ids at turn boundaries, so the learner
would score tokens the engine never sampled).

How the framing is found: the template renders ``[user, assistant, *new]`` (a fixed probe conversation) with
each message's content replaced by a marker of its own (``MARK``, a random tag no content holds, the message's
index); the text after the assistant's marker is the end of the assistant's turn followed by the new messages
and the next assistant header. The policy's turn ended with its stop token (whose text, e.g. ``<|im_end|>``,
starts that string) or was cut by a length limit; the environment span is the rest of the string after the
stop token's text, or the whole string (a turn cut after ``<`` keeps the real ``<|im_end|>``).

Framing and content are tokenised apart: the template's own text (``<|im_start|>tool`` ...) with its special
tokens, every message's content (tool results, an agent's messages, the row's prompt) with special-token
parsing off, so a tool that prints ``<|im_end|>\n<|im_start|>assistant\n`` adds text, never a forged turn. A
template that changes a message's content (it must render it verbatim) is refused with a ``ValueError``, as is
content that is not text: OpenAI content-part lists of ``text`` parts are joined, ``None`` is empty text on an
assistant message with ``tool_calls`` (legal OpenAI) and refused elsewhere, naming the message.

Tools: with a template that takes ``tools`` (its source mentions them), the schemas go to it and tool
results are ``tool`` messages. Otherwise (the fallback format) the schemas are described in a system
message (:data:`FALLBACK_TOOL_PROMPT`: the same ``<tool_call>{json}</tool_call>`` call syntax) and each
tool result becomes a ``user`` message ``<tool_response>...</tool_response>``.

Plain text (a tokenizer without a chat template): observations are text, appended as they are.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from gspo_mcore.envs.base import Observation

MARK = "\u2063\u2063MARK\u2063\u2063"
FRAME, CONTENT, TURN = "frame", "content", "turn"  # a rendered piece: the template's, a message's, the probe turn's
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
        self._special_ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
        # a fast tokenizer's special-token switch is one shared setting: one encode at a time per renderer
        self._lock = threading.Lock()

    @functools.cached_property
    def max_token_chars(self) -> int:
        """How many characters of content one token covers at most: twice the longest vocabulary entry (an
        entry's text is at least as long as what it decodes to; the factor covers normalisers that drop
        characters). Content longer than ``max_total_tokens * max_token_chars`` cannot fit, so the episode
        driver refuses it before tokenising."""
        vocab = self.tokenizer.get_vocab()
        return 2 * max((len(t) for t in vocab), default=1)

    def first(self, observation: Observation, tools: Sequence[Mapping[str, Any]] = ()) -> list[int]:
        """The prompt's ids, ending with the assistant header (generation starts the reply)."""
        if not self.chat:
            return self._encode([(_as_text(observation), CONTENT)])
        messages = _plain_messages(observation)
        kwargs = {}
        if tools and self.template_tools:
            kwargs["tools"] = [dict(t) for t in tools]
        elif tools:
            messages = _with_fallback_tools(messages, tools)
        return self._encode(self._segments(messages, **kwargs))

    def after_turn(
        self, observation: Observation, last_policy_ids: Sequence[int], stopped: bool | None = None
    ) -> list[int]:
        """The ids to append after a policy turn that ended with ``last_policy_ids[-1]``: the rest of the
        assistant turn's framing, the new messages, and the next assistant header. ``stopped``: the turn ended
        on a stop token (its finish reason); ``None``: when its last id is a special token."""
        if not self.chat:
            return self._encode([(_as_text(observation), CONTENT)])
        new = [self._fallback_message(m) for m in _plain_messages(observation)]
        probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]
        segments = self._segments(probe + new, turn=1)
        at = [k for k, (_, kind) in enumerate(segments) if kind == TURN]
        if len(at) != 1:
            raise ValueError("the chat template does not render the assistant's content verbatim")
        tail = segments[at[0] + 1 :]  # end of the assistant turn + new messages + the next header
        if stopped is None:
            stopped = bool(last_policy_ids) and last_policy_ids[-1] in self._special_ids
        stop_text = self.tokenizer.decode([last_policy_ids[-1]]) if stopped and last_policy_ids else ""
        if stop_text and tail and tail[0][1] == FRAME and tail[0][0].startswith(stop_text):
            tail[0] = (tail[0][0][len(stop_text) :], FRAME)
        return self._encode(tail)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _fallback_message(self, m: dict) -> dict:
        if m.get("role") == "tool" and not self.template_tools:
            return {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        return m

    def _segments(self, messages: list[dict], turn: int | None = None, **kwargs) -> list[tuple[str, str]]:
        """The template's text of ``messages`` as ``(text, kind)`` pieces: its framing (``FRAME``) and each
        message's content where the template puts it (``CONTENT``; message ``turn``'s is ``TURN``, the probe's
        assistant turn, never tokenised)."""
        contents = [m["content"] for m in messages]
        tag = secrets.token_hex(6)
        while any(tag in c for c in contents):
            tag = secrets.token_hex(6)
        masked = [{**m, "content": f"{MARK}{tag}.{k}{MARK}"} for k, m in enumerate(messages)]
        render = self.tokenizer.apply_chat_template
        text = render(masked, tokenize=False, add_generation_prompt=True, **kwargs)
        parts = re.split(f"{re.escape(MARK)}{tag}\\.(\\d+){re.escape(MARK)}", text)
        segments = []
        for k, part in enumerate(parts):
            if k % 2:
                segments.append((contents[int(part)], TURN if int(part) == turn else CONTENT))
            elif part:
                segments.append((part, FRAME))
        real = render(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        rebuilt = "".join(piece for piece, _ in segments)
        if rebuilt != real:
            raise ValueError(
                "the chat template changes a message's content (it must render each content verbatim, so that "
                "the template's framing and the content can be tokenised apart)"
            )
        return segments

    def _encode(self, segments: Sequence[tuple[str, str]]) -> list[int]:
        """Framing with the tokenizer's special tokens; content with special-token parsing off."""
        ids: list[int] = []
        with self._lock:
            for text, kind in segments:
                if text and kind != TURN:
                    kw = {"split_special_tokens": True} if kind == CONTENT else {}
                    ids += self.tokenizer(text, add_special_tokens=False, **kw)["input_ids"]
        return ids


def _with_fallback_tools(messages: list[dict], tools: Sequence[Mapping[str, Any]]) -> list[dict]:
    lines = "\n".join(json.dumps(t.get("function", t)) for t in tools)
    prompt = FALLBACK_TOOL_PROMPT.format(tools=lines)
    if messages and messages[0].get("role") == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{prompt}"}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _as_messages(observation: Observation) -> list[Mapping[str, Any]]:
    return [{"role": "user", "content": observation}] if isinstance(observation, str) else list(observation)


def _plain_messages(observation: Observation) -> list[dict]:
    """The observation's messages with text content (see the module docstring); ``ValueError`` naming the
    message otherwise."""
    return [{**m, "content": _content_text(m, k)} for k, m in enumerate(_as_messages(observation))]


def _content_text(m: Mapping[str, Any], k: int) -> str:
    content, role = m.get("content"), m.get("role")
    if isinstance(content, str):
        return content
    if content is None:
        if role == "assistant" and m.get("tool_calls"):
            return ""
        raise ValueError(
            f"message {k} ({role}): content None (only an assistant message with tool_calls may have no content)"
        )
    if isinstance(content, (list, tuple)):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"message {k} ({role}): a content part of type {kind!r}; only text parts are taken")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(f"message {k} ({role}): content of type {type(content).__name__}, expected text or text parts")


def _as_text(observation: Observation) -> str:
    if isinstance(observation, str):
        return observation
    return "".join(m["content"] for m in _plain_messages(observation))
