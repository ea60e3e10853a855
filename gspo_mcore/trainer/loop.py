"""The GSPO training loop: sample prompts -> roll out G per prompt -> rewards (with dynamic sampling, more
rounds of fresh prompts until enough groups have a reward spread) -> group advantages ->
old log-probs (and, for MoE with Routing Replay, the experts) -> ``num_minibatches`` updates -> weight
sync -> metrics -> checkpoint; held-out evaluation before the first step, every ``eval.every`` steps and
after the last.

With ``checkpoint.resume`` the run first restores the newest valid checkpoint (model, optimizer, LR
schedule, RNG states, data position, engine weight version) and continues at the step after it; rollout
seeds derive from ``(seed, step)``, so a resumed run repeats what an uninterrupted one would have done.

Every rank runs this same loop. Prompts are drawn identically on all ranks; the rollout backend
(:mod:`gspo_mcore.trainer.backends`: the in-process engine, each DP rank sampling its share, or SGLang
driven by rank 0) gives every rank the whole rollout batch, which the learner splits into mini-batches
and micro-batches; the backend then syncs the engine's weights.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass

import torch

from gspo_mcore.algo import group_advantages
from gspo_mcore.config import to_dict
from gspo_mcore.data.difficulty import build_sampler
from gspo_mcore.data.loader import PromptLoader
from gspo_mcore.learner.checkpoint import Checkpointer
from gspo_mcore.learner.learner import Learner
from gspo_mcore.metrics import MetricsLogger, step_metrics
from gspo_mcore.rewards import RewardRunner
from gspo_mcore.trainer import distill, episode_log, preflight, run_dir
from gspo_mcore.trainer.asynchronous import Prefetcher, fresh_groups
from gspo_mcore.trainer.backends import InProcessRollout, RolloutBackend, SGLangRollout
from gspo_mcore.trainer.batch import (
    decode_responses,
    episode_metrics,
    episode_rewards,
    learner_samples,
    length_penalty_metrics,
    length_penalty_terms,
    overlong_penalties,
    staleness_metrics,
)
from gspo_mcore.trainer.config import TrainConfig, resolve
from gspo_mcore.trainer.dynamic_sampling import RolloutBatch, collect, rollout_seed
from gspo_mcore.trainer.early_stop import EarlyStop
from gspo_mcore.trainer.episodes import AgentRollout, SGLangAgentRollout
from gspo_mcore.trainer.evaluation import Evaluator

logger = logging.getLogger(__name__)


@dataclass
class Run:
    """What a run holds while it trains: its configuration, the learner, the rollout backend, the prompt stream,
    the rewards, the tokenizer, and (asynchronous rollouts) the next step's batch in flight."""

    cfg: TrainConfig
    learner: Learner
    rollout: RolloutBackend
    loader: PromptLoader
    rewards: RewardRunner
    tokenizer: object
    prefetch: Prefetcher | None = None
    distiller: distill.Distiller | None = None
    data_files: dict | None = None
    """The data files' sizes and hashes, saved with each checkpoint (checked at resume)."""
    stopper: EarlyStop | None = None
    """``early_stop``'s tracker (saved with each checkpoint)."""


def run(cfg: TrainConfig) -> list[dict]:
    """Train; returns the per-step metrics (on every rank)."""
    cfg = resolve(cfg)
    inputs = preflight.check(cfg)  # every input (and the run folder) checked; nothing built or written yet
    try:
        return _run_checked(cfg, inputs)
    finally:  # the run folder is the next run's once this one ends, however it ends
        if inputs.lock is not None:
            inputs.lock.release()


