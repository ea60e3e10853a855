"""A TEST STAND-IN for an SGLang server. It is NOT SGLang and runs no model.

A small real HTTP server (stdlib ``ThreadingHTTPServer`` on 127.0.0.1) that answers SGLang 0.5.23's
native endpoints with the *shapes* described in ``data/README.md`` (its output objects are
copies of the hand-written ``data/generate_single_n1.json``), so the client can be tested over real
sockets with real timeouts. Its tokens are a deterministic function of the prompt and the sample index
(:func:`expected_response`), so a test can tell whether any sample was dropped, duplicated or given to
the wrong prompt. It can be told to misbehave on ``/generate``:

- ``hang``: accept the request and never answer (until :meth:`StandIn.stop`);
- ``die``: close the connection without answering and stop listening (later connections are refused);
- ``drop``: close the connection without answering but keep listening;
- ``truncate``: send the headers and half of the declared body, then close;
- ``malformed``: answer 200 with a body that lacks ``meta_info.output_token_logprobs``;
- ``http500`` / ``abort``: answer 500, or answer 200 with ``finish_reason.type == "abort"``.

A weight update that arrives while a ``/generate`` request waits out ``delay_s`` is treated as landing
halfway through its tokens, in the way the last ``/pause_generation`` mode says: ``retract`` continues
the request, so the answer carries ``meta_info.weight_versions`` spans (the first half of the tokens on
the old version, the rest on the new); ``abort`` ends it with the first half of its tokens and
``finish_reason.type == "abort"``. (Its log-probs stay the deterministic ones; it runs no model.)

``misbehave_after=k`` serves ``k`` requests normally first. Weight-update endpoints enforce 0.5.23's
begin/end session rule (or answer 404 with ``has_session=False``, like older servers), and the
distributed ones wait, like a real server, for the trainer side of the collective: a test's callback
must call :meth:`StandIn.trainer_collective` while the request is open.

Run as a script (``python sglang_standin.py --port P ...``) it serves until SIGTERM, accepting the
launcher's command line; ``--proxy-to URL`` makes it a crude router forwarding ``/generate``.
"""

from __future__ import annotations

import argparse
import base64
import copy
import json
import os
import pickle
import signal
import socket
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

DATA = Path(__file__).parent / "data"


def load_exchange(name: str) -> dict:
    """A hand-written SGLang exchange from data/ (see data/README.md)."""
    return json.loads((DATA / name).read_text())


TEMPLATE = load_exchange("generate_single_n1.json")["body"]
SAMPLING_KEYS = frozenset(
    "max_new_tokens stop stop_token_ids stop_regex temperature top_p top_k min_p frequency_penalty "
    "presence_penalty repetition_penalty min_new_tokens n json_schema regex ebnf structural_tag ignore_eos "
    "skip_special_tokens spaces_between_special_tokens no_stop_trim stream_interval logit_bias sampling_seed "
    "custom_params".split()
)
MISBEHAVIOURS = ("hang", "die", "drop", "truncate", "malformed", "http500", "abort")


def expected_response(prompt, sample_index: int, max_new_tokens: int, stop_token_ids=()):
    """The stand-in's deterministic output for one sample: (token ids, log-probs, finish type)."""
    length = min(max_new_tokens, 2 + (sum(prompt) + sample_index) % 4)
    ids = [(sum(prompt) * 31 + 7 * sample_index + t) % 997 + 3 for t in range(length)]
    for t, tok in enumerate(ids):
        if tok in stop_token_ids:
            ids = ids[: t + 1]
            break
    logprobs = [-0.5 - 0.25 * ((tok + t) % 8) for t, tok in enumerate(ids)]
    finish = "stop" if (ids[-1] in stop_token_ids or len(ids) < max_new_tokens) else "length"
    return ids, logprobs, finish


