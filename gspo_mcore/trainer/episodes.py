"""Multi-turn rollouts for the trainer (``rollout.env``): an engine driven by the episode driver.

In-process (:class:`AgentRollout`): each data-parallel rank runs the episodes of its share of the prompts;
within a tensor-parallel group only TP rank 0 runs the environment and broadcasts what it answers, so that
every rank feeds the engine the same tokens. The groups are gathered so every rank holds the whole batch, as
:class:`InProcessRollout` does.

SGLang (:class:`SGLangAgentRollout`): global rank 0 runs every episode (the environments and the driver) against
the servers, each turn a request continuing from the sequence's token ids (:meth:`SGLangEngine.generate_turns`),
and broadcasts the groups, as :class:`SGLangRollout` does.

Both hand their engine to the same :class:`~gspo_mcore.rollout.episode.EpisodeDriver`: every engine's
``generate_turns`` is a coroutine (:meth:`gspo_mcore.rollout.types.RolloutEngine.generate_turns`), which the driver
runs; this module only wires the environment, the renderer and the ranks.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from gspo_mcore.envs import ChatRenderer, load_env
from gspo_mcore.rollout.episode import EpisodeDriver
from gspo_mcore.rollout.types import SamplingParams
from gspo_mcore.trainer.backends import InProcessRollout, SGLangRollout, dp_share


class AgentRollout(InProcessRollout):
    """:class:`InProcessRollout` whose ``generate`` runs episodes of ``rollout.env`` (prompts: the loader's
    items or the dataset's rows, which the environment resets from; evaluation runs the same environment)."""

    runs_episodes = True

    def __init__(self, learner, tokenizer, rollout_cfg, *, env=None):
        super().__init__(
            learner, tokenizer, max_batch_size=rollout_cfg.max_batch_size, decode_threads=rollout_cfg.decode_threads
        )
        if not self.engine.model.own_cache:
            raise ValueError(
                "rollout.env: the in-process engine extends episodes on its own KV cache, which Transformer "
                "Engine's attention does not allow"
            )
        if env is None:  # the start-up checks build it (trainer.preflight.check_env); errors name rollout.env
            env = load_env(rollout_cfg.env, rollout_cfg.env_kwargs)
        layout = self.layout
        share = None
        if layout.tp_size > 1:
            src = dist.get_global_rank(layout.tp_group, 0)

            def share(value):
                box = [value]
                dist.broadcast_object_list(box, src=src, group=layout.tp_group)
                return box[0]

        renderer = ChatRenderer(tokenizer, tool_format=rollout_cfg.episode.tool_format)
        self.driver = EpisodeDriver(env, renderer, rollout_cfg.episode, runs_env=layout.tp_rank == 0, share=share)

    def generate(self, prompts, n: int, params: SamplingParams, *, seed: int):
        """``n`` episodes per prompt item (``PromptItem``: its dataset row resets the environment)."""
        layout = self.layout
        part = dp_share(len(prompts), layout.dp_size, layout.dp_rank)
        params = dataclasses.replace(params, seed=seed)
        rows = [_row(p) for p in prompts[part.start : part.stop]]
        mine = self.driver.run(self.engine, rows, n, params, seed=seed, prompt_offset=part.start) if rows else []
        if layout.dp_size == 1:
            return mine
        parts = [None] * layout.dp_size
        dist.all_gather_object(parts, mine, group=layout.dp_group)
        return [g for part in parts for g in part]


class SGLangAgentRollout(SGLangRollout):
    """:class:`SGLangRollout` whose ``generate`` runs episodes of ``rollout.env`` on rank 0 (prompts: the loader's
    items or the dataset's rows; evaluation runs the same environment)."""

    runs_episodes = True

    def __init__(
        self,
        rollout_cfg,
        tokenizer,
        *,
        model_dir: str,
        output_dir: str,
        layout,
        env=None,
        routed_experts: tuple[int, int] | None = None,
    ):
        """``routed_experts`` (R3): as :class:`SGLangRollout`'s; each sample keeps its last turn's routing, which
        covers the whole episode (environment spans from their prefill)."""
        super().__init__(
            rollout_cfg.sglang, model_dir=model_dir, output_dir=output_dir, layout=layout, routed_experts=routed_experts
        )
        self.driver = None
        if self.is_driver:
            if env is None:  # the start-up checks build it (trainer.preflight.check_env); errors name rollout.env
                env = load_env(rollout_cfg.env, rollout_cfg.env_kwargs)
            renderer = ChatRenderer(tokenizer, tool_format=rollout_cfg.episode.tool_format)
            self.driver = EpisodeDriver(env, renderer, rollout_cfg.episode)

    def generate(self, prompts, n: int, params: SamplingParams, *, seed: int):
        """``n`` episodes per prompt item, on every rank."""
        groups = [None]
        if self.is_driver:
            rows = [_row(p) for p in prompts]
            params = dataclasses.replace(params, seed=seed)
            groups = [self.driver.run(self.engine, rows, n, params, seed=seed) if rows else []]
        return self._broadcast(groups)

    def start_generate(self, prompts, n: int, params: SamplingParams, *, seed: int):
        raise RuntimeError("rollout.env: episodes are generated synchronously (rollout.max_staleness: 0)")


def _row(item) -> dict:
    sample = getattr(item, "sample", item)  # a loader's PromptItem, or a PromptSample (evaluation)
    return {"prompt": sample.prompt, "messages": sample.messages, "metadata": sample.metadata}
