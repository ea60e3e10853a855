"""Command-line plumbing shared by ``tools/convert_*.py``: layout arguments, sizes, self-relaunch on N ranks."""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MiB"``, ``"1048576"`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MiB, 1048576)")
    value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {text!r}")
    return value


def add_layout_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE)")
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bars (default: for models of 1 GiB or more)",
    )


def parallel_config(args):
    from gspo_mcore.learner.parallel import ParallelConfig

    return ParallelConfig(tensor=args.tp, pipeline=args.pp, expert=args.ep)


def world_size_for(parallel) -> int:
    """The fewest ranks that fit ``parallel`` (EP lives inside a pipeline stage's data-parallel ranks)."""
    experts = parallel.expert * parallel.expert_tensor_size
    return parallel.pipeline * math.lcm(parallel.tensor * parallel.context, experts)


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def preflight_launch(parallel, arch, out: str) -> int:
    """The conversion tools' checks before any rank starts: the world size (torchrun's, or the fewest ranks
    that fit ``parallel``), the layout against the model ``arch``, and an empty ``out`` (before a relaunch).
    Returns the world size; raises ``ValueError`` / ``FileExistsError`` naming what is wrong."""
    import torch

    from gspo_mcore.learner.parallel import validate_layout

    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else world_size_for(parallel)
    validate_layout(parallel, world, arch, on_gpu=torch.cuda.is_available())
    if os.path.isdir(out) and os.listdir(out) and not under_torchrun():
        raise FileExistsError(f"--out {out} exists and is not empty")
    return world


def relaunch(script: str, argv: list[str], nproc: int) -> int:
    """Run ``script argv`` on ``nproc`` ranks with ``torch.distributed.run``; returns its exit code."""
    from gspo_mcore.platform.launch import torchrun_prefix

    cmd = [*torchrun_prefix(nproc), os.path.abspath(script), *argv]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.call(cmd, env=env)


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2
