"""Code reward: the response's last Python code block, run against the sample's tests in the sandbox.

Test formats (``metadata["tests"]``):

- a string, or a list of strings: assert-style test code, run after the solution in its namespace
  (one string: reward 1/0; a list: the fraction that pass). With ``metadata["entry_point"]`` set, each
  test is followed by ``check(<entry_point>)`` (HumanEval style).
- a list of ``{"input": str, "output": str}``, or ``{"inputs": [...], "outputs": [...]}`` (APPS
  style, also as a JSON string): standard-input / standard-output cases, each a fresh sandboxed run;
  a case passes when the program exits 0 and its output equals the expected one up to trailing
  whitespace on each line and trailing blank lines. Reward: the fraction that pass.

Model-written code only ever runs through ``sandbox.run_python``. The sandbox protects the host; it
does not make the verdicts tamper-proof: code that digs the harness's nonce out of the interpreter's
memory could forge passes (``os._exit``, ``sys.exit`` and printing fake verdicts cannot).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from gspo_mcore.rewards.extract import last_code_block
from gspo_mcore.rewards.sandbox import SandboxConfig, run_python

_HARNESS = Path(__file__).with_name("_harness.py").read_text()


@dataclass(frozen=True, kw_only=True)
class CodeRewardConfig:
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Limits and isolation of each sandboxed run."""
    tests_key: str = "tests"
    max_cases: int = 32
    """Standard-input cases run at most (the first ones); the reward is the fraction of those."""
    test_timeout_s: float | None = 5.0
    """Time limit of each assert-style test inside the run (None: only the sandbox's limits)."""

    def __post_init__(self):
        if isinstance(self.max_cases, bool) or not isinstance(self.max_cases, int) or self.max_cases < 1:
            raise ValueError(f"CodeRewardConfig.max_cases must be an int >= 1, got {self.max_cases!r}")
        if self.test_timeout_s is not None and not self.test_timeout_s > 0:
            raise ValueError(f"CodeRewardConfig.test_timeout_s must be > 0 or None, got {self.test_timeout_s!r}")


def code_reward(response: str, metadata: Mapping[str, Any], *, config: CodeRewardConfig = CodeRewardConfig()) -> float:
    """Fraction of the sample's tests the response's code passes (0.0 without a code block)."""
    if metadata.get(config.tests_key) is None:
        raise KeyError(f"code reward needs metadata[{config.tests_key!r}]")
    code = last_code_block(response)
    if code is None:
        return 0.0
    kind, tests = parse_tests(metadata[config.tests_key], metadata.get("entry_point"))
    if kind == "assert":
        return run_assert_tests(code, tests, config=config)
    return run_stdio_tests(code, tests[: config.max_cases], config=config)


def parse_tests(tests: Any, entry_point: str | None = None) -> tuple[str, list]:
    """``("assert", [code, ...])`` or ``("stdio", [(input, output), ...])``."""
    if isinstance(tests, str) and tests.lstrip().startswith("{"):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError:
            pass
    if isinstance(tests, Mapping):
        inputs, outputs = tests.get("inputs"), tests.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
            raise ValueError("stdio tests need equally long 'inputs' and 'outputs' lists")
        return "stdio", [(_text(i), _text(o)) for i, o in zip(inputs, outputs)]
    if isinstance(tests, str):
        tests = [tests]
    if not isinstance(tests, (list, tuple)) or not tests:
        raise ValueError(
            f"tests must be a string, a non-empty list or an inputs/outputs mapping, got {type(tests).__name__}"
        )
    if all(isinstance(t, Mapping) for t in tests):
        return "stdio", [(_text(t["input"]), _text(t["output"])) for t in tests]
    if all(isinstance(t, str) for t in tests):
        suffix = f"\ncheck({entry_point})\n" if entry_point else ""
        return "assert", [t + suffix for t in tests]
    raise ValueError("a tests list must hold only strings or only {'input', 'output'} mappings")


def run_assert_tests(code: str, tests: list[str], *, config: CodeRewardConfig) -> float:
    nonce = secrets.token_hex(16)
    payload = json.dumps({"nonce": nonce, "tests": tests, "test_timeout_s": config.test_timeout_s})
    result = run_python(_HARNESS, stdin=payload.encode(), files={"solution.py": code}, config=config.sandbox)
    passed = set()
    for line in result.stdout.decode(errors="replace").splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == nonce and parts[2] == "1" and parts[1].isdigit():
            passed.add(int(parts[1]))
    return len(passed & set(range(len(tests)))) / len(tests)


def run_stdio_tests(code: str, cases: list[tuple[str, str]], *, config: CodeRewardConfig) -> float:
    passed = 0
    for stdin, expected in cases:
        result = run_python(code, stdin=stdin.encode(), config=config.sandbox)
        passed += result.ok and _lines(result.stdout.decode(errors="replace")) == _lines(expected)
    return passed / len(cases)


def _text(x: Any) -> str:
    return "\n".join(map(str, x)) if isinstance(x, list) else str(x)


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.strip("\n").splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines
