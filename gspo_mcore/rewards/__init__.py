"""Verifiable rewards: math answer equivalence, exact / regex match, code run in a sandbox, user functions.

``registry.get(name)`` gives a reward function ``fn(response, metadata) -> float``; ``RewardRunner``
scores a batch concurrently, turning failures and timeouts into a counted reward of 0. Model-written
code runs only inside ``sandbox.run_python``.
"""

from gspo_mcore.rewards.registry import RewardFn, get, names, register, unregister
from gspo_mcore.rewards.runner import RewardRunner, RewardRunnerConfig

__all__ = ["RewardFn", "RewardRunner", "RewardRunnerConfig", "get", "names", "register", "unregister"]
