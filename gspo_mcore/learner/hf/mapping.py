"""The one map between Megatron-Core ``GPTModel`` parameters and Hugging Face Qwen3 / Qwen3-MoE / Llama / Qwen2
tensors.

Pure torch: no megatron, no process groups. A Megatron parameter is named here with GLOBAL indices (the
layer's ``layer_number - 1``, the expert's global id) and handled as a FULL tensor (gathered over tensor
parallelism); :mod:`gspo_mcore.learner.hf.export` and :mod:`gspo_mcore.learner.hf.load` translate the
local names/shards of a rank to and from this form.

Names and layouts (``L`` layer, ``E`` expert, ``H`` hidden, ``d`` head_dim, ``nh`` query heads, ``ng``
KV heads (query groups), ``I`` MLP width, ``V`` vocabulary)::

    Megatron (local spec; TE-spec alias)                 Hugging Face                            layout
    embedding.word_embeddings.weight                      model.embed_tokens.weight               [V', H]
    decoder.final_layernorm.weight                        model.norm.weight                       [H]
    output_layer.weight                                   lm_head.weight (absent when tied)       [V', H]
    decoder.layers.L.input_layernorm.weight               model.layers.L.input_layernorm.weight   [H]
      (TE: decoder.layers.L.self_attention.linear_qkv.layer_norm_weight)
    decoder.layers.L.self_attention.linear_qkv.weight     self_attn.{q,k,v}_proj.weight           [ng*(nh/ng+2)*d, H]
      (and .bias: Qwen2)                                  self_attn.{q,k,v}_proj.bias
    decoder.layers.L.self_attention.q_layernorm.weight    self_attn.q_norm.weight (Qwen3 only)    [d]
    decoder.layers.L.self_attention.k_layernorm.weight    self_attn.k_norm.weight (Qwen3 only)    [d]
    decoder.layers.L.self_attention.linear_proj.weight    self_attn.o_proj.weight                 [H, nh*d]
    decoder.layers.L.pre_mlp_layernorm.weight             post_attention_layernorm.weight         [H]
      (TE, dense layers: decoder.layers.L.mlp.linear_fc1.layer_norm_weight)
    decoder.layers.L.mlp.linear_fc1.weight                mlp.gate_proj.weight ; mlp.up_proj      [2I, H] = [gate; up]
    decoder.layers.L.mlp.linear_fc2.weight                mlp.down_proj.weight                    [H, I]
    decoder.layers.L.mlp.router.weight                    mlp.gate.weight                         [E, H]
    decoder.layers.L.mlp.experts.local_experts.E.linear_fc1.weight   mlp.experts.E.{gate,up}_proj.weight
      (TE grouped GEMM: decoder.layers.L.mlp.experts.linear_fc1.weightE)
    decoder.layers.L.mlp.experts.local_experts.E.linear_fc2.weight   mlp.experts.E.down_proj.weight

``linear_qkv`` is interleaved per query group: viewed as ``[ng, (nh/ng + 2) * d, H]``, group ``g`` holds
its ``nh/ng`` query heads, then its key head, then its value head. Tensor parallelism splits it into
contiguous row blocks of whole groups, so concatenating the TP shards along dim 0 gives this layout.
``linear_fc1`` (SwiGLU) is ``[gate; up]`` in full, but each TP rank holds ``[gate_r; up_r]`` (Megatron
chunks the local output in two), so it is NOT a plain concatenation of shards: see :func:`tp_shard` and
:func:`tp_unshard`. Megatron may pad the vocabulary (``V' >= V``): Hugging Face tensors have exactly
``vocab_size`` rows (:func:`to_hf` drops the padding, :func:`from_hf` pads with zeros).

Hugging Face names are those of the safetensors checkpoint (what ``save_pretrained`` writes and SGLang
loads): one tensor per expert. transformers >= 5 holds MoE experts in memory as fused
``mlp.experts.gate_up_proj [E, 2I, H]`` / ``mlp.experts.down_proj [E, H, I]``;
:func:`to_transformers_layout` / :func:`from_transformers_layout` convert between the two.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}
"""Hugging Face ``architectures`` entry -> ``model_type`` this module converts."""


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's architecture is not one :data:`SUPPORTED_ARCHITECTURES` names."""


class ShapeMismatchError(ValueError):
    """A tensor's shape differs from the one the config (or the model) implies."""


class MissingTensorError(KeyError):
    """A tensor the config implies is absent (or the checkpoint has tensors the model has no place for)."""

    def __str__(self):  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


