"""SGLang's native HTTP API, as this client uses it: every path, request body and response shape.

All knowledge of SGLang's wire format lives here, so a version bump is a change to this module (and to
the recorded responses under ``tests/rollout/data/``). Written against SGLang ``SGLANG_VERSION``
(``sglang/api/v1/api_types.py``, ``srt/entrypoints/http_server.py`` and ``srt/managers/io_struct.py``
of that release).

Shapes relied on:

- ``POST /generate`` with ``{"input_ids": [int], "sampling_params": {...}, "return_logprob": true,
  "logprob_start_len": -1, "stream": false}``. ``sampling_params`` keys used: ``max_new_tokens``,
  ``temperature``, ``top_p``, ``top_k`` (-1 = off), ``stop_token_ids``, ``ignore_eos``, ``n``,
  ``sampling_seed`` (unknown keys are rejected with HTTP 400 ``{"error": "unknown field ..."}``).
  With a seed and ``n > 1`` the prompt is sent as a batch of ``n`` copies (``input_ids: [[int]]``, a
  list of ``sampling_params``), one seed each, because SGLang copies one request's ``sampling_seed``
  to all ``n`` parallel samples.
- Response: one object for a single prompt with ``n == 1``, otherwise a flat list ordered prompt-major
  (``[p0s0, p0s1, ..., p1s0, ...]``). Each object is ``{"text", "output_ids": [int], "meta_info":
  {"finish_reason": {"type": "stop"|"length"|"abort", ...}, "output_token_logprobs": [[logprob,
  token_id, text|null], ...], "weight_version": str, "weight_versions"?: [{"version", "start",
  "end"}], ...}}``. ``output_token_logprobs`` (and ``output_ids``) include a matched stop token.
  An aborted request still answers 200, with ``finish_reason.type == "abort"`` and partial tokens.
- Scoring (a teacher, :meth:`~gspo_mcore.rollout.sglang.SGLangEngine.score`): ``POST /generate`` with
  ``{"input_ids": [int], "sampling_params": {"max_new_tokens": 0}, "return_logprob": true,
  "logprob_start_len": s}`` generates nothing and returns ``meta_info.input_token_logprobs``: one
  ``[logprob, token_id, text]`` per input position ``s, s+1, ..., L-1``, the first with logprob ``null``
  (position ``s``'s own token is not predicted), entry ``k >= 1`` holding ``log p(ids[s+k] | ids[:s+k])``
  (``srt/managers/scheduler_components/logprob_result_processor.py``, ``_process_input_token_logprobs``:
  ``[None] + logprobs[:-1]`` over ``origin_input_ids[s:]``; the echoed ids are clipped there, every id
  ``>= vocab_size - 1`` echoed as 0, a guard for multimodal placeholder ids, while the log-probs are of the ids
  sent: so an echoed 0 is accepted for any id). ``max_new_tokens`` 0 is accepted
  (``srt/sampling/sampling_params.py`` refuses only < 0). These input log-probs are ``log_softmax`` of the
  raw logits: 0.5.23 applies no temperature to them (``srt/layers/logprob_processor.py``), so a teacher
  temperature other than 1 cannot be asked for. The radix cache may reuse a prefix only up to ``s``
  (``Req._compute_max_prefix_len``), so the prompt of a group's samples is computed once.
- Errors: ``{"error": "..."}`` or ``{"error": {"message": "..."}}`` with a 4xx/5xx status.
- Control endpoints (POST, JSON): ``/pause_generation {mode}``, ``/continue_generation {}``,
  ``/flush_cache`` (plain text; 200, or 400 while requests run), ``/begin_weight_update {selector}``
  and ``/end_weight_update {}`` (new in 0.5.23; 404 on older servers), ``/update_weights_from_disk``,
  ``/update_weights_from_tensor``, ``/init_weights_update_group``, ``/update_weights_from_distributed``,
  ``/destroy_weights_update_group``; these answer ``{"success": bool, "message": str, ...}`` with 200
  or 400. ``GET /server_info`` gives the resolved server arguments plus ``version``;
  ``GET /health_generate`` runs a one-token generation (200 or 503); ``GET /health`` only checks the
  HTTP front end.
- LoRA adapters (``rollout.sglang.lora_mode: adapter``; a server started with ``--enable-lora``):
  ``/load_lora_adapter_from_tensors {lora_name, config_dict, serialized_named_tensors}`` (one base64 pickle of
  ``{peft_name: tensor}`` per TP rank), ``/load_lora_adapter {lora_name, lora_path, pinned}``,
  ``/unload_lora_adapter {lora_name}``: 200 or 400 with ``{success, error_message, loaded_adapters}``; a loaded
  name cannot be loaded again. An adapter load leaves the weight version alone: ``/update_weight_version
  {new_version, abort_all_requests}`` sets it (``abort_all_requests`` defaults to true there). ``/generate`` names
  the adapter with ``"lora_path": name`` (absent: the base model).
- Routed experts (R3, ``SGLangClientConfig.routed_experts``): ``"return_routed_experts": true`` on
  ``/generate`` (a server started with ``--enable-return-routed-experts``; otherwise the key is silently
  ignored and ``meta_info`` has no ``routed_experts``) and ``routed_experts_start_len`` 0 (the whole
  sequence). ``meta_info.routed_experts`` is then base64 of little-endian int32, ``[seqlen - 1, num_layers,
  topk]`` row-major (``srt/state_capturer/base.py`` ``get_topk``, ``srt/managers/detokenizer_manager.py``):
  one row per input position of the prompt (prefill) and of every generated token but the last, which is
  never fed back. ``seqlen`` counts a matched stop token. ``/server_info`` reports
  ``enable_return_routed_experts``.
"""

