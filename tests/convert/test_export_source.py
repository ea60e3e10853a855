"""Which checkpoint ``tools/convert_mcore_to_hf.py`` exports (gspo_mcore.convert.export_source.locate), on a real
training run folder: the tiny job (2 gloo ranks) saves steps 0 and 1.

``--run F`` takes F's own checkpoints whatever F's ``config.yaml`` says and wherever the command is run from: a
copied folder, a moved one, and a backup of a run started with relative paths while the original (the same
relative path seen from the working directory) has gone on training. A ``checkpoint.dir`` outside F is used only
when F holds no checkpoint, with a line naming it. Unfinished steps (an interrupted save's ``step_<N>.tmp-*``,
a step without its manifest) are refused by name.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys

import pytest
import yaml
from helpers import ROOT, worker_env
from helpers.checkpoint_launch import ENV, tiny_command

from gspo_mcore.convert.export_source import ExportSourceError, locate

pytestmark = pytest.mark.distributed
SMALL = ("rollout.prompts_per_step=4", "rollout.group_size=4", "batch.num_minibatches=1")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``(workdir, run folder)``: the tiny job run from ``workdir`` with the relative ``log.output_dir``
    ``runs/x`` (so its config.yaml records the relative ``checkpoint.dir`` ``runs/x/checkpoints``), 2 steps,
    saved after each."""
    from examples.tiny.task import prepare

    work = tmp_path_factory.mktemp("work")
    prepare(str(work / "inputs"), num_prompts=32)
    command = tiny_command(str(work / "inputs"), "runs/x", "steps=2", "checkpoint.save_every=1", *SMALL)
    proc = subprocess.run(command, cwd=work, env=ENV, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    run = work / "runs" / "x"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["checkpoint"]["dir"] == "runs/x/checkpoints"
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step_0", "step_1"]
    return work, run


def _keep_only(run, step: int) -> None:
    """The run folder as it was after ``step``: the later checkpoints gone, ``latest`` naming it."""
    ckpts = run / "checkpoints"
    for name in os.listdir(ckpts):
        if name.startswith("step_") and name != f"step_{step}":
            shutil.rmtree(ckpts / name)
    (ckpts / "latest").write_text(f"step_{step}\n")


def _manifest_sha256(step_dir) -> str:
    return hashlib.sha256((step_dir / "manifest.json").read_bytes()).hexdigest()


def test_a_copied_run_folder_exports_its_own_checkpoint(trained, tmp_path, monkeypatch):
    work, run = trained
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    _keep_only(copy, 0)  # the copy differs from the original (step 1) so a wrong pick shows
    monkeypatch.chdir(work)  # where the original's relative checkpoint.dir resolves to the original
    source = locate(str(copy), verify="size")
    assert source.training.path == str(copy / "checkpoints" / "step_0")
    assert source.training.found_via is None
    assert source.training.manifest_sha256 == _manifest_sha256(copy / "checkpoints" / "step_0")


def test_a_moved_run_folder_exports_its_own_checkpoint(trained, tmp_path, monkeypatch):
    """The folder moved away after step 0, and a new run at its old path (``runs/x`` from the working
    directory, now at step 1): the moved folder is exported, not what its old path holds now."""
    work, run = trained
    moved = tmp_path / "elsewhere" / "renamed"
    shutil.copytree(run, moved)
    _keep_only(moved, 0)
    monkeypatch.chdir(work)
    assert locate(str(moved), verify="size").training.path == str(moved / "checkpoints" / "step_0")
    assert locate(str(moved / "checkpoints"), verify="size").training.path == str(moved / "checkpoints" / "step_0")


def test_a_backup_of_a_relative_path_run_is_not_the_live_run(trained, tmp_path, monkeypatch):
    """The backup (step 0) is exported from the live run's working directory, where the backup's recorded
    ``checkpoint.dir`` (runs/x/checkpoints) names the original, which has trained on (step 1)."""
    work, run = trained
    backup = tmp_path / "backup" / "x"
    shutil.copytree(run, backup)
    _keep_only(backup, 0)
    monkeypatch.chdir(work)
    out = tmp_path / "hf"
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tools", "convert_mcore_to_hf.py"),
            "--run",
            str(backup),
            "--out",
            str(out),
        ],
        cwd=work,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    step_dir = backup / "checkpoints" / "step_0"
    assert f"exported step 0 ({step_dir}; manifest sha256 {_manifest_sha256(step_dir)})" in proc.stdout
    assert str(run) not in proc.stdout + proc.stderr


def test_a_checkpoint_dir_outside_the_folder_is_used_only_when_the_folder_holds_none(trained, tmp_path, monkeypatch):
    work, run = trained
    folder = tmp_path / "runs" / "y"
    folder.mkdir(parents=True)
    shutil.copy(run / "config.yaml", folder / "config.yaml")
    elsewhere = tmp_path / "store"
    shutil.copytree(run / "checkpoints", elsewhere)
    config = yaml.safe_load((folder / "config.yaml").read_text())
    monkeypatch.chdir(work)  # a relative checkpoint.dir is never taken from the working directory
    with pytest.raises(ExportSourceError, match="holds no checkpoint"):
        locate(str(folder), verify="size")
    config["checkpoint"]["dir"] = str(elsewhere)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    source = locate(str(folder), verify="size")
    assert source.training.path == str(elsewhere / "step_1")
    assert str(elsewhere) in source.training.found_via and "checkpoint.dir" in source.training.found_via
    # the folder's own checkpoints win over the configured directory
    shutil.copytree(run / "checkpoints", folder / "checkpoints")
    _keep_only(folder, 0)
    source = locate(str(folder), verify="size")
    assert source.training.path == str(folder / "checkpoints" / "step_0") and source.training.found_via is None


@pytest.mark.parametrize("name", ["step_2.tmp-0123abcd", "step_2.deleting-0123abcd", "step_2.rejected-0123abcd"])
def test_an_unfinished_step_is_refused_by_name(trained, tmp_path, monkeypatch, name):
    work, run = trained
    partial = tmp_path / name
    shutil.copytree(run / "checkpoints" / "step_1", partial)
    monkeypatch.chdir(work)
    with pytest.raises(ExportSourceError) as exc:
        locate(str(partial), verify="size")
    assert name in str(exc.value) and "unfinished" in str(exc.value)


def test_a_step_without_its_manifest_is_refused_even_unverified(trained, tmp_path, monkeypatch):
    work, run = trained
    partial = tmp_path / "step_1"
    shutil.copytree(run / "checkpoints" / "step_1", partial)
    (partial / "manifest.json").unlink()
    monkeypatch.chdir(work)
    for verify in ("size", "none"):
        with pytest.raises(ExportSourceError, match="unfinished"):
            locate(str(partial), verify=verify)
    renamed = tmp_path / "chosen"
    os.rename(partial, renamed)
    with pytest.raises(ExportSourceError, match="unfinished"):
        locate(str(renamed), verify="none")
