"""The agent endpoint's HTTP limits (gspo_mcore/envs/endpoint.py): every refusal an OpenAI error body, never a
traceback; bodies, nesting, idle and slow connections bounded; close() closes every connection."""

import json
import socket
import time

import pytest

from gspo_mcore.envs.agent import _Session
from gspo_mcore.envs.endpoint import Endpoint, EndpointLimits


class _Env:
    """One open episode, ``ep``, whose requests nobody answers (the limits refuse before they reach it)."""

    model = "policy"
    ignore_fields = ()

    def __init__(self):
        self.session = _Session(id="ep")

    def find(self, episode):
        return self.session if episode == "ep" else None


@pytest.fixture
def endpoint():
    made = []

    def make(**limits):
        env = _Env()
        made.append(Endpoint(env, "127.0.0.1", 0, EndpointLimits(**limits)))
        return made[-1], env.session

    yield make
    for e in made:
        e.close()


def _connect(endpoint):
    return socket.create_connection(endpoint.address, timeout=10)


def _request(endpoint, head: str, body: bytes = b"", key: str | None = None) -> tuple[int, dict]:
    """Send a raw request (``head``: its request line and headers), read the answer to its end."""
    conn = _connect(endpoint)
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    conn.sendall(f"{head}\r\nHost: x\r\n{auth}Connection: close\r\n\r\n".encode() + body)
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    conn.close()
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


def _is_openai_error(body: dict, code: str) -> str:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "code", "param"}, body
    assert body["error"]["code"] == code, body
    return body["error"]["message"]


def test_a_body_over_the_cap_is_refused_before_it_is_read(endpoint, capfd):
    """A 40 MB Content-Length: 413 at once, with nothing of the body sent (the server never waits for it)."""
    ep, session = endpoint()
    start = time.monotonic()
    status, body = _request(
        ep, "POST /episodes/ep/v1/chat/completions HTTP/1.1\r\nContent-Length: 41943040", key=session.key
    )
    assert status == 413 and "over max_body_bytes=8388608" in _is_openai_error(body, "request_too_large")
    assert time.monotonic() - start < 5
    # a chunked body has no length: cut when it passes the cap
    small, session = endpoint(max_body_bytes=1000)
    chunk = b"x" * 600
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(3)) + b"0\r\n\r\n"
    status, body = _request(
        small, "POST /episodes/ep/v1/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked", chunked, session.key
    )
    assert status == 413 and "over max_body_bytes=1000" in _is_openai_error(body, "request_too_large")
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("length", ["-1", "abc", "1" * 40])
def test_a_bad_content_length_is_an_openai_error_not_a_traceback(endpoint, length, capfd):
    ep, session = endpoint()
    status, body = _request(
        ep, f"POST /episodes/ep/v1/chat/completions HTTP/1.1\r\nContent-Length: {length}", key=session.key
    )
    assert status in (400, 413), (status, body)
    _is_openai_error(body, "malformed_request" if status == 400 else "request_too_large")
    assert "Traceback" not in capfd.readouterr().err


def test_deeply_nested_json_is_refused(endpoint):
    ep, session = endpoint()
    for depth in (65, 100_000):  # past the limit; past the standard parser's recursion limit
        data = b"[" * depth + b"]" * depth
        status, body = _request(
            ep, f"POST /episodes/ep/v1/chat/completions HTTP/1.1\r\nContent-Length: {len(data)}", data, session.key
        )
        assert status == 400 and "max_json_depth=64" in _is_openai_error(body, "too_deep"), body
    data = b'{"messages": [{"role": "user", "content": "x"}], "tools": ' + b"[" * 40 + b"]" * 40 + b"}"
    status, body = _request(
        ep, f"POST /episodes/ep/v1/chat/completions HTTP/1.1\r\nContent-Length: {len(data)}", data, session.key
    )
    assert status == 400 and body["error"]["code"] != "too_deep", body  # within the limit: parsed, then checked


@pytest.mark.parametrize(
    "head, body, status, code",
    [
        ("GET /v1/nothing HTTP/1.1", b"", 404, "unknown_route"),
        ("POST /episodes/other/v1/chat/completions HTTP/1.1\r\nContent-Length: 2", b"{}", 404, "unknown_episode"),
        ("POST /episodes/ep/v1/chat/completions HTTP/1.1\r\nContent-Length: 2", b"{}", 401, "invalid_api_key"),
        ("BROKEN LINE", b"", 400, "malformed_request"),
    ],
    ids=["route", "episode", "key", "request-line"],
)
def test_every_refusal_is_an_openai_error_body(endpoint, head, body, status, code):
    ep, _ = endpoint()
    got, answer = _request(ep, head, body)
    assert got == status
    _is_openai_error(answer, code)


def test_malformed_json_and_a_slow_body_are_refused(endpoint):
    ep, session = endpoint(read_timeout_s=0.5)
    status, body = _request(
        ep, "POST /episodes/ep/v1/chat/completions HTTP/1.1\r\nContent-Length: 5", b"{nope", session.key
    )
    assert status == 400 and "not JSON" in _is_openai_error(body, "invalid_json")
    status, body = _request(
        ep, "POST /episodes/ep/v1/chat/completions HTTP/1.1\r\nContent-Length: 100", b"{", session.key
    )
    assert status == 408 and "read_timeout_s=0.5" in _is_openai_error(body, "timeout")


def _closed(conn, wait=10.0) -> bool:
    conn.settimeout(wait)
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_300_idle_connections_are_all_closed_by_close(endpoint):
    ep, _ = endpoint()
    conns = [_connect(ep) for _ in range(300)]
    deadline = time.monotonic() + 10
    while ep.connections < 300 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ep.connections == 300
    ep.close()
    assert all(_closed(c) for c in conns)
    for c in conns:
        c.close()


def test_idle_connections_time_out_and_extra_connections_are_closed(endpoint):
    ep, _ = endpoint(idle_timeout_s=0.5, max_connections=3)
    conns = [_connect(ep) for _ in range(4)]
    assert _closed(conns[3], wait=5)  # the fourth: over max_connections
    assert all(_closed(c, wait=5) for c in conns[:3])  # the rest: idle for idle_timeout_s
    for c in conns:
        c.close()


def test_limits_are_checked_naming_the_key():
    with pytest.raises(ValueError, match=r"rollout.env_kwargs.limits.max_body_bytes must be a positive integer"):
        EndpointLimits(max_body_bytes=-1)
    with pytest.raises(ValueError, match=r"rollout.env_kwargs.limits.idle_timeout_s must be a positive number"):
        EndpointLimits(idle_timeout_s=0)
