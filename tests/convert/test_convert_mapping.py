"""The name/layout map on its own (no megatron, no process groups), the checkpoint reader, and the errors."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest
import torch
from convert_models import MODELS, ROOT, build_hf_model
from safetensors.torch import load_file, save_file

from gspo_mcore.convert.convert import preflight_hf
from gspo_mcore.learner.hf.folder import HFCheckpoint
from gspo_mcore.learner.hf.mapping import (
    KINDS,
    MissingTensorError,
    ShapeMismatchError,
    UnsupportedArchitectureError,
    check_architecture,
    from_hf,
    from_transformers_layout,
    hf_shapes,
    megatron_params,
    merge_qkv,
    parse_hf_name,
    parse_megatron_name,
    split_qkv,
    to_hf,
    to_transformers_layout,
    tp_shard,
    tp_unshard,
)
from gspo_mcore.learner.model_config import UnsupportedConfigError, load_hf_config

# ------------------------------------------------------------------------------------------ layouts


def test_qkv_interleave_is_per_query_group():
    """Megatron's linear_qkv rows: group g = [its nh/ng query heads, its key head, its value head]."""
    ng, nh, d, H = 2, 8, 3, 5
    qpg = nh // ng
    q = torch.arange(nh * d * H, dtype=torch.float32).reshape(nh * d, H)
    k = -1 - torch.arange(ng * d * H, dtype=torch.float32).reshape(ng * d, H)
    v = 1000 + torch.arange(ng * d * H, dtype=torch.float32).reshape(ng * d, H)
    qkv = merge_qkv(q, k, v, ng)
    assert qkv.shape == ((nh + 2 * ng) * d, H)
    block = (qpg + 2) * d
    for g in range(ng):
        rows = qkv[g * block : (g + 1) * block]
        assert torch.equal(rows[: qpg * d], q[g * qpg * d : (g + 1) * qpg * d])
        assert torch.equal(rows[qpg * d : (qpg + 1) * d], k[g * d : (g + 1) * d])
        assert torch.equal(rows[(qpg + 1) * d :], v[g * d : (g + 1) * d])
    for a, b in zip(split_qkv(qkv, ng, nh, d), (q, k, v)):
        assert torch.equal(a, b)
    bias = merge_qkv(q[:, 0], k[:, 0], v[:, 0], ng)  # biases interleave the same way
    assert torch.equal(bias, qkv[:, 0])


@pytest.mark.parametrize("size", [1, 2, 4])
def test_tp_shard_and_unshard_are_inverse(size):
    g = torch.Generator().manual_seed(0)
    for kind in KINDS.values():
        full = torch.randn(8, 12, generator=g) if kind.tp_dim is not None or kind.vocab else torch.randn(8, generator=g)
        shards = [tp_shard(kind, full, r, size) for r in range(size)]
        assert all(s.shape == shards[0].shape for s in shards)  # equal shards: gloo all_gather
        assert torch.equal(tp_unshard(kind, shards), full), kind.megatron


def test_glu_shard_holds_its_gate_and_up_slices():
    """Each TP rank computes silu(gate_r) * up_r on its own: its linear_fc1 shard is [gate_r; up_r]."""
    kind = KINDS["decoder.layers.{L}.mlp.linear_fc1.weight"]
    gate, up = torch.arange(8.0)[:, None], 100 + torch.arange(8.0)[:, None]
    full = torch.cat([gate, up])
    assert torch.equal(tp_shard(kind, full, 1, 2), torch.cat([gate[4:], up[4:]]))


def test_vocab_padding_is_dropped_and_restored():
    arch = load_hf_config(dict(model_type="qwen3", **MODELS["dense"][1]))
    p = parse_megatron_name("embedding.word_embeddings.weight")
    emb = torch.randn(arch.vocab_size, arch.hidden_size)
    padded = from_hf(p, {"model.embed_tokens.weight": emb}, arch, padded_vocab=arch.vocab_size + 28)
    assert padded.shape[0] == 128 and torch.equal(padded[:100], emb) and not padded[100:].any()
    [(name, back)] = to_hf(p, padded, arch)
    assert name == "model.embed_tokens.weight" and torch.equal(back, emb)


