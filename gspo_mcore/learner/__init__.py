"""The learner: Qwen3 / Qwen3-MoE / Llama / Qwen2 on Megatron-Core, trained with GSPO (TP/PP/EP/DP; CPU
with gloo or GPU).

The pieces, in the order a trainer uses them::

    shape = load_hf_config("ckpt/config.json")               # model_config
    layout = init_parallel(ParallelConfig(tensor=2), shape)   # parallel (validates the layout first)
    model = build_model(shape, ParallelConfig(tensor=2))       # model (GPTModel in Megatron DDP)
    optimizer, scheduler = build_optimizer(model, OptimConfig(lr=1e-6))
    metrics = train_step(model, optimizer, scheduler, samples, layout, LossConfig(), BatchConfig())
    # MoE: RoutingConfig(replay="learner" | "rollout") as a further argument replays the old policy's experts

``samples`` is a list of :class:`Sample` (``batching``), the same on every rank. Importing this package
does not import megatron; the functions do.
"""

from gspo_mcore.learner.batching import MicroBatch, Sample, build_microbatch, plan_microbatches, split_minibatches
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
from gspo_mcore.learner.step import (
    BatchConfig,
    LossConfig,
    OffPolicyConfig,
    forward_backward,
    forward_logprobs,
    forward_logprobs_with_routing,
    microbatches_for_rank,
    train_minibatch,
    train_step,
)

__all__ = [
    "BatchConfig",
    "Layout",
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
