"""Run ``gspo_mcore.train`` with the rollout backend's ``close`` recorded and the evaluator's set-up made to fail
(after the backend is built, before the first step); prints how often the backend was closed."""

import sys

from gspo_mcore import train
from gspo_mcore.trainer import loop

closed = []
build_backend = loop._rollout_backend


def recording_backend(*args, **kwargs):
    backend = build_backend(*args, **kwargs)
    close = backend.close

    def close_and_record():
        closed.append(True)
        close()

    backend.close = close_and_record
    return backend


class SetupFailed(RuntimeError):
    pass


def failing_evaluator(*args, **kwargs):
    raise SetupFailed("the evaluator's set-up failed")


loop._rollout_backend = recording_backend
loop.Evaluator = failing_evaluator
try:
    train.main(sys.argv[1:])
    print("no failure")
except SetupFailed:
    print(f"backend closed {len(closed)} time(s)")
