"""Conversion tests: tiny Hugging Face checkpoints (session fixture) and a summary of the measured
Megatron-vs-transformers logit differences."""

from __future__ import annotations

import os

import pytest
import torch
from convert_models import MODELS, build_hf_model, tokens
from helpers.export_cases import TRAINED


def _save_tokenizer(path: str) -> None:
    """A small word-level tokenizer, so that the tools' copying of tokenizer files is exercised."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(20)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(path)


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory) -> dict[str, str]:
    """``{name: folder}``: each model of ``MODELS`` saved by ``save_pretrained``, with ``ref.pt`` holding
    the tokens and transformers' float32 logits for them (computed here, so workers need no transformers)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name in MODELS:
        model = build_hf_model(name)
        path = str(root / name)
        model.save_pretrained(path)
        if name == "moe":
            _save_tokenizer(path)
        toks = tokens()
        with torch.no_grad():
            logits = model(toks).logits.float()
        torch.save({"tokens": toks, "logits": logits}, os.path.join(path, "ref.pt"))
        out[name] = path
    return out


def pytest_configure(config):
    config._convert_logits = {}


@pytest.fixture
def logits_report(request):
    """``report(model, layout, max_abs_diff, max_abs_logit)`` for the terminal summary."""
    store = request.config._convert_logits

    def report(model, layout, diff, scale):
        store[(model, layout)] = (float(diff), float(scale))

    return report


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    store = getattr(config, "_convert_logits", {})
    if not store:
        return
    terminalreporter.section("Megatron (converted) vs transformers logits, float32")
    terminalreporter.write_line(f"{'model':<12} {'layout':<8} {'max|diff|':>10} {'max|logit|':>10}")
    for (model, layout), (diff, scale) in sorted(store.items()):
        terminalreporter.write_line(f"{model:<12} {layout:<8} {diff:>10.2e} {scale:>10.2f}")


@pytest.fixture(scope="session")
def trained_runs(hf_models, tmp_path_factory) -> dict[str, dict]:
    """``{name: result}`` of the training worker (one 2-rank launch for every layout of ``TRAINED``); each
    result has ``run_dir`` (with ``checkpoints/`` and the learner's logits at the saved step,
    ``learner_logits.pt``), ``checkpoint`` (the step directory) and ``hf`` (the model it started from)."""
    import json

    from convert_models import HERE, run, torchrun

    root = tmp_path_factory.mktemp("trained")
    cases = [dict(name=f"{m}-{lay}", hf=hf_models[m], **extra) for m, lay, extra in TRAINED]
    out = str(root / "results.jsonl")
    run(
        torchrun(
            os.path.join(HERE, "train_export_worker.py"),
            2,
            ["--cases", json.dumps(cases), "--root", str(root), "--out", out],
        ),
        timeout=420,
        what="train_export_worker.py on 2 ranks",
    )
    with open(out) as f:
        results = {r["case"]: r for r in map(json.loads, f)}
    for case in cases:
        results[case["name"]].update(run_dir=str(root / case["name"]), hf=case["hf"])
    return results
