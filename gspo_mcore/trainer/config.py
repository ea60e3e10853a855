"""The run configuration: one frozen tree whose sections are the components' own configs.

:func:`resolve` fills every default that depends on another section (the checkpoint directory, the
tokenizer directory, each evaluation set's reward) and checks the cross-section rules. The trainer runs
the resolved tree, saves it as ``<log.output_dir>/config.yaml`` and hashes it into every checkpoint, so
the saved file describes the run that happened; loading that file and resolving it again gives the same
tree (``save -> load -> resolve`` is the identity).

The policy's temperature is defined once, by ``rollout.sampling.temperature``: the learner's log-probs are
``log softmax(logits / T)`` with that ``T`` (1 for greedy sampling), like the engine's.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Literal

from gspo_mcore.algo.length_penalty import LengthPenaltyConfig
from gspo_mcore.algo.loss_config import LossConfig
from gspo_mcore.config import check_literals
from gspo_mcore.data.dataset import DataConfig
from gspo_mcore.data.sampler import SamplerConfig
from gspo_mcore.data.template import TemplateConfig
from gspo_mcore.envs.config import EpisodeConfig
from gspo_mcore.learner.checkpoint import CheckpointConfig
from gspo_mcore.learner.lora import LoraConfig
from gspo_mcore.learner.model import ModelOptions
from gspo_mcore.learner.optimizer import OptimConfig
from gspo_mcore.learner.parallel import ParallelConfig
from gspo_mcore.learner.routing import RoutingConfig
from gspo_mcore.learner.step import BatchConfig
from gspo_mcore.metrics import LogConfig
from gspo_mcore.rewards.runner import RewardRunnerConfig
from gspo_mcore.rollout.types import SamplingParams
from gspo_mcore.trainer.backends import SGLangConfig
from gspo_mcore.trainer.distill import DistillConfig, check_distill
from gspo_mcore.trainer.early_stop import EarlyStopConfig, check_early_stop


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which model: a Hugging Face style directory with ``config.json`` and the tokenizer files."""

    hf_dir: str
    """Model directory: its ``config.json`` sets the architecture; its tokenizer renders prompts and responses."""
    init_seed: int = 1234
    """Random initialisation seed (layout independent), used when ``load_hf_weights`` is off."""
    load_hf_weights: bool = False
    """Start from the safetensors weights in ``hf_dir`` (any TP/PP/EP layout; see gspo_mcore.learner.hf)."""
    options: ModelOptions = field(default_factory=ModelOptions)

    def __post_init__(self):
        if not self.hf_dir:
            raise ValueError("ModelConfig.hf_dir must be set")


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """How each step's rollout batch is made, and how its rewards become advantages."""

    engine: Literal["inprocess", "sglang"] = "inprocess"
    """``inprocess`` (samples from the learner's own model; the CPU default) or ``sglang`` (servers
    launched or connected per ``sglang``; weights pushed after every step)."""
    prompts_per_step: int = 16
    """Prompts drawn per step (groups)."""
    group_size: int = 8
    """Samples per prompt, ``G``."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Sampling parameters; ``sampling.temperature`` also defines the policy the learner trains."""
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    """``recompute``: the learner recomputes the behaviour log-probs before the first update and reports
    the train/inference mismatch; ``rollout``: use the engine's log-probs (GSPO tolerates the small
    mismatch and saves a forward pass)."""
    drop_zero_advantage_groups: bool = False
    """Drop groups whose rewards are all equal (no learning signal) before the update."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: roll out further rounds of ``prompts_per_step`` fresh prompts until the
    step holds ``prompts_per_step`` groups whose (shaped) rewards are not all equal, at most
    ``max_sampling_rounds`` rounds; extra groups of the last round are discarded, and a step that still has
    fewer trains on those (see :mod:`gspo_mcore.trainer.dynamic_sampling`). Implies dropping zero-advantage groups."""
    max_sampling_rounds: int = 3
    """``dynamic_sampling``: the most rounds of generation per step (>= 1; 1 only filters)."""
    normalize_std: bool = True
    """Divide advantages by the group's standard deviation."""
    overlong_buffer: int = 0
    """DAPO's soft overlong penalty: a response longer than ``max_new_tokens - overlong_buffer`` tokens
    gets ``-overlong_penalty * excess / overlong_buffer`` added to its reward (so a truncated one gets
    ``-overlong_penalty``) before the advantages are taken. 0: off."""
    overlong_penalty: float = 1.0
    """The penalty at ``max_new_tokens`` (see ``overlong_buffer``)."""
    length_penalty: LengthPenaltyConfig = field(default_factory=LengthPenaltyConfig)
    """Penalties per policy token, turn and tool call, optionally only beyond the group's mean, added to the reward
    before the advantages (:mod:`gspo_mcore.algo.length_penalty`); off by default."""
    mask_truncated: bool = False
    """Leave responses cut at ``max_new_tokens`` out of the loss (DAPO's overlong filtering); they still
    count in their group's advantage statistics."""
    max_staleness: int = 0
    """Asynchronous rollouts: 0 is the synchronous loop. ``k >= 1`` (``engine: sglang`` with
    ``sglang.colocate: false``): the first round of step ``s + 1`` is generated while the learner trains on
    step ``s`` (one step off policy); a group with a sample more than ``k`` weight versions older than the
    learner when its step trains is dropped and counted (``stale_groups_dropped``). See
    :mod:`gspo_mcore.trainer.asynchronous`."""
    partial_rollouts: bool = False
    """Asynchronous rollouts (``max_staleness >= 1``): push the weights at the end of a step while the
    next batch is still generating, instead of waiting for it first. The servers pause (``sglang.client.
    pause_mode: retract``, which this needs: the running requests keep their tokens and log-probs), load
    the new weights and continue, so a response can hold tokens of two versions, each with its own
    log-prob (``Sample.token_versions``); its staleness is its oldest token's. See docs/async.md."""
    max_batch_size: int = 512
    """In-process engine: rows per forward pass."""
    decode_threads: int | None = None
    """In-process engine: torch's intra-op threads while it samples (the learner's count is restored for the update);
    ``None``: the process's count (``OMP_NUM_THREADS``). 1 suits a CPU that other jobs share: decoding is many small
    operations, and each waits at a thread barrier for threads the scheduler has not run."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """The SGLang servers and weight sync (``engine: sglang``)."""
    env: str = ""
    """Multi-turn agents: the environment class, ``"package.module:Class"`` (docs/agents.md); empty: one
    response per prompt. Each policy turn is limited by ``sampling.max_new_tokens``."""
    env_kwargs: dict = field(default_factory=dict)
    """Keyword arguments of the environment class."""
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    """Limits of an episode (``env``): turns, total tokens, the environment step's timeout."""

    def __post_init__(self):
        check_literals(self)
        if self.env:
            if self.max_staleness or self.partial_rollouts:
                raise ValueError(
                    "rollout.env: multi-turn episodes do not support rollout.max_staleness / rollout.partial_rollouts "
                    "(a weight update inside an episode is refused)"
                )
        if self.prompts_per_step < 1 or self.group_size < 2:
            raise ValueError("RolloutConfig needs prompts_per_step >= 1 and group_size >= 2")
        if not 0 <= self.overlong_buffer < self.sampling.max_new_tokens:
            raise ValueError(
                f"RolloutConfig.overlong_buffer must be in [0, sampling.max_new_tokens = "
                f"{self.sampling.max_new_tokens}), got {self.overlong_buffer}"
            )
        if self.overlong_penalty < 0:
            raise ValueError(f"RolloutConfig.overlong_penalty must be >= 0, got {self.overlong_penalty}")
        if self.max_batch_size < 1:
            raise ValueError(f"RolloutConfig.max_batch_size must be >= 1, got {self.max_batch_size}")
        threads = self.decode_threads
        if threads is not None and not (isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1):
            raise ValueError(f"RolloutConfig.decode_threads must be null or an integer >= 1, got {threads!r}")
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"RolloutConfig.max_staleness must be an integer >= 0, got {self.max_staleness!r}")
        if not isinstance(self.partial_rollouts, bool):
            raise ValueError(f"RolloutConfig.partial_rollouts must be true or false, got {self.partial_rollouts!r}")
        rounds = self.max_sampling_rounds
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"RolloutConfig.max_sampling_rounds must be an integer >= 1, got {rounds!r}")


