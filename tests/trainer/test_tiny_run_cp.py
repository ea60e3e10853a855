"""The trainer with context parallelism: the tiny job with ``parallel.context: 2`` on 2 CPU ranks (the CPU CP
attention; the in-process engine decodes whole sequences on every CP rank) equals the same job on 1 rank.

Both runs have one data-parallel rank, so they sample the same prompts with the same seeds; the CP run's
learner splits every sample over the 2 ranks (load-balanced layout) and reduces the per-sequence sums over
them. Rewards (from the sampled tokens) must be identical, losses and gradient norms equal to fp32 rounding.
"""

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT
from helpers.launch import prepare_tiny, torchrun


def _run(tmp_path, name, nproc, extra):
    out = tmp_path / name
    launch = [sys.executable] if nproc == 1 else torchrun(nproc)
    cmd = launch + [
        "-m",
        "gspo_mcore.train",
        "--config",
        "examples/tiny/config.yaml",
        "steps=2",
        f"model.hf_dir={tmp_path}/model",
        f"data.paths=[{tmp_path}/prompts.jsonl]",
        f"log.output_dir={out}",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "batch.num_minibatches=2",
        # the demo drops groups with equal rewards: with 4 groups a step can keep none and make no update,
        # and this test compares the updates
        "rollout.drop_zero_advantage_groups=false",
        "log.progress_bar=false",
        "log.tensorboard=false",
        *extra,
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.distributed
def test_tiny_job_with_context_parallel_2_equals_one_rank(tmp_path):
    prepare_tiny(tmp_path, 16)
    one = _run(tmp_path, "one", 1, [])
    cp = _run(tmp_path, "cp2", 2, ["parallel.context=2"])
    assert [r["step"] for r in cp] == [r["step"] for r in one] == [0, 1]
    for a, b in zip(one, cp):
        assert b["reward_mean"] == a["reward_mean"] and b["response_length_mean"] == a["response_length_mean"]
        for key in ("loss", "grad_norm", "ratio_mean", "entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (key, a[key], b[key])
        assert b["logprob_mismatch"] < 7.5e-7  # engine (whole sequences) vs learner (CP-split): same model


def test_context_parallel_refuses_block_diagonal_packing_and_routing_replay():
    from gspo_mcore.train import parse_config

    base = ["--config", "examples/tiny/config.yaml", "parallel.context=2"]
    with pytest.raises(ValueError, match="parallel.context=2 needs batch.packing=padded"):
        parse_config(base + ["batch.packing=block_diagonal"])
    for key in ("routing.replay=true", "routing.measure_every=1"):
        with pytest.raises(ValueError, match="parallel.context=2 with routing.replay / routing.measure_every"):
            parse_config(base + [key])
