"""LoRA (gspo_mcore/learner/lora.py, issue 39): the ``lora:`` section's refusals, one wrapped linear in float64
against a pure-torch reference (1 rank and TP2, column- and row-parallel), and the toy dense model with adapters
on every linear: at initialisation (``B = 0``) its log-probs equal the base model's bit for bit; only the adapters
are trainable and held by the optimizer (default and distributed); one rollout batch (2 updates) gives the same
losses, gradient norms, first-mini-batch gradients and updated adapters at 1 rank, DP2 (also with the distributed
optimizer), TP2 and PP2 within the aggregation-invariance tests' bounds; the base weights are unchanged by the
updates; the in-process engine (KV-cache decode of the live, unmerged adapters) and a merged export
(``W + (alpha/r) B A``) loaded into a model without LoRA give the learner's log-probs; the PEFT export's tensors
(gathered from each layout) applied to the base in pure torch give the merged export. ``batch.share_prompt`` combines
with LoRA: at 1 rank and TP2 one update with shared prompts equals the same grouped batch unshared.

With ``B = 0`` the first mini-batch's gradient of every ``A`` is zero, so the worker redraws ``B`` from
``N(0, 0.05)`` after the bit-exact check (the same global tensors at every layout) and then trains."""

from __future__ import annotations

import json
import os

import pytest
from helpers import learner_toy as toy
from helpers.launch import run_ranks
from test_learner_invariance import GRAD_ATOL, GRAD_RTOL, LOGP_ATOL, LOSS_RTOL, PARAM_ATOL

from gspo_mcore.learner.lora import HF_TARGETS, LoraConfig, check_layout
from gspo_mcore.learner.model_config import ModelArch
from gspo_mcore.learner.parallel import ParallelConfig
from gspo_mcore.train import parse_config
from gspo_mcore.trainer.run_dir import base_mismatch, lora_mismatch

TINY = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "tiny", "config.yaml")
ENGINE_ATOL = 1e-5
"""The in-process engine's and the merged export's log-probs vs the learner's (fp32, another summation order)."""
LAYERS = toy.MODELS["dense"]["num_hidden_layers"]
PEFT_MERGE_ATOL = 1e-6
"""The PEFT export's ``W + (alpha/r) B A`` in pure torch vs the merged export (fp32, B A summed per TP shard there)."""
LAYER_RTOL = 1e-12
"""float64 wrapped linear vs the pure-torch reference, relative to the largest reference value."""


# ---------------------------------------------------------------- the lora: section


def test_off_by_default_and_parses_from_the_run_config():
    assert not parse_config(["--config", TINY]).lora.enabled
    cfg = parse_config(["--config", TINY, "lora.rank=8", "lora.target_modules=[q_proj,k_proj,v_proj]"])
    assert cfg.lora.rank == 8 and cfg.lora.scale == 32 / 8 and cfg.lora.megatron_targets == ("linear_qkv",)
    assert LoraConfig(rank=2, target_modules="gate_proj, up_proj").megatron_targets == ("linear_fc1",)
    assert LoraConfig(rank=2).megatron_targets == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(rank=-1), r"lora.rank must be an integer >= 1 \(or 0: LoRA off\), got -1"),
        (dict(rank=2.5), r"lora.rank must be an integer"),
        (dict(rank=4, alpha=0), r"lora.alpha must be a finite number > 0"),
        (dict(rank=4, dropout=1.0), r"lora.dropout must be in \[0, 1\)"),
        (dict(rank=4, target_modules=["q_proj", "k_proj", "v_proj", "lm_head"]), r"unknown name\(s\) \['lm_head'\]"),
        (dict(rank=4, target_modules=["all-linear", "o_proj"]), r"'all-linear' must stand alone"),
        (dict(rank=4, target_modules=[]), r"must name at least one"),
        (
            dict(rank=4, target_modules=["q_proj", "v_proj"]),
            r"names \['q_proj', 'v_proj'\] but not \['k_proj'\]: Megatron-Core fuses \['q_proj', 'k_proj', 'v_proj'\] "
            r"into one linear \(linear_qkv\)",
        ),
        (dict(rank=4, target_modules=["up_proj", "down_proj"]), r"not \['gate_proj'\].*\(linear_fc1\)"),
    ],
)
def test_bad_values_are_refused_naming_the_key(kw, message):
    with pytest.raises(ValueError, match=message):
        LoraConfig(**kw)


