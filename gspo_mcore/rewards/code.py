"""Code reward: the response's last Python code block, run against the sample's tests in the sandbox.

Test formats (``metadata["tests"]``, also as a JSON string), strongest first:

- **stdio** (recommended): a list of ``{"input": str, "output": str}``, or ``{"inputs": [...],
  "outputs": [...]}`` (APPS style): each case a fresh sandboxed run; it passes when the program exits 0
  and its output equals the expected one up to trailing whitespace on each line and trailing blank
  lines. The expected output never leaves the host.
- **call-based** (recommended): ``{"fn_name": str, "inputs": [...], "outputs": [...]}`` (APPS / TACO /
  LiveCodeBench functional form). An input is a list of positional arguments, or a string of one JSON
  value per line (LiveCodeBench; its output is then a JSON string too). The sandboxed harness calls
  ``fn_name`` (or ``Solution().fn_name``) and reports each result as JSON plain data; the host compares
  it with the expected output, type-strictly (``plain.strict_equal``; ``float_tolerance`` for numbers;
  an expected ``[x]`` also accepts ``x``, as APPS stores outputs). A result that is not plain data fails.
  Only the inputs are sent to the sandbox.
- **assert-style**: a string or a list of strings of test code (one string: reward 1/0; a list: the
  fraction that pass); with ``metadata["entry_point"]`` each test is followed by
  ``check(<entry_point>)`` (HumanEval). Asserts are rewritten into probes judged on the host
  (``asserts.py``); literals on the expected side never reach the sandbox. Read that module's
  docstring for what the model's code can still forge in this format.

Each case or test passes or fails; the reward is the fraction that pass. Model-written code only ever
runs through ``sandbox.run_python``; nothing it prints or writes decides a verdict by itself.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from gspo_mcore.rewards import asserts, judge
from gspo_mcore.rewards.extract import last_code_block
from gspo_mcore.sandbox import SandboxConfig, run_python

_HERE = Path(__file__).parent
_HARNESS = (_HERE / "_harness.py").read_text()
_HARNESS_FILES = {name: (_HERE / name).read_text() for name in ("_wire.py", "_solution_server.py")}


@dataclass(frozen=True, kw_only=True)
class CodeRewardConfig:
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Limits and isolation of each sandboxed run."""
    tests_key: str = "tests"
    """Metadata field with the sample's tests (see the module docstring for the formats)."""
    max_cases: int = 32
    """Stdio / call-based cases run at most (the first ones); the reward is the fraction of those."""
    test_timeout_s: float | None = 5.0
    """Time limit of each assert-style test or call inside the run (None: only the sandbox's limits)."""
    float_tolerance: float | None = None
    """Call-based tests: None compares numbers exactly and type-strictly; a value t accepts an int or
    float result within ``math.isclose(rel_tol=t, abs_tol=t)`` of an expected number."""
    stdio_time_budget_s: float | None = 30.0
    """Wall-clock budget of all stdio cases of one response together (each case also has the sandbox's
    ``wall_time_s``): a response that runs past it scores 0 and is counted
    (``reward_code_over_budget``), so the reward call ends before ``reward.timeout_s``. None: no budget."""

    judge_inline_bytes: int = 16384
    """Call-based and assert-style reports of at most this many bytes are judged on the reward's thread
    (under 6 ms of CPU); a larger one in a child process, off the trainer's GIL (``rewards/judge.py``). 0: every
    report in a child."""
    judge_cpu_budget_s: float = 2.0
    """CPU seconds a child judge may spend on one report (the judge is linear; a hostile 1 MiB report
    takes well under 1 s): a report past it, or a judge that crashes, scores 0 and is counted
    (``reward_code_judge_failed``)."""

    def __post_init__(self):
        if not self.tests_key:
            raise ValueError("CodeRewardConfig.tests_key must be non-empty")
        if isinstance(self.max_cases, bool) or not isinstance(self.max_cases, int) or self.max_cases < 1:
            raise ValueError(f"CodeRewardConfig.max_cases must be an int >= 1, got {self.max_cases!r}")
        if self.test_timeout_s is not None and not self.test_timeout_s > 0:
            raise ValueError(f"CodeRewardConfig.test_timeout_s must be > 0 or None, got {self.test_timeout_s!r}")
        if self.stdio_time_budget_s is not None and not self.stdio_time_budget_s > 0:
            raise ValueError(
                f"CodeRewardConfig.stdio_time_budget_s must be > 0 or None, got {self.stdio_time_budget_s!r}"
            )
        if (
            isinstance(self.judge_inline_bytes, bool)
            or not isinstance(self.judge_inline_bytes, int)
            or self.judge_inline_bytes < 0
        ):
            raise ValueError(
                f"CodeRewardConfig.judge_inline_bytes must be an int >= 0, got {self.judge_inline_bytes!r}"
            )
        b = self.judge_cpu_budget_s
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not (0 < b <= 600):
            raise ValueError(f"CodeRewardConfig.judge_cpu_budget_s must be a number in (0, 600], got {b!r}")
        if self.float_tolerance is not None and not self.float_tolerance >= 0:
            raise ValueError(f"CodeRewardConfig.float_tolerance must be >= 0 or None, got {self.float_tolerance!r}")


