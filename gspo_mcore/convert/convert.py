"""Whole-checkpoint conversions, Hugging Face folder <-> converted Megatron checkpoint (any layout).

Both run on this process's ranks (1 process, or every rank of a ``torchrun`` launch: all ranks call
them) and set up and tear down the process groups themselves. The command-line tools in ``tools/`` are
thin wrappers around :func:`hf_to_mcore` and :func:`mcore_to_hf`.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from gspo_mcore.convert.export_source import ExportSource, locate
from gspo_mcore.convert.mcore_checkpoint import hf_side_files, load_model, save_model
from gspo_mcore.learner.hf.export import DEFAULT_BUCKET_BYTES, export_plan, hf_buckets
from gspo_mcore.learner.hf.folder import HFCheckpoint, copy_files, read_config, side_files, write_safetensors
from gspo_mcore.learner.hf.load import check_checkpoint, load_hf_weights
from gspo_mcore.learner.hf.mapping import check_architecture

PROGRESS_MIN_BYTES = 1 << 30
"""Show progress bars for models at least this large (``progress=None``)."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | None) -> torch.dtype | None:
    """``float32``, ``bfloat16``, ``float16`` (or ``fp32``, ``bf16``, ``fp16``) -> dtype; None/``auto`` -> None."""
    if name in (None, "auto"):
        return None
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}
    key = aliases.get(name, name).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[key]


def config_dtype(config: dict) -> torch.dtype | None:
    """The dtype a Hugging Face ``config.json`` declares (``dtype``, or the older ``torch_dtype``), if one
    of float32/bfloat16/float16."""
    try:
        return parse_dtype(config.get("dtype") or config.get("torch_dtype"))
    except ValueError:
        return None


def preflight_hf(hf_dir: str):
    """Everything checkable without megatron: architecture, config, tensor names and shapes.

    Returns ``(reader, shape)``.
    """
    from gspo_mcore.learner.model_config import load_hf_config

    reader = HFCheckpoint(hf_dir)
    check_architecture(reader.config)
    arch = load_hf_config(reader.config)
    check_checkpoint(reader, arch)
    return reader, arch


def _teardown(owned: bool) -> None:
    """Destroy the groups this call created (only Megatron's if the caller had initialised torch.distributed)."""
    from megatron.core import parallel_state as ps

    from gspo_mcore.learner.parallel import destroy_parallel

    if owned:
        destroy_parallel()
    elif ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _show_progress(progress: bool | None, nbytes: int) -> bool:
    return _rank() == 0 and (progress if progress is not None else nbytes >= PROGRESS_MIN_BYTES)


def hf_to_mcore(
    hf_dir: str, out_dir: str, parallel=None, *, dtype: torch.dtype | None = None, progress: bool | None = None
) -> str:
    """Convert a Hugging Face folder into a Megatron checkpoint at ``out_dir`` (see ``mcore_checkpoint``).

    ``parallel``: the :class:`~gspo_mcore.learner.ParallelConfig` to load and save with (the world must
    fit it); ``dtype``: the saved dtype (default: ``config.json``'s, else the model's). Returns the
    distributed checkpoint folder.
    """
    from megatron.core import __version__ as mcore_version

    from gspo_mcore.learner.model import build_model
    from gspo_mcore.learner.parallel import ParallelConfig, init_parallel

    parallel = parallel or ParallelConfig()
    reader, arch = preflight_hf(hf_dir)
    dtype = dtype or config_dtype(reader.config)
    owned = not dist.is_initialized()
    layout = init_parallel(parallel, arch)
    try:
        model = build_model(arch, parallel, seed=None, wrap_ddp=False)
        nbytes = sum(p.numel() * p.element_size() for p in model[0].parameters()) * layout.world_size
        load_hf_weights(model, reader, arch, progress=_show_progress(progress, nbytes), layout=layout)
        if dtype is not None:
            model[0].to(dtype)
        meta = dict(
            source=os.path.abspath(hf_dir),
            model_type=arch.model_type,
            dtype=str(next(model[0].parameters()).dtype).removeprefix("torch."),
            saved_with=dict(
                tensor=parallel.tensor, pipeline=parallel.pipeline, expert=parallel.expert, world_size=layout.world_size
            ),
            megatron_core=mcore_version,
        )
        return save_model(model, out_dir, hf_dir=hf_dir, meta=meta)
    finally:
        _teardown(owned)


def mcore_to_hf(
    mcore_dir: str | ExportSource,
    out_dir: str,
    parallel=None,
    *,
    config_dir: str | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    progress: bool | None = None,
    verify: str = "sha256",
) -> list[str]:
    """Convert a Megatron checkpoint (converted or trained) into a Hugging Face folder at ``out_dir``.

    ``mcore_dir``: anything :func:`~gspo_mcore.convert.export_source.locate` accepts (a run folder, a
    training checkpoint directory or ``step_<N>``, a converted folder), or its result; ``config_dir``:
    where ``config.json`` and the tokenizer files are, if not found from the checkpoint; ``verify``: how a
    training checkpoint is checked before use (``sha256``, ``size``, ``none``); ``dtype``: the written
    dtype (default: ``config.json``'s, else the parameters'). Rank 0 writes. Returns the safetensors
    files written.
    """
    from gspo_mcore.learner.model import build_model
    from gspo_mcore.learner.model_config import load_hf_config
    from gspo_mcore.learner.parallel import ParallelConfig, init_parallel

    parallel = parallel or ParallelConfig()
    source = mcore_dir
    if not isinstance(source, ExportSource):
        source = locate(mcore_dir, config_dir=config_dir, verify=verify)
    config = read_config(source.side_dir)
    check_architecture(config)
    arch = load_hf_config(config)
    declared = config_dtype(config)
    dtype = dtype or declared
    owned = not dist.is_initialized()
    layout = init_parallel(parallel, arch)
    try:
        lora = _run_lora(source)
        base_seed = _base_seed(source)
        model = build_model(arch, parallel, seed=base_seed, wrap_ddp=False, lora=lora)
        if adapters_only(source) and base_seed is None:  # the base as the run built it at its start
            load_hf_weights(model, source.side_dir, arch, layout=layout)
        load_model(model, source)
        plan = export_plan(model, arch, dtype=dtype, layout=layout)
        total = sum(it.nbytes for it in plan)
        buckets = hf_buckets(model, arch, bucket_bytes=bucket_bytes, dtype=dtype, plan=plan, layout=layout)
        files = []
        if _rank() == 0:
            bar = None
            if _show_progress(progress, total):
                from tqdm import tqdm

                bar = tqdm(total=total, unit="B", unit_scale=True, desc="writing safetensors")
            named = (pair for bucket in buckets for pair in bucket)
            files = write_safetensors(
                out_dir, named, [(it.name, it.nbytes) for it in plan], max_shard_bytes=max_shard_bytes, progress=bar
            )
            if bar is not None:
                bar.close()
            _write_side_files(source, out_dir)
            if dtype is not None and dtype != declared:  # keep config.json truthful about the weights
                config["dtype"] = str(dtype).removeprefix("torch.")
                config.pop("torch_dtype", None)
                with open(os.path.join(out_dir, "config.json"), "w") as f:
                    json.dump(config, f, indent=2, sort_keys=True)
                    f.write("\n")
        else:
            for _ in buckets:
                pass
        if dist.is_initialized():
            dist.barrier()
        return files
    finally:
        _teardown(owned)


EXPORT_META_FILE = "gspo_mcore_export.json"
"""Written into a folder exported from a training checkpoint: which checkpoint (path, step, config hash)."""
_NOT_TOKENIZER = ("config.json", "generation_config.json")


def adapters_only(source: ExportSource) -> bool:
    """Whether ``source`` is a LoRA run's training checkpoint, which holds the adapters only (the
    ``trainer_state.json``'s ``model: adapters``)."""
    return source.training is not None and source.training.trainer_state.get("model") == "adapters"


def _base_seed(source: ExportSource) -> int | None:
    """The seed the run initialised its base from (``model.init_seed``) when a LoRA checkpoint's base is not a
    Hugging Face folder's weights (``model.load_hf_weights: false``); ``None`` otherwise."""
    if not adapters_only(source):
        return None
    model = source.training.run_config.get("model") or {}
    if model.get("load_hf_weights"):
        return None
    return int(model.get("init_seed", 1234))


