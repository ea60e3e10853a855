"""The configuration reference: docs/config.md is what tools/gen_config_docs.py generates from the typed configs
today, it documents every key, and `gspo-train --print-config` prints a complete, loadable configuration for
every example config."""

from __future__ import annotations

import dataclasses
import difflib
import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest
import yaml

from gspo_mcore.config import ConfigError, defaults_tree, from_dict, load_yaml
from gspo_mcore.train import parse_config
from gspo_mcore.trainer import TrainConfig, resolve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE_CONFIGS = sorted(glob.glob(os.path.join(ROOT, "examples", "*", "*.yaml")))


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", os.path.join(ROOT, "tools", "gen_config_docs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _keys(tree: dict, path: str = "") -> set[str]:
    """Every dotted key of a plain-data tree (a mapping's own key and its children's)."""
    out = set()
    for k, v in tree.items():
        key = f"{path}.{k}" if path else k
        out.add(key)
        if isinstance(v, dict):
            out |= _keys(v, key)
    return out


def test_docs_config_md_is_up_to_date():
    gen = _generator()
    want = gen.render()
    with open(os.path.join(ROOT, "docs", "config.md")) as f:
        have = f.read()
    if have != want:
        diff = "".join(
            list(difflib.unified_diff(have.splitlines(True), want.splitlines(True), "docs/config.md", "generated"))[:40]
        )
        pytest.fail(f"docs/config.md is stale: run `{gen.COMMAND}` and commit the result\n{diff}")


def test_reference_documents_every_key_with_its_default():
    """Every key of the default tree (what --print-config prints) has a row, and the row shows its default."""
    text = _generator().render()
    tree, required = defaults_tree(TrainConfig)
    rows = {line.split("|")[1].strip().strip("`"): line for line in text.splitlines() if line.startswith("| `")}

    def documented(key: str) -> bool:
        """A row of its own, or (a section type met before) a row under the table its section points to."""
        if key in rows:
            return True
        head, _, tail = key.rpartition(".")
        while head:
            m = re.search(r"Keys: \[`([^`]+)`\]", rows.get(head, ""))
            if m:
                return documented(f"{m.group(1)}.{tail}") if m.group(1) != head else False
            head, _, more = head.rpartition(".")
            tail = f"{more}.{tail}"
        return False

    missing = sorted(k for k in _keys(tree) if not documented(k))
    assert not missing, f"keys without a row in the reference: {missing}"
    assert required == ["model.hf_dir", "data.paths"]
    for key in required:
        assert "| required |" in rows[key]
    assert "| `1.0e-06` |" in rows["optim.lr"]  # a scalar default, as YAML writes it
    # a section whose default differs from its class's own defaults shows the difference
    assert "| `{epochs: null}` |" in rows["sampler"]
    # list-of-section fields get their own table (keys of each element)
    assert "eval.datasets[].name" in rows and "reward.terms[].weight" in rows


def test_field_docstrings_are_read_from_the_source():
    gen = _generator()

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Example:
        """An example section."""

        alpha: int = 1
        """The first key,
        on two lines."""
        beta: str = "b"
        gamma: float = 0.5
        """The third key."""

    assert gen.field_docs(Example) == {"alpha": "The first key,\non two lines.", "gamma": "The third key."}


@pytest.mark.parametrize("path", EXAMPLE_CONFIGS, ids=lambda p: os.path.relpath(p, ROOT))
def test_print_config_on_every_example(path, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(["--print-config", "--config", path])
    assert exc.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    tree, _ = defaults_tree(TrainConfig)
    # every default key is there (sections that hold lists of sections are compared as keys only)
    assert _keys(tree) <= _keys(printed), sorted(_keys(tree) - _keys(printed))
    # it is the resolved run configuration, and it loads back to the same tree
    cfg = resolve(from_dict(TrainConfig, load_yaml(path)))
    assert resolve(from_dict(TrainConfig, printed)) == cfg
    # the defaults that depend on another section are filled in by resolve()
    assert cfg.template.tokenizer_dir and printed["template"]["tokenizer_dir"] == cfg.template.tokenizer_dir
    assert cfg.checkpoint.dir and printed["checkpoint"]["dir"] == cfg.checkpoint.dir


def test_print_config_applies_overrides_and_refuses_unknown_keys(capsys):
    tiny = os.path.join(ROOT, "examples", "tiny", "config.yaml")
    with pytest.raises(SystemExit):
        parse_config(["--print-config", "--config", tiny, "optim.lr=2e-4", "steps=7"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["optim"]["lr"] == 2e-4 and printed["steps"] == 7
    with pytest.raises(ConfigError, match="did you mean 'optim.lr'"):
        parse_config(["--print-config", "--config", tiny, "optim.lrr=1"])


def test_print_config_without_a_file_prints_every_default(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(["--print-config"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("# every default; required (null here): model.hf_dir, data.paths\n")
    printed = yaml.safe_load(out)
    assert printed["model"]["hf_dir"] is None and printed["data"]["paths"] is None
    assert printed["rollout"]["group_size"] == TrainConfig.__dataclass_fields__["rollout"].default_factory().group_size
    # without --print-config the file is still required
    with pytest.raises(SystemExit) as exc:
        parse_config([])
    assert exc.value.code == 2


def test_help_points_to_the_reference_and_print_config():
    """Through the installed entry point's module, as a user runs it."""
    proc = subprocess.run(
        [sys.executable, "-m", "gspo_mcore.train", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "docs/config.md" in text and "--print-config" in text
