"""Both SmolLM2 examples' data steps run on a machine with no package index and no network, from the items
shipped in ``examples/smollm2_arithmetic/data``, and write the same bytes every time.

Only what ``make install`` installs is used (the single-turn step's training rows come from ``reasoning-gym``,
pinned in requirements.txt). A missing package skips a test with the reason on a developer's machine and
fails it under ``CI=true``, where ``make install`` has run."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import socket
import subprocess
import sys

import pytest
from helpers import ROOT, worker_env

from examples.smollm2_agent import prepare_data as agent_data
from examples.smollm2_agent.env import EXAMPLES
from examples.smollm2_arithmetic import make_items
from examples.smollm2_arithmetic import prepare_data as single_data

WRITTEN_SHA256 = {
    "eval_2_digit_addition.jsonl": "4e1c4b9e4c2bbeb6b8954672524a77d214d539d2436fca16a574ef18d18f89de",
    "eval_2_digit_subtraction.jsonl": "70359039546ca8a47452bbf9e6a8053207692e41f61addf7467d8aa586e3030f",
    "train.jsonl": "192079b05deb850df8c3164a5f60c9b36910b709c84d3feba62e494168bff4c2",
    "agent_train.jsonl": "890961777e834b9c757483439aac14be433d909a2278d2567848efa956a697e9",
}
"""SHA-256 of the rows the data steps write (default settings): a change to the items, the row format, the
instruction or reasoning-gym's draws shows here."""


def require(module: str, why: str) -> None:
    """Skip without ``module``; fail under ``CI=true``, where ``make install`` must have installed it."""
    if importlib.util.find_spec(module) is None:
        message = f"{module} is not installed ({why})"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message + "; CI=true, so this fails instead of skipping")
        pytest.skip(message)


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"the data step tried {what}: {args[1:3] if len(args) > 1 else args}")

    return refuse


@pytest.fixture
def offline(monkeypatch):
    """No package index (pip would find a closed loopback port, and is told not to look), no connection, no
    subprocess: each raises an AssertionError naming what was tried."""
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket.socket, "connect", _refuse("a network connection"))
    monkeypatch.setattr(socket.socket, "connect_ex", _refuse("a network connection"))
    monkeypatch.setattr(socket, "getaddrinfo", _refuse("a name lookup"))
    monkeypatch.setattr(subprocess, "Popen", _refuse("a subprocess"))
    monkeypatch.setattr(os, "system", _refuse("a shell command"))


def _sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_offline_guard_refuses_pip_and_connections(offline):
    """The guard itself: what the old data step did (pip download) fails loudly under it."""
    with pytest.raises(AssertionError, match="a subprocess"):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "bigbench==1.0.0"])
    with pytest.raises(AssertionError, match="a name lookup"):
        socket.create_connection(("127.0.0.1", 9), timeout=1)
    with socket.socket() as s, pytest.raises(AssertionError, match="a network connection"):
        s.connect(("127.0.0.1", 9))


AGENT_STEP_OFFLINE = """
import os, socket, subprocess, sys
sys.modules["reasoning_gym"] = None  # any import of it fails: the agent's data step must not need it
def refuse(*args, **kwargs):
    raise AssertionError(f"the data step tried the network or a subprocess: {args[1:3]}")
socket.socket.connect = socket.socket.connect_ex = refuse
socket.getaddrinfo = subprocess.Popen = os.system = refuse
from examples.smollm2_agent.prepare_data import main
sys.exit(main(sys.argv[1:]))
"""
"""The agent example's data step in a fresh interpreter, offline and with ``reasoning_gym`` unimportable (in
this process it may have been imported already)."""


def test_agent_data_step_needs_no_extra_package_and_no_network(tmp_path):
    env = worker_env(PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_NO_INDEX="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-c", AGENT_STEP_OFFLINE, "--data", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = {name: _sha256(tmp_path / name) for name in sorted(os.listdir(tmp_path))}
    names = ("eval_2_digit_addition.jsonl", "eval_2_digit_subtraction.jsonl", "agent_train.jsonl")
    assert written == {name: WRITTEN_SHA256[name] for name in sorted(names)}
    assert json.loads(proc.stdout) == {names[0]: 1000, names[1]: 1000, names[2]: 1936}
    rows, held_out = agent_data.training_rows(str(tmp_path))
    assert len(held_out) == 64 and not held_out & {r["expression"] for r in rows}
    # the prompt's worked examples are neither held out nor trained on
    assert not {e for _, e in EXAMPLES} & (held_out | {r["expression"] for r in rows})


def test_single_turn_data_step_needs_no_network(offline, tmp_path, capsys):
    require("reasoning_gym", "requirements.txt pins reasoning-gym==0.1.25; run make install")
    assert single_data.main(["--out", str(tmp_path)]) == 0
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["files"] == {
        "eval_2_digit_addition.jsonl": 1000,
        "eval_2_digit_subtraction.jsonl": 1000,
        "train.jsonl": 242,
    }
    assert manifest["settings"]["items_sha256"] == single_data.ITEMS_SHA256
    for name in manifest["files"]:
        assert _sha256(tmp_path / name) == WRITTEN_SHA256[name], name
    first = json.loads((tmp_path / "eval_2_digit_addition.jsonl").read_text().splitlines()[0])
    assert first["source"] == "generated/bigbench-format/2_digit_addition"


def test_shipped_items_are_the_generators_bit_for_bit(tmp_path):
    """``make_items`` rewrites the committed files exactly, and their hashes are the recorded ones."""
    assert make_items.main(["--out", str(tmp_path)]) == 0
    for task in single_data.TASKS:
        shipped = os.path.join(single_data.ITEMS_DIR, f"{task}.jsonl")
        assert open(shipped, "rb").read() == (tmp_path / f"{task}.jsonl").read_bytes(), task
        assert _sha256(shipped) == single_data.ITEMS_SHA256[task], task
    assert make_items.main(["--check"]) == 0
    items = make_items.items("2_digit_subtraction")
    assert len({i["input"] for i in items}) == make_items.SIZE and any(i["target"].startswith("-") for i in items)
    assert all(i["input"].startswith("What is ") and i["input"].endswith("?") for i in items)


def test_changed_items_are_refused_by_name(tmp_path):
    path = os.path.join(single_data.ITEMS_DIR, "2_digit_addition.jsonl")
    text = open(path).read()
    (tmp_path / "2_digit_addition.jsonl").write_text(text.replace('"target": "73"', '"target": "74"', 1))
    with pytest.raises(single_data.DataError, match=r"2_digit_addition\.jsonl: SHA-256 \w+ is not the recorded"):
        single_data.read_items("2_digit_addition", str(tmp_path))
    with pytest.raises(single_data.DataError, match="cannot read the shipped items"):
        single_data.read_items("2_digit_subtraction", str(tmp_path))


def test_a_missing_package_fails_under_ci(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="not installed.*CI=true"):
        require("reasoning_gym", "pinned")
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception, match="not installed"):
        require("reasoning_gym", "pinned")
