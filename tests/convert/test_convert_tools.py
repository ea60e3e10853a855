"""The command-line converters end to end: HF -> Megatron on 2 ranks (the tool relaunches itself under
torch.distributed.run) -> HF on 1 process (resharded at load), split into several safetensors files. (Export
from real training checkpoints: test_export_training.py.)

The round trip only moves bytes, so every tensor comes back bit for bit, and config.json and the
tokenizer files are copied verbatim; transformers loads the result and computes the original logits.
"""

from __future__ import annotations

import filecmp
import json
import os
import sys

import pytest
import torch
from convert_models import ROOT, run

from gspo_mcore.learner.hf.folder import HFCheckpoint

pytestmark = pytest.mark.distributed


def tool(name: str, *args: str) -> list[str]:
    return [sys.executable, os.path.join(ROOT, "tools", f"{name}.py"), *args]


def test_round_trip_through_the_tools(hf_models, tmp_path):
    src = hf_models["moe"]
    mcore, back = str(tmp_path / "mcore"), str(tmp_path / "hf")
    run(
        tool("convert_hf_to_mcore", "--hf", src, "--out", mcore, "--ep", "2"),
        timeout=150,
        what="convert_hf_to_mcore.py --ep 2",
    )
    meta = json.loads(open(os.path.join(mcore, "gspo_mcore_convert.json")).read())
    assert meta["saved_with"] == dict(tensor=1, pipeline=1, expert=2, world_size=2)
    assert os.path.isfile(os.path.join(mcore, "model", "metadata.json"))

    run(
        tool("convert_mcore_to_hf", "--mcore", mcore, "--out", back, "--max-shard-size", "100KB", "--progress"),
        timeout=120,
        what="convert_mcore_to_hf.py",
    )
    index = json.loads(open(os.path.join(back, "model.safetensors.index.json")).read())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all(os.path.getsize(os.path.join(back, f)) < 150_000 for f in files)

    a, b = HFCheckpoint(src), HFCheckpoint(back)
    assert sorted(a.keys()) == sorted(b.keys()) == sorted(index["weight_map"])
    for k in a.keys():
        ta, tb = a.get(k), b.get(k)
        assert ta.dtype == tb.dtype and torch.equal(ta, tb), k
    copied = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    for f in copied:
        assert filecmp.cmp(os.path.join(src, f), os.path.join(back, f), shallow=False), f

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(back).eval()
    ref = torch.load(os.path.join(src, "ref.pt"))
    with torch.no_grad():
        assert torch.equal(model(ref["tokens"]).logits, ref["logits"])
    assert AutoTokenizer.from_pretrained(back)("w3 w7")["input_ids"] == [5, 9]
