"""The in-process rollout engine: samples from the learner's own model on the same ranks.

The embedded default on CPU and in tests. It needs no weight sync (it reads the live parameters) and
knows nothing of Megatron: it drives a :class:`DecodeModel`, a prefill over the (left-padded) prompts
followed by one-token decode steps over a KV cache, which the learner provides for its ``GPTModel``
(:func:`gspo_mcore.learner.inference.decode_model`). :class:`RecomputeModel` implements the same protocol
over a plain ``logits_fn(tokens [B, L]) -> logits [B, L, V]`` by recomputing every sequence for every
token (no cache): the pure-torch reference, and the benchmark's baseline.

Every rank of a tensor-parallel group must call :meth:`InProcessEngine.generate_sync` with the same
prompts, seed and prompt offset: every rank then draws the same tokens.

Sampling is layout independent: the random numbers of sample ``j`` of the prompt at global index ``i``
come from a counter-based stream keyed by ``derive_sample_seed(seed, i, j)`` and the decoding step, and
each token is drawn by inverse CDF over that row's own (truncated) distribution. The samples therefore do
not depend on how prompts are split over data-parallel ranks or chunked into batches (as long as the
model's logits for a row do not: a real model's float rounding may differ with the batch composition
by about 1e-7, which can flip a draw that lands that close to a CDF boundary).

Log-probs follow the convention in :mod:`gspo_mcore.rollout.types`: ``log softmax(logits / tau)`` of the
drawn token over the untruncated vocabulary, ``tau = 1`` when greedy.

Shared prefill: the rows of a batch that hold the same prompt (the samples of a group, the episodes of a group)
start from one prefill of it: the model prefills each distinct prompt once and the session's ``select`` copies
its cache to every row of that prompt before the first token is drawn (``share_prefill=False``: one prefill row
per sample, the reference for the tests and the benchmark).

Threads: decoding is many small operations per token (a few rows, one position each), which gain little from
intra-op threads and, on a CPU that other jobs share, lose a lot: each operation waits at a thread barrier for a
thread the scheduler has not run yet. ``decode_threads=k`` runs prefill and decoding with ``k`` torch threads
(``torch.set_num_threads``) and restores the caller's count afterwards, so the learner's update keeps its own.
On the 2-core machine of docs/results/agent-multihop.md, loaded by other jobs, 2 threads made small bf16
matmuls some 25 times slower than 1 (big ones 3 times); that, not the evaluation, made its evaluation crawl.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

import numpy as np
import torch

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

LogitsFn = Callable[[torch.Tensor], torch.Tensor]


class DecodeSession(Protocol):
    """One batch being decoded: the model's cache for its rows."""

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token to every row: ``tokens [B] int64 -> next-token logits [B, V]``."""

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (indices into the current batch, int64); later calls see ``len(rows)`` rows. An index
        may repeat: the new rows are copies of that row (the engine gives a prompt's prefill to each of its
        samples so); dropping finished rows passes increasing indices."""

    def extend(self, tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        """Multi-turn episodes (optional): append ``tokens[b]`` (any number, 0 included) to row ``b``, after what
        the row holds, without recomputing it -> the logits after each row's last token ``[B, V]`` (rows given
        no token: any values). Rows then hold different numbers of tokens; :meth:`step` is not used again."""


class DecodeModel(Protocol):
    """What the engine needs from a model: a prefill that starts a :class:`DecodeSession`."""

    own_cache: bool
    """Whether its sessions keep the KV cache themselves, so that :meth:`DecodeSession.extend` can append any
    number of tokens to a row (multi-turn episodes need it; Transformer Engine's attention does not allow it)."""

    def start(
        self, tokens: torch.Tensor, lengths: torch.Tensor, max_new_tokens: int
    ) -> tuple[DecodeSession, torch.Tensor]:
        """Prefill ``tokens [B, P] int64``, LEFT-padded: row ``b``'s prompt is in its last ``lengths[b]``
        columns and the padding before it must not influence anything (positions count from the first
        prompt token). The session must have room for ``max_new_tokens - 1`` further steps.
        Returns the session and the next-token logits ``[B, V]``."""


class RecomputeModel:
    """:class:`DecodeModel` over ``logits_fn(tokens [B, L]) -> logits [B, L, V]`` (causal, right padding
    allowed): every step recomputes the whole batch. Exact but quadratic in the length."""

    own_cache = True
    """It recomputes every row from its tokens, so rows can be extended."""

    def __init__(self, logits_fn: LogitsFn, *, pad_token_id: int = 0):
        self.logits_fn = logits_fn
        self.pad_token_id = pad_token_id

    def start(self, tokens: torch.Tensor, lengths: torch.Tensor, max_new_tokens: int):
        B, P = tokens.shape
        right = torch.full((B, P + max_new_tokens), self.pad_token_id, dtype=torch.long)  # (B, P + N)
        for b in range(B):
            n = int(lengths[b])
            right[b, :n] = tokens[b, P - n :]
        session = _RecomputeSession(self.logits_fn, right, lengths.clone().long())
        return session, session.last_logits()


class _RecomputeSession:
    def __init__(self, logits_fn: LogitsFn, tokens: torch.Tensor, lengths: torch.Tensor):
        self.logits_fn, self.tokens, self.lengths = logits_fn, tokens, lengths  # (B, L_max), (B,)

    def last_logits(self) -> torch.Tensor:
        B, width = self.tokens.shape[0], int(self.lengths.max())
        logits = self.logits_fn(self.tokens[:, :width])  # (B, width, V)
        if logits.dim() != 3 or logits.shape[:2] != (B, width):
            raise RolloutError(
                f"in-process engine: logits_fn returned shape {tuple(logits.shape)}, expected ({B}, {width}, V)"
            )
        return logits[torch.arange(B), self.lengths - 1]  # (B, V)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.tokens[torch.arange(len(tokens)), self.lengths] = tokens
        self.lengths = self.lengths + 1
        return self.last_logits()

    def select(self, rows: torch.Tensor) -> None:
        self.tokens, self.lengths = self.tokens[rows], self.lengths[rows]

    def extend(self, tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        k = torch.tensor([len(t) for t in tokens], dtype=torch.long)  # (B,)
        need = int((self.lengths + k).max())
        if need > self.tokens.shape[1]:  # grow the right padding
            grown = self.tokens.new_zeros((self.tokens.shape[0], need))
            grown[:, : self.tokens.shape[1]] = self.tokens
            self.tokens = grown
        for b, t in enumerate(tokens):
            if len(t):
                self.tokens[b, int(self.lengths[b]) : int(self.lengths[b]) + len(t)] = torch.tensor(list(t))
        self.lengths = self.lengths + k
        return self.last_logits()


class InProcessEngine(RolloutEngine):
    """Sampling from a local model through a :class:`DecodeModel`.

    Args:
        model: a :class:`DecodeModel`, or a plain ``logits_fn`` (wrapped in :class:`RecomputeModel`).
        eos_token_id: ends a response (kept as its last token, with its log-prob) unless ``ignore_eos``.
        vocab_size: ids ``>= vocab_size`` (a padded embedding table) are never sampled; ``None``: all.
        pad_token_id: filler for the left padding of prompts and the rows that have finished.
        max_batch_size: rows per pass (prompts x samples are chunked, whole groups together).
        compact_below: once the unfinished rows of a batch fall to this fraction of the session's rows,
            the finished ones are dropped from the cache (``DecodeSession.select``); 0 never drops them.
        share_prefill: prefill each distinct prompt of a batch once and copy its cache to the rows that hold it
            (``DecodeSession.select`` with repeated rows); ``False``: one prefill row per sample.
        decode_threads: torch's intra-op threads while prefilling and decoding (restored afterwards); ``None``:
            the caller's count.
    """

    def __init__(
        self,
        model: DecodeModel | LogitsFn,
        *,
        eos_token_id: int,
        vocab_size: int | None = None,
        pad_token_id: int = 0,
        max_batch_size: int = 512,
        version: int = 0,
        compact_below: float = 0.75,
        share_prefill: bool = True,
        decode_threads: int | None = None,
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if decode_threads is not None and not (isinstance(decode_threads, int) and decode_threads >= 1):
            raise ValueError(f"decode_threads must be None or an integer >= 1, got {decode_threads!r}")
        if not 0 <= compact_below <= 1:
            raise ValueError(f"compact_below must be in [0, 1], got {compact_below}")
        self.model: DecodeModel = model if hasattr(model, "start") else RecomputeModel(model, pad_token_id=pad_token_id)
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.compact_below = compact_below
        self.share_prefill = share_prefill
        self.decode_threads = decode_threads
        self._version = version
        self._paused = False
        self._calls = 0

    @property
    def weight_version(self) -> int:
        return self._version

    def set_weight_version(self, version: int) -> None:
        """The model's parameters changed in place (a training step): tag what follows with ``version``."""
        self._version = version

    async def generate(self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams) -> list[list[Sample]]:
        return self.generate_sync(prompts, n, params)

    def generate_sync(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams, *, prompt_offset: int = 0
    ) -> list[list[Sample]]:
        """``n`` samples per prompt. ``prompt_offset``: the global index of ``prompts[0]`` (a data-parallel
        rank's share starts there), so that sample ``j`` of global prompt ``i`` is drawn from the same
        random numbers whatever the split. ``Sample.prompt_index`` stays local (``0 .. len(prompts)-1``)."""
        check_generate_args(n, params)
        if self._paused:
            raise RolloutError("in-process engine: generate() called while paused")
        if not (isinstance(prompt_offset, int) and prompt_offset >= 0):
            raise ValueError(f"prompt_offset must be an integer >= 0, got {prompt_offset!r}")
        prompts = normalize_prompts(prompts)
        rows = [(i, j) for i in range(len(prompts)) for j in range(n)]
        seed = params.seed if params.seed is not None else self._calls
        self._calls += 1
        out: list[list[Sample | None]] = [[None] * n for _ in prompts]
        for start in range(0, len(rows), self.max_batch_size):
            chunk = rows[start : start + self.max_batch_size]
            keys = np.array([derive_sample_seed(seed, prompt_offset + i, j) for i, j in chunk], dtype=np.int64)
            with self._threads():
                decoded = self._decode([prompts[i] for i, _ in chunk], params, keys.view(np.uint64))
            for (i, j), (ids, lps, reason) in zip(chunk, decoded):
                out[i][j] = Sample(
                    prompt_index=i,
                    sample_index=j,
                    prompt_ids=prompts[i],
                    response_ids=tuple(ids),
                    response_logprobs=tuple(lps),
                    finish_reason=reason,
                    weight_version=self._version,
                )
        return out  # type: ignore[return-value]

    def _start(self, prompts: Sequence[tuple[int, ...]], max_new_tokens: int) -> tuple[DecodeSession, torch.Tensor]:
        """A session over one row per prompt and the first next-token logits ``[B, V]``. With ``share_prefill``
        the model prefills each distinct prompt once (left-padded) and ``select`` copies its cache to the rows
        that hold it."""
        distinct: dict[tuple[int, ...], int] = {}
        inverse = [distinct.setdefault(p, len(distinct)) for p in prompts]  # each row's distinct prompt
        first = list(distinct) if self.share_prefill else list(prompts)
        lengths = torch.tensor([len(p) for p in first])  # (U,)
        P = int(lengths.max())
        tokens = torch.full((len(first), P), self.pad_token_id, dtype=torch.long)  # (U, P), left padding
        for u, p in enumerate(first):
            tokens[u, P - len(p) :] = torch.tensor(p)
        session, logits = self.model.start(tokens, lengths, max_new_tokens)
        if len(first) < len(prompts):
            if logits.dim() != 2 or logits.shape[0] != len(first):
                raise RolloutError(
                    f"in-process engine: the model's prefill returned logits of shape {tuple(logits.shape)}, "
                    f"expected ({len(first)}, V)"
                )
            rows = torch.tensor(inverse, dtype=torch.long)  # (B,)
            session.select(rows)
            logits = logits[rows]
        return session, logits

    @torch.no_grad()
    def _decode(self, prompts: list[tuple[int, ...]], params: SamplingParams, keys: np.ndarray):
        B = len(prompts)
        stop_ids = torch.tensor(
            sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else {self.eos_token_id})), dtype=torch.long
        )
        session, logits = self._start(prompts, params.max_new_tokens)
        out_ids = torch.full((B, params.max_new_tokens), -1, dtype=torch.long)  # (B, N)
        out_lps = torch.zeros((B, params.max_new_tokens), dtype=torch.float32)  # (B, N)
        finished = torch.zeros(B, dtype=torch.bool)
        live = torch.arange(B)  # the session's rows, as indices into the batch
        tau = params.logprob_temperature
        steps = 0
        for t in range(params.max_new_tokens):
            if logits.dim() != 2 or logits.shape[0] != len(live):
                raise RolloutError(
                    f"in-process engine: the model returned logits of shape {tuple(logits.shape)}, "
                    f"expected ({len(live)}, V)"
                )
            last = logits.float()  # (B_live, V)
            if self.vocab_size is not None and last.shape[1] > self.vocab_size:
                last[:, self.vocab_size :] = -torch.inf
            nxt = draw_tokens(last, params, _uniforms(keys[live.numpy()], t))  # (B_live,)
            lp = torch.log_softmax(last / tau, dim=-1).gather(1, nxt[:, None]).squeeze(1)  # (B_live,)
            active = ~finished[live]  # (B_live,)
            rows = live[active]
            out_ids[rows, t], out_lps[rows, t] = nxt[active], lp[active]
            steps = t + 1
            finished[rows] = torch.isin(nxt[active], stop_ids)
            if bool(finished.all()) or t + 1 == params.max_new_tokens:
                break
            feed = torch.where(finished[live], self.pad_token_id, nxt)  # (B_live,)
            alive = ~finished[live]
            if int(alive.sum()) <= self.compact_below * len(live):
                keep = torch.nonzero(alive).squeeze(1)
                session.select(keep)
                live, feed = live[keep], feed[keep]
            logits = session.step(feed)
        results = []
        for b in range(B):
            ids = out_ids[b, :steps]
            n = int((ids >= 0).sum())
            results.append((ids[:n].tolist(), out_lps[b, :n].tolist(), "stop" if bool(finished[b]) else "length"))
        return results

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
        """Multi-turn episodes, one per prompt (row), decoded together whatever turn each is at. A coroutine like
        every engine's (:meth:`RolloutEngine.generate_turns`) that decodes in place, without yielding: ``on_turns``
        is called on the caller's thread (tensor-parallel ranks broadcast inside it).

        Each policy turn samples at most ``params.max_new_tokens`` tokens, at most what is left of the row's
        ``max_total_tokens`` and at most the row's cap (``caps``), and ends at the row's stop strings (``stops``:
        the engine has no tokenizer, so it asks the turn's ``TurnStop.hit`` after each token it samples); when turns
        end, ``on_turns`` (see :mod:`gspo_mcore.rollout.turns`) gives each row's next environment span, which is
        prefilled onto the row's KV cache with the turn's last sampled token (nothing before it is recomputed), or
        ends the row.
        ``keys[i]``: row ``i``'s sampling key (as :func:`derive_sample_seed`); its ``t``-th sampled token, over all
        its turns, is drawn from the ``t``-th number of that key's stream, so an episode does not depend on the
        batch it shares."""
        if self._paused:
            raise RolloutError("in-process engine: generate_turns() called while paused")
        check_generate_args(1, params)
        prompts = normalize_prompts(prompts)
        if len(keys) != len(prompts):
            raise ValueError(f"generate_turns: {len(keys)} keys for {len(prompts)} prompts")
        too_long = [i for i, p in enumerate(prompts) if len(p) >= max_total_tokens]
        if too_long:
            raise ValueError(f"generate_turns: prompt {too_long[0]} leaves no room under max_total_tokens")
        for start in range(0, len(prompts), self.max_batch_size):
            stop = min(start + self.max_batch_size, len(prompts))
            chunk_keys = np.array(list(keys[start:stop]), dtype=np.int64).view(np.uint64)

            def shifted(ends, _start=start):
                ends = [TurnEnd(e.row + _start, e.ids, e.logprobs, e.versions, e.finish_reason) for e in ends]
                return on_turns(ends)

            chunk_caps = None if caps is None else (lambda b, _start=start: caps(b + _start))
            chunk_stops = None if stops is None else (lambda b, _start=start: stops(b + _start))
            with self._threads():  # on_turns (the environment) runs inside: it does not compute with torch
                self._decode_turns(
                    prompts[start:stop], params, chunk_keys, max_total_tokens, shifted, chunk_caps, chunk_stops
                )

    @contextlib.contextmanager
    def _threads(self) -> Iterator[None]:
        """torch's intra-op thread count set to ``decode_threads`` inside (unchanged with ``None``), restored after."""
        before = torch.get_num_threads()
        if self.decode_threads is None or self.decode_threads == before:
            yield
            return
        torch.set_num_threads(self.decode_threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    @torch.no_grad()
    def _decode_turns(
        self,
        prompts,
        params: SamplingParams,
        keys: np.ndarray,
        max_total: int,
        on_turns,
        caps: TurnCaps | None,
        stops: TurnStops | None = None,
    ) -> None:
        B = len(prompts)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else {self.eos_token_id})
        session, logits = self._start(prompts, max_total - min(len(p) for p in prompts) + 1)
        if not hasattr(session, "extend"):
            raise RolloutError(f"in-process engine: the decode model {type(self.model).__name__} cannot extend rows")
        total = [len(p) for p in prompts]  # tokens each row holds, its pending sampled token included
        drawn = np.zeros(B, dtype=np.int64)  # tokens each row has sampled, over all its turns
        turn_ids: list[list[int]] = [[] for _ in range(B)]
        turn_lps: list[list[float]] = [[] for _ in range(B)]
        budget = [turn_budget(params.max_new_tokens, max_total - n, caps, b) for b, n in enumerate(total)]
        stop_at = [stops(b) if stops is not None else None for b in range(B)]  # each row's turn's TurnStop
        live = list(range(B))  # the session's rows, as row indices
        running = set(live)
        tau = params.logprob_temperature
        while running:
            last = logits.float()  # (B_live, V)
            if last.dim() != 2 or last.shape[0] != len(live):
                raise RolloutError(
                    f"in-process engine: the model returned logits of shape {tuple(last.shape)}, "
                    f"expected ({len(live)}, V)"
                )
            if self.vocab_size is not None and last.shape[1] > self.vocab_size:
                last[:, self.vocab_size :] = -torch.inf
            idx = np.array(live)
            nxt = draw_tokens(last, params, _uniforms(keys[idx], drawn[idx]))  # (B_live,)
            lp = torch.log_softmax(last / tau, dim=-1).gather(1, nxt[:, None]).squeeze(1)  # (B_live,)
            feeds: list[list[int]] = [[] for _ in live]
            ends = []
            for i, b in enumerate(live):
                if b not in running:
                    continue
                t = int(nxt[i])
                turn_ids[b].append(t)
                turn_lps[b].append(float(lp[i]))
                drawn[b] += 1
                total[b] += 1
                feeds[i] = [t]
                stopped = t in stop_ids or (stop_at[b] is not None and stop_at[b].hit(turn_ids[b]))
                if stopped or len(turn_ids[b]) >= budget[b]:
                    reason = "stop" if stopped else "length"
                    ends.append(
                        TurnEnd(b, tuple(turn_ids[b]), tuple(turn_lps[b]), (self._version,) * len(turn_ids[b]), reason)
                    )
            if ends:
                answers = on_turns(ends)
                if len(answers) != len(ends):
                    raise RolloutError(f"on_turns answered {len(answers)} of {len(ends)} turn ends")
                position = {b: i for i, b in enumerate(live)}
                for end, more in zip(ends, answers):
                    b = end.row
                    turn_ids[b], turn_lps[b] = [], []
                    if more is None:
                        running.discard(b)
                        feeds[position[b]] = []
                        continue
                    more = [int(x) for x in more]
                    if total[b] + len(more) >= max_total:
                        raise RolloutError(
                            f"on_turns gave row {b} {len(more)} tokens: no room left under max_total_tokens {max_total}"
                        )
                    feeds[position[b]] += more
                    total[b] += len(more)
                    budget[b] = turn_budget(params.max_new_tokens, max_total - total[b], caps, b)
                    stop_at[b] = stops(b) if stops is not None else None
            if not running:
                break
            if len(running) <= self.compact_below * len(live):
                keep = [i for i, b in enumerate(live) if b in running]
                session.select(torch.tensor(keep, dtype=torch.long))
                live, feeds = [live[i] for i in keep], [feeds[i] for i in keep]
            logits = session.extend(feeds)

    async def update_weights(self, buckets: Iterable[NamedTensors], version: int) -> None:
        raise RolloutError(
            "the in-process engine samples from the learner's live parameters: "
            "use set_weight_version() after an optimizer step instead of a weight update"
        )

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        await self.update_weights((), version)

    async def pause(self) -> None:
        self._paused = True

    async def resume(self) -> None:
        self._paused = False

    async def health(self) -> dict[str, bool]:
        return {"in-process": not self._paused}

    async def close(self) -> None:
        self._paused = True


def truncated_logits(last: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``last / T`` with every token outside the top-k and the top-p nucleus set to ``-inf``: the
    distribution tokens are drawn from (``last [B, V]`` float32; ``T > 0``). Ties at the k-th value are
    all kept; the nucleus is the smallest prefix of the sorted distribution whose mass reaches ``top_p``."""
    z = last / params.temperature  # (B, V)
    if 0 < params.top_k < z.shape[1]:
        kth = torch.topk(z, params.top_k, dim=-1).values[:, -1:]  # (B, 1)
        z = z.masked_fill(z < kth, -torch.inf)
    if params.top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        drop = probs.cumsum(-1) - probs > params.top_p  # keep the smallest prefix with mass >= top_p
        z = torch.full_like(z, -torch.inf).scatter(1, order, sorted_z.masked_fill(drop, -torch.inf))
    return z


def draw_tokens(last: torch.Tensor, params: SamplingParams, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``last [B, V]`` (raw logits, float32) from ``softmax(last / T)`` truncated by
    top-k / top-p, by inverse CDF at ``u [B]`` (float64 in [0, 1)); greedy (argmax) when ``T == 0``."""
    if params.temperature == 0:
        return last.argmax(dim=-1)
    probs = torch.softmax(truncated_logits(last, params).double(), dim=-1)  # (B, V) float64
    cdf = probs.cumsum(-1)  # (B, V); flat over excluded tokens, so they are never the first above u
    target = (u.double() * cdf[:, -1])[:, None]  # (B, 1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)  # first index with cdf > target
    # cdf rises only at tokens with a positive probability, so idx is one of them, or V where the target rounded
    # up to the total mass: there, the last token with a positive probability
    over = torch.nonzero(idx == last.shape[1]).squeeze(1)
    if len(over):
        idx[over] = last.shape[1] - 1 - (probs[over] > 0).flip(-1).to(torch.uint8).argmax(-1)
    return idx


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _uniforms(keys: np.ndarray, step) -> torch.Tensor:
    """Counter-based uniforms in [0, 1), one per key (uint64): SplitMix64 of ``key + (step + 1) * golden``
    (``step``: an int, or one per key)."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps modulo 2**64
        z = keys + (np.asarray(step, dtype=np.uint64) + np.uint64(1)) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        z = z ^ (z >> np.uint64(31))
    return torch.from_numpy((z >> np.uint64(11)).astype(np.float64) * 2.0**-53)  # (B,)
