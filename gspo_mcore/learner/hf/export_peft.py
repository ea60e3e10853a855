"""A model's LoRA adapters as a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).

PEFT (``PeftModel.from_pretrained(base, folder)``) applies ``W + (lora_alpha / r) B A`` to each named projection
of the base Hugging Face model. Its tensor names are the projection's Hugging Face name under
``base_model.model.``, with ``lora_A.weight`` (``[r, in]``) and ``lora_B.weight`` (``[out, r]``), e.g.
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``.

Megatron-Core fuses ``q_proj``/``k_proj``/``v_proj`` into ``linear_qkv`` and ``gate_proj``/``up_proj`` into
``linear_fc1``, with one adapter on the fused linear (:mod:`gspo_mcore.learner.lora`). ``B A`` of a fused linear is
its rows' ``B`` times the shared ``A``, so the fused adapter splits exactly into one adapter per projection: each
gets the shared ``A`` and its own rows of ``B``, split like the fused weight (:func:`~.mapping.to_hf`: the qkv rows
interleaved per query group, ``[gate; up]``). ``A`` is then stored once per projection (three times for q/k/v).
"""

from __future__ import annotations

import json
import os
import re

import torch

from gspo_mcore.learner.hf.mapping import parse_megatron_name, to_hf

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_KEY = re.compile(r"^(?P<head>decoder\.layers\.)(?:(?P<layer>\d+)\.)?(?P<rest>.+)\.(?P<which>lora_[AB])$")


def peft_tensors(adapters: dict[str, torch.Tensor], arch, *, dtype: torch.dtype | None = None) -> dict:
    """PEFT's ``{name: tensor}`` from :func:`~gspo_mcore.learner.lora.global_adapters`' full adapters (checkpoint
    keys, the layer number a leading axis); ``dtype`` (default: the tensors')."""
    out = {}
    for key, full in sorted(adapters.items()):
        m = _KEY.match(key)
        if m is None:
            raise ValueError(f"not a transformer layer's adapter: {key}")
        layers = [(int(m["layer"]), full)] if m["layer"] is not None else list(enumerate(full))
        for layer, t in layers:
            p = parse_megatron_name(f"decoder.layers.{layer}.{m['rest']}.weight")
            names = p.hf_names
            if m["which"] == "lora_A":  # shared by the projections of a fused group
                parts = [(name, t) for name in names]
            else:  # B's rows split like the fused weight's (to_hf checks the shape only for weights: split here)
                parts = _split_rows(p, t, arch)
            for name, part in parts:
                peft_name = PEFT_PREFIX + name.removesuffix(".weight") + f".{m['which']}.weight"
                out[peft_name] = part.to(dtype or part.dtype).contiguous().clone()
    return out


def _split_rows(p, b: torch.Tensor, arch) -> list[tuple[str, torch.Tensor]]:
    """``B``'s rows per Hugging Face projection, as :func:`~.mapping.to_hf` splits the fused weight's rows."""
    if p.kind.fused is None:
        return [(p.hf_names[0], b)]
    # to_hf on a [out, in] stand-in whose columns carry B's r columns (to_hf checks the weight's shape)
    hidden = arch.hidden_size
    rank = b.shape[1]
    if rank > hidden:
        raise ValueError(f"lora rank {rank} above hidden_size {hidden}")
    stand_in = torch.zeros((b.shape[0], hidden), dtype=b.dtype)
    stand_in[:, :rank] = b
    return [(name, part[:, :rank]) for name, part in to_hf(p, stand_in, arch)]


def adapter_config(lora, *, base_model: str, targets: list[str]) -> dict:
    """PEFT's ``adapter_config.json`` for the :class:`~gspo_mcore.learner.lora.LoraConfig` ``lora``;
    ``targets``: the Hugging Face projections exported (``q_proj``...); ``base_model``: the base's folder."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def write_peft_adapter(out_dir: str, tensors: dict[str, torch.Tensor], config: dict) -> list[str]:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``out_dir``; returns their paths."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    weights = os.path.join(out_dir, ADAPTER_WEIGHTS)
    save_file({k: v.cpu() for k, v in tensors.items()}, weights, metadata={"format": "pt"})
    path = os.path.join(out_dir, ADAPTER_CONFIG)
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    return [path, weights]


def projection_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The Hugging Face projections (``q_proj``...) that ``tensors`` adapt."""
    return sorted({name.split(".")[-3] for name in tensors})


def live_adapter(model, arch, lora, *, base_model: str, dtype: torch.dtype | None = None) -> tuple[dict, dict]:
    """The model's current adapters as a PEFT adapter: ``({peft_name: tensor}, adapter_config)`` (what SGLang's
    adapter loading takes, and what :func:`write_peft_adapter` writes). A collective over the whole world (every rank
    must call it, see :func:`~gspo_mcore.learner.lora.global_adapters`); every rank gets the result."""
    from gspo_mcore.learner.lora import global_adapters

    tensors = peft_tensors(global_adapters(model), arch, dtype=dtype)
    return tensors, adapter_config(lora, base_model=base_model, targets=projection_names(tensors))
