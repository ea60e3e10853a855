"""No test module imports from a ``conftest`` by bare name: ``from conftest import X`` resolves to whichever
``conftest`` module pytest imported first, so it breaks when test folders are collected together (shared
constants live in ``tests/helpers``, imported by module name)."""

from __future__ import annotations

import os
import re

from helpers import TESTS

BARE_CONFTEST = re.compile(r"^\s*(from\s+conftest\s+import|import\s+conftest\b)", re.MULTILINE)


def test_no_test_module_imports_a_conftest_by_bare_name():
    found = []
    for folder, _, files in os.walk(TESTS):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    if BARE_CONFTEST.search(f.read()):
                        found.append(os.path.relpath(path, TESTS))
    assert not found, f"bare conftest imports (move the shared names to tests/helpers): {found}"
