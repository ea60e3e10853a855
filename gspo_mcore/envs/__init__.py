"""Environments and tools for multi-turn agents. Knows nothing of engines or the learner.

``base``: the interface (``reset(row) -> Reset``, ``step(state, action) -> Step``); ``tools``: plain Python
functions as tools and :class:`ToolEnv`; ``builtin``: a calculator and a sandboxed Python tool; ``lookup``: a
table-lookup tool with the calculator (multi-hop tasks); ``render``: observations -> token ids through the chat
template, appending only what is new; ``config``: an episode's
limits and loading ``rollout.env``; ``agent``: an agent program (a function, or a black-box program behind an
OpenAI-compatible endpoint) as an environment. See docs/agents.md.
"""

from gspo_mcore.envs.agent import AgentEnv, ChatClient, EpisodeOver
from gspo_mcore.envs.base import Environment, Reset, Step
from gspo_mcore.envs.config import EpisodeConfig, load_env
from gspo_mcore.envs.lookup import LookupEnv
from gspo_mcore.envs.render import ChatRenderer
from gspo_mcore.envs.tools import Tool, ToolEnv, parse_tool_calls

__all__ = [
    "AgentEnv",
    "ChatClient",
    "EpisodeOver",
    "ChatRenderer",
    "Environment",
    "EpisodeConfig",
    "LookupEnv",
    "Reset",
    "Step",
    "Tool",
    "ToolEnv",
    "load_env",
    "parse_tool_calls",
]
