"""The multi-hop example's environment: :class:`~gspo_mcore.envs.lookup.LookupEnv` (``lookup`` over the generated
table of people, and the calculator), a system message that says how to call both, and worked exchanges as
earlier chat turns (the question, the lookup, its result, the calculator call, its result, the answer), rendered
exactly as an episode renders calls in the fallback format (SmolLM2's chat template takes no ``tools``).

How many worked exchanges, and the temperature and group size, were screened on the untrained model
(``python -m examples.smollm2_multihop.screen``; figures in docs/results/agent-multihop.md).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from examples.smollm2_multihop.make_items import SUFFIX, TEMPLATES
from gspo_mcore.envs import Reset
from gspo_mcore.envs.builtin import calculator
from gspo_mcore.envs.lookup import LookupEnv

INSTRUCTIONS = {
    "three_steps": (
        "You are a helpful assistant with two tools. Answer a question about a person in three replies. First, "
        'look up the person\'s age: reply with only <tool_call>{"name": "lookup", "arguments": {"name": "..."}}'
        "</tool_call>. When the age comes back in <tool_response></tool_response>, compute: reply with only "
        '<tool_call>{"name": "calculator", "arguments": {"expression": "..."}}</tool_call>. When its result comes '
        "back, reply with that number only."
    ),
    "two_tools": (
        "You are a helpful assistant with two tools. To find a person's age, reply with only "
        '<tool_call>{"name": "lookup", "arguments": {"name": "..."}}</tool_call>. To compute, reply with only '
        '<tool_call>{"name": "calculator", "arguments": {"expression": "..."}}</tool_call>. '
        "Each result comes back in <tool_response></tool_response>; then reply with the answer."
    ),
}
"""The system messages screened (``MultihopEnv(instruction=...)``): ``three_steps`` says the order of the two calls
and the answer; ``two_tools`` only says how to call each tool."""
INSTRUCTION = INSTRUCTIONS["three_steps"]

EXAMPLE_PEOPLE = (("Zorvane", 41), ("Kelthim", 27), ("Drabosk", 63))
"""The worked exchanges' people (made up; in the table, never asked about in the data)."""
EXAMPLE_QUESTIONS = ((0, 12), (0, 5), (0, 30))
"""Per worked exchange: the template (``make_items.TEMPLATES``) and its ``n``."""


def _call(name: str, arguments: dict) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _result(text: str) -> dict:
    return {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}


def worked_example(k: int, name_fields: bool = True) -> list[dict]:
    """Worked exchange ``k``: question, lookup, its result (``age: 41``, or ``41`` without ``name_fields``: as
    :class:`LookupEnv` answers), calculator call, its result, answer."""
    (name, age), (template, n) = EXAMPLE_PEOPLE[k], EXAMPLE_QUESTIONS[k]
    text, expression, _ = TEMPLATES[template]
    expression = expression.format(age=age, n=n)
    answer = calculator(expression)
    return [
        {"role": "user", "content": text.format(name=name, n=n) + SUFFIX},
        {"role": "assistant", "content": _call("lookup", {"name": name})},
        _result(f"age: {age}" if name_fields else str(age)),
        {"role": "assistant", "content": _call("calculator", {"expression": expression})},
        _result(answer),
        {"role": "assistant", "content": answer},
    ]


class MultihopEnv(LookupEnv):
    """:class:`LookupEnv` with :data:`INSTRUCTION` and ``examples`` worked exchanges before the row's question.

    Args:
        table: the people table (a JSON file's path, or the mapping).
        examples: how many worked exchanges (0 to 3).
        instruction: the system message, a key of :data:`INSTRUCTIONS`.
        name_fields: the lookup answers ``age: 41`` (``True``) or ``41``.
        max_result_chars: a tool's result is cut to this many characters.
    """

    def __init__(
        self,
        *,
        table,
        examples: int = 2,
        instruction: str = "three_steps",
        name_fields: bool = True,
        max_result_chars: int = 200,
    ):
        if isinstance(examples, bool) or not isinstance(examples, int) or not 0 <= examples <= len(EXAMPLE_PEOPLE):
            raise ValueError(
                f"MultihopEnv: examples must be an integer from 0 to {len(EXAMPLE_PEOPLE)}, got {examples!r}"
            )
        if instruction not in INSTRUCTIONS:
            raise ValueError(f"MultihopEnv: instruction must be one of {sorted(INSTRUCTIONS)}, got {instruction!r}")
        super().__init__(
            table=table,
            system_prompt=INSTRUCTIONS[instruction],
            max_result_chars=max_result_chars,
            name_fields=name_fields,
        )
        self.examples, self.name_fields = examples, name_fields

    def reset(self, row: Mapping[str, Any]) -> Reset:
        first = super().reset(row)
        messages = list(first.observation)
        messages[1:1] = [m for k in range(self.examples) for m in worked_example(k, self.name_fields)]
        return Reset(observation=messages, state=first.state, tools=())  # the instruction says how to call
