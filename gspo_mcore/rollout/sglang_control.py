"""SGLang's control plane: pause/continue, cache flush, server info, and the weight-update sequences.

Every call goes to each worker (never through a router). A weight update is
pause -> flush the cache -> [begin session] -> update -> [end session] -> continue, tagged with
``weight_version`` = the training step. The tensor and distributed paths run inside SGLang's
``begin_weight_update``/``end_weight_update`` session where the server has it (0.5.23 refuses them
outside one; older servers answer 404 and run without). The disk path runs without a session: it does
not need one, and ending a session with no tensor load in it makes SGLang re-run its post-load weight
processing (``end_weight_update`` in ``srt/managers/scheduler_components/weight_updater.py``). If an
update fails, the servers stay paused (their weights may be half updated) and :class:`WeightUpdateError`
is raised. With :attr:`SGLangControl.min_live` set, a disk or tensor update instead drops a worker that fails in
transport (:class:`ServerLost`: it died or dropped the connection) and goes on with the others while at least
``min_live`` remain; the dropped worker is excluded (``on_lost`` tells the engine) and gets the weights when it is
back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

from gspo_mcore.rollout import _http
from gspo_mcore.rollout import sglang_api as api
from gspo_mcore.rollout.types import NamedTensors, RolloutError, WeightUpdateError

log = logging.getLogger(__name__)


class ServerLost(RolloutError):
    """A control call got no complete response from ``url`` (transport failure: refused, reset, timed out)."""

    def __init__(self, message: str, url: str):
        super().__init__(message)
        self.url = url


@dataclasses.dataclass(frozen=True, kw_only=True)
class SGLangClientConfig:
    """Timeouts, retries and concurrency of the SGLang client."""

    request_timeout_s: float = 900.0
    """Wall-clock limit for one ``/generate`` request (a hung server is detected after this)."""
    connect_timeout_s: float = 10.0
    """Limit for opening a connection to a server."""
    control_timeout_s: float = 120.0
    """Limit for pause/continue/flush/session/health/server-info calls."""
    weight_update_timeout_s: float = 1800.0
    """Limit for one weight-update call (one bucket, or the whole disk load)."""
    max_attempts: int = 3
    """Tries per prompt across servers before the step fails."""
    max_inflight_per_server: int = 256
    """Concurrent ``/generate`` requests per server (SGLang batches them itself)."""
    pause_mode: Literal["abort", "retract"] = "abort"
    """How ``/pause_generation`` (:meth:`SGLangControl.pause`, and every weight update) treats running
    requests: ``abort`` returns them with ``finish_reason == "abort"``; ``retract`` puts them back in the
    queue, to finish after the update. SGLang's third mode, ``in_place``, is refused: it keeps the requests
    in the running batch, and SGLang 0.5.23 then refuses the ``/flush_cache`` that every weight update sends
    after pausing (HTTP 400), so the update would fail after ``flush_timeout_s``."""
    flush_timeout_s: float = 300.0
    """Limit for a weight update's ``/flush_cache`` to succeed (retried while requests are still running)."""
    flush_poll_s: float = 0.5
    """Wait between ``/flush_cache`` retries."""
    initial_weight_version: int = 0
    """The version SGLang's start-up value ``"default"`` stands for."""
    probe_path: str = api.HEALTH_GENERATE
    """Health check used by ``SGLangEngine.health`` and to re-admit a failed server."""
    probe_timeout_s: float = 30.0
    """Limit for one health probe (SGLang's ``/health_generate`` gives up by itself after 20 s)."""
    episode_affinity: bool = True
    """Send every turn of a multi-turn episode to the server that answered its previous turn (its radix cache holds
    the conversation), while that server is in rotation; False: each turn to the least busy server."""
    routed_experts: tuple[int, int] | None = None
    """``(num_layers, topk)`` of the served MoE model: ask every ``/generate`` for the experts each token was
    routed to and attach them to the samples (R3; the servers need ``--enable-return-routed-experts``).
    ``None``: do not ask. The trainer sets it from the model for ``routing.replay: rollout``."""

    def __post_init__(self):
        for f in (
            "request_timeout_s",
            "connect_timeout_s",
            "control_timeout_s",
            "weight_update_timeout_s",
            "flush_timeout_s",
            "flush_poll_s",
            "probe_timeout_s",
        ):
            if not getattr(self, f) > 0:
                raise ValueError(f"{f} must be > 0, got {getattr(self, f)!r}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.max_inflight_per_server < 1:
            raise ValueError(f"max_inflight_per_server must be >= 1, got {self.max_inflight_per_server}")
        if self.pause_mode == "in_place":
            raise ValueError(
                "pause_mode='in_place' cannot be used: a weight update pauses the servers and then flushes "
                "their cache, and SGLang refuses /flush_cache (HTTP 400) while requests are held in place, so "
                "every update would fail; use pause_mode='abort' (the default) or 'retract'"
            )
        if self.pause_mode not in ("abort", "retract"):
            raise ValueError(f"pause_mode must be 'abort' or 'retract', got {self.pause_mode!r}")
        if self.routed_experts is not None:
            dims = tuple(self.routed_experts)
            if len(dims) != 2 or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in dims):
                raise ValueError(f"routed_experts must be (num_layers, topk), two integers >= 1, got {dims!r}")
            object.__setattr__(self, "routed_experts", dims)


