"""Reward functions, the registry, and the runner's failure handling."""

from __future__ import annotations

import dataclasses
import textwrap
import threading
import time

import pytest

from gspo_mcore import rewards
from gspo_mcore.rewards import RewardRunner, RewardRunnerConfig, registry
from gspo_mcore.rewards.code import CodeRewardConfig, code_reward, parse_tests
from gspo_mcore.rewards.extract import last_boxed, last_code_block
from gspo_mcore.rewards.match import ExactMatchConfig, RegexMatchConfig, exact_match, regex_match
from gspo_mcore.rewards.math import MathRewardConfig, math_reward, normalise
from gspo_mcore.sandbox import SandboxConfig

# ---------------------------------------------------------------------------------------------- extract


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
        (r"\boxed{1} then \boxed{\sqrt{\frac{a}{b}}}", r"\sqrt{\frac{a}{b}}"),  # the last one, nested braces
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces do not count
        (r"\fbox{7}", "7"),
        (r"$\boxed 5$", "5"),
        (r"\boxed{3} and a truncated \boxed{\frac{1}{", None),  # unbalanced last box: no final answer
        ("no box here", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_last_code_block_prefers_python_then_untagged():
    text = "```python\nx = 1\n```\ntext\n```bash\nls\n```\n```py\nx = 2\n```"
    assert last_code_block(text) == "x = 2\n"
    assert last_code_block("```\nprint(3)\n```\n```bash\nls\n```") == "print(3)\n"
    assert last_code_block("no code") is None


# ------------------------------------------------------------------------------------------------- math


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        (r"The answer is \boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"\boxed{\dfrac{\sqrt{2}}{2}}", r"\sqrt{2}/2", 1.0),
        (r"\boxed{1+x}", "x + 1", 1.0),
        (r"\boxed{42}", 42, 1.0),  # a numeric reference answer
        (r"\boxed{2} ... final: \boxed{3}", "3", 1.0),  # the last box counts
        (r"\boxed{3} ... final: \boxed{2}", "3", 0.0),
        (r"\boxed{4}", "3", 0.0),
        ("The answer is 0.5", "0.5", 0.0),  # no box: no credit by default
        (r"\boxed{\text{(B)}}", "(B)", 1.0),  # normalised text comparison
    ],
)
def test_math_reward(response, answer, expected):
    assert math_reward(response, {"answer": answer}) == expected


def test_math_reward_without_box_when_allowed():
    cfg = MathRewardConfig(require_boxed=False)
    assert math_reward("so the result is $\\frac{1}{2}$", {"answer": "0.5"}, config=cfg) == 1.0


def test_math_reward_off_the_main_thread():
    """math-verify's signal.alarm timeouts fail off the main thread; the reward must still work there."""
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward(r"\boxed{\frac{1}{2}}", {"answer": "0.5"})))
    t.start()
    t.join()
    assert out == [1.0]


def test_math_reward_needs_an_answer():
    with pytest.raises(KeyError, match="answer"):
        math_reward(r"\boxed{1}", {})


def test_normalise():
    assert normalise(r"$\left( 1, 2 \right).$") == "(1,2)"
    assert normalise(r"\text{Yes}") == "yes"


# ------------------------------------------------------------------------------------------------ match


def test_exact_match():
    assert exact_match("  Paris \n", {"answer": "Paris"}) == 1.0
    assert exact_match(r"I think \boxed{Paris}", {"answer": "Paris"}) == 1.0
    assert exact_match("paris", {"answer": "Paris"}) == 0.0
    assert exact_match("paris", {"answer": "Paris"}, config=ExactMatchConfig(case_sensitive=False)) == 1.0
    assert exact_match("Lyon", {"answer": ["Paris", "Lyon"]}) == 1.0
    assert exact_match("new   york", {"answer": "new york"}) == 1.0


