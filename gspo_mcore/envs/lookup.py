"""A multi-hop tool environment: a ``lookup`` tool over a table of entities, plus the built-in calculator.

The table maps an entity's name to its fields (``{"Bexmel": {"age": 34}, ...}``), given inline or as the path of
a JSON file (the YAML form: ``rollout.env_kwargs: {table: runs/.../table.json}``). Questions about entities the
model cannot know ("How old will Bexmel be in 37 years?") need a ``lookup`` and then a ``calculator`` call on its
result: two calls whose results combine. The tools are :class:`~gspo_mcore.envs.tools.Tool` functions run by
:class:`~gspo_mcore.envs.tools.ToolEnv` (its call parsing, error messages and counts); ``lookup`` of an unknown
entity or field answers an error the model reads, never a crash.

Use it as ``rollout.env: gspo_mcore.envs.lookup:LookupEnv``; ``examples/smollm2_multihop`` generates a table and
questions with held-out entities.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from gspo_mcore.envs.builtin import calculator
from gspo_mcore.envs.tools import Tool, ToolEnv


def load_table(table: str | Mapping[str, Mapping[str, Any]], key: str = "table") -> dict[str, dict[str, Any]]:
    """The table as ``{name: {field: value}}``: inline, or read from a JSON file. ``ValueError`` naming ``key`` for
    a missing file, an empty table, or an entity whose fields are not a non-empty mapping."""
    if isinstance(table, str):
        if not os.path.isfile(table):
            raise ValueError(f"{key}: no table file at {table!r}")
        with open(table) as f:
            try:
                table = json.load(f)
            except ValueError as e:
                raise ValueError(f"{key}: {f.name} is not JSON ({e})") from None
    if not isinstance(table, Mapping) or not table:
        raise ValueError(f"{key}: the table is empty (it needs at least one entity with fields)")
    out = {}
    for name, fields in table.items():
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{key}: entity names must be non-empty strings, got {name!r}")
        if not isinstance(fields, Mapping) or not fields:
            raise ValueError(f"{key}: entity {name!r} needs a non-empty mapping of fields, got {fields!r}")
        out[name.strip()] = {str(k): v for k, v in fields.items()}
    return out


def lookup_tool(table: Mapping[str, Mapping[str, Any]], *, name_fields: bool = True) -> Tool:
    """The ``lookup(name, field="")`` tool over ``table`` (names matched without regard to case or surrounding
    spaces): one field's value, or ``field: value`` pairs for all of them when ``field`` is empty. With
    ``name_fields``, a lone field is named too (``age: 34``, not ``34``): a result that says what it is reads less
    like a final answer (a small model otherwise tends to answer the looked-up number itself)."""
    by_name = {name.lower(): (name, fields) for name, fields in table.items()}

    def lookup(name: str, field: str = "") -> str:
        """Look up what the table knows about a person or thing.

        Args:
            name: the entity's name, e.g. "Bexmel".
            field: one field to return (e.g. "age"); empty: all of them.
        """
        found = by_name.get(name.strip().lower())
        if found is None:
            raise ValueError(f"no entry named {name!r}")
        _, fields = found
        if field:
            if field.strip() not in fields:
                raise ValueError(f"{name!r} has no field {field!r}; fields: {', '.join(fields)}")
            return str(fields[field.strip()])
        if len(fields) == 1 and not name_fields:
            return str(next(iter(fields.values())))
        return ", ".join(f"{k}: {v}" for k, v in fields.items())

    return Tool.from_function(lookup)


class LookupEnv(ToolEnv):
    """:class:`ToolEnv` with ``lookup`` over ``table`` and the calculator (see the module docstring).

    Args:
        table: ``{name: {field: value}}``, or the path of a JSON file holding it (refused when empty).
        system_prompt: a system message put before the row's messages.
        max_result_chars: a tool's result is cut to this many characters.
        name_fields: a lookup of a lone field answers ``field: value`` (see :func:`lookup_tool`).
    """

    def __init__(
        self,
        *,
        table: str | Mapping[str, Mapping[str, Any]],
        system_prompt: str = "",
        max_result_chars: int = 200,
        name_fields: bool = True,
    ):
        self.table = load_table(table, key="LookupEnv(table=...)")
        super().__init__(
            [lookup_tool(self.table, name_fields=name_fields), calculator],
            system_prompt=system_prompt,
            max_result_chars=max_result_chars,
        )
