"""Large reports are judged in a child process on a CPU budget (``rewards/judge.py``), off the trainer's GIL."""

from __future__ import annotations

import json
import textwrap

import pytest

from gspo_mcore.rewards import RewardRunner, RewardRunnerConfig, asserts, judge
from gspo_mcore.rewards import code as code_mod
from gspo_mcore.rewards.code import CodeRewardConfig, code_reward
from gspo_mcore.sandbox import SandboxConfig

FAST = CodeRewardConfig(sandbox=SandboxConfig(cpu_time_s=2, wall_time_s=20, memory_mb=256, max_processes=8))
N = 30_000  # a reported list of N ints is ~200 KiB: past the default inline limit of 16 KiB


def fenced(code: str) -> str:
    return f"```python\n{textwrap.dedent(code).strip()}\n```\n"


@pytest.fixture
def child_calls(monkeypatch):
    """Counts the reports judged in a child (the real child runs; this only counts)."""
    calls = []
    real = judge._in_child

    def spy(*args):
        calls.append(len(args[1]))
        return real(*args)

    monkeypatch.setattr(judge, "_in_child", spy)
    return calls


def _line(case: int, value) -> bytes:
    return (json.dumps({"c": case, "v": value}) + "\n").encode()


def test_large_reports_are_judged_in_a_child_with_the_inline_verdicts(child_calls):
    """Honest and hostile large reports, call-based and assert-style: the child's verdicts equal the
    inline judge's, and only reports past ``inline_bytes`` go to the child."""
    p61 = 2**61 - 1
    big = list(range(N))
    call_reports = [
        (_line(0, big) + _line(1, 7), [big, 7]),  # honest: both pass
        (_line(0, big) + _line(1, 8), [big, 7]),  # honest: one fails
        (_line(0, {"$": "set", "v": [k * p61 for k in range(N)]}) + _line(1, 7), [[1], 7]),  # one hash
        (b'{"c": 0, "v": [' + b"9" * 4301 + b"]}\n" + _line(1, {"$": "bytes", "v": "zz"}) + b"x" * 100_000, [[1], b""]),
        (_line(0, 1e308) * 10_000, [1.5, 2]),
    ]
    for report, outputs in call_reports:
        assert len(report) > 65536
        inline = judge.verdicts("call", report, outputs, 1e-6, inline_bytes=len(report), cpu_budget_s=2.0)
        child = judge.verdicts("call", report, outputs, 1e-6, inline_bytes=65536, cpu_budget_s=2.0)
        assert child == inline, (report[:60], child, inline)
    assert child_calls == [len(r) for r, _ in call_reports]
    assert [judge.judge_calls(r, o, 1e-6) for r, o in call_reports[:2]] == [[True, True], [True, False]]

    tests = [asserts.compile_test(f"assert f() == {N}\nassert len(g()) == 3"), asserts.compile_test("assert h()")]
    records = [{"i": 0, "s": 0, "v": [N]}, {"i": 0, "s": 1, "v": [3]}, {"done": 0}, {"i": 1, "s": 0, "v": [0]}]
    report = b"noise\n" * 20_000 + b"".join((json.dumps(r) + "\n").encode() for r in records)
    inline = judge.verdicts("assert", report, tests, None, inline_bytes=len(report), cpu_budget_s=2.0)
    child = judge.verdicts("assert", report, tests, None, inline_bytes=0, cpu_budget_s=2.0)
    assert child == inline == [True, False]
    assert len(child_calls) == len(call_reports) + 1
    small = _line(0, 3)
    assert judge.verdicts("call", small, [3], None, inline_bytes=65536, cpu_budget_s=2.0) == [True]
    assert len(child_calls) == len(call_reports) + 1  # a small report stays inline


def test_a_sandboxed_solution_with_a_large_report_scores_through_the_child(child_calls):
    """End to end: a call-based solution whose report is ~200 KiB scores 1 (child) and a wrong one 0."""
    tests = {"fn_name": "f", "inputs": [[N]], "outputs": [list(range(N))]}
    assert code_reward(fenced("def f(n):\n    return list(range(n))"), {"tests": tests}, config=FAST) == 1.0
    assert code_reward(fenced("def f(n):\n    return list(range(1, n + 1))"), {"tests": tests}, config=FAST) == 0.0
    assert len(child_calls) == 2 and min(child_calls) > FAST.judge_inline_bytes


def test_a_judge_past_its_cpu_budget_or_crashing_scores_zero_and_is_counted():
    """A budget of 1 ms cannot judge a ~200 KiB report: 0 and one ``reward_code_judge_failed``, no
    exception; the same response with the default budget scores 1. A child that crashes gives None."""
    tests = {"fn_name": "f", "inputs": [[N]], "outputs": [list(range(N))]}
    response = fenced("def f(n):\n    return list(range(n))")
    code_mod.JUDGE_FAILED.take()
    tiny = CodeRewardConfig(sandbox=FAST.sandbox, judge_cpu_budget_s=0.001)
    runner = RewardRunner(RewardRunnerConfig(reward="code", code=tiny))
    assert runner.score([response], [{"tests": tests}])[0] == 0.0
    m = runner.metrics()
    assert m["reward_code_judge_failed"] == 1.0 and m["reward_errors"] == 0.0, m
    assert code_reward(response, {"tests": tests}, config=FAST) == 1.0  # the control
    assert code_mod.JUDGE_FAILED.take() == 0
    # a crash: the child cannot judge these "tests" (not CompiledTest objects)
    assert judge.verdicts("assert", b"x" * 100, [1, 2], None, inline_bytes=0, cpu_budget_s=2.0) is None


@pytest.mark.parametrize(
    "field, value",
    [("judge_inline_bytes", -1), ("judge_inline_bytes", True), ("judge_inline_bytes", 1.5),
     ("judge_cpu_budget_s", 0), ("judge_cpu_budget_s", -1.0), ("judge_cpu_budget_s", "2"),
     ("judge_cpu_budget_s", float("nan"))],
)  # fmt: skip
def test_judge_config_is_validated(field, value):
    with pytest.raises(ValueError, match=f"CodeRewardConfig.{field}"):
        CodeRewardConfig(**{field: value})
