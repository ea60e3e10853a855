"""Agent programs as environments: the agent calls the policy like a chat API; the trainer keeps the tokens.

The user writes the agent: a function ``agent(client, row, **agent_kwargs) -> reward`` (or ``async def``) that
talks to the policy with ``client.chat(messages, tools=...)`` and runs its own tools between calls. With
``serve: true`` the same calls are also served over HTTP as an OpenAI-compatible ``/v1/chat/completions`` (and
``/v1/responses``, :mod:`gspo_mcore.envs.responses_api`) on loopback (``client.base_url``, ``client.api_key``),
so a black-box program (any language, the ``openai`` SDK) can be the agent: the function starts it and returns its
reward.

:class:`AgentEnv` turns that program into an :class:`~gspo_mcore.envs.base.Environment`: ``reset`` starts the
agent (its own thread) and waits for its first request, whose messages and tools are the first observation;
``step`` answers the request the policy's turn belongs to with an assistant message (``<tool_call>`` blocks
parsed into OpenAI ``tool_calls``) and waits for the next request, whose new messages are the next observation.
The agent returning ends the episode (``done``); its number is added to the reward (``Step.reward``).

Token exactness needs every request to extend the conversation: the previous request's messages, then the
assistant message that answered it, then new messages. Only the new messages are rendered; the rest is checked
against the conversation so far, never re-tokenised (the learner trains on the recorded ids). The check takes
what real clients do to the history they re-send, and only that: the ``reasoning_content`` / ``reasoning`` a
client split off the content merged back into the ``<think>`` block; an empty answer (no text, no tool calls)
left out; content None, "" or absent, or a list of text parts; tool-call arguments as JSON, not as strings;
fields clients add (``name``, and ``refusal``, ``annotations``, ``audio``, ``function_call`` holding nothing).
A request that edits or drops history ends the episode as ``error`` naming the message, the field and both
values. Tool-call ids are ``call_`` + random hex, unique within the episode. ``stream: true`` gets the answer
as server-sent-event chunks once the turn is sampled. Every answer has ``usage`` (the trainer's token counts),
and ``logprobs`` (the recorded log-probs) when asked. ``max_tokens`` / ``max_completion_tokens`` (the Responses
API's ``max_output_tokens``) cap the turn below the run's limits (``Reset`` / ``Step.max_new_tokens``: the engine
stops the turn there, finish reason ``length``); ``stop`` strings end it (``Reset`` / ``Step.stop``: the engine
stops at the token that completes one, that token kept; the answer's content ends before the string, finish reason
``stop``, and that content is what the next request's history is checked against). Request fields that would
change the policy's distribution (``temperature``, ``tool_choice`` "required", ...:
:data:`~gspo_mcore.envs.chat_api.REFUSABLE`) are
refused naming the field, unless ``ignore_fields`` lists them (then counted per episode, ``Step.info``'s
``ignored_fields``, which reach the run's metrics as ``episode_ignored_fields/<field>``).

When the episode ends for another cause (``max_turns``, ``max_total_tokens``, a timeout), the agent's pending
or next call raises :class:`EpisodeOver` (HTTP 409), so its thread ends Every later request with the
episode's key gets 409 too, however often a client retries it (the last :data:`ENDED_KEPT` episodes' keys are
kept). Retries are safe: a request identical to the one being answered, or to the last one answered, gets that
same answer (the same completion id), never a second turn; a client that hung up before its answer is logged at
INFO, never as a traceback.

Each episode has its own URL (``client.base_url``, ``/episodes/<id>/v1``) and its own key (``client.api_key``):
a secret from :mod:`secrets` (nothing about it follows from another episode's), compared in constant time. A
request with no key or another key is refused (HTTP 401, as OpenAI answers a bad key) and logged (a warning
naming the episode whose URL it used, never the key); that episode is unaffected. The endpoint listens on
loopback by default and warns when bound to another address: anything that can reach it can try keys.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import ipaddress
import itertools
import json
import logging
import queue
import re
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gspo_mcore.envs.base import IGNORED_FIELDS, TOOL_CALLS, Reset, Step
from gspo_mcore.envs.chat_api import CAPS, REFUSABLE, stop_strings
from gspo_mcore.envs.endpoint import Endpoint, EndpointLimits
from gspo_mcore.envs.tools import ToolCall, load_object, parse_tool_calls

KEY = "rollout.env_kwargs"
ENDED_KEPT = 16384
"""How many ended episodes the endpoint still recognises (their key, for a 409 to a client's retries)."""
logger = logging.getLogger(__name__)
_CALL_BLOCK = r"<tool_call>.*?</tool_call>"


class EpisodeOver(RuntimeError):
    """The episode ended (a limit, a timeout, a bad request): the agent's call has no answer."""

    http_status, http_code = 409, "episode_over"


class AgentError(RuntimeError):
    """The agent raised (or returned something other than a number): its episode ends as ``error``, counted as
    ``episode_env_errors/AgentError``."""


class AgentRequestError(ValueError):
    """A request the trainer cannot answer token-exactly (edited history, changed tools, ...)."""

    http_status, http_code = 400, "invalid_request"


@dataclass
class _Turn:
    """One request and its answer, shared by the request's retries."""

    request: tuple  # (messages, tools, max_tokens, stop) as plain data
    number: int = 0  # the episode's how-manieth answer (the completion id)
    created: int = 0  # when it was answered (Unix seconds)
    answer: dict | BaseException | None = None
    meta: dict = field(default_factory=dict)  # the turn's tokens as the trainer counted them (TurnTokens)
    done: threading.Event = field(default_factory=threading.Event)
    callbacks: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def finish(self, answer) -> None:
        """Answer the turn (once): its waiters wake, its callbacks run (on this thread)."""
        with self.lock:
            if self.done.is_set():
                return
            self.answer = answer
            self.done.set()
            callbacks, self.callbacks = self.callbacks, []
        for fn in callbacks:
            fn()

    def when_done(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once the turn is answered (at once if it is)."""
        with self.lock:
            if not self.done.is_set():
                self.callbacks.append(fn)
                return
        fn()


@dataclass
class _Session:
    """One episode: the agent's requests go to the environment, its answers come back."""

    id: str
    key: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)
    """The episode's API key: a secret of its own (never derived from the id or another key)."""
    # ("request", messages, tools, max_tokens, stop) | ("finished", reward) | ("failed", why) | ("closed", why)
    events: queue.Queue = field(default_factory=queue.Queue)
    conversation: list = field(default_factory=list)  # (canonical message, may be left out) so far
    tools: list | None = None
    reply: dict | None = None  # the assistant message that answered the last request
    stop: tuple = ()  # the stop strings of the request being answered
    call_ids: set = field(default_factory=set)  # every tool-call id this episode gave
    calls: int = 0
    pending: _Turn | None = None  # the request being answered
    answered: _Turn | None = None  # the last request answered
    closed: str | None = None
    ignored: collections.Counter = field(default_factory=collections.Counter)  # since the last step, per field
    lock: threading.Lock = field(default_factory=threading.Lock)
    thread: threading.Thread | None = None

    def request(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        max_tokens: int | None = None,
        stop: Sequence[str] = (),
    ) -> dict:
        """The agent side: one chat request, answered with the policy's turn (blocks until it is sampled)."""
        turn = self.submit(messages, tools, max_tokens, stop=stop)
        turn.done.wait()
        if isinstance(turn.answer, BaseException):
            raise turn.answer
        return _plain(turn.answer, "answer")  # each caller its own copy

    def submit(
        self, messages, tools, max_tokens: int | None = None, ignored: Sequence[str] = (), stop: Sequence[str] = ()
    ) -> _Turn:
        """The turn of a request, answered or not (never blocks). A retry (the same messages, tools, cap and stop
        strings as the request being answered, or as the last one answered) gets that turn, never a second turn;
        another request while one is being answered is refused. ``ignored``: the fields ``ignore_fields`` let
        through (counted for the next step's ``info``)."""
        request = (_plain(messages, "messages"), _plain(tools or [], "tools"), max_tokens, tuple(stop))
        with self.lock:
            if self.closed is not None:
                raise EpisodeOver(f"episode {self.id} is over: {self.closed}")
            turn = self.pending
            if turn is not None and turn.request != request:
                raise AgentRequestError(f"episode {self.id}: one request at a time (the previous one is not answered)")
            if turn is None and self.answered is not None and self.answered.request == request:
                turn = self.answered
            if turn is None:
                turn = self.pending = _Turn(request)
                self.events.put(("request", *request))
            self.ignored.update(ignored)
        return turn

    def take_ignored(self) -> dict[str, int]:
        """The ignored fields counted since the last call (for a step's ``info``)."""
        with self.lock:
            out, self.ignored = dict(self.ignored), collections.Counter()
        return out

    def answer(self, reply: dict, meta: dict | None = None) -> None:
        """The environment side: the policy's turn answers the pending request (and its retries)."""
        with self.lock:
            turn, self.pending = self.pending, None
            self.calls += 1
            if turn is None:
                return
            turn.number, turn.created, self.answered = self.calls, int(time.time()), turn
            turn.meta = dict(meta or {})
        turn.finish(reply)

    def close(self, why: str) -> None:
        with self.lock:
            if self.closed is None:
                self.closed = why
            turn, self.pending = self.pending, None
        if turn is not None:
            turn.finish(EpisodeOver(f"episode {self.id} is over: {self.closed}"))
        self.events.put(("closed", why))


class ChatClient:
    """What the agent function gets: ``chat`` in-process, and the HTTP endpoint for a black-box program."""

    def __init__(self, session: _Session, *, base_url: str | None, model: str):
        self._session = session
        self._base_url = base_url
        self.model = model
        self.episode = session.id
        """The episode's id (not a secret: it names the episode in the endpoint's URL and log lines)."""
        self.api_key = session.key
        """The episode's key, a secret: a black-box program sends it as its OpenAI API key
        (``Authorization: Bearer``)."""

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT/episodes/<id>/v1``: the episode's OpenAI-compatible endpoint (``serve: true``)."""
        if self._base_url is None:
            raise RuntimeError(f"{KEY}.serve is false: no HTTP endpoint; set it to true, or call client.chat")
        return self._base_url

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        max_tokens: int | None = None,
        stop: str | Sequence[str] | None = None,
    ) -> dict:
        """The policy's next turn as an OpenAI assistant message: ``{"role": "assistant", "content": str,
        "tool_calls": [...]}`` (``tool_calls`` only when the turn has ``<tool_call>`` blocks). ``messages`` must
        extend the previous call's messages and its answer (see the module docstring). ``max_tokens`` caps the
        turn below the run's limits (which still apply); ``stop`` (a string or up to 4) ends it where its text
        completes one, the content ending before it."""
        if max_tokens is not None and (
            isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
        ):
            raise ValueError(f"client.chat: max_tokens must be a positive integer, got {max_tokens!r}")
        strings = stop_strings(list(stop) if isinstance(stop, tuple) else stop)
        return self._session.request(messages, tools, max_tokens, strings)

    async def achat(self, messages, tools=None, *, max_tokens: int | None = None, stop=None) -> dict:
        """``chat`` for an ``async`` agent."""
        return await asyncio.to_thread(self.chat, messages, tools, max_tokens=max_tokens, stop=stop)


class AgentEnv:
    """An environment driven by an agent program (see the module docstring).

    Args:
        agent: ``"pkg.module:function"`` (or the function): ``agent(client, row, **agent_kwargs)`` returns the
            episode's reward term (a number, or ``None`` for 0), sync or ``async``.
        agent_kwargs: keyword arguments for every call of ``agent``.
        serve: also serve the OpenAI-compatible endpoint (``client.base_url``).
        host, port: where it listens: loopback by default; port 0 picks a free one.
        model: the model name the endpoint reports.
        limits: the endpoint's limits (:class:`~gspo_mcore.envs.endpoint.EndpointLimits`' fields).
        ignore_fields: request fields the endpoint lets through unhonoured instead of refusing them (names from
            :data:`~gspo_mcore.envs.chat_api.REFUSABLE`, ``n`` excepted): one warning per field per run, counted
            in ``ignored_fields``.
    """

    def __init__(
        self,
        agent: str | Callable[..., Any],
        agent_kwargs: Mapping[str, Any] | None = None,
        *,
        serve: bool = False,
        host: str = "127.0.0.1",
        port: int = 0,
        model: str = "policy",
        limits: Mapping[str, Any] | None = None,
        ignore_fields: Sequence[str] = (),
    ):
        fn = load_object(agent, f"{KEY}.agent") if isinstance(agent, str) else agent
        if not callable(fn):
            raise ValueError(f"{KEY}.agent: {agent!r} is not callable")
        try:
            sig = inspect.signature(fn)
            sig.bind(None, None, **dict(agent_kwargs or {}))
        except TypeError as e:
            raise ValueError(
                f"{KEY}.agent: {agent!r} cannot be called as agent(client, row, **agent_kwargs): {e}"
            ) from e
        except ValueError:
            pass  # no signature (a builtin): called as is
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"{KEY}.port must be an integer in [0, 65535], got {port!r}")
        if isinstance(ignore_fields, str):
            ignore_fields = [ignore_fields]
        honoured = sorted(set(ignore_fields) & {*CAPS, "max_output_tokens", "stop"})
        if honoured:
            raise ValueError(f"{KEY}.ignore_fields: {honoured} are honoured (they limit the turn): leave them out")
        unknown = sorted(set(ignore_fields) - (set(REFUSABLE) - {"n"}))
        if unknown:
            raise ValueError(
                f"{KEY}.ignore_fields: {unknown} cannot be ignored (one of {sorted(set(REFUSABLE) - {'n'})})"
            )
        self.ignore_fields = tuple(ignore_fields)
        self.ignored_fields: collections.Counter[str] = collections.Counter()
        """How many requests had each ignored field set (a warning names each field once)."""
        self._ignored_lock = threading.Lock()
        try:
            endpoint_limits = EndpointLimits(**dict(limits or {}))
        except TypeError as e:
            raise ValueError(f"{KEY}.limits: {e} (fields: {sorted(EndpointLimits.__dataclass_fields__)})") from e
        self.fn, self.agent_kwargs, self.model = fn, dict(agent_kwargs or {}), model
        self.sessions: dict[str, _Session] = {}
        self.ended: collections.OrderedDict[str, _Session] = collections.OrderedDict()
        """The last :data:`ENDED_KEPT` ended episodes (id, key and cause only): a retried request gets 409."""
        self._ids = itertools.count()
        self._prefix = f"ep-{id(self):x}-"
        self.server = None
        if serve:
            try:
                self.server = Endpoint(self, host, port, endpoint_limits)
            except OSError as e:
                raise ValueError(f"{KEY}: cannot listen on {host}:{port} ({e})") from e
            if not _loopback(host):
                logger.warning(
                    "%s.host=%s: the agent endpoint listens beyond loopback; anything that reaches %s can try "
                    "episode keys (keep 127.0.0.1 unless the agents run on another machine)",
                    KEY,
                    host,
                    self.base_url,
                )

    @property
    def base_url(self) -> str | None:
        """The endpoint's root (``/v1/models``); each episode's is ``client.base_url``."""
        if self.server is None:
            return None
        host, port = self.server.address
        return f"http://{host}:{port}/v1"

    def _episode_url(self, session: _Session) -> str | None:
        if self.server is None:
            return None
        host, port = self.server.address
        return f"http://{host}:{port}/episodes/{session.id}/v1"

    # -- the environment ----------------------------------------------------------------------------------
    def reset(self, row: Mapping[str, Any]) -> Reset:
        session = _Session(id=f"{self._prefix}{next(self._ids)}")
        self.sessions[session.id] = session
        client = ChatClient(session, base_url=self._episode_url(session), model=self.model)
        session.thread = threading.Thread(
            target=self._run_agent, args=(session, client, row), daemon=True, name=f"agent-{session.id}"
        )
        session.thread.start()
        event = session.events.get()
        if event[0] != "request":
            self.end_episode(session)
            what = "returned" if event[0] == "finished" else f"failed ({event[1]})"
            raise AgentError(f"{KEY}.agent {what} before its first chat request")
        _, messages, tools, max_tokens, stop = event
        if not messages:
            self.end_episode(session)
            raise AgentRequestError(f"{KEY}.agent: its first request has no messages")
        session.conversation, session.tools, session.stop = [(_canonical(m), False) for m in messages], tools, stop
        return Reset(observation=messages, state=session, tools=tuple(tools), max_new_tokens=max_tokens, stop=stop)

    def step(self, session: _Session, action: str, turn=None) -> Step:
        """Answer the pending request with the policy's turn; ``turn`` (the driver's ``TurnTokens``) gives the
        answer's ``usage``, ``logprobs`` and finish reason. A turn its request's ``stop`` strings ended is answered
        with the text before the first of them."""
        session.reply = _assistant_message(_before_stop(action, session.stop), session.call_ids)
        calls = len(session.reply.get("tool_calls", ()))
        meta = {}
        if turn is not None:
            meta = {
                "prompt_tokens": turn.prompt_tokens,
                "ids": turn.ids,
                "logprobs": turn.logprobs,
                "tokens": turn.tokens,
                "finish_reason": turn.finish_reason,
            }
        session.answer(session.reply, meta)
        event = session.events.get()
        kind = event[0]
        info = {TOOL_CALLS: calls, IGNORED_FIELDS: session.take_ignored()}
        if kind == "finished":
            return Step(done=True, reward=event[1], info=info)
        if kind == "failed":
            raise AgentError(f"the agent failed: {event[1]}")
        if kind == "closed":
            raise EpisodeOver(event[1])
        _, messages, tools, max_tokens, stop = event
        try:
            new = _new_messages(session, messages, tools)
        except AgentRequestError as e:
            session.close(str(e))
            raise
        session.stop = stop
        return Step(observation=new, info=info, max_new_tokens=max_tokens, stop=stop)

    def end_episode(self, session: _Session) -> None:
        """The episode is over (whatever the cause): a call still waiting raises :class:`EpisodeOver`, and so
        does every later request with its key (HTTP 409, however often a client retries it)."""
        session.close("the episode ended")
        if self.sessions.pop(session.id, None) is not None:
            self.ended[session.id] = _Session(id=session.id, key=session.key, closed=session.closed)
            while len(self.ended) > ENDED_KEPT:
                self.ended.popitem(last=False)

    def close(self) -> None:
        """Stop the HTTP endpoint and end every episode still open."""
        for session in list(self.sessions.values()):
            self.end_episode(session)
        if self.server is not None:
            self.server.close()
            self.server = None

    def note_ignored(self, fields: Sequence[str]) -> None:
        """A request set ``fields``, ignored as the run asked (``ignore_fields``): counted, warned once each."""
        with self._ignored_lock:
            new = [f for f in fields if f not in self.ignored_fields]
            self.ignored_fields.update(fields)
        for f in new:
            logger.warning(
                "agent endpoint: a request set %s; ignored as %s.ignore_fields lists it (%s; warned once per run)",
                f,
                KEY,
                REFUSABLE[f],
            )

    def find(self, episode: str) -> _Session | None:
        """The open or recently ended episode named ``episode`` (the endpoint's routes)."""
        return self.sessions.get(episode) or self.ended.get(episode)

    def _run_agent(self, session: _Session, client: ChatClient, row) -> None:
        try:
            if inspect.iscoroutinefunction(self.fn):
                value = asyncio.run(self.fn(client, row, **self.agent_kwargs))
            else:
                value = self.fn(client, row, **self.agent_kwargs)
            if value is None:
                value = 0.0
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"the agent returned {type(value).__name__}, not a number (its reward term)")
            session.events.put(("finished", float(value)))
        except EpisodeOver as e:
            session.events.put(("closed", str(e)))
        except Exception as e:  # noqa: BLE001 - the agent's failure ends its episode, counted
            session.events.put(("failed", f"{type(e).__name__}: {e}"))


