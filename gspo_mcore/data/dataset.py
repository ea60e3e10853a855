"""Prompt datasets from JSONL and Parquet files.

A row is an object with either a prompt string (``prompt_key``) or a chat (``messages_key``: a list of
``{"role", "content"}``); a list under ``prompt_key`` counts as a chat too (verl's layout). Every other
field is kept as the sample's ``metadata`` for the reward (``answer``, ``tests``, ``reward_fn``, ...).

A malformed row raises ``MalformedRowError`` naming the file and line (JSONL, 1-based line number) or
row (Parquet, 1-based row number); with ``skip_malformed`` it is skipped and counted instead.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

logger = logging.getLogger(__name__)

ROLES = frozenset({"system", "user", "assistant", "tool"})
_JSONL = (".jsonl", ".ndjson")
_PARQUET = (".parquet", ".pq")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    paths: tuple[str, ...]
    """JSONL (``.jsonl``/``.ndjson``) and Parquet (``.parquet``/``.pq``) files, read in this order."""
    prompt_key: str = "prompt"
    """Field with the prompt string (or a list of messages)."""
    messages_key: str = "messages"
    """Field with the chat messages."""
    skip_malformed: bool = False
    """Skip and count malformed rows instead of raising."""

    def __post_init__(self):
        paths = (self.paths,) if isinstance(self.paths, (str, os.PathLike)) else tuple(self.paths)
        object.__setattr__(self, "paths", tuple(os.fspath(p) for p in paths))
        if not self.paths:
            raise ValueError("DataConfig.paths must name at least one file")
        for p in self.paths:
            if not p.lower().endswith(_JSONL + _PARQUET):
                raise ValueError(f"DataConfig.paths: {p!r} is neither JSONL ({_JSONL}) nor Parquet ({_PARQUET})")
        if not self.prompt_key or not self.messages_key or self.prompt_key == self.messages_key:
            raise ValueError("DataConfig.prompt_key and messages_key must be non-empty and different")


@dataclass(frozen=True)
class PromptSample:
    prompt: str | None
    """The prompt string, or None for a chat sample."""
    messages: tuple[Mapping[str, str], ...] | None
    """The chat, or None for a prompt-string sample."""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """Every other field of the row (read-only)."""
    source: str = ""
    """Where the row came from: ``path:line`` or ``path row N``."""


class MalformedRowError(ValueError):
    def __init__(self, path: str, line: int, reason: str, *, unit: str = "line"):
        self.path, self.line, self.reason = path, line, reason
        where = f"{path}:{line}" if unit == "line" else f"{path} row {line}"
        super().__init__(f"{where}: {reason}")


class PromptDataset(Sequence[PromptSample]):
    """All valid rows of the configured files, in file order. ``num_skipped`` counts skipped rows."""

    def __init__(self, config: DataConfig):
        self.config = config
        self.num_skipped = 0
        self._samples: list[PromptSample] = []
        for path in config.paths:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"dataset file not found: {path}")
            rows = _jsonl_rows(path) if path.lower().endswith(_JSONL) else _parquet_rows(path)
            unit = "line" if path.lower().endswith(_JSONL) else "row"
            for line, row in rows:
                if isinstance(row, MalformedRowError):  # unparsable JSON
                    self._skip_or_raise(row)
                    continue
                try:
                    sample = _sample(row, config, f"{path}:{line}" if unit == "line" else f"{path} row {line}")
                except _RowError as e:
                    error = MalformedRowError(path, line, str(e), unit=unit)
                else:
                    self._samples.append(sample)
                    continue
                self._skip_or_raise(error)
        if not self._samples:
            raise ValueError(f"no valid samples in {list(config.paths)} ({self.num_skipped} malformed rows skipped)")
        if self.num_skipped:
            logger.warning("skipped %d malformed rows in %s", self.num_skipped, list(config.paths))

    def _skip_or_raise(self, error: MalformedRowError) -> None:
        if not self.config.skip_malformed:
            raise error
        self.num_skipped += 1
        logger.debug("skipping %s", error)

    def __len__(self) -> int:
        return len(self._samples)

    def __getitem__(self, i):
        return self._samples[i]


class _RowError(ValueError):
    pass


def _jsonl_rows(path: str) -> Iterator[tuple[int, Any]]:
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                yield line_no, json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                yield line_no, MalformedRowError(path, line_no, f"invalid JSON: {e}")


def _parquet_rows(path: str) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise ValueError(f"{path}: cannot read as Parquet: {e}") from e
    row_no = 0
    for batch in file.iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            row_no += 1
            yield row_no, row


def _sample(row: Any, config: DataConfig, source: str) -> PromptSample:
    if not isinstance(row, dict):
        raise _RowError(f"expected an object, got {type(row).__name__}")
    prompt = row.get(config.prompt_key)
    messages = row.get(config.messages_key)
    if isinstance(prompt, list):  # a chat stored under the prompt key
        if messages is not None:
            raise _RowError(f"both {config.prompt_key!r} and {config.messages_key!r} hold messages")
        prompt, messages = None, prompt
    if prompt is not None and messages is not None:
        raise _RowError(f"has both {config.prompt_key!r} and {config.messages_key!r}; give one")
    if prompt is None and messages is None:
        raise _RowError(f"missing {config.prompt_key!r} (a string) or {config.messages_key!r} (a list of messages)")
    if prompt is not None and (not isinstance(prompt, str) or not prompt.strip()):
        raise _RowError(f"{config.prompt_key!r} must be a non-empty string, got {_short(prompt)}")
    if messages is not None:
        messages = _messages(messages, config.messages_key)
    metadata = {k: v for k, v in row.items() if k not in (config.prompt_key, config.messages_key)}
    return PromptSample(prompt=prompt, messages=messages, metadata=MappingProxyType(metadata), source=source)


def _messages(messages: Any, key: str) -> tuple[Mapping[str, str], ...]:
    if not isinstance(messages, list) or not messages:
        raise _RowError(f"{key!r} must be a non-empty list of {{role, content}} objects, got {_short(messages)}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _RowError(f"{key}[{i}] must be an object, got {_short(m)}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise _RowError(f"{key}[{i}].role must be one of {sorted(ROLES)}, got {_short(role)}")
        if not isinstance(content, str):
            raise _RowError(f"{key}[{i}].content must be a string, got {_short(content)}")
        out.append(MappingProxyType({"role": role, "content": content}))
    return tuple(out)


def _short(x: Any) -> str:
    r = repr(x)
    return r if len(r) <= 60 else r[:57] + "..."
