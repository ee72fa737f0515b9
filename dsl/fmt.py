"""``pipec fmt``: print a schedule file in canonical form.

The canonical form keeps what the author chose to group (statements that
shared a line still do), comments (own-line and trailing), and single blank
lines between paragraphs; it normalises everything else: one space between a
key and its value (keys padded to a column within a paragraph of
one-statement lines), two spaces between statements on one line, ``, ``
between items, ``name=value`` for settings, spaces around binary operators,
and an ``order`` block as one indented line per rank clause.

Parsing the output gives a tree equal to the input's (spans aside), and
formatting is idempotent; the tests check both on every example and on
generated files.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipec.dsl import ast
from pipec.dsl.expr import expr_text
from pipec.dsl.parse import Parsed, parse_source

__all__ = ["format_file", "format_parsed", "value_text", "statement_text"]

INDENT = "  "


def _escape(value: str) -> str:
    return (value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t"))


def _join(items) -> str:
    return ", ".join(value_text(i) for i in items)


def _simple_field(node: ast.Node) -> bool:
    if isinstance(node, (ast.Number, ast.Word)):
        return True
    return (isinstance(node, ast.BinOp) and node.op in "+-" and _simple_field(node.left)
            and isinstance(node.right, (ast.Number, ast.Word)))


def _field(node: ast.Node, *, stage: bool = False) -> str:
    """An order-block field: bare when the grammar allows it, else parenthesised."""
    if isinstance(node, ast.Number) or (not stage and _simple_field(node)):
        return expr_text(node).replace(" ", "")
    return f"({expr_text(node)})"


def value_text(node: ast.Node) -> str:
    """The canonical one-line text of a value (an order block spans lines)."""
    if isinstance(node, ast.Number) or isinstance(node, ast.Quantity):
        return node.text
    if isinstance(node, ast.Word):
        return node.name
    if isinstance(node, ast.Path):
        return node.text
    if isinstance(node, ast.String):
        return f'"{_escape(node.value)}"'
    if isinstance(node, ast.Kwarg):
        return f"{node.name.name}={value_text(node.value)}"
    if isinstance(node, ast.Call):
        space = " " if isinstance(node.func, ast.String) else ""
        return f"{value_text(node.func)}{space}({_join(node.args + node.kwargs)})"
    if isinstance(node, ast.Group):
        return f"({_join(node.args + node.kwargs)})"
    if isinstance(node, ast.List):
        return f"[{_join(node.items)}]"
    if isinstance(node, ast.Subscript):
        return f"{node.name.name}[{_join(node.items)}]"
    if isinstance(node, ast.Typed):
        return f"{value_text(node.name)}: {value_text(node.type)}"
    if isinstance(node, (ast.BinOp, ast.Neg)):
        return expr_text(node)
    if isinstance(node, ast.Seq):
        return _join(node.items)
    if isinstance(node, ast.Phrase):
        return f"{node.head} {_join(node.items)}"
    if isinstance(node, ast.Action):
        text = f"{node.kind}{_field(node.stage, stage=True)}.{_field(node.microbatch)}"
        return text + (f"..{_field(node.end)}" if node.end is not None else "")
    if isinstance(node, ast.Repeat):
        body = " ".join(value_text(e) for e in node.body)
        return f"({body} for {node.var.name} in {_field(node.start)}..{_field(node.end)})"
    if isinstance(node, ast.RankClause):
        body = " ".join(value_text(e) for e in node.body)
        if node.var is None:
            return f"rank {value_text(node.rank)}: {body}"
        return f"rank {node.var.name} in {_field(node.rank)}..{_field(node.end)}: {body}"
    if isinstance(node, ast.OrderBlock):
        return "\n".join(INDENT + value_text(c) for c in node.clauses)
    raise AssertionError(f"no text for {type(node).__name__}")


def statement_text(st: ast.Statement) -> str:
    """The canonical text of one statement (an order block spans lines)."""
    if isinstance(st.value, ast.OrderBlock):
        return st.key.name + "\n" + value_text(st.value)
    return f"{st.key.name} {value_text(st.value)}"


# ----------------------------------------------------------------------------- layout


@dataclass(slots=True)
class _Line:
    """One output line and the source lines it stands for."""

    text: str
    first: int
    last: int
    role: str = "line"
    """``"one"`` (a single statement: its key is padded), ``"line"`` (several),
    ``"order"`` (an order block's key) or ``"clause"`` (one of its rank clauses)."""
    key: str = ""
    value: str = ""
    trailing: str = ""


def _groups(statements: tuple[ast.Statement, ...]) -> list[list[ast.Statement]]:
    """Statements that share a source line stay together; an order block stands alone."""
    groups: list[list[ast.Statement]] = []
    for st in statements:
        alone = isinstance(st.value, ast.OrderBlock)
        if groups and not alone and not isinstance(groups[-1][-1].value, ast.OrderBlock) \
                and st.span.line == groups[-1][-1].span.end_line:
            groups[-1].append(st)
        else:
            groups.append([st])
    return groups


def _lines(parsed: Parsed) -> list[_Line]:
    out: list[_Line] = []
    for group in _groups(parsed.file.statements):
        first, last = group[0].span.line, group[-1].span.end_line
        if isinstance(group[0].value, ast.OrderBlock):
            st = group[0]
            clauses = st.value.clauses
            head_last = clauses[0].span.line - 1 if clauses[0].span.line > st.span.line else st.span.line
            out.append(_Line(st.key.name, st.span.line, max(st.span.line, head_last), "order"))
            for i, clause in enumerate(clauses):
                end = clause.span.end_line
                if i + 1 < len(clauses):
                    end = max(end, clauses[i + 1].span.line - 1) if clauses[i + 1].span.line > end else end
                out.append(_Line(INDENT + value_text(clause), clause.span.line, end, "clause"))
            continue
        if len(group) == 1:
            st = group[0]
            out.append(_Line("", first, last, "one", st.key.name, value_text(st.value)))
        else:
            out.append(_Line("  ".join(statement_text(s) for s in group), first, last, "line"))
    return out


def format_parsed(parsed: Parsed) -> str:
    """The canonical text of a parsed file."""
    lines = _lines(parsed)
    source_lines = parsed.source.text.split("\n")

    def blank(n: int) -> bool:
        return 1 <= n <= len(source_lines) and not source_lines[n - 1].strip()

    # Comments: trailing ones join the output line that covers their source line;
    # own-line ones go before the first output line that starts after them.
    own: list[tuple[int, str, bool]] = []
    for c in parsed.comments:
        before = source_lines[c.line - 1][: c.col - 1] if c.line <= len(source_lines) else ""
        host = next((ln for ln in lines if ln.first <= c.line <= ln.last), None)
        if before.strip() and host is not None:
            host.trailing = (host.trailing + "  " + c.text) if host.trailing else c.text
        else:
            own.append((c.line, c.text, c.col > 1))

    # Blank lines: one where the source had any, between items (lines or comments).
    items: list[tuple[int, int, object]] = [(ln.first, ln.last, ln) for ln in lines]
    items += [(n, n, (text, indented)) for n, text, indented in own]
    items.sort(key=lambda t: (t[0], isinstance(t[2], _Line)))
    text_out: list[str] = []
    paragraph: list[_Line] = []

    def flush() -> None:
        width = max((len(ln.key) for ln in paragraph if ln.role == "one"), default=0)
        for ln in paragraph:
            if ln.role == "one":
                ln.text = f"{ln.key.ljust(width)} {ln.value}"

    rendered: list[object] = []
    prev_last = 0
    for first, last, item in items:
        if rendered and any(blank(n) for n in range(prev_last + 1, first)):
            rendered.append(None)
        rendered.append(item)
        prev_last = max(prev_last, last)
    # Pad keys within paragraphs (runs without a blank line or an order block), then print.
    for item in rendered + [None]:
        if isinstance(item, _Line) and item.role in ("one", "line"):
            paragraph.append(item)
        elif item is None or isinstance(item, _Line):
            flush()
            paragraph = []
    in_order = False
    for item in rendered:
        if item is None:
            text_out.append("")
            continue
        if isinstance(item, tuple):
            text, indented = item
            text_out.append((INDENT if in_order and indented else "") + text)
            continue
        in_order = item.role in ("order", "clause")
        line = item.text.rstrip()
        if item.trailing:
            line += "  " + item.trailing
        text_out.append(line)
    while text_out and not text_out[-1]:
        text_out.pop()
    return "\n".join(text_out) + "\n" if text_out else ""


def format_file(text: str, *, filename: str = "<string>") -> str:
    """``pipec fmt``: the canonical form of a schedule file.

    Raises :class:`~pipec.dsl.errors.DSLError` if the file does not parse
    (formatting does not run the semantic checks).
    """
    return format_parsed(parse_source(text, filename=filename))