@dataclasses.dataclass
class WeightGroup:
    """A weight-update process group shared by the trainer (rank 0) and every server."""

    name: str
    world_size: int
    broadcast: Callable[[NamedTensors], None] | None


class SGLangControl:
    """Control calls to a fixed set of SGLang workers: pause/resume, memory, cache, ``/server_info`` and the weight
    updates (pause -> flush -> [session] -> update -> continue). :class:`~gspo_mcore.rollout.sglang.SGLangEngine`
    holds one as its ``control``; the engine's :class:`~gspo_mcore.rollout.types.RolloutEngine` methods use it, and
    callers that need the other control calls use it directly (``engine.control.release_memory()``)."""

    def __init__(self, worker_urls: Sequence[str], config: SGLangClientConfig):
        self.worker_urls = list(worker_urls)
        self.config = config
        self.version = config.initial_weight_version
        """The weight version the servers serve: the last successful update's."""
        self.group: WeightGroup | None = None
        self.excluded: set[str] = set()
        """Workers left out of every control call and weight update (unreachable, or dead and being restarted): a
        weight update goes to the others, and an excluded worker gets the weights when it is back (see
        :meth:`resync`, or the next update)."""
        self.min_live = 0
        """0: a weight update fails when any worker fails (the default). >= 1: a disk or tensor update drops a worker
        that fails in transport (adds it to :attr:`excluded`, calls :attr:`on_lost`) while at least this many live
        workers remain, and goes on with them."""
        self.on_lost: Callable[[str, str], None] | None = None
        """``on_lost(url, why)``: called for each worker dropped from a weight update."""
        self._dropping = False  # inside an update that may drop lost workers
        self.last_disk_update: tuple[str, int] | None = None
        """``(path, version)`` of the last update when it came from disk (a returning server can load it alone)."""
        self._infos: dict[str, api.ServerInfo] = {}
        self._has_session: dict[str, bool] = {}

    @property
    def live_urls(self) -> list[str]:
        """The workers control calls go to (not :attr:`excluded`)."""
        return [u for u in self.worker_urls if u not in self.excluded]

    # ------------------------------------------------------------------------------- plumbing
    async def _send(
        self, method: str, url: str, path: str, body: dict | None = None, timeout_s: float | None = None
    ) -> _http.HttpResponse:
        """One request to ``url + path`` (``timeout_s`` default: ``control_timeout_s``); no complete response is a
        :class:`RolloutError` naming both."""
        try:
            return await _http.request(
                method,
                url + path,
                body,
                timeout_s=timeout_s or self.config.control_timeout_s,
                connect_timeout_s=self.config.connect_timeout_s,
            )
        except _http.TransportError as e:
            raise ServerLost(f"{url}{path} failed: {e}", url) from None

    async def _get(self, url: str, path: str, parse: Callable[[Any], Any]) -> Any:
        """``GET url + path`` and ``parse`` its JSON; any failure (transport, a status other than 200, a body of
        another shape) is a :class:`RolloutError` naming ``url + path``."""
        resp = await self._send("GET", url, path)
        try:
            if resp.status != 200:
                raise api.ProtocolError(f"HTTP {resp.status}: {api.error_message(resp)}")
            return parse(api.decode_json(resp))
        except api.ProtocolError as e:
            raise RolloutError(f"{url}{path} failed: {e}") from None

    async def post(self, url: str, path: str, body: dict | None, timeout_s: float) -> dict:
        resp = await self._send("POST", url, path, body, timeout_s)
        try:
            return api.check_control_response(resp)
        except api.ProtocolError as e:
            raise RolloutError(f"{url}{path} failed: {e}") from None

    async def post_all(
        self,
        path: str,
        bodies: dict[str, dict | None],
        timeout_s: float,
        side_job: Callable[[], None] | None = None,
    ) -> None:
        """POST to several servers at once; optionally run a blocking ``side_job`` (a trainer-side
        collective the servers wait for) in a thread meanwhile. Raises on the first failure."""
        tasks = [asyncio.create_task(self.post(u, path, b, timeout_s)) for u, b in bodies.items()]
        side = _run_in_daemon_thread(side_job) if side_job else None
        waiting = tasks + ([side] if side else [])
        if not waiting:
            return
        every = self._dropping and side is None  # every answer is needed to tell a lost worker from a failed call
        try:
            done, _ = await asyncio.wait(
                waiting, return_when=asyncio.ALL_COMPLETED if every else asyncio.FIRST_EXCEPTION
            )
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        errors = [t.exception() for t in done if not t.cancelled() and t.exception() is not None]
        errors = self._drop_lost(errors, path)
        if not errors:
            return
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        msg = "; ".join(str(e) for e in errors)
        if side is not None and not side.done():
            msg += (
                " (the trainer-side collective is still blocked in its thread; the weight-update group "
                "is unusable and the trainer should exit)"
            )
        elif side is not None and side in done and side.exception() is not None:
            msg = f"trainer side of {path} failed: {msg}"
        raise RolloutError(msg)

    def _drop_lost(self, errors: list[BaseException], what: str) -> list[BaseException]:
        """Inside an update that may drop workers: when every error is a :class:`ServerLost` and at least
        :attr:`min_live` workers would remain, exclude the lost ones and return no error; else ``errors`` as given."""
        if not self._dropping or not errors or not all(isinstance(e, ServerLost) for e in errors):
            return errors
        lost = {e.url: str(e) for e in errors}
        if len([u for u in self.live_urls if u not in lost]) < self.min_live:
            return errors
        for url, why in lost.items():
            log.warning("SGLang server %s lost during a weight update (at %s: %s): left out of it", url, what, why)
            self.excluded.add(url)
            if self.on_lost is not None:
                self.on_lost(url, f"lost during a weight update: {why}")
        return []

    def _to_all(self, body: dict) -> dict[str, dict]:
        return dict.fromkeys(self.live_urls, body)

    # ------------------------------------------------------------------------- simple controls
    async def pause(self) -> None:
        await self.post_all(
            api.PAUSE, self._to_all(api.pause_body(self.config.pause_mode)), self.config.control_timeout_s
        )

    async def resume(self) -> None:
        await self.post_all(api.CONTINUE, self._to_all(api.continue_body()), self.config.control_timeout_s)

    async def release_memory(self, tags: Sequence[str] = api.MEMORY_TAGS) -> None:
        """Colocated mode: free the servers' GPU memory (KV cache, weights) while the learner trains."""
        await self.post_all(api.RELEASE_MEMORY, self._to_all(api.memory_body(tags)), self.config.control_timeout_s)

    async def resume_memory(self, tags: Sequence[str] = api.MEMORY_TAGS) -> None:
        """Colocated mode: take the memory back before the next weight update / rollout."""
        await self.post_all(api.RESUME_MEMORY, self._to_all(api.memory_body(tags)), self.config.control_timeout_s)

    async def flush_cache(self) -> None:
        """Flush every server's prefix cache, polling while requests still run (HTTP 400)."""
        results = await asyncio.gather(*(self._flush_one(u) for u in self.live_urls), return_exceptions=True)
        errors = self._drop_lost([r for r in results if isinstance(r, BaseException)], api.FLUSH_CACHE)
        if errors:
            raise errors[0]

    async def _flush_one(self, url: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.flush_timeout_s
        while True:
            resp = await self._send("POST", url, api.FLUSH_CACHE)
            if resp.status == 200:
                return
            if loop.time() >= deadline:
                raise RolloutError(
                    f"{url}{api.FLUSH_CACHE} still refused after {self.config.flush_timeout_s:g}s: "
                    f"HTTP {resp.status}: {resp.text(200)}"
                )
            await asyncio.sleep(self.config.flush_poll_s)

    async def server_info(self, refresh: bool = False) -> dict[str, api.ServerInfo]:
        """``/server_info`` of every worker (cached); warns when a server's version is not the pinned one."""
        if refresh or len(self._infos) != len(self.worker_urls):
            infos = await asyncio.gather(*(self._server_info(u) for u in self.worker_urls))
            self._infos = dict(zip(self.worker_urls, infos))
            for url, info in self._infos.items():
                if info.version != api.SGLANG_VERSION:
                    log.warning(
                        "SGLang server %s runs version %r; this client is tested against %s",
                        url,
                        info.version,
                        api.SGLANG_VERSION,
                    )
        return dict(self._infos)

    async def _server_info(self, url: str) -> api.ServerInfo:
        return await self._get(url, api.SERVER_INFO, api.parse_server_info)

    async def weight_version_of(self, url: str) -> int:
        """The weight version ``url`` reports now (``GET /model_info``), as a training step."""
        initial = self.config.initial_weight_version
        return await self._get(url, api.MODEL_INFO, lambda info: api.parse_model_info_version(info, initial))

    async def resync(self, url: str) -> bool:
        """Give one returning server the current weights, the way every server got them, if this client can do it
        alone: when the last update came from disk it loads that folder (pause, flush, load, continue on that server
        only); after a tensor or distributed update the weights are the trainer's, so it waits for the next update
        (returns False). Returns whether the server now reports :attr:`version`."""
        if self.last_disk_update is None or self.last_disk_update[1] != self.version:
            return False
        path, version = self.last_disk_update
        one = SGLangControl([url], self.config)
        one._has_session = {k: v for k, v in self._has_session.items() if k == url}
        await one.update_from_disk(path, version)
        return await self.weight_version_of(url) == version

    # ---------------------------------------------------------------------------- weight updates
    async def update_from_disk(self, path: str, version: int) -> None:
        """Load an exported HF-format (safetensors) directory on every server as ``version``."""
        body = api.update_from_disk_body(path, version)
        self._dropping = self.min_live > 0
        try:
            await self._pause_and_flush()
            try:
                await self.post_all(api.UPDATE_FROM_DISK, self._to_all(body), self.config.weight_update_timeout_s)
            except RolloutError as e:
                raise WeightUpdateError(f"update_weights_from_disk({path!r}, version={version}) failed: {e}") from None
            await self.resume()
        finally:
            self._dropping = False
        self.version = version
        self.last_disk_update = (str(path), version)

    async def update_from_tensor(
        self, buckets: Iterable[NamedTensors], version: int, *, load_format: str | None = None
    ) -> None:
        """Push buckets of ``(hf_name, tensor)`` to colocated servers as shared tensors (CUDA IPC, or
        shared memory for CPU tensors); see :func:`sglang_api.serialize_named_tensors`."""
        infos = await self.server_info()

        async def push(bucket: NamedTensors, last: bool) -> None:
            bodies = {
                u: api.update_from_tensor_body(
                    api.serialize_named_tensors(bucket, infos[u].tp_size),
                    version=version if last else None,
                    flush_cache=last,
                    load_format=load_format,
                )
                for u in self.live_urls
            }
            await self.post_all(api.UPDATE_FROM_TENSOR, bodies, self.config.weight_update_timeout_s)

        self._dropping = self.min_live > 0
        try:
            await self._update_in_session(buckets, version, push, "update_weights_from_tensor")
        finally:
            self._dropping = False

    async def update_adapter(
        self,
        name: str,
        version: int,
        *,
        tensors: dict | None = None,
        config_dict: dict | None = None,
        path: str | None = None,
    ) -> None:
        """Load a LoRA adapter version on every server under the new ``name`` and tag the servers ``version``
        (SGLang's adapter path; the servers run with ``--enable-lora``, see :mod:`~gspo_mcore.rollout.sglang_lora`).
        From ``tensors`` (``{peft_name: tensor}``, shared like :meth:`update_from_tensor`'s, with their PEFT
        ``config_dict``) through ``/load_lora_adapter_from_tensors``, or from a PEFT folder ``path`` on the servers'
        file system through ``/load_lora_adapter``. Pause, flush, load, ``/update_weight_version`` (an adapter load
        leaves the version alone), continue. The previous version is unloaded by the caller
        (:meth:`unload_adapter`) once requests name the new one."""
        if (tensors is None) == (path is None):
            raise ValueError("update_adapter: give tensors (with config_dict) or path, not both")
        if tensors is not None and config_dict is None:
            raise ValueError("update_adapter: tensors need their PEFT config_dict")
        await self._pause_and_flush()
        try:
            if tensors is not None:
                infos = await self.server_info()
                bodies = {
                    u: api.load_lora_from_tensors_body(
                        name, config_dict, api.serialize_tensor_dict(tensors, infos[u].tp_size)
                    )
                    for u in self.live_urls
                }
                await self._post_lora_all(api.LOAD_LORA_FROM_TENSORS, bodies)
            else:
                await self._post_lora_all(api.LOAD_LORA, self._to_all(api.load_lora_body(name, path)))
            body = api.weight_version_body(version)
            await self.post_all(api.UPDATE_WEIGHT_VERSION, self._to_all(body), self.config.control_timeout_s)
        except RolloutError as e:
            raise WeightUpdateError(f"loading LoRA adapter {name!r} (version {version}) failed: {e}") from None
        await self.resume()
        self.version = version
        self.last_disk_update = None

    async def unload_adapter(self, name: str) -> None:
        """Unload the adapter ``name`` on every server (SGLang waits for its running requests first)."""
        await self._post_lora_all(api.UNLOAD_LORA, self._to_all(api.unload_lora_body(name)))

    async def _post_lora_all(self, path: str, bodies: dict[str, dict]) -> None:
        async def one(url: str, body: dict) -> None:
            resp = await self._send("POST", url, path, body, self.config.weight_update_timeout_s)
            try:
                api.check_lora_response(resp)
            except api.ProtocolError as e:
                raise RolloutError(f"{url}{path} failed: {e}") from None

        await asyncio.gather(*(one(u, b) for u, b in bodies.items()))

    async def init_group(
        self,
        *,
        master_address: str,
        master_port: int,
        trainer_init: Callable[[int], None],
        broadcast: Callable[[NamedTensors], None] | None = None,
        group_name: str = api.DEFAULT_GROUP_NAME,
        backend: str = "nccl",
        ranks_per_server: Sequence[int] | None = None,
    ) -> int:
        """Create the process group the trainer broadcasts weights over; returns its world size.

        The trainer is rank 0; server ``i`` takes ranks ``1 + sum(ranks_per_server[:i])`` onwards
        (``ranks_per_server`` defaults to tp x pp from ``/server_info``). ``trainer_init(world_size)``
        must create the trainer's side of the group the way SGLang does (a custom group with the same
        ``group_name``; a plain ``init_process_group`` hangs); it runs in a thread while the servers join.
        ``broadcast(bucket)``, if given, becomes the default of the engine's ``update_weights``.
        """
        if ranks_per_server is None:
            infos = await self.server_info()
            for url, info in infos.items():
                if info.dp_size != 1:
                    raise ValueError(f"{url} runs dp_size={info.dp_size}; pass ranks_per_server explicitly")
            ranks_per_server = [infos[u].num_gpus for u in self.worker_urls]
        if len(ranks_per_server) != len(self.worker_urls):
            raise ValueError(f"{len(ranks_per_server)} rank counts for {len(self.worker_urls)} servers")
        world_size = 1 + sum(ranks_per_server)
        offsets = itertools.accumulate([1, *ranks_per_server])
        bodies = {
            url: api.init_group_body(
                master_address=master_address,
                master_port=master_port,
                rank_offset=off,
                world_size=world_size,
                group_name=group_name,
                backend=backend,
            )
            for url, off in zip(self.worker_urls, offsets)
        }
        try:
            await self.post_all(
                api.INIT_GROUP, bodies, self.config.weight_update_timeout_s, side_job=lambda: trainer_init(world_size)
            )
        except RolloutError as e:
            raise WeightUpdateError(f"init_weights_update_group({group_name!r}) failed: {e}") from None
        self.group = WeightGroup(group_name, world_size, broadcast)
        return world_size

    async def destroy_group(self) -> None:
        """Tear the weight-update group down on every server (nothing when none was created)."""
        if self.group is None:
            return
        body = api.destroy_group_body(self.group.name)
        self.group = None
        await self.post_all(api.DESTROY_GROUP, self._to_all(body), self.config.control_timeout_s)

    async def update_from_distributed(
        self,
        buckets: Iterable[NamedTensors],
        version: int,
        *,
        broadcast: Callable[[NamedTensors], None],
        load_format: str | None = None,
    ) -> None:
        """For each bucket, send its metadata (names, dtypes, shapes) to every server and, meanwhile,
        call ``broadcast(bucket)`` (in a thread), which must broadcast each tensor from rank 0 of the
        group in bucket order."""
        if self.group is None:
            raise WeightUpdateError("update_weights_from_distributed needs init_weight_update_group first")
        if self.excluded:
            raise WeightUpdateError(
                f"update_weights_from_distributed: server(s) {sorted(self.excluded)} are out of reach, and the "
                "weight-update group's broadcast needs every member (a lost or restarted server cannot rejoin it; use "
                "weight_sync tensor or disk for servers that may be restarted)"
            )
        group = self.group.name

        async def push(bucket: NamedTensors, last: bool) -> None:
            body = api.update_from_distributed_body(
                bucket, group_name=group, version=version if last else None, flush_cache=last, load_format=load_format
            )
            await self.post_all(
                api.UPDATE_FROM_DISTRIBUTED,
                self._to_all(body),
                self.config.weight_update_timeout_s,
                side_job=lambda: broadcast(bucket),
            )

        await self._update_in_session(buckets, version, push, "update_weights_from_distributed")

    async def _pause_and_flush(self) -> None:
        try:
            await self.pause()
            await self.flush_cache()
        except RolloutError as e:
            raise WeightUpdateError(f"could not pause and flush before a weight update: {e}") from None

    async def _update_in_session(self, buckets, version, push, what: str) -> None:
        """Pause, flush, open sessions, ``push(bucket, is_last)`` each bucket, close them, continue."""
        await self._pause_and_flush()
        opened: list[str] = []
        try:
            opened = await self._begin_session()
            count = 0
            for bucket, last in _with_last(buckets):
                await push(bucket, last)
                count += 1
            if count == 0:
                raise ValueError(f"{what}: no weight buckets given")
            await self._end_session(opened)
            opened = []
        except RolloutError as e:
            raise WeightUpdateError(f"{what}(version={version}) failed: {e}") from None
        finally:
            if opened:  # best effort, so a later update can open a session again
                try:
                    await self._end_session(opened)
                except RolloutError as e:
                    log.warning("could not close the weight-update session: %s", e)
        await self.resume()
        self.version = version
        self.last_disk_update = None

    async def _begin_session(self) -> list[str]:
        """Open a session on each server that has the endpoint; returns those URLs."""

        async def begin(url: str) -> str | None:
            if self._has_session.get(url) is False:
                return None
            resp = await self._send("POST", url, api.BEGIN_WEIGHT_UPDATE, api.begin_weight_update_body())
            if resp.status == 404:
                log.info("%s has no %s (SGLang < 0.5.23); no session", url, api.BEGIN_WEIGHT_UPDATE)
                self._has_session[url] = False
                return None
            try:
                api.check_control_response(resp)
            except api.ProtocolError as e:
                raise RolloutError(f"{url}{api.BEGIN_WEIGHT_UPDATE} failed: {e}") from None
            self._has_session[url] = True
            return url

        results = await asyncio.gather(*(begin(u) for u in self.live_urls), return_exceptions=True)
        opened = [r for r in results if isinstance(r, str)]
        errors = self._drop_lost([r for r in results if isinstance(r, BaseException)], api.BEGIN_WEIGHT_UPDATE)
        if errors:
            if opened:
                ends = (self.post(u, api.END_WEIGHT_UPDATE, {}, self.config.control_timeout_s) for u in opened)
                await asyncio.gather(*ends, return_exceptions=True)
            raise errors[0]
        return opened

    async def _end_session(self, urls: list[str]) -> None:
        body = api.end_weight_update_body()
        live = [u for u in urls if u not in self.excluded]  # not one dropped from the update since its session opened
        await self.post_all(api.END_WEIGHT_UPDATE, dict.fromkeys(live, body), self.config.control_timeout_s)


def _with_last(items: Iterable) -> Iterable[tuple[Any, bool]]:
    it = iter(items)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield prev, False
        prev = item
    yield prev, True


def _run_in_daemon_thread(fn: Callable[[], None]) -> asyncio.Future:
    """Run a blocking call in a daemon thread (a collective that never returns must not keep the
    interpreter alive, as an executor thread would) and return a future for its outcome."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)

    def target():
        exc = None
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            exc = e
        try:
            loop.call_soon_threadsafe(settle, exc)
        except RuntimeError:  # the loop is gone: nobody waits for this outcome any more
            pass

    threading.Thread(target=target, name="gspo-weight-sync", daemon=True).start()
    return fut
