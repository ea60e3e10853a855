"""The model's architecture from a Hugging Face ``config.json`` (Qwen3, Qwen3-MoE, Llama, Qwen2), and its
Megatron-Core config.

The architecture is read from the same ``config.json`` that converted checkpoints and SGLang use, so the three
always agree on it. :func:`transformer_config` maps it to a ``TransformerConfig``: RMSNorm, SwiGLU,
plain RoPE (``rope_theta``), grouped-query attention with any head ratio, no linear biases, and per family:

- ``qwen3`` / ``qwen3_moe``: QK-norm (RMSNorm over each query and key head); Qwen3-MoE top-k softmax
  routing with normalised top-k probabilities;
- ``llama``: the Qwen3 block without QK-norm;
- ``qwen2``: the Llama block with biases on the q/k/v projections (not on ``o_proj``).

Refused by name (:class:`UnsupportedConfigError`): other ``model_type`` values, RoPE scaling of any kind
(``rope_scaling`` / ``rope_parameters`` other than the default), sliding-window attention, an activation
other than SiLU, and ``attention_bias`` / ``mlp_bias`` (Megatron cannot put a bias on ``o_proj`` alone).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

import torch

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "llama", "qwen2")
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")
"""Families whose attention normalises every query and key head (RMSNorm) before RoPE."""
SUPPORTED_ROPE_TYPES = ("default",)
"""RoPE kinds implemented exactly: ``default`` (plain RoPE, ``rope_scaling: null``)."""


class UnsupportedConfigError(ValueError):
    """A ``config.json`` asks for something the learner does not implement (named in the message)."""


@dataclass(frozen=True, kw_only=True)
class ModelArch:
    """The architecture fields of a Qwen3 / Qwen3-MoE / Llama / Qwen2 ``config.json`` that the learner uses."""

    model_type: str
    """``"qwen3"`` (dense), ``"qwen3_moe"``, ``"llama"`` or ``"qwen2"`` (see :data:`SUPPORTED_MODEL_TYPES`)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    """Dense MLP width (SwiGLU); used by dense layers of a MoE model too."""
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    """Grouped-query attention: query heads share ``num_attention_heads / num_key_value_heads`` KV heads."""
    head_dim: int
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    """One matrix for the input embedding and the output layer (Megatron's
    ``share_embeddings_and_output_weights``); the checkpoint then has no ``lm_head.weight``."""
    attention_bias: bool = False
    """Llama / Qwen3 ``attention_bias``: biases on q, k, v AND ``o_proj``. Must be false (Megatron has no
    bias on the output projection alone). Qwen2's q/k/v biases do not depend on it (see :attr:`qkv_bias`)."""
    mlp_bias: bool = False
    """Llama ``mlp_bias`` (biases on gate/up/down). Must be false."""
    hidden_act: str = "silu"
    """The MLP activation; must be ``"silu"`` (SwiGLU)."""
    initializer_range: float = 0.02
    # Qwen3-MoE
    num_experts: int = 0
    """Routed experts per MoE layer (0: dense model)."""
    num_experts_per_tok: int = 0
    """Top-k."""
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    """Renormalise the top-k routing probabilities (softmax over the chosen experts)."""
    router_aux_loss_coef: float = 0.0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
    """Layers (0-based) that use the dense MLP in a MoE model."""

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedConfigError(f"model_type must be one of {SUPPORTED_MODEL_TYPES}, got {self.model_type!r}")
        if self.hidden_act != "silu":
            raise UnsupportedConfigError(f"hidden_act={self.hidden_act!r} is not supported (SwiGLU with 'silu' only)")
        if self.attention_bias and self.model_type != "qwen2":
            raise UnsupportedConfigError(
                f"attention_bias=true is not supported for model_type {self.model_type!r}: it puts a bias on "
                "o_proj too, which Megatron cannot do without biases on every MLP projection"
            )
        if self.mlp_bias:
            raise UnsupportedConfigError(
                f"mlp_bias=true is not supported for model_type {self.model_type!r} (SwiGLU without biases only)"
            )
        if self.model_type != "qwen3_moe" and self.num_experts:
            raise ValueError(
                f"num_experts={self.num_experts}: model_type {self.model_type!r} is dense (MoE: qwen3_moe)"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention)"
            )
        if self.is_moe:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                    f"got {self.num_experts_per_tok}"
                )
            if self.moe_intermediate_size <= 0:
                raise ValueError(f"moe_intermediate_size must be > 0 for a MoE model, got {self.moe_intermediate_size}")
            if self.decoder_sparse_step <= 0:
                raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
            if self.router_aux_loss_coef < 0:
                raise ValueError(f"router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}")
            bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
            if bad:
                raise ValueError(f"mlp_only_layers {bad} are outside [0, {self.num_hidden_layers})")
        elif self.model_type == "qwen3_moe":
            raise ValueError("a qwen3_moe config needs num_experts > 0")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def qk_norm(self) -> bool:
        """RMSNorm over each query and key head (Qwen3 / Qwen3-MoE)."""
        return self.model_type in QK_NORM_MODEL_TYPES

    @property
    def qkv_bias(self) -> bool:
        """Biases on the q/k/v projections (Qwen2 always has them)."""
        return self.model_type == "qwen2"

    def moe_layer_pattern(self) -> list[int]:
        """1 for a MoE layer, 0 for a dense layer (Qwen3-MoE's ``decoder_sparse_step``/``mlp_only_layers``)."""
        return [
            int(self.is_moe and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0)
            for i in range(self.num_hidden_layers)
        ]

    def dense_layer_indices(self) -> tuple[int, ...]:
        """The 0-based dense layers of a MoE model (no router: ``-1`` in routing records); ``()`` for a dense
        model."""
        return tuple(i for i, m in enumerate(self.moe_layer_pattern()) if not m) if self.is_moe else ()


