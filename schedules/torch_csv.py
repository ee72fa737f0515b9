"""torch.distributed.pipelining's schedule CSV: its grammar both ways and the checks on a file (pure Python).

torch writes a schedule as one CSV row per pp rank, one cell per action
(``PipelineScheduleMulti._dump_csv``, ``_PipelineScheduleRuntime._dump_csv``)
and reads it back with ``_load_csv(path, format=...)``. A cell is
``<stage><type><microbatch>`` (``2F0``, ``1I3``, ``0SEND_F1``), or
``<stage><type>`` for the types that come once per stage or window
(``0REDUCE_GRAD``, ``0UNSHARD``, ``0RESHARD``); an empty cell is an idle
slot. torch's ``OVERLAP_F_B`` (DualPipeV's fused pair) is refused. There are
two forms:

- ``compute_only``: F, B, I, W (torch's ``_load_csv`` refuses anything else
  there, REDUCE_GRAD included), the input of torch's own lowering: a
  :class:`~pipec.schedules.order.ComputeOrder` (:meth:`TorchCsv.to_order`,
  :func:`parse_compute_csv`, :func:`format_compute_csv`).
- ``compute_comms``: the lowered form torch's runtime executes as is, with
  SEND_F / RECV_F / SEND_B / RECV_B (always between adjacent stages: a
  SEND_F or RECV_B of stage s joins s+1, a RECV_F or SEND_B joins s-1),
  REDUCE_GRAD (once per stage, after its last backward), UNSHARD and
  RESHARD. What it is as a Program depends on the mesh: that mapping is
  ``pipec.compiler.ir.torch_csv``'s, the only part of the CSV the compiler holds.

This module owns the cell grammar (:func:`parse_cell`, shared by every
reader: ``pipec import`` of either form and the schedule language's ``order
"file.csv"``; :meth:`TorchAction.text` the other way), the rows of a file
(:func:`parse_rows`, :func:`format_rows`) and the checks on a whole file
(:meth:`TorchCsv.parse`).
"""

from __future__ import annotations

import csv
import io
import os
import re
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

from pipec.errors import PipecError
from pipec.schedules.order import Action, ComputeOrder, Kind

__all__ = [
    "TorchCsvError",
    "CellError",
    "TorchAction",
    "COMPUTE_TYPES",
    "COMM_TYPES",
    "OTHER_TYPES",
    "Form",
    "FORMS",
    "check_form",
    "parse_cell",
    "where",
    "Rows",
    "parse_rows",
    "check_compute",
    "check_comms",
    "TorchCsv",
    "compute_order",
    "parse_compute_csv",
    "compute_rows",
    "format_rows",
    "format_compute_csv",
]

COMPUTE_TYPES = ("F", "B", "I", "W")
COMM_TYPES = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
OTHER_TYPES = ("REDUCE_GRAD", "UNSHARD", "RESHARD")
"""torch's ``_ComputationType`` values pipec reads besides compute and comms (no microbatch); OVERLAP_F_B
is refused. In the compute+comms form (``pipec.compiler.ir.torch_csv``) they are sharded data parallelism's
instructions: ``UNSHARD`` / ``RESHARD`` are ``UN<s>`` / ``RE<s>`` and ``REDUCE_GRAD`` is ``RS<s>`` on a
mesh that shards parameters (else ``AR<s>:dp``); the compute-only form skips them."""

_COMM_OFFSET = {"SEND_F": +1, "RECV_F": -1, "SEND_B": -1, "RECV_B": +1}
"""Per comm type, the other stage's offset: torch's comms always join adjacent stages."""
_KIND_OF = {kind.value: kind for kind in Kind}
_CELL_RE = re.compile(r"(\d+)(REDUCE_GRAD|UNSHARD|RESHARD|SEND_F|RECV_F|SEND_B|RECV_B|[FBIW])(\d*)")

Form = Literal["compute_only", "compute_comms"]
FORMS: tuple[str, ...] = ("compute_only", "compute_comms")


class TorchCsvError(PipecError):
    """A torch schedule CSV cannot be read, or a program cannot be written as one."""


