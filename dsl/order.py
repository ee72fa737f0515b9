"""Explicit orders: expand an ``order`` block, or read torch's compute-only CSV.

The language only reads an order: its actions per rank, each with the place
it was written (:class:`Expanded`), and its shape (ranks, microbatches,
placement) for the mesh's defaults. The compiler's driver checks its
invariants and builds it; a complaint names a rank and an action index,
which :meth:`Expanded.place` turns back into a place in the text.

An order block has one clause per rank (or per range of ranks)::

    order
      rank 0: F0.0..3 (B0.m F0.m+4 for m in 0..3) B0.4..7
      rank r in 1..3: F(r).0..3-r (B(r).m F(r).m+4-r for m in 0..3+r) B(r).4+r..7

``F0.0..3`` is a range of microbatches (both ends included; empty when the end
is below the start), ``(... for m in A..B)`` repeats its actions for each m,
and fields are integer expressions (:mod:`pipec.dsl.expr`) over loop
variables and ``ranks``/``P``, ``microbatches``/``M``, ``chunks``/``V``.
Expansion is bounded: more than :data:`MAX_ACTIONS` actions (or loop
iterations) are refused at the range that overflows, before the work is done.

A CSV file (torch.distributed.pipelining's ``_dump_csv`` compute-only form)
has one row per rank and one cell per action (``2F0``: stage 2, forward,
microbatch 0; an empty cell is an idle slot).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from pipec.compiler.limits import MAX_INSTRUCTIONS, MAX_MICROBATCHES, MAX_RANKS, MAX_STAGES
from pipec.dsl import ast
from pipec.dsl.ast import Span
from pipec.dsl.errors import DSLError, Source
from pipec.dsl.expr import ExprError, compile_int, referenced_names
from pipec.schedules.order import Action, Kind
from pipec.schedules.torch_csv import COMPUTE_TYPES, CellError, parse_cell

__all__ = ["MAX_ACTIONS", "ORDER_NAMES", "Expanded", "expand_block", "read_csv", "shape"]

MAX_ACTIONS = MAX_INSTRUCTIONS
"""Most actions (and loop iterations) an order may expand to: pipec's instruction limit."""

MAX_INDEX = min(MAX_STAGES, MAX_MICROBATCHES) - 1
"""Largest stage or microbatch index (pipec's limits on S and M)."""

MAX_CSV_BYTES = 64 * 2**20

ORDER_NAMES = {"ranks": "ranks", "P": "ranks", "microbatches": "microbatches", "M": "microbatches",
               "chunks": "chunks", "V": "chunks"}
"""Names an order block's fields may use besides its loop variables."""

_KINDS = {"F": Kind.F, "B": Kind.B, "I": Kind.I, "W": Kind.W}


@dataclass(slots=True)
class Expanded:
    """Per rank: its actions and, for each, the span (in ``source``) that produced it.
    ``span`` is the order's value in ``owner`` (the schedule file or command line)."""

    source: Source
    owner: Source
    span: Span
    actions: dict[int, list[Action]] = field(default_factory=dict)
    spans: dict[int, list[Span]] = field(default_factory=dict)
    clauses: dict[int, Span] = field(default_factory=dict)

    def place(self, rank: int | None, index: int | None) -> tuple[Source, Span]:
        """Where the ``index``-th action of ``rank`` was written; its rank's clause
        when ``index`` is None; the whole order when neither is known."""
        if rank in self.spans and index is not None and 0 <= index < len(self.spans[rank]):
            return self.source, self.spans[rank][index]
        if rank in self.clauses:
            return self.source, self.clauses[rank]
        return self.owner, self.span


