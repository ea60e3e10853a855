"""Checkpoint validation and resume policy, in this process (no ranks): a truncated, corrupted or
incomplete checkpoint is reported with the reason; ``resume`` picks the newest valid one or refuses.

The checkpoints are copies of the reference run's (``conftest.reference``).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from helpers.checkpoint_launch import TINY_CONFIG

from gspo_mcore.config import ConfigError
from gspo_mcore.learner.checkpoint import CheckpointConfig, Checkpointer, CheckpointError, find_latest_valid, validate
from gspo_mcore.train import parse_config

pytestmark = pytest.mark.distributed  # spawns training processes: not in the fast tier


@pytest.fixture
def ckpts(reference, tmp_path):
    """A copy of the reference's checkpoint directory (step_3, step_4, step_5)."""
    root = str(tmp_path / "checkpoints")
    shutil.copytree(os.path.join(reference["out"], "checkpoints"), root)
    return root


def step(root, n):
    return os.path.join(root, f"step_{n}")


def test_a_complete_checkpoint_is_valid(ckpts):
    assert validate(step(ckpts, 5)) == []
    with open(os.path.join(step(ckpts, 5), "manifest.json")) as f:
        manifest = json.load(f)
    names = set(manifest["files"])
    assert {
        "trainer_state.json",
        "config.yaml",
        "megatron/metadata.json",
        "megatron/.metadata",
        "rng/rank_0.pt",
        "rng/rank_1.pt",
    } <= names
    assert manifest["step"] == 5 and len(manifest["config_sha256"]) == 64


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1)


def _flip(path):
    with open(path, "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0x80]))


def _append(path):
    with open(path, "ab") as f:
        f.write(b"x")


@pytest.mark.parametrize(
    "damage, file, expected",
    [
        (_truncate, "megatron/__0_0.distcp", "megatron/__0_0.distcp truncated"),
        (_append, "megatron/common.pt", "megatron/common.pt longer than recorded"),
        (_flip, "megatron/__1_1.distcp", "megatron/__1_1.distcp corrupted (sha256 mismatch)"),
        (_flip, "trainer_state.json", "trainer_state.json corrupted (sha256 mismatch)"),
        (os.remove, "rng/rank_1.pt", "rng/rank_1.pt missing"),
        (os.remove, "manifest.json", "no manifest.json (incomplete checkpoint)"),
        (_truncate, "manifest.json", "manifest.json unreadable: JSONDecodeError"),
    ],
)
def test_damage_is_detected_with_the_reason(ckpts, damage, file, expected):
    damage(os.path.join(step(ckpts, 5), file))
    problems = validate(step(ckpts, 5))
    assert any(expected in p for p in problems), problems


def test_size_only_verification_misses_a_flipped_byte_but_not_a_truncation(ckpts):
    _flip(os.path.join(step(ckpts, 5), "megatron", "__0_0.distcp"))
    assert validate(step(ckpts, 5), verify="size") == []
    _truncate(os.path.join(step(ckpts, 4), "megatron", "__0_0.distcp"))
    assert validate(step(ckpts, 4), verify="size")


def test_the_newest_valid_checkpoint_is_found_and_newer_invalid_ones_are_reported(ckpts):
    _flip(os.path.join(step(ckpts, 5), "megatron", "__0_0.distcp"))
    os.remove(os.path.join(step(ckpts, 4), "manifest.json"))
    os.makedirs(os.path.join(ckpts, "step_6.tmp-0123"))  # an interrupted save: not a checkpoint
    path, rejected = find_latest_valid(ckpts)
    assert path == step(ckpts, 3)
    assert [p for p, _ in rejected] == [step(ckpts, 5), step(ckpts, 4)]


def _checkpointer(root, resume):
    return Checkpointer(CheckpointConfig(save_every=1, resume=resume), root, layout=None)


def test_resume_policy(ckpts, tmp_path):
    empty = str(tmp_path / "empty")
    assert _checkpointer(empty, False).resume(None, None, None) is None
    assert _checkpointer(empty, True).resume(None, None, None) is None  # first launch of a resumable job
    assert _checkpointer(empty, "auto").resume(None, None, None) is None
    os.makedirs(empty)
    with pytest.raises(CheckpointError, match="holds no checkpoint"):  # an explicit, empty checkpoint directory
        _checkpointer(ckpts, empty).resume(None, None, None)
    with pytest.raises(CheckpointError, match=r"already holds checkpoints \(newest: .*step_5\).*resume=true"):
        _checkpointer(ckpts, False).resume(None, None, None)
    with pytest.raises(CheckpointError, match=r"step_9 does not exist"):
        _checkpointer(empty, step(ckpts, 9)).resume(None, None, None)
    for n in (3, 4, 5):
        _truncate(os.path.join(step(ckpts, n), "trainer_state.json"))
    with pytest.raises(CheckpointError, match=r"step_4 is not valid: trainer_state.json truncated"):
        _checkpointer(empty, step(ckpts, 4)).resume(None, None, None)  # an explicit path: no fallback
    for _ in range(2):  # left in place: a relaunch fails the same way instead of starting from scratch
        with pytest.raises(CheckpointError, match="no valid checkpoint"):
            _checkpointer(ckpts, True).resume(None, None, None)
    assert sorted(os.listdir(ckpts)) == ["latest", "step_3", "step_4", "step_5"]


def test_a_save_interrupted_before_its_rename_is_ignored_then_removed(ckpts):
    """Killed after the manifest, before the rename: complete and valid content under a temporary name."""
    shutil.copytree(step(ckpts, 5), os.path.join(ckpts, "step_6.tmp-0123"))
    assert validate(os.path.join(ckpts, "step_6.tmp-0123")) == []
    os.makedirs(os.path.join(ckpts, "step_2.deleting-4567"))  # a deletion cut short
    assert find_latest_valid(ckpts) == (step(ckpts, 5), [])
    _checkpointer(ckpts, True)
    assert sorted(os.listdir(ckpts)) == ["latest", "step_3", "step_4", "step_5"]


def test_due_saves_every_n_steps_and_after_the_last():
    ck = Checkpointer.__new__(Checkpointer)
    ck.cfg, ck.total_steps = CheckpointConfig(save_every=3), 8
    assert [s for s in range(8) if ck.due(s)] == [2, 5, 7]
    ck.cfg = CheckpointConfig(save_every=0)
    assert not any(ck.due(s) for s in range(8))


def test_checkpoint_config_from_yaml_and_overrides():
    cfg = parse_config(["--config", TINY_CONFIG, "checkpoint.save_every=10", "checkpoint.resume=true"])
    assert cfg.checkpoint.save_every == 10 and cfg.checkpoint.resume is True
    assert parse_config(["--config", TINY_CONFIG, "checkpoint.resume=auto"]).checkpoint.resume == "auto"
    assert (
        parse_config(["--config", TINY_CONFIG, "checkpoint.resume=runs/x/checkpoints/step_9"]).checkpoint.resume
        == "runs/x/checkpoints/step_9"
    )
    assert parse_config(["--config", TINY_CONFIG]).checkpoint == CheckpointConfig()
    for bad, message in (
        ("checkpoint.keep_last=0", "keep_last must be >= 1"),
        ("checkpoint.save_every=-1", "save_every must be an int >= 0"),
        ("checkpoint.optimizer_format=zero", "checkpoint.optimizer_format: must be one of"),
        ("checkpoint.verify=md5", "checkpoint.verify: must be one of"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_config(["--config", TINY_CONFIG, bad])
