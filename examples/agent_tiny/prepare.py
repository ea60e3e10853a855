"""Write the tiny agent job's inputs: ``python -m examples.agent_tiny.prepare --out runs/agent_tiny``."""

import argparse

from examples.agent_tiny.task import prepare

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="runs/agent_tiny")
    parser.add_argument("--num-prompts", type=int, default=4096)
    args = parser.parse_args()
    print(" ".join(f"{k}={v}" for k, v in prepare(args.out, num_prompts=args.num_prompts).items()))
