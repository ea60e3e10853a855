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

from gspo_mcore.learner.hf.folder import copy_files, side_files
from gspo_mcore.learner.hf.sharding import model_chunks

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
def load_model(model, source) -> None:
    """Load a checkpoint's model weights into ``model`` (any layout; all ranks call this).

    ``source``: an :class:`~gspo_mcore.convert.export_source.ExportSource` or a converted checkpoint's
    distributed checkpoint folder. A training checkpoint's model part is read through the trainer's own
    loader (:func:`~gspo_mcore.learner.checkpoint.load_model_and_optimizer` without an optimizer: the
    optimizer state beside it is left on disk), so every layout it saves reads back here. A LoRA run's
    checkpoint holds its adapters only: load the base into ``model`` first (``gspo_mcore.convert.convert``).
    """
    from megatron.core import dist_checkpointing

    training = getattr(source, "training", None)
    if training is not None:
        from gspo_mcore.learner.checkpoint import load_model_and_optimizer

        state = training.trainer_state
        load_model_and_optimizer(
            training.megatron_dir,
            model_chunks(model),
            None,
            saved_optimizer=state["optimizer"],
            saved_layout=state["layout"],
            layout=state["layout"],
            part=state.get("model", "all"),  # LoRA's adapters only: the caller loaded the base
        )
        return
    ckpt_dir = getattr(source, "ckpt_dir", source)
    chunk = model_chunks(model)[0]
    state = dist_checkpointing.load(_sharded_state_dict(model), ckpt_dir)
    chunk.load_state_dict(state, strict=True)