def _run_checked(cfg: TrainConfig, inputs: preflight.Inputs) -> list[dict]:
    """The run, once :func:`~gspo_mcore.trainer.preflight.check` has checked its inputs and locked its folder."""
    arch, tokenizer, template, dataset = inputs.arch, inputs.tokenizer, inputs.template, inputs.dataset
    eval_sets, rewards = inputs.eval_sets, inputs.rewards
    loader = PromptLoader(dataset, build_sampler(len(dataset), cfg.sampler), template)
    distill_plan = inputs.distill  # the teacher's folder, weights, tokenizer and fit: checked before any model

    learner = Learner.build(
        arch,
        parallel=cfg.parallel,
        options=cfg.model.options,
        optim=cfg.optim,
        loss=cfg.loss,
        batch=cfg.batch,
        routing=cfg.routing,
        lora=cfg.lora,
        seed=cfg.seed,
        init_seed=cfg.model.init_seed,
        hf_weights=cfg.model.hf_dir if cfg.model.load_hf_weights else None,
        temperature=cfg.temperature,
        recompute_old_logprobs=cfg.rollout.old_logprobs == "recompute",
        progress=True,
    )
    is_writer = learner.is_writer
    if is_writer:
        run_dir.prepare(inputs.run_dir, to_dict(cfg))  # the run's first write: config.yaml (after log.overwrite)
        if learner.reference is not None:
            logger.info("KL reference policy: %.1f MiB of CPU memory per rank", learner.reference.nbytes / 2**20)
    # a launched server (SGLang rollout or teacher) is stopped however the run ends, its set-up included; the
    # learner's process groups are torn down last, when the run ends without an error (the teardown's barrier
    # would wait for ranks that failed)
    with contextlib.ExitStack() as cleanup:
        cleanup.push(lambda exc_type, exc, tb: learner.close() if exc_type is None else None)
        distiller = distill_plan.build(cfg.parallel, learner.layout, cfg.model.options) if distill_plan else None
        if distiller is not None:
            cleanup.callback(distiller.close)
        rollout = _rollout_backend(cfg, learner, tokenizer, env=inputs.env)
        cleanup.callback(rollout.close)
        samples_dir = os.path.join(cfg.log.output_dir, "eval_samples") if is_writer and cfg.eval.save_samples else None
        evaluator = Evaluator(cfg.eval, eval_sets, rollout, tokenizer, samples_dir=samples_dir)
        checkpoints = Checkpointer(
            cfg.checkpoint, cfg.checkpoint.dir, learner.layout, run_config=to_dict(cfg), total_steps=cfg.steps
        )

        start = 0
        stopper = EarlyStop(cfg.early_stop, [d.name for d in cfg.eval.datasets])
        resumed = learner.load(checkpoints)
        if resumed is not None:
            loader.load_state_dict(resumed.extra["data"])
            if "early_stop" in resumed.extra:
                stopper.load_state_dict(resumed.extra["early_stop"])
            rollout.restore_weights(learner, resumed.extra["weight_version"])
            start = resumed.step + 1
            if is_writer:
                _drop_metrics_after(os.path.join(cfg.log.output_dir, "metrics.jsonl"), resumed.step)
        metrics = MetricsLogger(
            cfg.log, total_steps=cfg.steps, start_step=start, enabled=is_writer, run_config=to_dict(cfg)
        )
        cleanup.callback(metrics.close)
        prefetch = (
            Prefetcher(
                loader,
                lambda ids, seed: rollout.start_generate(ids, cfg.rollout.group_size, cfg.rollout.sampling, seed=seed),
                rollout.finish_generate,
            )
            if cfg.rollout.max_staleness > 0
            else None
        )
        state = Run(cfg, learner, rollout, loader, rewards, tokenizer, prefetch, distiller, inputs.data_files, stopper)
        return _train(state, evaluator, checkpoints, metrics, start)


def _train(
    state: Run, evaluator: Evaluator, checkpoints: Checkpointer, metrics: MetricsLogger, start: int
) -> list[dict]:
    """Steps ``start`` .. ``cfg.steps - 1`` with their evaluations and checkpoints; the per-step metrics."""
    cfg = state.cfg
    history, evaluated = [], set()
    step = start
    stopper = state.stopper
    for step in range(start, cfg.steps):
        if evaluator.due(step):
            evaluation = evaluator.run(step)
            _log_eval(metrics, step, evaluation)
            evaluated.add(step)
            if stopper is not None and stopper.after_eval(evaluation):
                break
        record = gspo_step(state, step)
        if record is None:  # the prompts ran out (a finite number of epochs)
            break
        history.append(record)
        metrics.log(step, record)
        stop = stopper is not None and stopper.after_step(record)
        if checkpoints.due(step) or (stop and checkpoints.cfg.save_every > 0):
            _save_checkpoint(state, checkpoints, step)
        step += 1
        if stop:
            break
    if stopper is not None and stopper.reason and state.learner.is_writer:
        logger.info("early stop before step %d: %s", step, stopper.reason)
    if evaluator.sets and step not in evaluated:  # after the last step
        _log_eval(metrics, step, evaluator.run(step))
    return history


def _save_checkpoint(state: Run, checkpoints: Checkpointer, step: int) -> None:
    """Save checkpoint ``step`` with the trainer's state; a full disk is named as such (folder and step)."""
    extra = {"data": _data_state(state.loader, state.prefetch), "weight_version": step + 1}
    stopper = getattr(state, "stopper", None)  # a Run always has one; a stand-in state may not
    if stopper is not None:
        extra["early_stop"] = stopper.state_dict()
    if state.data_files is not None:
        extra["data_files"] = state.data_files
    with run_dir.disk_full_named(state.cfg.checkpoint.dir, "checkpoint.dir", f"saving the checkpoint of step {step}"):
        state.learner.save(checkpoints, step, extra=extra)


def gspo_step(run: Run, step: int) -> dict | None:
    """One GSPO step: roll out and score groups (dynamic sampling may add rounds), take group advantages,
    train (the learner computes old log-probs where needed, then one update per mini-batch), and serve the new
    weights as version ``step + 1``. Returns the step's metrics record, or ``None`` when no prompts are left.
    With asynchronous rollouts the first round was generated during the previous step, and this step starts
    the next one's before it trains."""
    cfg, learner, rollout = run.cfg, run.learner, run.rollout
    phases = _Phases()
    batch, generation_s = _rollout_batch(run, step, phases)  # rollout + reward
    if batch is None:
        return None
    if run.prefetch is not None and step + 1 < cfg.steps:  # step s+1's first round, made while step s trains
        run.prefetch.start(step + 1, cfg.rollout.prompts_per_step, seed=rollout_seed(cfg.seed, step + 1, 0))
    with phases("train"):
        advantages = group_advantages(batch.shaped, cfg.rollout.group_size, normalize_std=cfg.rollout.normalize_std)
        samples, left_out = learner_samples(
            batch.groups,
            advantages,
            batch.keep,
            mask_truncated=cfg.rollout.mask_truncated,
            token_shaping=batch.token_shaping,
            dense_layers=learner.arch.dense_layer_indices(),
        )
        rollout.before_train()  # colocated SGLang frees its GPU memory
        samples, distilled = run.distiller.apply(samples) if run.distiller else (samples, {})
        skipped = _too_few_samples(samples, cfg.batch.num_minibatches, step, warn=learner.is_writer)
        measure = cfg.routing.measure_every > 0 and step % cfg.routing.measure_every == 0
        updates = [] if skipped else learner.train(samples, measure_routing=measure)
    if run.prefetch is not None and not cfg.rollout.partial_rollouts:
        with phases("rollout_wait"):  # the learner idles here while the next batch is still generating
            run.prefetch.wait()
    # with rollout.partial_rollouts the next batch is still generating: the update pauses it (retract),
    # loads the new weights and continues it, and the step that takes it waits for the rest
    with phases("weight_sync"):
        rollout.sync_weights(learner, step + 1)  # the engine serves the updated policy as version step+1
    record = step_metrics(
        batch.groups,
        batch.scores,
        batch.shaped,
        batch.keep,
        updates,
        run.rewards.metrics(),
        cfg.rollout.group_size,
        timings=phases.seconds,
        left_out=left_out,
        update_skipped=skipped,
    ) | _sampling_metrics(cfg, batch, step)
    record.update(
        length_penalty_metrics(length_penalty_terms(batch.groups, cfg.rollout.group_size, cfg.rollout.length_penalty))
    )
    record["nonzero_advantage_fraction"] = float((advantages != 0).float().mean())  # samples with a signal
    if hasattr(run.loader.sampler, "metrics"):  # difficulty-aware sampling: pool sizes, draws per pool
        record.update(run.loader.sampler.metrics())
    record.update(staleness_metrics(batch.groups, step))  # the learner trains weight version `step`
    record.update(distill.step_metrics(distilled, record))
    episode_log.record(batch.groups, step, cfg.log.output_dir if learner.is_writer else None)  # causes first
    record.update(episode_metrics(batch.groups, max_error_fraction=cfg.reward.max_error_fraction))
    # the engine's generation time for this step's batch (in the background, for a prefetched one); not a
    # phase of the learner's step, so not part of time_step_s
    record["time_generation_s"] = generation_s
    return record


