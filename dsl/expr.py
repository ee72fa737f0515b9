"""The integer expression language of warm-up policies and order blocks.

``+ - * //``, unary ``-``, ``min(a, b, ...)``, ``max(a, b, ...)``, integer
literals, parentheses, and a fixed set of names (``rank``, ``ranks``,
``chunks``, ``microbatches`` and their one-letter aliases ``P``, ``V``,
``M``; loop variables in an order block). An expression is compiled once
into a tree of closures, a pure-Python callable: there is no ``eval()``.

Values are checked while they are computed: a division by zero or a value
beyond +-2**62 raises :class:`ExprError` at the offending operator, so a
hostile file can neither crash nor stall the compiler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from pipec.dsl import ast
from pipec.dsl.ast import Span
from pipec.dsl.errors import did_you_mean
from pipec.errors import PipecError

__all__ = ["ExprError", "IntExpr", "compile_int", "expr_text", "referenced_names", "BOUND"]

BOUND = 2**62
"""Intermediate and final values must stay within +-BOUND."""

Env = Mapping[str, int]
_Fn = Callable[[Env], int]


class ExprError(PipecError):
    """An expression that cannot be compiled or evaluated, with the span at fault."""

    def __init__(self, span: Span, message: str, *hints: str) -> None:
        super().__init__(message)
        self.span = span
        self.message = message
        self.hints = tuple(h for h in hints if h)


@dataclass(frozen=True, slots=True)
class IntExpr:
    """A compiled integer expression. Call it with the values of its names."""

    text: str
    """Canonical text, e.g. ``min(P - 1 - rank, M)``."""
    names: frozenset[str]
    """The canonical names it reads."""
    node: ast.Node
    fn: _Fn = field(compare=False, repr=False)

    def __call__(self, env: Env) -> int:
        return self.fn(env)


def _check(value: int, span: Span) -> int:
    if -BOUND <= value <= BOUND:
        return value
    raise ExprError(span, f"value out of range: the result exceeds {BOUND:.2e} in magnitude")


_OPS: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}


def compile_int(node: ast.Node, names: Mapping[str, str]) -> IntExpr:
    """Compile ``node`` to an :class:`IntExpr`.

    ``names`` maps each name the expression may use (aliases included) to its
    canonical name, the key of the environment it is called with. Raises
    :class:`ExprError` at the first unsupported construct.
    """
    used: set[str] = set()
    fn = _compile(node, names, used)
    return IntExpr(expr_text(node), frozenset(used), node, fn)


def _compile(node: ast.Node, names: Mapping[str, str], used: set[str]) -> _Fn:
    if isinstance(node, ast.Number):
        if isinstance(node.value, float):
            raise ExprError(node.span, f"expected a whole number, got {node.text}")
        value = _check(node.value, node.span)
        return lambda env: value
    if isinstance(node, ast.Word):
        if node.name not in names:
            known = sorted(set(names))
            raise ExprError(node.span, f"unknown name '{node.name}' in an expression",
                            did_you_mean(node.name, known) or "names: " + ", ".join(known))
        canonical = names[node.name]
        used.add(canonical)
        return lambda env: env[canonical]
    if isinstance(node, ast.Group):
        if len(node.args) == 1 and not node.kwargs:
            return _compile(node.args[0], names, used)
        raise ExprError(node.span, "expected one expression in parentheses")
    if isinstance(node, ast.Neg):
        inner = _compile(node.operand, names, used)
        return lambda env: -inner(env)
    if isinstance(node, ast.BinOp):
        if node.op == "/":
            raise ExprError(node.span, "'/' is not integer division", "use // (floor division)")
        left = _compile(node.left, names, used)
        right = _compile(node.right, names, used)
        span = node.span
        if node.op == "//":
            def floordiv(env: Env) -> int:
                divisor = right(env)
                if divisor == 0:
                    raise ExprError(span, "division by zero", "guard the divisor, e.g. max(1, M // P)")
                return left(env) // divisor
            return floordiv
        op = _OPS[node.op]
        return lambda env: _check(op(left(env), right(env)), span)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Word) and node.func.name in ("min", "max"):
        if node.kwargs:
            raise ExprError(node.kwargs[0].span, f"{node.func.name}() takes no named arguments")
        if len(node.args) < 2:
            raise ExprError(node.span, f"{node.func.name}() needs at least two arguments")
        parts = [_compile(a, names, used) for a in node.args]
        pick = min if node.func.name == "min" else max
        return lambda env: pick(p(env) for p in parts)
    if isinstance(node, ast.Call):
        fname = node.func.name if isinstance(node.func, ast.Word) else node.func.value
        raise ExprError(node.func.span, f"unknown function '{fname}' in an expression",
                        did_you_mean(fname, ["min", "max"]) or "functions: min, max")
    raise ExprError(node.span, f"expected an integer expression, got {ast.describe(node)}")


def referenced_names(node: ast.Node | None) -> set[str]:
    """Every bare name used anywhere under ``node`` (without compiling it)."""
    found: set[str] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n is None or isinstance(n, (str, int, float)):
            continue
        if isinstance(n, ast.Word):
            found.add(n.name)
            continue
        if isinstance(n, tuple):
            stack.extend(n)
            continue
        for name in getattr(n, "__slots__", ()):
            if name != "span":
                stack.append(getattr(n, name))
    return found


_PREC = {"+": 1, "-": 1, "*": 2, "//": 2, "/": 2}


def expr_text(node: ast.Node, parent: int = 0, right: bool = False) -> str:
    """Canonical text of an arithmetic expression, with spaces around binary
    operators and parentheses only where precedence needs them (an explicit
    group keeps its parentheses)."""
    if isinstance(node, ast.BinOp):
        prec = _PREC[node.op]
        text = f"{expr_text(node.left, prec)} {node.op} {expr_text(node.right, prec, True)}"
        if prec < parent or (right and prec == parent):
            return f"({text})"
        return text
    if isinstance(node, ast.Neg):
        return "-" + expr_text(node.operand, 3)
    from pipec.dsl.fmt import value_text  # the formatter owns the text of every other node

    return value_text(node)