def test_an_unknown_target_lists_the_valid_names():
    with pytest.raises(ValueError) as info:
        LoraConfig(rank=4, target_modules=["qkv"])
    assert all(name in str(info.value) for name in HF_TARGETS) and "all-linear" in str(info.value)


def test_a_run_config_refuses_a_bad_lora_key():
    with pytest.raises(ValueError, match=r"lora\.rnak"):
        parse_config(["--config", TINY, "lora.rnak=8"])


@pytest.mark.parametrize(
    "model, parallel, use_te, message",
    [
        (
            "dense",
            dict(tensor=2, sequence_parallel=True),
            False,
            r"sequence parallelism \(parallel.sequence_parallel\)",
        ),
        ("dense", dict(context=2), False, r"parallel.context=2"),
        ("dense", {}, True, r"Transformer Engine \(model.options.use_te"),
        ("moe", {}, False, r"MLP projections \['gate_proj', 'up_proj', 'down_proj'\] of a MoE model"),
    ],
)
def test_layouts_lora_cannot_run_with_are_refused(model, parallel, use_te, message):
    arch = ModelArch(**toy.MODELS[model])
    with pytest.raises(ValueError, match=message):
        check_layout(LoraConfig(rank=4), arch=arch, parallel=ParallelConfig(**parallel), use_te=use_te)
    attention_only = LoraConfig(rank=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    if model == "moe":  # the attention of a MoE model may be adapted
        check_layout(attention_only, arch=arch, parallel=ParallelConfig(**parallel), use_te=use_te)
    check_layout(LoraConfig(rank=0), arch=arch, parallel=ParallelConfig(**parallel), use_te=use_te)  # off


def test_a_resume_between_lora_and_full_runs_is_refused():
    lora = dict(rank=8, alpha=16, target_modules=["all-linear"])
    assert lora_mismatch(None, None) is None and lora_mismatch(dict(rank=0), None) is None
    assert lora_mismatch(lora, dict(lora, alpha=32)) is None  # the same parameters
    assert lora_mismatch(lora, dict(lora, target_modules=list(HF_TARGETS))) is None
    assert lora_mismatch(None, lora) == (
        "was written by a full fine-tuning (lora.rank=0) run and this run is LoRA (lora.rank=8, lora.target_modules="
        "['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj']): the checkpoint holds other "
        "parameters than this model; resume with the same lora section, or start from Hugging Face weights"
    )
    assert "LoRA (lora.rank=8" in lora_mismatch(lora, dict(rank=0)) and "this run is full fine-tuning" in (
        lora_mismatch(lora, dict(rank=0))
    )
    assert lora_mismatch(lora, dict(lora, rank=4)) and lora_mismatch(lora, dict(lora, target_modules=["o_proj"]))


def test_an_adapter_only_resume_onto_another_base_is_refused():
    hf = dict(hf_dir="runs/m", load_hf_weights=True, init_seed=1)
    assert base_mismatch(hf, dict(hf, init_seed=2)) is None  # the seed does not make a base of HF weights
    assert base_mismatch(hf, dict(hf, hf_dir="runs/../runs/m")) is None  # the same folder
    assert base_mismatch(hf, dict(hf, hf_dir="runs/other")).startswith(
        f"holds LoRA adapters trained on the weights of model.hf_dir={os.path.realpath('runs/m')}, and this run's "
        f"base is the weights of model.hf_dir={os.path.realpath('runs/other')}: adapters apply only to the base"
    )
    random = dict(hf, load_hf_weights=False)
    assert base_mismatch(random, dict(random, hf_dir="runs/other")) is None  # config.json only: the same shapes
    assert "from model.init_seed=1 (model.load_hf_weights=false), and this run's base is the weights" in (
        base_mismatch(random, hf)
    )
    assert "model.init_seed=2" in base_mismatch(random, dict(random, init_seed=2))


def test_a_peft_export_of_a_checkpoint_without_adapters_is_refused():
    from gspo_mcore.convert.convert import _base_seed, adapters_only, peft_lora
    from gspo_mcore.convert.export_source import ExportSource, TrainingCheckpoint

    def source(run_config, model="all"):
        ckpt = TrainingCheckpoint(
            path="/r/step_3", step=3, run_config=run_config, trainer_state={"model": model}, config_sha256=None
        )
        return ExportSource(ckpt_dir="/r/step_3/megatron", side_dir="/m", training=ckpt)

    with pytest.raises(ValueError, match=r"--lora-format peft: /c is not a LoRA run's training checkpoint"):
        peft_lora(ExportSource(ckpt_dir="/c", side_dir="/m"))  # a converted model
    with pytest.raises(ValueError, match=r"/r/step_3 is not a LoRA run's training checkpoint \(lora.rank 0"):
        peft_lora(source({"lora": {"rank": 0}}))
    lora = {"lora": {"rank": 4, "alpha": 8.0}, "model": {"init_seed": 5}}
    assert peft_lora(source(lora)).scale == 2.0
    # the merged export of an adapter-only checkpoint rebuilds the run's base: its seed, or model.hf_dir's weights
    assert adapters_only(source(lora, "adapters")) and not adapters_only(source(lora))
    assert _base_seed(source(lora, "adapters")) == 5 and _base_seed(source(lora)) is None
    assert _base_seed(source({**lora, "model": {"load_hf_weights": True}}, "adapters")) is None


# ---------------------------------------------------------------- the adapters (gloo ranks)

ONE_RANK = [
    dict(name="1rank", save=True),
    # batch.share_prompt with LoRA: the grouped batch unshared is the reference of the shared runs
    dict(name="1rank-groups", save=True, groups=True, ref="groups"),
    dict(name="1rank-share", groups=True, share=True, ref="groups"),
    dict(name="layer-column", kind="layer", column=True),
    dict(name="layer-row", kind="layer", column=False),
    dict(name="rank-too-big", kind="refuse", lora=dict(rank=65)),
]
TWO_RANKS = [
    dict(name="dp2"),
    dict(name="dp2-distopt", distopt=True),
    dict(name="tp2", tp=2),
    dict(name="pp2", pp=2),
    dict(name="tp2-share", tp=2, groups=True, share=True, ref="groups"),
    dict(name="layer-column-tp2", kind="layer", column=True, tp=2),
    dict(name="layer-row-tp2", kind="layer", column=False, tp=2),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora")
    out = {}
    for nproc, cases in ((1, ONE_RANK), (2, TWO_RANKS)):
        path = folder / f"out{nproc}.jsonl"
        run_ranks(
            "learner/lora_worker.py",
            nproc,
            ["--ref", str(folder), "--out", str(path), "--cases", json.dumps(cases)],
            timeout=900,
        )
        out.update({r["case"]: r for r in map(json.loads, path.read_text().splitlines())})
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["layer-column", "layer-row", "layer-column-tp2", "layer-row-tp2"])
def test_one_lora_linear_matches_the_float64_reference(results, name):
    r = results[name]
    for key in ("out", "grad_A", "grad_B", "grad_x"):
        assert r[key] <= LAYER_RTOL * r["scale"], (name, key, r[key])


@pytest.fixture(scope="module")
def dropout_results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora_dropout")
    path = folder / "out.jsonl"
    cases = [
        dict(name="layer-column-dropout", kind="layer", column=True, dropout=0.5),
        dict(name="layer-row-dropout", kind="layer", column=False, dropout=0.5),
    ]
    run_ranks(
        "learner/lora_worker.py",
        1,
        ["--ref", str(folder), "--out", str(path), "--cases", json.dumps(cases)],
        timeout=600,
    )
    return {r["case"]: r for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["layer-column-dropout", "layer-row-dropout"])
def test_lora_dropout_drops_the_adapters_input_in_training_forwards_only(dropout_results, name):
    """``lora.dropout: 0.5`` on one wrapped linear (float64): the training forward and its gradients equal the
    reference ``base(x) + (alpha/r) B A (mask * x / (1 - p))`` with the same mask (the base sees the undropped
    ``x``); a forward without a gradient (log-probs, the engine's decode) and an eval-mode forward apply none."""
    r = dropout_results[name]
    assert 0.3 < r["dropped"] < 0.7, r["dropped"]  # a real mask was drawn
    for key in ("out", "grad_A", "grad_B", "grad_x"):
        assert r[key] <= LAYER_RTOL * r["scale"], (name, key, r[key])
    assert r["no_grad_out"] <= LAYER_RTOL * r["scale"] and r["eval_out"] <= LAYER_RTOL * r["scale"], r
    assert r["out_vs_undropped"] > 1e-3 * r["scale"], r  # the check can see the dropout


@pytest.mark.distributed
def test_a_rank_above_the_layer_size_is_refused_naming_the_key(results):
    assert results["rank-too-big"]["error"] == (
        "lora.rank=65 exceeds the size of decoder.layers.0.self_attention.linear_proj (64 x 64): the rank must be "
        "at most 64"
    )


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["1rank", "dp2", "dp2-distopt", "tp2", "pp2", "1rank-share", "tp2-share"])
def test_adapters_only_are_trained(results, name):
    r = results[name]
    assert r["init_bitwise"], "at B = 0 the log-probs must equal the base model's bit for bit"
    assert r["trainable"] and all(n.endswith((".lora_A", ".lora_B")) for n in r["trainable"])
    assert r["opt_numel"] == r["adapter_numel"] > 0, "the optimizer must hold the adapters, and only them"
    assert r["frozen_grad_buffers"] == 0
    assert r["base_changed"] == 0.0, "an update changed a frozen base weight"
    assert r["adapters_moved"] > 1e-4
    assert not r["export_has_adapters"]
    assert r["merged_diff"] <= ENGINE_ATOL, "merged export reloaded without LoRA vs the learner's log-probs"
    if "engine_diff" in r:  # the in-process engine needs PP = 1
        assert r["engine_diff"] <= ENGINE_ATOL, "in-process engine vs the learner's log-probs"


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["1rank", "dp2", "tp2", "pp2"])
def test_the_peft_export_applied_to_the_base_equals_the_merged_export(results, name):
    """PEFT's tensors (gathered from this layout, the fused q/k/v and gate/up adapters split into their projections
    with the shared A) give ``W + (alpha/r) B A`` of the merged export, for every projection of every layer."""
    r = results[name]
    projections = [
        f"{part}.{proj}" for part, projs in (("self_attn", HF_TARGETS[:4]), ("mlp", HF_TARGETS[4:])) for proj in projs
    ]
    assert r["peft_names"] == sorted(
        f"base_model.model.model.layers.{i}.{p}.lora_{ab}.weight"
        for i in range(LAYERS)
        for p in projections
        for ab in "AB"
    )
    assert r["peft_merge_diff"] <= PEFT_MERGE_ATOL, (name, r["peft_merge_diff"])


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["dp2", "dp2-distopt", "tp2", "pp2", "1rank-share", "tp2-share"])
def test_one_update_is_layout_invariant(results, name):
    """Every layout (and batch.share_prompt, at 1 rank and TP2, against the same grouped batch unshared) gives the
    1-rank run's losses, gradient norms, first-mini-batch gradients, adapters and log-probs."""
    r = results[name]
    if "share" in name:  # the prompts were shared: fewer tokens computed than the samples hold
        assert sum(r["computed_tokens"]) < sum(r["sample_tokens"]), (r["computed_tokens"], r["sample_tokens"])
    for a, b in zip(r["losses"], r["ref_losses"], strict=True):
        assert a == pytest.approx(b, rel=LOSS_RTOL, abs=1e-7), (name, "loss", r["losses"], r["ref_losses"])
    for a, b in zip(r["grad_norms"], r["ref_grad_norms"], strict=True):
        assert a == pytest.approx(b, rel=LOSS_RTOL), (name, "grad norm", r["grad_norms"], r["ref_grad_norms"])
    assert not r["keys_missing"]
    assert r["param_diff"] <= PARAM_ATOL, (name, "adapters after the updates", r["param_diff"])
    assert r["logp_diff"] <= LOGP_ATOL
    if "grad_diff" in r:  # (the distributed optimizer reduce-scatters: no full gradient to compare)
        scale = max(r["grad_ref_scale"].values())
        for key, diff in r["grad_diff"].items():
            assert diff <= GRAD_RTOL * r["grad_ref_scale"][key] + GRAD_ATOL * scale, (name, key, diff)
