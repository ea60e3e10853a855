"""The simple form of an environment: plain Python functions as tools.

:class:`Tool` reads a function's schema from its signature (the JSON type of each annotated parameter,
required unless it has a default) and its docstring (the first paragraph describes the tool; an ``Args:``
section describes the parameters). A parameter named ``row`` is hidden from the schema and receives the
episode's dataset row, so a tool can answer from data only the environment holds.

:class:`ToolEnv` is an :class:`~gspo_mcore.envs.base.Environment` over a list of tools: each policy turn is
scanned for tool calls (:func:`parse_tool_calls`, the ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
blocks of Qwen's and Hermes' templates); each call's result (or error) becomes a ``tool`` message, and a turn
without a call ends the episode (it is the final answer). A malformed call, an unknown tool, bad arguments
or an exception inside the tool become an error message to the model and count as a tool error, never a
crash; a turn with no call ends the episode.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gspo_mcore.envs.base import TOOL_CALLS, TOOL_ERRORS, Reset, Step

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
HIDDEN_PARAMETER = "row"

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"


class ToolCallError(ValueError):
    """A tool call the environment cannot run; its message goes back to the model."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class Tool:
    """A Python function the model may call."""

    fn: Callable[..., Any]
    name: str
    description: str
    parameters: dict
    """JSON schema of the arguments (``{"type": "object", "properties": ..., "required": [...]}``)."""
    wants_row: bool = False

    @classmethod
    def from_function(cls, fn: Callable[..., Any], *, name: str | None = None) -> Tool:
        """A tool whose schema comes from ``fn``'s signature and docstring; an error names what is missing."""
        name = name or fn.__name__
        doc = inspect.getdoc(fn) or ""
        if not doc:
            raise ValueError(f"tool {name!r}: the function needs a docstring (it is the model's description)")
        description, arg_docs = _parse_docstring(doc)
        try:
            hints = typing.get_type_hints(fn)
        except Exception:  # noqa: BLE001 - unresolvable annotations: fall back to the raw ones
            hints = {}
        props, required, wants_row = {}, [], False
        for p in inspect.signature(fn).parameters.values():
            if p.name == HIDDEN_PARAMETER:
                wants_row = True
                continue
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise ValueError(f"tool {name!r}: *args / **kwargs have no schema; name every parameter")
            ann = hints.get(p.name, p.annotation)
            if ann is inspect.Parameter.empty:
                raise ValueError(f"tool {name!r}: parameter {p.name!r} needs a type annotation")
            prop = {"type": _json_type(ann, f"tool {name!r}, parameter {p.name!r}")}
            if p.name in arg_docs:
                prop["description"] = arg_docs[p.name]
            props[p.name] = prop
            if p.default is inspect.Parameter.empty:
                required.append(p.name)
        schema = {"type": "object", "properties": props, "required": required}
        return cls(fn=fn, name=name, description=description, parameters=schema, wants_row=wants_row)

    @property
    def schema(self) -> dict:
        """OpenAI's function-tool schema, as chat templates take it."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def __call__(self, arguments: Mapping[str, Any], row: Mapping[str, Any] | None = None) -> str:
        """Run the tool; ``ToolCallError`` for arguments that do not fit the schema. The result as text."""
        if not isinstance(arguments, Mapping):
            raise ToolCallError(f"{self.name}: arguments must be a JSON object")
        props = self.parameters["properties"]
        unknown = sorted(set(arguments) - set(props))
        if unknown:
            raise ToolCallError(f"{self.name}: unknown argument(s) {unknown}; expected {sorted(props)}")
        missing = [k for k in self.parameters["required"] if k not in arguments]
        if missing:
            raise ToolCallError(f"{self.name}: missing argument(s) {missing}")
        for k, v in arguments.items():
            if not _fits(v, props[k]["type"]):
                raise ToolCallError(f"{self.name}: argument {k!r} must be of JSON type {props[k]['type']}")
        kwargs = dict(arguments)
        if self.wants_row:
            kwargs[HIDDEN_PARAMETER] = row
        out = self.fn(**kwargs)
        return out if isinstance(out, str) else json.dumps(out)


def parse_tool_calls(text: str) -> list[ToolCall | ToolCallError]:
    """Every ``<tool_call>{json}</tool_call>`` block of ``text``, in order: a :class:`ToolCall`, or a
    :class:`ToolCallError` for a block that is not a JSON object with a string ``name`` and an object
    ``arguments`` (a missing ``arguments`` is ``{}``). An opening tag without its closing tag is an error."""
    out: list[ToolCall | ToolCallError] = []
    for m in _CALL.finditer(text):
        body = m.group(1).strip()
        try:
            obj = json.loads(body)
        except ValueError as e:
            out.append(ToolCallError(f"tool call is not valid JSON ({e.msg} at char {e.pos}): {body[:200]}"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            out.append(ToolCallError(f'tool call must be {{"name": ..., "arguments": {{...}}}}, got: {body[:200]}'))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                pass
        if not isinstance(args, dict):
            out.append(ToolCallError(f"tool call {obj['name']!r}: arguments must be a JSON object"))
            continue
        out.append(ToolCall(obj["name"], args))
    if text.count(_OPEN) > len(list(_CALL.finditer(text))):
        out.append(ToolCallError("a <tool_call> is not closed by </tool_call>"))
    return out


def load_object(spec: str, what: str) -> Any:
    """``"pkg.module:name"`` -> the object; an error names ``what`` (the config key) and the spec."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"{what}: expected 'package.module:Name', got {spec!r}")
    module, name = spec.split(":")
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - the import's own error, named
        raise ValueError(f"{what}: cannot import module {module!r} ({type(e).__name__}: {e})") from e
    try:
        return getattr(mod, name)
    except AttributeError:
        raise ValueError(f"{what}: module {module!r} has no attribute {name!r}") from None


