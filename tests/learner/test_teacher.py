"""The in-process distillation teacher (gspo_mcore.learner.teacher): a real tiny Hugging Face model built as
the learner's forward-only second Megatron model. Its log-probs on gloo TP2 equal 1 rank's and transformers'
own, it holds no gradient state, and a teacher the layout cannot split is refused with the reason."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.distill_models import hf_logprobs, write_teacher
from helpers.launch import run_ranks


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return write_teacher(str(tmp_path_factory.mktemp("teacher")), seed=3)


def _run(teacher_dir, tmp_path, nproc, cases):
    out = tmp_path / f"out{nproc}.jsonl"
    run_ranks(
        "learner/teacher_worker.py",
        nproc,
        ["--teacher", teacher_dir, "--out", str(out), "--cases", json.dumps(cases)],
        timeout=300,
    )
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.distributed
def test_teacher_logprobs_tp2_pp2_equal_one_rank_and_transformers(teacher_dir, tmp_path):
    (one,) = _run(teacher_dir, tmp_path, 1, [{"tp": 1}])
    tp2, pp2 = _run(teacher_dir, tmp_path, 2, [{"tp": 2}, {"pp": 2}])
    ref = hf_logprobs(teacher_dir, one["tokens"])
    worst_layout = worst_hf = 0.0
    for a, b, c, r in zip(one["logprobs"], tp2["logprobs"], pp2["logprobs"], ref):
        a, b, c = (torch.tensor(x, dtype=torch.float64) for x in (a, b, c))
        worst_layout = max(worst_layout, float((a - b).abs().max()), float((a - c).abs().max()))
        worst_hf = max(worst_hf, float((a - r).abs().max()))
    # fp32 models: TP2 splits the vocabulary's softmax and the matmuls' sums (measured 5.5e-6); PP2 (2 stages
    # of 1 layer) measured equal to 1 rank exactly
    assert worst_layout < 2e-5, worst_layout
    # the weights were loaded (without the load: 9.2 nats off): fp32 vs transformers' fp64, measured 4.1e-6
    assert worst_hf < 5e-5, worst_hf
    # a real, non-uniform teacher: log(1/64) = -4.16 would be the uniform one
    assert max(abs(x + 4.1589) for lp in one["logprobs"] for x in lp) > 0.5
    for r in (one, tp2, pp2):
        assert not r["requires_grad"] and r["grad_buffers"] == 0


def test_teacher_that_the_layout_cannot_split_is_refused(tmp_path):
    from gspo_mcore.learner.parallel import ParallelConfig
    from gspo_mcore.learner.teacher import check_teacher_fits

    d = tmp_path / "t"
    d.mkdir()
    from examples.tiny.task import model_config

    (d / "config.json").write_text(json.dumps(model_config() | {"num_attention_heads": 3, "num_key_value_heads": 1}))
    with pytest.raises(
        ValueError,
        match=r"distill.teacher_dir=.*does not fit the learner's layout.*TP=2 does not divide "
        r"num_attention_heads=3",
    ):
        check_teacher_fits(str(d), ParallelConfig(tensor=2), 2, where="distill.teacher_dir", on_gpu=False)
    check_teacher_fits(str(d), ParallelConfig(tensor=1), 2, where="distill.teacher_dir", on_gpu=False)  # DP2 fits
    (d / "config.json").write_text(json.dumps(model_config() | {"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"distill.teacher_dir=.*unsupported architecture GPT2LMHeadModel"):
        check_teacher_fits(str(d), ParallelConfig(), 1, where="distill.teacher_dir", on_gpu=False)