def check_architecture(config: Mapping) -> str:
    """The ``model_type`` of a Hugging Face ``config.json`` dict; raises if it is not supported."""
    archs = list(config.get("architectures") or [])
    model_type = config.get("model_type")
    supported = ", ".join(f"{a} ({t})" for a, t in SUPPORTED_ARCHITECTURES.items())
    if archs:
        bad = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
        if bad:
            raise UnsupportedArchitectureError(
                f"unsupported architecture {', '.join(bad)} (model_type {model_type!r}); supported: {supported}"
            )
        types = {SUPPORTED_ARCHITECTURES[a] for a in archs}
        if model_type is not None and model_type not in types:
            raise UnsupportedArchitectureError(
                f"config.json says architectures={archs} but model_type={model_type!r}; supported: {supported}"
            )
        return types.pop() if model_type is None else model_type
    if model_type not in SUPPORTED_ARCHITECTURES.values():
        raise UnsupportedArchitectureError(
            f"unsupported model_type {model_type!r} (no architectures entry); supported: {supported}"
        )
    return model_type


# --------------------------------------------------------------------------------------------------
# Parameter kinds


@dataclass(frozen=True)
class Kind:
    """How one kind of Megatron parameter maps to Hugging Face."""

    megatron: str
    """Canonical Megatron name (local spec) with ``{L}`` / ``{E}`` for the global layer / expert."""
    hf: tuple[str, ...]
    """Hugging Face name(s) the full tensor splits into (``{L}``/``{E}`` as above), in fused order."""
    tp_dim: int | None = None
    """Dim split over tensor parallelism (expert-TP for experts); ``None``: replicated."""
    fused: str | None = None
    """``"qkv"`` (interleaved per query group) or ``"glu"`` (``[gate; up]``, per-rank chunks)."""
    vocab: bool = False
    """Rows are the (possibly padded) vocabulary."""
    expert: bool = False


