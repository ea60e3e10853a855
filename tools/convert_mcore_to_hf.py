"""Convert a Megatron-Core checkpoint of a Qwen3 / Qwen3-MoE / Llama / Qwen2 model into a Hugging Face folder.

    python tools/convert_mcore_to_hf.py --run runs/x --out hf/x                       # the run's newest good checkpoint
    python tools/convert_mcore_to_hf.py --mcore runs/x/checkpoints/step_123 --out hf/x-123   # a chosen step
    python tools/convert_mcore_to_hf.py --mcore ckpt/qwen3-8b-mcore --out hf/qwen3-8b [--max-shard-size 5GB]

``--run`` is a training run folder (``log.output_dir``): its own checkpoints, wherever it was copied or moved
(a ``checkpoint.dir`` outside it is followed only when it holds none, with a line naming it; see
``gspo_mcore.convert.export_source``); ``--mcore`` is a training checkpoint (``step_<N>``, or the checkpoint
directory holding them: its newest one that validates; an unfinished ``step_<N>.tmp-*`` is refused), a folder
written by ``convert_hf_to_mcore.py``, or a distributed checkpoint with ``config.json`` beside it. The line
printed at the end names the exported step and its manifest's sha256. Training checkpoints
are checked against their manifest first (``--verify``), and their model part is read whatever the layout
and optimizer they were saved with; ``config.json`` and the tokenizer come from the run's ``model.hf_dir``
(and ``template.tokenizer_dir``) unless ``--config`` names a folder. Writes ``config.json``,
``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` above
``--max-shard-size``), the tokenizer files and, for a training checkpoint, ``gspo_mcore_export.json``
(which checkpoint, which step). Runs on one process by default (the checkpoint is resharded at load);
``--tp/--pp/--ep`` spread a big model over ranks (relaunched under ``torch.distributed.run``). ``--dtype``
sets the written dtype (default: ``config.json``'s).

A LoRA run's checkpoint (``lora.rank > 0``; it holds the adapters only) exports, with ``--lora-format``:
``merged`` (default) a full model with ``W + (alpha/r) B A`` in every adapted projection (the base rebuilt as the
run built it: ``model.hf_dir``'s weights, or ``model.init_seed``), or ``peft`` a PEFT adapter folder
(``adapter_config.json`` + ``adapter_model.safetensors``, float32 unless ``--dtype``; the base is the run's
``model.hf_dir``): ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_dir), OUT)``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from gspo_mcore.convert.launch import (
        add_layout_args,
        fail,
        parallel_config,
        parse_size,
        preflight_launch,
        relaunch,
        under_torchrun,
    )

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--mcore", help="training checkpoint (step_<N> or its directory), or converted checkpoint")
    source.add_argument("--run", help="training run folder (log.output_dir): export its newest valid checkpoint")
    parser.add_argument("--out", required=True, help="output Hugging Face folder (must not exist or be empty)")
    parser.add_argument(
        "--config", default=None, help="folder with config.json and tokenizer files, if not beside the checkpoint"
    )
    parser.add_argument(
        "--verify",
        choices=("sha256", "size", "none"),
        default="sha256",
        help="check a training checkpoint's files against its manifest first (default sha256)",
    )
    parser.add_argument("--dtype", default="auto", help="auto (config.json's), float32, bfloat16 or float16")
    parser.add_argument(
        "--max-shard-size",
        type=parse_size,
        default="5GB",
        help="split the safetensors files above this size (default 5GB)",
    )
    parser.add_argument(
        "--lora-format",
        choices=("merged", "peft"),
        default="merged",
        help="a LoRA run's checkpoint: a merged full model (default) or a PEFT adapter folder",
    )
    add_layout_args(parser)
    args = parser.parse_args(argv)

    from gspo_mcore.convert.convert import mcore_to_hf, parse_dtype
    from gspo_mcore.convert.export_source import ExportSourceError, locate
    from gspo_mcore.learner.hf.folder import read_config
    from gspo_mcore.learner.hf.mapping import check_architecture
    from gspo_mcore.learner.model_config import load_hf_config

    try:
        dtype = parse_dtype(args.dtype)
        parallel = parallel_config(args)
        source = locate(args.mcore or args.run, config_dir=args.config, verify=args.verify)
        config = read_config(source.side_dir)
        check_architecture(config)
        arch = load_hf_config(config)
        if args.lora_format == "peft":
            from gspo_mcore.convert.convert import peft_lora

            peft_lora(source)
        world = preflight_launch(parallel, arch, args.out)
    except (ValueError, KeyError, FileNotFoundError, FileExistsError, ExportSourceError) as exc:
        return fail(str(exc))
    rank0 = int(os.environ.get("RANK", "0")) == 0
    ckpt = source.training
    if rank0 and ckpt is not None:
        if ckpt.found_via:
            print(ckpt.found_via, file=sys.stderr)
        for bad, problems in ckpt.skipped:
            print(f"skipping {bad}: not valid ({'; '.join(problems)})", file=sys.stderr)
    if world > 1 and not under_torchrun():  # the ranks export what was checked here, without checking again
        return relaunch(__file__, [*argv, "--verify", "none"] if ckpt is None else _pinned(argv, ckpt.path), world)
    if args.lora_format == "peft":
        from gspo_mcore.convert.convert import mcore_to_peft

        mcore_to_peft(source, args.out, parallel, dtype=dtype)
        if rank0:
            print(f"exported the LoRA adapters of step {ckpt.step} ({ckpt.path}) to {args.out} as a PEFT adapter")
        return 0
    files = mcore_to_hf(
        source,
        args.out,
        parallel,
        dtype=dtype,
        max_shard_bytes=args.max_shard_size,
        progress=args.progress,
    )
    if rank0:
        what = (
            f"step {ckpt.step} ({ckpt.path}; manifest sha256 {ckpt.manifest_sha256})"
            if ckpt is not None
            else source.ckpt_dir
        )
        print(f"exported {what} to {args.out}: {len(files)} safetensors file(s), {arch.model_type}")
    return 0


def _pinned(argv: list[str], step_dir: str) -> list[str]:
    """``argv`` with the source replaced by the checked ``step_dir`` (so every rank reads that one)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--mcore", "--run"):
            skip = True
            continue
        if a.startswith(("--mcore=", "--run=", "--verify=")):
            continue
        out.append(a)
    return [*out, "--mcore", step_dir, "--verify", "none"]


if __name__ == "__main__":  # the checkpoint reader/writer may re-import this module in a helper process
    sys.exit(main())
