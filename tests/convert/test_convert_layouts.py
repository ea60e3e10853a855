"""Converted weights on 2-rank layouts (TP2, PP2, EP2, and the unsharded DP2), one launch for all cases:
Qwen3, Qwen3-MoE, Llama and Qwen2, each with and without tied embeddings.

What each test checks, and why it is exact or bounded:
- The gather of a layout-independently initialised model (every global tensor drawn from its own seed,
  each rank copying its slice as Megatron's ``sharded_state_dict`` places it) is the same on every
  layout as on the unsharded model: gathering only moves bytes, so equality is bit-exact.
- HF -> Megatron (any layout) -> HF gives back every checkpoint tensor bit for bit (slicing and gathering
  move bytes only), under exactly the checkpoint's names, in buckets identical on both ranks.
- The converted model's logits equal transformers' within float32 rounding: both compute the same function
  with different kernels and summation orders (fused QKV, vocabulary-parallel output, MoE dispatch),
  so they differ by rounding only: measured 1.3e-6 to 3.4e-6 (dense TP2; up to ~14 ulps) for logits up to
  3.7 (1 ulp at 2-4 is 2.4e-7; AMD EPYC, AVX2). The bound, 7e-6, is 2x the worst measured case and far
  below what a subtle mapping slip does (an RMSNorm epsilon of 1e-5 instead of 1e-6 moves these logits by
  1.5e-3; a q/k/v interleave error by 4).
- A distributed checkpoint saved on one layout and loaded on another gathers back to the checkpoint.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from convert_models import HERE, digest, run, torchrun
from safetensors import safe_open

pytestmark = pytest.mark.distributed

LOGITS_ATOL = 7e-6
"""Bound on max |Megatron - transformers| over all logits (float32; logits here are of order 1-4)."""

# (model, layout, extra): saves go before the loads that use them; dp2 = the unsharded model on each rank.
CASES = [
    ("dense", "tp2", dict(tp=2, save=True)),
    ("dense", "pp2", dict(pp=2, load="dense-tp2", save=True)),
    ("dense", "dp2", dict(load="dense-pp2", bf16=True)),
    ("dense_tied", "tp2", dict(tp=2, save=True)),
    ("dense_tied", "pp2", dict(pp=2, load="dense_tied-tp2")),
    ("dense_tied", "dp2", dict()),
    ("moe", "ep2", dict(ep=2, save=True)),
    ("moe", "pp2", dict(pp=2, load="moe-ep2", save=True)),
    ("moe", "dp2", dict(load="moe-pp2", bf16=True)),
    ("moe_tied", "ep2", dict(ep=2, save=True)),
    ("moe_tied", "pp2", dict(pp=2, load="moe_tied-ep2")),
    ("moe_tied", "dp2", dict()),
    ("llama", "tp2", dict(tp=2, save=True)),
    ("llama", "pp2", dict(pp=2, load="llama-tp2")),
    ("llama", "dp2", dict(bf16=True)),
    ("llama_tied", "tp2", dict(tp=2, save=True)),
    ("llama_tied", "dp2", dict(load="llama_tied-tp2")),
    ("qwen2", "tp2", dict(tp=2, save=True)),
    ("qwen2", "pp2", dict(pp=2, load="qwen2-tp2")),
    ("qwen2", "dp2", dict()),
    ("qwen2_tied", "tp2", dict(tp=2)),
    ("qwen2_tied", "dp2", dict()),
]
IDS = [f"{m}-{lay}" for m, lay, _ in CASES]


@pytest.fixture(scope="module")
def results(hf_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    cases = [dict(name=f"{m}-{lay}", model=m, layout=lay, hf=hf_models[m], **extra) for m, lay, extra in CASES]
    out = str(root / "results.jsonl")
    run(
        torchrun(
            os.path.join(HERE, "convert_worker.py"),
            2,
            ["--cases", json.dumps(cases), "--ckpt-root", str(root), "--out", out],
        ),
        timeout=480,
        what="convert_worker.py on 2 ranks",
    )
    with open(out) as f:
        return {r["case"]: r for r in map(json.loads, f)}


def checkpoint_digests(path: str, dtype=None) -> dict[str, str]:
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        return {k: digest(f.get_tensor(k) if dtype is None else f.get_tensor(k).to(dtype)) for k in f.keys()}


def mismatches(got: dict[str, str], want: dict[str, str]) -> dict:
    return dict(
        missing=sorted(set(want) - set(got)),
        extra=sorted(set(got) - set(want)),
        different=sorted(k for k in set(got) & set(want) if got[k] != want[k]),
    )


NO_MISMATCH = dict(missing=[], extra=[], different=[])


@pytest.mark.parametrize("model,layout", [c[:2] for c in CASES], ids=IDS)
def test_logits_match_transformers(results, model, layout, logits_report):
    r = results[f"{model}-{layout}"]
    logits_report(model, layout, r["logits_max_abs_diff"], r["logits_max_abs"])
    assert r["logits_max_abs"] > 1.0  # the comparison is not between near-zero logits
    assert r["logits_max_abs_diff"] < LOGITS_ATOL


@pytest.mark.parametrize("model,layout", [c[:2] for c in CASES], ids=IDS)
def test_gather_equals_unsharded_model(results, model, layout):
    """Same random weights (layout-independent init) gathered on this layout and on the unsharded model."""
    unsharded = results[f"{model}-dp2"]["seed_digests"]
    assert mismatches(results[f"{model}-{layout}"]["seed_digests"], unsharded) == NO_MISMATCH


@pytest.mark.parametrize("model,layout", [c[:2] for c in CASES], ids=IDS)
def test_round_trip_is_bit_exact(results, hf_models, model, layout):
    """HF checkpoint -> this layout -> gather: every tensor, bit for bit, under the checkpoint's names
    (the names transformers' save_pretrained writes and SGLang loads)."""
    r = results[f"{model}-{layout}"]
    assert mismatches(r["import_digests"], checkpoint_digests(hf_models[model])) == NO_MISMATCH


@pytest.mark.parametrize("model,layout", [c[:2] for c in CASES], ids=IDS)
def test_buckets_identical_on_every_rank(results, model, layout):
    b = results[f"{model}-{layout}"]["buckets"]
    assert b["identical_on_all_ranks"]
    assert b["num_buckets"] > 2 and b["over_budget"] == []


@pytest.mark.parametrize("case", [f"{m}-{lay}" for m, lay, extra in CASES if "load" in extra])
def test_checkpoint_reloads_on_another_layout(results, hf_models, case):
    r = results[case]
    assert r["reloaded_from"].split("-")[1] != r["layout"]
    assert mismatches(r["reload_digests"], checkpoint_digests(hf_models[r["model"]])) == NO_MISMATCH


@pytest.mark.parametrize("case", [f"{m}-{lay}" for m, lay, extra in CASES if extra.get("bf16")])
def test_gather_casts_to_the_requested_dtype(results, hf_models, case):
    r = results[case]
    want = checkpoint_digests(hf_models[r["model"]], dtype=torch.bfloat16)
    assert mismatches(r["bf16_digests"], want) == NO_MISMATCH
