"""The in-process rollout engine: samples from the learner's own model on the same ranks.

The embedded default on CPU and in tests. It needs no weight sync (it reads the live parameters) and
knows nothing of Megatron: it is given ``logits_fn(tokens [B, L] int64) -> logits [B, L, V]`` (the full
vocabulary, gathered), which the learner provides (:func:`gspo_mcore.learner.inference.logits_fn`). Every
rank of a tensor-parallel group must call :meth:`InProcessEngine.generate` with the same prompts and seed:
the sampler is seeded identically, so all of them draw the same tokens.

Each decoding step recomputes the forward pass over the whole batch (no KV cache): correctness first;
the tiny CPU models this engine serves have prompts of a few dozen tokens. Batch whole groups together:
per-call overhead dominates at small batch sizes.

Log-probs follow the convention in :mod:`gspo_mcore.rollout.types`: ``log softmax(logits / tau)`` of the
drawn token over the untruncated vocabulary, ``tau = 1`` when greedy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from gspo_mcore.rollout.types import (
    NamedTensors,
    RolloutEngine,
    RolloutError,
    Sample,
    SamplingParams,
    check_generate_args,
    normalize_prompts,
)

LogitsFn = Callable[[torch.Tensor], torch.Tensor]


class InProcessEngine(RolloutEngine):
    """Sampling from a local model through ``logits_fn``.

    Args:
        logits_fn: ``tokens [B, L] -> logits [B, L, V]``, causal, right padding allowed.
        eos_token_id: ends a response (kept as its last token, with its log-prob) unless ``ignore_eos``.
        vocab_size: ids ``>= vocab_size`` (a padded embedding table) are never sampled; ``None``: all.
        pad_token_id: filler for finished rows and right padding.
        max_batch_size: rows per forward pass (prompts x samples are chunked).
    """

    def __init__(self, logits_fn: LogitsFn, *, eos_token_id: int, vocab_size: int | None = None,
                 pad_token_id: int = 0, max_batch_size: int = 512, version: int = 0):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self._logits_fn = logits_fn
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
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

    def generate_sync(self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams) -> list[list[Sample]]:
        check_generate_args(n, params)
        if self._paused:
            raise RolloutError("in-process engine: generate() called while paused")
        prompts = normalize_prompts(prompts)
        rows = [(i, j) for i in range(len(prompts)) for j in range(n)]
        seed = params.seed if params.seed is not None else self._calls
        self._calls += 1
        gen = torch.Generator().manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
        out: list[list[Sample | None]] = [[None] * n for _ in prompts]
        for start in range(0, len(rows), self.max_batch_size):
            chunk = rows[start:start + self.max_batch_size]
            for (i, j), (ids, lps, reason) in zip(chunk, self._decode([prompts[i] for i, _ in chunk], params, gen)):
                out[i][j] = Sample(prompt_index=i, sample_index=j, prompt_ids=prompts[i], response_ids=tuple(ids),
                                   response_logprobs=tuple(lps), finish_reason=reason, weight_version=self._version)
        return out  # type: ignore[return-value]

    @torch.no_grad()
    def _decode(self, prompts: list[tuple[int, ...]], params: SamplingParams, gen: torch.Generator):
        B = len(prompts)
        lengths = torch.tensor([len(p) for p in prompts])  # (B,)
        total = int(lengths.max()) + params.max_new_tokens
        tokens = torch.full((B, total), self.pad_token_id, dtype=torch.long)  # (B, L_max)
        for b, p in enumerate(prompts):
            tokens[b, :len(p)] = torch.tensor(p)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else {self.eos_token_id})
        responses: list[list[int]] = [[] for _ in range(B)]
        logprobs: list[list[float]] = [[] for _ in range(B)]
        reasons = ["length"] * B
        active = torch.ones(B, dtype=torch.bool)
        tau = params.logprob_temperature
        for _ in range(params.max_new_tokens):
            width = int(lengths.max())
            logits = self._logits_fn(tokens[:, :width])  # (B, width, V)
            if logits.dim() != 3 or logits.shape[:2] != (B, width):
                raise RolloutError(f"in-process engine: logits_fn returned shape {tuple(logits.shape)}, "
                                   f"expected ({B}, {width}, V)")
            last = logits[torch.arange(B), lengths - 1].float()  # (B, V)
            if self.vocab_size is not None and last.shape[1] > self.vocab_size:
                last[:, self.vocab_size:] = -torch.inf
            logp_all = torch.log_softmax(last / tau, dim=-1)  # (B, V)
            nxt = self._draw(last, params, gen)  # (B,)
            lp = logp_all.gather(1, nxt[:, None]).squeeze(1)
            for b in torch.nonzero(active).squeeze(1).tolist():
                t = int(nxt[b])
                responses[b].append(t)
                logprobs[b].append(float(lp[b]))
                tokens[b, lengths[b]] = t
                if t in stop_ids:
                    reasons[b] = "stop"
                    active[b] = False
            lengths = lengths + active.long()
            if not bool(active.any()):
                break
        return list(zip(responses, logprobs, reasons))

    @staticmethod
    def _draw(last: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> torch.Tensor:
        """Draw one token per row from ``softmax(last / T)`` truncated by top-k and top-p."""
        if params.temperature == 0:
            return last.argmax(dim=-1)
        z = last / params.temperature
        if params.top_k > 0 and params.top_k < z.shape[1]:
            kth = torch.topk(z, params.top_k, dim=-1).values[:, -1:]
            z = z.masked_fill(z < kth, -torch.inf)
        if params.top_p < 1.0:
            sorted_z, order = torch.sort(z, dim=-1, descending=True)
            probs = torch.softmax(sorted_z, dim=-1)
            drop = probs.cumsum(-1) - probs > params.top_p  # keep the smallest prefix with mass >= top_p
            sorted_z = sorted_z.masked_fill(drop, -torch.inf)
            z = torch.full_like(z, -torch.inf).scatter(1, order, sorted_z)
        probs = torch.softmax(z, dim=-1)
        return torch.multinomial(probs, 1, generator=gen).squeeze(1)

    async def update_weights(self, buckets: Iterable[NamedTensors], version: int) -> None:
        raise RolloutError("the in-process engine samples from the learner's live parameters: "
                           "use set_weight_version() after an optimizer step instead of a weight update")

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
