"""The rollout engine interface the trainer uses: sampling settings, samples, and the abstract engine.

Log-prob convention (every engine must follow it, and the learner computes its ``logp`` the same way)
--------------------------------------------------------------------------------------------------
A sample's ``response_logprobs[t]`` is ``log softmax(logits_t / tau)[y_t]``, where ``logits_t`` are the
model's raw next-token logits and ``tau = temperature`` (``tau = 1`` when ``temperature == 0``, i.e.
greedy). Top-p / top-k truncate the distribution the token is *drawn* from, but the returned log-prob
is of the full, untruncated, temperature-scaled softmax (no renormalisation over the kept tokens).

This is what SGLang 0.5.23 returns, read in its source (``python/sglang/srt/``):

- ``layers/sampler.py``, ``Sampler.forward``: when any request in the batch samples, the standard path
  divides the logits by ``sampling_info.temperatures`` in place, takes the softmax (``probs``), draws
  the token in ``Sampler._sample_from_probs`` (top-k/top-p/min-p filter a sorted copy in
  ``top_k_top_p_min_p_sampling_from_probs_torch``, or work inside flashinfer's
  ``top_k_top_p_sampling_from_probs``; ``probs`` itself is left untouched), and returns
  ``logprobs = torch.log(probs)``: the *unfiltered* temperature-scaled softmax. Deterministic inference
  and ``--rl-on-policy-target`` compute ``log_softmax(logits / T)`` instead, the same quantity. When the
  whole batch is greedy it returns ``log_softmax(logits)``.
- ``sampling/sampling_params.py``, ``SamplingParams.__post_init__``: ``0 <= temperature < 1e-6`` is
  rewritten to ``temperature = 1.0, top_k = 1``, so greedy log-probs are of ``softmax(logits)`` whether
  or not the request shares a batch with sampling ones; ``top_k = -1`` means the whole vocabulary.
- The environment variable ``SGLANG_RETURN_ORIGINAL_LOGPROB`` (read at import in ``layers/sampler.py``)
  switches the returned values to ``log_softmax(logits)`` *before* temperature scaling, which breaks
  this convention whenever ``temperature != 1``: ``sglang_server.py`` refuses it in a server's
  configured environment and overrides an inherited one.
- ``model_executor/model_runner.py``, ``ModelRunner.sample`` -> ``ModelRunner._preprocess_logits`` ->
  ``SamplingBatchInfo.apply_logits_bias`` (``sampling/sampling_batch_info.py``) adds penalties, grammar
  masks and ``logit_bias`` to the logits *before* the sampler, so they would enter the log-probs too;
  :class:`SamplingParams` exposes none of them.
- Not used here: ``return_sampling_mask`` on ``/generate`` (0.5.23) additionally returns the sampling
  support and ``output_token_sampling_logprobs`` renormalised over it (the truncated policy).
- Older SGLang returned other values: at an early-2025 commit (584f55d) ``Sampler.forward`` returned
  ``log(top_p_normalize_probs_torch(probs, top_ps))``, i.e. renormalised after top-p. This is one reason
  the client pins the version it is tested against (``sglang_api.SGLANG_VERSION``).
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import math
import operator
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

    from gspo_mcore.rollout.turns import OnTurns, TurnCaps, TurnStops

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")

# One bucket of named tensors for a weight update: ``[(hf_name, tensor), ...]``.
NamedTensors = Sequence[tuple[str, "torch.Tensor"]]

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample one response. Validated on construction."""

    temperature: float = 1.0
    """Softmax temperature ``tau`` (>= 0). 0 means greedy; log-probs are then of ``softmax(logits)``."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]. 1 disables it."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 disables it, otherwise >= 1."""
    max_new_tokens: int = 128
    """Hard cap on response length (>= 1); hitting it gives ``finish_reason == "length"``."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end a response (the model's EOS stops it anyway unless ``ignore_eos``).
    A matched stop token is part of ``response_ids`` and has a log-prob."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS token (for benchmarks and tests)."""
    seed: int | None = None
    """Base seed. Each sample gets its own seed from :func:`derive_sample_seed`. Engines may need a
    deterministic mode to honour it (SGLang uses ``sampling_seed`` only under
    ``--enable-deterministic-inference``)."""

    def __post_init__(self):
        if not (
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0
        ):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1)):
            raise ValueError(f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        if not (_is_int(self.max_new_tokens) and self.max_new_tokens >= 1):
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        stop = tuple(self.stop_token_ids)
        if not all(_is_int(t) and t >= 0 for t in stop):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stop)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.seed is not None and not (_is_int(self.seed) and _INT64_MIN <= self.seed <= _INT64_MAX):
            raise ValueError(f"seed must be None or a 64-bit integer, got {self.seed!r}")

    @property
    def logprob_temperature(self) -> float:
        """The ``tau`` the returned log-probs are scaled by: ``temperature``, or 1 when greedy."""
        return self.temperature if self.temperature > 0 else 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sample:
    """One sampled response to one prompt."""

    prompt_index: int
    """Index of the prompt in the ``generate`` call (the group)."""
    sample_index: int
    """Index of this sample within its group, ``0 <= sample_index < n``."""
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    response_logprobs: tuple[float, ...]
    """``log softmax(logits / tau)`` of each response token under the policy that sampled it (see the
    module docstring). Same length as ``response_ids``."""
    finish_reason: FinishReason
    """``stop`` (EOS or a stop token, which is the last response token), ``length`` (hit
    ``max_new_tokens``) or ``abort`` (the engine cut it short, e.g. a pause; tokens are partial)."""
    weight_version: int
    """The training step whose weights produced the response. If the weights changed while it was
    being generated, the oldest version involved (a sample's staleness is its oldest token's)."""
    routed_experts: torch.Tensor | None = dataclasses.field(default=None, compare=False)
    """MoE, when the engine was asked for them (R3, ``routing.replay: rollout``): ``[P + R, num_layers, topk]``
    int32, the experts each token (prompt, then response) was routed to in each layer when the engine ran it;
    ``-1`` where the engine did not route it (the last response token, which is never fed back)."""
    token_versions: tuple[int, ...] | None = None
    """The weight version that produced each response token, when the weights changed while the
    response was generated (a partial rollout: paused at a weight update and continued on the new
    weights; each token's log-prob is then under its own version's weights). ``None``: every token came
    from ``weight_version``."""
    response_mask: tuple[int, ...] | None = None
    """Multi-turn episodes: 1 on the response tokens the policy sampled, 0 on the environment's (tool results,
    template framing), which have log-prob 0 here and are context only for the loss. ``None``: all sampled."""
    episode: object = dataclasses.field(default=None, compare=False)
    """Multi-turn episodes: the episode's :class:`gspo_mcore.rollout.turns.EpisodeStats`."""

    def __post_init__(self):
        where = f"sample ({self.prompt_index}, {self.sample_index})"
        if len(self.response_ids) != len(self.response_logprobs):
            raise ValueError(
                f"{where}: {len(self.response_ids)} response ids but {len(self.response_logprobs)} log-probs"
            )
        r = self.routed_experts
        if r is not None and (r.dim() != 3 or r.shape[0] != len(self.prompt_ids) + len(self.response_ids)):
            raise ValueError(
                f"{where}: routed_experts of shape {tuple(r.shape)}, "
                f"expected [{len(self.prompt_ids) + len(self.response_ids)} tokens, num_layers, topk]"
            )
        if self.token_versions is not None:
            if len(self.token_versions) != len(self.response_ids):
                raise ValueError(
                    f"{where}: {len(self.token_versions)} token versions for {len(self.response_ids)} response ids"
                )
            if self.token_versions and min(self.token_versions) != self.weight_version:
                raise ValueError(
                    f"{where}: weight_version {self.weight_version} is not the oldest token version "
                    f"{min(self.token_versions)}"
                )
        if self.response_mask is not None:
            mask = tuple(self.response_mask)
            if len(mask) != len(self.response_ids) or not set(mask) <= {0, 1}:
                raise ValueError(f"{where}: response_mask must be 0/1, one per response id ({len(self.response_ids)})")
            object.__setattr__(self, "response_mask", mask)
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")


