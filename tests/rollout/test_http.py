"""The rollout's HTTP client (rollout/_http.py) against small real aiohttp servers on loopback."""

from __future__ import annotations

import asyncio
import gc
import socket
import time
import warnings

import pytest
from aiohttp import web

from gspo_mcore.rollout import _http


class Peer:
    """An aiohttp server that records the client port of every request (one port = one connection)."""

    def __init__(self):
        self.ports: list[int] = []
        self.cancelled = asyncio.Event()
        app = web.Application()
        app.router.add_post("/echo", self.echo)
        app.router.add_get("/status/{code}", self.status)
        app.router.add_get("/hang", self.hang)
        self.runner = web.AppRunner(app)

    async def start(self) -> str:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def echo(self, request: web.Request):
        self.ports.append(request.transport.get_extra_info("peername")[1])
        return web.json_response({"got": await request.json(), "key": request.headers.get("X-Key")})

    async def status(self, request: web.Request):
        return web.json_response({"error": "told to"}, status=int(request.match_info["code"]))

    async def hang(self, request: web.Request):
        for _ in range(200):  # watch the connection for 10 s
            if request.transport is None or request.transport.is_closing():
                self.cancelled.set()  # the client closed it
                break
            await asyncio.sleep(0.05)
        return web.Response()


def test_requests_reuse_pooled_connections_and_carry_headers():
    async def main():
        peer = Peer()
        url = await peer.start()
        try:
            for i in range(5):
                resp = await _http.request("POST", url + "/echo", {"i": i}, timeout_s=5, headers={"X-Key": "ep7"})
                assert resp.status == 200 and b'"key": "ep7"' in resp.body and f'"i": {i}'.encode() in resp.body
            assert len(set(peer.ports)) == 1, f"sequential requests used {len(set(peer.ports))} connections"
            await asyncio.gather(*(_http.request("POST", url + "/echo", {}, timeout_s=5) for _ in range(8)))
            assert len(set(peer.ports)) > 1  # concurrent requests open more connections (no global cap)
        finally:
            await _http.close_pool()
            await peer.runner.cleanup()

    asyncio.run(main())


def test_http_status_is_returned_not_raised():
    async def main():
        peer = Peer()
        url = await peer.start()
        try:
            resp = await _http.request("GET", url + "/status/503", timeout_s=5)
            assert resp.status == 503 and "told to" in resp.text()
        finally:
            await peer.runner.cleanup()

    asyncio.run(main())


def test_timeout_really_cancels_the_request():
    async def main():
        peer = Peer()
        url = await peer.start()
        try:
            t0 = time.monotonic()
            with pytest.raises(_http.TransportError, match=r"no complete response within 0.3s") as err:
                await _http.request("GET", url + "/hang", timeout_s=0.3)
            assert err.value.kind == "timeout" and time.monotonic() - t0 < 2
            await asyncio.wait_for(peer.cancelled.wait(), 5)  # the server saw the connection close
        finally:
            await peer.runner.cleanup()

    asyncio.run(main())


def test_connection_refused_is_a_connect_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(_http.TransportError, match=rf"cannot connect to 127.0.0.1:{port}") as err:
        asyncio.run(_http.request("GET", f"http://127.0.0.1:{port}/x", timeout_s=5))
    assert err.value.kind == "connect"


def test_asyncio_run_closes_its_loops_session_without_warnings():
    async def main():
        peer = Peer()
        url = await peer.start()
        try:
            await _http.request("POST", url + "/echo", {}, timeout_s=5)
            return await _http._session()
        finally:
            await peer.runner.cleanup()

    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        session = asyncio.run(main())
        assert session.closed
        del session
        gc.collect()


def test_only_http_urls():
    with pytest.raises(ValueError, match="only http://"):
        asyncio.run(_http.request("GET", "https://example.invalid/", timeout_s=1))
