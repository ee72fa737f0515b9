"""torch.distributed.pipelining's schedule CSV, compute-only form: cells, rows and compute orders (pure Python).

torch writes a schedule as one CSV row per pp rank, one cell per action; a
cell is ``<stage><type><microbatch>`` (``2F0``, ``1I3``, ``0SEND_F1``,
``0REDUCE_GRAD``) and an empty cell is an idle slot. This module owns the
cell grammar (:func:`parse_cell`, shared by every reader: the compiler's
``pipec import`` of either form, and the schedule language's ``order
"file.csv"``), the rows of a file, and the compute-only form: F, B, I, W
per rank, which is a :class:`~pipec.schedules.order.ComputeOrder`
(:func:`parse_compute_csv`, :func:`format_compute_csv`). The compute+comms
form, a Program, lives with the IR in ``pipec.compiler.ir.torch_csv``.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass
from typing import Sequence

from pipec.errors import PipecError
from pipec.schedules.order import Action, ComputeOrder, Kind

__all__ = [
    "TorchCsvError",
    "CellError",
    "TorchAction",
    "COMPUTE_TYPES",
    "COMM_TYPES",
    "OTHER_TYPES",
    "parse_cell",
    "where",
    "Rows",
    "parse_rows",
    "check_compute",
    "compute_order",
    "parse_compute_csv",
    "compute_rows",
    "format_rows",
    "format_compute_csv",
]

COMPUTE_TYPES = ("F", "B", "I", "W")
COMM_TYPES = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
OTHER_TYPES = ("REDUCE_GRAD", "UNSHARD", "RESHARD")
"""torch's ``_ComputationType`` values pipec reads besides compute and comms; OVERLAP_F_B is refused.
In the compute+comms form (``pipec.compiler.ir.torch_csv``) they are sharded data parallelism's
instructions: ``UNSHARD`` / ``RESHARD`` are ``UN<s>`` / ``RE<s>`` and ``REDUCE_GRAD`` is ``RS<s>`` on a
mesh that shards parameters (else ``AR<s>:dp``); the compute-only form skips them."""

_CELL_RE = re.compile(r"(\d+)(REDUCE_GRAD|UNSHARD|RESHARD|SEND_F|RECV_F|SEND_B|RECV_B|[FBIW])(\d*)")
_KIND_OF = {"F": Kind.F, "B": Kind.B, "I": Kind.I, "W": Kind.W}


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


@dataclass(frozen=True, slots=True)
class TorchAction:
    """One cell of torch's CSV: ``type`` is torch's ``_ComputationType`` value."""

    stage: int
    type: str
    microbatch: int | None = None

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
            if a.type not in _KIND_OF:
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
                missing = {None: f"{s}F{mb} and its backward", "F": f"a backward ({s}B{mb} or {s}I{mb})", "I": f"{s}W{mb}"}[cur]
                raise TorchCsvError(
                    f"{source}: rank {rank} (row {rank + 1}): stage {s} microbatch {mb} is missing "
                    f"{missing}; every stage needs all {num_mb} microbatches"
                )
    return tuple(owner[s][0] for s in range(num_stages)), num_mb


def compute_order(rows: Sequence[Sequence[TorchAction | None]], placement: tuple[int, ...],
                  num_microbatches: int) -> ComputeOrder:
    """The compute actions (F, B, I, W) of every row, in order; other cells are skipped."""
    ranks = tuple(
        tuple(Action(_KIND_OF[a.type], a.stage, a.microbatch) for a in row if a is not None and a.type in _KIND_OF)
        for row in rows
    )
    return ComputeOrder(num_ranks=len(rows), num_microbatches=num_microbatches, placement=placement, ranks=ranks)


def parse_compute_csv(text: str, source: str = "<csv>") -> ComputeOrder:
    """A compute-only CSV (what torch's ``_load_csv(format="compute_only")`` reads) as a compute order."""
    rows = parse_rows(text, source)
    for rank, row in enumerate(rows):
        for col, a in enumerate(row):
            if a is not None and a.type not in _KIND_OF:
                raise TorchCsvError(
                    f"{where(source, rank, col, a.text())}: a compute_only schedule holds F, B, I and W "
                    "only; read it as compute_comms (pipec import) instead")
    placement, num_mb = check_compute(rows, source)
    return compute_order(rows, placement, num_mb)


def compute_rows(order: ComputeOrder) -> list[list[str]]:
    """Each rank's actions as torch's cell texts."""
    return [[f"{a.stage}{a.kind.value}{a.microbatch}" for a in actions] for actions in order.ranks]


def format_rows(rows: Sequence[Sequence[str]]) -> str:
    """Rows of cell texts as torch's CSV text (``csv`` module, CRLF, as torch writes it)."""
    out = io.StringIO()
    csv.writer(out, lineterminator="\r\n").writerows(rows)
    return out.getvalue()


def format_compute_csv(order: ComputeOrder) -> str:
    """A compute order as torch's compute-only CSV text (no REDUCE_GRAD: torch's loader refuses it there)."""
    return format_rows(compute_rows(order))
