"""The calculator environment of the SmolLM2 agent example: the built-in calculator as the only tool, a short
system message that says how to call it, and worked examples as earlier chat turns.

SmolLM2's chat template takes no ``tools``, so calls use the documented fallback format
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, results as user messages
``<tool_response>...</tool_response>``, see ``gspo_mcore.envs.render``). Two choices here were screened on the
untrained model (``python -m examples.smollm2_agent.screen``; figures in docs/results/agent-smollm2.md):

- the system message is one sentence with the call written out (:data:`INSTRUCTION`) instead of the fallback's
  JSON-schema listing: the same call syntax, about 100 prompt tokens fewer (277 -> 173 with one worked
  exchange), and a call rate as high;
- ``examples`` worked exchanges (:data:`EXAMPLES`: the question, the call, the tool's result, the answer) sit
  between the system message and the row's question, rendered exactly as an episode renders a call. The untrained
  model's first-turn call rate rises with their number: 0 with none, 9-14% with one, 50-58% with two, 86-97% with
  three (two screens of 16 held-out items x 4 samples). The example uses two: the model calls often enough for
  groups of 4 to hold a reward spread, and far from always, so training has something to learn.

The rows are the single-turn example's format (``examples/smollm2_arithmetic/prepare_data.py``): the question,
then "Answer with the number only."; the reward is its ``last_integer`` on the final turn.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from gspo_mcore.envs import Reset, ToolEnv
from gspo_mcore.envs.builtin import calculator

INSTRUCTION = (
    "You are a helpful assistant with a calculator. To use it, reply with only "
    '<tool_call>{"name": "calculator", "arguments": {"expression": "..."}}</tool_call>. '
    "Its result comes back in <tool_response></tool_response>; then reply with the answer."
)
"""The system message: the tool and its call syntax in one sentence (the fallback format's call)."""

EXAMPLES = (("What is 3 plus 4?", "3 + 4"), ("What is 12 plus 5?", "12 + 5"), ("What is 20 plus 31?", "20 + 31"))
"""The worked exchanges' questions and the expressions they call the calculator with (none is a held-out item)."""

SUFFIX = " Answer with the number only."
"""The rows' instruction, which the worked questions carry too."""


def worked_example(question: str, expression: str) -> list[dict]:
    """One solved exchange in the episode's own rendering: the question, the call, the tool's result (the
    fallback format's user message), the answer."""
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    result = calculator(expression)
    return [
        {"role": "user", "content": question + SUFFIX},
        {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
        {"role": "user", "content": f"<tool_response>\n{result}\n</tool_response>"},
        {"role": "assistant", "content": result},
    ]


class CalculatorEnv(ToolEnv):
    """:class:`~gspo_mcore.envs.ToolEnv` with the built-in calculator (see the module docstring).

    Args:
        examples: how many of :data:`EXAMPLES` to show before the row's question (0 to 3).
        instruction: the system message.
        max_result_chars: a tool result is cut to this many characters.
    """

    def __init__(self, *, examples: int = 2, instruction: str = INSTRUCTION, max_result_chars: int = 200):
        if isinstance(examples, bool) or not isinstance(examples, int) or not 0 <= examples <= len(EXAMPLES):
            raise ValueError(f"CalculatorEnv: examples must be an integer from 0 to {len(EXAMPLES)}, got {examples!r}")
        super().__init__([calculator], system_prompt=instruction, max_result_chars=max_result_chars)
        self.examples = examples

    def reset(self, row: Mapping[str, Any]) -> Reset:
        first = super().reset(row)
        messages = list(first.observation)
        at = 1 if messages and messages[0]["role"] == "system" else 0
        messages[at:at] = [m for q, e in EXAMPLES[: self.examples] for m in worked_example(q, e)]
        # no tools to list: the system message already says how to call the one there is
        return Reset(observation=messages, state=first.state, tools=())