@dataclass(frozen=True)
class CallCases:
    """Call-based cases: ``fn_name(*inputs[k])`` must return ``outputs[k]``."""

    fn_name: str
    inputs: list[list[Any]]
    outputs: list[Any]


def code_reward(response: str, metadata: Mapping[str, Any], *, config: CodeRewardConfig = CodeRewardConfig()) -> float:
    """Fraction of the sample's tests the response's code passes (0.0 without a code block)."""
    if metadata.get(config.tests_key) is None:
        raise KeyError(f"code reward needs metadata[{config.tests_key!r}]")
    kind, tests = parse_tests(metadata[config.tests_key], metadata.get("entry_point"))
    code = last_code_block(response)
    if code is None:
        return 0.0
    if kind == "assert":
        return run_assert_tests(code, tests, config=config)
    if kind == "call":
        n = min(len(tests.inputs), config.max_cases)
        return run_call_tests(code, CallCases(tests.fn_name, tests.inputs[:n], tests.outputs[:n]), config=config)
    return run_stdio_tests(code, tests[: config.max_cases], config=config)


def check_code_metadata(metadata: Mapping[str, Any], *, config: CodeRewardConfig = CodeRewardConfig()) -> None:
    """Raise ``ValueError`` / ``SyntaxError`` for tests this reward could not run (start-up check)."""
    kind, tests = parse_tests(metadata[config.tests_key], metadata.get("entry_point"))
    if kind == "assert":
        for i, t in enumerate(tests):
            asserts.compile_test(t, filename=f"<test {i}>")


def parse_tests(tests: Any, entry_point: str | None = None) -> tuple[str, Any]:
    """``("assert", [code, ...])``, ``("stdio", [(input, output), ...])`` or ``("call", CallCases)``."""
    if isinstance(tests, str) and tests.lstrip().startswith(("{", "[{")):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as e:
            raise ValueError(f"tests look like JSON but do not parse: {e}") from None
    if isinstance(tests, Mapping):
        inputs, outputs = tests.get("inputs"), tests.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs) or not inputs:
            raise ValueError("stdio and call-based tests need equally long, non-empty 'inputs' and 'outputs' lists")
        if tests.get("fn_name") is not None:
            return "call", _call_cases(tests["fn_name"], inputs, outputs)
        return "stdio", [(_text(i), _text(o)) for i, o in zip(inputs, outputs)]
    if isinstance(tests, str):
        tests = [tests]
    if not isinstance(tests, (list, tuple)) or not tests:
        raise ValueError(
            f"tests must be a string, a non-empty list or an inputs/outputs mapping, got {type(tests).__name__}"
        )
    if all(isinstance(t, Mapping) for t in tests):
        for k, t in enumerate(tests):
            if "input" not in t or "output" not in t:
                raise ValueError(f"stdio test case {k} needs 'input' and 'output', has {sorted(t)}")
        return "stdio", [(_text(t["input"]), _text(t["output"])) for t in tests]
    if all(isinstance(t, str) for t in tests):
        suffix = f"\ncheck({entry_point})\n" if entry_point else ""
        return "assert", [t + suffix for t in tests]
    raise ValueError("a tests list must hold only strings or only {'input', 'output'} mappings")