def _assistant_message(text: str, used: set) -> dict:
    """The policy's turn as an OpenAI assistant message: ``<tool_call>`` blocks become ``tool_calls`` (a
    malformed block stays in the content, for the agent to see). Each call's id is ``call_`` + 24 random hex
    digits, none of the episode's ``used`` ids (added to it): clients key tool results and completed calls by
    id (the Agents SDK refuses an id reused for another call)."""
    parsed = parse_tool_calls(text)
    calls = [c for c in parsed if isinstance(c, ToolCall)]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls and len(calls) == len(parsed):
        message["content"] = re.sub(_CALL_BLOCK, "", text, flags=re.DOTALL).strip()
        message["tool_calls"] = [
            {
                "id": _call_id(used),
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for c in calls
        ]
    return message


def _before_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` up to the first place one of the ``stop`` strings starts (all of it when none is in it): what a
    turn its stop strings ended answers (the engine kept the token that completed the string, whose text may go
    past it; the ids trained on are those sampled, the text shown ends before the string, as OpenAI's does)."""
    at = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
    return text[:at]


def _call_id(used: set) -> str:
    while (new := f"call_{secrets.token_hex(12)}") in used:
        pass
    used.add(new)
    return new


def _new_messages(session: _Session, messages: list, tools: list) -> list:
    """The messages a request adds after the last answer (the conversation grows by them);
    :class:`AgentRequestError` naming the message, the field and both values if it does not extend it."""
    if tools != session.tools:
        raise AgentRequestError("the request changed its tools (the prompt already rendered them)")
    conversation = [*session.conversation, (_canonical(session.reply), _is_empty(session.reply))]
    k = 0
    for want, optional in conversation:
        got = _canonical(messages[k]) if k < len(messages) else None
        if got == want:
            k += 1
        elif not optional:  # an empty answer a client left out is skipped; anything else is an edit
            if got is None:
                break
            raise AgentRequestError(f"the request does not extend the conversation: {_difference(k, want, got)}")
    if k >= len(messages):
        raise AgentRequestError(
            f"the request does not extend the conversation: it has {len(messages)} messages, none new after the "
            "conversation so far (its messages, the assistant's answers, then something new)"
        )
    session.conversation = conversation + [(_canonical(m), False) for m in messages[k:]]
    return messages[k:]


# What clients add to an assistant message they re-send, never part of the answer: the speaker's ``name``
# (LangChain's AIMessage.name); other fields count only when they hold something (``refusal``, ``annotations``,
# ``audio``, ``function_call`` as None or empty from the openai SDK's model_dump(), litellm's ``function_call``).
_ANSWER_IGNORED = ("name",)
_REASONING = ("reasoning_content", "reasoning")  # litellm; vLLM, OpenRouter
_THINK = re.compile(r"\s*<think>(.*?)</think>(.*)", re.DOTALL)


def _canonical(message: Mapping[str, Any]) -> dict:
    """What a history message is compared by: its fields holding something, content as text (text parts
    joined, None or absent as ""), tool calls as (id, name, arguments as JSON). For an assistant message: the
    reasoning a client split off (``reasoning_content`` / ``reasoning``) merged back into the
    ``<think>`` block, the think block and the text each compared without surrounding whitespace, and the
    fields clients add left out."""
    if not isinstance(message, Mapping):
        return {"role": None, "message": message}
    out = {k: v for k, v in message.items() if v not in (None, "", [], {}) and k not in ("content", "tool_calls")}
    out["role"] = message.get("role")
    content = _text(message.get("content"))
    if out["role"] == "assistant":
        reasoning = next((out[k] for k in _REASONING if k in out), None)
        for k in (*_REASONING, *_ANSWER_IGNORED):
            out.pop(k, None)
        content = _with_think(reasoning, content)
    out["content"] = content
    calls = [_call(c) for c in message.get("tool_calls") or ()]
    if calls:
        out["tool_calls"] = calls
    return out


def _text(content):
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    return content


def _with_think(reasoning, content):
    """``<think>reasoning</think>text``, each part stripped (an empty think block is no think block)."""
    if not isinstance(content, str):
        return content
    if not isinstance(reasoning, str):
        parsed = _THINK.match(content)
        reasoning, content = parsed.groups() if parsed else (None, content)
    think = (reasoning or "").strip()
    return f"<think>{think}</think>{content.strip()}" if think else content.strip()


def _call(c) -> dict:
    if not isinstance(c, Mapping):
        return {"call": c}
    fn = c.get("function") if isinstance(c.get("function"), Mapping) else {}
    args = fn.get("arguments")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        pass
    return {"id": c.get("id"), "name": fn.get("name"), "arguments": args}


def _is_empty(reply: Mapping[str, Any]) -> bool:
    """An answer with no text and no tool calls (the Agents SDK leaves it out of the history it re-sends)."""
    return not reply.get("tool_calls") and not str(reply.get("content") or "").strip()


def _difference(k: int, want: dict, got: dict) -> str:
    """The first field of message ``k`` whose value changed, with both values."""
    was = "answered" if want["role"] == "assistant" else "before"
    name = next(f for f in ("role", "content", "tool_calls", *want, *got) if want.get(f) != got.get(f))
    return f"message {k} ({got.get('role')}) differs in {name}: {want.get(name)!r} {was}, {got.get(name)!r} now"


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _plain(value, what: str):
    """A JSON round trip: the agent's objects become plain data it cannot change behind our back."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise AgentRequestError(f"the request's {what} are not JSON ({e})") from e
