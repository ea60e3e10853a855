"""Rollout engines: the interface the trainer uses, and the SGLang client.

``types`` holds the engine-independent interface (and the log-prob/temperature convention);
``sglang_api`` every detail of SGLang's HTTP wire format (pinned to ``SGLANG_VERSION``);
``inprocess`` the embedded engine that samples from the learner's own model;
``sglang`` the client engine (concurrency, retries, weight sync); ``sglang_server`` the launcher and the servers'
settings every user shares (:class:`SGLangServers`).
"""

from gspo_mcore.rollout.inprocess import InProcessEngine
from gspo_mcore.rollout.sglang import SGLangClientConfig, SGLangEngine
from gspo_mcore.rollout.sglang_api import SGLANG_VERSION
from gspo_mcore.rollout.sglang_server import RouterConfig, ServerLaunchError, SGLangServerConfig, SGLangServers
from gspo_mcore.rollout.types import (
    RolloutEngine,
    RolloutError,
    Sample,
    SamplingParams,
    WeightUpdateError,
    derive_sample_seed,
)

__all__ = [
    "SGLANG_VERSION",
    "InProcessEngine",
    "RolloutEngine",
    "RolloutError",
    "RouterConfig",
    "SGLangClientConfig",
    "SGLangEngine",
    "SGLangServerConfig",
    "SGLangServers",
    "Sample",
    "SamplingParams",
    "ServerLaunchError",
    "WeightUpdateError",
    "derive_sample_seed",
]
