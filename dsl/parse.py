"""Text -> syntax tree: lark's LALR parser, a Transformer to frozen AST nodes,
and syntax errors turned into located :class:`~pipec.dsl.errors.DSLError`.

The grammar (``grammar.lark``, package data) is generic: a statement is a
name and a value. Common mistakes are recognised by lark's
``match_examples`` (the parser state an example fails in names the mistake);
other syntax errors say what was found and what was expected.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import threading
from dataclasses import dataclass
from importlib import resources
from typing import Any

from lark import Lark, Token, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken, VisitError
from lark.lexer import PatternStr
from lark.visitors import Transformer_NonRecursive

from pipec.dsl import ast
from pipec.dsl.ast import Span
from pipec.dsl.errors import DSLError, Source
from pipec.errors import PipecError

__all__ = ["Comment", "Parsed", "MAX_DEPTH", "parse_source", "parse_value", "parser"]

MAX_DEPTH = 64
"""How deeply values may nest (brackets and operators); deeper is refused."""

MAX_NUMBER_DIGITS = 40
"""Longer numeric literals are refused before conversion (DESIGN's limits are far below)."""


@dataclass(frozen=True, slots=True)
class Comment:
    """A ``# comment``: its text and where it starts."""

    text: str
    line: int
    col: int


@dataclass(frozen=True, slots=True)
class Parsed:
    """A parsed file: the tree, its comments (for the formatter) and its source."""

    file: ast.File
    comments: tuple[Comment, ...]
    source: Source


_local = threading.local()


def _on_comment(token: Token) -> Token:
    sink = getattr(_local, "comments", None)
    if sink is not None:
        sink.append(Comment(str(token), token.line, token.column))
    return token


@functools.lru_cache(maxsize=1)
def parser() -> Lark:
    """The schedule-file parser (built once; start rules ``start`` and ``value``)."""
    grammar = resources.files("pipec.dsl").joinpath("grammar.lark").read_text(encoding="utf-8")
    return Lark(
        grammar,
        parser="lalr",
        propagate_positions=True,
        start=["start", "value"],
        lexer_callbacks={"COMMENT": _on_comment},
        cache=_cache_file(grammar),
    )


def _cache_file(grammar: str) -> str | bool:
    """Where lark keeps its grammar analysis (~70 ms of start-up): the user's own cache folder, never the
    shared temp folder lark picks by default (the cache is a pickle; a file another user planted there would
    be loaded). False, no cache, where that folder cannot be made."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = os.path.join(root, "pipec")
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    except OSError:
        return False
    if not os.access(folder, os.W_OK):
        return False
    digest = hashlib.sha256(grammar.encode("utf-8")).hexdigest()[:16]
    return os.path.join(folder, f"grammar-{digest}.lark")


# ----------------------------------------------------------------------------- tree -> AST


class _Refused(PipecError):
    """Raised inside the transformer; carries a span and message out of lark's VisitError."""

    def __init__(self, span: Span, message: str, *hints: str) -> None:
        super().__init__(message)
        self.span = span
        self.message = message
        self.hints = hints


def _tspan(tok: Token) -> Span:
    return Span(tok.line, tok.column, tok.end_line, tok.end_column, tok.start_pos, tok.end_pos)


def _mspan(meta: Any) -> Span:
    if getattr(meta, "empty", True):
        return ast.NO_SPAN
    return Span(meta.line, meta.column, meta.end_line, meta.end_column, meta.start_pos, meta.end_pos)


_UNESCAPE = {"n": "\n", "t": "\t"}
_QUANTITY = re.compile(r"((?:\d+(?:\.\d+)?|\.\d+)(?:[eE][+-]?\d+)?)(.*)", re.S)


def _number_value(text: str, span: Span) -> int | float:
    if len(text) > MAX_NUMBER_DIGITS:
        raise _Refused(span, f"number {text[:12]}... is too long ({len(text)} characters)")
    if re.fullmatch(r"\d+", text):
        return int(text)
    return float(text)


def _nodes(children: list[Any]) -> tuple[Any, ...]:
    return tuple(c for c in children if c is not None)


@v_args(meta=True)
class _ToAST(Transformer_NonRecursive):
    """One method per grammar rule (or alias), each building one AST node.

    Nesting depth is tracked per node (by identity, for this parse only) and
    refused past :data:`MAX_DEPTH`, so every later recursive pass is safe.
    """

    def __init__(self) -> None:
        super().__init__()
        self._depth: dict[int, int] = {}
        self._keep: list[Any] = []  # keeps nodes alive so ids stay unique

    def _made(self, node: Any, *children: Any) -> Any:
        depth = 1 + max((self._depth.get(id(c), 0) for c in children), default=0)
        if depth > MAX_DEPTH:
            raise _Refused(node.span, f"this value nests more than {MAX_DEPTH} levels deep")
        self._depth[id(node)] = depth
        self._keep.append(node)
        return node

    # --- file and statements

    def start(self, meta, children):
        return ast.File(tuple(children), _mspan(meta))

    def statement(self, meta, children):
        key, value = children
        return ast.Statement(ast.Word(str(key), _tspan(key)), value, _mspan(meta))

    # --- leaves

    def number(self, meta, children):
        (tok,) = children
        span = _tspan(tok)
        return self._made(ast.Number(_number_value(str(tok), span), str(tok), span))

    def quantity(self, meta, children):
        (tok,) = children
        span = _tspan(tok)
        number, unit = _QUANTITY.fullmatch(str(tok)).groups()
        return self._made(ast.Quantity(_number_value(number, span), unit, str(tok), span))

    def word(self, meta, children):
        (tok,) = children
        return self._made(ast.Word(str(tok), _tspan(tok)))

    def path(self, meta, children):
        (tok,) = children
        return self._made(ast.Path(str(tok), _tspan(tok)))

    def string(self, meta, children):
        (tok,) = children
        return self._made(ast.String(_unescape(str(tok)[1:-1]), _tspan(tok)))

    # --- compound values

    def arguments(self, meta, children):
        items = _nodes(children)
        args = tuple(c for c in items if not isinstance(c, ast.Kwarg))
        kwargs = tuple(c for c in items if isinstance(c, ast.Kwarg))
        return (args, kwargs, items)

    def kwarg(self, meta, children):
        name, value = children
        return self._made(ast.Kwarg(ast.Word(str(name), _tspan(name)), value, _mspan(meta)), value)

    def call(self, meta, children):
        func, (args, kwargs, items) = children
        fnode = (ast.String(_unescape(str(func)[1:-1]), _tspan(func)) if func.type == "STRING"
                 else ast.Word(str(func), _tspan(func)))
        return self._made(ast.Call(fnode, args, kwargs, _mspan(meta)), *items)

    def group(self, meta, children):
        ((args, kwargs, items),) = children
        return self._made(ast.Group(args, kwargs, _mspan(meta)), *items)

    def list(self, meta, children):
        items = _nodes(children)
        return self._made(ast.List(items, _mspan(meta)), *items)

    def subscript(self, meta, children):
        name, *rest = children
        items = _nodes(rest)
        return self._made(ast.Subscript(ast.Word(str(name), _tspan(name)), items, _mspan(meta)), *items)

    def typed(self, meta, children):
        name, value = children
        label = (ast.String(_unescape(str(name)[1:-1]), _tspan(name)) if name.type == "STRING"
                 else ast.Word(str(name), _tspan(name)))
        return self._made(ast.Typed(label, value, _mspan(meta)), value)

    def seq(self, meta, children):
        return self._made(ast.Seq(tuple(children), _mspan(meta)), *children)

    def split_phrase(self, meta, children):
        return self._made(ast.Phrase("split before", tuple(children), _mspan(meta)), *children)

    def stages_phrase(self, meta, children):
        return self._made(ast.Phrase("stages", tuple(children), _mspan(meta)), *children)

    # --- arithmetic

    def _binop(self, op, meta, children):
        left, right = children
        return self._made(ast.BinOp(op, left, right, _mspan(meta)), left, right)

    def add(self, meta, children):
        return self._binop("+", meta, children)

    def sub(self, meta, children):
        return self._binop("-", meta, children)

    def mul(self, meta, children):
        return self._binop("*", meta, children)

    def floordiv(self, meta, children):
        return self._binop("//", meta, children)

    def truediv(self, meta, children):
        return self._binop("/", meta, children)

    def neg(self, meta, children):
        (operand,) = children
        return self._made(ast.Neg(operand, _mspan(meta)), operand)

    # --- order blocks

    def order_block(self, meta, children):
        return self._made(ast.OrderBlock(tuple(children), _mspan(meta)), *children)

    def rank_one(self, meta, children):
        rank, *body = children
        rnode = ast.Number(_number_value(str(rank), _tspan(rank)), str(rank), _tspan(rank))
        return self._made(ast.RankClause(rnode, tuple(body), span=_mspan(meta)), *body)

    def rank_each(self, meta, children):
        var, start, end, *body = children
        clause = ast.RankClause(start, tuple(body), ast.Word(str(var), _tspan(var)), end, _mspan(meta))
        return self._made(clause, start, end, *body)

    def action(self, meta, children):
        kind, stage, mb = children
        return self._made(ast.Action(str(kind), stage, mb, None, _mspan(meta)), stage, mb)

    def action_range(self, meta, children):
        kind, stage, mb, end = children
        return self._made(ast.Action(str(kind), stage, mb, end, _mspan(meta)), stage, mb, end)

    def repeat(self, meta, children):
        *body, var, start, end = children
        node = ast.Repeat(tuple(body), ast.Word(str(var), _tspan(var)), start, end, _mspan(meta))
        return self._made(node, start, end, *body)


def _unescape(raw: str) -> str:
    out, i = [], 0
    while i < len(raw):
        c = raw[i]
        if c == "\\" and i + 1 < len(raw):
            out.append(_UNESCAPE.get(raw[i + 1], raw[i + 1]))
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


# ----------------------------------------------------------------------------- syntax errors

# Common mistakes, recognised by the parser state they fail in (lark's match_examples).
_EXAMPLES: dict[str, list[str]] = {
    "equals after key": ["pp = 4", "schedule = gpipe", "lr = 3e-4", 'model = "a:b"', "dp=2"],
    "colon after key": ["pp: 4", "schedule: gpipe", "microbatches: 8"],
    "missing value": ["pp", "pp 4 schedule", "microbatches"],
    "two values": ["pp 4 4", "placement 0 1", 'model "a:b" "c"', "schedule gpipe 8", "pp 4 (1)",
                   "pp 4 [1]", "x a.b 1", "x 1 -"],
    "equals outside parentheses": ["policy warmup = 3", "pp 4 = 5", "lr_schedule cosine warmup = 3"],
    "unquoted target": ["model pipec.examples.gpt:build", "data my.data:batches", "loss a.b:c"],
    "rank colon": ["order rank 0 F0.0", "order rank 1 B0.1", "order rank r in 0..3 F(r).0"],
    "rank range": ["order rank r: F0.0", "order rank r in 0: F0.0", "order rank r in 0..: F0.0"],
    "action form": ["order rank 0: F0", "order rank 0: F0 B0", "order rank 0: F0.0 B1"],
    "empty rank": ["order rank 0: rank 1: F0.0", "order rank 0:", "order rank 0: pp 4"],
    "repeat form": ["order rank 0: (F0.m B0.m)", "order rank 0: (F0.m for 0..3)",
                    "order rank 0: (F0.m for m 0..3)", "order rank 0: (F0.m for m in 0)"],
    "value expected in parentheses": ["x f(,)", "x f(a=)", "x (1,)", "x f(1,)"],
}

_HINTS = {
    "two values": ("unexpected {found} after a complete value",
                   "join a value's parts with commas (`placement 0, 1, 1, 0`), or start a new "
                   "statement with a key"),
    "equals after key": ("a key takes its value after a space, without '='", "write it as `{key} value`"),
    "colon after key": ("a key takes its value after a space, without ':'", "write it as `{key} value`"),
    "missing value": ("'{key}' needs a value", ""),
    "equals outside parentheses": ("'=' can only appear inside parentheses",
                                   "write settings as `key name(setting = value, ...)` or `policy (warmup = ...)`"),
    "unquoted target": ("a 'module:function' target must be quoted",
                        'write it in double quotes: "pkg.module:function"'),
    "rank colon": ("a rank clause needs ':' before its actions", "write `rank 0: F0.0 F0.1 ...`"),
    "rank range": ("a rank range is written `rank r in FIRST..LAST:`", "for example `rank r in 0..3: F(r).0`"),
    "action form": ("an action is a kind, a stage and a microbatch: `F0.3`",
                    "kinds are F, B, I and W; the stage is a number or `(expression)`; "
                    "`F0.0..7` is a range of microbatches"),
    "empty rank": ("a rank clause needs at least one action", "for example `rank 0: F0.0 B0.0`"),
    "repeat form": ("a repeat is written `(ACTIONS for VAR in FIRST..LAST)`",
                    "for example `(B0.m F0.m+4 for m in 0..3)`"),
    "value expected in parentheses": ("unexpected {found}; expected a value", ""),
}

_TERMINAL_NAMES = {
    "NAME": "a name",
    "NUMBER": "a number",
    "QUANTITY": "a number with a unit",
    "STRING": "a string",
    "PATH": "a dotted path",
    "INT": "a whole number",
    "KIND": "an action such as F0.3",
    "$END": "the end of the file",
}


@functools.lru_cache(maxsize=1)
def _example_parse():
    p = parser()
    return functools.partial(p.parse, start="start")


def _describe_terminal(name: str) -> str:
    if name in _TERMINAL_NAMES:
        return _TERMINAL_NAMES[name]
    try:
        pattern = parser().get_terminal(name).pattern
    except KeyError:
        return name
    if isinstance(pattern, PatternStr):
        return f"'{pattern.value}'"
    return name.lower()


def _expected_phrase(expected: set[str]) -> str:
    if {"NUMBER", "NAME", "STRING"} <= expected:
        return "a value"
    names = sorted({_describe_terminal(n) for n in expected if n != "$END"})
    if "$END" in expected:
        names.append("the end of the file")
    if not names:
        return ""
    if len(names) > 6:
        names = names[:6] + ["..."]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _found(token: Token) -> str:
    if token.type == "$END":
        return "end of file"
    text = str(token)
    if token.type == "NAME":
        return f"name '{text}'"
    if token.type in ("NUMBER", "INT"):
        return f"number {text}"
    return f"'{text}'"


def _key_example(key: str) -> str:
    from pipec.dsl.keys import KEYS  # the table knows each key's example

    return f"for example: {KEYS[key].example}" if key in KEYS else ""


def _statement_key(text: str, pos: int) -> str:
    """The last key-like word before ``pos``: the key a missing value belongs to."""
    words = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text[:pos])
    return words[-1] if words else "key"


