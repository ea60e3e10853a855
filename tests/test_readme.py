"""Every command in the README is exercised: make targets exist and dry-run, the torchrun line's config
and overrides parse and validate (the trainer itself runs in tests/trainer), the install line names this
project's build."""

import os
import re
import shlex
import subprocess

import pytest

from gspo_mcore.train import parse_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_commands():
    text = open(os.path.join(ROOT, "README.md")).read()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    cmds = []
    for block in blocks:
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                cmds.append(line)
    return cmds


def test_readme_has_the_two_commands():
    cmds = readme_commands()
    assert "make demo" in cmds and "make test" in cmds


@pytest.mark.parametrize("cmd", [c for c in readme_commands() if c.startswith("make ")])
def test_make_targets_dry_run(cmd):
    proc = subprocess.run(["make", "-n", *shlex.split(cmd)[1:]], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("cmd", [c for c in readme_commands() if "gspo_mcore.train" in c or c.startswith("gspo-train")])
def test_training_commands_parse(cmd):
    argv = shlex.split(cmd)
    argv = argv[argv.index("gspo_mcore.train") + 1 :] if "gspo_mcore.train" in argv else argv[1:]
    cfg = parse_config(argv)
    assert cfg.steps >= 1


def test_install_line_builds_this_project():
    cmds = readme_commands()
    assert "pip install -e . --no-build-isolation" in cmds
    assert os.path.exists(os.path.join(ROOT, "setup.py")) and os.path.exists(os.path.join(ROOT, "pyproject.toml"))


def test_ci_calls_make_test_and_the_sglang_tier():
    lines = [ln.strip() for ln in open(os.path.join(ROOT, ".ci", "run")) if not ln.lstrip().startswith("#")]
    assert "make test" in lines and "make test-sglang" in lines
    assert lines.index("make lint") < lines.index("make test-fast") < lines.index("make test")
