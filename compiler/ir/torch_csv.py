"""Interop with torch.distributed.pipelining's schedule CSV (pure Python, no torch).

The cell grammar, the rows and the compute-only form live in
:mod:`pipec.schedules.torch_csv` (the schedule language reads orders with
them too); this module adds the compute+comms form, which is a Program.

torch writes a schedule as one CSV row per pp rank, one cell per action
(``PipelineScheduleMulti._dump_csv``, ``_PipelineScheduleRuntime._dump_csv``)
and reads it back with ``_load_csv(path, format=...)``. A cell is
``<stage><type><microbatch>``: ``2F0``, ``1I3``, ``0SEND_F1``,
``0REDUCE_GRAD``; an empty cell is an idle slot. There are two forms:

- ``compute_only``: F, B, I, W (torch's ``_load_csv`` refuses anything else
  there, REDUCE_GRAD included) - the input of torch's own lowering. It maps to
  a :class:`~pipec.schedules.order.ComputeOrder`; pipec's lowering turns that
  into a Program.
- ``compute_comms``: the lowered form, which torch's runtime executes as is.
  It maps to a :class:`~pipec.compiler.ir.program.Program` directly.

The mapping (DESIGN, "torch.distributed.pipelining CSV"):

============  =====================================================
torch         pipec
============  =====================================================
``sF m``      ``FWD`` (``Fs.m``); ``B``/``I``/``W`` alike
``sSEND_Fm``  ``SEND_ACT`` s.m to stage s+1 (``SAs.m>s+1@peer``)
``sRECV_Fm``  ``RECV_ACT`` s.m from stage s-1 (``RAs.m<s-1@peer``)
``sSEND_Bm``  ``SEND_GRAD`` s.m to stage s-1 (``SGs.m>s-1@peer``)
``sRECV_Bm``  ``RECV_GRAD`` s.m from stage s+1 (``RGs.m<s+1@peer``)
``sREDUCE_GRAD``  ``ALLREDUCE`` over dp (``ARs:dp``); dropped when dp = 1;
              on a mesh that shards parameters (``shard grads|full``)
              ``REDUCE_SCATTER`` (``RSs:dp``; HSDP: ``RSs:dp.shard``
              then ``ARs:dp.replicate``)
``sUNSHARD``  ``UNSHARD`` (``UNs:dp``) on a mesh that shards
              parameters; else dropped (torch inserts it always and
              ignores it for a stage that is not an FSDP module)
``sRESHARD``  ``RESHARD`` (``REs:dp``), likewise
``OVERLAP_F_B``  refused
============  =====================================================

torch's comms always join adjacent stages; ``peer`` is the pp rank that owns
the other stage, inferred (like torch does) from where compute actions
appear. Between adjacent stages on one rank (the tip of a V) torch passes
tensors locally and writes no comm, as pipec's lowering does. An imported
Program ends each rank with ``OPTIM_STEP`` (torch steps the optimizer outside
the schedule).

Export is the reverse. torch's CSV has no batches: each post becomes its own
cell (torch issues each as its own ``batch_isend_irecv``), so batch ids are
lost; import yields unbatched posts, which is how torch will run them, so
``pipec check`` on an imported file proves what torch executes. torch's
runtime also scales gradients by 1/M in ``REDUCE_GRAD``, so the
``compute_comms`` export writes a ``REDUCE_GRAD`` for every stage: where the
Program's ``AR<s>:dp`` is, or at dp = 1 right after the stage's last backward (and its send)
(where torch's own lowering puts it); ``RS<s>`` is written as the stage's
``REDUCE_GRAD`` (FSDP2's post-backward reduce-scatters), HSDP's
``AR<s>:dp.replicate`` goes with it (FSDP2 reduces a 2-D mesh's replicate
dimension in the same post-backward), and ``UN<s>`` / ``RE<s>`` are
``sUNSHARD`` / ``sRESHARD``. Skip edges (comms between non-adjacent stages)
and tie-group all-reduces have no torch equivalent and are refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from pipec.compiler.ir.program import COMM_OPS as _COMM_OPS, COMPUTE_OPS, Instruction, Op, Program
from pipec.compiler.ir.plan import Mesh
from pipec.schedules.order import ComputeOrder, Kind
from pipec.schedules.torch_csv import (
    TorchAction,
    TorchCsvError,
    check_compute,
    compute_order,
    compute_rows,
    format_rows,
    parse_rows,
    where as _where,
)

__all__ = [
    "TorchCsvError",
    "TorchAction",
    "TorchSchedule",
    "parse_torch_csv",
    "read_torch_csv",
    "format_torch_csv",
    "write_torch_csv",
]

Form = Literal["compute_only", "compute_comms"]
FORMS: tuple[str, ...] = ("compute_only", "compute_comms")


_KIND_OF = {"F": Kind.F, "B": Kind.B, "I": Kind.I, "W": Kind.W}
_OP_OF_KIND = {Kind.F: Op.FWD, Kind.B: Op.BWD, Kind.I: Op.BWD_I, Kind.W: Op.BWD_W}
_TYPE_OF_OP = {
    Op.FWD: "F", Op.BWD: "B", Op.BWD_I: "I", Op.BWD_W: "W",
    Op.SEND_ACT: "SEND_F", Op.RECV_ACT: "RECV_F", Op.SEND_GRAD: "SEND_B", Op.RECV_GRAD: "RECV_B",
}
_SHARD_OP = {"UNSHARD": Op.UNSHARD, "RESHARD": Op.RESHARD}
# Per comm type: the pipec op, the other stage's offset, and whether it is a send.
_COMM = {
    "SEND_F": (Op.SEND_ACT, +1, True),
    "RECV_F": (Op.RECV_ACT, -1, False),
    "SEND_B": (Op.SEND_GRAD, -1, True),
    "RECV_B": (Op.RECV_GRAD, +1, False),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class TorchSchedule:
    """A torch schedule CSV, parsed and checked.

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

    def to_program(self, *, dp: int = 1, mesh: Mesh | None = None) -> Program:
        """The Program of a ``compute_comms`` file, for ``mesh`` (default: ``dp`` replicas, unsharded).

        On a mesh that shards parameters, ``UNSHARD``, ``RESHARD`` and
        ``REDUCE_GRAD`` become ``UN<s>``, ``RE<s>`` and ``RS<s>`` over its
        shard group (HSDP: ``RS<s>:dp.shard`` then ``AR<s>:dp.replicate``).
        Otherwise ``REDUCE_GRAD`` becomes ``AR<s>:dp`` when ``dp > 1`` and is
        dropped at ``dp == 1``, and UNSHARD/RESHARD are dropped. Each rank ends
        with ``OPT``. A ``compute_only`` file has no comms: lower
        :meth:`to_order` instead.
        """
        if self.kind != "compute_comms":
            raise TorchCsvError(
                f"{self.source}: a compute_only schedule has no sends or receives, so it is "
                "not a Program; lower its compute order instead (TorchSchedule.to_order(), "
                "then pipec's lowering), or export torch's compute_comms form"
            )
        if dp < 1:
            raise TorchCsvError(f"dp must be >= 1 (the number of pipeline replicas), got {dp}")
        mesh = mesh or Mesh(pp=self.num_ranks, dp=dp)
        sharded, group = mesh.params_sharded, mesh.shard_group
        ranks = []
        for row in self.rows:
            out: list[Instruction] = []
            for a in row:
                if a is None or a.type in _SHARD_OP and not sharded:
                    continue
                if a.type in _KIND_OF:
                    out.append(Instruction(_OP_OF_KIND[_KIND_OF[a.type]], a.stage, a.microbatch))
                elif a.type in _SHARD_OP:
                    out.append(Instruction(_SHARD_OP[a.type], a.stage, group=group))
                elif a.type == "REDUCE_GRAD":
                    if sharded:
                        out.append(Instruction(Op.REDUCE_SCATTER, a.stage, group=group))
                        if mesh.hybrid:
                            out.append(Instruction(Op.ALLREDUCE, a.stage, group="dp.replicate"))
                    elif mesh.dp > 1:
                        out.append(Instruction(Op.ALLREDUCE, a.stage, group="dp"))
                else:
                    op, offset, is_send = _COMM[a.type]
                    other = a.stage + offset
                    out.append(
                        Instruction(
                            op,
                            a.stage,
                            a.microbatch,
                            to_stage=other if is_send else None,
                            from_stage=None if is_send else other,
                            peer=self.placement[other],
                        )
                    )
            out.append(Instruction(Op.OPTIM_STEP))
            ranks.append(tuple(out))
        return Program(tuple(ranks))