def load_hf_config(source: str | os.PathLike | dict) -> ModelArch:
    """A :class:`ModelArch` from a ``config.json`` path, a checkpoint folder holding one, or a dict.

    Raises :class:`UnsupportedConfigError` naming the key for anything not implemented exactly (see the
    module docstring), so that a checkpoint never loads into a model that computes something else.
    """
    if isinstance(source, dict):
        raw, where = dict(source), "config"
    else:
        path = os.fspath(source)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            raw = json.load(f)
        where = path
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedConfigError(
            f"{where}: unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    _check_rope(raw, where)
    if raw.get("use_sliding_window"):
        raise UnsupportedConfigError(f"{where}: use_sliding_window=true is not supported (full attention only)")
    sliding = sorted({t for t in raw.get("layer_types") or () if t != "full_attention"})
    if sliding:
        raise UnsupportedConfigError(f"{where}: layer_types {sliding} are not supported (full_attention only)")
    # transformers >= 5 writes RoPE as ``rope_parameters`` (not ``rope_theta``/``rope_scaling``) and the
    # Qwen3-MoE expert count as ``num_local_experts``; older checkpoints use the top-level names.
    rope = raw.get("rope_parameters") or {}
    names = {f.name for f in dataclasses.fields(ModelArch)}
    kwargs = {k: v for k, v in raw.items() if k in names and v is not None}
    if "rope_theta" in rope:
        if kwargs.get("rope_theta", rope["rope_theta"]) != rope["rope_theta"]:
            raise UnsupportedConfigError(
                f"{where}: rope_theta={kwargs['rope_theta']} and rope_parameters.rope_theta="
                f"{rope['rope_theta']} disagree"
            )
        kwargs["rope_theta"] = rope["rope_theta"]
    if "num_experts" not in kwargs and "num_local_experts" in raw:
        kwargs["num_experts"] = raw["num_local_experts"]
    if "head_dim" not in kwargs and "hidden_size" in raw and "num_attention_heads" in raw:
        kwargs["head_dim"] = raw["hidden_size"] // raw["num_attention_heads"]
    if "num_key_value_heads" not in kwargs and "num_attention_heads" in raw:
        kwargs["num_key_value_heads"] = raw["num_attention_heads"]
    if "mlp_only_layers" in kwargs:
        kwargs["mlp_only_layers"] = tuple(kwargs["mlp_only_layers"])
    if model_type != "qwen3_moe":
        for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            kwargs.pop(k, None)
    if model_type == "qwen2":
        kwargs.pop("attention_bias", None)  # not a Qwen2 setting: its q/k/v always have biases, o_proj never
    try:
        return ModelArch(**kwargs)
    except UnsupportedConfigError as exc:
        raise UnsupportedConfigError(f"{where}: {exc}") from None


def _check_rope(raw: dict, where: str) -> None:
    """Refuse RoPE scaling: ``rope_scaling`` (transformers < 5) or ``rope_parameters`` (>= 5) of any
    ``rope_type`` (older files: ``type``) but ``default``."""
    for key in ("rope_scaling", "rope_parameters"):
        value = raw.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise UnsupportedConfigError(f"{where}: {key}={value!r} is not a dict")
        kind = value.get("rope_type", value.get("type", "default"))
        if kind not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedConfigError(
                f"{where}: {key} asks for RoPE scaling of type {kind!r}, which is not supported; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)} (plain RoPE, rope_scaling: null)"
            )


def transformer_config(
    arch: ModelArch,
    *,
    tensor: int = 1,
    pipeline: int = 1,
    expert: int = 1,
    expert_tensor: int | None = None,
    context: int = 1,
    sequence_parallel: bool = False,
    on_gpu: bool,
    bf16: bool | None = None,
    recompute: bool = False,
):
    """The Megatron-Core ``TransformerConfig`` for ``arch`` under a parallel layout.

    ``on_gpu``: the bias-dropout fusion; otherwise every CUDA-only fusion off. ``bf16``: bf16 parameters
    (Megatron's mixed precision; ``None``: on a GPU only), otherwise fp32.
    """
    from megatron.core.transformer import TransformerConfig

    bf16 = on_gpu if bf16 is None else bf16
    dtype = torch.bfloat16 if bf16 else torch.float32
    kwargs = dict(
        num_layers=arch.num_hidden_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        qk_layernorm=arch.qk_norm,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=arch.initializer_range,
        tensor_model_parallel_size=tensor,
        pipeline_model_parallel_size=pipeline,
        expert_model_parallel_size=expert,
        expert_tensor_parallel_size=expert_tensor,
        context_parallel_size=context,
        sequence_parallel=sequence_parallel,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=bf16,
        use_cpu_initialization=not on_gpu,
        variable_seq_lengths=True,  # packed micro-batches differ in length
        moe_token_dispatcher_type="alltoall",  # the only dispatcher that allows variable lengths
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=on_gpu,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,  # its CUDA kernel is optional (apex); TE attention does not use it
        persist_layer_norm=False,
        deallocate_pipeline_outputs=on_gpu,
    )
    if recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if arch.is_moe:
        pattern = arch.moe_layer_pattern()
        kwargs.update(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.num_experts_per_tok,
            moe_ffn_hidden_size=arch.moe_intermediate_size,
            moe_layer_freq=pattern if not all(pattern) else 1,
            moe_router_score_function="softmax",
            # top-k then softmax over the chosen experts == softmax, top-k, renormalise (norm_topk_prob)
            moe_router_pre_softmax=not arch.norm_topk_prob,
            moe_router_load_balancing_type="aux_loss" if arch.router_aux_loss_coef > 0 else "none",
            moe_aux_loss_coeff=arch.router_aux_loss_coef,
            moe_grouped_gemm=False,
            moe_router_dtype="fp32",
            # each router gets a RouterReplay (idle unless gspo_mcore.learner.routing drives it): Routing
            # Replay and the routing-volatility measurement record / force the experts through it
            moe_enable_routing_replay=True,
        )
    return TransformerConfig(**kwargs)
