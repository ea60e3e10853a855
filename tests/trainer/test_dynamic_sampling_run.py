"""Dynamic sampling end to end: the tiny job (2 gloo ranks, in-process engine) with
``rollout.dynamic_sampling``, then the same job resumed from the checkpoint of step 1.

Settings that make refills happen from the random start: groups of 2 and at most 4 new tokens, so most
groups score two equal (mostly zero) rewards. The resumed run must repeat step 2 exactly: the loader's
position after step 1 is in the checkpoint and the rounds' seeds derive from ``(seed, step, round)``, so it
draws the same prompts, in the same rounds, as the uninterrupted run.
"""

import shutil

import pytest
from helpers.checkpoint_launch import metrics, run_tiny

pytestmark = pytest.mark.distributed

TARGET, ROUNDS = 4, 3
ARGS = (
    "steps=3",
    "checkpoint.save_every=1",
    f"rollout.prompts_per_step={TARGET}",
    "rollout.group_size=2",
    "rollout.sampling.max_new_tokens=4",
    "batch.num_minibatches=1",
    "rollout.dynamic_sampling=true",
    f"rollout.max_sampling_rounds={ROUNDS}",
)


def comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time_") and not k.endswith("_per_s")} for r in rows]


def test_dynamic_sampling_refills_reports_and_resumes_the_same_prompt_stream(tmp_path):
    from examples.tiny.task import prepare

    data = str(tmp_path / "data")
    prepare(data, num_prompts=128)
    out = str(tmp_path / "run")
    log = run_tiny(data, out, *ARGS)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2], log[-4000:]
    for r in rows:
        assert 1 <= r["sampling_rounds"] <= ROUNDS
        assert r["groups_generated"] == TARGET * r["sampling_rounds"]
        assert r["groups_used"] + r["sampling_groups_short"] == TARGET
        assert r["sampling_groups_short"] == 0 or r["sampling_rounds"] == ROUNDS  # short only at the bound
    assert any(r["sampling_rounds"] > 1 for r in rows)  # refills happened

    resumed = str(tmp_path / "resumed")
    shutil.copytree(out, resumed)
    shutil.rmtree(f"{resumed}/checkpoints/step_2")
    log = run_tiny(data, resumed, *ARGS, "checkpoint.resume=true")
    assert "(step 1)" in log and "resumed from" in log, log[-4000:]
    assert comparable(metrics(resumed)) == comparable(rows)
