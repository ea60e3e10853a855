"""LoRA with a real SGLang 0.5.23 CPU server: the merged-weights path (issue 39, item 3).

SGLang 0.5.23 cannot serve LoRA adapters on a CPU (its LoRA layers pin memory, which needs a GPU driver;
docs/lora.md), so there the learner merges ``W + (alpha/r) B A`` and pushes the merged weights through the
ordinary weight sync (``rollout.sglang.lora_mode: merged``, the default). The tiny job trains rank-4 adapters
on every linear for 3 steps against the session's server, pushing after every step (``weight_sync`` disk, and
tensor: shared CPU tensors). With
``old_logprobs=recompute`` each step's ``logprob_mismatch`` (mean |SGLang log-prob - learner log-prob| over
the step's response tokens) stays at the parity level only if each step's rollout ran on the merged weights
of the step before. Control (disk): the last pushed folder differs from the base checkpoint in every adapted
projection (the adapters moved) and equals it bit for bit elsewhere (only the merge changed it).
"""

from __future__ import annotations

import json
import os
import types

import pytest
import torch
from sglang_cpu import LOGPROB_TOL, PYTHON, get_json
from test_real_gspo_run import STEPS, _run_tiny

pytestmark = pytest.mark.sglang

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["all-linear"], "init_seed": 7}
ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("weight_sync", ["disk", "tensor"])
def test_lora_run_syncs_merged_weights(weight_sync, server, tmp_path, figures):
    rows = _run_tiny(
        server,
        tmp_path,
        figures,
        f"tiny LoRA run (merged, {weight_sync}), {STEPS} steps (s)",
        weight_sync,
        overrides={"lora": LORA},
    )
    for r in rows:
        assert not r.get("update_skipped", False), r
        figures(f"tiny LoRA run (merged, {weight_sync}): logprob_mismatch, worst step", r["logprob_mismatch"])
        assert r["logprob_mismatch"] < LOGPROB_TOL, (r["step"], r["logprob_mismatch"])
    assert get_json(server.url + "/model_info")["weight_version"] == str(STEPS)
    if weight_sync != "disk":
        return

    # what the server was given: merged weights, different from the base exactly where adapters sit
    base, pushed = _tensors(server.base_dir), _tensors(str(tmp_path / "run" / "weights" / f"step_{STEPS}"))
    assert set(base) == set(pushed)
    changed = {name for name in base if not (base[name] == pushed[name]).all()}
    adapted = {name for name in base if name.endswith(".weight") and name.split(".")[-2] in ADAPTED}
    assert adapted and changed == adapted, sorted(changed ^ adapted)
    delta = max(float((pushed[n] - base[n]).abs().max()) for n in adapted)
    figures("tiny LoRA run (merged): max |merged - base| of the pushed weights", delta, worst=min)


NO_GPU = (
    "needs a CUDA GPU: SGLang 0.5.23 cannot serve LoRA adapters on a CPU (its LoRA layers pin memory, which needs a "
    "GPU driver), and the trainer refuses rollout.sglang.lora_mode: adapter there"
)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
@pytest.mark.parametrize("weight_sync", ["tensor", "disk"])
def test_lora_run_through_sglangs_adapter_path(weight_sync, tiny_ckpt, tmp_path, figures):
    """The tiny LoRA run with ``lora_mode: adapter``: the trainer launches a GPU server with LoRA enabled, pushes each
    step's adapter as a new version (``/load_lora_adapter_from_tensors``, or ``/load_lora_adapter`` from a PEFT
    folder) and samples with it. Every step's ``logprob_mismatch`` stays at the parity level (the adapter reached
    the server, and the requests named it), and the server ends at the last version, serving ``gspo-policy-v3``.
    Written without a GPU at hand (not yet run)."""
    launched = types.SimpleNamespace(base_dir=tiny_ckpt, url="", holds_base=False, log_tail=lambda lines=60: "")
    sglang = {
        "urls": [],
        "num_servers": 1,
        "python": PYTHON,
        "colocate": False,
        "weight_sync": weight_sync,
        "lora_mode": "adapter",
        "extra_args": ["--dtype", "float32", "--mem-fraction-static", "0.3"],
        "restart_attempts": 0,
    }
    rows = _run_tiny(
        launched,
        tmp_path,
        figures,
        f"tiny LoRA run (adapter, {weight_sync}), {STEPS} steps (s)",
        weight_sync,
        overrides={"lora": LORA, "rollout": {"sglang": sglang}, "model": {"options": {"use_te": False}}},
        nproc=1,  # one GPU: the learner's rank and the server share it
    )
    for r in rows:
        figures(f"tiny LoRA run (adapter, {weight_sync}): logprob_mismatch, worst step", r["logprob_mismatch"])
        assert r["logprob_mismatch"] < 1e-3, (r["step"], r["logprob_mismatch"])
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "run" / "sglang_logs").glob("*.log"))
    assert f"gspo-policy-v{STEPS}" in logs


def _tensors(folder: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update({k: v.float() for k, v in load_file(os.path.join(folder, f)).items()})
    assert out, f"no safetensors in {folder}: {json.dumps(os.listdir(folder))}"
    return out
