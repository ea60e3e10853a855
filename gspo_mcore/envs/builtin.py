"""Built-in tools: a calculator (a safe arithmetic evaluator) and Python run in the code sandbox.

Use them by name in a :class:`~gspo_mcore.envs.tools.ToolEnv`'s ``tools`` list:
``gspo_mcore.envs.builtin:calculator`` and ``gspo_mcore.envs.builtin:python``.
"""

from __future__ import annotations

import ast
import math
import operator

from gspo_mcore.sandbox import SandboxConfig, run_python

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e30
MAX_OUTPUT_CHARS = 1000

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression: numbers, ``+ - * / // % **`` and parentheses, nothing else
    (no names, calls or attributes; parsed with :mod:`ast`, never ``eval``). ``ValueError`` otherwise, for a
    division by zero, an exponent above 64 or a result beyond 1e30 in magnitude."""
    if not isinstance(expression, str):
        raise ValueError("the expression must be a string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is above {MAX_EXPONENT}")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("the result is too large") from None
        if isinstance(value, complex) or (isinstance(value, float) and not math.isfinite(value)):
            raise ValueError("the result is not a finite real number")
        return _bounded(value)
    raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed (found {type(node).__name__})")


def _bounded(value: int | float) -> int | float:
    """``value`` when it is within 1e30 in magnitude (a literal such as ``1e999``, ``inf``, too)."""
    if abs(value) > MAX_MAGNITUDE:
        raise ValueError(f"{value:g} is beyond {MAX_MAGNITUDE:g} in magnitude")
    return value


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(12 + 30) * 2".
    """
    value = evaluate(expression)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


SANDBOX = SandboxConfig(cpu_time_s=5, wall_time_s=10.0, memory_mb=512)


def python(code: str) -> str:
    """Run a Python program (standard library only, no network) and return what it printed.

    Args:
        code: the program; print the values you need.
    """
    result = run_python(code, config=SANDBOX)
    out = result.stdout.decode(errors="replace")
    err = result.stderr.decode(errors="replace")
    parts = [f"stdout:\n{_cut(out)}"] if out else []
    if err:
        parts.append(f"stderr:\n{_cut(err)}")
    if result.timed_out:
        parts.append(f"(stopped after {SANDBOX.wall_time_s:g} s)")
    elif result.returncode != 0:
        parts.append(f"(exit status {result.returncode})")
    return "\n".join(parts) if parts else "(no output)"


def _cut(text: str) -> str:
    if len(text) <= MAX_OUTPUT_CHARS:
        return text
    return text[:MAX_OUTPUT_CHARS] + f"\n... [{len(text) - MAX_OUTPUT_CHARS} more characters cut]"
