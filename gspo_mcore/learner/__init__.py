"""The learner: Qwen3 / Qwen3-MoE / Llama / Qwen2 on Megatron-Core, trained with GSPO (TP/PP/EP/CP/DP; CPU
with gloo or GPU).

A trainer uses one object, :class:`Learner` (``learner.py``), the only door into the package::

    arch = load_hf_config("ckpt/config.json")                            # model_config: the architecture
    learner = Learner.build(arch, parallel=ParallelConfig(tensor=2), optim=OptimConfig(lr=1e-6))
    old = learner.logprobs(samples)                                      # forward only
    metrics = learner.train(samples)                                     # every mini-batch update of one step
    buckets = learner.export_weights(dtype=torch.bfloat16)               # Hugging Face tensors, in buckets
    learner.close()                                                      # the process groups, at the end

The modules underneath, one job each: ``parallel`` (process groups, the layout), ``model`` (GPTModel in Megatron
DDP), ``optimizer``, ``batching`` (samples -> micro-batches), ``schedule`` (Megatron's pipeline schedule),
``forward`` (per-token log-probs, forward-only passes), ``loss`` (the loss adapter), ``routing`` (MoE routing
record/replay and the step's :func:`~gspo_mcore.learner.routing.plan`), ``step`` (one training step, under its
:class:`~gspo_mcore.learner.step.StepSettings`), ``kl_reference`` (the KL term's frozen initial policy),
``teacher`` (the distillation teacher), ``checkpoint``, ``inference`` (the KV-cache decode model of the
in-process engine), ``hf`` (Hugging Face weight I/O: load, export, the name map). ``samples`` is a list of
:class:`TrainSample` (``batching``), the same on every rank. This package exports the Learner, its configs,
:class:`TrainSample`, :class:`ModelArch` and :func:`load_hf_config`; everything else is imported from its module
(``from gspo_mcore.learner.parallel import init_parallel``). Importing this package does not import megatron; the
functions do. :class:`~gspo_mcore.algo.LossConfig` and :class:`~gspo_mcore.algo.OffPolicyConfig` belong to the
algorithm (``gspo_mcore.algo``) and are re-exported here for convenience.
"""

from gspo_mcore.algo.loss_config import LossConfig, OffPolicyConfig
from gspo_mcore.learner.batching import TrainSample
from gspo_mcore.learner.learner import Learner
from gspo_mcore.learner.model import ModelOptions
from gspo_mcore.learner.model_config import ModelArch, load_hf_config
from gspo_mcore.learner.optimizer import OptimConfig
from gspo_mcore.learner.parallel import ParallelConfig
from gspo_mcore.learner.routing import RoutingConfig
from gspo_mcore.learner.step import BatchConfig

__all__ = [
    "BatchConfig",
    "Learner",
    "LossConfig",
    "ModelArch",
    "ModelOptions",
    "OffPolicyConfig",
    "OptimConfig",
    "ParallelConfig",
    "RoutingConfig",
    "TrainSample",
    "load_hf_config",
]
