"""Load Hugging Face weights into a sharded Megatron model: every rank reads what it holds and slices it.

Call after :func:`gspo_mcore.learner.model.build_model` and BEFORE building the optimizer (the optimizer keeps
its own fp32 copy of the parameters, taken when it is built). Works on any layout: a rank builds the full
Megatron tensor of each of its parameters from the checkpoint
(:func:`~gspo_mcore.learner.hf.mapping.from_hf`) and copies its shard
(:func:`~gspo_mcore.learner.hf.mapping.tp_shard`); no communication.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from gspo_mcore.learner.hf.folder import HFCheckpoint
from gspo_mcore.learner.hf.mapping import (
    MissingTensorError,
    ShapeMismatchError,
    check_architecture,
    from_hf,
    hf_shapes,
    tp_shard,
)
from gspo_mcore.learner.hf.sharding import local_parameters, tp_split
from gspo_mcore.learner.parallel import Layout, current_layout


def check_checkpoint_keys(names, arch) -> None:
    """Raise if the checkpoint lacks a tensor ``arch`` implies, or holds one the model has no place for."""
    expected = hf_shapes(arch)
    present = set(names)
    missing = [n for n in expected if n not in present]
    ignorable = {"lm_head.weight"} if arch.tie_word_embeddings else set()
    unexpected = sorted(n for n in present - set(expected) - ignorable if not n.endswith(".rotary_emb.inv_freq"))
    if missing:
        raise MissingTensorError(
            f"{len(missing)} tensor(s) that config.json implies are missing from the checkpoint, e.g. {missing[:5]}"
        )
    if unexpected:
        raise MissingTensorError(
            f"{len(unexpected)} checkpoint tensor(s) have no place in the "
            f"{arch.model_type} model, e.g. {unexpected[:5]}"
        )


def check_checkpoint(reader: HFCheckpoint, arch) -> None:
    """Check a checkpoint's tensor names and shapes (file headers only) against ``arch``."""
    check_checkpoint_keys(reader.keys(), arch)
    bad = [
        f"{name}: expected {expected}, got {got}"
        for name, expected in hf_shapes(arch).items()
        if (got := reader.shape_of(name)) != expected
    ]
    if bad:
        raise ShapeMismatchError(
            f"{len(bad)} checkpoint tensor(s) do not have the shape config.json implies: " + "; ".join(bad[:10])
        )


@torch.no_grad()
def load_hf_weights(
    model,
    source: str | HFCheckpoint | Mapping[str, torch.Tensor],
    arch=None,
    *,
    progress: bool = False,
    layout: Layout | None = None,
) -> None:
    """Fill ``model`` (this rank's chunk(s)) from a Hugging Face checkpoint folder, reader or state dict.

    ``arch`` defaults to the folder's ``config.json``; ``layout`` (the model's parallel layout) to the
    current one. Raises naming the tensor on any shape mismatch
    and before touching the model if tensors are missing or unexpected.
    """
    from gspo_mcore.learner.model_config import load_hf_config

    if isinstance(source, (str, bytes)) or hasattr(source, "__fspath__"):
        source = HFCheckpoint(source)
    if isinstance(source, HFCheckpoint):
        check_architecture(source.config)
        arch = arch or load_hf_config(source.config)
        check_checkpoint(source, arch)
        get = source.get
    else:
        if arch is None:
            raise ValueError("load_hf_weights(state_dict) needs arch (the model architecture)")
        check_checkpoint_keys(list(source), arch)
        get = source.__getitem__
    layout = layout or current_layout()
    params = local_parameters(model, layout)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(params), desc="loading weights", unit="tensor")
    for lp in params:
        size, rank, _ = tp_split(layout, lp.param)
        target = lp.tensor
        padded = target.shape[0] * size if lp.param.kind.vocab else None
        full = from_hf(lp.param, get, arch, padded_vocab=padded)
        local = tp_shard(lp.param.kind, full, rank, size)
        if tuple(local.shape) != tuple(target.shape):
            raise ShapeMismatchError(
                f"Megatron parameter {lp.local_name} ({lp.param.name}): expected shard shape "
                f"{tuple(target.shape)}, got {tuple(local.shape)} from the checkpoint"
            )
        target.copy_(local)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
