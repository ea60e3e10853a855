"""Assert-style tests judged on the host: each ``assert`` becomes a probe that reports plain data.

``compile_test`` rewrites a test's source (with ``ast``) before it is sent to the sandbox: every
``assert`` statement, wherever it is (top level, inside a HumanEval ``check`` function, in a loop),
becomes a call ``__gspo_probe__(site, (operand, ...))`` that reports the values the model's code
produced, JSON-encoded as plain data (``plain.py``). The comparison itself happens here, on the host:

- ``assert a == b`` (any comparison operator, chains too): an operand written as a literal
  (``ast.literal_eval``: numbers, strings, ``None``, containers of those, ...) is **kept on the host and
  never sent**; the other operands are reported. ``assert a`` alone reports ``a`` and the host takes
  its truth value. ``not`` is applied on the host; ``assert x and y`` is split into two sites.
- a test passes when the program reports its end, every probe reported for it holds, and every site
  (but a literal ``assert False``) was reached at least once.

What this protects, and what it cannot (the trust boundary of assert-style tests):

- The verdict is never computed in the model's interpreter and depends on no secret there: exiting
  early, printing or writing forged records on any descriptor, patching builtins / ``json`` / the
  harness, walking frames or ``gc`` give the model nothing it can turn into a pass of a site whose
  expected side is a literal, because that literal is not in its process. An object whose ``__eq__``
  always returns True, or an ``int`` / ``str`` subclass, is not plain data and fails.
- The model's process writes the reports, so it can forge them: a site whose expected value it can
  know can be forged. That is the case for ``assert pred(x)`` (expected: true), for comparisons whose
  both sides are computed in the sandbox (``assert f(x) == expected`` with ``expected`` a variable,
  ``assert f(x) == g(x)``), for literals written inside the reported side (``abs(f(x) - 0.5) < 1e-6``
  sends ``0.5``), for ``or`` and other expressions that are evaluated whole in the sandbox, and for
  control flow (``try: f(-1); assert False except ValueError: pass``).
- Where a reward must hold against an adversarial policy, use stdio or call-based tests
  (``code.py``), whose expected outputs never leave the host.
"""

from __future__ import annotations

import ast
import operator
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from gspo_mcore.rewards.plain import COMPARE, NotPlain, decode

PROBE = "__gspo_probe__"
_OPS = {
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.In: "in",
    ast.NotIn: "not in",
    ast.Is: "is",
    ast.IsNot: "is not",
}


@dataclass(frozen=True)
class Site:
    """One check of a test: ``operands[0] ops[0] operands[1] ...`` (or the truth of one operand)."""

    ops: tuple[str, ...]
    """Comparison operators; empty: the truth value of the single operand."""
    operands: tuple[tuple[str, Any], ...]
    """``("lit", value)``: a literal kept on the host; ``("rep", k)``: the k-th reported value."""
    negate: bool = False
    required: bool = True
    """Must be reached at least once (all but a literal ``assert False``)."""

    @property
    def num_reported(self) -> int:
        return sum(kind == "rep" for kind, _ in self.operands)

    def holds(self, reported: list[Any]) -> bool:
        """The check on decoded, builtin values (never on objects from the sandbox)."""
        if len(reported) != self.num_reported:
            return False
        values = [reported[v] if kind == "rep" else v for kind, v in self.operands]
        try:
            if not self.ops:
                ok = bool(values[0])
            else:
                ok = all(COMPARE[op](a, b) for op, a, b in zip(self.ops, values, values[1:]))
        except Exception:  # noqa: BLE001 - e.g. '<' between str and int: the assert would have raised
            return False
        return ok != self.negate


@dataclass(frozen=True)
class CompiledTest:
    source: str
    """What the sandbox runs: the test with each assert replaced by a probe (no hidden literal in it)."""
    sites: tuple[Site, ...]


def compile_test(source: str, *, hide_literals: bool = True, filename: str = "<test>") -> CompiledTest:
    """Rewrite ``source``'s asserts into probes. ``hide_literals=False`` (tests only) sends literals too.

    Raises ``SyntaxError`` for a test that does not parse.
    """
    tree = ast.parse(source, filename=filename)
    rewriter = _Rewriter(hide_literals)
    tree = ast.fix_missing_locations(rewriter.visit(tree))
    return CompiledTest(source=ast.unparse(tree), sites=tuple(rewriter.sites))


