"""Input errors under the real ``torchrun`` launch (2 gloo ranks): one line, ``gspo-train: <kind> error: ...``,
printed once (rank 0 only), a non-zero exit, no traceback, and nothing written, because each is found by the
start-up checks (gspo_mcore.trainer.preflight) before any model is built.

The checkpoint cases use a real training checkpoint: the tiny job runs one step and saves it.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re

import pytest
from helpers.checkpoint_launch import run_tiny

pytestmark = pytest.mark.distributed

LINE = re.compile(r"^gspo-train: (?P<kind>[a-z ]+) error: (?P<what>.*)$", re.MULTILINE)
SMALL = ("rollout.prompts_per_step=4", "rollout.group_size=4", "batch.num_minibatches=1")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny job's inputs and a run folder holding one real checkpoint (step_0)."""
    from examples.tiny.task import prepare

    d = tmp_path_factory.mktemp("inputs")
    prepare(str(d), num_prompts=32)
    out = str(d / "run")
    run_tiny(str(d), out, "steps=1", "checkpoint.save_every=1", *SMALL)
    assert os.path.isdir(os.path.join(out, "checkpoints", "step_0"))
    return str(d), out


def one_error(output: str) -> tuple[str, str]:
    """The one ``gspo-train: <kind> error`` line of ``output`` (exactly one, and no traceback from the ranks:
    torchrun's own summary of a failed launch follows it)."""
    lines = LINE.findall(output)
    assert len(lines) == 1, output[-6000:]
    assert "gspo_mcore/" not in output and "[rank0]:" not in output and "[rank1]:" not in output, output[-6000:]
    return lines[0]


def fingerprint(folder: str) -> dict[str, str]:
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "**"), recursive=True)):
        if os.path.isfile(path) and not path.endswith(".log"):
            with open(path, "rb") as f:
                out[path] = hashlib.sha256(f.read()).hexdigest()
    return out


def failing(data: str, out: str, *overrides: str) -> str:
    """Run the tiny job expecting an input error; its output."""
    log = run_tiny(data, out, *SMALL, *overrides, check=False, timeout=180)
    return log


def test_model_folder_without_weights(tiny, tmp_path):
    data, _ = tiny
    out = str(tmp_path / "run")
    kind, what = one_error(failing(data, out, "model.load_hf_weights=true"))
    assert kind == "model"
    assert f"model.hf_dir={data}/model with model.load_hf_weights=true: no *.safetensors weights in" in what
    assert os.listdir(out) == [n for n in os.listdir(out) if n.endswith(".log")]  # only the launcher's log


def test_eval_file_that_does_not_exist(tiny, tmp_path):
    data, _ = tiny
    out = str(tmp_path / "run")
    missing = str(tmp_path / "nowhere.jsonl")
    log = failing(
        data,
        out,
        f"eval.datasets=[{{name: h0, data: {{paths: [{data}/heldout.jsonl]}}}}, "
        f"{{name: h1, data: {{paths: [{missing}]}}}}]",
    )
    kind, what = one_error(log)
    assert (kind, what) == ("eval", f"eval.datasets[1] (h1): data.paths: {missing} does not exist")
    assert os.listdir(out) == [n for n in os.listdir(out) if n.endswith(".log")]


def test_resume_with_a_changed_configuration(tiny):
    data, run = tiny
    before = fingerprint(run)
    kind, what = one_error(failing(data, run, "steps=1", "checkpoint.resume=true", "optim.lr=0.001"))
    assert kind == "run folder"
    assert "1 key(s) that define the run: optim.lr: 0.003 -> 0.001" in what
    assert os.path.join(run, "checkpoints", "step_0", "config.yaml") in what
    assert fingerprint(run) == before


def test_resume_with_every_checkpoint_damaged(tiny):
    data, run = tiny
    shard = sorted(glob.glob(os.path.join(run, "checkpoints", "step_0", "megatron", "*.distcp")))[0]
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    before = fingerprint(run)
    kind, what = one_error(failing(data, run, "steps=2", "checkpoint.resume=true"))
    assert kind == "checkpoint"
    assert what.startswith(f"no usable checkpoint to resume in {run}/checkpoints: every one is damaged (step_0: ")
    assert f"megatron/{os.path.basename(shard)} truncated" in what
    assert fingerprint(run) == before


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("rollout.env=no_such_pkg.mod:Env",), "rollout.env: cannot import module 'no_such_pkg.mod' ("),
        (
            ("rollout.env=gspo_mcore.envs.tools:ToolEnv", "rollout.env_kwargs={tools: ['no_such_pkg.tools:add']}"),
            "rollout.env: gspo_mcore.envs.tools:ToolEnv(**rollout.env_kwargs) failed: ValueError: tools[0]: "
            "cannot import module 'no_such_pkg.tools'",
        ),
    ],
    ids=["unimportable", "bad-kwargs"],
)
def test_environment_that_cannot_be_built(tiny, tmp_path, overrides, message):
    """A bad ``rollout.env`` is found before any model is built: one config error naming the key."""
    data, _ = tiny
    out = str(tmp_path / "run")
    kind, what = one_error(failing(data, out, *overrides))
    assert kind == "config" and what.startswith(message), what
    assert os.listdir(out) == [n for n in os.listdir(out) if n.endswith(".log")]