from __future__ import annotations

import base64
import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gspo_mcore.rollout.types import NamedTensors, Sample, SamplingParams, derive_sample_seed

if TYPE_CHECKING:
    from gspo_mcore.rollout._http import HttpResponse

SGLANG_VERSION = "0.5.23"
"""The SGLang release this module's shapes were read from and its tests are written against."""

GENERATE = "/generate"
HEALTH = "/health"
HEALTH_GENERATE = "/health_generate"
SERVER_INFO = "/server_info"
MODEL_INFO = "/model_info"
PAUSE = "/pause_generation"
CONTINUE = "/continue_generation"
FLUSH_CACHE = "/flush_cache"
BEGIN_WEIGHT_UPDATE = "/begin_weight_update"
END_WEIGHT_UPDATE = "/end_weight_update"
UPDATE_FROM_DISK = "/update_weights_from_disk"
UPDATE_FROM_TENSOR = "/update_weights_from_tensor"
INIT_GROUP = "/init_weights_update_group"
DESTROY_GROUP = "/destroy_weights_update_group"
UPDATE_FROM_DISTRIBUTED = "/update_weights_from_distributed"
RELEASE_MEMORY = "/release_memory_occupation"
RESUME_MEMORY = "/resume_memory_occupation"
LOAD_LORA = "/load_lora_adapter"
LOAD_LORA_FROM_TENSORS = "/load_lora_adapter_from_tensors"
UNLOAD_LORA = "/unload_lora_adapter"
UPDATE_WEIGHT_VERSION = "/update_weight_version"
MEMORY_TAGS = ("weights", "kv_cache")

DEFAULT_GROUP_NAME = "weight_update_group"
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
"""The header sglang-router 0.3.2 routes a request by: requests with the same key go to the same worker under its
``manual`` policy (``--policy manual``; ``--assignment-mode min_load`` gives a new key the least loaded worker) and
its ``consistent_hashing`` one (not on the 0.3.2 command line). Its default ``cache_aware`` policy ignores it and
routes by prefix match instead. SGLang itself reads it only on its OpenAI routes."""
_SGLANG_DEFAULT_WEIGHT_VERSION = "default"  # ServerArgs.weight_version when --weight-version is not given


class ProtocolError(ValueError):
    """A response that does not have the documented shape (the caller adds the URL and request)."""


# ----------------------------------------------------------------------------------------- /generate
SEED_MASK = 2**63 - 1
"""``sampling_seed`` is sent as its low 63 bits: SGLang reads it as a signed 64-bit integer and sglang-router 0.3.2 as
an unsigned one (it refuses a negative seed with HTTP 422), so only ``0 .. 2**63 - 1`` passes both."""


