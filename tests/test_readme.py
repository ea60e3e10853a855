"""Every command in the README and the docs (their ```bash blocks) is exercised: make targets exist and
dry-run, the training lines' configs and overrides parse and validate (the trainer itself runs in
tests/trainer), the tools and example scripts accept every flag the line gives them, and the install line
names this project's build. CI (.ci/run) runs each tier once and stops at the first failure."""

import glob
import os
import re
import shlex
import stat
import subprocess
import sys

import pytest
import yaml

from gspo_mcore.train import parse_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [
    "README.md",
    *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)),
]


def doc_commands(path: str) -> list[str]:
    text = open(os.path.join(ROOT, path)).read()
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                cmds.append(line)
    return cmds


def all_commands() -> list[tuple[str, str]]:
    return [(path, cmd) for path in DOCS for cmd in doc_commands(path)]


def _ids(items):
    return [f"{path}: {cmd[:60]}" for path, cmd in items]


def _script(argv: list[str]) -> list[str] | None:
    """``[python, script.py | -m module, args...]`` of a ``python tools/x.py ...`` / ``python -m pkg ...`` line
    (after any ``VAR=value`` prefixes) whose script is in this repository, as a command to run here; None for
    other lines (``python -m sglang...``, ``torchrun``, ``pip``)."""
    while argv and re.match(r"^[A-Z_]+=", argv[0]):
        argv = argv[1:]
    if not argv or not os.path.basename(argv[0]).startswith("python"):
        return None
    rest = argv[1:]
    if rest[:1] == ["-m"] and rest[1].split(".")[0] in ("gspo_mcore", "examples", "tools", "tests"):
        return [sys.executable, "-m", rest[1], *rest[2:]]
    if rest and rest[0].endswith(".py"):
        return [sys.executable, rest[0], *rest[1:]]
    return None


MAKE = [c for c in all_commands() if c[1].startswith("make ")]
TRAIN = [c for c in all_commands() if "gspo_mcore.train" in c[1] or c[1].startswith("gspo-train")]
SCRIPTS = [c for c in all_commands() if _script(shlex.split(c[1]))]


def test_readme_has_the_two_commands():
    cmds = doc_commands("README.md")
    assert "make demo" in cmds and "make test" in cmds


def test_readme_is_a_front_page():
    """At most about 250 lines: the measurements live in docs/results/."""
    lines = open(os.path.join(ROOT, "README.md")).read().splitlines()
    assert len(lines) <= 260, len(lines)


def test_every_results_page_states_date_machine_and_command():
    pages = sorted(glob.glob(os.path.join(ROOT, "docs", "results", "*.md")))
    assert pages
    for page in pages:
        head = open(page).read()[:2000]
        for field in ("**Date**", "**Machine**", "**Command**", "**Figures**"):
            assert field in head, f"{os.path.relpath(page, ROOT)} does not state its {field}"


@pytest.mark.parametrize("path,cmd", MAKE, ids=_ids(MAKE))
def test_make_targets_dry_run(path, cmd):
    proc = subprocess.run(["make", "-n", *shlex.split(cmd)[1:]], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("path,cmd", TRAIN, ids=_ids(TRAIN))
def test_training_commands_parse(path, cmd, capsys):
    argv = shlex.split(cmd)
    argv = argv[argv.index("gspo_mcore.train") + 1 :] if "gspo_mcore.train" in argv else argv[1:]
    if "--print-config" in argv:
        with pytest.raises(SystemExit) as exc:
            parse_config(argv)
        assert exc.value.code == 0
        assert yaml.safe_load(capsys.readouterr().out)["steps"] >= 1
        return
    cfg = parse_config(argv)
    assert cfg.steps >= 1


@pytest.mark.parametrize("path,cmd", SCRIPTS, ids=_ids(SCRIPTS))
def test_script_commands_accept_their_flags(path, cmd):
    """The script exists, its --help runs, and every --flag of the documented line is one it takes."""
    run = _script(shlex.split(cmd))
    target = run[1] if run[1] != "-m" else run[2]
    if run[1] != "-m":
        assert os.path.exists(os.path.join(ROOT, target)), f"{path}: {target} does not exist"
    head = run[:3] if run[1] == "-m" else run[:2]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([*head, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"{path}: {' '.join(head[1:])} --help failed:\n{proc.stderr[-2000:]}"
    flags = {a.split("=", 1)[0] for a in run[len(head) :] if a.startswith("--")}
    unknown = sorted(f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", proc.stdout))
    assert not unknown, f"{path}: `{cmd}` passes {unknown}, which {target} --help does not list"


def test_install_line_builds_this_project():
    cmds = doc_commands("README.md")
    assert "pip install -e . --no-build-isolation" in cmds
    assert os.path.exists(os.path.join(ROOT, "setup.py")) and os.path.exists(os.path.join(ROOT, "pyproject.toml"))


def _ci_targets() -> list[str]:
    lines = [ln.strip() for ln in open(os.path.join(ROOT, ".ci", "run")) if not ln.lstrip().startswith("#")]
    return [ln for ln in lines if ln.startswith("make ")]


def test_ci_runs_each_tier_once():
    """Lint, the README's test command (the whole suite, the fast tier included) and the SGLang tier, once each."""
    assert _ci_targets() == ["make install", "make lint", "make test", "make test-sglang"]


def test_ci_stops_at_a_failing_tier_with_a_nonzero_status(tmp_path):
    """.ci/run against a `make` that fails on `test`: the script exits non-zero and runs nothing after it."""
    log = tmp_path / "calls"
    fake = tmp_path / "make"
    fake.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\n[ "$1" != test ]\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    # a Slurm root given: .ci/run keeps it instead of downloading the packages (tools/slurm/ci_slurm.sh)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "GSPO_SLURM_ROOT": str(tmp_path)}
    proc = subprocess.run(["bash", os.path.join(ROOT, ".ci", "run")], capture_output=True, text=True, env=env)
    assert proc.returncode != 0
    assert log.read_text().split("\n")[:-1] == ["install", "lint", "test"]


def test_ci_runs_the_suite_with_slurm(tmp_path):
    """`make test` runs with GSPO_SLURM_TESTS=1 and the Slurm root tools/slurm/ci_slurm.sh gives (here one given
    beforehand, which .ci/run keeps), so the single-node Slurm test runs in CI and cannot pass by skipping."""
    log = tmp_path / "calls"
    fake = tmp_path / "make"
    fake.write_text(f'#!/bin/sh\necho "$1 $GSPO_SLURM_TESTS $GSPO_SLURM_ROOT" >> "{log}"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {k: v for k, v in os.environ.items() if k != "GSPO_SLURM_TESTS"}
    env.update(PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}", GSPO_SLURM_ROOT="/opt/slurm-root")
    proc = subprocess.run(["bash", os.path.join(ROOT, ".ci", "run")], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    calls = dict(line.split(" ", 1) for line in log.read_text().splitlines())
    assert calls["test"] == "1 /opt/slurm-root"