def test_transformer_engine_names_map_like_local_ones():
    experts = "decoder.layers.3.mlp.experts"
    te = {
        "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight": "decoder.layers.3.input_layernorm.weight",
        "decoder.layers.3.mlp.linear_fc1.layer_norm_weight": "decoder.layers.3.pre_mlp_layernorm.weight",
        f"{experts}.linear_fc1.weight5": f"{experts}.local_experts.5.linear_fc1.weight",
        f"{experts}.linear_fc2.weight5": f"{experts}.local_experts.5.linear_fc2.weight",
    }
    for name, local in te.items():
        assert parse_megatron_name(name) == parse_megatron_name(local)
    assert parse_megatron_name("decoder.layers.3.mlp.experts.linear_fc2.weight5").hf_names == [
        "model.layers.3.mlp.experts.5.down_proj.weight"
    ]


@pytest.mark.parametrize("name", list(MODELS))
def test_names_and_shapes_are_those_transformers_writes(hf_models, name):
    """The mapping's HF names/shapes are exactly save_pretrained's; every HF name parses back to its
    Megatron parameter; the checkpoint in transformers' in-memory layout is the model's state_dict."""
    path = hf_models[name]
    arch = load_hf_config(path)
    stored = load_file(os.path.join(path, "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in stored.items()} == hf_shapes(arch)
    params = megatron_params(arch)
    for hf_name in stored:
        p, i = parse_hf_name(hf_name)
        assert p in params and p.hf_names[i] == hf_name
    state = build_hf_model(name).state_dict()
    if arch.tie_word_embeddings and "lm_head.weight" in state:  # the embedding itself, not saved
        assert torch.equal(state.pop("lm_head.weight"), state["model.embed_tokens.weight"])
        assert "lm_head.weight" not in stored
    fused = to_transformers_layout(stored.items())
    assert set(fused) == set(state)
    assert all(torch.equal(fused[k], state[k]) for k in state)
    assert from_transformers_layout(fused.items()).keys() == stored.keys()


def test_reader_accepts_fused_transformers_experts(hf_models, tmp_path):
    """A safetensors file holding transformers 5.x fused experts reads as one tensor per expert."""
    src = hf_models["moe"]
    stored = load_file(os.path.join(src, "model.safetensors"))
    shutil.copy(os.path.join(src, "config.json"), tmp_path / "config.json")
    save_file(to_transformers_layout(stored.items()), str(tmp_path / "model.safetensors"))
    reader = HFCheckpoint(str(tmp_path))
    assert sorted(reader.keys()) == sorted(stored)
    for k in stored:
        assert reader.shape_of(k) == tuple(stored[k].shape)
        assert torch.equal(reader.get(k), stored[k])


def test_config_as_transformers_5_writes_it(hf_models):
    """transformers 5 writes ``rope_parameters`` and ``num_local_experts``; older configs the top-level
    ``rope_theta`` and ``num_experts``: both give the same shape (a wrong RoPE base would not fail
    loudly, only the logits test would notice)."""
    config = json.loads(open(os.path.join(hf_models["moe"], "config.json")).read())
    assert "rope_theta" not in config and "num_experts" not in config
    arch = load_hf_config(config)
    assert (arch.rope_theta, arch.num_experts, arch.mlp_only_layers) == (10000.0, 4, (1,))
    old = {k: v for k, v in config.items() if k not in ("rope_parameters", "num_local_experts")}
    assert load_hf_config(dict(old, rope_theta=10000.0, num_experts=4)) == arch
    with pytest.raises(UnsupportedConfigError, match="RoPE scaling of type 'yarn'"):
        load_hf_config(dict(config, rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}))


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "arch,model_type",
    [("MistralForCausalLM", "mistral"), ("GemmaForCausalLM", "gemma"), ("MixtralForCausalLM", "mixtral")],
)
def test_unsupported_architecture_is_named(arch, model_type):
    with pytest.raises(UnsupportedArchitectureError) as exc:
        check_architecture({"architectures": [arch], "model_type": model_type})
    msg = str(exc.value)
    assert arch in msg
    for supported in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM"):
        assert supported in msg
    with pytest.raises(
        UnsupportedConfigError,
        match=f"unsupported model_type '{model_type}'; supported: qwen3, qwen3_moe, llama, qwen2",
    ):
        load_hf_config(dict(MODELS["dense"][1], model_type=model_type))


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("kind", ["llama3", "linear", "dynamic", "yarn", "longrope"])
def test_rope_scaling_is_refused_by_name(key, kind):
    """transformers < 5 writes ``rope_scaling`` (``type`` in the oldest files), >= 5 ``rope_parameters``."""
    field = "type" if kind == "linear" and key == "rope_scaling" else "rope_type"
    config = dict(MODELS["llama"][1], model_type="llama", **{key: {field: kind, "factor": 8.0, "rope_theta": 5e5}})
    with pytest.raises(
        UnsupportedConfigError,
        match=f"{key} asks for RoPE scaling of type '{kind}', which is not supported; supported: default",
    ):
        load_hf_config(config)