_ATTN = "model.layers.{L}.self_attn."
_MLP = "model.layers.{L}.mlp."
KINDS: dict[str, Kind] = {
    k.megatron: k
    for k in (
        Kind("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), tp_dim=0, vocab=True),
        Kind("decoder.final_layernorm.weight", ("model.norm.weight",)),
        Kind("output_layer.weight", ("lm_head.weight",), tp_dim=0, vocab=True),
        Kind("decoder.layers.{L}.input_layernorm.weight", ("model.layers.{L}.input_layernorm.weight",)),
        Kind(
            "decoder.layers.{L}.self_attention.linear_qkv.weight",
            (_ATTN + "q_proj.weight", _ATTN + "k_proj.weight", _ATTN + "v_proj.weight"),
            tp_dim=0,
            fused="qkv",
        ),
        Kind(
            "decoder.layers.{L}.self_attention.linear_qkv.bias",
            (_ATTN + "q_proj.bias", _ATTN + "k_proj.bias", _ATTN + "v_proj.bias"),
            tp_dim=0,
            fused="qkv",
        ),
        Kind("decoder.layers.{L}.self_attention.q_layernorm.weight", (_ATTN + "q_norm.weight",)),
        Kind("decoder.layers.{L}.self_attention.k_layernorm.weight", (_ATTN + "k_norm.weight",)),
        Kind("decoder.layers.{L}.self_attention.linear_proj.weight", (_ATTN + "o_proj.weight",), tp_dim=1),
        Kind("decoder.layers.{L}.self_attention.linear_proj.bias", (_ATTN + "o_proj.bias",)),
        Kind("decoder.layers.{L}.pre_mlp_layernorm.weight", ("model.layers.{L}.post_attention_layernorm.weight",)),
        Kind(
            "decoder.layers.{L}.mlp.linear_fc1.weight",
            (_MLP + "gate_proj.weight", _MLP + "up_proj.weight"),
            tp_dim=0,
            fused="glu",
        ),
        Kind("decoder.layers.{L}.mlp.linear_fc2.weight", (_MLP + "down_proj.weight",), tp_dim=1),
        Kind("decoder.layers.{L}.mlp.router.weight", (_MLP + "gate.weight",)),
        Kind(
            "decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc1.weight",
            (_MLP + "experts.{E}.gate_proj.weight", _MLP + "experts.{E}.up_proj.weight"),
            tp_dim=0,
            fused="glu",
            expert=True,
        ),
        Kind(
            "decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc2.weight",
            (_MLP + "experts.{E}.down_proj.weight",),
            tp_dim=1,
            expert=True,
        ),
    )
}

# Transformer Engine spec names -> canonical names (same tensors, same layouts).
_ALIASES = (
    (
        re.compile(r"^decoder\.layers\.(\d+)\.self_attention\.linear_qkv\.layer_norm_weight$"),
        "decoder.layers.{L}.input_layernorm.weight",
    ),
    (
        re.compile(r"^decoder\.layers\.(\d+)\.mlp\.linear_fc1\.layer_norm_weight$"),
        "decoder.layers.{L}.pre_mlp_layernorm.weight",
    ),
    (
        re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.linear_fc1\.weight(\d+)$"),
        "decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc1.weight",
    ),
    (
        re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.linear_fc2\.weight(\d+)$"),
        "decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc2.weight",
    ),
)


def _template_regex(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)") + "$")


_PATTERNS = [(_template_regex(k.megatron), k) for k in KINDS.values()]
_HF_PATTERNS = [(_template_regex(t), k, i) for k in KINDS.values() for i, t in enumerate(k.hf)]


@dataclass(frozen=True)
class MegatronParam:
    """One Megatron parameter, named with global indices."""

    kind: Kind
    layer: int | None = None
    expert: int | None = None

    @property
    def name(self) -> str:
        """The canonical (local-spec) Megatron name."""
        return _fill(self.kind.megatron, self.layer, self.expert)

    @property
    def hf_names(self) -> list[str]:
        return [_fill(t, self.layer, self.expert) for t in self.kind.hf]


def _fill(template: str, layer, expert) -> str:
    return template.replace("{L}", str(layer)).replace("{E}", str(expert))


def parse_megatron_name(name: str) -> MegatronParam:
    """The :class:`MegatronParam` of a global Megatron parameter name (local or TE spec)."""
    for rx, canonical in _ALIASES:
        m = rx.match(name)
        if m:
            name = _fill(canonical, m.group(1), m.group(2) if rx.groups > 1 else None)
            break
    for rx, kind in _PATTERNS:
        m = rx.match(name)
        if m:
            d = m.groupdict()
            return MegatronParam(kind, int(d["L"]) if "L" in d else None, int(d["E"]) if "E" in d else None)
    raise KeyError(
        f"no Hugging Face mapping for Megatron parameter {name!r} (supported: Qwen3 / Qwen3-MoE / "
        "Llama / Qwen2 "
        "GPTModel with the local or Transformer Engine spec, no grouped-GEMM legacy MLP, "
        "no shared experts)"
    )


def parse_hf_name(name: str) -> tuple[MegatronParam, int]:
    """The Megatron parameter a Hugging Face checkpoint tensor belongs to, and its index in the fused order."""
    for rx, kind, i in _HF_PATTERNS:
        m = rx.match(name)
        if m:
            d = m.groupdict()
            return MegatronParam(kind, int(d["L"]) if "L" in d else None, int(d["E"]) if "E" in d else None), i
    raise KeyError(f"no Megatron mapping for Hugging Face tensor {name!r}")


# --------------------------------------------------------------------------------------------------
# The parameters of a model architecture


def megatron_params(arch) -> list[MegatronParam]:
    """Every parameter of the unsharded GPTModel for ``arch`` (a :class:`ModelArch`), in HF order."""
    K = KINDS
    out = [MegatronParam(K["embedding.word_embeddings.weight"])]
    moe = arch.moe_layer_pattern() if arch.is_moe else [0] * arch.num_hidden_layers
    for layer in range(arch.num_hidden_layers):

        def p(kind, expert=None):
            return MegatronParam(K[kind], layer, expert)

        out += [
            p("decoder.layers.{L}.input_layernorm.weight"),
            p("decoder.layers.{L}.self_attention.linear_qkv.weight"),
        ]
        if arch.qkv_bias:
            out.append(p("decoder.layers.{L}.self_attention.linear_qkv.bias"))
        if arch.qk_norm:
            out += [
                p("decoder.layers.{L}.self_attention.q_layernorm.weight"),
                p("decoder.layers.{L}.self_attention.k_layernorm.weight"),
            ]
        out += [
            p("decoder.layers.{L}.self_attention.linear_proj.weight"),
            p("decoder.layers.{L}.pre_mlp_layernorm.weight"),
        ]
        if moe[layer]:
            out.append(p("decoder.layers.{L}.mlp.router.weight"))
            for e in range(arch.num_experts):
                out += [
                    p("decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc1.weight", e),
                    p("decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc2.weight", e),
                ]
        else:
            out += [p("decoder.layers.{L}.mlp.linear_fc1.weight"), p("decoder.layers.{L}.mlp.linear_fc2.weight")]
    out.append(MegatronParam(K["decoder.final_layernorm.weight"]))
    if not arch.tie_word_embeddings:
        out.append(MegatronParam(K["output_layer.weight"]))
    return out


def hf_shapes(arch) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face checkpoint tensor of ``arch`` and its shape, in checkpoint order."""
    out = {}
    for p in megatron_params(arch):
        for name, s in zip(p.hf_names, _hf_part_shapes(p, arch)):
            out[name] = s
    return out


def _hf_part_shapes(p: MegatronParam, arch) -> list[tuple[int, ...]]:
    H, d = arch.hidden_size, arch.head_dim
    nh, ng, V = arch.num_attention_heads, arch.num_key_value_heads, arch.vocab_size
    k = p.kind.megatron
    if p.kind.vocab:
        return [(V, H)]
    if k.endswith("linear_qkv.weight"):
        return [(nh * d, H), (ng * d, H), (ng * d, H)]
    if k.endswith("linear_qkv.bias"):
        return [(nh * d,), (ng * d,), (ng * d,)]
    if k.endswith(("q_layernorm.weight", "k_layernorm.weight")):
        return [(d,)]
    if k.endswith("linear_proj.weight"):
        return [(H, nh * d)]
    if k.endswith(("layernorm.weight", "linear_proj.bias")):
        return [(H,)]
    if k.endswith("router.weight"):
        return [(arch.num_experts, H)]
    inter = arch.moe_intermediate_size if p.kind.expert else arch.intermediate_size
    if k.endswith("linear_fc1.weight"):
        return [(inter, H), (inter, H)]
    if k.endswith("linear_fc2.weight"):
        return [(H, inter)]
    raise AssertionError(k)  # pragma: no cover - every kind is listed above


def megatron_shape(p: MegatronParam, arch, *, padded_vocab: int | None = None) -> tuple[int, ...]:
    """The full (TP-gathered) Megatron shape of ``p``."""
    parts = _hf_part_shapes(p, arch)
    if p.kind.vocab:
        return (padded_vocab or arch.vocab_size, arch.hidden_size)
    return (sum(s[0] for s in parts),) + parts[0][1:]


# --------------------------------------------------------------------------------------------------
# Layout transforms (full tensors)


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int) -> torch.Tensor:
    """Hugging Face q/k/v (weights ``[n*d, H]`` or biases ``[n*d]``) -> Megatron's interleaved ``linear_qkv``."""
    ng = num_query_groups
    rest = q.shape[1:]
    qg, kg, vg = (t.reshape(ng, -1, *rest) for t in (q, k, v))
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, num_query_groups: int, num_heads: int, head_dim: int):
    """Megatron's interleaved ``linear_qkv`` -> Hugging Face (q, k, v)."""
    ng, d = num_query_groups, head_dim
    qpg = num_heads // ng
    rest = qkv.shape[1:]
    grouped = qkv.reshape(ng, (qpg + 2) * d, *rest)
    q, k, v = torch.split(grouped, [qpg * d, d, d], dim=1)
    return q.reshape(ng * qpg * d, *rest), k.reshape(ng * d, *rest), v.reshape(ng * d, *rest)