@dataclass(frozen=True, kw_only=True)
class EvalSetConfig:
    """One held-out dataset."""

    name: str
    """Metrics appear as ``eval/<name>/...``."""
    data: DataConfig
    """The held-out rows (same formats as ``data``)."""
    reward: RewardRunnerConfig | None = None
    """Its reward; ``None``: the training reward (filled in by :func:`resolve`)."""
    max_prompts: int | None = None
    """Evaluate the first ``max_prompts`` rows only; ``None``: all."""

    def __post_init__(self):
        if not self.name or "/" in self.name:
            raise ValueError(f"EvalSetConfig.name must be non-empty and contain no '/', got {self.name!r}")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ValueError(f"EvalSetConfig.max_prompts must be >= 1 or null, got {self.max_prompts}")


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Evaluation on held-out datasets during training: before the first step, every ``every`` steps,
    and after the last one. The schedule depends only on the step, so a resumed run keeps it."""

    datasets: tuple[EvalSetConfig, ...] = ()
    """The held-out sets; none: no evaluation."""
    every: int = 0
    """Evaluate before every step that is a multiple of ``every`` (0: only before the first step and after
    the last)."""
    n: int = 1
    """Samples per prompt (pass@k needs ``n >= k``)."""
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=1.0))
    """Sampling parameters of the ``n`` samples (their own, independent of the rollout's)."""
    pass_k: tuple[int, ...] = (1,)
    """The ``k`` of the reported pass@k (unbiased estimator of Chen et al. 2021)."""
    greedy: bool = True
    """With ``n > 1`` (or a sampling temperature > 0) also report greedy pass@1 (``greedy_pass@1``)."""
    pass_threshold: float = 1.0
    """A sample passes when its reward is at least this."""
    seed: int = 0
    """Base sampling seed; the same at every evaluation, and never drawn from the training streams."""
    save_samples: bool = True
    """Write every evaluation's responses to ``<log.output_dir>/eval_samples/step_<step>.jsonl``."""

    def __post_init__(self):
        if self.every < 0:
            raise ValueError(f"EvalConfig.every must be >= 0, got {self.every}")
        if self.n < 1:
            raise ValueError(f"EvalConfig.n must be >= 1, got {self.n}")
        if not self.pass_k or any(k < 1 for k in self.pass_k):
            raise ValueError(f"EvalConfig.pass_k must be a non-empty list of integers >= 1, got {self.pass_k}")
        too_big = [k for k in self.pass_k if k > self.n]
        if too_big:
            raise ValueError(
                f"EvalConfig.pass_k: pass@{too_big[0]} needs at least {too_big[0]} samples per prompt, "
                f"but eval.n is {self.n}"
            )
        names = [d.name for d in self.datasets]
        if len(set(names)) != len(names):
            raise ValueError(f"EvalConfig.datasets: names must be unique, got {names}")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything one run needs; each section is owned by its component."""

    steps: int = 100
    """Rollout steps (each makes ``batch.num_minibatches`` optimizer steps)."""
    seed: int = 1234
    """Seed of the run: the learner's random state, and every rollout's sampling seed (derived from it and the step)."""
    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    """MoE: Routing Replay and routing-volatility measurement (ignored for dense models)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters, base weights frozen (docs/lora.md); ``rank: 0`` (the default) is full fine-tuning."""
    data: DataConfig
    sampler: SamplerConfig = field(default_factory=lambda: SamplerConfig(epochs=None))
    template: TemplateConfig = field(default_factory=TemplateConfig)
    reward: RewardRunnerConfig = field(default_factory=RewardRunnerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)
    """Stop when nothing is left to learn (held-out pass@1 stalled, or no advantage signal); off by default."""
    distill: DistillConfig | None = None
    """On-policy distillation from a teacher (docs/distill.md); ``None``: none."""
    allow_data_change: bool = False
    """A resume whose training or evaluation data file (same path) differs from what the checkpoint recorded
    (each file's size and sha256, stored with every checkpoint) is refused, naming the file; ``true`` resumes
    anyway (the change is logged)."""

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.rollout.engine == "sglang" and not self.model.load_hf_weights:
            raise ValueError(
                "rollout.engine=sglang needs model.load_hf_weights=true: the servers load the weights in "
                "model.hf_dir, so the learner must start from the same ones"
            )
        if self.rollout.max_staleness > 0 and self.rollout.engine != "sglang":
            raise ValueError(
                f"rollout.max_staleness={self.rollout.max_staleness} needs rollout.engine=sglang: the in-process "
                "engine shares the learner's ranks and cores, so its rollouts stay synchronous (max_staleness: 0)"
            )
        if self.rollout.max_staleness > 0 and self.rollout.sglang.colocate:
            raise ValueError(
                f"rollout.max_staleness={self.rollout.max_staleness} needs rollout.sglang.colocate=false: "
                "colocated servers release their memory while the learner trains, so they cannot generate then"
            )
        self._check_partial_rollouts()
        if self.routing.replay == "learner" and self.rollout.old_logprobs != "recompute":
            raise ValueError(
                "routing.replay=learner (or true) needs rollout.old_logprobs=recompute: the experts are recorded in "
                "the learner's old-log-prob forward, so the old log-probs must come from it too"
            )
        if self.routing.replay == "rollout" and self.rollout.engine != "sglang":
            raise ValueError(
                f"routing.replay=rollout needs rollout.engine=sglang (got {self.rollout.engine!r}): it replays the "
                "experts the rollout engine routed each token to, and only SGLang returns them"
            )
        if self.loss.off_policy.mode != "none" and self.rollout.old_logprobs != "recompute":
            raise ValueError(
                f"loss.off_policy.mode={self.loss.off_policy.mode} needs rollout.old_logprobs=recompute: the "
                "clipped ratio is taken against the learner's recompute (pi_prox) and the weight compares it with "
                "the engine's log-probs (mu); with rollout.old_logprobs=rollout there is no pi_prox"
            )
        self._check_context_parallel()
        check_distill(self)
        check_early_stop(self)
        total = self.rollout.prompts_per_step * self.rollout.group_size
        if self.batch.num_minibatches > total:
            raise ValueError(
                f"batch.num_minibatches ({self.batch.num_minibatches}) exceeds the rollout batch ({total} samples)"
            )

    def _check_partial_rollouts(self) -> None:
        """``rollout.partial_rollouts`` continues requests across a weight update: only asynchronously, and
        only where the servers keep the running requests' tokens at the update's pause."""
        r = self.rollout
        if not r.partial_rollouts:
            return
        if r.max_staleness < 1:
            raise ValueError(
                "rollout.partial_rollouts=true needs rollout.max_staleness >= 1: in the synchronous loop no "
                "request is in flight when the weights change"
            )
        if r.sglang.client.pause_mode != "retract":
            raise ValueError(
                f"rollout.partial_rollouts=true needs rollout.sglang.client.pause_mode=retract, got "
                f"{r.sglang.client.pause_mode!r}: in abort mode the update ends the running requests, with "
                "partial responses, instead of continuing them on the new weights"
            )

    def _check_context_parallel(self) -> None:
        """What context parallelism (``parallel.context > 1``) cannot do yet, refused before anything is built."""
        cp = self.parallel.context
        if cp == 1:
            return
        if self.batch.packing != "padded":
            raise ValueError(
                f"parallel.context={cp} needs batch.packing=padded: a {self.batch.packing!r} micro-batch's "
                "block-diagonal mask is not split over CP ranks (with Transformer Engine micro-batches are THD "
                "packed and split per sequence)"
            )
        if self.routing.enabled or self.routing.measure_every:
            raise ValueError(
                f"parallel.context={cp} with routing.replay / routing.measure_every: the routing tape records "
                "and replays whole sequences, not CP-split ones"
            )

    @property
    def temperature(self) -> float:
        """The policy's softmax temperature: the rollout's (1 when it samples greedily)."""
        return self.rollout.sampling.logprob_temperature


def resolve(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with every derived default filled in; idempotent (``resolve(resolve(c)) == resolve(c)``)."""
    template = cfg.template
    if not template.tokenizer_dir:
        template = dataclasses.replace(template, tokenizer_dir=cfg.model.hf_dir)
    checkpoint = cfg.checkpoint
    if not checkpoint.dir:
        checkpoint = dataclasses.replace(checkpoint, dir=os.path.join(cfg.log.output_dir, "checkpoints"))
    datasets = tuple(
        d if d.reward is not None else dataclasses.replace(d, reward=cfg.reward) for d in cfg.eval.datasets
    )
    return dataclasses.replace(
        cfg, template=template, checkpoint=checkpoint, eval=dataclasses.replace(cfg.eval, datasets=datasets)
    )