def judge(tests: list[CompiledTest], records: Iterable[Mapping[str, Any]]) -> list[bool]:
    """Per test: passed? ``records`` are the channel's ``{"i", "s", "v"|"bad"}`` and ``{"done"}`` objects."""
    done: set[int] = set()
    reached: list[set[int]] = [set() for _ in tests]
    failed = [False] * len(tests)
    for r in records:
        if set(r) == {"done"} and type(r["done"]) is int and 0 <= r["done"] < len(tests):
            done.add(r["done"])
            continue
        i, s = r.get("i"), r.get("s")
        if type(i) is not int or not 0 <= i < len(tests):
            continue
        if type(s) is not int or not 0 <= s < len(tests[i].sites) or set(r) != {"i", "s", "v"}:
            failed[i] = True  # a malformed or "not plain data" report about this test
            continue
        reached[i].add(s)
        try:
            values = r["v"]
            ok = type(values) is list and tests[i].sites[s].holds([decode(v) for v in values])
        except (NotPlain, RecursionError):
            ok = False
        failed[i] |= not ok
    out = []
    for i, t in enumerate(tests):
        required = {s for s, site in enumerate(t.sites) if site.required}
        out.append(i in done and not failed[i] and required <= reached[i])
    return out


class _Rewriter(ast.NodeTransformer):
    def __init__(self, hide_literals: bool):
        self.hide_literals = hide_literals
        self.sites: list[Site] = []

    def visit_Assert(self, node: ast.Assert):
        return [self._probe(expr, negate, node) for expr, negate in _split(node.test, False)]

    def _probe(self, expr: ast.expr, negate: bool, where: ast.AST) -> ast.stmt:
        if isinstance(expr, ast.Compare):
            operands, ops = [expr.left, *expr.comparators], tuple(_OPS[type(op)] for op in expr.ops)
        else:
            operands, ops = [expr], ()
        spec, reported = [], []
        for o in operands:
            literal = _literal(o) if self.hide_literals else _NO
            if literal is _NO:
                spec.append(("rep", len(reported)))
                reported.append(self.visit(o))  # asserts inside lambdas etc. are rewritten too
            else:
                spec.append(("lit", literal))
        site = Site(ops=ops, operands=tuple(spec), negate=negate)
        if not reported and not site.holds([]):  # e.g. `assert False` after an expected exception
            site = Site(ops=ops, operands=tuple(spec), negate=negate, required=False)
        self.sites.append(site)
        call = ast.Call(
            func=ast.Name(PROBE, ast.Load()),
            args=[ast.Constant(len(self.sites) - 1), ast.Tuple(reported, ast.Load())],
            keywords=[],
        )
        return ast.copy_location(ast.Expr(call), where)


_NO = object()


def _literal(node: ast.expr) -> Any:
    """The value of an operand written as a literal, or ``_NO``. Arithmetic on numbers counts
    (``10**9 + 7``, ``2**31 - 1``, ``1 / 3``): it is evaluated here, with bounded sizes."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    try:
        return _arithmetic(node, 0)
    except (_NotConstant, ArithmeticError, ValueError, TypeError, MemoryError, RecursionError):
        return _NO


class _NotConstant(Exception):
    pass


_MAX_BITS = 4096  # results and operands of constant arithmetic (a larger one is sent to the sandbox)
_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.LShift: operator.lshift,
    ast.RShift: operator.rshift,
    ast.BitOr: operator.or_,
    ast.BitAnd: operator.and_,
    ast.BitXor: operator.xor,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}


def _arithmetic(node: ast.expr, depth: int) -> int | float:
    """Numbers combined with + - * / // % ** << >> | & ^ ~ (no names, no calls); sizes bounded."""
    if depth > 32:
        raise _NotConstant
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_arithmetic(node.operand, depth + 1)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _arithmetic(node.left, depth + 1), _arithmetic(node.right, depth + 1)
        if isinstance(node.op, ast.Pow) and type(a) is int and type(b) is int:
            if b < 0 or abs(a) > 1 and b * abs(a).bit_length() > _MAX_BITS:
                raise _NotConstant
        if isinstance(node.op, ast.LShift) and (type(b) is not int or b > _MAX_BITS):
            raise _NotConstant
        return _bounded(_BINOPS[type(node.op)](a, b))
    raise _NotConstant


def _bounded(x: Any) -> int | float:
    if type(x) is int and x.bit_length() > _MAX_BITS or type(x) not in (int, float):
        raise _NotConstant
    return x


def _split(expr: ast.expr, negate: bool) -> list[tuple[ast.expr, bool]]:
    """``not`` toggles the polarity; a positive ``and`` is a sequence of asserts (same short-circuit)."""
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        return _split(expr.operand, not negate)
    if isinstance(expr, ast.BoolOp) and isinstance(expr.op, ast.And) and not negate:
        return [part for value in expr.values for part in _split(value, False)]
    return [(expr, negate)]