class _Budget:
    """Counts work (loop iterations, CSV cells) against :data:`MAX_ACTIONS`."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = MAX_ACTIONS

    def take(self, n: int, span: Span, source: Source) -> None:
        if n > self.left:
            raise source.error(span, f"the order expands to more than {MAX_ACTIONS:,} actions, pipec's limit")
        self.left -= n


def _compile(node: ast.Node, names: dict[str, str], source: Source):
    try:
        return compile_int(node, names)
    except ExprError as err:
        raise source.error(err.span, err.message, *err.hints) from None


def _eval(fn, env, source: Source) -> int:
    """Evaluate a compiled field (an ExprError is turned into a DSLError by :func:`expand_block`)."""
    return fn.fn(env)


def _index(value: int, node: ast.Node, what: str, source: Source) -> int:
    if value < 0:
        hint = "ranges are written FIRST..LAST, such as 0..3" if isinstance(node, ast.BinOp) else ""
        raise source.error(node.span, f"{what} {value} is negative", hint)
    if value > MAX_INDEX:
        raise source.error(node.span, f"{what} {value} is beyond pipec's limit of {MAX_INDEX}")
    return value


class _Elem:
    """A compiled element: ``count`` its actions cheaply (ranges and loops in closed
    form where they can be), ``run`` to emit them."""

    __slots__ = ("node", "source")

    def too_many(self) -> DSLError:
        return self.source.error(self.node.span, f"the order expands to more than {MAX_ACTIONS:,} actions, "
                                 "pipec's limit")


def _compile_body(body, names: dict[str, str], source: Source) -> list[_Elem]:
    return [_ActionElem(e, names, source) if isinstance(e, ast.Action) else _RepeatElem(e, names, source)
            for e in body]


def _count_body(body: list[_Elem], env, work: _Budget) -> int:
    total = 0
    for elem in body:
        total += elem.count(env, work)
        if total > MAX_ACTIONS:
            raise elem.too_many()
    return total


class _ActionElem(_Elem):
    __slots__ = ("kind", "stage_fn", "mb_fn", "end_fn")

    def __init__(self, node: ast.Action, names, source: Source) -> None:
        self.node, self.source, self.kind = node, source, _KINDS[node.kind]
        self.stage_fn = _compile(node.stage, names, source)
        self.mb_fn = _compile(node.microbatch, names, source)
        self.end_fn = _compile(node.end, names, source) if node.end is not None else None

    def _range(self, env) -> tuple[int, int, int]:
        node, source = self.node, self.source
        stage = _index(_eval(self.stage_fn, env, source), node.stage, "stage", source)
        first = _index(_eval(self.mb_fn, env, source), node.microbatch, "microbatch", source)
        if self.end_fn is None:
            return stage, first, first
        last = _eval(self.end_fn, env, source)
        if last >= first:
            _index(last, node.end, "microbatch", source)
        return stage, first, last

    def count(self, env, work: _Budget) -> int:
        if self.end_fn is None:
            return 1
        _, first, last = self._range(env)
        return max(0, last - first + 1)

    def run(self, env, emit) -> None:
        stage, first, last = self._range(env)
        for m in range(first, last + 1):
            emit(Action(self.kind, stage, m), self.node.span)


def _loop_var(var: ast.Word, names, source: Source) -> None:
    if var.name in names:
        raise source.error(var.span, f"loop variable '{var.name}' hides a name already in use",
                           "pick another name, such as k")


def _size_names(body) -> set[str]:
    """The names a body's action count depends on: range ends and loop bounds
    (not the stage or microbatch of a single action)."""
    names: set[str] = set()
    for elem in body:
        if isinstance(elem, ast.Action) and elem.end is not None:
            names |= referenced_names(elem.microbatch) | referenced_names(elem.end)
        elif isinstance(elem, ast.Repeat):
            names |= referenced_names(elem.start) | referenced_names(elem.end) | _size_names(elem.body)
    return names


class _RepeatElem(_Elem):
    __slots__ = ("start_fn", "end_fn", "body", "var", "invariant")

    def __init__(self, node: ast.Repeat, names, source: Source) -> None:
        _loop_var(node.var, names, source)
        self.node, self.source, self.var = node, source, node.var.name
        self.start_fn = _compile(node.start, names, source)
        self.end_fn = _compile(node.end, names, source)
        self.body = _compile_body(node.body, {**names, self.var: self.var}, source)
        self.invariant = self.var not in _size_names(node.body)
        """The body's size does not depend on the loop variable: count it once."""

    def _bounds(self, env) -> range:
        return range(_eval(self.start_fn, env, self.source), _eval(self.end_fn, env, self.source) + 1)

    def count(self, env, work: _Budget) -> int:
        values = self._bounds(env)
        if not values:
            return 0
        if self.invariant:
            return len(values) * _count_body(self.body, {**env, self.var: values[0]}, work)
        work.take(len(values), self.node.span, self.source)  # iterations are work too: bounded time
        return sum(_count_body(self.body, {**env, self.var: v}, work) for v in values)

    def run(self, env, emit) -> None:
        for value in self._bounds(env):
            inner = {**env, self.var: value}
            for elem in self.body:
                elem.run(inner, emit)