def _call_cases(fn_name: Any, inputs: list, outputs: list) -> CallCases:
    if not isinstance(fn_name, str) or not fn_name.isidentifier():
        raise ValueError(f"call-based tests: fn_name must be a Python identifier, got {fn_name!r}")
    args, outs = [], []
    for k, (i, o) in enumerate(zip(inputs, outputs)):
        if isinstance(i, str):  # LiveCodeBench: one JSON argument per line, the output a JSON string
            try:
                args.append([json.loads(line) for line in i.splitlines() if line.strip()])
                outs.append(json.loads(o) if isinstance(o, str) else o)
            except json.JSONDecodeError as e:
                raise ValueError(f"call-based case {k}: input/output lines must be JSON: {e}") from None
        elif isinstance(i, list):
            args.append(i)
            outs.append(o)
        else:
            raise ValueError(f"call-based case {k}: an input must be a list of arguments or a string, got {i!r:.60}")
    return CallCases(fn_name, args, outs)


def run_assert_tests(code: str, tests: list[str], *, config: CodeRewardConfig) -> float:
    """Fraction of assert-style tests that pass, judged on the host (``asserts.judge``)."""
    compiled = [asserts.compile_test(t, filename=f"<test {i}>") for i, t in enumerate(tests)]
    payload = {"mode": "assert", "tests": [c.source for c in compiled], "test_timeout_s": config.test_timeout_s}
    return _score("assert", _run_harness(code, payload, config).stdout, compiled, config)


def run_call_tests(code: str, cases: CallCases, *, config: CodeRewardConfig) -> float:
    """Fraction of call-based cases whose reported result equals the expected output (host-side)."""
    payload = {
        "mode": "call",
        "fn_name": cases.fn_name,
        "inputs": cases.inputs,
        "test_timeout_s": config.test_timeout_s,
    }
    return _score("call", _run_harness(code, payload, config).stdout, cases.outputs, config)


def _score(kind: str, stdout: bytes, expected: list, config: CodeRewardConfig) -> float:
    """Fraction of the verdicts that pass; 0 (counted in ``JUDGE_FAILED``) when the judge could not
    give them within its CPU budget."""
    out = judge.verdicts(
        kind,
        stdout,
        expected,
        config.float_tolerance,
        inline_bytes=config.judge_inline_bytes,
        cpu_budget_s=config.judge_cpu_budget_s,
    )
    if out is None:
        JUDGE_FAILED.add()
        return 0.0
    return sum(out) / len(expected)


_call_ok = judge.call_ok


def _run_harness(code: str, payload: dict, config: CodeRewardConfig):
    files = {**_HARNESS_FILES, "solution.py": code}
    return run_python(_HARNESS, stdin=json.dumps(payload).encode(), files=files, config=config.sandbox)


def _records(result) -> list[dict]:
    return judge.records(result.stdout)


class _Tally:
    """A thread-safe count (reward calls run on several threads)."""

    def __init__(self):
        self._lock, self._n = threading.Lock(), 0

    def add(self) -> None:
        with self._lock:
            self._n += 1

    def take(self, reset: bool = True) -> int:
        with self._lock:
            n = self._n
            if reset:
                self._n = 0
            return n


OVER_BUDGET = _Tally()
"""Responses whose stdio cases ran past ``stdio_time_budget_s`` (scored 0); read by ``RewardRunner.metrics``."""
JUDGE_FAILED = _Tally()
"""Reports whose child judge ran past ``judge_cpu_budget_s`` or crashed (scored 0); read by
``RewardRunner.metrics``."""


def run_stdio_tests(code: str, cases: list[tuple[str, str]], *, config: CodeRewardConfig) -> float:
    """Fraction of stdio cases passed; 0 (counted in ``OVER_BUDGET``) when all of them together run past
    ``config.stdio_time_budget_s``: the last case's wall clock is cut to what is left of the budget."""
    budget = config.stdio_time_budget_s
    deadline = None if budget is None else time.monotonic() + budget
    passed = 0
    for stdin, expected in cases:
        sandbox = config.sandbox
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                OVER_BUDGET.add()
                return 0.0
            if left < sandbox.wall_time_s:
                sandbox = dataclasses.replace(sandbox, wall_time_s=left)
        result = run_python(code, stdin=stdin.encode(), config=sandbox)
        if result.timed_out and sandbox is not config.sandbox:  # the budget, not the case's own limit
            OVER_BUDGET.add()
            return 0.0
        passed += result.ok and _lines(result.stdout.decode(errors="replace")) == _lines(expected)
    return passed / len(cases)


def _text(x: Any) -> str:
    return "\n".join(map(str, x)) if isinstance(x, list) else str(x)


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.strip("\n").splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines
