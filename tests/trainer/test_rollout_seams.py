"""The declared rollout seams: every method the trainer calls on a backend or an engine is declared on
:class:`~gspo_mcore.trainer.backends.RolloutBackend` / :class:`~gspo_mcore.rollout.types.RolloutEngine`, and
every concrete backend and engine implements what has no default."""

import ast
import inspect
import os

import pytest

from gspo_mcore.rollout import InProcessEngine, SamplingParams, SGLangEngine
from gspo_mcore.rollout.types import RolloutEngine
from gspo_mcore.trainer.backends import InProcessRollout, RolloutBackend, SGLangRollout
from gspo_mcore.trainer.episodes import AgentRollout, SGLangAgentRollout

BACKENDS = {InProcessRollout: False, SGLangRollout: False, AgentRollout: True, SGLangAgentRollout: True}


@pytest.mark.parametrize("cls", list(BACKENDS), ids=lambda c: c.__name__)
def test_every_backend_implements_the_declared_methods(cls):
    assert issubclass(cls, RolloutBackend)
    assert not cls.__abstractmethods__, f"{cls.__name__} lacks {sorted(cls.__abstractmethods__)}"
    assert cls.runs_episodes is BACKENDS[cls]


def _backend_uses(path: str) -> set[str]:
    """The attributes the module at ``path`` reads on its backend: ``rollout.x``, ``run.rollout.x``,
    ``self.backend.x`` (not ``cfg.rollout.x``, the configuration)."""
    tree = ast.parse(open(path).read())
    used = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if isinstance(v, ast.Name) and v.id == "rollout":
            used.add(node.attr)
        elif isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name):
            if (v.value.id, v.attr) in (("run", "rollout"), ("self", "backend"), ("state", "rollout")):
                used.add(node.attr)
    return used


def test_the_trainer_calls_nothing_undeclared_on_a_backend():
    import gspo_mcore.trainer as trainer

    root = os.path.dirname(trainer.__file__)
    used = set().union(*(_backend_uses(os.path.join(root, f)) for f in ("loop.py", "evaluation.py")))
    assert {"generate", "start_generate", "finish_generate", "runs_episodes"} <= used  # the scan sees the calls
    declared = {name for name in dir(RolloutBackend) if not name.startswith("_")}
    assert used <= declared, f"used on a backend but not declared on RolloutBackend: {sorted(used - declared)}"


def test_a_synchronous_backend_says_so_when_asked_to_generate_in_the_background():
    backend = object.__new__(InProcessRollout)  # nothing built: the default needs no engine
    with pytest.raises(RuntimeError, match=r"InProcessRollout generates synchronously only"):
        backend.start_generate([[1]], 1, SamplingParams(), seed=0)
    with pytest.raises(RuntimeError, match=r"synchronously only"):
        backend.finish_generate(None)


@pytest.mark.parametrize("cls", [InProcessEngine, SGLangEngine], ids=lambda c: c.__name__)
def test_every_engine_runs_turns_as_a_coroutine(cls):
    assert issubclass(cls, RolloutEngine) and not cls.__abstractmethods__
    assert inspect.iscoroutinefunction(cls.generate_turns)
