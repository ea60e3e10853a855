"""The package's import rules, read from the source with ``ast`` (no import is executed).

The layers, lowest first::

    ops      <-  algo  <-  {learner, rollout}  <-  trainer  <-  train
    sandbox  <-  {rewards, envs}  <-  trainer
    data     <-  {envs, trainer}

(``platform`` sits over ops and under learner and rollout: its CPU modules run the compiled kernels of ops;
``convert`` over the learner, ``metrics`` over algo; ``ALLOWED``
below is the exact list.)

- a package imports only from its own layer's allowed set (``ALLOWED``): nothing imports upward;
- ``learner`` and ``rollout`` never import each other (the trainer wires them);
- only ``learner`` (its Hugging Face weight I/O in ``learner.hf``), ``convert`` (the offline checkpoint converters,
  above the learner) and ``platform`` (the one adapter of third-party libraries to a CPU host) import ``megatron``;
- only ``rollout`` speaks to SGLang: it alone imports ``sglang`` or an HTTP client;
- only ``envs`` serves HTTP (the agent endpoint, ``envs/endpoint.py``): besides ``rollout`` it alone imports
  ``aiohttp``, and nothing else of ``HTTP_CLIENTS`` (``HTTP_SERVER_OK``).

``config`` (the typed-config helpers) and the compiled ``_C`` are importable from anywhere. A new package must be
given its place in ``ALLOWED`` before this test passes: a layer is a decision, not an accident.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "gspo_mcore"

BASE = {"config", "_C"}
"""Importable from every module of the package."""

ALLOWED: dict[str, set[str]] = {
    "config": set(),
    "ops": {"ops"},
    "platform": {"platform", "ops"},
    "algo": {"ops", "algo"},
    "data": {"data"},
    "sandbox": {"sandbox"},
    "rewards": {"rewards", "sandbox"},
    "envs": {"envs", "sandbox", "data"},
    "learner": {"ops", "algo", "learner", "platform"},
    "convert": {"convert", "learner", "platform"},
    "rollout": {"ops", "algo", "rollout", "platform"},
    "metrics": {"algo"},
    "trainer": {
        "ops",
        "algo",
        "learner",
        "convert",
        "rollout",
        "rewards",
        "data",
        "envs",
        "metrics",
        "platform",
        "trainer",
    },
    "train": {"trainer"},
}
"""For each top-level package (or module) of ``gspo_mcore``, the packages it may import from."""

EXCEPTIONS: dict[str, set[str]] = {}
"""Single modules allowed one more package than their package, with the reason."""

MEGATRON_OK = {"learner", "convert", "platform"}
SGLANG_OK = {"rollout"}
HTTP_CLIENTS = {"sglang", "aiohttp", "httpx", "requests", "urllib.request", "http.client"}
HTTP_SERVER_OK = {"envs": {"aiohttp"}}
"""The package that serves the agent endpoint, and the one HTTP library it may import for it (aiohttp.web)."""


def _modules(extra: dict[str, str]):
    """``(relative path, source)`` of every module of the package, plus ``extra``."""
    files = {p.relative_to(PACKAGE).as_posix(): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}
    yield from {**files, **extra}.items()


def _imports(rel: str, source: str) -> list[tuple[int, str]]:
    """Every imported module name in the module (absolute), with its line; relative imports resolved."""
    tree = ast.parse(source, filename=rel)
    rel_parts = ["gspo_mcore", *pathlib.PurePosixPath(rel).with_suffix("").parts]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = rel_parts[: len(rel_parts) - node.level]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((node.lineno, name))
            if name == "gspo_mcore":  # from gspo_mcore import algo, ops
                out += [(node.lineno, f"gspo_mcore.{a.name}") for a in node.names]
    return out


def violations(extra: dict[str, str] | None = None) -> list[str]:
    """Every broken rule, one line each; ``extra``: more modules (relative path -> source) to check as if they
    were in the package."""
    found = []
    for rel, source in _modules(extra or {}):
        top = rel.split("/")[0].removesuffix(".py")
        if top == "__init__":
            continue
        if top not in ALLOWED:
            found.append(f"{rel}: package {top!r} has no place in ALLOWED (tests/test_layering.py): give it a layer")
            continue
        allowed = ALLOWED[top] | BASE | EXCEPTIONS.get(rel, set())
        for line, name in _imports(rel, source):
            parts = name.split(".")
            if parts[0] == "gspo_mcore":
                if len(parts) == 1:
                    continue  # `from gspo_mcore import x` is expanded above
                target = parts[1]
                if target not in allowed:
                    found.append(f"{rel}:{line}: {top} imports gspo_mcore.{target} (allowed: {sorted(allowed)})")
            elif parts[0] in ("megatron", "transformer_engine") and top not in MEGATRON_OK:
                found.append(f"{rel}:{line}: {top} imports {name}; only {sorted(MEGATRON_OK)} import megatron")
            elif top not in SGLANG_OK and any(_under(name, h) for h in HTTP_CLIENTS):
                if not any(_under(name, h) for h in HTTP_SERVER_OK.get(top, ())):
                    found.append(
                        f"{rel}:{line}: {top} imports {name}; only rollout speaks to SGLang / HTTP servers "
                        f"(and envs serves with aiohttp)"
                    )
    return found


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_import_layers_hold():
    bad = violations()
    assert not bad, "import rules broken:\n" + "\n".join(bad)


def test_learner_and_rollout_never_import_each_other():
    assert "rollout" not in ALLOWED["learner"] and "learner" not in ALLOWED["rollout"]
    assert not any("rollout" in v for k, v in EXCEPTIONS.items() if k.startswith("learner/"))


@pytest.mark.parametrize(
    "rel, source, expect",
    [
        (
            "learner/_bad.py",
            "from gspo_mcore.rollout.inprocess import RecomputeModel\n",
            "learner imports gspo_mcore.rollout",
        ),
        (
            "learner/_bad.py",
            "from gspo_mcore.convert.convert import hf_to_mcore\n",
            "learner imports gspo_mcore.convert",
        ),
        ("learner/hf/_bad.py", "from gspo_mcore import convert\n", "learner imports gspo_mcore.convert"),
        ("algo/_bad.py", "def f():\n    from gspo_mcore.trainer import run\n", "algo imports gspo_mcore.trainer"),
        ("rollout/_bad.py", "from gspo_mcore import learner\n", "rollout imports gspo_mcore.learner"),
        ("rewards/_bad.py", "import megatron.core\n", "only ['convert', 'learner', 'platform'] import megatron"),
        ("trainer/_bad.py", "import aiohttp\n", "only rollout speaks to SGLang"),
        ("trainer/_bad.py", "from aiohttp import web\n", "only rollout speaks to SGLang"),
        ("envs/_bad.py", "import httpx\n", "only rollout speaks to SGLang"),
        ("envs/_bad.py", "from sglang.srt import server\n", "only rollout speaks to SGLang"),
        ("envs/_bad.py", "import http.client\n", "only rollout speaks to SGLang"),
        ("ops/_bad.py", "from ..algo import policy_loss\n", "ops imports gspo_mcore.algo"),
        ("sandbox/_bad.py", "from gspo_mcore.rewards import code\n", "sandbox imports gspo_mcore.rewards"),
        ("sandbox/_bad.py", "from ..envs.builtin import python\n", "sandbox imports gspo_mcore.envs"),
        ("envs/_bad.py", "from gspo_mcore.rewards.runner import RewardRunner\n", "envs imports gspo_mcore.rewards"),
        ("newpkg/_bad.py", "x = 1\n", "has no place in ALLOWED"),
    ],
)
def test_a_bad_import_is_caught(rel, source, expect):
    """The rules fail on a deliberate bad import, checked as if the module were in the package."""
    bad = violations({rel: source})
    assert any(rel in b and expect in b for b in bad), bad


def test_envs_may_serve_with_aiohttp():
    """The agent endpoint's package imports aiohttp (its server): no violation."""
    assert not violations({"envs/_ok.py": "from aiohttp import web\nimport aiohttp\n"})