def tp_shard(kind: Kind, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s tensor-parallel shard of the full Megatron tensor (a view where possible)."""
    if kind.tp_dim is None or size == 1:
        return full
    if full.shape[kind.tp_dim] % size:
        raise ShapeMismatchError(
            f"{kind.megatron}: dim {kind.tp_dim} of {tuple(full.shape)} is not divisible "
            f"by the tensor-parallel size {size}"
        )
    if kind.fused == "glu":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    return full.chunk(size, dim=kind.tp_dim)[rank]  # qkv: blocks of whole query groups


def tp_unshard(kind: Kind, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full Megatron tensor from all tensor-parallel shards (inverse of :func:`tp_shard`)."""
    if kind.tp_dim is None or len(shards) == 1:
        return shards[0]
    if kind.fused == "glu":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=kind.tp_dim)


# --------------------------------------------------------------------------------------------------
# Megatron <-> Hugging Face for one parameter


def to_hf(p: MegatronParam, full: torch.Tensor, arch) -> list[tuple[str, torch.Tensor]]:
    """Hugging Face ``(name, tensor)`` pairs of the full Megatron tensor ``full`` (views where possible).

    The output layer of a tied model maps to nothing (Hugging Face keeps only ``embed_tokens``).
    """
    if p.kind.megatron == "output_layer.weight" and arch.tie_word_embeddings:
        return []
    names = p.hf_names
    expected = megatron_shape(p, arch, padded_vocab=full.shape[0] if p.kind.vocab else None)
    if tuple(full.shape) != expected:
        raise ShapeMismatchError(
            f"Megatron tensor {p.name}: expected shape {expected} from config.json, got {tuple(full.shape)}"
        )
    if p.kind.vocab:
        if full.shape[0] < arch.vocab_size:
            raise ShapeMismatchError(
                f"Megatron tensor {p.name} has {full.shape[0]} rows, fewer than vocab_size={arch.vocab_size}"
            )
        return [(names[0], full[: arch.vocab_size])]
    if p.kind.fused == "qkv":
        return list(zip(names, split_qkv(full, arch.num_key_value_heads, arch.num_attention_heads, arch.head_dim)))
    if p.kind.fused == "glu":
        return list(zip(names, full.chunk(2, dim=0)))
    return [(names[0], full)]


