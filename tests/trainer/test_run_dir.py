"""One run per folder (gspo_mcore.trainer.run_dir): what a fresh run and a resumed one may find in the folder.

Configurations here are plain data as ``to_dict`` makes them; ``config.yaml`` is written by :func:`prepare`
(the trainer's own first write). The checkpoint side (a resume's candidate, damaged checkpoints) runs on a
real training checkpoint in tests/trainer/test_input_errors.py.
"""

from __future__ import annotations

import pytest

from gspo_mcore.trainer import run_dir
from gspo_mcore.trainer.run_dir import RESUME_MAY_DIFFER, RunDirError, check, prepare

CONFIG = {
    "steps": 10,
    "seed": 1,
    "optim": {"lr": 1e-3, "clip_grad": 1.0},
    "parallel": {"tensor": 1},
    "eval": {"every": 5, "datasets": [{"name": "h", "data": {"paths": ["h.jsonl"]}}]},
    "log": {"output_dir": "x", "progress_bar": True, "overwrite": False},
    "checkpoint": {"resume": False, "save_every": 0},
    "data": {"paths": ["a.jsonl"]},
}


def edit(config: dict, key: str, value) -> dict:
    import copy

    out = copy.deepcopy(config)
    node = out
    *parents, last = key.split(".")
    for p in parents:
        node = node[p]
    node[last] = value
    return out


def _check(tmp_path, config=CONFIG, *, resume=False, overwrite=False):
    return check(
        config,
        output_dir=str(tmp_path),
        checkpoint_dir=str(tmp_path / "checkpoints"),
        resume=resume,
        overwrite=overwrite,
    )


def test_a_fresh_folder_is_not_created_by_the_check(tmp_path):
    plan = _check(tmp_path / "new")
    assert plan.clear == () and not (tmp_path / "new").exists()
    prepare(plan, CONFIG)
    assert (tmp_path / "new" / "config.yaml").exists()


@pytest.mark.parametrize(
    "trace", ["metrics.jsonl", "config.yaml", "tensorboard/events.out.tfevents.1.host", "checkpoints/step_3"]
)
def test_a_fresh_run_is_refused_in_a_folder_holding_another_run(tmp_path, trace):
    path = tmp_path / trace
    if "." in trace:
        path.parent.mkdir(exist_ok=True)
        path.write_text("{}\n")
    else:
        path.mkdir(parents=True)
    with pytest.raises(RunDirError) as exc:
        _check(tmp_path)
    message = str(exc.value)
    assert f"{tmp_path} already holds a run ({trace.split('/')[0]})" in message
    assert "checkpoint.resume=true" in message and "log.overwrite=true" in message


def test_overwrite_deletes_the_previous_runs_traces_only(tmp_path):
    for f in ("metrics.jsonl", "metrics.jsonl.previous", "config.yaml", "prompts.jsonl"):
        (tmp_path / f).write_text("old\n")
    (tmp_path / "checkpoints" / "step_0").mkdir(parents=True)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    plan = _check(tmp_path, overwrite=True)
    prepare(plan, CONFIG)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["config.yaml", "model", "prompts.jsonl"]
    assert "old" not in (tmp_path / "config.yaml").read_text()


def test_overwrite_and_resume_contradict(tmp_path):
    with pytest.raises(RunDirError, match="log.overwrite=true .* checkpoint.resume=True .*: set one of them"):
        _check(tmp_path, resume=True, overwrite=True)


@pytest.mark.parametrize(
    "key,value",
    [
        ("steps", 20),
        ("eval.every", 2),
        ("parallel.tensor", 2),
        ("log.progress_bar", False),
        ("checkpoint.resume", True),
        ("log.output_dir", "moved"),
    ],
)
def test_a_resume_may_change_what_does_not_define_the_run(tmp_path, key, value):
    prepare(_check(tmp_path), CONFIG)
    plan = _check(tmp_path, edit(CONFIG, key, value), resume=True)
    assert plan.compared_with == str(tmp_path / "config.yaml")


