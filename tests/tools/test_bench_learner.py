"""tools/bench_learner.py: a tiny run end to end (a subprocess: it launches torch.distributed ranks) with a workload
of groups sharing a prompt, its table and JSON (tokens/s, the learner's GFLOP/s and the GEMM rates of the same run);
the pass-through learner options refused, naming the key, by a learner that lacks them. No timed assertions."""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from helpers.launch import run_tool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tool():
    spec = importlib.util.spec_from_file_location("bench_learner", os.path.join(ROOT, "tools", "bench_learner.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.distributed
def test_bench_learner_groups_sharing_a_prompt_report_tokens_flops_and_gemm_rates():
    proc = run_tool(
        ["tools/bench_learner.py", "--layouts", "1", "--samples", "8", "--group-size", "4"]
        + ["--prompt-len", "9", "--response-len", "5", "--steps", "1", "--warmup", "0", "--max-tokens", "64"]
        + ["--rope", "torch", "--split-linear", "off", "--grad-accumulation", "megatron"]
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "cpu_isa" in proc.stdout and "GEMM bf16" in proc.stdout
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(data["header"]) >= {"cpu", "cpu_isa", "threads"}
    [row] = data["rows"]
    # the launcher passed the options to the worker
    assert row["rope"] == "torch" and row["split_linear"] == "off" and row["grad_accumulation"] == "megatron"
    assert row["tokens"] == 8 * (9 + 5) and row["computed_tokens"] == row["tokens"]  # unshared: every prompt
    assert row["tokens_per_s"] > 0 and row["gflops_per_rank"] > 0
    # plain GEMMs in both dtypes, and bf16's faster of plain and row-split (gspo_mcore.ops.gemm.mm_rows)
    assert set(row["gemm_gflops"]) == {"fp32", "bf16", "bf16_best"}
    assert all(v > 0 for v in row["gemm_gflops"].values())
    assert row["gemm_fraction"] == pytest.approx(row["gflops_per_rank"] / row["gemm_gflops"]["fp32"])
    assert row["gemm_fraction_best"] is None  # an fp32 learner: the bf16 best does not apply


def test_model_flops_count_the_matmuls_of_each_token_forward_and_backward():
    tool = _tool()
    arch = SimpleNamespace(
        hidden_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        hidden_act="silu",
        num_experts=0,
        intermediate_size=16,
        vocab_size=32,
    )
    per_layer = 8 * (8 + 2 * 4) + 8 * 8 + 8 * 32 + 16 * 8  # qkv, proj, fc1 (gated: 2 x 16), fc2
    assert tool.model_flops(arch, 5) == 6 * 5 * (2 * per_layer + 8 * 32)


def test_workload_counts_a_shared_prompt_once_when_the_learner_shares_it():
    import torch

    tool = _tool()
    args = SimpleNamespace(samples=8, group_size=4, prompt_len=9, response_len=5, share_prompt="on", max_len=0)
    samples, computed = tool.make_samples(args, 50, torch.Generator().manual_seed(0))
    assert computed == 2 * 9 + 8 * 5
    assert all(torch.equal(s.tokens[:9], samples[0].tokens[:9]) for s in samples[:4])
    assert not torch.equal(samples[4].tokens[:9], samples[0].tokens[:9])
    assert all(int(s.loss_mask.sum()) == 5 and int(s.loss_mask[:9].sum()) == 0 for s in samples)


def test_options_the_learner_lacks_are_refused_naming_the_key(monkeypatch):
    import gspo_mcore.learner.model as model
    import gspo_mcore.learner.step as step

    tool = _tool()

    @dataclasses.dataclass(frozen=True)
    class OldOptions:
        use_te: bool | None = None

    def old_forward_backward(model, samples, layout, loss_cfg, *, max_tokens, packing="padded"):
        return {}

    monkeypatch.setattr(model, "ModelOptions", OldOptions)
    monkeypatch.setattr(step, "forward_backward", old_forward_backward)
    with pytest.raises(SystemExit, match=r"--dtype bf16: the installed learner has no model.options.cpu_bf16"):
        tool.learner_options(SimpleNamespace(dtype="bf16", share_prompt=None))
    with pytest.raises(SystemExit, match=r"--share-prompt off: the installed learner has no batch.share_prompt"):
        tool.learner_options(SimpleNamespace(dtype="fp32", share_prompt="off"))
    assert tool.learner_options(SimpleNamespace(dtype="fp32", share_prompt=None)) == ({}, {})
    with pytest.raises(
        SystemExit, match=r"--attention megatron: the installed learner has no model.options.cpu_attention"
    ):
        tool.learner_options(SimpleNamespace(dtype="fp32", share_prompt=None, attention="megatron"))
    with pytest.raises(SystemExit, match=r"--rms-norm torch: the installed learner has no model.options.cpu_rms_norm"):
        tool.learner_options(SimpleNamespace(dtype="fp32", share_prompt=None, rms_norm="torch"))

    @dataclasses.dataclass(frozen=True)
    class NewOptions:
        cpu_bf16: bool = False
        cpu_attention: bool = True
        cpu_rms_norm: bool = True
        cpu_swiglu: bool = True

    def new_forward_backward(model, samples, layout, loss_cfg, *, max_tokens, packing="padded", share_prompt=False):
        return {}

    monkeypatch.setattr(model, "ModelOptions", NewOptions)
    monkeypatch.setattr(step, "forward_backward", new_forward_backward)
    args = SimpleNamespace(dtype="bf16", share_prompt="off", attention="megatron", rms_norm="torch", swiglu="torch")
    assert tool.learner_options(args) == (
        {"cpu_bf16": True, "cpu_attention": False, "cpu_rms_norm": False, "cpu_swiglu": False},
        {"share_prompt": False},
    )


def test_group_options_need_the_prompt_and_response_lengths():
    proc = subprocess.run(
        [sys.executable, "tools/bench_learner.py", "--group-size", "4"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2 and "--group-size needs --prompt-len and --response-len" in proc.stderr