class StandIn:
    """One stand-in server. ``start()`` returns its URL; ``stop()`` ends it and releases hung requests."""

    def __init__(
        self,
        *,
        tp_size: int = 1,
        pp_size: int = 1,
        has_session: bool = True,
        weight_version: str = "0",
        version: str = "0.5.23",
        delay_s: float = 0.0,
        collective_timeout_s: float = 10.0,
        port: int = 0,
        proxy_to: str | None = None,
    ):
        self.tp_size, self.pp_size, self.has_session, self.weight_version = (
            tp_size,
            pp_size,
            has_session,
            weight_version,
        )
        self.version, self.delay_s, self.collective_timeout_s, self.proxy_to = (
            version,
            delay_s,
            collective_timeout_s,
            proxy_to,
        )
        self.misbehave: str | None = None
        self.misbehave_after = 0
        self.busy_flushes = 0  # answer /flush_cache with 400 this many times first
        self.fail_update: str | None = None  # an endpoint path that answers success=false
        self.health_status = 200
        self.calls: list[tuple[str, object]] = []  # (path, decoded JSON body) in arrival order
        self.headers: list[dict[str, str]] = []  # each call's request headers (lower-cased names), same order
        self.received_tensors: list[list[tuple[str, object]]] = []
        self.loras: dict[str, str] = {}  # loaded LoRA adapters: name -> path ("__tensor__" for tensors)
        self.received_adapters: dict[str, dict] = {}  # name -> {peft_name: tensor} of /load_lora_adapter_from_tensors
        self.generate_served = 0
        self._session_open = False
        self._paused = False
        self.pause_mode = "abort"  # of the last /pause_generation
        self._collective = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._release = threading.Event()
        self._server = _Server(("127.0.0.1", port), _make_handler(self))
        self._thread: threading.Thread | None = None
        self._stopped = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> str:
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self.url

    def stop(self) -> None:
        self._release.set()
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._server.shutdown()  # waits for the accept loop to end (never called from that loop's thread)
        self._server.server_close()

    def paths(self) -> list[str]:
        return [p for p, _ in self.calls]

    def trainer_collective(self) -> None:
        """The trainer's side of one collective (group init or one bucket's broadcast)."""
        self._collective.release()

    # -------------------------------------------------------------------------------- handlers
    def handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        path = h.path.split("?")[0]
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            return _send(h, 400, {"error": "body is not JSON"})
        with self._lock:
            self.calls.append((path, body))
            self.headers.append({k.lower(): v for k, v in h.headers.items()})
        if path == "/generate":
            return self._generate(h, body)
        if path in ("/health", "/health_generate"):
            return _send(h, self.health_status, None)
        if path == "/server_info":
            return _send(
                h,
                200,
                {
                    "version": self.version,
                    "tp_size": self.tp_size,
                    "pp_size": self.pp_size,
                    "dp_size": 1,
                    "weight_version": self.weight_version,
                    "model_path": "stand-in",
                },
            )
        if path == "/model_info":
            return _send(
                h, 200, {"model_path": "stand-in", "is_generation": True, "weight_version": self.weight_version}
            )
        if path == "/pause_generation":
            self._paused = True
            self.pause_mode = (body or {}).get("mode", "abort")
            return _send(h, 200, {"message": "Generation paused successfully.", "status": "ok"})
        if path == "/continue_generation":
            self._paused = False
            return _send(h, 200, {"message": "Generation continued successfully.", "status": "ok"})
        if path in ("/release_memory_occupation", "/resume_memory_occupation"):
            # SGLang 0.5.23 answers 200 with a JSON null body
            return _send(h, 200, None)
        if path == "/flush_cache":
            with self._lock:
                busy = self.busy_flushes > 0
                self.busy_flushes -= busy
            if busy:
                return _send_text(h, 400, "Flush cache failed: there are running requests.\n")
            return _send_text(h, 200, "Cache flushed.\n")
        if path in ("/begin_weight_update", "/end_weight_update") and not self.has_session:
            return _send(h, 404, {"detail": "Not Found"})
        if path == "/begin_weight_update":
            if self._session_open:
                return _result(h, False, "a weight-update session is already open; call end_weight_update() first")
            self._session_open = True
            return _result(h, True, "Success")
        if path == "/end_weight_update":
            if not self._session_open:
                return _result(h, False, "no weight-update session is open; call begin_weight_update() first")
            self._session_open = False
            return _result(h, True, "Success")
        if path == self.fail_update:
            return _result(h, False, "stand-in told to fail " + path)
        if path == "/update_weights_from_disk":
            self.weight_version = body.get("weight_version") or self.weight_version
            return _send(
                h, 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
            )
        if (
            path in ("/update_weights_from_tensor", "/update_weights_from_distributed")
            and self.has_session
            and not self._session_open
        ):
            return _result(h, False, f"{path[1:]} must run between begin_weight_update() and end_weight_update()")
        if path == "/update_weights_from_tensor":
            payloads = body["serialized_named_tensors"]
            if len(payloads) != self.tp_size:
                return _result(h, False, f"expected {self.tp_size} serialized payloads, got {len(payloads)}")
            self.received_tensors.append(pickle.loads(base64.b64decode(payloads[0])))
            self.weight_version = body.get("weight_version") or self.weight_version
            return _result(h, True, "Success")
        if path in ("/init_weights_update_group", "/update_weights_from_distributed"):
            if not self._collective.acquire(timeout=self.collective_timeout_s):
                return _result(h, False, "timed out waiting for the trainer side of the collective")
            if path == "/update_weights_from_distributed":
                self.weight_version = body.get("weight_version") or self.weight_version
            return _result(h, True, "Success")
        if path in ("/load_lora_adapter", "/load_lora_adapter_from_tensors", "/unload_lora_adapter"):
            return self._lora(h, path, body)
        if path == "/update_weight_version":  # SGLang 0.5.23: answers {success, message, new_version}
            self.weight_version = body["new_version"]
            return _send(h, 200, {"success": True, "message": "ok", "new_version": body["new_version"]})
        if path == "/destroy_weights_update_group":
            return _result(h, True, "Success")
        return _send(h, 404, {"detail": "Not Found"})

    def _lora(self, h, path: str, body) -> None:
        """SGLang 0.5.23's LoRA endpoints: ``LoRAUpdateOutput`` (``success``, ``error_message``, ``loaded_adapters``),
        400 on failure; a loaded name cannot be loaded again."""
        name = body["lora_name"]
        error = None
        if path == "/unload_lora_adapter":
            if self.loras.pop(name, None) is None:
                error = f"LoRA adapter {name} is not loaded"
        elif name in self.loras:
            error = f"LoRA adapter {name} is already loaded"
        elif path == "/load_lora_adapter":
            self.loras[name] = body["lora_path"]
        else:
            payloads = body["serialized_named_tensors"]
            if len(payloads) != self.tp_size:
                error = f"expected {self.tp_size} serialized payloads, got {len(payloads)}"
            else:
                self.received_adapters[name] = pickle.loads(base64.b64decode(payloads[0]))
                self.loras[name] = "__tensor__"
        answer = {"success": error is None, "error_message": error, "loaded_adapters": dict(self.loras)}
        return _send(h, 400 if error else 200, answer)

    def _generate(self, h, body) -> None:
        lora = (body or {}).get("lora_path")
        if lora is not None and lora not in self.loras:  # SGLang 0.5.23 refuses an adapter it has not loaded
            return _send(h, 400, {"error": f"The following requested LoRA adapters are not loaded: {lora}"})
        with self._lock:
            index = self.generate_served
            self.generate_served += 1
        if self.proxy_to:
            req = urllib.request.Request(
                self.proxy_to + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=30) as r:
                return _send_raw(h, r.status, r.read())
        mode = self.misbehave if index >= self.misbehave_after else None
        started_on = self.weight_version
        if self.delay_s:
            time.sleep(self.delay_s)
        if mode == "hang":
            self._release.wait(60)
            return _abandon(h)
        if mode in ("die", "drop"):
            if mode == "die":
                self.stop()
            return _abandon(h)
        if mode == "http500":
            return _send(h, 500, {"error": {"message": "stand-in internal error"}})
        params = body.get("sampling_params") or {}
        params_list = params if isinstance(params, list) else [params]
        for sp in params_list:
            unknown = set(sp) - SAMPLING_KEYS
            if unknown:
                return _send(h, 400, {"error": f"unknown field `{sorted(unknown)[0]}`, expected one of ..."})
        ids = body.get("input_ids")
        if not ids or "text" in body:
            return _send(h, 400, {"error": "stand-in needs input_ids"})
        prompts = ids if isinstance(ids[0], list) else [ids]
        outs = []
        for i, prompt in enumerate(prompts):
            sp = params_list[i] if isinstance(params, list) else params
            for j in range(int(sp.get("n", 1))):
                sample_index = i if isinstance(params, list) else j  # a seeded batch is one prompt repeated
                outs.append(self._output(prompt, sample_index, sp, body, mode, started_on))
        payload = outs[0] if len(outs) == 1 and not isinstance(ids[0], list) else outs
        if mode == "truncate":
            data = json.dumps(payload).encode()
            h.send_response(200)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            h.wfile.write(data[: len(data) // 2])
            h.wfile.flush()
            return _abandon(h)
        return _send(h, 200, payload)

    def _output(self, prompt, sample_index, sp, body, mode, started_on) -> dict:
        ids, logprobs, finish = expected_response(
            prompt, sample_index, sp.get("max_new_tokens", 128), sp.get("stop_token_ids", ())
        )
        split = len(ids) // 2 if started_on != self.weight_version else None  # an update landed mid-request
        if split is not None and self.pause_mode == "abort":
            ids, logprobs, mode = ids[:split], logprobs[:split], "abort"
        out = copy.deepcopy(TEMPLATE)
        meta = out["meta_info"]
        out["output_ids"] = ids
        out["text"] = "".join(chr(97 + t % 26) for t in ids)
        meta["id"] = f"{os.getpid()}-{id(out):x}"
        meta["prompt_tokens"] = len(prompt)
        meta["completion_tokens"] = meta["output_token_logprobs_length"] = len(ids)
        meta["weight_version"] = self.weight_version
        if split is not None and self.pause_mode == "retract":
            meta["weight_versions"] = [
                {"version": started_on, "start": 0, "end": split},
                {"version": self.weight_version, "start": split, "end": len(ids)},
            ]
        elif split is not None:
            meta["weight_version"] = started_on
        meta["output_top_logprobs"] = [None] * len(ids)
        if finish == "stop":
            meta["finish_reason"] = {"type": "stop", "matched": ids[-1]}
        else:
            meta["finish_reason"] = {"type": "length", "length": len(ids)}
        if mode == "abort":
            meta["finish_reason"] = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logprobs, ids)]
        else:
            del meta["output_token_logprobs"]
        if mode == "malformed":
            del meta["output_token_logprobs"]
        return out


