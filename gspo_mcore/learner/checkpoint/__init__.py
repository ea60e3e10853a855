"""Crash-safe training checkpoints (see :mod:`.checkpointer`)."""

from gspo_mcore.learner.checkpoint.checkpointer import *  # noqa: F401,F403
from gspo_mcore.learner.checkpoint.checkpointer import __all__  # noqa: F401
