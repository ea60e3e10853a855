"""Verifiable rewards: math answer equivalence, exact / regex match, code run in a sandbox, user functions.

``registry.get(name)`` gives a reward function ``fn(response, metadata) -> float``. ``RewardRunner``
(configured by the run config's ``reward:`` section, ``RewardRunnerConfig``) composes weighted terms,
scores a batch concurrently, counts failures per reward and cause, and raises ``RewardFailure`` when a
step's rewards cannot be trusted; ``check_reward_setup`` checks the rewards against the host and every
dataset row at start-up. Model-written code runs only inside ``sandbox.run_python``, and its verdicts
are decided on the host (``code.py``).
"""

from gspo_mcore.rewards.config import RewardRunnerConfig, RewardTermConfig
from gspo_mcore.rewards.preflight import check_reward_setup
from gspo_mcore.rewards.registry import RewardFn, TokenRewards, get, names, register, unregister
from gspo_mcore.rewards.resolve import RewardError, RewardSetupError
from gspo_mcore.rewards.runner import RewardFailure, RewardRunner

__all__ = [
    "RewardError",
    "RewardFailure",
    "RewardFn",
    "RewardRunner",
    "RewardRunnerConfig",
    "RewardSetupError",
    "RewardTermConfig",
    "TokenRewards",
    "check_reward_setup",
    "get",
    "names",
    "register",
    "unregister",
]