def test_llama_and_qwen2_shapes():
    """QK-norm only for Qwen3; q/k/v biases only for Qwen2 (whatever attention_bias says); rope_parameters
    (transformers 5) give rope_theta; a null rope_scaling / head_dim is the default."""
    raw = dict(
        MODELS["llama"][1],
        model_type="llama",
        rope_scaling=None,
        head_dim=None,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5},
    )
    with pytest.raises(UnsupportedConfigError, match="rope_theta=100000.0 and rope_parameters.rope_theta=500000.0"):
        load_hf_config(raw)
    llama = load_hf_config({k: v for k, v in raw.items() if k != "rope_theta"})
    assert (llama.qk_norm, llama.qkv_bias, llama.head_dim, llama.rope_theta, llama.rms_norm_eps) == (
        False,
        False,
        16,
        5e5,
        1e-5,
    )
    qwen2 = load_hf_config(dict(MODELS["qwen2"][1], model_type="qwen2", attention_bias=False))
    assert (qwen2.qk_norm, qwen2.qkv_bias) == (False, True)
    qwen3 = load_hf_config(dict(MODELS["dense"][1], model_type="qwen3"))
    assert (qwen3.qk_norm, qwen3.qkv_bias) == (True, False)
    names = {
        name: [p.name.split(".", 3)[-1] for p in megatron_params(s) if p.layer == 0]
        for name, s in (("llama", llama), ("qwen2", qwen2), ("qwen3", qwen3))
    }
    assert "self_attention.q_layernorm.weight" in names["qwen3"] and "self_attention.linear_qkv.bias" in names["qwen2"]
    assert not any("layernorm.weight" in n and "self_attention" in n for n in names["llama"] + names["qwen2"])
    assert not any(n.endswith(".bias") for n in names["llama"] + names["qwen3"])


@pytest.mark.parametrize(
    "edit,message",
    [
        (dict(attention_bias=True), "attention_bias=true is not supported for model_type 'llama'"),
        (dict(mlp_bias=True), "mlp_bias=true is not supported for model_type 'llama'"),
        (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
        (dict(layer_types=["full_attention", "sliding_attention"]), r"layer_types \['sliding_attention'\]"),
        (dict(use_sliding_window=True), "use_sliding_window=true"),
    ],
)
def test_llama_features_not_implemented_are_refused(edit, message, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(MODELS["llama"][1], model_type="llama", **edit)))
    with pytest.raises(UnsupportedConfigError, match=message) as exc:
        load_hf_config(str(tmp_path))
    assert str(path) in str(exc.value)  # names the file