def test_exit_status_of_an_input_error_with_and_without_torchrun(tmp_path):
    """The documented statuses (gspo_mcore/train.py, docs/export.md): the entry point returns 2 on an input error;
    under a real torchrun (1 process) the rank exits 2, which torchrun's summary shows, and torchrun itself exits
    1, as it does whenever a rank fails (it cannot pass a rank's status on)."""
    import subprocess
    import sys

    from helpers import ROOT, worker_env
    from helpers.launch import torchrun

    args = ["-m", "gspo_mcore.train", "--config", os.path.join(ROOT, "examples", "tiny", "config.yaml"), "optim.lrr=1"]
    env = worker_env()
    plain = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 2, plain.stderr[-3000:]
    assert one_error(plain.stdout + plain.stderr)[0] == "config"
    launched = subprocess.run([*torchrun(1), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = launched.stdout + launched.stderr
    assert LINE.findall(output) == [("config", "unknown config key 'optim.lrr'; did you mean 'optim.lr'?")], output
    assert re.search(r"exitcode\s*:\s*2\b", output), output[-3000:]
    assert launched.returncode == 1, output[-3000:]
    import gspo_mcore.train

    for where, text in [("gspo_mcore/train.py", gspo_mcore.train.__doc__), ("docs/export.md", _read("docs/export.md"))]:
        assert "torchrun itself exits with status 1" in " ".join(text.split()), f"{where} says otherwise"


def _read(relative: str) -> str:
    from helpers import ROOT

    with open(os.path.join(ROOT, relative)) as f:
        return f.read()


@pytest.mark.parametrize("case", ["missing", "no-weights", "other-tokenizer"])
def test_distillation_inputs_are_checked_before_anything_is_written(tiny, tmp_path, case):
    """distill.teacher_dir: a missing folder, one without weights, one with another tokenizer: one line, exit
    status 2 on the rank, nothing written (a fixed rerun is not refused as "already holds a run")."""
    import json
    import shutil

    from helpers.distill_models import write_teacher

    data, _ = tiny
    teacher = str(tmp_path / "teacher")
    if case != "missing":
        write_teacher(teacher)
    if case == "no-weights":
        for f in glob.glob(os.path.join(teacher, "*.safetensors")):
            os.remove(f)
    if case == "other-tokenizer":
        path = os.path.join(teacher, "tokenizer.json")
        tok = json.load(open(path))
        vocab = tok["model"]["vocab"]
        a, b = sorted(vocab, key=vocab.get)[5:7]
        vocab[a], vocab[b] = vocab[b], vocab[a]
        with open(path, "w") as f:
            json.dump(tok, f)
    out = str(tmp_path / "run")
    log = failing(
        data, out, f"distill={{teacher_dir: {teacher}, reward_weight: 1.0}}", "loss.variant=gspo_token", "steps=1"
    )
    kind, what = one_error(log)
    assert kind == "distill" and what.startswith(f"distill.teacher_dir={teacher}"), what
    assert {"missing": "config.json", "no-weights": "safetensors", "other-tokenizer": "tokenizer"}[case] in what
    assert "exitcode  : 2" in log or "exitcode : 2" in log, log[-3000:]
    assert os.listdir(out) == [n for n in os.listdir(out) if n.endswith(".log")]
    shutil.rmtree(teacher, ignore_errors=True)


def test_resume_after_the_data_changed_is_refused_naming_the_file(tmp_path):
    """The checkpoint records each data file's size and sha256; a resume whose file at the same path has other
    content (here the same rows in another order: same size) is refused naming it, before anything is written,
    unless allow_data_change=true."""
    import json

    from examples.tiny.task import prepare

    data = str(tmp_path / "inputs")
    prepare(data, num_prompts=32)
    run = str(tmp_path / "run")
    run_tiny(data, run, "steps=1", "checkpoint.save_every=1")  # full batch: an update, so Adam has state to resume
    state = json.load(open(os.path.join(run, "checkpoints", "step_0", "trainer_state.json")))
    prompts = os.path.join(data, "prompts.jsonl")
    recorded = state["extra"]["data_files"]["data.paths[0]"]
    assert recorded["path"] == prompts and recorded["size"] == os.path.getsize(prompts)
    with open(prompts) as f:
        lines = f.readlines()
    with open(prompts, "w") as f:
        f.writelines(reversed(lines))
    before = fingerprint(run)
    kind, what = one_error(run_tiny(data, run, "steps=2", "checkpoint.resume=true", check=False, timeout=300))
    assert kind == "data" and f"data.paths[0]: {prompts} changed since the checkpoint" in what, what
    assert "allow_data_change=true" in what
    assert fingerprint(run) == before
    log = run_tiny(data, run, "steps=1", "checkpoint.resume=true", "allow_data_change=true")
    assert f"allow_data_change=true: data.paths[0]: {prompts} changed since the checkpoint" in log, log[-3000:]
