"""Typed configuration from YAML plus ``key=value`` overrides, for trees of frozen dataclasses.

Every component owns a small frozen dataclass (validated in its ``__post_init__``); the trainer's config
is a dataclass whose fields are those components. This module only builds such trees from plain
data, refuses unknown keys (suggesting the closest valid one, or saying where a removed key went when the
class lists it in a ``REMOVED_KEYS`` class attribute), and writes a tree back as YAML.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration problem; the message names the key (dotted path) at fault."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key repeated in one mapping (YAML's last-wins would silently drop
    the first value)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node.start_mark.line + 1)
                except TypeError:  # an unhashable key: SafeLoader's own error follows
                    continue
                if first != key_node.start_mark.line + 1:
                    raise _DuplicateKey(key, key_node.start_mark.line + 1, first)
        return super().construct_mapping(node, deep=deep)


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key, line: int, first: int):
        super().__init__(f"duplicate key {key!r} at line {line} (first at line {first})")


def load_yaml(path: str | os.PathLike) -> dict:
    """The YAML mapping in ``path``; a missing file, invalid YAML, a key repeated in one mapping or a top level
    that is not a mapping is a :class:`ConfigError` naming the file."""
    try:
        with open(path) as f:
            data = yaml.load(f, Loader=_UniqueKeyLoader)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except _DuplicateKey as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML scalars/lists) to a nested dict copy."""
    out = _deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.path=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {item!r}: empty key component")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {key}: cannot parse value {raw!r}: {exc}") from None
        node = out
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {key}: {p} is not a section")
            node = nxt
        node[parts[-1]] = value
    return out


def from_dict(cls: type, data: Any, path: str = ""):
    """Build dataclass ``cls`` from nested plain data, checking keys and basic types."""
    where = path or cls.__name__
    if data is None:
        data = {}
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of {cls.__name__} fields, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        if key not in fields and key in getattr(cls, "REMOVED_KEYS", {}):
            raise ConfigError(f"config key {_join(path, key)!r} no longer exists: {cls.REMOVED_KEYS[key]}")
        if key not in fields:
            near = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {_join(path, near[0])!r}?" if near else f"; valid keys: {', '.join(fields)}"
            raise ConfigError(f"unknown config key {_join(path, key)!r}{hint}")
        kwargs[key] = _convert(hints[key], value, _join(path, key))
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def check_literals(obj) -> None:
    """Raise ``ValueError`` if a ``Literal[...]`` field of dataclass ``obj`` holds another value (for configs
    built in Python; :func:`from_dict` checks them with the key's path)."""
    for f in dataclasses.fields(obj):
        hint = typing.get_type_hints(type(obj)).get(f.name)
        if typing.get_origin(hint) is typing.Literal and getattr(obj, f.name) not in typing.get_args(hint):
            raise ValueError(
                f"{type(obj).__name__}.{f.name} must be one of {typing.get_args(hint)}, got {getattr(obj, f.name)!r}"
            )


def to_dict(obj) -> Any:
    """Plain data (dicts, lists, scalars) for a dataclass tree."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def to_yaml(obj) -> str:
    """A dataclass tree (or plain data) as YAML, keys in field order; :func:`from_dict` reads it back."""
    return yaml.safe_dump(to_dict(obj), sort_keys=False)


def save_yaml(obj, path: str | os.PathLike) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(to_yaml(obj))
    os.replace(tmp, path)


def defaults_tree(cls: type, path: str = "") -> tuple[dict, list[str]]:
    """Every default of dataclass ``cls`` as plain data, and the dotted keys that have none (``None`` in the
    tree; a required section is expanded to its own defaults)."""
    hints = typing.get_type_hints(cls)
    tree, required = {}, []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key = _join(path, f.name)
        if f.default is not dataclasses.MISSING:
            tree[f.name] = to_dict(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            tree[f.name] = to_dict(f.default_factory())
        elif dataclasses.is_dataclass(hints[f.name]):
            tree[f.name], inner = defaults_tree(hints[f.name], key)
            required += inner
        else:
            tree[f.name] = None
            required.append(key)
    return tree, required


def _convert(hint, value, path):
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(a, value, path)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {value!r} does not match {hint}")
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, path)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        args = typing.get_args(hint)
        item = args[0] if args else Any
        seq = [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(seq) if origin is tuple else seq
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    if hint is Any or origin is typing.Literal:
        if origin is typing.Literal and value not in typing.get_args(hint):
            raise ConfigError(f"{path}: must be one of {typing.get_args(hint)}, got {value!r}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true/false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-5" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return str(value)
    return value


def _join(path, key):
    return f"{path}.{key}" if path else str(key)


def _deepcopy(d):
    return {k: _deepcopy(v) if isinstance(v, dict) else v for k, v in d.items()}
