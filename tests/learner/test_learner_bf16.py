"""bf16 on a CPU with native bf16 (``model.options.cpu_bf16``): Megatron's mixed precision on the toy models, one
update against fp32, bounded by torch's own bf16 (autocast) error on the same step (see bf16_worker.py), on 1
rank and DP2, and a checkpoint round trip; the option refused, naming the key, on a CPU without native bf16."""

from __future__ import annotations

import json

import pytest
from helpers.launch import run_ranks

from gspo_mcore.platform import cpu_features

needs_bf16 = pytest.mark.skipif(
    not cpu_features.native_bf16(), reason="this CPU has no native bf16 (AVX512_BF16 / AMX-BF16)"
)

# Megatron's bf16 against fp32 may differ from torch's autocast against fp32 by this factor at most: both round the
# matmul inputs to bf16, Megatron also keeps the activations between matmuls (and the weights' forward copy) in
# bf16. Measured (dense, 1 rank): log-probs 1.01x, gradients 1.4x.
GAP_FACTOR = 4.0


def _run(tmp_path, nproc, cases):
    out = tmp_path / "results.jsonl"
    run_ranks(
        "learner/bf16_worker.py",
        nproc,
        ["--out", str(out), "--ckpt", str(tmp_path / "ckpt"), "--cases", json.dumps(cases)],
        timeout=900,
    )
    return {r["case"]: r for r in map(json.loads, out.read_text().splitlines())}


def _check_update(r):
    name = r["case"]
    # what is bf16 and what is fp32
    assert r["param_dtypes"] == ["bfloat16"], (name, r["fp32_params"])
    assert r["master_dtypes"] == ["torch.float32"], name
    assert r["optimizer_param_dtypes"] == ["torch.float32"], name
    assert r["optimizer_grad_dtypes"] == ["torch.float32"], name
    assert r["optimizer_state_dtypes"] == ["torch.float32"], name
    assert r["logp_dtypes"] == ["torch.float32"], name
    # bf16 really ran (a gap) and autocast really ran (its own gap), and Megatron's gap is torch's size
    assert r["logp_gap_autocast"] > 1e-4 and r["grad_gap_autocast"] > 0, r
    assert 0 < r["logp_gap_bf16"] <= GAP_FACTOR * r["logp_gap_autocast"], r
    assert 0 < r["grad_gap_bf16"] <= GAP_FACTOR * r["grad_gap_autocast"], r
    assert r["grad_gap_bf16"] <= 0.05 * r["grad_scale"], r
    assert r["grad_norm_gap_bf16"] <= 0.01 * r["grad_norm"], r
    assert r["loss_gap_bf16"] <= 10 * r["logp_gap_bf16"], r
    # the update: Adam on fp32 masters, to fp32 accuracy (bf16 masters would be off by bf16_master_err)
    assert r["update_successful"] == 1.0, r
    assert r["moved"] > 0.5 * r["lr"], r
    assert r["update_err"] <= 1e-6 < r["bf16_master_err"] / 10, r
    assert r["model_vs_master"] == 0.0, r  # the bf16 weights are the masters rounded
    assert r["dp_master_spread"] == 0.0, r  # every DP rank holds the same masters


def _check_checkpoint(r):
    assert r["resumed_step"] == 1 and r["second_update_changed"], r
    assert r["masters_restored"] and r["model_restored"] and r["adam_restored"], r
    assert r["restored_master_dtypes"] == ["torch.float32"], r


@pytest.mark.distributed
@needs_bf16
def test_bf16_one_rank(tmp_path):
    cases = [
        {"name": "dense", "model": "dense", "checkpoint": True},
        {"name": "llama", "model": "llama"},
        {"name": "moe", "model": "moe"},
    ]
    results = _run(tmp_path, 1, cases)
    for r in results.values():
        _check_update(r)
    _check_checkpoint(results["dense"])


@pytest.mark.distributed
@needs_bf16
def test_bf16_dp2(tmp_path):
    r = _run(tmp_path, 2, [{"name": "dense-dp2", "model": "dense", "checkpoint": True}])["dense-dp2"]
    assert r["world"] == 2
    _check_update(r)
    _check_checkpoint(r)


def test_cpu_bf16_refused_without_native_bf16(monkeypatch):
    import torch

    from gspo_mcore.learner.model import ModelOptions

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cpu_features, "native_bf16", lambda: ())
    with pytest.raises(ValueError, match=r"model\.options\.cpu_bf16"):
        ModelOptions(cpu_bf16=True)
    assert not ModelOptions().bf16()
    monkeypatch.setattr(cpu_features, "native_bf16", lambda: ("avx512_bf16",))
    assert ModelOptions(cpu_bf16=True).bf16()


def test_cpu_bf16_auto_follows_the_cpu(monkeypatch):
    import torch

    from gspo_mcore.config import ConfigError, from_dict
    from gspo_mcore.learner.model import ModelOptions

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cpu_features, "native_bf16", lambda: ())
    assert not ModelOptions(cpu_bf16="auto").bf16()  # accepted, and fp32, where the CPU lacks bf16
    monkeypatch.setattr(cpu_features, "native_bf16", lambda: ("amx_bf16",))
    assert ModelOptions(cpu_bf16="auto").bf16()
    assert from_dict(ModelOptions, {"cpu_bf16": "auto"}).cpu_bf16 == "auto"
    with pytest.raises(ConfigError, match=r"cpu_bf16"):
        from_dict(ModelOptions, {"cpu_bf16": "yes"}, "model.options")
    with pytest.raises(ValueError, match=r"model\.options\.cpu_bf16 must be true, false or auto"):
        ModelOptions(cpu_bf16="on")


def test_native_bf16_reads_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    assert cpu_features.native_bf16() == ()
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16", "amx_bf16"}))
    assert cpu_features.native_bf16() == ("amx_bf16", "avx512_bf16")
