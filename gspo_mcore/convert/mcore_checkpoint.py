"""A converted Megatron-Core model checkpoint: ``megatron.core.dist_checkpointing`` plus the Hugging Face
side files, so that it converts back and can stand in for the Hugging Face folder's config/tokenizer::

    OUT/config.json, generation_config.json, tokenizer files ...   (copied from the Hugging Face folder)
    OUT/gspo_mcore_convert.json                                     (what was converted, how)
    OUT/model/                                                      (the distributed checkpoint)

The distributed checkpoint holds the model's ``sharded_state_dict()``: it loads on any layout
(Megatron reshards at load). Save and load are collectives: every rank calls them.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from gspo_mcore.convert.hf_io import copy_files, side_files
from gspo_mcore.convert.sharding import model_chunks

META_FILE = "gspo_mcore_convert.json"
MODEL_DIR = "model"


def _sharded_state_dict(model):
    chunks = model_chunks(model)
    if len(chunks) != 1:
        raise NotImplementedError("virtual pipeline stages (several model chunks) are not supported here")
    return chunks[0].sharded_state_dict()


def save_model(model, out_dir: str, *, hf_dir: str | None = None, meta: dict | None = None) -> str:
    """Save ``model``'s weights as a distributed checkpoint under ``out_dir/model`` (all ranks call this).

    Rank 0 copies the side files of ``hf_dir`` (config, tokenizer) to ``out_dir`` and writes the metadata.
    Returns the distributed checkpoint folder.
    """
    from megatron.core import dist_checkpointing

    ckpt = os.path.join(out_dir, MODEL_DIR)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        if os.path.isdir(ckpt) and os.listdir(ckpt):
            raise FileExistsError(f"{ckpt} exists and is not empty")
        os.makedirs(ckpt, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    dist_checkpointing.save(_sharded_state_dict(model), ckpt)
    if rank == 0:
        copied = copy_files(hf_dir, out_dir, side_files(hf_dir)) if hf_dir else []
        with open(os.path.join(out_dir, META_FILE), "w") as f:
            json.dump(
                dict(
                    format="megatron-core dist_checkpointing (model only)",
                    model_dir=MODEL_DIR,
                    hf_files=copied,
                    **(meta or {}),
                ),
                f,
                indent=2,
            )
            f.write("\n")
    if dist.is_initialized():
        dist.barrier()
    return ckpt


TRAINING_MODEL_DIR = "megatron"
"""Where a training checkpoint (``gspo_mcore.learner.checkpoint``: ``step_<N>/megatron``) keeps its tensors."""


def find_checkpoint(path: str, config_dir: str | None = None) -> tuple[str, str]:
    """(distributed checkpoint folder, folder of config.json and the side files).

    ``path``: a converted checkpoint folder, a training checkpoint ``step_<N>`` folder or the folder
    holding ``latest``, or a distributed checkpoint itself. ``config.json`` is looked for in
    ``config_dir``, else in ``path`` and beside the distributed checkpoint.
    """
    path = os.path.abspath(path)
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            path = os.path.join(path, f.read().strip())
    candidates = (os.path.join(path, MODEL_DIR), os.path.join(path, TRAINING_MODEL_DIR), path)
    for ckpt in candidates:
        if os.path.isfile(os.path.join(ckpt, "metadata.json")):
            break
    else:
        raise FileNotFoundError(f"no Megatron distributed checkpoint (metadata.json) in any of {list(candidates)}")
    for side in [config_dir] if config_dir else [path, os.path.dirname(ckpt)]:
        if os.path.isfile(os.path.join(side, "config.json")):
            return ckpt, side
    raise FileNotFoundError(
        f"no config.json in {config_dir}"
        if config_dir
        else f"no config.json next to the checkpoint {ckpt} (pass the Hugging Face folder as --config)"
    )


def hf_side_files(side_dir: str) -> list[str]:
    """The files to copy into a Hugging Face folder: those the metadata lists, else every side file."""
    meta = os.path.join(side_dir, META_FILE)
    if os.path.isfile(meta):
        with open(meta) as f:
            files = json.load(f).get("hf_files")
        if files:
            return [f for f in files if os.path.isfile(os.path.join(side_dir, f))]
    return [f for f in side_files(side_dir) if f != META_FILE]


@torch.no_grad()
def load_model(model, ckpt_dir: str) -> None:
    """Load a distributed checkpoint's model weights into ``model`` (any layout; all ranks call this)."""
    from megatron.core import dist_checkpointing

    chunk = model_chunks(model)[0]
    state = dist_checkpointing.load(_sharded_state_dict(model), ckpt_dir)
    # a training checkpoint (step_<N>/megatron) also holds the optimizer, whose common (non-tensor) state the
    # load hands back beside the model's tensors
    state.pop("optimizer", None)
    chunk.load_state_dict(state, strict=True)