def test_regex_match():
    assert regex_match("The answer is 42.", {"pattern": r"\b42\b"}) == 1.0
    assert regex_match("The answer is 420.", {"pattern": r"\b42\b"}) == 0.0
    full = RegexMatchConfig(mode="fullmatch")
    assert regex_match(" yes \n", {"pattern": "yes|no"}, config=full) == 1.0
    assert regex_match("yes, no", {"pattern": "yes|no"}, config=full) == 0.0
    assert regex_match("alpha beta", {"pattern": ["alpha", "gamma"]}) == 0.5  # partial credit
    assert regex_match("YES", {"pattern": "yes"}, config=RegexMatchConfig(ignore_case=True)) == 1.0
    with pytest.raises(KeyError, match="pattern"):
        regex_match("x", {})


# ------------------------------------------------------------------------------------------------- code

FAST = CodeRewardConfig(sandbox=SandboxConfig(cpu_time_s=2, wall_time_s=20, memory_mb=256, max_processes=8))


def fenced(code: str) -> str:
    return f"Here you go:\n```python\n{textwrap.dedent(code).strip()}\n```\n"


def test_code_reward_assert_tests_partial_credit():
    response = fenced("def add(a, b):\n    return a + b")
    tests = ["assert add(1, 2) == 3", "assert add(2, 2) == 5", "assert add(0, 0) == 0", "assert add(-1, 1) == 0"]
    assert code_reward(response, {"tests": tests}, config=FAST) == 0.75
    assert code_reward(response, {"tests": "assert add(1, 2) == 3"}, config=FAST) == 1.0


def test_code_reward_humaneval_entry_point():
    response = fenced("def inc(x):\n    return x + 1")
    meta = {"tests": "def check(candidate):\n    assert candidate(1) == 2", "entry_point": "inc"}
    assert code_reward(response, meta, config=FAST) == 1.0


def test_code_reward_stdio_tests():
    response = fenced("a, b = map(int, input().split())\nprint(a + b)")
    cases = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5", "output": "10"}, {"input": "1 1", "output": "3"}]
    assert code_reward(response, {"tests": cases}, config=FAST) == pytest.approx(2 / 3)
    apps_style = '{"inputs": ["2 3\\n"], "outputs": ["5\\n"]}'
    assert code_reward(response, {"tests": apps_style}, config=FAST) == 1.0


@pytest.mark.parametrize(
    "code",
    [
        "import os\nos._exit(0)",  # leave before the tests run
        "import sys\nsys.exit(0)",
        "print('0 0 1')\nprint('x 0 1')",  # forged verdict lines without the nonce
        "raise SystemExit(0)",
        "def add(a, b):\n    while True:\n        pass",  # a test that never ends
    ],
)
def test_code_reward_cannot_be_gamed_by_exiting_or_printing(code):
    cfg = CodeRewardConfig(sandbox=FAST.sandbox, test_timeout_s=0.5)
    assert code_reward(fenced(code), {"tests": ["assert add(1, 2) == 3"]}, config=cfg) == 0.0


CALL = {"fn_name": "f", "inputs": [[1, 2], [3, 4]], "outputs": [3, 7]}