def sampling_params_json(params: SamplingParams, *, n: int = 1, seed: int | None = None) -> dict[str, Any]:
    """``sampling_params`` for one request; only keys SGLang accepts."""
    out: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": params.top_k,
        "n": n,
    }
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if params.ignore_eos:
        out["ignore_eos"] = True
    if seed is not None:
        out["sampling_seed"] = seed & SEED_MASK
    return out


def build_generate_request(
    prompt_ids: Sequence[int],
    n: int,
    params: SamplingParams,
    *,
    prompt_index: int,
    routed_experts: bool = False,
    lora_name: str | None = None,
) -> dict[str, Any]:
    """The ``/generate`` body for the ``n`` samples of one prompt (token ids, never text); ``routed_experts``:
    also ask for the experts every position was routed to (prompt included); ``lora_name``: sample with that loaded
    LoRA adapter (``lora_path``, which takes the adapter's name; None: the base model)."""
    body: dict[str, Any] = {"return_logprob": True, "logprob_start_len": -1, "stream": False}
    if lora_name is not None:
        body["lora_path"] = lora_name
    if routed_experts:
        body["return_routed_experts"] = True
        body["routed_experts_start_len"] = 0
    if params.seed is None:
        body["input_ids"] = list(prompt_ids)
        body["sampling_params"] = sampling_params_json(params, n=n)
    elif n == 1:
        body["input_ids"] = list(prompt_ids)
        body["sampling_params"] = sampling_params_json(params, seed=derive_sample_seed(params.seed, prompt_index, 0))
    else:
        body["input_ids"] = [list(prompt_ids) for _ in range(n)]
        body["sampling_params"] = [
            sampling_params_json(params, seed=derive_sample_seed(params.seed, prompt_index, j)) for j in range(n)
        ]
    return body


def build_score_request(ids: Sequence[int], start: int) -> dict[str, Any]:
    """The ``/generate`` body that scores ``ids`` without generating: the log-prob of every token from
    position ``start`` on (``1 <= start < len(ids)``), each given the tokens before it."""
    if not 1 <= start < len(ids):
        raise ValueError(f"score: start {start} must be in [1, {len(ids)}) for {len(ids)} tokens")
    return {
        "input_ids": list(ids),
        "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
        "return_logprob": True,
        "logprob_start_len": start - 1,
        "stream": False,
    }


def parse_input_logprobs(item: Any, ids: Sequence[int], start: int, where: str = "output") -> tuple[float, ...]:
    """The answer to :func:`build_score_request`: ``log p(ids[t] | ids[:t])`` for ``t = start .. len(ids)-1``.
    The token ids SGLang echoes must be ``ids[start-1:]`` (else the server scored something else)."""
    if not isinstance(item, dict) or not isinstance(item.get("meta_info"), dict):
        raise ProtocolError(f"{where}: missing 'meta_info' object")
    entries = item["meta_info"].get("input_token_logprobs")
    if not isinstance(entries, list):
        raise ProtocolError(f"{where}: missing 'meta_info.input_token_logprobs' (was return_logprob sent?)")
    expected = list(ids[start - 1 :])
    if len(entries) != len(expected):
        raise ProtocolError(
            f"{where}: {len(entries)} input_token_logprobs for positions {start - 1}..{len(ids) - 1} "
            f"({len(expected)} expected)"
        )
    out = []
    for k, (e, tok) in enumerate(zip(entries, expected)):
        if not (isinstance(e, (list, tuple)) and len(e) >= 2):
            raise ProtocolError(f"{where}: input_token_logprobs[{k}] is not [logprob, token_id, text]: {e!r}")
        if e[1] != tok and e[1] != 0:  # SGLang echoes ids >= vocab_size - 1 as 0 (see the module docstring)
            raise ProtocolError(
                f"{where}: input_token_logprobs[{k}] is for token {e[1]!r}, position {start - 1 + k} holds {tok}"
            )
        if k == 0:
            continue  # the first position's own token is not predicted (logprob null)
        lp = e[0]
        if not (isinstance(lp, (int, float)) and not isinstance(lp, bool) and (math.isfinite(lp) or lp == -math.inf)):
            raise ProtocolError(f"{where}: input_token_logprobs[{k}] has logprob {lp!r}")
        out.append(float(lp))
    return tuple(out)


def decode_json(resp: HttpResponse) -> Any:
    try:
        return json.loads(resp.body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"body is not JSON ({e}): {resp.text(200)!r}") from None


def split_generate_outputs(body: Any, num_prompts: int, n: int) -> list[list[dict]]:
    """Group a decoded ``/generate`` response as ``out[prompt][sample]`` (SGLang's prompt-major order)."""
    expected = num_prompts * n
    if isinstance(body, dict):
        items = [body]
    elif isinstance(body, list):
        items = body
    else:
        raise ProtocolError(f"expected a JSON object or list, got {type(body).__name__}")
    if len(items) != expected:
        raise ProtocolError(f"expected {expected} outputs ({num_prompts} prompt(s) x n={n}), got {len(items)}")
    for k, item in enumerate(items):
        if not isinstance(item, dict):
            raise ProtocolError(f"output {k} is a {type(item).__name__}, not an object")
    return [items[i * n : (i + 1) * n] for i in range(num_prompts)]


def parse_generate_output(
    item: dict,
    *,
    prompt_ids: Sequence[int],
    prompt_index: int,
    sample_index: int,
    initial_weight_version: int,
    routing_dims: tuple[int, int] | None = None,
) -> Sample:
    """One output object of ``/generate`` as a :class:`Sample`; with ``routing_dims`` ``(num_layers, topk)``
    also its ``routed_experts`` (see :func:`parse_routed_experts`)."""
    where = f"output for prompt {prompt_index} sample {sample_index}"
    meta = item.get("meta_info")
    if not isinstance(meta, dict):
        raise ProtocolError(f"{where}: missing 'meta_info' object")
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list):
        raise ProtocolError(f"{where}: missing 'meta_info.output_token_logprobs' (was return_logprob sent?)")
    ids, logprobs = [], []
    for t, e in enumerate(entries):
        if not (isinstance(e, (list, tuple)) and len(e) >= 2):
            raise ProtocolError(f"{where}: output_token_logprobs[{t}] is not [logprob, token_id, text]: {e!r}")
        lp, tok = e[0], e[1]
        if not (isinstance(lp, (int, float)) and not isinstance(lp, bool) and (math.isfinite(lp) or lp == -math.inf)):
            raise ProtocolError(f"{where}: output_token_logprobs[{t}] has logprob {lp!r}")
        if not (isinstance(tok, int) and not isinstance(tok, bool) and tok >= 0):
            raise ProtocolError(f"{where}: output_token_logprobs[{t}] has token id {tok!r}")
        ids.append(tok)
        logprobs.append(float(lp))
    output_ids = item.get("output_ids")
    if output_ids is not None and list(output_ids) != ids:
        raise ProtocolError(
            f"{where}: output_ids ({len(output_ids)} tokens) disagree with the token ids in "
            f"output_token_logprobs ({len(ids)} tokens)"
        )
    routed = None
    finish_reason = parse_finish_reason(meta.get("finish_reason"), where)
    if routing_dims is not None and ids and not (finish_reason == "abort" and "routed_experts" not in meta):
        # an aborted request may come back without routing: its sample then has none (R3 refuses it by name)
        routed = parse_routed_experts(meta, len(prompt_ids) + len(ids), routing_dims, where)
    return Sample(
        prompt_index=prompt_index,
        sample_index=sample_index,
        prompt_ids=tuple(prompt_ids),
        response_ids=tuple(ids),
        response_logprobs=tuple(logprobs),
        finish_reason=finish_reason,
        weight_version=parse_weight_version(meta, initial_weight_version, where),
        routed_experts=routed,
        token_versions=parse_token_versions(meta, len(ids), initial_weight_version, where),
    )


def parse_routed_experts(meta: dict, length: int, routing_dims: tuple[int, int], where: str = "output"):
    """``meta_info.routed_experts`` as an int32 tensor ``[length, num_layers, topk]`` aligned with the sample's
    tokens (prompt + response): row ``t`` holds the experts input token ``t`` was routed to in every layer.
    SGLang returns ``length - 1`` rows (the last generated token is never run through the model); the last
    row is ``-1`` ("not routed")."""
    import numpy as np
    import torch

    num_layers, topk = routing_dims
    data = meta.get("routed_experts")
    if not isinstance(data, str):
        raise ProtocolError(
            f"{where}: missing 'meta_info.routed_experts' (routing.replay=rollout needs SGLang servers started "
            "with --enable-return-routed-experts)"
        )
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError as e:
        raise ProtocolError(f"{where}: meta_info.routed_experts is not base64: {e}") from None
    rows = length - 1
    if len(raw) != rows * num_layers * topk * 4:
        raise ProtocolError(
            f"{where}: meta_info.routed_experts has {len(raw)} bytes, expected {rows} positions x {num_layers} "
            f"layers x top-{topk} x 4 (int32) = {rows * num_layers * topk * 4} for {length} tokens"
        )
    routed = torch.full((length, num_layers, topk), -1, dtype=torch.int32)
    routed[:rows] = torch.from_numpy(np.frombuffer(raw, dtype="<i4").astype(np.int32).reshape(rows, num_layers, topk))
    return routed


def parse_finish_reason(fr: Any, where: str = "output") -> str:
    """``{"type": "stop"|"length"|"abort", ...}`` -> that type."""
    if not isinstance(fr, dict):
        raise ProtocolError(f"{where}: finish_reason is {fr!r}, expected an object with a 'type'")
    kind = fr.get("type")
    if kind not in ("stop", "length", "abort"):
        raise ProtocolError(f"{where}: unknown finish_reason type {kind!r}")
    return kind


def parse_weight_version(meta: dict, initial_version: int, where: str = "output") -> int:
    """The training step of the weights that produced an output: the oldest one when the weights were
    swapped mid-generation (``meta_info.weight_versions`` spans), else ``meta_info.weight_version``.
    SGLang's start-up value ``"default"`` maps to ``initial_version``."""
    spans = meta.get("weight_versions")
    if spans:
        if not isinstance(spans, list) or not all(isinstance(s, dict) and "version" in s for s in spans):
            raise ProtocolError(f"{where}: malformed weight_versions {spans!r}")
        return min(_version_int(s["version"], initial_version, where) for s in spans)
    if "weight_version" not in meta:
        raise ProtocolError(f"{where}: missing 'meta_info.weight_version'")
    return _version_int(meta["weight_version"], initial_version, where)


def parse_token_versions(
    meta: dict, num_tokens: int, initial_version: int, where: str = "output"
) -> tuple[int, ...] | None:
    """Each output token's weight version from ``meta_info.weight_versions`` (spans ``{version, start,
    end}`` over the output tokens, which SGLang records when the weights change under a running or
    retracted request); ``None`` when one version made them all (or the server sent no spans). Spans
    that do not tile ``[0, num_tokens)`` in order are a protocol error."""
    spans = meta.get("weight_versions")
    if not spans:
        return None
    if not isinstance(spans, list) or not all(isinstance(s, dict) and "version" in s for s in spans):
        raise ProtocolError(f"{where}: malformed weight_versions {spans!r}")
    out: list[int] = []
    for s in spans:
        start, end = s.get("start"), s.get("end")
        if not (_plain_int(start) and _plain_int(end) and start == len(out) and end >= start):
            raise ProtocolError(f"{where}: weight_versions {spans!r} do not tile the {num_tokens} output tokens")
        out += [_version_int(s["version"], initial_version, where)] * (end - start)
    if len(out) != num_tokens:
        raise ProtocolError(f"{where}: weight_versions {spans!r} do not tile the {num_tokens} output tokens")
    return tuple(out) if len(set(out)) > 1 else None


def parse_model_info_version(body: Any, initial_version: int) -> int:
    """The weight version a server reports in ``GET /model_info`` (``weight_version``; SGLang 0.5.23 has no
    ``/get_weight_version``) as a training step (``"default"``, the start-up value, is ``initial_version``)."""
    if not isinstance(body, dict) or "weight_version" not in body:
        raise ProtocolError(f"/model_info has no 'weight_version': {str(body)[:200]}")
    return _version_int(body["weight_version"], initial_version, "/model_info")


def _plain_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _version_int(v: Any, initial_version: int, where: str) -> int:
    if v == _SGLANG_DEFAULT_WEIGHT_VERSION:
        return initial_version
    try:
        return int(v)
    except (TypeError, ValueError):
        raise ProtocolError(
            f"{where}: weight_version {v!r} is not a training step (this client tags weights with integers)"
        ) from None


def error_message(resp: HttpResponse) -> str:
    """The human-readable part of an error response (``error``, ``error.message`` or ``message``)."""
    try:
        body = json.loads(resp.body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return resp.text(300)
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if err is not None:
            return str(err)
        if "message" in body:
            return str(body["message"])
    return resp.text(300)


# ------------------------------------------------------------------------------ control endpoints
def pause_body(mode: str) -> dict:
    if mode not in ("abort", "retract", "in_place"):
        raise ValueError(f"pause mode must be 'abort', 'retract' or 'in_place', got {mode!r}")
    return {"mode": mode}


def continue_body() -> dict:
    return {}


def memory_body(tags) -> dict:
    """Body of ``/release_memory_occupation`` and ``/resume_memory_occupation``: which GPU memory to
    free or take back (colocated mode frees the KV cache and weights while the learner trains)."""
    tags = list(tags)
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad or not tags:
        raise ValueError(f"memory tags must be a non-empty subset of {MEMORY_TAGS}, got {tags}")
    return {"tags": tags}


def begin_weight_update_body() -> dict:
    return {"selector": "all"}


def end_weight_update_body() -> dict:
    return {}


def update_from_disk_body(path: str, version: int) -> dict:
    return {
        "model_path": str(path),
        "weight_version": str(version),
        "flush_cache": True,
        "abort_all_requests": False,
    }


def update_from_tensor_body(
    serialized: list[str], *, version: int | None, flush_cache: bool, load_format: str | None = None
) -> dict:
    body: dict[str, Any] = {
        "serialized_named_tensors": serialized,
        "flush_cache": flush_cache,
        "abort_all_requests": False,
    }
    if version is not None:
        body["weight_version"] = str(version)
    if load_format is not None:
        body["load_format"] = load_format
    return body


def init_group_body(
    *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
) -> dict:
    return {
        "master_address": master_address,
        "master_port": int(master_port),
        "rank_offset": int(rank_offset),
        "world_size": int(world_size),
        "group_name": group_name,
        "backend": backend,
    }


def destroy_group_body(group_name: str) -> dict:
    return {"group_name": group_name}


def update_from_distributed_body(
    bucket: NamedTensors,
    *,
    group_name: str,
    version: int | None,
    flush_cache: bool,
    load_format: str | None = None,
) -> dict:
    """Metadata of one bucket; the tensors themselves are broadcast by the trainer, in this order."""
    body: dict[str, Any] = {
        "names": [name for name, _ in bucket],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
        "group_name": group_name,
        "flush_cache": flush_cache,
        "abort_all_requests": False,
    }
    if version is not None:
        body["weight_version"] = str(version)
    if load_format is not None:
        body["load_format"] = load_format
    return body


def load_lora_from_tensors_body(name: str, config_dict: dict, serialized: list[str]) -> dict:
    """``/load_lora_adapter_from_tensors`` (``LoadLoRAAdapterFromTensorsReqInput``): the adapter ``name`` (new:
    a loaded name cannot be loaded again), its PEFT ``adapter_config.json`` as a dict, and one serialized
    ``{peft_name: tensor}`` per TP rank of the server (:func:`serialize_tensor_dict`; full tensors, each rank slices
    its own part)."""
    return {"lora_name": name, "config_dict": dict(config_dict), "serialized_named_tensors": list(serialized)}


def load_lora_body(name: str, path: str) -> dict:
    """``/load_lora_adapter`` (``LoadLoRAAdapterReqInput``): a PEFT adapter folder on the server's file system (a
    path that is not a local directory is looked up on the Hugging Face hub by SGLang)."""
    return {"lora_name": name, "lora_path": str(path), "pinned": False}


def unload_lora_body(name: str) -> dict:
    """``/unload_lora_adapter`` (``UnloadLoRAAdapterReqInput``)."""
    return {"lora_name": name}


def weight_version_body(version: int) -> dict:
    """``/update_weight_version`` (``UpdateWeightVersionReqInput``): an adapter load does not change the server's
    weight version, so it is set here; ``abort_all_requests`` is false (SGLang's default, true, would abort
    running requests)."""
    return {"new_version": str(version), "abort_all_requests": False}


def check_lora_response(resp: HttpResponse) -> dict:
    """The answer of a LoRA load/unload (``LoRAUpdateOutput``: ``success``, ``error_message``, ``loaded_adapters``);
    raises :class:`ProtocolError` unless it reports success."""
    if resp.status != 200:
        raise ProtocolError(f"HTTP {resp.status}: {error_message(resp)}")
    body = decode_json(resp)
    if not isinstance(body, dict) or body.get("success") is not True:
        detail = body.get("error_message") if isinstance(body, dict) else body
        raise ProtocolError(f"success=false: {detail}")
    return body


def check_control_response(resp: HttpResponse) -> dict:
    """A control endpoint's JSON answer; raises :class:`ProtocolError` unless it reports success."""
    if resp.status != 200:
        raise ProtocolError(f"HTTP {resp.status}: {error_message(resp)}")
    if not resp.body.strip():
        return {}
    body = decode_json(resp)
    if isinstance(body, dict) and body.get("success") is False:
        raise ProtocolError(f"success=false: {body.get('message', '')}")
    return body if isinstance(body, dict) else {}


def serialize_named_tensors(bucket: NamedTensors, num_ranks: int) -> list[str]:
    """``serialized_named_tensors`` for ``/update_weights_from_tensor``: one base64 string per TP rank
    of the server, each a ``ForkingPickler`` pickle of ``[(name, tensor), ...]`` (what SGLang's
    ``MultiprocessingSerializer.serialize(..., output_str=True)`` produces). Pickled separately per
    rank so each rank holds its own CUDA-IPC reference. The tensors are shared, not copied: CUDA tensors
    as CUDA-IPC handles (same node only), CPU tensors through shared memory, which needs torch's
    ``file_system`` sharing strategy (``file_descriptor`` crashed SGLang 0.5.23). Keep the tensors
    alive until the server has answered.
    """
    items = [(str(name), t) for name, t in bucket]
    return _pickle_per_rank(items, [t for _, t in items], num_ranks)


def _pickle_per_rank(items, tensors: list, num_ranks: int) -> list[str]:
    """``items`` pickled (``ForkingPickler``: tensors shared, not copied) once per rank, base64; CPU tensors need
    torch's ``file_system`` sharing strategy."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as tmp  # registers torch's tensor reductions with ForkingPickler

    if any(t.device.type == "cpu" for t in tensors) and tmp.get_sharing_strategy() != "file_system":
        raise RuntimeError(
            "sending CPU tensors to SGLang needs torch.multiprocessing.set_sharing_strategy('file_system') "
            f"(the current strategy {tmp.get_sharing_strategy()!r} passes file descriptors, which SGLang "
            "0.5.23 cannot receive over HTTP)"
        )
    out = []
    for _ in range(num_ranks):
        buf = io.BytesIO()
        ForkingPickler(buf).dump(items)
        out.append(base64.b64encode(buf.getvalue()).decode("ascii"))
    return out


def serialize_tensor_dict(tensors: dict, num_ranks: int) -> list[str]:
    """``serialized_named_tensors`` for ``/load_lora_adapter_from_tensors``: like :func:`serialize_named_tensors`
    (same sharing rules), but each rank's pickle is a ``{name: tensor}`` dict, which is what SGLang's LoRA loader
    reads (``tp_worker.load_lora_adapter_from_tensors``)."""
    items = {str(name): t for name, t in tensors.items()}
    return _pickle_per_rank(items, list(items.values()), num_ranks)


# ------------------------------------------------------------------------------------ /server_info
@dataclass(frozen=True)
class ServerInfo:
    version: str
    tp_size: int
    pp_size: int
    dp_size: int
    weight_version: str | None
    routed_experts: bool = False
    """``enable_return_routed_experts``: the server can return the experts it routed each token to."""

    @property
    def num_gpus(self) -> int:
        """Ranks this server contributes to a weight-update group (tp x pp; data parallel is not handled)."""
        return self.tp_size * self.pp_size


def parse_server_info(body: Any) -> ServerInfo:
    if not isinstance(body, dict):
        raise ProtocolError(f"/server_info: expected an object, got {type(body).__name__}")
    try:
        return ServerInfo(
            version=str(body.get("version", "")),
            tp_size=int(body.get("tp_size", 1)),
            pp_size=int(body.get("pp_size", 1)),
            dp_size=int(body.get("dp_size", 1)),
            weight_version=body.get("weight_version"),
            routed_experts=bool(body.get("enable_return_routed_experts", False)),
        )
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"/server_info: {e}") from None
