"""The trainer: the run configuration (:mod:`.config`), the loop (:mod:`.loop`), the rollout backends it
drives (:mod:`.backends`), the step's batch assembly (:mod:`.batch`) and held-out evaluation
(:mod:`.evaluation`).

Importing this package imports neither megatron nor SGLang; running a loop does.
"""

from gspo_mcore.trainer.config import EvalConfig, EvalSetConfig, ModelConfig, RolloutConfig, TrainConfig, resolve
from gspo_mcore.trainer.loop import run

__all__ = ["EvalConfig", "EvalSetConfig", "ModelConfig", "RolloutConfig", "TrainConfig", "resolve", "run"]