def from_hf(
    p: MegatronParam,
    get: Callable[[str], torch.Tensor] | Mapping[str, torch.Tensor],
    arch,
    *,
    padded_vocab: int | None = None,
) -> torch.Tensor:
    """The full Megatron tensor of ``p`` built from Hugging Face tensors (``get(name)`` or a mapping).

    Every Hugging Face tensor is checked against the shape ``config.json`` implies. A tied model's output
    layer (a pipeline stage's copy of the embedding) is read from ``model.embed_tokens.weight``.
    """
    lookup = get.__getitem__ if isinstance(get, Mapping) else get
    if p.kind.megatron == "output_layer.weight" and arch.tie_word_embeddings:
        p = MegatronParam(KINDS["embedding.word_embeddings.weight"])
    parts = []
    for name, expected in zip(p.hf_names, _hf_part_shapes(p, arch)):
        t = lookup(name)
        if tuple(t.shape) != expected:
            raise ShapeMismatchError(
                f"Hugging Face tensor {name}: expected shape {expected} from config.json, got {tuple(t.shape)}"
            )
        parts.append(t)
    if p.kind.vocab:
        rows = padded_vocab or arch.vocab_size
        if rows < arch.vocab_size:
            raise ShapeMismatchError(
                f"{p.name}: the model has {rows} vocabulary rows, fewer than vocab_size={arch.vocab_size}"
            )
        if rows == arch.vocab_size:
            return parts[0]
        return torch.cat([parts[0], parts[0].new_zeros(rows - arch.vocab_size, parts[0].shape[1])])
    if p.kind.fused == "qkv":
        return merge_qkv(*parts, arch.num_key_value_heads)
    if p.kind.fused == "glu":
        return torch.cat(parts, dim=0)
    return parts[0]


# --------------------------------------------------------------------------------------------------
# transformers >= 5 in-memory MoE layout

_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def to_transformers_layout(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Checkpoint names (one tensor per expert) -> transformers 5.x module state (fused experts)."""
    out, experts = {}, {}
    for name, t in named:
        m = _PER_EXPERT.match(name)
        if m:
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
        else:
            out[name] = t
    for prefix, parts in experts.items():
        n = 1 + max(e for e, _ in parts)
        try:
            out[prefix + ".gate_up_proj"] = torch.stack(
                [torch.cat([parts[e, "gate_proj"], parts[e, "up_proj"]]) for e in range(n)]
            )
            out[prefix + ".down_proj"] = torch.stack([parts[e, "down_proj"] for e in range(n)])
        except KeyError as exc:
            raise MissingTensorError(f"{prefix}: expert tensor {exc.args[0]} missing") from None
    return out


def from_transformers_layout(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """transformers 5.x fused experts (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``)
    -> checkpoint names (one tensor per expert); other tensors pass through."""
    out = {}
    for name, t in named:
        m = _FUSED_EXPERTS.match(name)
        if not m:
            out[name] = t
            continue
        prefix, what = m.groups()
        for e in range(t.shape[0]):
            if what == "gate_up_proj":
                gate, up = t[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate
                out[f"{prefix}.{e}.up_proj.weight"] = up
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
    return out


def fused_expert_source(name: str) -> tuple[str, int, str] | None:
    """For a per-expert checkpoint name, the fused transformers tensor that holds it: (name, expert, part)."""
    m = _PER_EXPERT.match(name)
    if not m:
        return None
    prefix, e, what = m.group(1), int(m.group(2)), m.group(3)
    return (prefix + (".down_proj" if what == "down_proj" else ".gate_up_proj"), e, what)