@pytest.mark.parametrize(
    "code, tests, expected",
    [
        ("def f(a, b):\n    return a + b", CALL, 1.0),
        ("def f(a, b):\n    return 3", CALL, 0.5),
        ("class Solution:\n    def f(self, a, b):\n        return a + b", CALL, 1.0),  # LeetCode style
        ("def f(a, b):\n    return float(a + b)", CALL, 0.0),  # type-strict: 3.0 is not 3
        ("def f(a, b):\n    return a + b == 3", {"fn_name": "f", "inputs": [[1, 2]], "outputs": [1]}, 0.0),
        ("def f(xs):\n    return tuple(sorted(xs))", {"fn_name": "f", "inputs": [[[2, 1]]], "outputs": [[1, 2]]}, 1.0),
        (
            "def f(xs):\n    return sorted(xs)",  # APPS stores an output x as [x]
            {"fn_name": "f", "inputs": [[[2, 1]]], "outputs": [[[1, 2]]]},
            1.0,
        ),
        (
            "def f(a, b):\n    return a + b",  # LiveCodeBench: one JSON argument per line
            {"fn_name": "f", "inputs": ["1\n2", "[1]\n[2]"], "outputs": ["3", "[1, 2]"]},
            1.0,
        ),
        ("class Yes:\n    def __eq__(self, o):\n        return True\ndef f(a, b):\n    return Yes()", CALL, 0.0),
        ("class I(int):\n    def __eq__(self, o):\n        return True\ndef f(a, b):\n    return I(0)", CALL, 0.0),
        ("def g(a, b):\n    return a + b", CALL, 0.0),  # no such function
        ("import os\nos._exit(0)", CALL, 0.0),
    ],
)
def test_code_reward_call_based(code, tests, expected):
    assert code_reward(fenced(code), {"tests": tests}, config=FAST) == expected


def test_code_reward_call_based_float_tolerance():
    tests = {"fn_name": "f", "inputs": [[1.0]], "outputs": [0.333333]}
    code = fenced("def f(x):\n    return x / 3")
    assert code_reward(code, {"tests": tests}, config=FAST) == 0.0
    loose = CodeRewardConfig(sandbox=FAST.sandbox, float_tolerance=1e-5)
    assert code_reward(code, {"tests": tests}, config=loose) == 1.0


@pytest.mark.parametrize(
    "test, expected",
    [
        ("assert not is_even(3)", 1.0),
        ("assert is_even(2) and not is_even(5)", 1.0),
        ("assert is_even(2) and is_even(5)", 0.0),
        ("assert 2 in evens(5) and 3 not in evens(5)", 1.0),
        ("assert 0 <= half(5) < 3", 1.0),
        ("assert half(5) is not None", 1.0),
        ("assert evens(4) == [0, 2]", 1.0),
        ("assert evens(4) == (0, 2)", 0.0),  # a list is not a tuple, as in Python
        ("assert half(4) == 2.0", 1.0),  # 2 == 2.0, as in Python
        ("for n in range(6):\n    assert is_even(n) == (n % 2 == 0)", 1.0),
        ("for n in range(6):\n    assert is_even(n) == (n < 3)", 0.0),
        ("if half(3) > 100:\n    assert half(3) == 1", 0.0),  # a site never reached fails the test
        ("try:\n    half('x')\n    assert False\nexcept TypeError:\n    pass", 1.0),
        ("assert half(2) == 1, 'with a message'", 1.0),
        ("assert half('x') == 1", 0.0),  # raising
    ],
)
def test_assert_rewriting_keeps_python_semantics(test, expected):
    code = fenced(
        "def is_even(n):\n    return n % 2 == 0\ndef evens(n):\n    return list(range(0, n, 2))\n"
        "def half(n):\n    return n // 2"
    )
    assert code_reward(code, {"tests": [test]}, config=FAST) == expected


def test_assert_literals_never_enter_the_sandbox():
    from gspo_mcore.rewards.asserts import compile_test

    c = compile_test("def check(candidate):\n    assert candidate(1) == 'SECRET-EXPECTED'\ncheck(f)")
    assert "SECRET-EXPECTED" not in c.source and "candidate(1)" in c.source
    assert compile_test("assert f(1) == 'SECRET'", hide_literals=False).source.count("SECRET") == 1


