"""How the trainer gets rollouts and keeps the engine's weights current: one small class per engine.

This is where the learner (Megatron model, HF export) and the rollout engines meet, so that neither
package imports the other. Both backends implement :class:`RolloutBackend`; every rank calls every
method in the same order.

- :class:`InProcessRollout`: each data-parallel rank samples its share of the prompts from the learner's
  own model; the groups are gathered so every rank holds the whole batch. No weight sync.
- :class:`SGLangRollout`: global rank 0 drives SGLang servers (launched here, or given by URL) through
  the project's client and broadcasts the groups. After each training step every rank takes part in the
  HF export of the sharded weights (:func:`gspo_mcore.learner.hf.export.hf_buckets`) and rank 0 pushes it
  to the servers: ``tensor`` (colocated servers: shared tensors) or ``disk`` (an exported safetensors
  directory). Colocated servers release their GPU memory while the learner trains.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import os
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from gspo_mcore.config import check_literals
from gspo_mcore.rollout.sglang_server import SGLangServers
from gspo_mcore.rollout.types import Sample, SamplingParams


class GenerateHandle:
    """A generation that :meth:`RolloutBackend.start_generate` started, for :meth:`RolloutBackend.finish_generate`."""

    seconds: float | None = None
    """How long the engine generated, once it has finished (``None`` before, and on ranks that do not drive it)."""


class RolloutBackend(abc.ABC):
    """What the training loop and the evaluator need of a rollout engine: every method they call is declared here
    (an optional one with its default). Every rank calls every method, in the same order."""

    runs_episodes: bool = False
    """Whether :meth:`generate` runs multi-turn episodes of ``rollout.env`` (its prompts are then the loader's
    items or the dataset's rows, which reset the environment), not one response per prompt's token ids."""

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams, *, seed: int) -> list[list[Sample]]:
        """``n`` samples for each prompt, on every rank. The samples depend only on ``seed``, the prompts
        and ``params``, not on the parallel layout."""

    def start_generate(self, prompts: list[list[int]], n: int, params: SamplingParams, *, seed: int) -> GenerateHandle:
        """Start :meth:`generate` in the background (asynchronous rollouts, ``rollout.max_staleness >= 1``); the
        learner trains meanwhile. By default a backend generates synchronously only, and says so."""
        raise RuntimeError(
            f"{type(self).__name__} generates synchronously only (rollout.max_staleness: 0): no start_generate"
        )

    def finish_generate(self, handle: GenerateHandle) -> list[list[Sample]]:
        """The groups of a :meth:`start_generate`, on every rank (a collective, like :meth:`generate`)."""
        raise RuntimeError(
            f"{type(self).__name__} generates synchronously only (rollout.max_staleness: 0): no finish_generate"
        )

    def before_train(self) -> None:  # noqa: B027 - optional: most backends have nothing to free
        """The learner is about to train (colocated engines free their memory). Default: nothing."""

    @abc.abstractmethod
    def sync_weights(self, learner, version: int) -> None:
        """The learner's parameters changed: serve them from now on, tagged ``version``."""

    @abc.abstractmethod
    def restore_weights(self, learner, version: int) -> None:
        """A resumed run: serve the parameters just restored from a checkpoint, tagged ``version`` (before
        the first rollout; the engine may still hold the weights it was started with)."""

    def close(self) -> None:  # noqa: B027 - optional: a backend that started nothing has nothing to release
        """Release the engine (servers this run launched are stopped). Default: nothing."""


@dataclass(frozen=True, kw_only=True)
class SGLangConfig(SGLangServers):
    """SGLang servers for rollouts: connect to ``urls`` (or ``router_url``), or launch ``num_servers`` from the
    model dir (the servers' settings: :class:`~gspo_mcore.rollout.sglang_server.SGLangServers`), and how the
    learner's weights reach them."""

    router_url: str | None = None
    """An sglang-router in front of the servers (generation goes there; control calls to ``urls``)."""
    weight_sync: Literal["tensor", "disk", "distributed"] = "tensor"
    """``tensor`` (colocated, shared tensors), ``disk`` (safetensors directory under the run's output) or
    ``distributed`` (broadcast from learner rank 0 over a process group shared with the servers: NCCL on
    GPU, gloo on CPU)."""
    group_address: str = "127.0.0.1"
    """``distributed``: the address of learner rank 0 that the servers can reach (its rendezvous)."""
    colocate: bool = True
    """Servers share the learner's GPUs: release their memory while training, resume before syncing."""
    sync_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """dtype of the exported weights."""
    bucket_mb: int = 512
    """Weight-sync bucket size."""
    lora_mode: Literal["merged", "adapter"] = "merged"
    """A LoRA run (``lora.rank > 0``): ``merged`` pushes the merged weights ``W + (alpha/r) B A`` through
    ``weight_sync`` (the model's size; the only mode on a CPU); ``adapter`` (GPU servers, ``weight_sync`` tensor or
    disk) starts launched servers with LoRA enabled and pushes only the adapter each update, as a new adapter
    version the requests name (docs/lora.md)."""

    def __post_init__(self):
        super().__post_init__()
        check_literals(self)
        if self.bucket_mb < 1:
            raise ValueError("SGLangConfig.bucket_mb must be >= 1")


class InProcessRollout(RolloutBackend):
    """Sampling from the learner's live model on the same ranks (see :mod:`gspo_mcore.rollout.inprocess`)."""

    def __init__(self, learner, tokenizer, *, max_batch_size: int, decode_threads: int | None = None):
        """``learner``: the :class:`~gspo_mcore.learner.Learner` whose live model samples; ``decode_threads``:
        the engine's (``rollout.decode_threads``)."""
        from gspo_mcore.rollout.inprocess import InProcessEngine

        self.layout = learner.layout
        self.engine = InProcessEngine(
            learner.decode_model(),
            eos_token_id=tokenizer.eos_token_id,
            vocab_size=learner.arch.vocab_size,
            pad_token_id=tokenizer.pad_token_id or 0,
            max_batch_size=max_batch_size,
            decode_threads=decode_threads,
        )

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams, *, seed: int):
        """``n`` samples per prompt: each DP rank generates a contiguous share, then all ranks gather."""
        layout = self.layout
        share = dp_share(len(prompts), layout.dp_size, layout.dp_rank)
        params = dataclasses.replace(params, seed=seed)
        mine = (
            self.engine.generate_sync(prompts[share.start : share.stop], n, params, prompt_offset=share.start)
            if len(share)
            else []
        )
        if layout.dp_size == 1:
            return mine
        parts = [None] * layout.dp_size
        dist.all_gather_object(parts, mine, group=layout.dp_group)
        return [g for part in parts for g in part]

    def sync_weights(self, learner, version: int) -> None:
        self.engine.set_weight_version(version)  # it reads the updated parameters directly

    def restore_weights(self, learner, version: int) -> None:
        self.engine.set_weight_version(version)  # it reads the restored parameters directly


ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"