class ToolEnv:
    """An environment whose actions are tool calls (see the module docstring).

    Args:
        tools: functions, or ``"pkg.module:function"`` strings (the YAML form).
        system_prompt: a system message put before the row's messages (none when empty).
        max_result_chars: a tool's result is cut to this many characters (the cut is marked).
    """

    def __init__(self, tools: Sequence[Callable | str], *, system_prompt: str = "", max_result_chars: int = 2000):
        if not tools:
            raise ValueError("ToolEnv needs at least one tool")
        if max_result_chars < 16:
            raise ValueError(f"ToolEnv: max_result_chars must be >= 16, got {max_result_chars}")
        loaded = [load_object(t, f"tools[{i}]") if isinstance(t, str) else t for i, t in enumerate(tools)]
        self.tools = {}
        for t in loaded:
            tool = t if isinstance(t, Tool) else Tool.from_function(t)
            if tool.name in self.tools:
                raise ValueError(f"ToolEnv: two tools named {tool.name!r}")
            self.tools[tool.name] = tool
        self.system_prompt = system_prompt
        self.max_result_chars = max_result_chars

    def reset(self, row: Mapping[str, Any]) -> Reset:
        if row.get("messages"):
            messages = [dict(m) for m in row["messages"]]
        elif isinstance(row.get("prompt"), str):
            messages = [{"role": "user", "content": row["prompt"]}]
        else:
            raise ValueError("ToolEnv.reset: the row has neither 'messages' nor a 'prompt' string")
        if self.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return Reset(
            observation=messages,
            state={"row": row.get("metadata", {})},
            tools=tuple(t.schema for t in self.tools.values()),
        )

    def step(self, state, action: str) -> Step:
        calls = parse_tool_calls(action)
        if not calls:
            return Step(done=True, info={TOOL_CALLS: 0, TOOL_ERRORS: 0})
        messages, errors = [], 0
        for call in calls:
            name = call.name if isinstance(call, ToolCall) else "error"
            try:
                if isinstance(call, ToolCallError):
                    raise call
                tool = self.tools.get(call.name)
                if tool is None:
                    raise ToolCallError(f"unknown tool {call.name!r}; available: {sorted(self.tools)}")
                content = tool(call.arguments, state["row"])
            except Exception as e:  # noqa: BLE001 - a tool's failure is the model's to read, not the run's
                errors += 1
                content = f"Error: {e}" if isinstance(e, ToolCallError) else f"Error: {type(e).__name__}: {e}"
            messages.append({"role": "tool", "name": name, "content": _truncate(content, self.max_result_chars)})
        return Step(observation=messages, info={TOOL_CALLS: len(calls), TOOL_ERRORS: errors})


def _truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    note = f"... [{len(text) - limit} more characters cut]"
    return text[: max(limit - len(note), 0)] + note


def _json_type(ann, where: str) -> str:
    origin = typing.get_origin(ann) or ann
    if origin in _JSON_TYPES:
        return _JSON_TYPES[origin]
    raise ValueError(f"{where}: annotation {ann!r} has no JSON type (use str, int, float, bool, list or dict)")


def _fits(value, json_type: str) -> bool:
    if json_type == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if json_type == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    py = {v: k for k, v in _JSON_TYPES.items()}[json_type]
    return isinstance(value, py)


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """The description (the text before an ``Args:`` section) and each argument's description."""
    lines = doc.splitlines()
    desc, args, current, in_args = [], {}, None, False
    for line in lines:
        stripped = line.strip()
        if stripped in ("Args:", "Arguments:", "Parameters:"):
            in_args = True
            continue
        if stripped in ("Returns:", "Raises:", "Yields:", "Examples:", "Example:", "Note:"):
            in_args, current = False, None
            break
        if in_args:
            m = re.match(r"^(\w+)\s*(\([^)]*\))?\s*:\s*(.*)$", stripped)
            if m and not line.startswith(" " * 8):
                current = m.group(1)
                args[current] = m.group(3)
            elif stripped and current:
                args[current] = f"{args[current]} {stripped}".strip()
            elif not stripped:
                current = None
                if args:
                    in_args = False
        else:
            desc.append(line)
    return "\n".join(desc).strip(), args
