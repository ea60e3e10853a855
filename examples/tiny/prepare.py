"""Write the tiny job's inputs: ``python -m examples.tiny.prepare --out runs/tiny [--moe]``."""

import argparse

from examples.tiny.task import prepare

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="runs/tiny")
    parser.add_argument("--moe", action="store_true", help="also write the MoE model directory")
    parser.add_argument("--num-prompts", type=int, default=4096)
    args = parser.parse_args()
    paths = prepare(args.out, num_prompts=args.num_prompts)
    if args.moe:
        paths.update(moe_model_dir=prepare(args.out, moe=True, num_prompts=args.num_prompts)["model_dir"])
    print(" ".join(f"{k}={v}" for k, v in paths.items()))
