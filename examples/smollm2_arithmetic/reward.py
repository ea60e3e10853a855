"""The arithmetic example's rewards: ``last_integer`` (1.0 when the last integer in the response equals the answer)
and, to measure the form of the answers in evaluation, ``number_only`` (a bare integer) and ``equation_only``.

The prompts ask for "the number only" (no ``\\boxed{}``), so the project's ``math`` reward, which reads the
last ``\\boxed{...}``, does not apply. Name this one in a job config by dotted path:
``examples.smollm2_arithmetic.reward:last_integer``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_INTEGER = re.compile(r"(?<![\d.])-?\d+(?:,\d{3})*(?![\d.]*\d)")


def last_integer(response: str, metadata: Mapping[str, Any]) -> float:
    """1.0 if the response's last integer (thousands commas allowed) equals ``metadata["answer"]``."""
    if metadata.get("answer") is None:
        raise KeyError("last_integer reward needs metadata['answer']")
    found = _INTEGER.findall(response)
    if not found:
        return 0.0
    return float(int(found[-1].replace(",", "")) == int(str(metadata["answer"]).strip()))


_NUMBER_ONLY = re.compile(r"\s*-?\d+(?:,\d{3})*\.?\s*")


def number_only(response: str, metadata: Mapping[str, Any]) -> float:
    """1.0 if the response is one integer and nothing else (a trailing period allowed), right or wrong.

    A format measure, used as a second evaluation of the same held-out items: how much of a change in
    ``last_integer`` comes from answering concisely rather than from the arithmetic."""
    return float(_NUMBER_ONLY.fullmatch(response) is not None)


_EQUATION = re.compile(r"\s*-?\d+\s*[-+]\s*-?\d+\s*=\s*-?\d+\.?\s*")


def equation_only(response: str, metadata: Mapping[str, Any]) -> float:
    """1.0 if the response is one equation ``a + b = c`` (or ``-``) and nothing else, right or wrong: the
    other short form a policy may settle on instead of the bare number."""
    return float(_EQUATION.fullmatch(response) is not None)