def _rollout_batch(run: Run, step: int, phases: _Phases) -> tuple[RolloutBatch | None, float]:
    """The step's scored rollout batch (:func:`~gspo_mcore.trainer.dynamic_sampling.collect`: rounds of fresh prompts
    until enough groups have a reward spread, with dynamic sampling), and the engine's generation seconds."""
    cfg = run.cfg
    G = cfg.rollout.group_size
    with phases("rollout"):
        first = run.prefetch.take(step) if run.prefetch is not None else None  # (prompts, groups) or None
    generation_s = run.prefetch.seconds if first is not None else 0.0  # the engine's busy time for this batch

    def draw(n):
        return first[0] if first is not None else run.loader.next_batch(n)

    def roll(prompts, round_):
        nonlocal first, generation_s
        with phases("rollout"):
            if first is not None:
                groups, first = first[1], None
            else:
                t0 = time.perf_counter()
                groups = run.rollout.generate(
                    [p if cfg.rollout.env else p.input_ids for p in prompts],
                    G,
                    cfg.rollout.sampling,
                    seed=rollout_seed(cfg.seed, step, round_),
                )
                generation_s += time.perf_counter() - t0
        with phases("reward"):
            scores, shaped, token_shaping = _score(cfg, groups, prompts, run.rewards, run.tokenizer)
        _observe(run.loader.sampler, prompts, scores, G)
        return groups, scores, shaped, token_shaping

    stale = cfg.rollout.max_staleness
    batch = collect(
        draw,
        roll,
        target=cfg.rollout.prompts_per_step,
        group_size=G,
        dynamic=cfg.rollout.dynamic_sampling,
        max_rounds=cfg.rollout.max_sampling_rounds,
        drop_zero_advantage_groups=cfg.rollout.drop_zero_advantage_groups,
        usable=(lambda groups: fresh_groups(groups, version=step, max_staleness=stale)) if stale else None,
    )
    if batch is not None and batch.short:
        logger.warning(
            "step %d: dynamic sampling kept %d of rollout.prompts_per_step=%d groups after %d round(s) "
            "(rollout.max_sampling_rounds=%d): training on those",
            step,
            int(batch.keep.sum()),
            cfg.rollout.prompts_per_step,
            batch.rounds,
            cfg.rollout.max_sampling_rounds,
        )
    return batch, generation_s


def _observe(sampler, prompts, scores: torch.Tensor, group_size: int) -> None:
    """Difficulty-aware sampling: each prompt's group of task rewards (every group generated, kept or not)."""
    if not hasattr(sampler, "observe"):
        return
    for p, rewards in zip(prompts, scores.view(-1, group_size).tolist()):
        sampler.observe(p.index, rewards)


def _too_few_samples(samples, num_minibatches: int, step: int, *, warn: bool = True) -> bool:
    """Whether the step makes no update: fewer samples than ``batch.num_minibatches`` (warned once, by the rank
    that ``warn``s: every rank holds the same batch)."""
    if len(samples) >= num_minibatches:
        return False
    if not warn:
        return True
    logger.warning(
        "step %d: %d samples to train on, fewer than batch.num_minibatches=%d: no update",
        step,
        len(samples),
        num_minibatches,
    )
    return True


