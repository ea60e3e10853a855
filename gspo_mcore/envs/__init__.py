"""Environments and tools for multi-turn agents. Knows nothing of engines or the learner.

``base``: the interface (``reset(row) -> Reset``, ``step(state, action) -> Step``); ``tools``: plain Python
functions as tools and :class:`ToolEnv`; ``builtin``: a calculator and a sandboxed Python tool; ``render``:
observations -> token ids through the chat template, appending only what is new; ``config``: an episode's
limits and loading ``rollout.env``. See docs/agents.md.
"""

from gspo_mcore.envs.base import Environment, Reset, Step
from gspo_mcore.envs.config import EpisodeConfig, load_env
from gspo_mcore.envs.render import ChatRenderer
from gspo_mcore.envs.tools import Tool, ToolEnv, parse_tool_calls

__all__ = [
    "ChatRenderer",
    "Environment",
    "EpisodeConfig",
    "Reset",
    "Step",
    "Tool",
    "ToolEnv",
    "load_env",
    "parse_tool_calls",
]