def test_a_resume_with_another_configuration_is_refused_naming_the_keys(tmp_path):
    prepare(_check(tmp_path), CONFIG)
    changed = edit(edit(edit(CONFIG, "optim.lr", 2e-3), "seed", 7), "steps", 30)
    with pytest.raises(RunDirError) as exc:
        _check(tmp_path, changed, resume=True)
    message = str(exc.value)
    assert "2 key(s) that define the run: optim.lr: 0.001 -> 0.002; seed: 1 -> 7" in message
    assert "steps" not in message.split("define the run:")[1]
    assert str(tmp_path / "config.yaml") in message


def test_a_resume_may_not_change_the_cpu_dtype(tmp_path):
    """model.options may differ on resume (how the same computation runs), but not cpu_bf16 inside it."""
    base = dict(CONFIG, model={"options": {"recompute": False, "cpu_bf16": False}})
    prepare(_check(tmp_path), base)
    _check(tmp_path, edit(base, "model.options.recompute", True), resume=True)
    with pytest.raises(RunDirError, match=r"1 key\(s\) that define the run: model\.options\.cpu_bf16: False -> 'auto'"):
        _check(tmp_path, edit(base, "model.options.cpu_bf16", "auto"), resume=True)


def test_resume_may_differ_names_real_keys():
    """Every key of RESUME_MAY_DIFFER is a field of the trainer's configuration (a rename must follow here)."""
    from gspo_mcore.config import to_dict
    from gspo_mcore.data.dataset import DataConfig
    from gspo_mcore.trainer import TrainConfig
    from gspo_mcore.trainer.config import ModelConfig

    tree = to_dict(TrainConfig(model=ModelConfig(hf_dir="m"), data=DataConfig(paths=("a.jsonl",))))
    for key in RESUME_MAY_DIFFER + run_dir.RESUME_MUST_MATCH:
        node = tree
        for part in key.split("."):
            assert isinstance(node, dict) and part in node, key
            node = node[part]


def test_diff_treats_tuples_as_saved_lists():
    assert run_dir.diff({"a": [1, 2], "b": {"c": 1}}, {"a": (1, 2), "b": {"c": 2}}) == {"b.c": (1, 2)}


def _old_run(folder, checkpoints):
    """A previous run's traces in ``folder`` (checkpoints in ``checkpoints``), next to a user's own files."""
    for f in ("metrics.jsonl", "metrics.jsonl.previous", "config.yaml", "metrics.png"):
        (folder / f).write_text("old\n")
    (folder / "tensorboard").mkdir()
    (folder / "tensorboard" / "events.out.tfevents.1.host").write_text("old")
    (folder / "eval_samples").mkdir()
    (folder / "eval_samples" / "step_0.jsonl").write_text("old\n")
    for step in ("step_0", "step_2", "step_3.tmp-abc"):
        (checkpoints / step / "megatron").mkdir(parents=True)
        (checkpoints / step / "megatron" / "metadata.json").write_text("{}")
    (checkpoints / "latest").write_text("step_2\n")


def _user_files(folder):
    (folder / "notes.txt").write_text("mine\n")
    (folder / "model").mkdir()
    (folder / "model" / "config.json").write_text("{}")
    (folder / "tensorboard").mkdir(exist_ok=True)
    (folder / "tensorboard" / "my_plot.png").write_text("mine")


def _tree(folder) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_overwrite_with_the_checkpoints_in_the_run_folder_deletes_only_the_runs_files(tmp_path):
    """checkpoint.dir = log.output_dir: overwrite removes step_*, latest, metrics, events and config, and keeps
    the user's files (a model folder, notes, a file among the events) and the folder itself."""
    _old_run(tmp_path, tmp_path)
    _user_files(tmp_path)
    plan = check(CONFIG, output_dir=str(tmp_path), checkpoint_dir=str(tmp_path), resume=False, overwrite=True)
    prepare(plan, CONFIG)
    assert _tree(tmp_path) == [
        "config.yaml",
        "model",
        "model/config.json",
        "notes.txt",
        "tensorboard",
        "tensorboard/my_plot.png",
    ]
    assert "old" not in (tmp_path / "config.yaml").read_text()


def test_overwrite_keeps_user_files_in_a_separate_checkpoint_directory(tmp_path):
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    (ckpts / "README").write_text("mine\n")
    _old_run(tmp_path, ckpts)
    prepare(check(CONFIG, output_dir=str(tmp_path), checkpoint_dir=str(ckpts), resume=False, overwrite=True), CONFIG)
    assert _tree(tmp_path) == ["ckpts", "ckpts/README", "config.yaml"]


