"""The SGLang rollout engine: a client for one or more SGLang servers (optionally behind sglang-router).

Generation sends one ``/generate`` request per prompt (its ``n`` samples together, so they share the
prompt's KV prefix on one server), many at a time, each to the least busy server. A multi-turn episode
(:meth:`SGLangEngine.generate_turns`) keeps to one server (episode affinity): every turn goes to the server
that answered the episode's previous turn while that server is in rotation, so its radix cache still holds the
conversation and only the new span is prefilled; if it fails, the turn goes to the least busy server, and the
episode stays there. Behind a router, each turn carries the episode's key in the header sglang-router reads
(:data:`~gspo_mcore.rollout.sglang_api.ROUTING_KEY_HEADER`; honoured by its ``manual`` policy).

Weight versions and restarts: before each generation every worker's reported weight version (``/model_info``) is
checked against the version last synced (:attr:`SGLangControl.version`); a worker that reports an older one (it
missed a sync while out of reach, or was restarted on other weights) is not sent a request until it holds the current
weights: it loads them at once when the last sync came from disk (:meth:`SGLangControl.resync`), else it gets them
with the next weight update (which goes to every reachable worker) and is checked again. A server this engine
launched whose process died, or that failed its health probe for ``restart.after_s``, is restarted on its port (at
most ``restart.attempts`` times, with back-off), then re-synced and checked the same way. With
``restart.probe_interval_s`` a background thread (:class:`~gspo_mcore.rollout.sglang_monitor.ServerMonitor`) also
watches the launched servers between steps and restarts a dead one at once, so it is up by the next step; the engine
takes it back the same way (its weights checked first). Fewer than ``restart.min_servers`` workers in rotation stops
the step with the reasons (and a given-up server's last log lines), after waiting for restarts in progress and looking
at the processes again (a server that died during these checks is restarted first). A weight update leaves out the
servers out of rotation or being restarted, and drops one that fails in transport during it (out of rotation, restarted
or re-synced before it serves again) while ``min_servers`` remain; with fewer it fails as
:class:`~gspo_mcore.rollout.types.WeightUpdateError`.

A request that fails in transport (connection refused or reset, timeout, truncated body) or with a 5xx status
is retried on another server, up to ``max_attempts`` tries per prompt; a server that failed in transport is
taken out of rotation until a health probe passes. A request the server rejects (4xx) or a response without
the documented shape fails the step at once. Either every prompt gets exactly its ``n`` samples, or
``generate`` raises :class:`RolloutError` naming the server URL and the request.

Pause/resume and weight updates (pause -> flush -> [session] -> update -> continue, weight version =
training step) are delegated to :class:`~gspo_mcore.rollout.sglang_control.SGLangControl`, which sends
them to every worker. All wire-format details live in :mod:`gspo_mcore.rollout.sglang_api`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from gspo_mcore.rollout import _http
from gspo_mcore.rollout import sglang_api as api
from gspo_mcore.rollout.sglang_control import SGLangClientConfig, SGLangControl
from gspo_mcore.rollout.sglang_server import RestartPolicy
from gspo_mcore.rollout.turns import OnTurns, TurnCaps, TurnEnd, TurnStops, turn_budget
from gspo_mcore.rollout.types import (
    NamedTensors,
    RolloutEngine,
    RolloutError,
    Sample,
    SamplingParams,
    check_generate_args,
    derive_sample_seed,
    normalize_prompts,
)

__all__ = ["SGLangClientConfig", "SGLangEngine"]

log = logging.getLogger(__name__)

_RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})


class SGLangEngine(RolloutEngine):
    """:class:`RolloutEngine` over SGLang's HTTP API.

    ``worker_urls`` are the SGLang servers (all control calls go to each of them). ``router_url``, if
    given, receives the ``/generate`` traffic instead (sglang-router balances and retries by itself).
    ``processes`` are launched processes the engine owns and stops on :meth:`close`.
    """

    def __init__(
        self,
        worker_urls: Sequence[str],
        *,
        router_url: str | None = None,
        config: SGLangClientConfig | None = None,
        processes: Sequence[Any] = (),
        launched: Sequence[tuple[Any, Any]] = (),
        restart: RestartPolicy | None = None,
    ):
        """``launched``: ``(ManagedProcess, SGLangServerConfig)`` of the servers this engine may restart (they are also
        in ``processes``); ``restart``: how (default: never; ``min_servers`` 1)."""
        if not worker_urls:
            raise ValueError("at least one SGLang worker URL is needed")
        self.worker_urls = [u.rstrip("/") for u in worker_urls]
        if len(set(self.worker_urls)) != len(self.worker_urls):
            raise ValueError(f"duplicate worker URLs: {self.worker_urls}")
        self.router_url = router_url.rstrip("/") if router_url else None
        self.config = config or SGLangClientConfig()
        self._processes = list(processes)
        self._down: dict[str, str] = {}  # generate URL -> why it was taken out of rotation
        self._down_since: dict[str, float] = {}
        self._stale: set[str] = set()  # workers out of rotation because of their weight version
        self._given_up: dict[str, str] = {}  # launched workers that could not be restarted -> why (with log tail)
        self._launched: dict[str, list] = {p.url: [p, c] for p, c in launched}
        self._restarts: dict[str, int] = dict.fromkeys(self._launched, 0)
        self._restart_locks = {u: threading.Lock() for u in self._launched}  # held while a server is restarted
        self._restart_outcomes: collections.deque = collections.deque()  # (url, ok, why) of background restarts
        self._closing = False
        self.restart = restart or RestartPolicy()
        self.restarted = 0
        """Servers restarted so far."""
        self.monitor = None
        """The background :class:`~gspo_mcore.rollout.sglang_monitor.ServerMonitor` of the launched servers (when
        ``restart.attempts`` and ``restart.probe_interval_s`` are both set), else None."""
        if self._launched and self.restart.attempts > 0 and self.restart.probe_interval_s > 0:
            from gspo_mcore.rollout.sglang_monitor import ServerMonitor

            self.monitor = ServerMonitor(
                self._watched,
                self._restart_in_background,
                interval_s=self.restart.probe_interval_s,
                after_s=self.restart.after_s,
                probe_timeout_s=self.config.probe_timeout_s,
            ).start()
        self.prompt_tokens = self.cached_tokens = 0
        """Prompt tokens sent in ``/generate`` requests so far, and how many of them the servers' prefix caches served
        (SGLang's ``meta_info.cached_tokens``): the prefix-cache hit rate is their ratio."""
        self.episode_moves = 0
        """Turns of multi-turn episodes that went to another server than the episode's previous turn (its server
        failed or was out of rotation)."""
        self.control: SGLangControl = SGLangControl(self.worker_urls, self.config)
        """The control client (pause/resume, memory, cache, ``/server_info``, weight updates) of every worker."""
        self.control.on_lost = self._mark_down  # a worker lost during a weight update: out of rotation, restarted
        self.lora_name: str | None = None
        """The LoRA adapter every ``/generate`` names (``lora_path``), set by :meth:`update_adapter`; None: the base
        model (and merged LoRA weights)."""

    @property
    def generate_urls(self) -> list[str]:
        return [self.router_url] if self.router_url else list(self.worker_urls)

    @property
    def weight_version(self) -> int:
        return self.control.version

    # --------------------------------------------------------------------------------- launching
    @classmethod
    def launch(
        cls,
        servers: Sequence[Any],
        *,
        router: Any = None,
        config: SGLangClientConfig | None = None,
        log_dir: str = ".",
        restart: RestartPolicy | None = None,
    ) -> SGLangEngine:
        """Start SGLang servers (``SGLangServerConfig`` each) and optionally a router, wait until healthy,
        and return an engine that stops them on :meth:`close`. Blocking (call before the event loop)."""
        from gspo_mcore.rollout import sglang_server

        procs = sglang_server.launch_servers(servers, log_dir=log_dir)
        router_proc = None
        try:
            if router is not None:
                router_proc = sglang_server.launch_router(router, [p.url for p in procs], log_dir=log_dir)
        except BaseException:
            for p in procs:
                p.shutdown(timeout_s=5.0)
            raise
        initial = {s.weight_version for s in servers}
        if config is None:
            config = SGLangClientConfig(initial_weight_version=min(initial))
        owned = ([router_proc] if router_proc else []) + procs
        return cls(
            [p.url for p in procs],
            router_url=router_proc.url if router_proc else None,
            config=config,
            processes=owned,
            launched=list(zip(procs, servers)),
            restart=restart,
        )

    async def close(self) -> None:
        """Stop the background monitor, the processes this engine launched (a server being restarted included) and
        close this event loop's pooled connections."""
        self._closing = True
        if self.monitor is not None:
            self.monitor.stop()
        procs, self._processes = self._processes, []
        procs += [e[0] for e in self._launched.values() if e[0] not in procs]
        for p in procs:
            await asyncio.to_thread(p.shutdown)
        await _http.close_pool()

    # -------------------------------------------------------------------------------- generation
    async def generate(self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams) -> list[list[Sample]]:
        check_generate_args(n, params)
        prompts = normalize_prompts(prompts)
        if not prompts:
            return []
        await self._maintain()
        slots, inflight = self._slots()
        tasks = [
            asyncio.create_task(self._generate_group(i, p, n, params, slots, inflight)) for i, p in enumerate(prompts)
        ]
        return await _all_or_first_error(tasks)

    def _slots(self) -> tuple[dict, dict]:
        """Per-call concurrency state: a semaphore and an in-flight count per generate URL."""
        urls = self.generate_urls
        return {u: asyncio.Semaphore(self.config.max_inflight_per_server) for u in urls}, dict.fromkeys(urls, 0)

    async def _generate_group(self, index, prompt, n, params, slots, inflight, *, home=None, stop=()) -> list[Sample]:
        """``n`` samples of ``prompt``; ``home``: the episode affinity of a turn (see :class:`_Home`); ``stop``: a
        turn's stop strings (SGLang's ``sampling_params.stop``)."""
        dims = self.config.routed_experts
        body = api.build_generate_request(
            prompt, n, params, prompt_index=index, routed_experts=dims is not None, lora_name=self.lora_name
        )
        if stop:
            body["sampling_params"]["stop"] = list(stop)
        what = f"prompt {index} ({len(prompt)} tokens, n={n})"
        return await self._request(
            body,
            index,
            what,
            slots,
            inflight,
            lambda answer: [
                api.parse_generate_output(
                    item,
                    prompt_ids=prompt,
                    prompt_index=index,
                    sample_index=j,
                    initial_weight_version=self.config.initial_weight_version,
                    routing_dims=dims,
                )
                for j, item in enumerate(self._count_cache(api.split_generate_outputs(answer, 1, n)[0]))
            ],
            home=home,
        )

    def _count_cache(self, items: list[dict]) -> list[dict]:
        """Add each output's prompt and cached tokens (``meta_info``) to the engine's totals."""
        for item in items:
            meta = item.get("meta_info") if isinstance(item, dict) else None
            if isinstance(meta, dict):
                self.prompt_tokens += int(meta.get("prompt_tokens") or 0)
                self.cached_tokens += int(meta.get("cached_tokens") or 0)
        return items

    async def _request(self, body, index: int, what: str, slots, inflight, parse, *, home: _Home | None = None):
        """POST ``body`` to ``/generate`` with the engine's retries (another server after a transport failure
        or a 5xx); ``parse(decoded JSON)`` of the first good answer (a :class:`ProtocolError` there fails).
        ``home``: an episode's affinity: its server is tried first, and the server that answers becomes it."""
        failures: list[str] = []
        tried: set[str] = set()
        headers = {api.ROUTING_KEY_HEADER: home.key} if home is not None and self.router_url else None
        while len(failures) < self.config.max_attempts:
            url = self._pick_server(tried, inflight, index, what, failures, prefer=home.url if home else None)
            inflight[url] += 1
            try:
                async with slots[url]:
                    if url in self._down:  # failed while this request was queued for it
                        continue
                    resp = await _http.request(
                        "POST",
                        url + api.GENERATE,
                        body,
                        timeout_s=self.config.request_timeout_s,
                        connect_timeout_s=self.config.connect_timeout_s,
                        headers=headers,
                    )
            except _http.TransportError as e:
                failures.append(f"{url}: {e}")
                tried.add(url)
                self._mark_down(url, str(e))
                continue
            finally:
                inflight[url] -= 1
            if resp.status in _RETRYABLE_STATUS:
                failures.append(f"{url}: HTTP {resp.status}: {api.error_message(resp)}")
                tried.add(url)
                continue
            if resp.status != 200:
                raise RolloutError(
                    f"{url}{api.GENERATE} rejected {what}: HTTP {resp.status}: {api.error_message(resp)}"
                )
            try:
                result = parse(api.decode_json(resp))
            except api.ProtocolError as e:
                raise RolloutError(
                    f"malformed response from {url}{api.GENERATE} to {what} (SGLang {api.SGLANG_VERSION} shape "
                    f"expected): {e}"
                ) from None
            if home is not None:
                if home.url is not None and home.url != url:
                    self.episode_moves += 1
                    log.info("episode %s moved from %s to %s", home.key, home.url, url)
                home.url = url
            return result
        raise RolloutError(f"{what} failed after {len(failures)} attempts: " + "; ".join(failures))

    # ------------------------------------------------------------------------------ multi-turn episodes
    async def generate_turns(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        keys: Sequence[int],
        max_total_tokens: int,
        on_turns: OnTurns,
        caps: TurnCaps | None = None,
        stops: TurnStops | None = None,
    ) -> None:
        """Multi-turn episodes, one per prompt (row); the contract of :mod:`gspo_mcore.rollout.turns` (the
        in-process engine's ``generate_turns``, here a coroutine).

        Each turn is one ``/generate`` request whose ``input_ids`` are the row's whole sequence so far (the
        prompt, every sampled id as SGLang returned it, every environment span as ``on_turns`` gave it), so the
        server's radix cache serves the prefix and only the new environment span is prefilled; it samples at
        most ``params.max_new_tokens``, at most what is left of ``max_total_tokens`` and at most the row's cap
        (``caps``, asked as the turn starts), and ends at the row's stop strings (``stops``, sent as SGLang's
        ``sampling_params.stop``: it keeps the token that completes one). Rows run independently:
        whenever requests finish, ``on_turns`` gets their turns (in a thread, so the other rows keep decoding
        while the environments step), and each answered row sends its next turn. Each turn's ``sampling_seed``
        is derived from the row's key and the turn's index. With routed experts asked for (R3), each turn's
        ``routed_experts`` cover the whole sequence so far (SGLang reads them by KV-cache slot, so a prefix the
        radix cache served keeps the routing of the request that computed it)."""
        check_generate_args(1, params)
        rows = normalize_prompts(prompts)
        if len(keys) != len(rows):
            raise ValueError(f"generate_turns: {len(keys)} keys for {len(rows)} prompts")
        too_long = [i for i, p in enumerate(rows) if len(p) >= max_total_tokens]
        if too_long:
            raise ValueError(f"generate_turns: prompt {too_long[0]} leaves no room under max_total_tokens")
        if not rows:
            return
        await self._maintain()
        slots, inflight = self._slots()
        seqs = [list(p) for p in rows]
        turn = [0] * len(rows)
        homes = [_Home(f"episode-{int(k)}") if self.config.episode_affinity else None for k in keys]

        def start(b: int) -> asyncio.Task:
            budget = turn_budget(params.max_new_tokens, max_total_tokens - len(seqs[b]), caps, b)
            turn_params = dataclasses.replace(
                params, max_new_tokens=budget, seed=derive_sample_seed(int(keys[b]), 0, turn[b])
            )
            stop = stops(b) if stops is not None else None
            strings = stop.strings if stop is not None else ()
            return asyncio.create_task(
                self._turn(b, tuple(seqs[b]), turn[b], turn_params, slots, inflight, homes[b], strings)
            )

        pending = {start(b) for b in range(len(rows))}
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                ends = sorted((t.result() for t in done), key=lambda e: e.row)  # raises the first failure
                answers = await asyncio.to_thread(on_turns, ends)
                if len(answers) != len(ends):
                    raise RolloutError(f"on_turns answered {len(answers)} of {len(ends)} turn ends")
                for end, more in zip(ends, answers):
                    b = end.row
                    seqs[b] += end.ids
                    if more is None:
                        continue
                    more = [int(x) for x in more]
                    if len(seqs[b]) + len(more) >= max_total_tokens:
                        raise RolloutError(
                            f"on_turns gave row {b} {len(more)} tokens: no room left under max_total_tokens "
                            f"{max_total_tokens}"
                        )
                    seqs[b] += more
                    turn[b] += 1
                    pending.add(start(b))
        finally:
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _turn(
        self, row: int, seq: tuple[int, ...], turn: int, params: SamplingParams, slots, inflight, home, stop=()
    ):
        """One policy turn of ``row``: sample a continuation of ``seq`` (all of it sent as ``input_ids``) on the
        episode's server (``home``), ending at the ``stop`` strings."""
        sample = (await self._generate_group(row, seq, 1, params, slots, inflight, home=home, stop=stop))[0]
        if sample.finish_reason == "abort":
            raise RolloutError(
                f"episode row {row}, turn {turn}: the SGLang request was aborted (a pause or weight update inside "
                "an episode is not supported)"
            )
        ids = sample.response_ids
        versions = sample.token_versions or (sample.weight_version,) * len(ids)
        return TurnEnd(row, ids, sample.response_logprobs, tuple(versions), sample.finish_reason, sample.routed_experts)

    # ------------------------------------------------------------------------------------ scoring
    async def score(self, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> list[tuple[float, ...]]:
        """A teacher's log-probs of given token ids (nothing is generated): for sequence ``i``,
        ``log p(ids[t] | ids[:t])`` for ``t = starts[i] .. len(ids) - 1`` (``log_softmax`` of the raw logits;
        see :func:`sglang_api.build_score_request`). One request per sequence, with the engine's retries."""
        if len(sequences) != len(starts):
            raise ValueError(f"score: {len(starts)} starts for {len(sequences)} sequences")
        seqs = normalize_prompts(sequences)
        bodies = [api.build_score_request(ids, int(s)) for ids, s in zip(seqs, starts)]
        if not seqs:
            return []
        await self._maintain()
        slots, inflight = self._slots()

        async def one(i: int):
            ids, start = seqs[i], int(starts[i])
            what = f"scoring sequence {i} ({len(ids)} tokens from position {start})"
            return await self._request(
                bodies[i], i, what, slots, inflight, lambda a: api.parse_input_logprobs(a, ids, start, what)
            )

        return await _all_or_first_error([asyncio.create_task(one(i)) for i in range(len(seqs))])

    def _pick_server(self, tried, inflight, index, what, failures, prefer: str | None = None) -> str:
        """``prefer`` (an episode's server) while it is in rotation and not yet tried for this request, else the
        least busy server in rotation (not yet tried, if there is one; ties broken by ``index``)."""
        up = [u for u in inflight if u not in self._down]
        fresh = [u for u in up if u not in tried] or up
        if not fresh:
            down = "; ".join(f"{u}: {why}" for u, why in self._down.items())
            history = f" (attempts: {'; '.join(failures)})" if failures else ""
            raise RolloutError(f"no SGLang server left for {what}; out of rotation: {down}{history}")
        if prefer in fresh and prefer not in tried:
            return prefer
        k = len(fresh)
        return min(fresh, key=lambda u: (inflight[u], (fresh.index(u) - index) % k))

    def _mark_down(self, url: str, why: str) -> None:
        if url not in self._down:
            log.warning("SGLang server %s taken out of rotation: %s", url, why)
            self._down[url] = why
            self._down_since[url] = time.monotonic()
        if url in self.worker_urls:
            self.control.excluded.add(url)  # weight updates go to the others until it answers again

    # ------------------------------------------------------------------ fleet: restarts, versions, rotation
    async def _maintain(self) -> None:
        """Before a generation: restart dead launched servers, probe the ones out of rotation, check every reachable
        worker's weight version (re-syncing a returning one where possible), and refuse to go on below
        ``min_servers``."""
        await self._restart_dead()
        await self._readmit_down_servers()
        await self._check_versions()
        up = [u for u in self.worker_urls if u not in self._down]
        for _ in range(self.restart.attempts + 1):  # bounded: each round waits for restarts or starts them
            if len(up) >= self.restart.min_servers or not self._may_come_back():
                break
            # too few servers, but some are being restarted in the background, or died after the first look at the
            # processes (before their weight version was asked): wait for those restarts, look at the processes again
            # (restarting the dead ones) rather than stop; again if the monitor began a restart in between
            for lock in self._restart_locks.values():
                await asyncio.to_thread(lock.acquire)
                lock.release()
            await self._restart_dead()
            await self._readmit_down_servers()
            await self._check_versions()
            up = [u for u in self.worker_urls if u not in self._down]
        if len(up) < self.restart.min_servers:
            why = "; ".join(f"{u}: {r}" for u, r in self._down.items())
            given_up = "".join(f"\n--- {u} ---\n{r}" for u, r in self._given_up.items())
            raise RolloutError(
                f"only {len(up)} SGLang server(s) in rotation, min_servers is {self.restart.min_servers}; out of "
                f"rotation: {why}{given_up}"
            )

    def _may_come_back(self) -> bool:
        """Whether a launched server out of rotation is being restarted or has restart attempts left."""
        return any(
            url in self._down
            and url not in self._given_up
            and (self._restart_locks[url].locked() or self._restarts[url] < self.restart.attempts)
            for url in self._launched
        )

    async def _restart_dead(self) -> None:
        self._take_background_restarts()
        for url, entry in list(self._launched.items()):
            proc, cfg = entry
            if url in self._given_up or self._restart_locks[url].locked():  # being restarted in the background
                continue
            code = proc.popen.poll()
            silent = url in self._down and url not in self._stale
            stuck = silent and time.monotonic() - self._down_since.get(url, time.monotonic()) >= self.restart.after_s
            if code is None and not stuck:
                continue
            why = f"its process exited with code {code}" if code is not None else "it failed its health probes"
            if self._restarts[url] >= self.restart.attempts:
                self._give_up(url, proc, f"{why}, and no restart attempts are left ({self.restart.attempts} allowed)")
                continue
            self._mark_down(url, why)
            await self._restart(url, why)

    async def _restart(self, url: str, why: str) -> None:
        outcomes: list[tuple[bool, str]] = []
        await asyncio.to_thread(self._restart_now, url, why, lambda ok, w: outcomes.append((ok, w)))
        for ok, w in outcomes:
            self._restarted(url, ok, w)

    def _watched(self) -> dict[str, Any]:
        """The launched servers the monitor watches now: not given up, with restart attempts left, and not being
        restarted (a server still starting does not answer yet)."""
        return {
            url: entry[0]
            for url, entry in list(self._launched.items())
            if url not in self._given_up
            and self._restarts[url] < self.restart.attempts
            and not self._restart_locks[url].locked()
        }

    def _restart_in_background(self, url: str, why: str) -> None:
        """The monitor's restart: the outcome is taken into the engine's state by the next generation or update."""
        self._restart_now(url, why, lambda ok, w: self._restart_outcomes.append((url, ok, w)))

    def _take_background_restarts(self) -> None:
        while self._restart_outcomes:
            url, ok, why = self._restart_outcomes.popleft()
            self._mark_down(url, why)
            self._restarted(url, ok, why)

    def _restarted(self, url: str, ok: bool, why: str) -> None:
        if ok:
            self.restarted += 1
            self._down[url] = f"restarted ({why}); its weights are checked before it serves"
            self._down_since[url] = time.monotonic()
        else:
            self._give_up(url, self._launched[url][0], why)

    def _restart_now(self, url: str, why: str, report: Callable[[bool, str], None]) -> None:
        """Restart the launched server at ``url`` on its port, blocking (run it in a thread), and ``report(True, why)``
        once it is healthy or ``report(False, why)`` when the attempts are used up, before another thread may restart
        it; nothing when another thread is restarting it or the engine is closing. Only the process is touched here:
        ``report`` brings the outcome into the engine's state."""
        from gspo_mcore.rollout import sglang_server

        lock = self._restart_locks[url]
        if not lock.acquire(blocking=False):
            return
        try:
            entry = self._launched[url]
            proc, cfg = entry
            port = int(url.rsplit(":", 1)[1])
            while self._restarts[url] < self.restart.attempts:
                if self._closing:
                    return
                self._restarts[url] += 1
                k = self._restarts[url]
                log.warning("restarting SGLang server %s (%s): attempt %d of %d", url, why, k, self.restart.attempts)
                proc.shutdown(5.0)
                time.sleep(k * self.restart.backoff_s)
                new_cfg = dataclasses.replace(cfg, port=port, log_path=str(proc.log_path))
                new = sglang_server.start_server(new_cfg, name=proc.name)
                self._processes = [new if p is proc else p for p in self._processes]
                entry[0] = new  # so close() and the next attempt stop this one
                if self._closing:
                    new.shutdown(5.0)
                    return
                try:
                    new.wait_healthy(cfg.startup_timeout_s)
                except sglang_server.ServerLaunchError as e:
                    log.warning("restart of %s failed: %s", url, e)
                    proc = new
                    why = str(e).split(";", 1)[0]
                    continue
                return report(True, why)
            report(False, f"{why}; {self.restart.attempts} restart attempt(s) failed")
        finally:
            lock.release()

    def _give_up(self, url: str, proc, why: str) -> None:
        log.error("SGLang server %s given up: %s", url, why)
        self._given_up[url] = f"{why}; last lines of {proc.log_path}:\n{proc.log_tail(20)}"
        self._down[url] = f"given up: {why}"
        self.control.excluded.add(url)

    async def _check_versions(self) -> None:
        """Every reachable worker must report the version last synced; a returning one is re-synced if the client
        can do it alone (the last sync came from disk), else it waits out of rotation for the next weight update."""
        want = self.control.version

        async def check(url: str) -> None:
            try:
                have = await self.control.weight_version_of(url)
                if have < want and await self.control.resync(url):
                    log.info("SGLang server %s re-synced to weight version %d", url, want)
                    have = want
            except RolloutError as e:
                self._stale.discard(url)
                self._mark_down(url, str(e).removeprefix(f"{url}{api.MODEL_INFO} failed: "))
                return
            if have >= want:  # newer: an update is landing right now (asynchronous rollouts)
                if url in self._down:
                    log.info("SGLang server %s serves weight version %d; back in rotation", url, have)
                self._stale.discard(url)
                self._down.pop(url, None)
                self._down_since.pop(url, None)
            else:
                self._stale.add(url)
                self._down[url] = (
                    f"serves weight version {have}, not {want} (out of rotation until it gets the current weights)"
                )
                self._down_since.setdefault(url, time.monotonic())

        urls = [u for u in self.worker_urls if u not in self.control.excluded and u not in self._given_up]
        await asyncio.gather(*(check(u) for u in urls))
        if self.router_url:
            stale = [u for u in self.worker_urls if u in self._stale]
            if stale:
                raise RolloutError(
                    f"SGLang worker(s) {stale} behind the router {self.router_url} do not serve weight version {want} "
                    f"({'; '.join(self._down[u] for u in stale)}): the router would send them requests"
                )

    async def _readmit_down_servers(self) -> None:
        """Probe the servers out of rotation for a transport failure; one that answers is reachable again (its weight
        version is checked next, before it is back in rotation)."""
        probe = [u for u in self._down if u not in self._stale and u not in self._given_up]
        if not probe:
            return
        results = await asyncio.gather(*(self._probe(u) for u in probe))
        for url, ok in results:
            if ok:
                log.info("SGLang server %s passed %s", url, self.config.probe_path)
                self.control.excluded.discard(url)
                if url not in self.worker_urls:  # the router: no weights of its own
                    self._down.pop(url, None)

    async def _probe(self, url: str) -> tuple[str, bool]:
        path = api.HEALTH if url == self.router_url else self.config.probe_path
        try:
            resp = await _http.request(
                "GET",
                url + path,
                timeout_s=self.config.probe_timeout_s,
                connect_timeout_s=self.config.connect_timeout_s,
            )
        except _http.TransportError:
            return url, False
        return url, resp.status == 200

    async def health(self) -> dict[str, bool]:
        """Probe every worker (and the router); a healthy one is put back in rotation."""
        urls = list(dict.fromkeys(self.worker_urls + self.generate_urls))
        results = dict(await asyncio.gather(*(self._probe(u) for u in urls)))
        for url, ok in results.items():
            if ok and url not in self._given_up:
                self.control.excluded.discard(url)
                if url not in self.worker_urls:
                    self._down.pop(url, None)
        await self._check_versions()
        return results

    # ----------------------------------------------------------------- control (all workers)
    # The engine's RolloutEngine methods below use its control client; every other control call (memory,
    # cache, /server_info, the weight-update group, the explicit update paths) is made on ``engine.control``.
    async def pause(self) -> None:
        await self.control.pause()

    async def resume(self) -> None:
        await self.control.resume()

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        await self._before_update()
        await self.control.update_from_disk(path, version)

    async def update_weights(self, buckets: Iterable[NamedTensors], version: int) -> None:
        """Through the weight-update group if ``control.init_group`` set one up with a ``broadcast`` callback,
        else as serialized tensors (colocated servers)."""
        await self._before_update()
        group = self.control.group
        if group is not None and group.broadcast is not None:
            await self.control.update_from_distributed(buckets, version, broadcast=group.broadcast)
        else:
            await self.control.update_from_tensor(buckets, version)

    async def update_adapter(
        self,
        version: int,
        *,
        tensors: dict | None = None,
        config_dict: dict | None = None,
        path: str | None = None,
    ) -> str:
        """SGLang's adapter path: load LoRA adapter ``version`` on every server under a new name
        (:func:`~gspo_mcore.rollout.sglang_lora.adapter_name`; SGLang loads a name once), tag the servers
        ``version``, name it in every later ``/generate``, then unload the previous version. Returns the name."""
        from gspo_mcore.rollout.sglang_lora import adapter_name

        name = adapter_name(version)
        previous = self.lora_name
        if previous == name:
            raise ValueError(f"LoRA adapter version {version} is already loaded as {name!r}")
        await self._before_update()
        await self.control.update_adapter(name, version, tensors=tensors, config_dict=config_dict, path=path)
        self.lora_name = name
        if previous is not None:
            try:
                await self.control.unload_adapter(previous)
            except RolloutError as e:  # a leftover adapter only holds memory; requests name the new one
                log.warning("could not unload the previous LoRA adapter %r: %s", previous, e)
        return name

    async def _before_update(self) -> None:
        """A weight update goes to every reachable worker: restart dead launched servers and probe the unreachable
        ones first, so a returning server gets the weights with the others. A server the monitor is restarting now is
        left out (it gets the weights when it is back); one lost during the update is dropped from it while any
        worker remains (:attr:`SGLangControl.min_live` = 1). ``min_servers`` is a rule for serving, not for updating:
        the next generation restarts the dropped server (or waits for its restart) and re-syncs it first, and stops
        the run there if fewer than ``min_servers`` can serve."""
        await self._restart_dead()
        await self._readmit_down_servers()
        for url, lock in self._restart_locks.items():
            if lock.locked():
                self._mark_down(url, "being restarted in the background")
        self.control.min_live = 1

    async def check_routed_experts(self) -> None:
        """Refuse servers that cannot return routed experts when the client asks for them (R3)."""
        if self.config.routed_experts is None:
            return
        for url, info in (await self.control.server_info(refresh=True)).items():
            if not info.routed_experts:
                raise RolloutError(
                    f"routing.replay=rollout: the SGLang server {url} was not started with "
                    "--enable-return-routed-experts (its /server_info has enable_return_routed_experts=false), "
                    "so it cannot return the experts it routed each token to"
                )


@dataclasses.dataclass
class _Home:
    """An episode's affinity: ``key`` (sent to a router as the routing key) and ``url``, the generate URL that
    answered its last turn (``None`` before its first)."""

    key: str
    url: str | None = None


async def _all_or_first_error(tasks: list[asyncio.Task]) -> list:
    """Every task's result in order, or (the others cancelled) the first failure in task order."""
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for t in tasks:
        if not t.cancelled() and t.exception() is not None:
            raise t.exception()
    return [t.result() for t in tasks]