def expand_block(block: ast.OrderBlock, env: dict[str, int], source: Source) -> Expanded:
    """Expand an order block. ``env`` binds the canonical names it may use
    (``ranks``, ``microbatches``, ``chunks``); a name used but not bound is an error."""
    try:
        return _expand(block, env, source)
    except ExprError as err:  # a division by zero or an overflow, at its operator
        raise source.error(err.span, err.message, *err.hints) from None


def _expand(block: ast.OrderBlock, env: dict[str, int], source: Source) -> Expanded:
    names = {alias: canon for alias, canon in ORDER_NAMES.items() if canon in env}
    out = Expanded(source, source, block.span)
    work = _Budget()  # rank clauses and loop iterations
    total = 0  # actions
    num_ranks = env.get("ranks")
    for clause in block.clauses:
        if clause.var is None:
            ranks = [(_index(clause.rank.value, clause.rank, "rank", source), {})]
            body = _compile_body(clause.body, names, source)
        else:
            _loop_var(clause.var, names, source)
            first = _eval(_compile(clause.rank, names, source), env, source)
            last = _eval(_compile(clause.end, names, source), env, source)
            _index(first, clause.rank, "rank", source)
            if last >= first:
                _index(last, clause.end, "rank", source)
            work.take(max(0, last - first + 1), clause.span, source)
            ranks = [(r, {clause.var.name: r}) for r in range(first, last + 1)]
            body = _compile_body(clause.body, {**names, clause.var.name: clause.var.name}, source)
        for rank, bound in ranks:
            if num_ranks is not None and rank >= num_ranks:
                raise source.error(clause.span, f"rank {rank} is outside the pipeline: pp is {num_ranks}",
                                   f"ranks are 0..{num_ranks - 1}")
            if rank in out.actions:
                first_at = out.clauses[rank]
                raise source.error(clause.span, f"rank {rank} is given twice",
                                   f"its first clause is at line {first_at.line}")
            if rank >= MAX_RANKS:
                raise source.error(clause.span, f"rank {rank} is beyond pipec's limit of {MAX_RANKS} pipeline ranks")
            acts: list[Action] = []
            spans: list[Span] = []

            def emit(action: Action, span: Span) -> None:
                acts.append(action)
                spans.append(span)

            local = {**env, **bound}
            total += _count_body(body, local, work)  # cheap: no action is made yet
            if total > MAX_ACTIONS:
                raise source.error(clause.span, f"the order expands to more than {MAX_ACTIONS:,} actions, "
                                   "pipec's limit")
            for elem in body:
                elem.run(local, emit)
            out.actions[rank], out.spans[rank], out.clauses[rank] = acts, spans, clause.span
    return out


