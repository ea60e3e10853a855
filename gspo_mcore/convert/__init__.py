"""Hugging Face <-> Megatron-Core conversion for Qwen3 / Qwen3-MoE / Llama / Qwen2.

- :mod:`~gspo_mcore.convert.hf_mapping`: the one name/layout map (pure torch, both directions).
- :func:`hf_buckets`: gather a sharded model (any TP/PP/EP/DP layout) into full Hugging Face tensors, in
  byte-bounded buckets, identical on every rank (the Megatron -> HF converter and the rollout weight sync).
- :func:`load_hf_weights`: fill a sharded model from a Hugging Face folder (each rank slices its shard).
- :mod:`~gspo_mcore.convert.mcore_checkpoint`: the converted Megatron checkpoint (``dist_checkpointing``).
- ``tools/convert_hf_to_mcore.py`` / ``tools/convert_mcore_to_hf.py``: the command-line converters.

Importing this package does not import megatron; the functions do.
"""

from gspo_mcore.convert.export import DEFAULT_BUCKET_BYTES, ExportItem, export_plan, hf_buckets, hf_state_dict
from gspo_mcore.convert.hf_import import check_checkpoint, check_checkpoint_keys, load_hf_weights
from gspo_mcore.convert.hf_io import HFCheckpoint, read_config, write_safetensors
from gspo_mcore.convert.hf_mapping import (
    SUPPORTED_ARCHITECTURES,
    MissingTensorError,
    ShapeMismatchError,
    UnsupportedArchitectureError,
    check_architecture,
    hf_shapes,
    to_transformers_layout,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "ExportItem",
    "HFCheckpoint",
    "MissingTensorError",
    "SUPPORTED_ARCHITECTURES",
    "ShapeMismatchError",
    "UnsupportedArchitectureError",
    "check_architecture",
    "check_checkpoint",
    "check_checkpoint_keys",
    "export_plan",
    "hf_buckets",
    "hf_shapes",
    "hf_state_dict",
    "load_hf_weights",
    "read_config",
    "to_transformers_layout",
    "write_safetensors",
]
