"""This rank's Megatron parameters under global names, and where each is split (TP, expert-TP, EP, PP).

Megatron names parameters locally: ``decoder.layers.i`` is the stage's ``i``-th layer and
``local_experts.j`` the rank's ``j``-th expert. :func:`local_parameters` renames them with the layer's
``layer_number - 1`` and the expert's global id, and pairs each with its
:class:`~gspo_mcore.learner.hf.mapping.MegatronParam`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from gspo_mcore.learner.hf.mapping import MegatronParam, parse_megatron_name
from gspo_mcore.learner.lora import is_adapter
from gspo_mcore.learner.model import unwrap
from gspo_mcore.learner.parallel import Layout, current_layout

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")  # TEGroupedMLP


def tp_split(layout: Layout, p: MegatronParam) -> tuple[int, int, object]:
    """(size, rank, group) of the tensor-parallel split that applies to ``p`` under ``layout``: expert
    weights follow the expert-TP group, everything else the TP group; unsplit parameters ``(1, 0, None)``."""
    if p.kind.tp_dim is None:
        return 1, 0, None
    if p.kind.expert:
        return layout.etp_size, layout.etp_rank, layout.etp_group
    return layout.tp_size, layout.tp_rank, layout.tp_group


@dataclass(frozen=True)
class LocalParam:
    """One parameter of this rank: its global identity and its local tensor (a shard)."""

    param: MegatronParam
    tensor: torch.Tensor
    """The live parameter (``requires_grad`` stripped by the callers under ``no_grad``)."""
    local_name: str


def model_chunks(model) -> list:
    """The unwrapped ``GPTModel`` chunks of ``model`` (Megatron's list, one DDP module or a GPTModel)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [unwrap(c) for c in chunks]


def local_parameters(model, layout: Layout | None = None) -> list[LocalParam]:
    """This rank's parameters, in module order, under global names. Checks Megatron's split attributes
    against :mod:`~gspo_mcore.learner.hf.mapping` (a Megatron change that moved a split would fail here).
    ``layout``: the model's parallel layout (default: :func:`~gspo_mcore.learner.parallel.current_layout`)."""
    layout = layout or current_layout()
    out = []
    for gpt in model_chunks(model):
        for name, prm in gpt.named_parameters():
            if is_adapter(name):
                continue  # LoRA adapters: exported merged into their base weight (gspo_mcore.learner.lora)
            p = parse_megatron_name(_global_name(gpt, name))
            is_split = bool(getattr(prm, "tensor_model_parallel", False))
            split_size = layout.etp_size if p.kind.expert else layout.tp_size
            # (checked where a split happens: Transformer Engine leaves the attributes off 1-way splits)
            if split_size > 1 and (
                is_split != (p.kind.tp_dim is not None) or (is_split and prm.partition_dim != p.kind.tp_dim)
            ):
                raise RuntimeError(
                    f"{name}: Megatron has tensor_model_parallel={is_split}, partition_dim="
                    f"{getattr(prm, 'partition_dim', None)}; hf_mapping says tp_dim={p.kind.tp_dim}"
                )
            out.append(LocalParam(p, prm, name))
    return out


def _global_name(gpt, name: str) -> str:
    m = _LAYER.match(name)
    if not m:
        return name
    layer = gpt.decoder.layers[int(m.group(1))]
    global_layer = layer.layer_number - 1
    rest = m.group(2)
    e = _LOCAL_EXPERT.match(rest)
    if e:
        rest = f"mlp.experts.local_experts.{layer.mlp.local_expert_indices[int(e.group(1))]}.{e.group(2)}"
    else:
        g = _GROUPED_EXPERT.match(rest)
        if g:
            rest = f"mlp.experts.{g.group(1)}.weight{layer.mlp.local_expert_indices[int(g.group(2))]}"
    return f"decoder.layers.{global_layer}.{rest}"