def _syntax_error(err: UnexpectedInput, source: Source) -> DSLError:
    text = source.text
    if isinstance(err, UnexpectedCharacters):
        char = text[err.pos_in_stream] if err.pos_in_stream < len(text) else ""
        span = Span(err.line, err.column, err.line, err.column + 1)
        if char == '"':
            return source.error(span, "unterminated string", 'close it with " on the same line')
        if char == "'":
            return source.error(span, "strings use double quotes", 'write "..." instead of \'...\'')
        if char == "=":
            return source.error(span, "'=' can only appear inside parentheses",
                                "write settings as `name(setting = value, ...)`")
        if char == ";":
            return source.error(span, "unexpected ';'", "statements need no separator: remove it")
        return source.error(span, f"unexpected character {char!r}")
    assert isinstance(err, UnexpectedToken)
    token = err.token
    if token.type == "$END":
        end = len(text.rstrip())
        line = text.count("\n", 0, end) + 1
        col = end - (text.rfind("\n", 0, end) + 1) + 1
        span = Span(line, max(1, col), line, max(1, col) + 1)
        pos = end
    else:
        span = _tspan(token)
        pos = token.start_pos
    label = None
    try:
        label = err.match_examples(_example_parse(), _EXAMPLES, token_type_match_fallback=True)
    except Exception:  # noqa: BLE001 -- a failed guess must not hide the real error
        label = None
    if token.type == "$END":
        opened = _unclosed(text)
        if opened:
            return source.error(opened[1], f"unclosed '{opened[0]}'", "close it before the end of the file")
    if label is not None:
        message, hint = _HINTS[label]
        key = _statement_key(text, pos)
        found = _found(token)
        if label == "missing value":
            hint = _key_example(key)
        return source.error(span, message.format(key=key, found=found), hint.format(key=key, found=found))
    expected = _expected_phrase(set(err.accepts or err.expected or ()))
    message = f"unexpected {_found(token)}" + (f"; expected {expected}" if expected else "")
    hints = []
    if expected == "a name or the end of the file" or expected == "a name":
        hints.append("each statement starts with a key; a value has one part unless its parts are "
                     "joined by commas")
    return source.error(span, message, *hints)


