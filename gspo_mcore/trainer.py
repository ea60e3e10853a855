"""The GSPO training loop: sample prompts -> roll out G per prompt -> rewards -> group advantages ->
old log-probs (and, for MoE with Routing Replay, the experts) -> ``num_minibatches`` updates -> weight
sync -> metrics -> checkpoint.

With ``checkpoint.resume`` the run first restores the newest valid checkpoint (model, optimizer, LR
schedule, RNG states, data position, engine weight version) and continues at the step after it; rollout
seeds derive from ``(seed, step)``, so a resumed run repeats what an uninterrupted one would have done.

Every rank runs this same loop. Prompts are drawn identically on all ranks; the rollout backend
(:mod:`gspo_mcore.rollout_backends`: the in-process engine, each DP rank sampling its share, or SGLang
driven by rank 0) gives every rank the whole rollout batch, which the learner splits into mini-batches
and micro-batches; the backend then syncs the engine's weights.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field

import torch

from gspo_mcore.algo import group_advantages, zero_advantage_groups
from gspo_mcore.config import save_yaml, to_dict
from gspo_mcore.data.dataset import DataConfig
from gspo_mcore.data.sampler import SamplerConfig
from gspo_mcore.data.template import TemplateConfig
from gspo_mcore.learner import BatchConfig, LossConfig, ModelOptions, OptimConfig, ParallelConfig
from gspo_mcore.learner.checkpoint import CheckpointConfig
from gspo_mcore.learner.routing import RoutingConfig
from gspo_mcore.metrics import LogConfig, MetricsLogger
from gspo_mcore.rewards.runner import RewardRunnerConfig
from gspo_mcore.rollout_backends import SGLangConfig
from gspo_mcore.rollout.types import SamplingParams


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which model: a Hugging Face style directory with ``config.json`` and the tokenizer files."""

    hf_dir: str
    """Model directory: its ``config.json`` sets the shape; its tokenizer renders prompts and responses."""
    init_seed: int = 1234
    """Random initialisation seed (layout independent), used when ``load_hf_weights`` is off."""
    load_hf_weights: bool = False
    """Start from the safetensors weights in ``hf_dir`` (any TP/PP/EP layout; see gspo_mcore.convert)."""
    options: ModelOptions = field(default_factory=ModelOptions)

    def __post_init__(self):
        if not self.hf_dir:
            raise ValueError("ModelConfig.hf_dir must be set")


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """How each step's rollout batch is made."""

    engine: str = "inprocess"
    """``inprocess`` (samples from the learner's own model; the CPU default) or ``sglang`` (servers
    launched or connected per ``sglang``; weights pushed after every step)."""
    prompts_per_step: int = 16
    """Prompts drawn per step (groups)."""
    group_size: int = 8
    """Samples per prompt, ``G``."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    old_logprobs: str = "recompute"
    """``recompute``: the learner recomputes the behaviour log-probs before the first update and reports
    the train/inference mismatch; ``rollout``: use the engine's log-probs (GSPO tolerates the small
    mismatch and saves a forward pass)."""
    drop_zero_advantage_groups: bool = False
    """Drop groups whose rewards are all equal (no learning signal) before the update."""
    normalize_std: bool = True
    """Divide advantages by the group's standard deviation."""
    max_batch_size: int = 512
    """In-process engine: rows per forward pass."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """The SGLang servers and weight sync (``engine: sglang``)."""

    def __post_init__(self):
        if self.engine not in ("inprocess", "sglang"):
            raise ValueError(f"RolloutConfig.engine must be 'inprocess' or 'sglang', got {self.engine!r}")
        if self.old_logprobs not in ("recompute", "rollout"):
            raise ValueError(f"RolloutConfig.old_logprobs must be 'recompute' or 'rollout', got {self.old_logprobs!r}")
        if self.prompts_per_step < 1 or self.group_size < 2:
            raise ValueError("RolloutConfig needs prompts_per_step >= 1 and group_size >= 2")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything one run needs; each section is owned by its component."""

    steps: int = 100
    """Rollout steps (each makes ``batch.num_minibatches`` optimizer steps)."""
    seed: int = 1234
    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    """MoE: Routing Replay and routing-volatility measurement (ignored for dense models)."""
    data: DataConfig
    sampler: SamplerConfig = field(default_factory=lambda: SamplerConfig(epochs=None))
    template: TemplateConfig = field(default_factory=lambda: TemplateConfig(tokenizer_dir=""))
    reward: RewardRunnerConfig = field(default_factory=RewardRunnerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if not math.isclose(self.loss.temperature, self.rollout.sampling.logprob_temperature):
            raise ValueError(f"loss.temperature ({self.loss.temperature}) must equal the rollout's sampling "
                             f"temperature ({self.rollout.sampling.logprob_temperature}): the learner's log-probs "
                             "and the engine's must describe the same policy softmax(logits / T)")
        if self.rollout.engine == "sglang" and not self.model.load_hf_weights:
            raise ValueError("rollout.engine=sglang needs model.load_hf_weights=true: the servers load the weights in "
                             "model.hf_dir, so the learner must start from the same ones")
        if self.routing.replay and self.rollout.old_logprobs != "recompute":
            raise ValueError("routing.replay=true needs rollout.old_logprobs=recompute: the experts are recorded in "
                             "the learner's old-log-prob forward, so the old log-probs must come from it too")
        total = self.rollout.prompts_per_step * self.rollout.group_size
        if self.batch.num_minibatches > total:
            raise ValueError(f"batch.num_minibatches ({self.batch.num_minibatches}) exceeds the rollout batch "
                             f"({total} samples)")


def run(cfg: TrainConfig) -> list[dict]:
    """Train; returns the per-step metrics (on every rank)."""
    from gspo_mcore.learner import build_model, build_optimizer, init_parallel, load_hf_config, train_step
    from gspo_mcore.learner.checkpoint import Checkpointer

    shape = load_hf_config(os.path.join(cfg.model.hf_dir, "config.json"))
    layout = init_parallel(cfg.parallel, shape, seed=cfg.seed)
    is_writer = layout.rank == 0
    if is_writer:
        os.makedirs(cfg.log.output_dir, exist_ok=True)
        save_yaml(cfg, os.path.join(cfg.log.output_dir, "config.yaml"))
    model = build_model(shape, cfg.parallel, cfg.model.options,
                        seed=None if cfg.model.load_hf_weights else cfg.model.init_seed,
                        use_distributed_optimizer=cfg.optim.use_distributed_optimizer)
    if cfg.model.load_hf_weights:
        from gspo_mcore.convert.hf_import import load_hf_weights

        load_hf_weights(model, cfg.model.hf_dir, shape, progress=is_writer)
    optimizer, scheduler = build_optimizer(model, cfg.optim)
    loss_cfg = dataclasses.replace(cfg.loss, recompute_old_logprobs=cfg.rollout.old_logprobs == "recompute")
    loader, tokenizer = _prompt_loader(cfg)
    rewards = _reward_runner(cfg.reward)
    engine = _rollout_backend(cfg, model, layout, shape, tokenizer)
    checkpoints = Checkpointer(cfg.checkpoint, cfg.checkpoint.dir or os.path.join(cfg.log.output_dir, "checkpoints"),
                               layout, run_config=to_dict(cfg), total_steps=cfg.steps)
    start = 0
    resumed = checkpoints.resume(model, optimizer, scheduler)
    if resumed is not None:
        loader.load_state_dict(resumed.extra["data"])
        engine.set_version(resumed.extra["weight_version"])
        start = resumed.step + 1
        if is_writer:
            _drop_metrics_after(os.path.join(cfg.log.output_dir, "metrics.jsonl"), resumed.step)
    logger = MetricsLogger(cfg.log, total_steps=cfg.steps, start_step=start, enabled=is_writer,
                           run_config=to_dict(cfg))
    history = []
    try:
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()
            prompts = loader.next_batch(cfg.rollout.prompts_per_step)
            if not prompts:
                break
            groups = engine.generate([p.input_ids for p in prompts], cfg.rollout.group_size, cfg.rollout.sampling,
                                     seed=cfg.seed * 100_003 + step)
            t1 = time.perf_counter()
            texts, metas = _responses(groups, prompts, tokenizer)
            scores = torch.tensor(rewards.score(texts, metas), dtype=torch.float32)  # (num_groups * G,)
            t2 = time.perf_counter()
            advantages = group_advantages(scores, cfg.rollout.group_size, normalize_std=cfg.rollout.normalize_std)
            keep = ~zero_advantage_groups(scores, cfg.rollout.group_size) if cfg.rollout.drop_zero_advantage_groups \
                else torch.ones(len(groups), dtype=torch.bool)
            samples = _learner_samples(groups, advantages, keep)
            engine.before_train()  # colocated SGLang frees its GPU memory
            measure = cfg.routing.measure_every > 0 and step % cfg.routing.measure_every == 0
            updates = train_step(model, optimizer, scheduler, samples, layout, loss_cfg, cfg.batch, cfg.routing,
                                 measure_routing=measure) if len(samples) >= cfg.batch.num_minibatches else []
            t3 = time.perf_counter()
            engine.sync_weights(model, shape, step + 1)  # the engine serves the updated policy as version step+1
            t4 = time.perf_counter()
            record = _step_metrics(groups, scores, keep, updates, rewards.metrics(), cfg.rollout.group_size,
                                   timings={"rollout": t1 - t0, "reward": t2 - t1, "train": t3 - t2,
                                            "weight_sync": t4 - t3})
            history.append(record)
            logger.log(step, record)
            if checkpoints.due(step):
                checkpoints.save(step, model, optimizer, scheduler,
                                 extra={"data": loader.state_dict(), "weight_version": step + 1})
    finally:
        logger.close()
        engine.close()
    return history


# ---- the steps of the loop --------------------------------------------------------------------------

def _rollout_backend(cfg: TrainConfig, model, layout, shape, tokenizer):
    from gspo_mcore.rollout_backends import InProcessRollout, SGLangRollout

    if cfg.rollout.engine == "sglang":
        return SGLangRollout(cfg.rollout.sglang, model_dir=cfg.model.hf_dir, output_dir=cfg.log.output_dir,
                             layout=layout)
    return InProcessRollout(model, layout, shape, tokenizer, max_batch_size=cfg.rollout.max_batch_size)


def _responses(groups, prompts, tokenizer):
    texts, metas = [], []
    for group, prompt in zip(groups, prompts):
        for s in group:
            texts.append(tokenizer.decode(list(s.response_ids), skip_special_tokens=True))
            metas.append(prompt.sample.metadata)
    return texts, metas


def _learner_samples(groups, advantages, keep):
    from gspo_mcore.learner import Sample

    out = []
    flat_adv = advantages.view(len(groups), -1)
    for g, group in enumerate(groups):
        if not bool(keep[g]):
            continue
        for j, s in enumerate(group):
            if not s.response_ids:
                continue
            p, r = len(s.prompt_ids), len(s.response_ids)
            tokens = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
            mask = torch.cat([torch.zeros(p), torch.ones(r)])
            # the engine's log-probs, aligned with tokens[1:]; with old_logprobs=recompute the learner
            # replaces them before the first update and reports the mismatch
            old = torch.cat([torch.zeros(p - 1), torch.tensor(s.response_logprobs, dtype=torch.float32)])
            out.append(Sample(tokens=tokens, loss_mask=mask, advantage=float(flat_adv[g, j]), old_logprobs=old))
    return out


def _step_metrics(groups, scores, keep, updates, reward_metrics, group_size, *, timings):
    lengths = [len(s.response_ids) for g in groups for s in g]
    zero = zero_advantage_groups(scores, group_size)
    record = {
        "reward_mean": float(scores.mean()),
        "reward_std": float(scores.std()) if scores.numel() > 1 else 0.0,
        "response_length_mean": sum(lengths) / max(len(lengths), 1),
        "zero_advantage_group_fraction": float(zero.float().mean()),
        "groups_used": int(keep.sum()),
        "finish_stop_fraction": sum(s.finish_reason == "stop" for g in groups for s in g) / max(len(lengths), 1),
        **{k: float(v) for k, v in reward_metrics.items()},
    }
    if updates:
        for key in updates[0]:
            record[key] = sum(u[key] for u in updates) / len(updates)  # mean over the mini-batches
        record["ratio_min"] = min(u["ratio_min"] for u in updates)
        record["ratio_max"] = max(u["ratio_max"] for u in updates)
        if "rollout_logprob_abs_diff" in updates[0]:
            record["logprob_mismatch"] = updates[0]["rollout_logprob_abs_diff"]
    total = sum(timings.values())
    record.update({f"time_{k}_s": v for k, v in timings.items()})
    record["time_step_s"] = total
    record["rollout_tokens_per_s"] = sum(lengths) / max(timings["rollout"], 1e-9)
    record["train_tokens_per_s"] = sum(u.get("num_tokens", 0.0) for u in updates) / max(timings["train"], 1e-9)
    return record


def _drop_metrics_after(path: str, step: int) -> None:
    """Keep the metrics of steps ``<= step``: a resumed run re-logs the steps after its checkpoint."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line).get("step", -1) <= step:
                    kept.append(line)
            except ValueError:  # the last line of a killed run can be cut short
                pass
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def _prompt_loader(cfg: TrainConfig):
    from gspo_mcore.data.dataset import PromptDataset
    from gspo_mcore.data.loader import PromptLoader
    from gspo_mcore.data.sampler import PromptSampler
    from gspo_mcore.data.template import PromptTemplate, load_tokenizer

    tokenizer = load_tokenizer(cfg.template.tokenizer_dir or cfg.model.hf_dir)
    template_cfg = dataclasses.replace(cfg.template, tokenizer_dir=cfg.template.tokenizer_dir or cfg.model.hf_dir)
    dataset = PromptDataset(cfg.data)
    sampler = PromptSampler(len(dataset), cfg.sampler)
    return PromptLoader(dataset, sampler, PromptTemplate(template_cfg, tokenizer)), tokenizer


def _reward_runner(cfg: RewardRunnerConfig):
    from gspo_mcore.rewards.runner import RewardRunner

    return RewardRunner(cfg)
