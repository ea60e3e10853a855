"""Hugging Face checkpoint folders: read safetensors lazily, write (sharded) safetensors, copy side files.

:class:`HFCheckpoint` reads ``model.safetensors``, ``model.safetensors.index.json`` + shards, or any
``*.safetensors`` in the folder, and presents tensors under checkpoint names (one tensor per expert),
also when a file holds transformers 5.x fused experts. :func:`write_safetensors` writes what
``save_pretrained`` would: one ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` files and
an index when the total exceeds ``max_shard_bytes``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable

import torch

from gspo_mcore.learner.hf.mapping import MissingTensorError, fused_expert_source

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".distcp")
_WEIGHT_INDEXES = (INDEX_FILE, "pytorch_model.bin.index.json")


def read_config(path: str) -> dict:
    """``config.json`` of a folder (or the file itself) as a dict."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json at {path}")
    with open(path) as f:
        return json.load(f)


class HFCheckpoint:
    """Lazy reader of a Hugging Face safetensors checkpoint folder."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = os.fspath(path)
        self.config = read_config(self.path)
        index = os.path.join(self.path, INDEX_FILE)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
            weight_map = None
        if not files:
            other = [f for f in os.listdir(self.path) if f.endswith(_WEIGHT_SUFFIXES)]
            raise FileNotFoundError(
                f"no *.safetensors weights in {self.path}"
                + (f" (found {other}; only safetensors is supported)" if other else "")
            )
        self._handles = {f: safe_open(os.path.join(self.path, f), framework="pt") for f in files}
        stored = {}
        for f, h in self._handles.items():
            for name in h.keys():
                if weight_map is not None and weight_map.get(name) != f:
                    continue
                stored[name] = f
        self._stored = stored
        self._virtual = {}  # per-expert name -> (fused name, expert, part) for transformers 5.x fused files
        for name in stored:
            if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                num = self._handles[stored[name]].get_slice(name).get_shape()[0]
                prefix = name.rsplit(".", 1)[0]
                parts = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
                for e in range(num):
                    for part in parts:
                        self._virtual[f"{prefix}.{e}.{part}.weight"] = (name, e, part)

    def keys(self) -> list[str]:
        """Checkpoint names (per expert), fused transformers names replaced by their per-expert names."""
        fused = {v[0] for v in self._virtual.values()}
        return [n for n in self._stored if n not in fused] + list(self._virtual)

    def __contains__(self, name: str) -> bool:
        return name in self._stored or name in self._virtual

    def shape_of(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, from the file header (nothing is read)."""
        if name in self._virtual:
            fused, _, part = self._virtual[name]
            _, rows, cols = self.shape_of(fused)
            return (rows, cols) if part == "down_proj" else (rows // 2, cols)
        if name not in self._stored:
            raise MissingTensorError(f"tensor {name} is not in the checkpoint {self.path}")
        return tuple(self._handles[self._stored[name]].get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        if name in self._stored:
            return self._handles[self._stored[name]].get_tensor(name)
        if name in self._virtual:
            fused, e, part = self._virtual[name]
            t = self._handles[self._stored[fused]].get_slice(fused)[e]
            if part == "down_proj":
                return t
            gate, up = t.chunk(2, dim=0)
            return (gate if part == "gate_proj" else up).contiguous()
        hint = fused_expert_source(name)
        raise MissingTensorError(
            f"tensor {name} is not in the checkpoint {self.path}" + (f" (nor its fused form {hint[0]})" if hint else "")
        )


def write_safetensors(
    out_dir: str,
    named: Iterable[tuple[str, torch.Tensor]],
    sizes: list[tuple[str, int]],
    *,
    max_shard_bytes: int = 5 * 2**30,
    progress=None,
) -> list[str]:
    """Write ``named`` (in the order of ``sizes``: ``(name, nbytes)`` for every tensor) as safetensors.

    Returns the files written. ``progress``: a tqdm-like object updated with bytes written, or ``None``.
    """
    from safetensors.torch import save_file

    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    file_of, shards, size = {}, 0, 0
    for name, nbytes in sizes:
        if size and size + nbytes > max_shard_bytes:
            shards, size = shards + 1, 0
        file_of[name] = shards
        size += nbytes
    n = shards + 1
    names = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    pending: dict[int, dict[str, torch.Tensor]] = {}
    remaining = {i: sum(1 for f in file_of.values() if f == i) for i in range(n)}
    os.makedirs(out_dir, exist_ok=True)
    for name, t in named:
        if name not in file_of:
            raise KeyError(f"{name} was not announced in sizes")
        i = file_of[name]
        pending.setdefault(i, {})[name] = t.detach().to("cpu", copy=True).contiguous()
        remaining[i] -= 1
        if remaining[i] == 0:
            save_file(pending.pop(i), os.path.join(out_dir, names[i]), metadata={"format": "pt"})
        if progress is not None:
            progress.update(t.numel() * t.element_size())
    if pending or any(remaining.values()):
        missing = [k for k, f in file_of.items() if remaining[f]]
        raise MissingTensorError(f"tensors announced but not given: {missing[:10]}")
    if n > 1:
        index = {
            "metadata": {"total_size": sum(s for _, s in sizes)},
            "weight_map": {k: names[f] for k, f in sorted(file_of.items())},
        }
        with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
            f.write("\n")
    return names


def side_files(src_dir: str) -> list[str]:
    """The non-weight files of a Hugging Face folder: config, generation config, tokenizer, chat template."""
    out = []
    for f in sorted(os.listdir(src_dir)):
        p = os.path.join(src_dir, f)
        weights = f.endswith(_WEIGHT_SUFFIXES) or f in _WEIGHT_INDEXES
        if os.path.isfile(p) and not f.startswith(".") and not weights:
            out.append(f)
    return out


def copy_files(src_dir: str, dst_dir: str, files: Iterable[str]) -> list[str]:
    os.makedirs(dst_dir, exist_ok=True)
    copied = []
    for f in files:
        shutil.copyfile(os.path.join(src_dir, f), os.path.join(dst_dir, f))
        copied.append(f)
    return copied