def _unclosed(text: str) -> tuple[str, Span] | None:
    """The innermost bracket left open at the end of ``text`` (strings and comments skipped)."""
    stack: list[tuple[str, int, int]] = []
    line, col, i = 1, 1, 0
    pairs = {")": "(", "]": "["}
    while i < len(text):
        c = text[i]
        if c == "#":
            j = text.find("\n", i)
            j = len(text) if j < 0 else j
            col += j - i
            i = j
            continue
        if c == '"':
            j = i + 1
            while j < len(text) and text[j] not in '"\n':
                j += 2 if text[j] == "\\" else 1
            col += j + 1 - i
            i = j + 1
            continue
        if c in "([":
            stack.append((c, line, col))
        elif c in pairs and stack and stack[-1][0] == pairs[c]:
            stack.pop()
        if c == "\n":
            line, col = line + 1, 1
        else:
            col += 1
        i += 1
    if not stack:
        return None
    c, ln, cl = stack[-1]
    return c, Span(ln, cl, ln, cl + 1)


# ----------------------------------------------------------------------------- entry points


def _run(text: str, source: Source, start: str):
    _local.comments = comments = []
    try:
        tree = parser().parse(text, start=start)
    except UnexpectedInput as err:
        raise _syntax_error(err, source) from None
    finally:
        _local.comments = None
    try:
        node = _ToAST().transform(tree)
    except VisitError as err:
        exc = err.orig_exc
        if isinstance(exc, _Refused):
            raise source.error(exc.span, exc.message, *exc.hints) from None
        raise
    return node, tuple(comments)


def parse_source(text: str, *, filename: str = "<string>") -> Parsed:
    """Parse a whole schedule file. Raises :class:`DSLError` on a syntax error."""
    source = Source(filename, text)
    file, comments = _run(text, source, "start")
    return Parsed(file, comments, source)


def parse_value(text: str, source: Source) -> ast.Node:
    """Parse one value (a flag's text) in ``source``. Raises :class:`DSLError`."""
    node, _ = _run(text, source, "value")
    return node
