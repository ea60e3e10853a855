"""The tiny job with LoRA through the real loop (gspo_mcore.learner.lora, issue 39), on 2 ranks at TP2, with the
KL reference (its weight swap covers the adapters), a checkpoint every step, and a base loaded from Hugging Face
weights (``model.load_hf_weights``: random ones written into the tiny model's folder):

- a run stopped after 2 steps and resumed to 3 gives the uninterrupted run's step 2;
- its checkpoints hold the adapters and their optimizer state only: no base tensor, and far fewer bytes than the
  base's weights with Adam's two moments (the resume rebuilt the base from ``model.hf_dir``);
- the converter writes merged weights (a frozen tensor unchanged between steps 0 and 2, every adapted projection
  moved, no adapter tensor in the folder);
- the converter's PEFT format (``--lora-format peft``) writes PEFT's names and config, and applying its ``A``/``B``
  to the base's weights in pure torch (``W + (lora_alpha/r) B A``) gives the merged export; with the ``peft``
  library, ``PeftModel`` on the base gives the merged model's logits (skipped when ``peft`` is not installed,
  failed under ``CI=true``);
- a full fine-tuning run may not resume from the LoRA checkpoint (refused at start-up, naming the keys)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from helpers import ROOT
from helpers.launch import prepare_tiny, torchrun
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.distributed

RANK, ALPHA = 4, 8.0
LORA = ["parallel.tensor=2", f"lora.rank={RANK}", f"lora.alpha={ALPHA}", "model.load_hf_weights=true"]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MERGE_ATOL = 1e-6
"""Pure-torch ``W + (alpha/r) B A`` from the PEFT export vs the merged export (both float32)."""
PEFT_LOGITS_ATOL = 1e-5
"""transformers + peft logits vs the merged model's (float32, another summation order)."""


def _run(tmp_path, out, *extra, nproc=2):
    cmd = [
        *(torchrun(nproc) if nproc > 1 else [sys.executable]),
        "-m",
        "gspo_mcore.train",
        "--config",
        "examples/tiny/config.yaml",
        f"model.hf_dir={tmp_path}/model",
        f"data.paths=[{tmp_path}/prompts.jsonl]",
        f"log.output_dir={out}",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "log.progress_bar=false",
        "checkpoint.save_every=1",
        "loss.kl_coef=0.01",
        *extra,
    ]
    return subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1")
    )


