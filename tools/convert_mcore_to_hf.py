"""Convert a Megatron-Core checkpoint of a Qwen3 / Qwen3-MoE / Llama / Qwen2 model into a Hugging Face folder.

    python tools/convert_mcore_to_hf.py --mcore ckpt/qwen3-8b-mcore --out hf/qwen3-8b [--max-shard-size 5GB]

``--mcore`` is a folder written by ``convert_hf_to_mcore.py``, a training checkpoint (``step_<N>`` or
the folder holding ``latest``; pass the Hugging Face folder as ``--config``), or a distributed checkpoint
with ``config.json`` beside it. Writes ``config.json``, ``model.safetensors`` (or
``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` above ``--max-shard-size``) and
the tokenizer files the checkpoint folder carries. Runs on one process by default (the checkpoint is
resharded at load); ``--tp/--pp/--ep`` spread a big model over ranks (relaunched under
``torch.distributed.run``). ``--dtype`` sets the written dtype (default: ``config.json``'s).
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
    parser.add_argument("--mcore", required=True, help="converted or training checkpoint folder")
    parser.add_argument("--out", required=True, help="output Hugging Face folder (must not exist or be empty)")
    parser.add_argument(
        "--config", default=None, help="folder with config.json and tokenizer files, if not beside the checkpoint"
    )
    parser.add_argument("--dtype", default="auto", help="auto (config.json's), float32, bfloat16 or float16")
    parser.add_argument(
        "--max-shard-size",
        type=parse_size,
        default="5GB",
        help="split the safetensors files above this size (default 5GB)",
    )
    add_layout_args(parser)
    args = parser.parse_args(argv)

    from gspo_mcore.convert.convert import mcore_to_hf, parse_dtype
    from gspo_mcore.convert.hf_io import read_config
    from gspo_mcore.convert.hf_mapping import check_architecture
    from gspo_mcore.convert.mcore_checkpoint import find_checkpoint
    from gspo_mcore.learner.model_config import load_hf_config

    try:
        dtype = parse_dtype(args.dtype)
        parallel = parallel_config(args)
        _, side = find_checkpoint(args.mcore, args.config)
        config = read_config(side)
        check_architecture(config)
        shape = load_hf_config(config)
        world = preflight_launch(parallel, shape, args.out)
    except (ValueError, KeyError, FileNotFoundError, FileExistsError) as exc:
        return fail(str(exc))
    if world > 1 and not under_torchrun():
        return relaunch(__file__, argv, world)
    files = mcore_to_hf(
        args.mcore,
        args.out,
        parallel,
        config_dir=args.config,
        dtype=dtype,
        max_shard_bytes=args.max_shard_size,
        progress=args.progress,
    )
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"wrote {len(files)} safetensors file(s) to {args.out} ({shape.model_type})")
    return 0


if __name__ == "__main__":  # the checkpoint reader/writer may re-import this module in a helper process
    sys.exit(main())
