"""The calculator environment of the SmolLM2 agent example: the built-in calculator as the only tool, a
system message that offers it, and (optionally) one worked example as earlier chat turns.

SmolLM2's chat template takes no ``tools``, so the schemas are shown in the documented fallback format
(``gspo_mcore.envs.render.FALLBACK_TOOL_PROMPT``: a system message listing them, ``<tool_call>{json}</tool_call>``
calls, results as user messages ``<tool_response>...</tool_response>``). A 135M model rarely finds that format
from the schema alone; ``demo: true`` puts one short solved exchange (a call, its result, the answer) before
the row's question, in exactly the rendering the episode will use, so the model sees the format once.

The rows are the single-turn example's (``examples/smollm2_arithmetic/prepare_data.py``): the question, then
"Answer with the number only.", and the reward is its ``last_integer`` on the final turn.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from gspo_mcore.envs import Reset, ToolEnv
from gspo_mcore.envs.builtin import calculator

SYSTEM_PROMPT = (
    "You are a helpful assistant with a calculator. Use the calculator for arithmetic, then give the answer."
)
"""The system message's own text; the fallback tool listing is appended to it."""

DEMO_QUESTION = "What is 3 plus 4? Answer with the number only."
DEMO_EXPRESSION = "3 + 4"


def demo_messages() -> list[dict]:
    """One solved exchange in the episode's own rendering: the question, the call, the tool's result (the
    fallback format's user message), the answer."""
    call = json.dumps({"name": "calculator", "arguments": {"expression": DEMO_EXPRESSION}})
    return [
        {"role": "user", "content": DEMO_QUESTION},
        {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
        {"role": "user", "content": f"<tool_response>\n{calculator(DEMO_EXPRESSION)}\n</tool_response>"},
        {"role": "assistant", "content": calculator(DEMO_EXPRESSION)},
    ]


class CalculatorEnv(ToolEnv):
    """:class:`~gspo_mcore.envs.ToolEnv` with the built-in calculator (see the module docstring).

    Args:
        system_prompt: the system message's own text (the fallback tool listing follows it).
        demo: put :func:`demo_messages` between the system message and the row's question.
        max_result_chars: a tool result is cut to this many characters.
    """

    def __init__(self, *, system_prompt: str = SYSTEM_PROMPT, demo: bool = True, max_result_chars: int = 200):
        if not isinstance(demo, bool):
            raise ValueError(f"CalculatorEnv: demo must be true or false, got {demo!r}")
        super().__init__([calculator], system_prompt=system_prompt, max_result_chars=max_result_chars)
        self.demo = demo

    def reset(self, row: Mapping[str, Any]) -> Reset:
        first = super().reset(row)
        if not self.demo:
            return first
        messages = list(first.observation)
        at = 1 if messages and messages[0]["role"] == "system" else 0
        messages[at:at] = demo_messages()
        return Reset(observation=messages, state=first.state, tools=first.tools)