def _convert(step_dir, out, *extra):
    proc = subprocess.run(
        [sys.executable, "tools/convert_mcore_to_hf.py", "--mcore", str(step_dir), "--out", str(out), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _write_base_weights(model_dir):
    """Random Hugging Face weights for the tiny model (transformers' own initialisation), as ``model.safetensors``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(model_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The runs (straight to 3 steps; 2 steps then resumed to 3) and the exports of the straight run's steps."""
    tmp_path = tmp_path_factory.mktemp("lora_run")
    prepare_tiny(tmp_path, 32)
    _write_base_weights(tmp_path / "model")
    straight = _run(tmp_path, tmp_path / "a", "steps=3", "checkpoint.keep_last=3", *LORA)
    assert straight.returncode == 0, straight.stderr[-6000:]
    first = _run(tmp_path, tmp_path / "b", "steps=2", *LORA)
    assert first.returncode == 0, first.stderr[-6000:]
    resumed = _run(tmp_path, tmp_path / "b", "steps=3", "checkpoint.resume=true", *LORA)
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    merged = {step: _convert(tmp_path / f"a/checkpoints/step_{step}", tmp_path / f"export{step}") for step in (0, 2)}
    peft = tmp_path / "peft2"
    _convert(tmp_path / "a/checkpoints/step_2", peft, "--lora-format", "peft")
    return dict(tmp=tmp_path, merged=merged, peft=peft)


def test_a_resumed_lora_run_equals_the_uninterrupted_one(job):
    tmp_path = job["tmp"]
    a, b = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert [r["step"] for r in a] == [0, 1, 2] and [r["step"] for r in b] == [0, 1, 2]
    for key in ("reward_mean", "loss", "grad_norm", "kl"):
        if key in a[2]:
            assert b[2][key] == pytest.approx(a[2][key], rel=1e-6, abs=1e-9), key
    assert any(r.get("grad_norm", 0) > 0 for r in a), "no update happened: the test would prove nothing"


def test_lora_checkpoints_hold_the_adapters_only(job):
    from torch.distributed.checkpoint import FileSystemReader

    tmp_path = job["tmp"]
    step = tmp_path / "b/checkpoints/step_1"  # the one the resume loaded
    assert json.loads((step / "trainer_state.json").read_text())["model"] == "adapters"
    saved = FileSystemReader(str(step / "megatron")).read_metadata().state_dict_metadata
    keys = sorted(saved)
    assert keys and all(k.endswith((".lora_A", ".lora_B")) for k in keys), [k for k in keys if "lora" not in k][:5]
    assert any(k.startswith("optimizer.state.exp_avg.") for k in keys), "the adapters' Adam state must be saved"
    # a full fine-tuning checkpoint holds the fp32 weights and Adam's two moments: 3x the base's weights (332 kB
    # here). The tiny model's rank-4 adapters are 9% of its parameters: 80 kB of tensors with their moments
    # (0.08 of a full one), 245 kB of files with the per-tensor overhead of dist_checkpointing (0.25)
    full_bytes = 3 * (tmp_path / "model/model.safetensors").stat().st_size
    tensor_bytes = sum(math.prod(m.size) * m.properties.dtype.itemsize for m in saved.values())
    file_bytes = sum(f.stat().st_size for f in (step / "megatron").rglob("*") if f.is_file())
    assert tensor_bytes < 0.12 * full_bytes and file_bytes < 0.4 * full_bytes, (tensor_bytes, file_bytes, full_bytes)


def test_the_converter_writes_merged_weights(job):
    exported = job["merged"]
    assert set(exported[0]) == set(exported[2]) and not any("lora" in k for k in exported[0])
    for name, before in exported[0].items():
        same = bool((before == exported[2][name]).all())
        adapted = name.endswith(("_proj.weight",))
        assert same != adapted, (name, "adapted" if adapted else "frozen", "unchanged" if same else "changed")


def test_the_peft_export_applied_in_pure_torch_equals_the_merged_export(job):
    tmp_path, peft = job["tmp"], job["peft"]
    config = json.loads((peft / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == RANK and config["lora_alpha"] == ALPHA
    assert config["lora_dropout"] == 0.0 and sorted(config["target_modules"]) == sorted(PROJECTIONS)
    assert config["base_model_name_or_path"] == str(tmp_path / "model")
    tensors = load_file(str(peft / "adapter_model.safetensors"))
    base = load_file(str(tmp_path / "model/model.safetensors"))
    merged = job["merged"][2]
    expected = {
        f"base_model.model.model.layers.{i}.{part}.{proj}.lora_{ab}.weight"
        for i in range(2)
        for proj in PROJECTIONS
        for part in ["self_attn" if proj in PROJECTIONS[:4] else "mlp"]
        for ab in "AB"
    }
    assert set(tensors) == expected
    for i in range(2):
        for proj in PROJECTIONS:
            name = f"model.layers.{i}.{'self_attn' if proj in PROJECTIONS[:4] else 'mlp'}.{proj}"
            a, b = tensors[f"base_model.model.{name}.lora_A.weight"], tensors[f"base_model.model.{name}.lora_B.weight"]
            assert a.shape[0] == RANK and b.shape[1] == RANK
            w = base[f"{name}.weight"] + (ALPHA / RANK) * b @ a
            assert float((w - merged[f"{name}.weight"]).abs().max()) <= MERGE_ATOL, name
            assert float((b @ a).abs().max()) > 1e-4, (name, "the adapter did not move: the check would be empty")


def test_peft_loads_the_export_with_the_merged_models_logits(job):
    if importlib.util.find_spec("peft") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("the peft package is not installed (CI=true: the PEFT export check must run)")
        pytest.skip("the peft package is not installed: the PEFT library check of the export needs it")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tmp_path = job["tmp"]
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"), dtype=torch.float32).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export2"), dtype=torch.float32).eval()
    ids = torch.randint(3, base.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, before = merged(input_ids=ids).logits, base(input_ids=ids).logits
        with_adapter = PeftModel.from_pretrained(base, str(job["peft"])).eval()  # wraps base's modules in place
        got = with_adapter(input_ids=ids).logits
    assert float((want - before).abs().max()) > 1e-4, "the adapters change nothing: the check would be empty"
    assert float((got - want).abs().max()) <= PEFT_LOGITS_ATOL


def test_a_full_fine_tuning_resume_from_a_lora_checkpoint_is_refused(job):
    tmp_path = job["tmp"]
    full = _run(tmp_path, tmp_path / "b", "steps=4", "checkpoint.resume=true", "model.load_hf_weights=true", nproc=1)
    assert full.returncode != 0
    assert "was written by a LoRA (lora.rank=4" in full.stdout + full.stderr
    assert "this run is full fine-tuning (lora.rank=0)" in full.stdout + full.stderr
