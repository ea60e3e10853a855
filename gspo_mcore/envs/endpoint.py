"""The agent endpoint's HTTP server: aiohttp.web on a thread and event loop of its own.

It serves :class:`~gspo_mcore.envs.agent.AgentEnv`'s episodes as OpenAI's API: ``GET /v1/models`` (and each
episode's ``/episodes/<id>/v1/models``), ``POST /episodes/<id>/v1/chat/completions`` and ``/v1/responses`` (both
streamed as server-sent events with ``stream: true``). This module owns
the HTTP side only: routes, the episode's key, the limits (:class:`EndpointLimits`), reading the body, and
writing answers and refusals. What a chat request means (its fields, the answer's shape) is
:mod:`gspo_mcore.envs.chat_api`; the episode it talks to is the ``AgentEnv`` session.

Every refusal is an OpenAI error body, ``{"error": {"message", "type", "code", "param"}}``, never a
traceback: a malformed request line or header (aiohttp's parser), a ``Content-Length`` that is negative or over
``max_body_bytes`` (refused before any of the body is read), a body slower than ``read_timeout_s``, JSON that
is not an object or nests deeper than ``max_json_depth``, an unknown route, a missing or wrong key, a field
the trainer cannot honour, a request after the episode ended. A connection idle for ``idle_timeout_s`` (one
that never sends a request included) is closed; connections beyond ``max_connections`` are closed as they
open; :meth:`Endpoint.close` closes every connection. A client that hangs up before its answer is logged at
INFO (its retry gets the answer).

Why aiohttp (see docs/agents.md): it serves and pools on one event loop (thousands of waiting agent requests
cost no thread each), streams server-sent events, has its own limits (keep-alive timeout from the first byte,
header size caps, a strict parser), and one library can serve both HTTP sides of the trainer (its client pools
connections for SGLang).
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import json
import logging
import re
import threading
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gspo_mcore.envs import chat_api, responses_api

logger = logging.getLogger("gspo_mcore.envs.agent")

_CHAT = re.compile(r"/episodes/([^/]+)/v1/(chat/completions|responses)")
RESPONSES_KEPT = 65536
"""How many answered Responses-API responses are kept (for ``previous_response_id``), oldest dropped first."""
_MODELS = re.compile(r"(/episodes/[^/]+)?/v1/models")
_LINGER_S = 1.0
"""How long the body of a refused request is still read (and dropped) so that its client gets the answer
before the connection closes."""


@dataclass(frozen=True)
class EndpointLimits:
    """The endpoint's limits (``rollout.env_kwargs.limits``; every field optional)."""

    max_body_bytes: int = 8 * 2**20
    """The largest request body (bytes); a larger ``Content-Length`` is refused (413) before it is read."""
    max_json_depth: int = 64
    """The deepest nesting of objects and lists a body may have (a chat request needs about 8)."""
    read_timeout_s: float = 60.0
    """How long reading one request's body may take (408 after it)."""
    idle_timeout_s: float = 300.0
    """How long a connection may stay idle (before its first request too) before it is closed."""
    max_connections: int = 4096
    """Open connections at most; one more is closed as it opens (agents keep about one each)."""
    close_timeout_s: float = 2.0
    """How long ``close()`` waits for requests still being answered before it drops them."""

    def __post_init__(self):
        for name in ("max_body_bytes", "max_json_depth", "max_connections"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"rollout.env_kwargs.limits.{name} must be a positive integer, got {v!r}")
        for name in ("read_timeout_s", "idle_timeout_s", "close_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"rollout.env_kwargs.limits.{name} must be a positive number, got {v!r}")


class Refused(Exception):
    """A request the endpoint answers with an OpenAI error body."""

    TYPES = {401: "invalid_request_error", 500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def response(self) -> web.Response:
        kind = self.TYPES.get(self.status, "invalid_request_error")
        body = {"error": {"message": self.message, "type": kind, "code": self.code, "param": self.param}}
        return web.json_response(body, status=self.status)


class _Handler(web.RequestHandler):
    """aiohttp's connection handler with the endpoint's connection cap and its own error bodies."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        cap = self._manager.endpoint_limits.max_connections
        if len(self._manager.connections) > cap:
            logger.warning("agent endpoint: %d connections open (max_connections): closed a new one", cap)
            transport.close()

    def handle_error(self, request, status: int = 500, exc=None, message=None) -> web.StreamResponse:
        """A request aiohttp's parser refused (a bad request line, header or Content-Length): one INFO line and
        an OpenAI error body, never a traceback."""
        logger.info("agent endpoint: refused a malformed request (%s): %s", status, exc or message)
        what = f"{type(exc).__name__}: {exc}" if exc is not None else message or "malformed request"
        resp = Refused(status, f"malformed HTTP request ({what})", code="malformed_request").response()
        resp.force_close()
        return resp


class _Server(web.Server):
    def __init__(self, *args, limits: EndpointLimits, **kwargs):
        super().__init__(*args, **kwargs)
        self.endpoint_limits = limits

    def __call__(self) -> _Handler:
        return _Handler(self, loop=self._loop, **self._kwargs)


class Endpoint:
    """The OpenAI-compatible server for ``env`` (an ``AgentEnv``): listening once constructed, until
    :meth:`close`.

    ``env`` provides ``model`` (the name reported), ``find(episode_id)`` (the open or recently ended session,
    or ``None``), ``ignore_fields`` and ``note_ignored(fields)`` (request fields let through, and counting
    them). A session provides ``id``, ``key``, ``submit(messages, tools, max_tokens, ignored, stop=)`` (the request's
    :class:`~gspo_mcore.envs.agent._Turn`, whose ``when_done(callback)`` calls back from any thread). An
    exception with ``http_status`` and ``http_code`` (and maybe ``param``) is answered with them.
    """

    def __init__(self, env, host: str, port: int, limits: EndpointLimits | None = None):
        self.env, self.limits = env, limits or EndpointLimits()
        self._responses: collections.OrderedDict[str, list] = collections.OrderedDict()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="agent-endpoint")
        self._thread.start()
        try:
            self.address = self._call(self._start(host, port))
        except BaseException:
            self._stop_loop()
            raise

    def _call(self, coro, timeout: float | None = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start(self, host: str, port: int) -> tuple[str, int]:
        server = _Server(
            self._handle,
            limits=self.limits,
            handler_cancellation=True,  # a client that hangs up cancels its handler (its turn stays pending)
            keepalive_timeout=self.limits.idle_timeout_s,
            lingering_time=_LINGER_S,
            access_log=None,
        )
        self._runner = web.ServerRunner(server, shutdown_timeout=self.limits.close_timeout_s)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        return tuple(self._runner.addresses[0][:2])

    @property
    def connections(self) -> int:
        """Open connections now."""
        return len(self._runner.server.connections) if self._runner.server is not None else 0

    def close(self) -> None:
        """Stop listening and close every connection (requests still waiting get ``close_timeout_s``)."""
        if self._thread is None:
            return
        try:
            self._call(self._runner.cleanup(), timeout=self.limits.close_timeout_s + 30)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()
        self._thread = None

    # -- requests ------------------------------------------------------------------------------------------
    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        try:
            return await self._route(request)
        except Refused as e:
            response = e.response()
        except asyncio.CancelledError:
            logger.info("agent endpoint: %s: the client hung up before its answer", request.path)
            raise
        except Exception as e:  # noqa: BLE001 - a bug answers 500 with its cause, never a traceback to the client
            logger.exception("agent endpoint: %s %s failed", request.method, request.path)
            response = Refused(500, f"the endpoint failed: {type(e).__name__}: {e}", code="server_error").response()
        if request.content_length and not request.content.at_eof():
            response.force_close()  # the body was not read: the connection cannot carry another request
        return response

    async def _route(self, request: web.BaseRequest) -> web.StreamResponse:
        path = request.path.rstrip("/")
        if request.method == "GET" and _MODELS.fullmatch(path):
            return web.json_response({"object": "list", "data": [{"id": self.env.model, "object": "model"}]})
        route = _CHAT.fullmatch(path)
        if request.method != "POST" or route is None:
            raise Refused(
                404,
                f"no route {request.method} {request.path}; use the episode's client.base_url + /chat/completions "
                "(or /responses)",
                code="unknown_route",
            )
        session = self.env.find(route.group(1))
        if session is None:
            raise Refused(404, f"no open episode {route.group(1)!r}", code="unknown_episode")
        self._check_key(request, session)
        body = await self._read_json(request)
        try:
            if route.group(2) == "responses":
                chat = responses_api.parse_request(body, self.env.ignore_fields, self._previous(session.id))
            else:
                chat = chat_api.parse_request(body, self.env.ignore_fields)
            turn = session.submit(chat.messages, chat.tools, chat.max_tokens, chat.ignored, stop=chat.stop)
            if chat.ignored:
                self.env.note_ignored(chat.ignored)
            await _done(turn)
            if isinstance(turn.answer, BaseException):
                raise turn.answer
        except Exception as e:
            status = getattr(e, "http_status", None)
            if status is None:
                raise
            raise Refused(status, str(e), code=e.http_code, param=getattr(e, "param", None)) from None
        if route.group(2) == "responses":
            rid = responses_api.response_id(session.id, turn)
            self._responses[rid] = [*chat.messages, turn.answer]
            while len(self._responses) > RESPONSES_KEPT:
                self._responses.popitem(last=False)
            if chat.stream:
                events = responses_api.events(self.env.model, session.id, turn, chat, body)
                return await self._stream(request, events, named=True)
            return web.json_response(responses_api.response(self.env.model, session.id, turn, chat, body))
        if chat.stream:
            return await self._stream(request, chat_api.chunks(self.env.model, session.id, turn, chat))
        return web.json_response(chat_api.completion(self.env.model, session.id, turn, chat))

    async def _stream(self, request: web.BaseRequest, events: list[dict], named: bool = False) -> web.StreamResponse:
        """Server-sent events: chat completions' chunks as ``data: {json}``, then ``data: [DONE]``; with ``named``
        (the Responses API) each event as ``event: <its type>`` and ``data: {json}``, no ``[DONE]``."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            await response.prepare(request)
            for event in events:
                head = f"event: {event['type']}\n".encode() if named else b""
                await response.write(head + b"data: " + json.dumps(event).encode() + b"\n\n")
            if not named:
                await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionError:
            logger.info("agent endpoint: %s: the client hung up during its stream", request.path)
        return response

    def _previous(self, episode: str):
        def find(rid):
            if not isinstance(rid, str) or not rid.startswith(f"resp_{episode}_"):
                return None
            return self._responses.get(rid)

        return find

    def _check_key(self, request: web.BaseRequest, session) -> None:
        header = request.headers.get("Authorization", "")
        key = header[len("Bearer ") :].strip() if header.startswith("Bearer ") else ""
        if not hmac.compare_digest(key.encode(), session.key.encode()):
            why = "another key than its own" if key else "no API key"
            logger.warning("agent endpoint: episode %s: refused a request with %s", session.id, why)
            raise Refused(
                401, f"episode {session.id}: {why}; send the episode's client.api_key", code="invalid_api_key"
            )

    async def _read_json(self, request: web.BaseRequest) -> Any:
        cap = self.limits.max_body_bytes
        if request.content_length is not None and request.content_length > cap:
            raise Refused(
                413,
                f"the body has {request.content_length} bytes, over max_body_bytes={cap}",
                code="request_too_large",
            )
        data = bytearray()
        try:
            async with asyncio.timeout(self.limits.read_timeout_s):
                while chunk := await request.content.readany():
                    data += chunk
                    if len(data) > cap:
                        raise Refused(413, f"the body is over max_body_bytes={cap}", code="request_too_large")
        except TimeoutError:
            raise Refused(
                408, f"the body took longer than read_timeout_s={self.limits.read_timeout_s}", code="timeout"
            ) from None
        try:
            body = json.loads(data or b"{}")
        except RecursionError:
            body = None  # deeper than the parser's recursion limit
        except ValueError as e:
            raise Refused(400, f"the body is not JSON ({e})", code="invalid_json") from None
        if body is None or _deeper(body, self.limits.max_json_depth):
            raise Refused(
                400, f"the body nests deeper than max_json_depth={self.limits.max_json_depth}", code="too_deep"
            )
        return body


async def _done(turn) -> None:
    """Wait for a turn's answer without holding a thread (the environment answers from its own)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def wake():
        loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

    turn.when_done(wake)
    await done


def _deeper(value, limit: int) -> bool:
    """Whether parsed JSON nests objects and lists deeper than ``limit`` (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            if d > limit:
                return True
            stack += [(c, d + 1) for c in (v.values() if isinstance(v, dict) else v)]
    return False
