"""Entry point: ``torchrun [...] -m gspo_mcore.train --config run.yaml [key.path=value ...]`` (or ``gspo-train``).

The YAML maps onto :class:`gspo_mcore.trainer.TrainConfig`; overrides use dotted keys
(``optim.lr=1e-5 rollout.group_size=16``). Unknown keys are refused with the closest valid key suggested.
The resolved configuration is saved as ``<log.output_dir>/config.yaml``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from gspo_mcore.config import ConfigError, apply_overrides, defaults_tree, from_dict, load_yaml, to_yaml


def parse_config(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(
        prog="gspo-train",
        description=__doc__.splitlines()[0],
        epilog="Every configuration key, its type, default and meaning: docs/config.md. "
        "`gspo-train --print-config [--config X] [overrides]` prints the resolved configuration, every default "
        "filled in, as YAML.",
    )
    parser.add_argument("--config", help="YAML file (see examples/); required unless --print-config")
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the fully resolved configuration (every default filled in) as YAML and exit; without "
        "--config, the defaults, with the required keys null",
    )
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides")
    args = parser.parse_args(argv)
    from gspo_mcore.trainer import TrainConfig

    if args.config is None and (args.overrides or not args.print_config):
        parser.error("the following arguments are required: --config")
    if args.print_config:
        print(_resolved_yaml(TrainConfig, args.config, args.overrides), end="")
        parser.exit(0)
    return from_dict(TrainConfig, apply_overrides(load_yaml(args.config), args.overrides))


def _resolved_yaml(cls, path: str | None, overrides: list[str]) -> str:
    """``--print-config``: the resolved run configuration as YAML; without a file, every default."""
    if path is None:
        tree, required = defaults_tree(cls)
        return f"# every default; required (null here): {', '.join(required)}\n" + to_yaml(tree)
    from gspo_mcore.trainer import resolve

    return to_yaml(resolve(from_dict(cls, apply_overrides(load_yaml(path), overrides))))


def main(argv: list[str] | None = None) -> int:
    _log_to_stderr()
    try:
        cfg = parse_config(argv)
    except ConfigError as exc:
        print(f"gspo-train: config error: {exc}", file=sys.stderr)
        return 2
    from gspo_mcore.trainer import run

    history = run(cfg)
    from gspo_mcore.learner import destroy_parallel

    destroy_parallel()
    if history and os.environ.get("RANK", "0") == "0":
        first, last = history[0], history[-1]
        print(
            f"gspo-train: {len(history)} steps; reward_mean {first['reward_mean']:.3f} -> {last['reward_mean']:.3f}; "
            f"metrics in {cfg.log.output_dir}/metrics.jsonl",
            flush=True,
        )
    return 0


def _log_to_stderr() -> None:
    """The package's INFO messages (evaluations, warnings) on stderr, rank 0's only; third-party loggers keep
    their own levels."""
    log = logging.getLogger("gspo_mcore")
    if log.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[gspo_mcore] %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING)
    log.propagate = False


if __name__ == "__main__":  # guarded: Megatron's async checkpoint writer re-imports the main module
    sys.exit(main())
