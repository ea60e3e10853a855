"""The ``reward:`` section from YAML, composed rewards with separate metrics, and the start-up check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gspo_mcore import rewards
from gspo_mcore.config import ConfigError, from_dict
from gspo_mcore.data.dataset import DataConfig, PromptDataset
from gspo_mcore.rewards import RewardRunner, RewardRunnerConfig, RewardSetupError, check_reward_setup

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(ROOT.glob("examples/**/*.yaml"))

COMPOSED = """
reward:
  terms:
    - name: format
      reward: regex
      weight: 0.2
      options: {patterns: ['\\\\boxed\\{']}
    - name: correct
      reward: exact
  exact: {case_sensitive: false}
  math: {answer_key: solution, require_boxed: false}
  code:
    max_cases: 4
    float_tolerance: 1.0e-6
    sandbox: {cpu_time_s: 3, memory_mb: 512, require_cgroup: false, cpu_cores: 0.5}
  max_error_fraction: 0.25
"""


def section(text: str) -> RewardRunnerConfig:
    return from_dict(RewardRunnerConfig, yaml.safe_load(text)["reward"], "reward")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT)))
def test_example_reward_sections_load(path):
    data = yaml.safe_load(path.read_text())
    if "reward" not in data:
        pytest.skip(f"{path.name} has no reward section")
    cfg = from_dict(RewardRunnerConfig, data["reward"], "reward")
    RewardRunner(cfg)  # every reward they name resolves (the tiny task's user function included)


def test_every_section_is_reachable_from_yaml():
    cfg = section(COMPOSED)
    assert [(t.name, t.reward, t.weight) for t in cfg.terms] == [("format", "regex", 0.2), ("correct", "exact", 1.0)]
    assert cfg.exact.case_sensitive is False and cfg.math.answer_key == "solution" and not cfg.math.require_boxed
    assert cfg.code.max_cases == 4 and cfg.code.float_tolerance == 1e-6
    assert (cfg.code.sandbox.cpu_time_s, cfg.code.sandbox.memory_mb, cfg.code.sandbox.cpu_cores) == (3, 512, 0.5)
    assert cfg.max_error_fraction == 0.25
    with pytest.raises(ConfigError, match=r"code.sandbox.cpu_time_sec.*did you mean 'reward.code.sandbox.cpu_time_s'"):
        section("reward: {code: {sandbox: {cpu_time_sec: 3}}}")
    with pytest.raises(ConfigError, match="max_error_fraction"):
        section("reward: {max_error_fraction: 2}")
    with pytest.raises(ConfigError, match="duplicate names"):
        section("reward: {terms: [{name: a, reward: math}, {name: a, reward: exact}]}")


def test_composed_reward_sums_weighted_terms_and_reports_each():
    runner = RewardRunner(section(COMPOSED))
    scores = runner.score([r"\boxed{PARIS}", "paris", r"\boxed{Lyon}"], [{"answer": "Paris"}] * 3)
    assert scores == pytest.approx([1.2, 1.0, 0.2])
    m = runner.metrics()
    assert m["reward/format/mean"] == pytest.approx(2 / 3) and m["reward/correct/mean"] == pytest.approx(2 / 3)
    assert m["reward/format/calls"] == 3.0 and m["reward_calls"] == 6.0 and m["reward/correct/errors"] == 0.0


def test_term_options_are_checked_against_the_builtin_section():
    with pytest.raises(RewardSetupError, match=r"reward.terms\[0\].options.patern.*did you mean"):
        RewardRunner(section("reward: {terms: [{name: f, reward: regex, options: {patern: x}}]}"))


# ------------------------------------------------------------------------------------------ start-up check


def dataset(tmp_path, rows) -> PromptDataset:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return PromptDataset(DataConfig(paths=(str(path),)))


def test_rows_missing_a_declared_field_fail_with_reward_field_file_and_line(tmp_path):
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}, {"prompt": "c", "ans": "3"}]
    ds = dataset(tmp_path, rows)
    cfg = section(COMPOSED.replace("reward: exact", "reward: math"))
    with pytest.raises(RewardSetupError) as e:
        check_reward_setup(cfg, ds)
    msg = str(e.value)
    assert f"{tmp_path}/prompts.jsonl:3" in msg and "reward 'correct'" in msg and "'solution'" in msg
    assert "prompts.jsonl:1" in msg  # answer_key is 'solution' here: every row lacks it
    check_reward_setup(RewardRunnerConfig(reward="math"), list(ds)[:2])
    with pytest.raises(RewardSetupError, match=r"prompts.jsonl:3: reward 'math'.*'answer', which this row lacks"):
        check_reward_setup(RewardRunnerConfig(reward="math"), ds)


def test_user_functions_declare_their_fields(tmp_path, monkeypatch):
    pkg = tmp_path / "setup_check_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "def declared(response, metadata):\n    return metadata['gold'] == response\n"
        "declared.required_fields = ('gold',)\n"
        "def plain(response, metadata):\n    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [("data.jsonl:7", {"other": 1})]
    with pytest.raises(RewardSetupError, match=r"data.jsonl:7: reward 'declared'.*'gold'"):
        check_reward_setup(RewardRunnerConfig(reward="setup_check_pkg:declared"), rows)
    with pytest.raises(RewardSetupError, match=r"data.jsonl:7: reward 'plain'.*'target'"):
        check_reward_setup(RewardRunnerConfig(reward="setup_check_pkg:plain", required_fields=("target",)), rows)
    check_reward_setup(RewardRunnerConfig(reward="setup_check_pkg:plain"), rows)


def test_unknown_and_unimportable_rewards_fail_at_start_up():
    with pytest.raises(RewardSetupError, match=r"reward.terms\[1\].reward = 'nope'.*unknown reward"):
        check_reward_setup(section("reward: {terms: [{name: a, reward: math}, {name: b, reward: nope}]}"), [])
    with pytest.raises(RewardSetupError, match=r"reward.reward = 'no_such_pkg_xyz:fn'.*cannot import"):
        check_reward_setup(RewardRunnerConfig(reward="no_such_pkg_xyz:fn"), [])
    with pytest.raises(RewardSetupError, match=r"f.jsonl:2: .*unknown reward 'bogus'"):
        check_reward_setup(
            RewardRunnerConfig(reward="exact"),
            [("f.jsonl:1", {"answer": "x"}), ("f.jsonl:2", {"answer": "x", "reward_fn": "bogus"})],
        )


def test_code_reward_start_up_checks_the_sandbox_and_each_rows_tests():
    bad_sandbox = section("reward: {reward: code, code: {sandbox: {namespaces: false, require: [netns]}}}")
    rows = [("t.jsonl:1", {"tests": ["assert f(1) == 2"]})]
    with pytest.raises(RewardSetupError, match=r"reward 'code'.*sandbox is unavailable.*netns"):
        check_reward_setup(bad_sandbox, rows)
    cfg = RewardRunnerConfig(reward="code")
    rows += [
        ("t.jsonl:2", {"tests": '{"inputs": ["1"], "outputs": ['}),
        ("t.jsonl:3", {"tests": ["assert f(1) == "]}),
        ("t.jsonl:4", {"prompt_only": True}),
    ]
    with pytest.raises(RewardSetupError) as e:
        check_reward_setup(cfg, rows, check_sandbox=False)
    msg = str(e.value)
    assert "3 problem(s) in 4 dataset rows" in msg and "t.jsonl:1" not in msg
    assert "t.jsonl:2: reward 'code' (code) cannot score this row: ValueError" in msg
    assert "t.jsonl:3: reward 'code' (code) cannot score this row: SyntaxError" in msg
    assert "t.jsonl:4: reward 'code' (code, reward.reward) needs metadata field 'tests'" in msg


def test_start_up_check_with_a_working_sandbox_returns_the_runner():
    runner = check_reward_setup(RewardRunnerConfig(reward="code"), [("t.jsonl:1", {"tests": ["assert True"]})])
    assert isinstance(runner, RewardRunner) and runner.terms[0].sandbox is not None


def test_module_exports():
    assert rewards.check_reward_setup is check_reward_setup and issubclass(rewards.RewardFailure, rewards.RewardError)