# ----------------------------------------------------------------------------- reading


def _check_others(
    rows: list[list[TorchAction | None]], placement: tuple[int, ...], num_mb: int, source: str
) -> None:
    """Comm cells: on the stage's own rank, between adjacent stages on two ranks.
    REDUCE_GRAD: once per stage, after all of its backwards (as torch's runtime needs)."""
    num_stages = len(placement)
    for rank, row in enumerate(rows):
        num_bwd: dict[int, int] = {}  # stage -> B and W cells so far in this row
        reduced: set[int] = set()
        for col, a in enumerate(row):
            if a is None:
                continue
            if a.type in ("B", "W"):
                num_bwd[a.stage] = num_bwd.get(a.stage, 0) + 1
            if a.type in _KIND_OF:
                continue
            where = _where(source, rank, col, a.text())
            if a.stage >= num_stages or placement[a.stage] != rank:
                on = "no rank" if a.stage >= num_stages else f"rank {placement[a.stage]}"
                raise TorchCsvError(
                    f"{where}: stage {a.stage} is computed on {on}, so its {a.type} belongs in "
                    f"that rank's row, not rank {rank}'s"
                )
            if a.type == "REDUCE_GRAD":
                done = num_bwd.get(a.stage, 0)
                if a.stage in reduced or done < num_mb:
                    why = "a second one" if a.stage in reduced else f"after {done} of its {num_mb} backwards"
                    raise TorchCsvError(
                        f"{where}: REDUCE_GRAD of stage {a.stage} comes once, after the stage's last "
                        f"backward (B or W); got {why}: move it after the last one, or drop it"
                    )
                reduced.add(a.stage)
            if a.type not in _COMM:
                continue
            other = a.stage + _COMM[a.type][1]
            if not 0 <= other < num_stages:
                raise TorchCsvError(
                    f"{where}: {a.type} of stage {a.stage} goes to stage {other}, which does not "
                    f"exist (stages 0..{num_stages - 1}); remove the cell"
                )
            if placement[other] == rank:
                raise TorchCsvError(
                    f"{where}: stages {a.stage} and {other} are both on rank {rank}; torch passes "
                    "tensors between them locally, so there is no send or receive; remove the cell"
                )