class _Server(ThreadingHTTPServer):
    request_queue_size = 1024  # socketserver's default of 5 drops SYNs under a burst of connections
    daemon_threads = True


def _make_handler(standin: StandIn):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            standin.handle(self, "GET")

        def do_POST(self):
            standin.handle(self, "POST")

        def log_message(self, *args):
            pass

    return Handler


def _send_raw(h, status: int, data: bytes, content_type: str = "application/json") -> None:
    h.send_response(status)
    h.send_header("Content-Type", content_type)
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    h.wfile.write(data)


def _send(h, status: int, obj) -> None:
    _send_raw(h, status, b"" if obj is None else json.dumps(obj).encode())


def _send_text(h, status: int, text: str) -> None:
    _send_raw(h, status, text.encode(), "text/plain")


def _result(h, success: bool, message: str) -> None:
    _send(h, 200 if success else 400, {"success": success, "message": message})


def _abandon(h) -> None:
    """Close the connection without (the rest of) an answer."""
    h.close_connection = True
    try:
        h.connection.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="SGLang test stand-in (NOT SGLang)")
    p.add_argument("--model-path", default="router")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--proxy-to", default=None)
    p.add_argument("--worker-urls", nargs="*", default=None)  # router-style command line
    p.add_argument("--policy", default=None)
    args, unknown = p.parse_known_args(argv)
    print(
        f"stand-in starting: model={args.model_path} CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')} "
        f"unknown_args={unknown}",
        flush=True,
    )
    if args.model_path == "EXIT_AT_START":
        print("stand-in: told to exit at start-up", flush=True)
        sys.exit(3)
    proxy = args.proxy_to or (args.worker_urls[0] if args.worker_urls else None)
    s = StandIn(tp_size=args.tp_size, weight_version=args.weight_version, port=args.port, proxy_to=proxy)
    if args.model_path == "NEVER_HEALTHY":
        s.health_status = 503
    signal.signal(signal.SIGTERM, lambda *_: (s.stop(), sys.exit(0)))
    s.start()
    print(f"stand-in serving on {s.url}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
