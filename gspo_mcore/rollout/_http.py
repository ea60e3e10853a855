"""The rollout's HTTP client: JSON in, bytes out, on aiohttp's pooled connections.

- **Pooled keep-alive connections.** Each event loop gets one ``aiohttp.ClientSession`` whose connector keeps idle
  connections to every server open for :data:`KEEPALIVE_S` (below uvicorn's 5 s, SGLang's server, so the client
  drops an idle connection before the server does and never sends a request into one the server is closing).
  There is no cap on connections: the callers bound their own concurrency (``max_inflight_per_server``).
- **A per-request timeout that really cancels.** ``timeout_s`` covers the whole exchange (waiting for a
  connection, sending, the status, the whole body); when it expires the request is cancelled and its connection
  closed, not returned to the pool.
- **Transport failures told apart from HTTP statuses.** No complete response raises :class:`TransportError`
  (``kind`` says which failure); any complete response, whatever its status, is returned.

The session of a loop is closed by :func:`close_pool`, or, for a loop run by ``asyncio.run``, when that loop
shuts down (a small async generator holds it open, and ``asyncio.run`` closes every async generator before it
closes the loop), so a background ``asyncio.run(engine.generate(...))`` leaves nothing open. Plain ``http://``
only: the engines listen on loopback or a cluster network.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.parse
import weakref
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import aiohttp

KEEPALIVE_S = 3.0
"""How long an idle pooled connection is kept (uvicorn, which serves SGLang, closes idle ones after 5 s)."""


class TransportError(Exception):
    """No complete HTTP response: the connection failed, timed out, or the response was cut short.

    ``kind`` is one of ``"connect"``, ``"timeout"``, ``"closed"`` (closed before a complete status and headers),
    ``"truncated"`` (closed mid-body) or ``"protocol"`` (not HTTP).
    """

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class HttpResponse:
    status: int
    headers: dict[str, str]  # lower-cased names
    body: bytes

    def text(self, limit: int = 500) -> str:
        """The body as text, shortened to ``limit`` characters, for error messages."""
        s = self.body.decode("utf-8", errors="replace")
        return s if len(s) <= limit else s[:limit] + f"... ({len(s)} chars)"


class _Pool:
    """One event loop's session, held open by an async generator that the loop's shutdown closes."""

    def __init__(self, session: aiohttp.ClientSession):
        self.session = session
        self.holder: AsyncIterator[None] | None = None


_pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Pool] = weakref.WeakKeyDictionary()
_pools_lock = threading.Lock()  # loops in other threads (a background asyncio.run) share the table


async def _hold(session: aiohttp.ClientSession) -> AsyncIterator[None]:
    try:
        yield
    finally:
        await session.close()


async def _session() -> aiohttp.ClientSession:
    loop = asyncio.get_running_loop()
    with _pools_lock:
        pool = _pools.get(loop)
        if pool is not None and not pool.session.closed:
            return pool.session
        for other in [lp for lp in _pools if lp.is_closed()]:  # loops that ended (and closed their sessions)
            _pools.pop(other, None)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
        pool = _Pool(aiohttp.ClientSession(connector=connector, auto_decompress=False, trust_env=False))
        _pools[loop] = pool
    pool.holder = _hold(pool.session)
    await anext(pool.holder)  # from now on the loop's shutdown_asyncgens() closes the session
    return pool.session


async def close_pool() -> None:
    """Close the running loop's pooled connections (a later request opens new ones)."""
    with _pools_lock:
        pool = _pools.pop(asyncio.get_running_loop(), None)
    if pool is not None:
        await pool.session.close()
        if pool.holder is not None:
            await pool.holder.aclose()


async def request(
    method: str,
    url: str,
    payload=None,
    *,
    timeout_s: float,
    connect_timeout_s: float | None = None,
    headers: Mapping[str, str] | None = None,
) -> HttpResponse:
    """Send ``payload`` (JSON-encoded, if not None) with ``headers`` and return the response.

    Raises :class:`TransportError` if no complete response arrives within ``timeout_s`` seconds (opening the
    connection within ``connect_timeout_s``, default ``timeout_s``).
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"only http:// URLs are supported, got {url!r}")
    where = f"{parts.hostname}:{parts.port or 80}"
    connect_timeout_s = timeout_s if connect_timeout_s is None else min(connect_timeout_s, timeout_s)
    send = {"Accept": "application/json", **(headers or {})}
    data = None
    if payload is not None:
        data = json.dumps(payload, separators=(",", ":")).encode()
        send["Content-Type"] = "application/json"
    session = await _session()
    try:
        async with asyncio.timeout(timeout_s):
            async with session.request(
                method,
                url,
                data=data,
                headers=send,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s),
                allow_redirects=False,
            ) as resp:
                body = await _read_body(resp)
                return HttpResponse(resp.status, {k.lower(): v for k, v in resp.headers.items()}, body)
    except aiohttp.ConnectionTimeoutError:
        raise TransportError("timeout", f"connecting to {where} timed out after {connect_timeout_s:g}s") from None
    except TimeoutError:
        raise TransportError("timeout", f"no complete response within {timeout_s:g}s") from None
    except aiohttp.ClientConnectorError as e:
        raise TransportError("connect", f"cannot connect to {where}: {e.os_error.strerror or e.os_error}") from None
    except aiohttp.ServerDisconnectedError:
        raise TransportError("closed", "connection closed before a complete response") from None
    except aiohttp.ClientOSError as e:
        raise TransportError("closed", f"connection lost: {e.strerror or e}") from None
    except aiohttp.ClientResponseError as e:  # the response could not be parsed as HTTP
        raise TransportError("protocol", f"not an HTTP response: {e.message}") from None
    except aiohttp.ClientError as e:
        raise TransportError("protocol", f"{type(e).__name__}: {e}") from None


async def _read_body(resp: aiohttp.ClientResponse) -> bytes:
    chunks: list[bytes] = []
    try:
        async for chunk in resp.content.iter_any():
            chunks.append(chunk)
    except aiohttp.ClientPayloadError:
        got = sum(map(len, chunks))
        of = f" of {resp.content_length}" if resp.content_length is not None else ""
        raise TransportError("truncated", f"response truncated: got {got}{of} body bytes") from None
    return b"".join(chunks)