def test_a_checkpoint_directory_above_the_run_folder_is_refused(tmp_path):
    with pytest.raises(RunDirError) as exc:
        check(CONFIG, output_dir=str(tmp_path / "run"), checkpoint_dir=str(tmp_path), resume=False, overwrite=True)
    message = str(exc.value)
    assert f"checkpoint.dir={tmp_path}" in message and f"log.output_dir={tmp_path / 'run'}" in message


def test_a_read_only_output_folder_is_named_at_start_up(tmp_path, monkeypatch):
    """The probe file cannot be created (EROFS, as on a read-only mount; root ignores chmod, so the failure is
    injected at the probe): a RunDirError naming the key, the folder and 'read-only'; nothing is left."""
    import errno
    import tempfile

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", kwargs.get("dir"))

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(RunDirError) as exc:
        run_dir.check_writable(str(tmp_path / "new" / "run"), str(tmp_path / "new" / "run" / "checkpoints"))
    message = str(exc.value)
    assert f"log.output_dir={tmp_path / 'new' / 'run'}" in message and "read-only" in message
    assert f"cannot create a file in {tmp_path}" in message
    assert not (tmp_path / "new").exists()
    monkeypatch.undo()
    run_dir.check_writable(str(tmp_path / "run"), str(tmp_path / "run" / "checkpoints"))
    assert list(tmp_path.iterdir()) == []


def test_a_second_run_in_the_same_folder_is_refused_while_the_first_holds_it(tmp_path):
    import subprocess
    import sys

    first = run_dir.lock_folder(str(tmp_path / "run"))
    with pytest.raises(RunDirError, match=f"log.output_dir={tmp_path / 'run'} is in use by another run"):
        run_dir.lock_folder(str(tmp_path / "run"))
    other = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from gspo_mcore.trainer import run_dir; run_dir.lock_folder({str(tmp_path / 'run')!r})",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert other.returncode != 0 and "is in use by another run" in other.stderr, other.stderr[-2000:]
    first.release()
    assert not (tmp_path / "run").exists()  # made for the lock, empty again: removed
    second = run_dir.lock_folder(str(tmp_path / "run"))
    (tmp_path / "run" / "config.yaml").write_text("x\n")
    second.release()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.yaml"]


def _save_state(checkpoint_dir, save):
    """The least of a run's state that ``loop._save_checkpoint`` reads, with the learner's ``save`` given."""
    import types

    return types.SimpleNamespace(
        cfg=types.SimpleNamespace(checkpoint=types.SimpleNamespace(dir=str(checkpoint_dir))),
        learner=types.SimpleNamespace(save=save),
        loader=types.SimpleNamespace(state_dict=lambda: {}),
        prefetch=None,
        data_files=None,
    )


@pytest.mark.parametrize(
    "error",
    ["enospc", "torch-writer"],
)
def test_a_full_disk_is_named_at_the_save(tmp_path, monkeypatch, error):
    """A checkpoint save that fails for want of space says so, naming the folder; torch's zip writer reports it
    as 'unexpected pos 704 vs 598', recognised by the free space left."""
    import errno
    import shutil
    import types

    from gspo_mcore.trainer import loop

    def save(checkpoints, step, *, extra=None):
        if error == "enospc":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise RuntimeError("[enforce fail at inline_container.cc:858] . unexpected pos 704 vs 598")

    monkeypatch.setattr(shutil, "disk_usage", lambda path: types.SimpleNamespace(total=10, used=10, free=0))
    state = _save_state(tmp_path, save)
    with pytest.raises(OSError) as exc:
        loop._save_checkpoint(state, None, 3)
    assert exc.value.errno == errno.ENOSPC
    assert f"disk full: no space left in checkpoint.dir={tmp_path} while saving the checkpoint of step 3" in str(
        exc.value
    )


def test_other_save_errors_pass_through(tmp_path):
    from gspo_mcore.trainer import loop

    def save(checkpoints, step, *, extra=None):
        raise RuntimeError("a bug")

    state = _save_state(tmp_path, save)
    with pytest.raises(RuntimeError, match="^a bug$"):
        loop._save_checkpoint(state, None, 3)
