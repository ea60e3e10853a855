"""The learner: Qwen3 / Qwen3-MoE / Llama / Qwen2 on Megatron-Core, trained with GSPO (TP/PP/EP/CP/DP; CPU
with gloo or GPU).

A trainer uses one object, :class:`Learner` (``learner.py``), which holds this rank's built state::

    arch = load_hf_config("ckpt/config.json")                            # model_config: the architecture
    learner = Learner.build(arch, parallel=ParallelConfig(tensor=2), optim=OptimConfig(lr=1e-6))
    old = learner.logprobs(samples)                                      # forward only
    metrics = learner.train(samples)                                     # every mini-batch update of one step
    buckets = learner.export_weights(dtype=torch.bfloat16)               # Hugging Face tensors, in buckets

The modules underneath, one job each: ``parallel`` (process groups, the layout), ``model`` (GPTModel in Megatron
DDP), ``optimizer``, ``batching`` (samples -> micro-batches), ``schedule`` (Megatron's pipeline schedule),
``logprobs`` (per-token log-probs, forward-only passes), ``loss`` (the loss adapter), ``routing`` (MoE routing
record/replay and the step's :func:`~gspo_mcore.learner.routing.plan`), ``step`` (one training step),
``checkpoint``, ``inference`` (the KV-cache decode model of the in-process engine). ``samples`` is a list of
:class:`Sample` (``batching``), the same on every rank. Importing this package does not import megatron; the
functions do. :class:`~gspo_mcore.algo.LossConfig` and :class:`~gspo_mcore.algo.OffPolicyConfig` belong to the
algorithm (``gspo_mcore.algo``) and are re-exported here for convenience.
"""

from gspo_mcore.algo.loss_config import LossConfig, OffPolicyConfig
from gspo_mcore.learner.batching import MicroBatch, Sample, build_microbatch, plan_microbatches, split_minibatches
from gspo_mcore.learner.learner import Learner
from gspo_mcore.learner.logprobs import forward_logprobs, forward_logprobs_with_routing
from gspo_mcore.learner.model import ModelOptions, build_model, have_transformer_engine, init_weights, unwrap
from gspo_mcore.learner.model_config import ModelShape, load_hf_config, transformer_config
from gspo_mcore.learner.optimizer import OptimConfig, build_optimizer
from gspo_mcore.learner.parallel import (
    Layout,
    ParallelConfig,
    current_layout,
    destroy_parallel,
    init_parallel,
    validate_layout,
)
from gspo_mcore.learner.reference import ReferencePolicy
from gspo_mcore.learner.routing import RoutingConfig
from gspo_mcore.learner.schedule import microbatches_for_rank
from gspo_mcore.learner.step import BatchConfig, forward_backward, train_minibatch, train_step

__all__ = [
    "BatchConfig",
    "Layout",
    "Learner",
    "LossConfig",
    "MicroBatch",
    "ModelOptions",
    "ModelShape",
    "OffPolicyConfig",
    "OptimConfig",
    "ParallelConfig",
    "ReferencePolicy",
    "Sample",
    "build_microbatch",
    "build_model",
    "build_optimizer",
    "current_layout",
    "RoutingConfig",
    "destroy_parallel",
    "forward_backward",
    "forward_logprobs",
    "forward_logprobs_with_routing",
    "have_transformer_engine",
    "init_parallel",
    "init_weights",
    "load_hf_config",
    "microbatches_for_rank",
    "plan_microbatches",
    "split_minibatches",
    "train_minibatch",
    "train_step",
    "transformer_config",
    "unwrap",
    "validate_layout",
]
