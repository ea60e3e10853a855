"""Kill -9 the tiny GSPO job (2 gloo ranks) while a step runs and while it saves, resume it, and compare
every step's metrics with an uninterrupted run: they must be EXACTLY equal.

Why exact equality holds. A checkpoint holds the bits of the model parameters, the optimizer state
(Adam moments and step counts, also when sharded by the distributed optimizer), the LR-schedule
position, the data sampler's position and the engine's weight version. Nothing else carries state
from one step to the next: the rollout seeds derive from ``(seed, step)``, the sampler's epoch order from
``(seed, epoch)``, the rewards are pure functions of the responses, and the reward runner's counters are
reset every step. On the CPU (fp32, fixed thread count, same 2-rank layout, gloo's fixed reduction
order) the same inputs give the same bits, so the resumed steps repeat the uninterrupted run's
floating-point operations one for one. A loss that differed in the last bit would expose lost state.

The job uses the distributed optimizer (its state is sharded over the two ranks).

Crash points: (a) an external SIGKILL of the launcher and both ranks during a step; (b) the test-only
hook ``GSPO_MCORE_TEST_CRASH_IN_SAVE=<step>:<point>`` kills rank 0 inside a save, after the shards are
written (``write``) and after the rename but before ``latest`` and the retention (``rename``); the
third point, after the manifest but before the rename, leaves a directory that is never a checkpoint by
name (test_checkpoint_files). Also: a truncated and a corrupted checkpoint are rejected with the reason
and the run falls back to the previous good one. One job, four launches: starting ranks costs far more
than the steps.
"""

from __future__ import annotations

import glob
import os
import time

import pytest
from helpers.checkpoint_launch import DISTOPT, STEPS, kill_tree, metrics, run_tiny, start_tiny

pytestmark = pytest.mark.distributed

RESUME = "checkpoint.resume=true"
CRASH = "GSPO_MCORE_TEST_CRASH_IN_SAVE"


def comparable(rows):
    """The per-step metrics without the wall-clock ones."""
    return [{k: v for k, v in r.items() if not k.startswith("time_") and not k.endswith("_per_s")} for r in rows]


def steps_saved(out):
    root = os.path.join(out, "checkpoints")
    return sorted(int(n.split("_")[1]) for n in os.listdir(root) if n.startswith("step_") and n[5:].isdigit())


def latest(out):
    with open(os.path.join(out, "checkpoints", "latest")) as f:
        return f.read().strip()


def test_reference_run_keeps_the_last_three_checkpoints(reference):
    assert steps_saved(reference["out"]) == [3, 4, 5]
    assert latest(reference["out"]) == "step_5"
    assert not glob.glob(os.path.join(reference["out"], "checkpoints", "*.tmp-*"))


def test_kill9_crashes_in_saves_and_damaged_checkpoints_then_resume_matches_the_uninterrupted_run(
    tiny_data, reference, tmp_path
):
    """Four launches of the same 6-step job (saving after every step, keeping 3), each resuming:
    1. SIGKILL of the launcher and both ranks while step 3 runs (step_0..2 saved);
    2. resumes from step_2; rank 0 killed in the save of step 3 after the shards are written (no manifest);
       then step_2 is truncated and step_1 corrupted (one flipped byte) on disk;
    3. rejects both with the reason, resumes from step_0; rank 0 killed in the save of step 4 after the
       rename (``latest`` and the retention not updated);
    4. resumes from step_4, the newest complete checkpoint (``latest`` still names step_3), runs step 5.
    The metrics file then holds steps 0-5, each equal to the uninterrupted run's (the killed runs' extra
    lines are dropped on resume)."""
    out = str(tmp_path / "run")
    root = os.path.join(out, "checkpoints")
    args = (f"steps={STEPS}", "checkpoint.save_every=1", "checkpoint.keep_last=3", DISTOPT)

    # 1. kill -9 during a step: once step_2 is complete (`latest` is written last), step 3 is running
    proc = start_tiny(tiny_data, out, *args)
    deadline = time.monotonic() + 150
    while not os.path.exists(os.path.join(root, "latest")) or latest(out) != "step_2":
        assert proc.poll() is None, f"the job ended before it could be killed:\n{open(proc.log_path).read()[-4000:]}"
        assert time.monotonic() < deadline, "the job did not save step 2 in time"
        time.sleep(0.01)
    kill_tree(proc)
    logged, saved = len(metrics(out)), steps_saved(out)
    assert logged == 3 and saved == [0, 1, 2], f"not killed during step 3 (logged {logged} steps, saved {saved})"

    # 2. killed in a save, shards written, no manifest: the leftover is not a checkpoint
    log = run_tiny(tiny_data, out, *args, RESUME, env={CRASH: "3:write"}, check=False)
    assert "resumed from " + os.path.join(root, "step_2") in log, log[-4000:]
    assert "killing rank 0 during the save of step 3" in log, log[-4000:]
    assert steps_saved(out) == [0, 1, 2] and latest(out) == "step_2"
    [tmp] = glob.glob(os.path.join(root, "step_3.tmp-*"))
    assert os.listdir(os.path.join(tmp, "megatron")) and not os.path.exists(os.path.join(tmp, "manifest.json"))
    with open(os.path.join(root, "step_2", "megatron", "__0_0.distcp"), "r+b") as f:
        f.truncate(100)
    corrupted = os.path.join(root, "step_1", "megatron", "__1_0.distcp")
    with open(corrupted, "r+b") as f:
        f.seek(os.path.getsize(corrupted) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))

    # 3. both damaged checkpoints rejected with the reason; killed after the rename of step_4
    log = run_tiny(tiny_data, out, *args, RESUME, env={CRASH: "4:rename"}, check=False)
    assert f"removing {tmp}" in log, log[-4000:]
    assert "step_2, it is not valid" in log and "megatron/__0_0.distcp truncated" in log, log[-4000:]
    assert "step_1, it is not valid" in log and "megatron/__1_0.distcp corrupted (sha256 mismatch)" in log, log[-4000:]
    assert "resumed from " + os.path.join(root, "step_0") in log, log[-4000:]
    assert len(glob.glob(os.path.join(root, "step_[12].rejected-*"))) == 2  # kept aside for inspection
    assert steps_saved(out) == [1, 2, 3, 4] and latest(out) == "step_3"

    # 4. to the end, from the newest complete checkpoint (not `latest`)
    log = run_tiny(tiny_data, out, *args, RESUME)
    assert "resumed from " + os.path.join(root, "step_4") in log, log[-4000:]
    assert steps_saved(out) == [3, 4, 5] and latest(out) == "step_5"
    assert not glob.glob(os.path.join(root, "*.tmp-*"))
    assert comparable(metrics(out)) == comparable(reference["metrics"])