def test_architecture_and_model_type_must_agree():
    with pytest.raises(UnsupportedArchitectureError, match="model_type='qwen3_moe'"):
        check_architecture({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3_moe"})
    assert check_architecture({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}) == "qwen3_moe"


def _corrupt_copy(src: str, dst, edit) -> str:
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def test_shape_mismatch_names_tensor_expected_and_got(hf_models, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"

    def edit(t):
        t[name] = t[name][:16]

    path = _corrupt_copy(hf_models["dense"], tmp_path / "bad", edit)
    with pytest.raises(ShapeMismatchError) as exc:
        preflight_hf(path)
    assert f"{name}: expected (32, 64), got (16, 64)" in str(exc.value)


def test_shape_mismatch_in_mapping_names_tensor():
    arch = load_hf_config(dict(model_type="qwen3", **MODELS["dense"][1]))
    p = parse_megatron_name("decoder.layers.0.mlp.linear_fc2.weight")
    with pytest.raises(
        ShapeMismatchError,
        match=r"model.layers.0.mlp.down_proj.weight: expected shape \(64, 96\)"
        r" from config.json, got \(96, 64\)",
    ):
        from_hf(p, {"model.layers.0.mlp.down_proj.weight": torch.zeros(96, 64)}, arch)
    with pytest.raises(ShapeMismatchError, match="decoder.layers.0.mlp.linear_fc2.weight"):
        to_hf(p, torch.zeros(64, 95), arch)


def test_missing_and_unexpected_tensors_are_named(hf_models, tmp_path):
    path = _corrupt_copy(
        hf_models["moe"], tmp_path / "missing", lambda t: t.pop("model.layers.2.mlp.experts.3.up_proj.weight")
    )
    with pytest.raises(MissingTensorError, match="model.layers.2.mlp.experts.3.up_proj.weight"):
        preflight_hf(path)
    path = _corrupt_copy(
        hf_models["dense"],
        tmp_path / "extra",
        lambda t: t.update({"model.layers.0.mlp.shared_expert.weight": torch.zeros(2)}),
    )
    with pytest.raises(MissingTensorError, match="shared_expert"):
        preflight_hf(path)


def test_locate_converted_and_bare_checkpoints(tmp_path):
    """Converted (OUT/model + config.json), bare (metadata.json, config.json beside it or --config); a folder
    that holds neither is refused by name. (Training checkpoints: test_export_training.py, real ones.)"""
    from gspo_mcore.convert.export_source import ExportSourceError, locate

    def ckpt(path):
        path.mkdir(parents=True)
        (path / "metadata.json").write_text("{}")
        return str(path)

    conv = tmp_path / "conv"
    model = ckpt(conv / "model")
    (conv / "config.json").write_text("{}")
    a, b = locate(str(conv)), locate(model)
    assert (a.ckpt_dir, a.side_dir, a.training) == (model, str(conv), None) == (b.ckpt_dir, b.side_dir, b.training)
    bare = ckpt(tmp_path / "bare")
    assert locate(bare, config_dir=str(conv)).side_dir == str(conv)
    with pytest.raises(ExportSourceError, match="pass the Hugging Face folder as --config"):
        locate(bare)
    with pytest.raises(ExportSourceError, match="no Megatron distributed checkpoint"):
        locate(str(tmp_path))


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tools_refuse_unsupported_architecture_and_bad_shapes(hf_models, tmp_path, capsys):
    """The command-line tools check before loading megatron: exit status 2 and a one-line reason."""
    mistral = tmp_path / "mistral"
    shutil.copytree(hf_models["dense"], mistral)
    config = json.loads((mistral / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral")
    (mistral / "config.json").write_text(json.dumps(config))
    hf_to_mcore = _tool("convert_hf_to_mcore")
    assert hf_to_mcore.main(["--hf", str(mistral), "--out", str(tmp_path / "o1")]) == 2
    err = capsys.readouterr().err
    assert "unsupported architecture MistralForCausalLM" in err and "supported: Qwen3ForCausalLM" in err
    assert "LlamaForCausalLM (llama)" in err

    def edit(t):
        t["lm_head.weight"] = t["lm_head.weight"][:, :32].contiguous()

    bad = _corrupt_copy(hf_models["dense"], tmp_path / "bad", edit)
    assert hf_to_mcore.main(["--hf", bad, "--out", str(tmp_path / "o2")]) == 2
    assert "lm_head.weight: expected (100, 64), got (100, 32)" in capsys.readouterr().err

    assert hf_to_mcore.main(["--hf", hf_models["dense"], "--out", str(tmp_path / "o3"), "--tp", "3"]) == 2
    assert "TP=3 does not divide num_attention_heads=8" in capsys.readouterr().err

    # Llama with 6 query heads on 2 KV heads: TP3 divides the query heads but not the KV heads
    assert hf_to_mcore.main(["--hf", hf_models["llama"], "--out", str(tmp_path / "o5"), "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert "TP=3 does not divide num_key_value_heads=2" in err and "num_attention_heads" not in err

    assert _tool("convert_mcore_to_hf").main(["--mcore", str(tmp_path), "--out", str(tmp_path / "o4")]) == 2
    assert "no Megatron distributed checkpoint" in capsys.readouterr().err
    assert not any((tmp_path / o).exists() for o in ("o1", "o2", "o3", "o4", "o5"))
