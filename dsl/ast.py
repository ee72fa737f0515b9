"""The schedule file's syntax tree: frozen nodes that keep their source spans.

:mod:`pipec.dsl.parse` builds these from lark's parse tree; the semantic pass
(:mod:`pipec.dsl.check`) reads them; the formatter (:mod:`pipec.dsl.fmt`)
prints them back. Spans are excluded from equality (``compare=False``), so two
trees are equal exactly when they say the same thing: that is what the
formatter's round trip asserts.

The value nodes are generic (the grammar knows no key names): a number, a
quantity with a unit, a bare word, a dotted path, a string, a call with
positional and keyword arguments, a parenthesised group, a list, a
subscript (``int64[16, 128]``), a typed name (``tokens: int64[16, 128]``),
arithmetic, a comma sequence, the two phrases (``split before ...``,
``stages ...``) and the ``order`` block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar, Union

__all__ = [
    "Span",
    "NO_SPAN",
    "Number",
    "Quantity",
    "Word",
    "Path",
    "String",
    "Kwarg",
    "Call",
    "Group",
    "List",
    "Subscript",
    "Typed",
    "BinOp",
    "Neg",
    "Seq",
    "Phrase",
    "Action",
    "Repeat",
    "RankClause",
    "OrderBlock",
    "Statement",
    "File",
    "Node",
    "describe",
]


@dataclass(frozen=True, slots=True)
class Span:
    """Where a node sits in its source: 1-based line and column, inclusive
    start and exclusive end (``end_col`` is one past the last character);
    ``start``/``end`` are character offsets."""

    line: int
    col: int
    end_line: int
    end_col: int
    start: int = 0
    end: int = 0


NO_SPAN = Span(0, 0, 0, 0)
"""The span of a node that was built, not parsed."""


_T = TypeVar("_T", bound=type)


def _node(cls: _T) -> _T:
    """A syntax-tree node: a frozen, slotted dataclass of the fields its class declares, then ``span`` (where
    it was written; ``NO_SPAN`` for a built node), which equality and repr leave out."""
    cls.__annotations__["span"] = "Span"
    cls.span = field(default=NO_SPAN, compare=False, repr=False)
    return dataclass(frozen=True, slots=True)(cls)


@_node
class Number:
    """An integer or real literal, as written (``8``, ``3e-4``)."""

    value: int | float
    text: str


@_node
class Quantity:
    """A number with a unit, written without a space: ``80GB``, ``10us``, ``25GB/s``."""

    value: int | float
    unit: str
    text: str


@_node
class Word:
    """A bare name: ``loop``, ``1f1b``, ``on``, ``rank``."""

    name: str


@_node
class Path:
    """A dotted name: a module path inside the model (``layers.4``)."""

    text: str


@_node
class String:
    """A double-quoted string; ``value`` is unescaped."""

    value: str


@_node
class Kwarg:
    """``name = value`` inside parentheses."""

    name: Word
    value: "Node"


@_node
class Call:
    """``func(args, name=value)``; ``func`` is a word or, for a model, a string."""

    func: Word | String
    args: tuple["Node", ...]
    kwargs: tuple[Kwarg, ...]


@_node
class Group:
    """A parenthesised group: an expression ``(M - 1)``, a tuple ``(0.9, 0.95)``,
    or keyword settings ``(warmup = 3, priority = backward)``."""

    args: tuple["Node", ...]
    kwargs: tuple[Kwarg, ...]


@_node
class List:
    """``[a, b, c]``."""

    items: tuple["Node", ...]


@_node
class Subscript:
    """``int64[16, 128]``: a name with bracketed integer expressions."""

    name: Word
    items: tuple["Node", ...]


@_node
class Typed:
    """``tokens: int64[16, 128]``: a name and a type; the name may be quoted (``"blocks.*.qkv": colwise``)."""

    name: "Word | String"
    type: "Node"


@_node
class BinOp:
    """``left op right`` with ``op`` one of ``+ - * // /``."""

    op: str
    left: "Node"
    right: "Node"


@_node
class Neg:
    """``-operand``."""

    operand: "Node"


@_node
class Seq:
    """A comma-separated value: ``0, 1, 1, 0`` or ``pp(...), dp(...)``."""

    items: tuple["Node", ...]


@_node
class Phrase:
    """A value introduced by keywords: ``split before a, b`` (``head`` is
    ``"split before"``) or ``stages 0, 1`` (``head`` is ``"stages"``)."""

    head: str
    items: tuple["Node", ...]


@_node
class Action:
    """``F0.3`` (or ``F0.0..3`` when ``end`` is set): a compute action of an
    order block. ``stage``, ``microbatch`` and ``end`` are integer expressions."""

    kind: str
    stage: "Node"
    microbatch: "Node"
    end: "Node | None" = None


@_node
class Repeat:
    """``(body for var in start..end)``: ``body`` once per value of ``var``."""

    body: tuple["Node", ...]
    var: Word
    start: "Node"
    end: "Node"


@_node
class RankClause:
    """``rank 0: body`` (``rank`` a number) or ``rank r in 0..3: body``
    (``var`` set; ``rank`` and ``end`` are the range)."""

    rank: "Node"
    body: tuple["Node", ...]
    var: Word | None = None
    end: "Node | None" = None


@_node
class OrderBlock:
    """An explicit per-rank order: one clause per rank (or per rank range)."""

    clauses: tuple[RankClause, ...]


Node = Union[
    Number, Quantity, Word, Path, String, Call, Group, List, Subscript, Typed, BinOp, Neg, Seq,
    Phrase, Action, Repeat, RankClause, OrderBlock,
]


@_node
class Statement:
    """``key value``."""

    key: Word
    value: Node


@_node
class File:
    statements: tuple[Statement, ...]


_DESCRIPTIONS = {
    Number: "a number",
    Quantity: "a quantity",
    Word: "a name",
    Path: "a dotted path",
    String: "a string",
    Call: "a call",
    Group: "a parenthesised group",
    List: "a list",
    Subscript: "a subscript",
    Typed: "a typed name",
    BinOp: "an expression",
    Neg: "an expression",
    Seq: "a comma-separated list",
    Phrase: "a phrase",
    OrderBlock: "an order block",
}


def describe(node: Node) -> str:
    """What a node is, for messages: ``"a string"``, ``"a number"``..."""
    if isinstance(node, Phrase):
        return f"'{node.head} ...'"
    return _DESCRIPTIONS.get(type(node), "a value")