def mcore_to_peft(
    mcore_dir: str | ExportSource,
    out_dir: str,
    parallel=None,
    *,
    config_dir: str | None = None,
    dtype: torch.dtype | None = None,
    verify: str = "sha256",
) -> list[str]:
    """Write a LoRA run's adapters (a training checkpoint, see :func:`mcore_to_hf` for ``mcore_dir``) as a PEFT
    adapter folder at ``out_dir`` (:mod:`gspo_mcore.learner.hf.export_peft`): ``adapter_config.json`` naming the
    run's ``model.hf_dir`` as the base, ``adapter_model.safetensors`` in ``dtype`` (default float32). Only the
    adapters are read (the base weights are not needed). Returns the files written (rank 0)."""
    from gspo_mcore.learner.hf.export_peft import adapter_config, peft_tensors, projection_names, write_peft_adapter
    from gspo_mcore.learner.lora import global_adapters
    from gspo_mcore.learner.model import build_model
    from gspo_mcore.learner.model_config import load_hf_config
    from gspo_mcore.learner.parallel import ParallelConfig, init_parallel

    parallel = parallel or ParallelConfig()
    source = mcore_dir
    if not isinstance(source, ExportSource):
        source = locate(mcore_dir, config_dir=config_dir, verify=verify)
    lora = peft_lora(source)
    config = read_config(source.side_dir)
    check_architecture(config)
    arch = load_hf_config(config)
    owned = not dist.is_initialized()
    init_parallel(parallel, arch)
    try:
        # the base's values do not matter here (Megatron's own initialisation): only the adapters are read
        model = build_model(arch, parallel, seed=None, wrap_ddp=False, lora=lora)
        load_model(model, source)
        tensors = peft_tensors(global_adapters(model), arch, dtype=dtype or torch.float32)
        files = []
        if _rank() == 0:
            base = (source.training.run_config.get("model") or {}).get("hf_dir") or source.side_dir
            cfg = adapter_config(lora, base_model=base, targets=projection_names(tensors))
            files = write_peft_adapter(out_dir, tensors, cfg)
            _write_side_files(source, out_dir, model_files=False)
        if dist.is_initialized():
            dist.barrier()
        return files
    finally:
        _teardown(owned)


def peft_lora(source: ExportSource):
    """The LoRA config of the run whose adapters a PEFT export writes; raises ``ValueError`` when ``source`` is not
    a LoRA run's training checkpoint."""
    lora = _run_lora(source)
    if lora is None:
        where = source.training.path if source.training is not None else source.ckpt_dir
        raise ValueError(
            f"--lora-format peft: {where} is not a LoRA run's training checkpoint (lora.rank 0, or a converted "
            "model): it has no adapters to write; export it without --lora-format peft"
        )
    return lora


def _run_lora(source: ExportSource):
    """The ``lora`` section of the run that wrote a training checkpoint, or ``None`` (full fine-tuning, or a converted
    folder): its adapters are loaded with the model and written merged into their base weights (``W + (alpha/r) B
    A``, gspo_mcore.learner.lora)."""
    section = (source.training.run_config.get("lora") if source.training is not None else None) or {}
    if not section.get("rank"):
        return None
    from gspo_mcore.learner.lora import LoraConfig

    return LoraConfig(**section)


def _write_side_files(source: ExportSource, out_dir: str, *, model_files: bool = True) -> None:
    """config.json and the other side files (``model_files``; a PEFT adapter folder has none); the tokenizer's
    from its own folder when the run had one; the provenance of a training checkpoint."""
    if model_files:
        copy_files(source.side_dir, out_dir, hf_side_files(source.side_dir))
    if source.tokenizer_dir is not None and model_files:
        files = [f for f in side_files(source.tokenizer_dir) if f not in _NOT_TOKENIZER]
        copy_files(source.tokenizer_dir, out_dir, files)
    ckpt = source.training
    if ckpt is not None:
        meta = dict(
            checkpoint=ckpt.path,
            step=ckpt.step,
            config_sha256=ckpt.config_sha256,
            hf_dir=source.side_dir,
            tokenizer_dir=source.tokenizer_dir or source.side_dir,
            saved_layout=ckpt.trainer_state.get("layout"),
        )
        with open(os.path.join(out_dir, EXPORT_META_FILE), "w") as f:
            json.dump(meta, f, indent=2)
            f.write("\n")