class SGLangRollout(RolloutBackend):
    """Rollouts from SGLang servers, driven by global rank 0."""

    last_sync_bytes: int | None = None
    """``lora_mode: adapter``: the bytes of the last adapter push (rank 0)."""

    def __init__(
        self,
        cfg: SGLangConfig,
        *,
        model_dir: str,
        output_dir: str,
        layout,
        routed_experts: tuple[int, int] | None = None,
        lora=None,
    ):
        """``routed_experts``: ``(num_layers, topk)`` to ask the servers for the experts they routed every token
        to (``routing.replay: rollout``); launched servers get ``--enable-return-routed-experts``, and every
        server must report it in ``/server_info``. ``lora``: the run's
        :class:`~gspo_mcore.learner.lora.LoraConfig` (for ``lora_mode: adapter``; launched servers then get
        LoRA enabled for its rank and targets)."""
        self.lora = lora
        if cfg.lora_mode == "adapter":
            from gspo_mcore.learner.lora import ALL_LINEAR, HF_TARGETS
            from gspo_mcore.rollout.sglang_lora import check_lora_mode, server_lora_args

            if lora is None:
                raise ValueError(
                    "rollout.sglang.lora_mode: adapter is not wired for this rollout (multi-turn episodes); use merged"
                )
            check_lora_mode(
                cfg.lora_mode, lora_rank=lora.rank, weight_sync=cfg.weight_sync, has_gpu=torch.cuda.is_available()
            )
            if not cfg.urls and "--enable-lora" not in cfg.extra_args:
                targets = HF_TARGETS if ALL_LINEAR in lora.target_modules else lora.target_modules
                cfg = dataclasses.replace(cfg, extra_args=(*cfg.extra_args, *server_lora_args(lora.rank, targets)))
        if routed_experts is not None:
            cfg = dataclasses.replace(cfg, client=dataclasses.replace(cfg.client, routed_experts=routed_experts))
            if not cfg.urls and ROUTED_EXPERTS_FLAG not in cfg.extra_args:
                cfg = dataclasses.replace(cfg, extra_args=(*cfg.extra_args, ROUTED_EXPERTS_FLAG))
        self.cfg, self.model_dir, self.output_dir, self.layout = cfg, model_dir, output_dir, layout
        self.is_driver = layout.rank == 0
        self.engine = self.loop = self.group = None
        if cfg.weight_sync == "tensor" and not torch.cuda.is_available():
            # CPU tensors travel through shared memory; torch's default file_descriptor strategy crashes
            # SGLang's receiving side (sglang.md), the file_system one works
            torch.multiprocessing.set_sharing_strategy("file_system")
        if self.is_driver:
            from gspo_mcore.rollout.sglang import SGLangEngine

            self.loop = asyncio.new_event_loop()
            if cfg.urls:
                self.engine = SGLangEngine(
                    list(cfg.urls), router_url=cfg.router_url, config=cfg.client, restart=cfg.restart_policy()
                )
            else:
                self.engine = SGLangEngine.launch(
                    cfg.launch_configs(model_dir),
                    config=cfg.client,
                    log_dir=os.path.join(output_dir, "sglang_logs"),
                    restart=cfg.restart_policy(),
                )
            self._run(self.engine.check_routed_experts())

    def _run(self, coro):
        return self.loop.run_until_complete(coro)

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams, *, seed: int):
        groups = (
            [self._run(self.engine.generate(prompts, n, dataclasses.replace(params, seed=seed)))]
            if self.is_driver
            else [None]
        )
        return self._broadcast(groups)

    def start_generate(self, prompts: list[list[int]], n: int, params: SamplingParams, *, seed: int) -> GenerateHandle:
        """Start :meth:`generate` in a background thread on the driver (its own event loop, with its own pooled
        connections, closed when that loop ends); returns the handle
        :meth:`finish_generate` takes. The learner trains meanwhile (``rollout.max_staleness >= 1``)."""
        if not self.is_driver:
            return GenerateHandle()
        params = dataclasses.replace(params, seed=seed)
        return _Background(lambda: asyncio.run(self.engine.generate(prompts, n, params)))

    def finish_generate(self, handle: GenerateHandle) -> list[list[Sample]]:
        """The groups of a :meth:`start_generate`, on every rank (a collective, like :meth:`generate`)."""
        return self._broadcast([handle.result() if self.is_driver else None])

    def _broadcast(self, groups: list):
        if self.layout.world_size > 1:
            dist.broadcast_object_list(groups, src=0)
        return groups[0]

    def before_train(self) -> None:
        if self.is_driver and self.cfg.colocate:
            self._run(self.engine.control.release_memory())

    def sync_weights(self, learner, version: int) -> None:
        """Every rank exports; rank 0 pushes the buckets to the servers and tags them ``version``."""
        if self.is_driver and self.cfg.colocate:
            self._run(self.engine.control.resume_memory())
        self._push(learner, version)

    def restore_weights(self, learner, version: int) -> None:
        """The servers were started from (or still serve) other weights: push the restored ones. They have
        not released their memory yet (that happens before the first training step)."""
        self._push(learner, version)

    def _push(self, learner, version: int) -> None:
        dtype = getattr(torch, self.cfg.sync_dtype)
        if self.cfg.lora_mode == "adapter":
            self._push_adapter(learner, dtype, version)
        elif self.cfg.weight_sync in ("tensor", "distributed"):
            buckets = learner.export_weights(dtype=dtype, bucket_bytes=self.cfg.bucket_mb * 2**20)
            if self.is_driver:
                if self.cfg.weight_sync == "distributed" and self.group is None:
                    self._init_group()
                self._run(self.engine.update_weights(buckets, version))  # over the group once it exists
            else:
                for _ in buckets:  # take part in the gather's collectives
                    pass
        else:
            path = self._export_to_disk(learner, dtype, version)
            if self.is_driver:
                self._run(self.engine.update_weights_from_disk(path, version))
        if self.layout.world_size > 1:
            dist.barrier()

    def _push_adapter(self, learner, dtype, version: int) -> None:
        """``lora_mode: adapter``: every rank gathers the adapters; rank 0 loads them on the servers as a new adapter
        version, from shared tensors (``weight_sync: tensor``) or a PEFT folder ``adapters/step_<v>`` (``disk``)."""
        from gspo_mcore.learner.hf.export_peft import live_adapter, write_peft_adapter
        from gspo_mcore.rollout.sglang_lora import adapter_nbytes

        tensors, config = live_adapter(learner.model, learner.arch, self.lora, base_model=self.model_dir, dtype=dtype)
        if self.is_driver:
            self.last_sync_bytes = adapter_nbytes(tensors)
            if self.cfg.weight_sync == "tensor":
                if torch.cuda.is_available():
                    tensors = {k: v.cuda() for k, v in tensors.items()}
                self._run(self.engine.update_adapter(version, tensors=tensors, config_dict=config))
            else:
                path = os.path.abspath(
                    os.path.join(self.output_dir, "adapters", f"step_{version}")
                )  # read by the servers
                shutil.rmtree(path, ignore_errors=True)
                write_peft_adapter(path, tensors, config)
                self._run(self.engine.update_adapter(version, path=path))
                shutil.rmtree(os.path.join(self.output_dir, "adapters", f"step_{version - 1}"), ignore_errors=True)

    def _init_group(self) -> None:
        """Create the weight-update group with every server (learner rank 0 is its rank 0)."""
        from gspo_mcore.platform.launch import free_port
        from gspo_mcore.rollout.weight_group import broadcast_bucket, trainer_side_group

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        port, name = free_port(), "gspo_mcore_weights"
        holder = {}

        def trainer_init(world_size: int) -> None:
            holder["group"] = trainer_side_group(self.cfg.group_address, port, world_size, name, backend=backend)

        def broadcast(bucket) -> None:
            broadcast_bucket(holder["group"])(bucket)

        self._run(
            self.engine.control.init_group(
                master_address=self.cfg.group_address,
                master_port=port,
                trainer_init=trainer_init,
                broadcast=broadcast,
                group_name=name,
                backend=backend,
            )
        )
        self.group = holder["group"]

    def _export_to_disk(self, learner, dtype, version: int) -> str:
        """Every rank takes part in the export; rank 0 writes it as a Hugging Face folder ``weights/step_<v>``."""
        from gspo_mcore.learner.hf.folder import copy_files, side_files, write_safetensors

        path = os.path.join(self.output_dir, "weights", f"step_{version}")
        tmp = path + ".tmp"
        plan = learner.export_plan(dtype=dtype)
        named = (
            item
            for bucket in learner.export_weights(dtype=dtype, bucket_bytes=self.cfg.bucket_mb * 2**20, plan=plan)
            for item in bucket
        )
        if not self.is_driver:
            for _ in named:  # take part in the gather's collectives
                pass
            return path
        shutil.rmtree(tmp, ignore_errors=True)
        write_safetensors(tmp, named, [(it.name, it.nbytes) for it in plan], max_shard_bytes=self.cfg.bucket_mb * 2**20)
        copy_files(self.model_dir, tmp, side_files(self.model_dir))
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        previous = os.path.join(self.output_dir, "weights", f"step_{version - 1}")
        shutil.rmtree(previous, ignore_errors=True)  # keep only the weights the servers serve
        return path

    def close(self) -> None:
        if self.is_driver and self.engine is not None:
            self._run(self.engine.close())
            self.loop.close()


class _Background(GenerateHandle):
    """``fn()`` in a daemon thread; :meth:`result` joins it and returns its value or raises its error.
    ``seconds``: how long ``fn`` ran (the engine's busy time for a generation), once it has returned."""

    def __init__(self, fn):
        self._value = self._error = None
        self._thread = threading.Thread(target=self._main, args=(fn,), name="gspo-rollout", daemon=True)
        self._thread.start()

    def _main(self, fn) -> None:
        t0 = time.perf_counter()
        try:
            self._value = fn()
        except BaseException as e:  # re-raised in the caller's thread
            self._error = e
        finally:
            self.seconds = time.perf_counter() - t0

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def dp_share(n: int, dp_size: int, dp_rank: int) -> range:
    """The contiguous slice of ``n`` items that data-parallel rank ``dp_rank`` takes."""
    base, extra = divmod(n, dp_size)
    start = dp_rank * base + min(dp_rank, extra)
    return range(start, start + base + (dp_rank < extra))
