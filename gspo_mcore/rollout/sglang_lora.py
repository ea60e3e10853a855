"""How a LoRA run reaches SGLang servers: ``rollout.sglang.lora_mode``.

- ``merged`` (the default; the only mode on a CPU): the learner merges ``W + (alpha/r) B A`` into the exported
  weights and pushes them through the ordinary weight sync (``weight_sync``: tensor, disk or distributed). The
  servers run the plain base model; every push is the whole model's size.
- ``adapter`` (GPU servers): the servers run the base model with LoRA enabled (:func:`server_lora_args`), and each
  update pushes only the adapter, in PEFT's names and ``adapter_config.json``, as a new adapter version
  (:func:`adapter_name`; SGLang 0.5.23 loads a name once) through ``/load_lora_adapter_from_tensors``
  (``weight_sync: tensor``, colocated servers) or ``/load_lora_adapter`` from a PEFT folder (``weight_sync: disk``),
  then sets the servers' weight version (an adapter load leaves it alone), names the adapter in every
  ``/generate`` (``lora_path``) and unloads the previous version. Every push is the adapter's size
  (:func:`adapter_nbytes`).

SGLang 0.5.23 cannot serve LoRA on a CPU: its LoRA layers (``srt/lora/layers.py``) create pinned-memory tensors
and its torch backend pins every batch, and pinning memory needs a GPU driver (``RuntimeError: Found no NVIDIA
driver``), so a server started with ``--enable-lora`` there fails at start-up. :func:`check_lora_mode` refuses
``adapter`` without a GPU, with that reason.
"""

from __future__ import annotations

from collections.abc import Sequence

LORA_MODES = ("merged", "adapter")
ADAPTER_PREFIX = "gspo-policy-v"
CPU_REASON = (
    "SGLang 0.5.23 cannot serve LoRA adapters on a CPU: its LoRA layers pin memory (srt/lora/layers.py, and the "
    "torch backend's prepare_lora_batch), which needs a GPU driver, so a server started with --enable-lora fails "
    "at start-up"
)


def adapter_name(version: int) -> str:
    """The adapter name of weight version ``version`` (a new name per version: SGLang refuses a loaded name)."""
    return f"{ADAPTER_PREFIX}{int(version)}"


def server_lora_args(rank: int, target_modules: Sequence[str]) -> list[str]:
    """``sglang.launch_server`` arguments that enable LoRA for adapters of ``rank`` on the Hugging Face projections
    ``target_modules`` (``q_proj``...; SGLang needs both when no ``--lora-paths`` is given). The adapter is loaded
    after start-up, one version at a time."""
    if rank < 1:
        raise ValueError(f"server_lora_args: rank must be >= 1, got {rank}")
    if not target_modules:
        raise ValueError("server_lora_args: no target modules")
    return ["--enable-lora", "--max-lora-rank", str(int(rank)), "--lora-target-modules", *target_modules]


def check_lora_mode(mode: str, *, lora_rank: int, weight_sync: str, has_gpu: bool) -> None:
    """Refuse, naming the key, a ``rollout.sglang.lora_mode`` that cannot run (at start-up)."""
    if mode not in LORA_MODES:
        raise ValueError(f"rollout.sglang.lora_mode must be one of {list(LORA_MODES)}, got {mode!r}")
    if mode == "merged":
        return
    if lora_rank < 1:
        raise ValueError("rollout.sglang.lora_mode: adapter needs LoRA (lora.rank >= 1); use merged (the default)")
    if weight_sync not in ("tensor", "disk"):
        raise ValueError(
            f"rollout.sglang.lora_mode: adapter with weight_sync={weight_sync!r}: SGLang 0.5.23 loads adapters from "
            "tensors (weight_sync: tensor) or from a folder (weight_sync: disk) only"
        )
    if not has_gpu:
        raise ValueError(
            f"rollout.sglang.lora_mode: adapter refused on this machine (no GPU): {CPU_REASON}; use merged"
        )


def adapter_nbytes(tensors: dict) -> int:
    """Bytes of an adapter push: the PEFT tensors' sizes (what one ``adapter`` weight sync sends per server rank)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


__all__ = [
    "ADAPTER_PREFIX",
    "CPU_REASON",
    "LORA_MODES",
    "adapter_name",
    "adapter_nbytes",
    "check_lora_mode",
    "server_lora_args",
]
