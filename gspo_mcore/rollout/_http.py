"""A minimal asyncio HTTP/1.1 client (JSON in, bytes out) on the standard library only.

One connection per request (``Connection: close``), a hard wall-clock timeout over the whole exchange
that really cancels it (no thread left blocked on a socket), and transport failures told apart from
HTTP statuses so the caller can decide what to retry. Plain ``http://`` only: the engines it talks to
listen on loopback or a cluster network.
"""

from __future__ import annotations

import asyncio
import json
import urllib.parse
from dataclasses import dataclass

_MAX_HEADER_BYTES = 64 * 1024


class TransportError(Exception):
    """No complete HTTP response: the connection failed, timed out, or the response was cut short.

    ``kind`` is one of ``"connect"``, ``"timeout"``, ``"closed"`` (closed before a status line),
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


async def request(
    method: str,
    url: str,
    payload=None,
    *,
    timeout_s: float,
    connect_timeout_s: float | None = None,
) -> HttpResponse:
    """Send ``payload`` (JSON-encoded, if not None) and return the response.

    Raises :class:`TransportError` if no complete response arrives within ``timeout_s`` seconds.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"only http:// URLs are supported, got {url!r}")
    host, port = parts.hostname, parts.port or 80
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    body = b"" if payload is None else json.dumps(payload, separators=(",", ":")).encode()
    head = [
        f"{method} {target} HTTP/1.1",
        f"Host: {parts.netloc}",
        "Accept: application/json",
        "Connection: close",
        f"Content-Length: {len(body)}",
    ]
    if payload is not None:
        head.append("Content-Type: application/json")
    raw = ("\r\n".join(head) + "\r\n\r\n").encode() + body

    connect_timeout_s = timeout_s if connect_timeout_s is None else min(connect_timeout_s, timeout_s)
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), connect_timeout_s)
    except TimeoutError:
        raise TransportError("timeout", f"connecting to {host}:{port} timed out after {connect_timeout_s:g}s") from None
    except OSError as e:
        raise TransportError("connect", f"cannot connect to {host}:{port}: {e.strerror or e}") from None
    try:
        async with asyncio.timeout(timeout_s):
            writer.write(raw)
            await writer.drain()
            return await _read_response(reader)
    except TimeoutError:
        raise TransportError("timeout", f"no complete response within {timeout_s:g}s") from None
    except (ConnectionError, OSError) as e:
        raise TransportError("closed", f"connection lost: {e}") from None
    finally:
        writer.close()
        try:
            await asyncio.wait_for(writer.wait_closed(), 1.0)
        except (TimeoutError, OSError, asyncio.CancelledError):
            pass


async def _read_response(reader: asyncio.StreamReader) -> HttpResponse:
    status_line = await reader.readline()
    if not status_line:
        raise TransportError("closed", "connection closed before any response")
    fields = status_line.decode("latin-1").split(None, 2)
    if len(fields) < 2 or not fields[0].startswith("HTTP/") or not fields[1].isdigit():
        raise TransportError("protocol", f"not an HTTP status line: {status_line[:100]!r}")
    status = int(fields[1])

    headers: dict[str, str] = {}
    size = 0
    while True:
        line = await reader.readline()
        size += len(line)
        if size > _MAX_HEADER_BYTES:
            raise TransportError("protocol", "response headers too large")
        if not line.endswith(b"\n"):
            raise TransportError("truncated", "connection closed inside the response headers")
        line = line.rstrip(b"\r\n")
        if not line:
            break
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()

    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = await _read_chunked(reader)
    elif "content-length" in headers:
        try:
            length = int(headers["content-length"])
        except ValueError:
            raise TransportError("protocol", f"bad Content-Length {headers['content-length']!r}") from None
        try:
            body = await reader.readexactly(length)
        except asyncio.IncompleteReadError as e:
            raise TransportError(
                "truncated", f"response truncated: got {len(e.partial)} of {length} body bytes"
            ) from None
    else:
        body = await reader.read()  # delimited by the server closing the connection
    return HttpResponse(status, headers, body)


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    chunks = []
    try:
        while True:
            size_line = await reader.readline()
            if not size_line.endswith(b"\n"):
                raise TransportError("truncated", "response truncated inside a chunked body")
            try:
                size = int(size_line.split(b";")[0].strip(), 16)
            except ValueError:
                raise TransportError("protocol", f"bad chunk size line {size_line[:50]!r}") from None
            if size == 0:
                while (await reader.readline()).strip():  # trailers
                    pass
                return b"".join(chunks)
            chunks.append(await reader.readexactly(size))
            await reader.readexactly(2)  # CRLF after each chunk
    except asyncio.IncompleteReadError:
        raise TransportError("truncated", "response truncated inside a chunked body") from None