def read_csv(path: str, base_dir: str, node: ast.Node, source: Source) -> Expanded:
    """Read a torch compute-only CSV order (path relative to ``base_dir``)."""
    full = path if os.path.isabs(path) else os.path.join(base_dir, path)
    try:
        size = os.path.getsize(full)
        if size > MAX_CSV_BYTES:
            raise source.error(node.span, f"order file '{path}' is {size:,} bytes, more than pipec reads "
                               f"({MAX_CSV_BYTES:,})")
        with open(full, encoding="utf-8") as f:
            text = f.read()
    except DSLError:
        raise
    except (OSError, UnicodeDecodeError, ValueError) as err:  # ValueError: a path with a NUL byte
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise source.error(node.span, f"cannot read order file '{path}': {reason}",
                           f"paths are relative to {'the schedule file' if base_dir != '.' else 'this folder'}"
                           f" ({os.path.abspath(base_dir)})") from None
    csv_source = Source(path, text)
    lines = text.split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise source.error(node.span, f"order file '{path}' is empty")
    out = Expanded(csv_source, source, node.span)
    budget = _Budget()
    for row, line in enumerate(lines):
        acts: list[Action] = []
        spans: list[Span] = []
        col = 1
        for cell in line.rstrip("\r").split(","):
            text_cell = cell.strip()
            start = col + (len(cell) - len(cell.lstrip()))
            span = Span(row + 1, start, row + 1, start + max(1, len(text_cell)))
            col += len(cell) + 1
            if not text_cell:
                continue
            try:  # torch's cell grammar, shared with `pipec import` (text_cell is not blank: an action)
                cell_action, why = parse_cell(text_cell), None
                typ = cell_action.type
            except CellError as err:
                cell_action, typ, why = None, err.type, err.reason
            if cell_action is None or typ not in COMPUTE_TYPES:
                if typ is not None and typ not in COMPUTE_TYPES:
                    raise csv_source.error(span, f"'{text_cell}' is a communication action: this is torch's "
                                           "compute+comms form", "pipec reads the compute-only form here; "
                                           "use `pipec import FILE.csv` for the other")
                if why == "overlap":
                    raise csv_source.error(span, "OVERLAP_F_B actions are not supported",
                                           "write the overlapped F and B as two cells")
                raise csv_source.error(span, f"unknown action '{text_cell}'",
                                       "cells look like 2F0 (stage 2, forward, microbatch 0); kinds are F, B, I, W")
            stage, kind, mb = cell_action.stage, cell_action.type, cell_action.microbatch
            if stage > MAX_INDEX or mb > MAX_INDEX:
                raise csv_source.error(span, f"'{text_cell}' is beyond pipec's limit of {MAX_INDEX} "
                                       "for a stage or microbatch")
            budget.take(1, span, csv_source)
            acts.append(Action(_KINDS[kind], stage, mb))
            spans.append(span)
        if row >= MAX_RANKS:
            raise csv_source.error(Span(row + 1, 1, row + 1, 2), f"more than {MAX_RANKS} rows (ranks), pipec's limit")
        out.actions[row], out.spans[row] = acts, spans
        out.clauses[row] = Span(row + 1, 1, row + 1, max(2, len(line) + 1))
    return out


def _placement(exp: Expanded) -> tuple[int, ...]:
    owner: dict[int, int] = {}
    for rank in sorted(exp.actions):
        for action, span in zip(exp.actions[rank], exp.spans[rank]):
            other = owner.setdefault(action.stage, rank)
            if other != rank:
                raise exp.source.error(span, f"stage {action.stage} runs on rank {other} and on rank {rank}",
                                       "a stage belongs to one rank: every action of a stage goes in "
                                       "that rank's clause")
    num_stages = max(owner, default=-1) + 1
    for s in range(num_stages):
        if s not in owner:
            raise exp.owner.error(exp.span, f"stage {s} appears in no rank's order",
                                   f"stages are numbered 0..{num_stages - 1} without gaps")
    return tuple(owner[s] for s in range(num_stages))


def shape(exp: Expanded) -> tuple[int, int, tuple[int, ...]]:
    """(ranks, microbatches, placement) an expanded order covers."""
    if not any(exp.actions.values()):
        raise exp.owner.error(exp.span, "the order has no actions")
    num_ranks = max(exp.actions) + 1
    for r in range(num_ranks):
        if r not in exp.actions:
            raise exp.owner.error(exp.span, f"rank {r} has no actions", f"add `rank {r}: ...`")
    placement = _placement(exp)
    num_mb = 1 + max((a.microbatch for acts in exp.actions.values() for a in acts), default=0)
    return num_ranks, num_mb, placement