def _score(cfg: TrainConfig, groups, prompts, rewards, tokenizer) -> tuple[torch.Tensor, torch.Tensor, list]:
    """The task rewards of a round's groups, the shaped ones the advantages are taken from, and each sample's
    per-token reward terms (``None`` for a sample whose rewards returned none)."""
    G = cfg.rollout.group_size
    metas = [p.sample.metadata for p in prompts for _ in range(G)]
    texts = [text for p in prompts for text in [tokenizer.decode(p.input_ids)] * G]  # for a failure's message
    ids = [s.response_ids for g in groups for s in g]
    values, token_shaping = rewards.score_tokens(decode_responses(groups, tokenizer), metas, ids, prompts=texts)
    scores = torch.tensor(values, dtype=torch.float32) + episode_rewards(groups)  # (num_groups * G,)
    shaped = scores + overlong_penalties(
        groups,
        max_new_tokens=cfg.rollout.sampling.max_new_tokens,
        buffer=cfg.rollout.overlong_buffer,
        penalty=cfg.rollout.overlong_penalty,
    )
    terms = length_penalty_terms(groups, G, cfg.rollout.length_penalty)  # per token / turn / tool call
    if terms:
        shaped = shaped + sum(terms.values()).float()
    return scores, shaped, token_shaping


def _sampling_metrics(cfg: TrainConfig, batch: RolloutBatch, step: int) -> dict:
    """Dynamic sampling's figures (rounds used, groups generated, groups missing from the target) and
    asynchronous rollouts' (groups dropped as too stale)."""
    out = {}
    if cfg.rollout.dynamic_sampling:
        out |= {
            "sampling_rounds": batch.rounds,
            "groups_generated": len(batch.groups),
            "sampling_groups_short": batch.short,
        }
    if cfg.rollout.max_staleness > 0:  # the lags themselves: staleness_metrics
        out["stale_groups_dropped"] = batch.unusable
    return out


def _data_state(loader: PromptLoader, prefetch: Prefetcher | None) -> dict:
    """The data position a checkpoint saves: before the in-flight batch of the next step, if any (a
    resumed run regenerates it)."""
    return {"sampler": prefetch.loader_state()["sampler"]} if prefetch is not None else loader.state_dict()


class _Phases:
    """Wall-clock seconds per named phase of a step."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


def _rollout_backend(cfg: TrainConfig, learner: Learner, tokenizer, *, env=None) -> RolloutBackend:
    arch = learner.arch
    routed = (arch.num_hidden_layers, arch.num_experts_per_tok) if cfg.routing.replay == "rollout" else None
    if cfg.rollout.engine == "sglang" and cfg.rollout.env:
        return SGLangAgentRollout(
            cfg.rollout,
            tokenizer,
            model_dir=cfg.model.hf_dir,
            output_dir=cfg.log.output_dir,
            layout=learner.layout,
            env=env,
            routed_experts=routed,
        )
    if cfg.rollout.engine == "sglang":
        return SGLangRollout(
            cfg.rollout.sglang,
            model_dir=cfg.model.hf_dir,
            output_dir=cfg.log.output_dir,
            layout=learner.layout,
            routed_experts=routed,
            lora=cfg.lora,
        )
    if cfg.rollout.env:
        return AgentRollout(learner, tokenizer, cfg.rollout, env=env)
    return InProcessRollout(
        learner, tokenizer, max_batch_size=cfg.rollout.max_batch_size, decode_threads=cfg.rollout.decode_threads
    )


def _log_eval(metrics: MetricsLogger, step: int, record: dict) -> None:
    metrics.log(step, record, advance=False)
    summary = ", ".join(
        f"{k.removeprefix('eval/')} {v:.3f}" for k, v in record.items() if k.endswith(("/reward_mean", "/pass@1"))
    )
    logger.info("eval at step %d: %s", step, summary)


def _drop_metrics_after(path: str, step: int) -> None:
    """Keep the records of steps ``<= step``: a resumed run re-logs the steps after its checkpoint. Only the
    last line may be cut short (a killed run); any other unreadable line is an error."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    kept = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON record; cannot resume the metrics log") from None
        if record.get("step", -1) <= step:
            kept.append(line)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)
