"""Entry point: ``torchrun [...] -m gspo_mcore.train --config run.yaml [key.path=value ...]`` (or ``gspo-train``).

The YAML maps onto :class:`gspo_mcore.trainer.TrainConfig`; overrides use dotted keys
(``optim.lr=1e-5 rollout.group_size=16``). Unknown keys are refused with the closest valid key suggested.
The resolved configuration is saved as ``<log.output_dir>/config.yaml``.

Errors. An input error (configuration, model folder, data, evaluation sets, rewards, run folder, checkpoint:
see :mod:`gspo_mcore.trainer.preflight`) prints one line on rank 0, ``gspo-train: <kind> error: <what>``,
and exits with status 2 on every rank: ``gspo-train`` or ``python -m gspo_mcore.train`` exits with status 2;
under ``torchrun`` each rank does (its summary shows ``exitcode : 2``), and torchrun itself exits with status 1,
as it does whenever a rank fails (it does not pass a rank's status on). Anything else is a bug or a failure of
the machine: the entry point is wrapped with torch.distributed.elastic's ``record``, so under ``torchrun`` its
traceback is written to the error file and torchrun's summary shows the root cause.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from gspo_mcore.config import apply_overrides, defaults_tree, from_dict, load_yaml, to_yaml

INPUT_ERROR_STATUS = 2


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


@record
def main(argv: list[str] | None = None) -> int:
    _log_to_stderr()
    from gspo_mcore.trainer import run
    from gspo_mcore.trainer.preflight import input_kind_of

    try:
        cfg = parse_config(argv)
        history = run(cfg)
    except Exception as exc:
        kind = input_kind_of(exc)
        if kind is None:
            raise  # not an input error: ``record`` hands the traceback to torchrun
        _report_once(f"gspo-train: {kind} error: {one_line(exc)}")
        return INPUT_ERROR_STATUS
    if history and _rank() == 0:
        first, last = history[0], history[-1]
        print(
            f"gspo-train: {len(history)} steps; reward_mean {first['reward_mean']:.3f} -> {last['reward_mean']:.3f}; "
            f"metrics in {cfg.log.output_dir}/metrics.jsonl",
            flush=True,
        )
    return 0


def one_line(exc: BaseException) -> str:
    """An error's message on one line (a multi-line message's lines joined by `` | ``)."""
    message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    return " | ".join(lines) or type(exc).__name__


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


PRINTED_KEY = "gspo_train/input_error_printed"
WAIT_FOR_RANK0_S = 60


def _report_once(line: str) -> None:
    """Rank 0 prints ``line``; the other ranks (which found the same error: the checks read the same inputs)
    print nothing and return only once rank 0 has printed, so that torchrun, which stops every rank when one
    exits with an error, cannot stop rank 0 before it printed. They learn it through torchrun's own key-value
    store (``TORCHELASTIC_USE_AGENT_STORE``); without one (no torchrun) there is nothing to wait for."""
    store = _agent_store()
    key = f"{PRINTED_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if _rank() == 0:
        print(line, file=sys.stderr, flush=True)
        if store is not None:
            store.set(key, "1")
    elif store is not None:
        import datetime

        try:
            store.wait([key], datetime.timedelta(seconds=WAIT_FOR_RANK0_S))
        except Exception:  # rank 0 did not fail the same way (or is gone): exit anyway
            pass


def _agent_store():
    """A client of torchrun's key-value store, or ``None`` outside torchrun."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true" or "MASTER_PORT" not in os.environ:
        return None
    import datetime

    from torch.distributed import TCPStore

    try:
        return TCPStore(
            os.environ.get("MASTER_ADDR", "127.0.0.1"),
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=WAIT_FOR_RANK0_S),
        )
    except Exception:  # the store is torchrun's business: no wait is better than a second error
        return None


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
