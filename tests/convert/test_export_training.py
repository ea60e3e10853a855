"""Export from real training checkpoints: every layout the trainer saves, default and distributed optimizer.

The checkpoints are written by the trainer's own ``Checkpointer`` after one GSPO batch from a tiny Hugging
Face model (``conftest.trained_runs``: TP2, PP2 and DP2 with the distributed optimizer, MoE EP2, MoE EP2
with the fully reshardable distributed optimizer; expert-TP does not train on CPU). Each is exported on one
process (resharded at load) by ``tools/convert_mcore_to_hf.py``, reached the three ways a user names it: the
run folder (``--run``), the checkpoint directory and the ``step_<N>`` folder (``--mcore``).

Then transformers loads the exported folder, and its logits for the reference tokens must equal the
learner's at the saved step, computed by Megatron at the training layout, within the bound of the
converter's layout tests (``LOGITS_ATOL``, 7e-6: the same function through different kernels and
summation orders; see test_convert_layouts.py). The training batch must have moved the logits by far more
than that (``MIN_TRAINED_SHIFT``), so an export of the starting weights, or of the wrong step, fails.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from convert_models import HERE, ROOT, run
from helpers.export_cases import TRAINED
from test_convert_layouts import LOGITS_ATOL

pytestmark = pytest.mark.distributed

MIN_TRAINED_SHIFT = 1e-3
"""One GSPO batch (2 Adam steps at lr 1e-3) must move some logit by at least this (measured: see the test)."""
NAMES = [f"{m}-{lay}" for m, lay, _ in TRAINED]
HOW = ["run", "checkpoints", "step"]
"""How each case names its source: the run folder, the checkpoint directory, the step folder (in turn)."""


def _source_args(result: dict, how: str) -> list[str]:
    if how == "run":
        return ["--run", result["run_dir"]]
    if how == "checkpoints":
        return ["--mcore", os.path.join(result["run_dir"], "checkpoints")]
    return ["--mcore", result["checkpoint"]]


CLI_CASE = "moe-ep2"
"""Exported by the command line itself (sharded safetensors, progress bar); the others by one process running
the tool's ``main`` for each (megatron imported once)."""


@pytest.fixture(scope="module")
def exported(trained_runs, tmp_path_factory) -> dict[str, str]:
    """``{case: exported Hugging Face folder}``."""
    root = tmp_path_factory.mktemp("exported")
    outs, argvs = {}, []
    for i, name in enumerate(NAMES):
        outs[name] = str(root / name)
        args = [*_source_args(trained_runs[name], HOW[i % len(HOW)]), "--out", outs[name]]
        if name == CLI_CASE:
            run(
                [
                    sys.executable,
                    os.path.join(ROOT, "tools", "convert_mcore_to_hf.py"),
                    *args,
                    "--max-shard-size",
                    "100KB",
                    "--progress",
                ],
                timeout=180,
                what=f"convert_mcore_to_hf.py {' '.join(args)}",
            )
        else:
            argvs.append(args)
    run(
        [sys.executable, os.path.join(HERE, "export_many.py"), json.dumps(argvs)],
        timeout=300,
        what="convert_mcore_to_hf.py on the training checkpoints",
    )
    return outs


@pytest.mark.parametrize("name", NAMES)
def test_export_of_a_training_checkpoint_computes_the_learners_logits(name, trained_runs, exported, logits_report):
    from transformers import AutoModelForCausalLM

    result = trained_runs[name]
    out = exported[name]
    meta = json.loads(open(os.path.join(out, "gspo_mcore_export.json")).read())
    assert meta["step"] == 0 and meta["checkpoint"] == result["checkpoint"]
    ref = torch.load(os.path.join(result["hf"], "ref.pt"))
    learner = torch.load(os.path.join(result["run_dir"], "learner_logits.pt"))
    assert result["trained_vs_initial"] >= MIN_TRAINED_SHIFT, "the training batch did not change the model"
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = model(ref["tokens"]).logits.float()
    diff = float((logits - learner).abs().max())
    logits_report(name.split("-")[0], "train:" + name.split("-", 1)[1], diff, float(learner.abs().max()))
    shift = result["trained_vs_initial"]
    print(f"{name}: max|exported - learner| {diff:.2e}; training moved the logits by {shift:.2e}")
    assert diff <= LOGITS_ATOL


def test_export_carries_the_runs_tokenizer_and_shards(trained_runs, exported):
    """The command-line export of a training checkpoint: config.json and the tokenizer files come from the run's
    model.hf_dir (byte for byte), the weights are split at --max-shard-size, and the tokenizer loads."""
    import filecmp

    from transformers import AutoTokenizer

    src, out = trained_runs[CLI_CASE]["hf"], exported[CLI_CASE]
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert filecmp.cmp(os.path.join(src, f), os.path.join(out, f), shallow=False), f
    index = json.loads(open(os.path.join(out, "model.safetensors.index.json")).read())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all(os.path.getsize(os.path.join(out, f)) < 150_000 for f in files)
    assert AutoTokenizer.from_pretrained(out)("w3 w7")["input_ids"] == [5, 9]