class CellError(TorchCsvError):
    """One cell is not a torch action; the message says why (without the cell's place, which the reader adds)."""

    def __init__(self, message: str, *, reason: str, type: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        """``overlap`` (OVERLAP_F_B), ``unknown`` (no action), or ``microbatch`` (one missing or not allowed)."""
        self.type = type
        """The torch type when the cell names one."""


def check_form(form: str | None) -> None:
    """Refuse a form that is not one of :data:`FORMS` (``None``: inferred, allowed)."""
    if form is not None and form not in FORMS:
        raise TorchCsvError(f"form must be one of {', '.join(FORMS)}, got {form!r}")


@dataclass(frozen=True, slots=True)
class TorchAction:
    """One cell of torch's CSV: ``type`` is torch's ``_ComputationType`` value."""

    stage: int
    type: str
    microbatch: int | None = None

    @classmethod
    def of(cls, action: Action) -> TorchAction:
        """The cell of a compute action (``F2.0`` is ``2F0``)."""
        return cls(action.stage, action.kind.value, action.microbatch)

    @property
    def kind(self) -> Kind | None:
        """The compute kind (F, B, I, W), or None for the other types."""
        return _KIND_OF.get(self.type)

    @property
    def other_stage(self) -> int | None:
        """A comm's other end (the adjacent stage it sends to or receives from), else None."""
        offset = _COMM_OFFSET.get(self.type)
        return None if offset is None else self.stage + offset

    @property
    def is_send(self) -> bool:
        return self.type in ("SEND_F", "SEND_B")

    def text(self) -> str:
        """The cell text torch writes: ``2F0``, ``0SEND_B3``, ``1REDUCE_GRAD``."""
        return f"{self.stage}{self.type}{'' if self.microbatch is None else self.microbatch}"

    __str__ = text


def parse_cell(cell: str) -> TorchAction | None:
    """One cell (surrounding blanks ignored); ``None`` for an idle cell. Raises :class:`CellError`."""
    text = cell.strip()
    if not text:
        return None
    if "OVERLAP_F_B" in text:
        raise CellError(
            "OVERLAP_F_B (DualPipeV's fused forward+backward) is not supported: pipec runs one compute action "
            "at a time; write its sub-actions as separate cells (e.g. '0F7,3B1' for '(0F7;3B1)OVERLAP_F_B')",
            reason="overlap")
    m = _CELL_RE.fullmatch(text)
    if m is None:
        raise CellError(
            "not a torch action; expected <stage><type><microbatch> with type one of F, B, I, W, SEND_F, "
            "RECV_F, SEND_B, RECV_B (e.g. '2F0', '0SEND_F1'), or <stage>REDUCE_GRAD / UNSHARD / RESHARD",
            reason="unknown")
    stage, typ, mb = int(m[1]), m[2], m[3]
    if typ in OTHER_TYPES:  # once per stage (REDUCE_GRAD) or per window (UNSHARD, RESHARD): no microbatch
        if mb:
            raise CellError(f"{typ} takes no microbatch; write '{stage}{typ}'", reason="microbatch", type=typ)
        return TorchAction(stage, typ, None)
    if not mb:
        raise CellError(f"{typ} needs a microbatch number, e.g. '{stage}{typ}0'", reason="microbatch", type=typ)
    return TorchAction(stage, typ, int(mb))


def where(source: str, rank: int, col: int, cell: str) -> str:
    """How messages name a cell: ``file: rank R (row R+1), column C ('cell')``."""
    return f"{source}: rank {rank} (row {rank + 1}), column {col + 1} ({cell!r})"


Rows = list[list[TorchAction | None]]


def parse_rows(text: str, source: str = "<csv>") -> Rows:
    """Every cell of every row (trailing blank rows dropped); a bad cell is named by its place."""
    raw_rows = list(csv.reader(io.StringIO(text)))
    while raw_rows and not any(c.strip() for c in raw_rows[-1]):
        raw_rows.pop()  # trailing blank lines; torch never writes a rank without actions
    rows: Rows = []
    for r, row in enumerate(raw_rows):
        out = []
        for col, cell in enumerate(row):
            try:
                out.append(parse_cell(cell))
            except CellError as e:
                raise TorchCsvError(f"{where(source, r, col, cell)}: {e}") from None
        rows.append(out)
    return rows


def _first(rows: Sequence[Sequence[TorchAction | None]],
           pick: Callable[[TorchAction], bool]) -> tuple[int, int, TorchAction] | None:
    """The first cell, row by row, that ``pick`` accepts: (rank, column, action)."""
    return next(((r, c, a) for r, row in enumerate(rows) for c, a in enumerate(row) if a is not None and pick(a)),
                None)


def _refuse_comms(rows: Rows, source: str, pick: Callable[[TorchAction], bool], what_to_do: str) -> None:
    found = _first(rows, pick)
    if found is not None:
        rank, col, a = found
        raise TorchCsvError(f"{where(source, rank, col, a.text())}: a compute_only schedule holds F, B, I and W "
                            f"only; {what_to_do}")


def check_compute(rows: Rows, source: str = "<csv>") -> tuple[tuple[int, ...], int]:
    """Infer placement and M; check each (stage, mb) gets one F and one backward, in order."""
    owner: dict[int, tuple[int, int]] = {}  # stage -> (rank, column of its first compute)
    state: dict[tuple[int, int], str] = {}  # (stage, mb) -> "F" | "I" | "done"
    max_stage = max_mb = -1
    for rank, row in enumerate(rows):
        for col, a in enumerate(row):
            if a is None:
                continue
            max_stage = max(max_stage, a.stage)
            if a.kind is None:
                continue
            at = where(source, rank, col, a.text())
            s, mb = a.stage, a.microbatch
            assert mb is not None
            max_mb = max(max_mb, mb)
            if s in owner and owner[s][0] != rank:
                r0, c0 = owner[s]
                raise TorchCsvError(
                    f"{at}: stage {s} is computed on rank {r0} (row {r0 + 1}, column {c0 + 1}) "
                    f"and on rank {rank}; a stage lives on one rank: move its actions to one row"
                )
            owner.setdefault(s, (rank, col))
            cur = state.get((s, mb))
            if a.type == "F":
                if cur is not None:
                    raise TorchCsvError(f"{at}: second forward of stage {s} microbatch {mb}; keep one")
                state[(s, mb)] = "F"
            elif a.type in ("B", "I"):
                if cur is None:
                    raise TorchCsvError(
                        f"{at}: backward of stage {s} microbatch {mb} before its forward "
                        f"{s}F{mb}; put the forward earlier in the row"
                    )
                if cur != "F":
                    raise TorchCsvError(f"{at}: second backward of stage {s} microbatch {mb}; keep one")
                state[(s, mb)] = "I" if a.type == "I" else "done"
            else:  # W
                if cur != "I":
                    raise TorchCsvError(
                        f"{at}: weight-grad W of stage {s} microbatch {mb} needs its input-grad "
                        f"{s}I{mb} earlier in the same row"
                    )
                state[(s, mb)] = "done"
    if max_stage < 0:
        raise TorchCsvError(f"{source}: no actions; expected one row per rank with cells like '0F0'")
    num_stages, num_mb = max_stage + 1, max_mb + 1
    for s in range(num_stages):
        if s not in owner:
            raise TorchCsvError(
                f"{source}: stage {s} has no compute action in any row, so its rank is unknown; "
                f"stages must be numbered 0..{num_stages - 1} and each computed somewhere"
            )
        rank = owner[s][0]
        for mb in range(num_mb):
            cur = state.get((s, mb))
            if cur != "done":
                missing = {None: f"{s}F{mb} and its backward", "F": f"a backward ({s}B{mb} or {s}I{mb})",
                           "I": f"{s}W{mb}"}[cur]
                raise TorchCsvError(
                    f"{source}: rank {rank} (row {rank + 1}): stage {s} microbatch {mb} is missing "
                    f"{missing}; every stage needs all {num_mb} microbatches"
                )
    return tuple(owner[s][0] for s in range(num_stages)), num_mb


def check_comms(rows: Rows, placement: tuple[int, ...], num_mb: int, source: str = "<csv>") -> None:
    """The other cells: on the stage's own rank; comms between adjacent stages on two ranks;
    REDUCE_GRAD once per stage, after all of its backwards (as torch's runtime needs)."""
    num_stages = len(placement)
    for rank, row in enumerate(rows):
        num_bwd: dict[int, int] = {}  # stage -> B and W cells so far in this row
        reduced: set[int] = set()
        for col, a in enumerate(row):
            if a is None:
                continue
            if a.type in ("B", "W"):
                num_bwd[a.stage] = num_bwd.get(a.stage, 0) + 1
            if a.kind is not None:
                continue
            at = where(source, rank, col, a.text())
            if a.stage >= num_stages or placement[a.stage] != rank:
                on = "no rank" if a.stage >= num_stages else f"rank {placement[a.stage]}"
                raise TorchCsvError(
                    f"{at}: stage {a.stage} is computed on {on}, so its {a.type} belongs in "
                    f"that rank's row, not rank {rank}'s"
                )
            if a.type == "REDUCE_GRAD":
                done = num_bwd.get(a.stage, 0)
                if a.stage in reduced or done < num_mb:
                    why = "a second one" if a.stage in reduced else f"after {done} of its {num_mb} backwards"
                    raise TorchCsvError(
                        f"{at}: REDUCE_GRAD of stage {a.stage} comes once, after the stage's last "
                        f"backward (B or W); got {why}: move it after the last one, or drop it"
                    )
                reduced.add(a.stage)
            other = a.other_stage
            if other is None:
                continue
            if not 0 <= other < num_stages:
                raise TorchCsvError(
                    f"{at}: {a.type} of stage {a.stage} goes to stage {other}, which does not "
                    f"exist (stages 0..{num_stages - 1}); remove the cell"
                )
            if placement[other] == rank:
                raise TorchCsvError(
                    f"{at}: stages {a.stage} and {other} are both on rank {rank}; torch passes "
                    "tensors between them locally, so there is no send or receive; remove the cell"
                )


def compute_order(rows: Sequence[Sequence[TorchAction | None]], placement: tuple[int, ...],
                  num_microbatches: int) -> ComputeOrder:
    """The compute actions (F, B, I, W) of every row, in order; other cells are skipped."""
    ranks = tuple(
        tuple(Action(a.kind, a.stage, a.microbatch) for a in row if a is not None and a.kind is not None)
        for row in rows
    )
    return ComputeOrder(num_ranks=len(rows), num_microbatches=num_microbatches, placement=placement, ranks=ranks)


@dataclass(frozen=True, slots=True, kw_only=True)
class TorchCsv:
    """A torch schedule CSV, parsed and checked (:meth:`parse`).

    ``rows[r]`` holds pp rank ``r``'s cells in order (``None`` = idle cell).
    ``placement``, ``num_microbatches`` and ``kind`` are inferred from the
    cells: a stage lives on the rank whose row computes it; ``kind`` is
    ``"compute_comms"`` when any cell is a send, receive, UNSHARD or RESHARD
    (or, on a single rank, REDUCE_GRAD).
    """

    kind: Form
    rows: tuple[tuple[TorchAction | None, ...], ...]
    placement: tuple[int, ...]
    num_microbatches: int
    source: str = "<csv>"

    @property
    def num_ranks(self) -> int:
        return len(self.rows)

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    def to_order(self) -> ComputeOrder:
        """The compute actions of every row, in order (either form)."""
        return compute_order(self.rows, self.placement, self.num_microbatches)

    @classmethod
    def parse(cls, text: str, *, form: Form | None = None, source: str = "<csv>"):
        """Parse a torch schedule CSV given as text (an instance of ``cls``).

        ``form`` checks the file is of that form (default: inferred from its cells).
        Errors name the rank, row and column of the offending cell and its text.
        """
        check_form(form)
        rows = parse_rows(text, source)
        placement, num_mb = check_compute(rows, source)
        check_comms(rows, placement, num_mb, source)
        # A single rank needs no comms: there, torch's REDUCE_GRAD marks the lowered form too
        # (a multi-rank file with REDUCE_GRAD and no comms is a Single schedule's order, e.g. GPipe's).
        lowered = COMM_TYPES + ("UNSHARD", "RESHARD")
        lowered_here = lowered + ("REDUCE_GRAD",) if len(rows) == 1 else lowered
        kind: Form = "compute_comms" if _first(rows, lambda a: a.type in lowered_here) else "compute_only"
        if form == "compute_only" and kind == "compute_comms":  # name a comm or shard cell, else REDUCE_GRAD
            what_to_do = "read it as compute_comms (or drop the form to infer it)"
            _refuse_comms(rows, source, lambda a: a.type in lowered, what_to_do)
            _refuse_comms(rows, source, lambda a: a.type in lowered_here, what_to_do)
        idle = sorted(set(range(len(rows))) - set(placement))
        if idle:
            raise TorchCsvError(
                f"{source}: rank {idle[0]} (row {idle[0] + 1}) computes no stage; every rank must own "
                f"at least one stage (got {len(rows)} rows for {len(placement)} stages)"
            )
        return cls(kind=form or kind, rows=tuple(map(tuple, rows)), placement=placement, num_microbatches=num_mb,
                   source=source)

    @classmethod
    def read(cls, path: str | os.PathLike[str], *, form: Form | None = None):
        """Read a torch schedule CSV file (``_dump_csv``'s output, either form)."""
        try:
            with open(path, newline="", encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise TorchCsvError(f"{os.fspath(path)}: cannot read: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise TorchCsvError(f"{os.fspath(path)}: not a text file: {e}") from None
        return cls.parse(text, form=form, source=os.fspath(path))


def parse_compute_csv(text: str, source: str = "<csv>") -> ComputeOrder:
    """A compute-only CSV (what torch's ``_load_csv(format="compute_only")`` reads) as a compute order."""
    rows = parse_rows(text, source)
    _refuse_comms(rows, source, lambda a: a.kind is None, "read it as compute_comms (pipec import) instead")
    placement, num_mb = check_compute(rows, source)
    return compute_order(rows, placement, num_mb)


def compute_rows(order: ComputeOrder) -> list[list[TorchAction]]:
    """Each rank's actions as torch's cells."""
    return [[TorchAction.of(a) for a in actions] for actions in order.ranks]


def format_rows(rows: Sequence[Sequence[TorchAction | None]]) -> str:
    """Rows of cells as torch's CSV text (``csv`` module, CRLF, as torch writes it; None: an idle cell)."""
    out = io.StringIO()
    csv.writer(out, lineterminator="\r\n").writerows([["" if a is None else a.text() for a in row] for row in rows])
    return out.getvalue()


def format_compute_csv(order: ComputeOrder) -> str:
    """A compute order as torch's compute-only CSV text (no REDUCE_GRAD: torch's loader refuses it there)."""
    return format_rows(compute_rows(order))