def test_a_truth_only_assert_is_no_longer_forgeable():
    """``assert pred(x)`` has a known expected value (true). It used to be forgeable by code that wrote the
    report channel from the test's interpreter; the tests now run in a process the solution cannot reach
    (``_harness.py``), so writing every descriptor it has, or the frame-walk forgery, scores 0."""
    forge = (
        "import json, os, sys\nrecords = [{'i': 0, 's': 0, 'v': [True]}, {'done': 0}]\n"
        "data = ''.join(json.dumps(r) + '\\n' for r in records).encode()\n"
        "for fd in range(1, 64):\n    try:\n        os.write(fd, data)\n    except OSError:\n        pass\n"
        "loc = sys._getframe(1).f_locals\nif 'out' in loc:\n    os.write(loc['out'], data)\nos._exit(0)"
    )
    honest = "def is_prime(n):\n    return n > 1 and all(n % k for k in range(2, n))"
    for test in ("assert is_prime(7)", "assert is_prime(7) == True", "assert not is_prime(8)"):
        assert code_reward(fenced(forge), {"tests": [test]}, config=FAST) == 0.0
        assert code_reward(fenced(honest), {"tests": [test]}, config=FAST) == 1.0


def test_malformed_json_tests_are_refused():
    with pytest.raises(ValueError, match="do not parse"):
        parse_tests('{"inputs": ["1"], "outputs": [')
    with pytest.raises(ValueError, match="fn_name"):
        parse_tests({"fn_name": "not an identifier", "inputs": [[1]], "outputs": [1]})
    with pytest.raises(ValueError, match="'input' and 'output'"):
        parse_tests([{"input": "1"}])


def test_code_reward_without_code_block_is_zero():
    assert code_reward("I don't know", {"tests": "assert True"}, config=FAST) == 0.0


def test_parse_tests_rejects_mixed_lists():
    with pytest.raises(ValueError, match="only strings"):
        parse_tests(["assert True", {"input": "", "output": ""}])
    assert parse_tests("assert f(1)", entry_point=None) == ("assert", ["assert f(1)"])


# --------------------------------------------------------------------------------------------- registry