def parse_torch_csv(text: str, *, form: Form | None = None, source: str = "<csv>") -> TorchSchedule:
    """Parse a torch schedule CSV given as text.

    ``form`` checks the file is of that form (default: inferred from its cells).
    Errors name the rank, row and column of the offending cell and its text.
    """
    if form is not None and form not in FORMS:
        raise TorchCsvError(f"form must be one of {', '.join(FORMS)}, got {form!r}")
    rows = parse_rows(text, source)
    placement, num_mb = check_compute(rows, source)
    _check_others(rows, placement, num_mb, source)
    # A single rank needs no comms: there, torch's REDUCE_GRAD marks the lowered form too
    # (a multi-rank file with REDUCE_GRAD and no comms is a Single schedule's order, e.g. GPipe's).
    lowered = ("UNSHARD", "RESHARD", "REDUCE_GRAD") if len(rows) == 1 else ("UNSHARD", "RESHARD")
    has_comms = any(a is not None and (a.type in _COMM or a.type in lowered) for row in rows for a in row)
    kind: Form = "compute_comms" if has_comms else "compute_only"
    if form == "compute_only" and has_comms:
        rank, col, a = next(
            (r, i, a) for r, row in enumerate(rows) for i, a in enumerate(row)
            if a is not None and a.type not in _KIND_OF and a.type != "REDUCE_GRAD"
        )
        raise TorchCsvError(
            f"{_where(source, rank, col, a.text())}: a compute_only schedule holds F, B, I and W "
            "only; read it as compute_comms (or drop the form to infer it)"
        )
    if form is not None:
        kind = form
    idle = sorted(set(range(len(rows))) - set(placement))
    if idle:
        raise TorchCsvError(
            f"{source}: rank {idle[0]} (row {idle[0] + 1}) computes no stage; every rank must own "
            f"at least one stage (got {len(rows)} rows for {len(placement)} stages)"
        )
    return TorchSchedule(
        kind=kind,
        rows=tuple(tuple(r) for r in rows),
        placement=placement,
        num_microbatches=num_mb,
        source=source,
    )


def read_torch_csv(path: str | os.PathLike[str], *, form: Form | None = None) -> TorchSchedule:
    """Read a torch schedule CSV file (``_dump_csv``'s output, either form)."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise TorchCsvError(f"{os.fspath(path)}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise TorchCsvError(f"{os.fspath(path)}: not a text file: {e}") from None
    return parse_torch_csv(text, form=form, source=os.fspath(path))


# ----------------------------------------------------------------------------- writing


def _compute_rows(source: Program | ComputeOrder) -> list[list[str]]:
    if isinstance(source, ComputeOrder):
        return compute_rows(source)
    return [
        [f"{i.stage}{_TYPE_OF_OP[i.op]}{i.microbatch}" for i in instrs if i.op in COMPUTE_OPS]
        for instrs in source.ranks
    ]


def _check_exportable(program: Program) -> None:
    """Refuse what torch cannot express: skip edges, tie groups, comms within a rank."""
    for rank, instrs in enumerate(program.ranks):
        for index, ins in enumerate(instrs):
            where = f"rank {rank}, instruction {index} ({ins.text()})"
            if ins.op is Op.ALLREDUCE and ins.group.startswith("tie."):
                raise TorchCsvError(
                    f"{where}: torch's schedule has no tie-group all-reduce (torch keeps one "
                    "untied copy per stage); untie the weight or keep this plan in pipec"
                )
            if ins.op in _TYPE_OF_OP and ins.op not in COMPUTE_OPS:
                other = ins.to_stage if ins.to_stage is not None else ins.from_stage
                typ = _TYPE_OF_OP[ins.op]
                assert ins.stage is not None and other is not None
                if other != ins.stage + _COMM[typ][1]:
                    raise TorchCsvError(
                        f"{where}: a skip edge between stages {ins.stage} and {other}; torch's "
                        f"{typ} only joins adjacent stages ({ins.stage} and "
                        f"{ins.stage + _COMM[typ][1]}); repartition so that each stage only feeds "
                        "the next, or keep this plan in pipec"
                    )
                if ins.peer == rank:
                    raise TorchCsvError(
                        f"{where}: a send or receive within rank {rank}; torch passes tensors "
                        "between stages on one rank locally; lower without it"
                    )


def _reduce_grad_slots(instrs: tuple[Instruction, ...]) -> dict[int, list[int]]:
    """Where torch's lowering puts the REDUCE_GRAD of stages without ``AR<s>:dp``.

    After the stage's last B or W, and after that B's own SEND_GRAD when it
    follows among the posts right after it: index -> stages to reduce there.
    """
    has_ar = {i.stage for i in instrs if i.op is Op.ALLREDUCE or i.op is Op.REDUCE_SCATTER}
    last: dict[int, int] = {}
    for index, ins in enumerate(instrs):
        if ins.op is Op.BWD or ins.op is Op.BWD_W:
            assert ins.stage is not None
            last[ins.stage] = index
    slots: dict[int, list[int]] = {}
    for s, index in sorted(last.items(), key=lambda kv: kv[1]):
        if s in has_ar:
            continue
        bwd, at = instrs[index], index
        if bwd.op is Op.BWD:
            j = index + 1
            while j < len(instrs) and instrs[j].op in _COMM_OPS:
                ins = instrs[j]
                if ins.op is Op.SEND_GRAD and (ins.stage, ins.microbatch) == (bwd.stage, bwd.microbatch):
                    at = j
                    break
                j += 1
        slots.setdefault(at, []).append(s)
    return slots


def _comms_rows(program: Program) -> list[list[str]]:
    rows = []
    for instrs in program.ranks:
        slots = _reduce_grad_slots(instrs)
        row = []
        for index, ins in enumerate(instrs):
            if ins.op is Op.ALLREDUCE and ins.group == "dp.replicate":
                pass  # part of the stage's REDUCE_GRAD (FSDP2 on a 2-D mesh)
            elif ins.op is Op.ALLREDUCE or ins.op is Op.REDUCE_SCATTER:
                row.append(f"{ins.stage}REDUCE_GRAD")
            elif ins.op is Op.UNSHARD or ins.op is Op.RESHARD:
                row.append(f"{ins.stage}{ins.op.value}")
            elif ins.op is not Op.OPTIM_STEP:
                row.append(f"{ins.stage}{_TYPE_OF_OP[ins.op]}{ins.microbatch}")
            row.extend(f"{s}REDUCE_GRAD" for s in slots.get(index, ()))
        rows.append(row)
    return rows


def format_torch_csv(source: Program | ComputeOrder, *, form: Form = "compute_only") -> str:
    """torch's CSV text for a Program or a ComputeOrder (see :func:`write_torch_csv`)."""
    if form not in FORMS:
        raise TorchCsvError(f"form must be one of {', '.join(FORMS)}, got {form!r}")
    if isinstance(source, Program):
        _check_exportable(source)
    if form == "compute_only":
        rows = _compute_rows(source)
    elif isinstance(source, ComputeOrder):
        raise TorchCsvError(
            "the compute_comms form needs a Program (sends and receives); lower the compute "
            "order first, or export form='compute_only'"
        )
    else:
        rows = _comms_rows(source)
    return format_rows(rows)


def write_torch_csv(
    source: Program | ComputeOrder, path: str | os.PathLike[str], *, form: Form = "compute_only"
) -> None:
    """Write ``source`` as torch's schedule CSV, loadable with ``_load_csv(path, format=form)``.

    ``compute_only``: each rank's F/B/I/W in order (no REDUCE_GRAD: torch's
    loader refuses it there and adds its own). ``compute_comms`` (a Program
    only): every instruction but ``OPT``, with a ``REDUCE_GRAD`` per stage.
    Skip edges and tie-group all-reduces are refused (:class:`TorchCsvError`).
    """
    text = format_torch_csv(source, form=form)
    with open(path, "w", newline="", encoding="utf-8") as f:
        f.write(text)

