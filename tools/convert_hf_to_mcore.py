"""Convert a Hugging Face Qwen3 / Qwen3-MoE / Llama / Qwen2 folder into a Megatron-Core distributed checkpoint.

    python tools/convert_hf_to_mcore.py --hf path/to/Qwen3-8B --out ckpt/qwen3-8b-mcore [--tp 2 --pp 2 --ep 1]

The architecture, config and every tensor's name and shape are checked first (file headers only). With
more than one rank needed the tool relaunches itself under ``torch.distributed.run`` (or run it under
``torchrun`` yourself); each rank loads its shard and all ranks write the checkpoint. The result
(``OUT/model`` + config/tokenizer files, see ``gspo_mcore.convert.mcore_checkpoint``) loads on any
layout. ``--dtype`` sets the saved dtype (default: ``config.json``'s).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hf", required=True, help="Hugging Face folder (config.json + *.safetensors)")
    parser.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    parser.add_argument("--dtype", default="auto", help="auto (config.json's), float32, bfloat16 or float16")
    from gspo_mcore.convert.launch import (
        add_layout_args,
        fail,
        parallel_config,
        preflight_launch,
        relaunch,
        under_torchrun,
    )

    add_layout_args(parser)
    args = parser.parse_args(argv)

    from gspo_mcore.convert.convert import hf_to_mcore, parse_dtype, preflight_hf

    try:
        dtype = parse_dtype(args.dtype)
        parallel = parallel_config(args)
        _, shape = preflight_hf(args.hf)
        world = preflight_launch(parallel, shape, args.out)
    except (ValueError, KeyError, FileNotFoundError, FileExistsError) as exc:
        return fail(str(exc))
    if world > 1 and not under_torchrun():
        return relaunch(__file__, argv, world)
    ckpt = hf_to_mcore(args.hf, args.out, parallel, dtype=dtype, progress=args.progress)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"wrote {ckpt} ({shape.model_type}, {shape.num_hidden_layers} layers) from {args.hf}")
    return 0


if __name__ == "__main__":  # the checkpoint writer re-imports this module in a helper process
    sys.exit(main())