class RolloutError(RuntimeError):
    """A rollout step failed: the message names the server URL and the request where one is involved."""


class WeightUpdateError(RolloutError):
    """A weight update failed; the engine may hold partially updated weights and stays paused."""


def derive_sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """A signed 64-bit seed for one sample, distinct across prompts and samples of one call.

    The same ``(seed, prompt_index, sample_index)`` always gives the same value, whatever the engine
    or the number of servers.
    """
    digest = hashlib.blake2b(f"{seed}:{prompt_index}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


class RolloutEngine(abc.ABC):
    """What the trainer needs from an inference engine. All methods are coroutines.

    ``generate`` may run many requests concurrently, with per-request timeouts and bounded retries;
    it either returns every sample or raises :class:`RolloutError` (no sample is dropped or duplicated).
    Weight updates pause generation, replace the weights, tag them with ``version`` (the training
    step) and resume.
    """

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """The version of the weights the engine serves now."""

    @abc.abstractmethod
    async def generate(self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams) -> list[list[Sample]]:
        """``n`` samples for each prompt (token ids, never re-tokenised).

        Returns ``out[i][j]`` = sample ``j`` of prompt ``i``: ``len(out) == len(prompts)`` and
        ``len(out[i]) == n``.
        """

    @abc.abstractmethod
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
        """Multi-turn episodes, one per prompt (row), for the episode driver (:mod:`gspo_mcore.rollout.episode`):
        the contract of :mod:`gspo_mcore.rollout.turns`. Each policy turn samples at most
        ``params.max_new_tokens``, at most what is left of ``max_total_tokens`` and at most the row's cap
        (``caps(row)`` when the turn starts, :func:`gspo_mcore.rollout.turns.turn_budget`), and ends at the
        row's stop strings (``stops(row)`` when the turn starts, :class:`gspo_mcore.rollout.turns.TurnStop`);
        whenever turns end, ``on_turns(ends)`` gives each row's next environment span (appended as given, never
        re-tokenised) or ``None`` (the row is over). ``keys[i]``: row ``i``'s sampling key (as
        :func:`derive_sample_seed`). Returns when every row is over."""

    @abc.abstractmethod
    async def update_weights(self, buckets: Iterable[NamedTensors], version: int) -> None:
        """Load new weights given as buckets of ``(hf_name, tensor)`` and serve them as ``version``."""

    @abc.abstractmethod
    async def update_weights_from_disk(self, path: str, version: int) -> None:
        """Load new weights from an exported HF-format (safetensors) directory as ``version``."""

    @abc.abstractmethod
    async def pause(self) -> None:
        """Stop generating (in-flight requests may come back with ``finish_reason == "abort"``)."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Undo :meth:`pause`."""

    @abc.abstractmethod
    async def health(self) -> dict[str, bool]:
        """Whether each backend (by name or URL) can generate now."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections and anything the engine started."""

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()


def normalize_prompts(prompts: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """Prompts as tuples of Python ints (lists, tuples, numpy arrays or 1-D integer tensors accepted)."""
    out = []
    for i, p in enumerate(prompts):
        if hasattr(p, "tolist"):
            p = p.tolist()
        try:
            ids = tuple(operator.index(t) for t in p)
        except TypeError:
            raise ValueError(f"prompt {i} must be a sequence of integer token ids") from None
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        if min(ids) < 0:
            raise ValueError(f"prompt {i} has a negative token id")
        out.append(ids)
    return out


def check_generate_args(n: int, params: SamplingParams) -> None:
    """Shared argument checks for :meth:`RolloutEngine.generate` implementations."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    if not (_is_int(n) and n >= 1):
        raise ValueError(f"n must be an integer >= 1, got {n!r}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