def test_registry_builtins_and_register():
    assert {"math", "exact", "regex", "code"} <= set(registry.names())
    assert registry.get("exact") is exact_match

    def always_half(response, metadata):
        return 0.5

    rewards.register("test_half", always_half)
    try:
        assert rewards.get("test_half") is always_half
        with pytest.raises(ValueError, match="already registered"):
            rewards.register("test_half", always_half)
        with pytest.raises(ValueError, match="already registered"):
            rewards.register("math", always_half)
    finally:
        rewards.unregister("test_half")
    with pytest.raises(KeyError, match="unknown reward"):
        rewards.get("test_half")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    pkg = tmp_path / "my_rewards_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scoring.py").write_text(
        "def length_bonus(response, metadata):\n    return min(len(response) / metadata['target_len'], 1.0)\n"
        "class Holder:\n    @staticmethod\n    def one(response, metadata):\n        return 1\n"
        "NOT_CALLABLE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards_pkg.scoring"


def test_dotted_path_user_functions(user_module):
    fn = rewards.get(f"{user_module}:length_bonus")
    assert fn("abcd", {"target_len": 8}) == 0.5
    assert rewards.get(f"{user_module}.length_bonus") is fn
    assert rewards.get(f"{user_module}:Holder.one")("x", {}) == 1
    with pytest.raises(TypeError, match="not callable"):
        rewards.get(f"{user_module}:NOT_CALLABLE")
    with pytest.raises(AttributeError, match="no attribute"):
        rewards.get(f"{user_module}:missing")
    with pytest.raises(ImportError, match="cannot import"):
        rewards.get("no_such_module_xyz:fn")


# ----------------------------------------------------------------------------------------------- runner


def _hangs(response, metadata):
    time.sleep(20)
    return 1.0


def _throws(response, metadata):
    raise RuntimeError("reward bug")


def _nan(response, metadata):
    return float("nan")


def _slow_one(response, metadata):
    time.sleep(1.0)
    return 1.0


@pytest.fixture
def test_rewards():
    names = {"t_hangs": _hangs, "t_throws": _throws, "t_nan": _nan, "t_slow": _slow_one}
    for name, fn in names.items():
        rewards.register(name, fn, overwrite=True)
    yield
    for name in names:
        rewards.unregister(name)


def test_runner_hanging_and_throwing_rewards_give_zero_and_are_counted(test_rewards):
    math_reward(r"\boxed{\frac{1}{2}}", {"answer": "0.5"})  # math-verify's first parse (seconds) before the clock
    runner = RewardRunner(RewardRunnerConfig(reward="exact", timeout_s=0.5, max_workers=4, max_error_fraction=1.0))
    responses = ["Paris", "x", "x", "x", r"\boxed{\frac{1}{2}}"]
    metadata = [
        {"answer": "Paris"},
        {"reward_fn": "t_hangs"},
        {"reward_fn": "t_throws"},
        {"reward_fn": "t_nan"},
        {"reward_fn": "math", "answer": "0.5"},
    ]
    t0 = time.monotonic()
    scores = runner.score(responses, metadata)
    assert time.monotonic() - t0 < 10  # the hanging call (20 s) was abandoned at its timeout
    assert scores == [1.0, 0.0, 0.0, 0.0, 1.0]
    m = runner.metrics()
    assert {k: m[k] for k in ("reward_calls", "reward_errors", "reward_timeouts")} == {
        "reward_calls": 5.0,
        "reward_errors": 2.0,
        "reward_timeouts": 1.0,
    }
    assert m["reward/t_throws/errors/RuntimeError"] == 1.0 and m["reward/t_nan/errors/ValueError"] == 1.0
    assert m["reward/t_hangs/timeouts"] == 1.0 and m["reward/exact/mean"] == 1.0 and m["reward/math/calls"] == 1.0
    assert runner.metrics() == {
        "reward_calls": 0.0,
        "reward_errors": 0.0,
        "reward_timeouts": 0.0,
        "reward_code_over_budget": 0.0,
        "reward_code_judge_failed": 0.0,
    }  # reset


def test_runner_stops_the_run_when_too_many_calls_fail(test_rewards):
    runner = RewardRunner(RewardRunnerConfig(reward="t_throws"))  # default max_error_fraction 0.1
    with pytest.raises(
        rewards.RewardFailure,
        match=r"4 of 4 reward calls failed.*'t_throws'.*RuntimeError: reward "
        r"bug.*prompt 'what is 2\+2\?'",
    ):
        runner.score(["a"] * 4, [{}] * 4, prompts=["what is 2+2?"] * 4)
    assert runner.metrics()["reward/t_throws/errors/RuntimeError"] == 4.0  # counted before raising
    # a misconfigured run: rows without the field the reward reads
    with pytest.raises(rewards.RewardFailure, match=r"KeyError.*answer"):
        RewardRunner(RewardRunnerConfig(reward="math")).score([r"\boxed{1}"] * 2, [{"question": "q"}] * 2)
    # one failure in 20 calls (5%) is tolerated and counted
    tolerant = RewardRunner(RewardRunnerConfig(reward="exact"))
    assert tolerant.score(["a"] * 20, [{"answer": "a"}] * 19 + [{"reward_fn": "t_throws"}])[:2] == [1.0, 1.0]
    assert tolerant.metrics()["reward_errors"] == 1.0


def test_runner_stops_at_once_for_a_broken_setup(test_rewards):
    runner = RewardRunner(RewardRunnerConfig(reward="exact", max_error_fraction=1.0))
    with pytest.raises(rewards.RewardFailure, match="cannot run.*unknown reward 'no_such_reward'"):
        runner.score(["a", "b"], [{"answer": "a"}, {"reward_fn": "no_such_reward"}])
    with pytest.raises(rewards.RewardSetupError, match=r"reward.reward = 'no_such_reward'"):
        RewardRunner(RewardRunnerConfig(reward="no_such_reward"))
    with pytest.raises(rewards.RewardSetupError, match="cannot import"):
        RewardRunner(RewardRunnerConfig(reward="no_such_module_xyz:fn"))


def test_runner_runs_calls_concurrently(test_rewards):
    runner = RewardRunner(RewardRunnerConfig(reward="t_slow", max_workers=8, timeout_s=5))
    t0 = time.monotonic()
    assert runner.score(["x"] * 8, [{}] * 8) == [1.0] * 8
    assert time.monotonic() - t0 < 5  # 8 x 1 s one after another would take 8 s


def test_runner_mixed_code_batch_with_attacks_keeps_going():
    """Attacks in a batch are stopped by the sandbox, and the honest sample and the caller are undisturbed.

    Each attack defines a correct ``add`` after (or around) its attack, so its score shows what the
    sandbox did: 0 where the attack itself is stopped before ``add`` exists (CPU and memory limits) or
    kills the run's own test process (kill(-1)), 1 where the attack is contained and the program goes on
    (fork bomb), and for the network
    1 only if the host's listener could not be reached (``add`` is wrong when the connection succeeds).
    """
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    code_cfg = CodeRewardConfig(
        sandbox=SandboxConfig(cpu_time_s=1, wall_time_s=10, memory_mb=256, max_processes=8), test_timeout_s=5.0
    )
    rewards.register("t_code", lambda r, m: code_reward(r, m, config=code_cfg), overwrite=True)
    add = "def add(a, b):\n    return a + b\n"
    try:
        runner = RewardRunner(RewardRunnerConfig(reward="t_code", max_workers=4, timeout_s=60, max_error_fraction=1.0))
        attacks = [
            ("while True:\n    pass\n" + add, 0.0),
            ("x = bytearray(16 << 30)\n" + add, 0.0),
            (
                "import os\nfor _ in range(100):\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
                + add,
                1.0,
            ),
            (
                "import _socket\ntry:\n    s = _socket.socket()\n"  # refused by the system-call filter, or
                f"    s.connect(('127.0.0.1', {port}))\n    NET = True\nexcept OSError:\n    NET = False\n"  # no route
                "def add(a, b):\n    return 0 if NET else a + b\n",
                1.0,
            ),
            # kill(-1) reaches only the run's own processes: the test process among them, so the test fails
            ("import os\ntry:\n    os.kill(-1, 9)\nexcept OSError:\n    pass\n" + add, 0.0),
        ]
        responses = [fenced(add)] + [fenced(a) for a, _ in attacks]
        scores = runner.score(responses, [{"tests": ["assert add(1, 2) == 3"]}] * len(responses))
        assert scores == [1.0] + [want for _, want in attacks]
        assert runner.metrics()["reward_timeouts"] == 0.0
    finally:
        rewards.unregister("t_code")
        server.close()


def test_runner_config_validation():
    with pytest.raises(ValueError, match="max_workers"):
        RewardRunnerConfig(max_workers=0)
    with pytest.raises(ValueError, match="timeout_s"):
        RewardRunnerConfig(timeout_s=float("inf"))
    with pytest.raises(ValueError, match="responses"):
        RewardRunner().score(["a"], [])


def test_plain_data_decoding_and_strict_equality():
    from gspo_mcore.rewards.plain import NotPlain, decode, strict_equal

    enc = [
        1,
        {"$": "tuple", "v": [2, "a"]},
        {"$": "dict", "v": [[{"$": "tuple", "v": [1]}, None]]},
        {"$": "frozenset", "v": [3]},
        {"$": "bytes", "v": "ff"},
        {"$": "float", "v": "nan"},
    ]
    got = decode(enc)
    assert got[:5] == [1, (2, "a"), {(1,): None}, frozenset({3}), b"\xff"] and got[5] != got[5]
    for bad in (
        {"a": 1},
        {"$": "pickle", "v": "..."},
        {"$": "set", "v": [[1]]},
        {"$": "dict", "v": [[1]]},
        {"$": "float", "v": "1e999"},
    ):
        with pytest.raises(NotPlain):
            decode(bad)
    nested = 1
    for _ in range(100):
        nested = [nested]
    with pytest.raises(NotPlain, match="deeply"):
        decode(nested)
    assert strict_equal((1, 2), [1, 2]) and not strict_equal(True, 1) and not strict_equal(1, 1.0)
    assert strict_equal(1, 1.0, float_tolerance=0.0) and strict_equal(0.1 + 0.2, 0.3, float_tolerance=1e-9)
    assert not strict_equal({"a": [1]}, {"a": [True]}) and strict_equal({"a": [1.5]}, {"a": [1.5]})


def test_judge_refuses_malformed_or_forged_records():
    from gspo_mcore.rewards.asserts import compile_test, judge

    tests = [compile_test("assert f(1) == 2\nassert f(2) == 3")]
    good = [{"i": 0, "s": 0, "v": [2]}, {"i": 0, "s": 1, "v": [3]}, {"done": 0}]
    assert judge(tests, good) == [True]
    assert judge(tests, good[:1] + good[2:]) == [False]  # a site never reported
    assert judge(tests, good[:2]) == [False]  # the test never finished
    assert judge(tests, good + [{"i": 0, "s": 0, "v": [5]}]) == [False]  # one failing report is enough
    assert judge(tests, good + [{"i": 0, "s": 0, "bad": "Yes is not plain data"}]) == [False]
    assert judge(tests, good + [{"i": 0, "s": 9, "v": [2]}]) == [False]  # no such site
    assert judge(tests, [{"i": 0, "s": 0, "v": [{"$": "evil", "v": 1}]}] + good[1:]) == [False]
    assert judge(tests, [{"i": 0, "s": 0, "v": [2, 2]}] + good[1:]) == [False]  # wrong operand count


# ------------------------------------------------------------------------- the host judge is total


@pytest.fixture
def no_int_digit_limit():
    """Whatever the host process allows (here: no limit on int digits), the judge's own bound holds."""
    import sys

    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    yield
    sys.set_int_max_str_digits(old)


def test_decode_is_total_malformed_values_are_not_plain(no_int_digit_limit):
    from gspo_mcore.rewards.plain import NotPlain, decode, decode_line

    for bad in (
        {"$": "bytes", "v": "zz"},  # malformed hex: a ValueError inside, "not plain" outside
        {"$": "bytes", "v": 5},
        {"$": "tuple", "v": 5},
        {"$": "dict", "v": [[[1], 2]]},  # an unhashable key
        {"$": "set", "v": [{"$": "dict", "v": []}]},
    ):
        with pytest.raises(NotPlain):
            decode(bad)
    assert decode_line("1" * 5000) is None  # decimal parsing is quadratic: long literals are refused
    assert decode_line("[" * 100_000 + "]" * 100_000) is None  # deeper than the parser's recursion
    assert decode_line("-" + "9" * 4300) == -int("9" * 4300)


def test_decode_refuses_hash_collisions_instead_of_going_quadratic():
    """``hash(k * (2**61 - 1)) == 0`` for every int ``k``: a set of such ints makes n**2 / 2 comparisons."""
    from gspo_mcore.rewards.plain import MAX_SAME_HASH, NotPlain, decode

    p = 2**61 - 1
    colliding = [k * p for k in range(20_000)]
    for enc in (
        {"$": "set", "v": colliding},
        {"$": "frozenset", "v": colliding},
        {"$": "dict", "v": [[x, 0] for x in colliding]},
        {"$": "set", "v": [{"$": "tuple", "v": [x]} for x in colliding]},  # tuples of colliding ints collide
    ):
        with pytest.raises(NotPlain, match="hash"):
            decode(enc)
    assert decode({"$": "set", "v": colliding[:MAX_SAME_HASH]}) == set(colliding[:MAX_SAME_HASH])
    assert decode({"$": "set", "v": list(range(20_000))}) == set(range(20_000))  # honest sets are fine


def test_an_overflowing_comparison_is_not_equal():
    from gspo_mcore.rewards.plain import strict_equal

    assert not strict_equal(10**400, 1.5, float_tolerance=1e-6)
    assert not strict_equal(1.5, 10**400, float_tolerance=1e-6)
    assert strict_equal(10**400, 10**400, float_tolerance=1e-6)


HOSTILE_REPORTS = """
import json, os
lines = [
    '{"c": 0, "v": {"$": "bytes", "v": "zz"}}',                       # decoding raised ValueError
    '{"c": 1, "v": ' + "1" * 4400 + '}',                               # a huge int literal
    json.dumps({"c": 2, "v": 10 ** 4000}),                             # vs a float with float_tolerance
    json.dumps({"c": 3, "v": {"$": "set", "v": [k * (2**61 - 1) for k in range(30_000)]}}),  # collisions
    '{"c": 4, "v": ' + "[" * 50_000 + "]" * 50_000 + '}',             # nesting
]
data = "".join(line + "\\n" for line in lines).encode()
for fd in range(3, 64):
    try:
        os.write(fd, data)
    except OSError:
        pass
os._exit(0)
"""


def test_hostile_reports_score_zero_and_never_raise():
    tests = {"fn_name": "f", "inputs": [[0]] * 5, "outputs": [b"x".hex(), 1, 1.5, [1], [[]]]}
    cfg = CodeRewardConfig(sandbox=FAST.sandbox, float_tolerance=1e-6)
    assert code_reward(fenced(HOSTILE_REPORTS), {"tests": tests}, config=cfg) == 0.0


@pytest.mark.parametrize(
    "expected, value",
    [("10**9 + 7", 1_000_000_007), ("2**31 - 1", 2**31 - 1), ("-(3 * 4)", -12), ("1 / 4", 0.25), ("1 << 10", 1024)],
)
def test_an_arithmetic_expected_side_stays_on_the_host(expected, value):
    from gspo_mcore.rewards.asserts import compile_test

    c = compile_test(f"assert f(1) == {expected}")
    assert c.source == "__gspo_probe__(0, (f(1),))" and c.sites[0].operands[1] == ("lit", value)
    assert compile_test("assert f(1) == 2 ** 100000").sites[0].num_reported == 2  # too large: not evaluated
    assert code_reward(
        fenced(f"def f(x):\n    return {expected}"), {"tests": [f"assert f(1) == {expected}"]}, config=FAST
    )


# --------------------------------------------------------------------------- the stdio time budget


def test_stdio_cases_past_the_overall_budget_score_zero_and_are_counted():
    """Two cases of 1.5 s each (within the case limit of 5 s) against a 2 s budget for both: 0 and one
    count; the reward call ends near the budget instead of running into the runner's timeout."""
    from gspo_mcore.rewards import code as code_mod

    slow = fenced("import time\ntime.sleep(1.5)\nprint(input())")
    cases = [{"input": f"{k}\n", "output": f"{k}\n"} for k in range(2)]
    sandbox = dataclasses.replace(FAST.sandbox, wall_time_s=5)
    code_mod.OVER_BUDGET.take()
    budgeted = CodeRewardConfig(sandbox=sandbox, stdio_time_budget_s=2.0)
    assert code_reward(slow, {"tests": cases}, config=budgeted) == 0.0
    assert code_mod.OVER_BUDGET.take() == 1
    unbudgeted = CodeRewardConfig(sandbox=sandbox, stdio_time_budget_s=None)  # the control: every case passes
    assert code_reward(slow, {"tests": cases}, config=unbudgeted) == 1.0
    assert code_mod.OVER_BUDGET.take() == 0
    with pytest.raises(ValueError, match="stdio_time_budget_s"):
        RewardRunnerConfig(reward="code", timeout_s=10, code=CodeRewardConfig(stdio_time_budget_s=30))
    RewardRunnerConfig(reward="math", timeout_s=10)  # the budget binds only where the code reward is used
