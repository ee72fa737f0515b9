"""torch.distributed.pipelining's schedule CSV as pipec's IR: parsed cells to a Program and back (no torch).

The CSV itself - the cell grammar both ways, the rows, the checks on a file,
the forms and the compute-only form's :class:`~pipec.schedules.order.ComputeOrder`
- is :mod:`pipec.schedules.torch_csv`'s. This module maps the parsed cells of
the ``compute_comms`` form to a :class:`~pipec.compiler.ir.program.Program`
on a :class:`~pipec.compiler.ir.plan.Mesh` (:meth:`TorchSchedule.to_program`),
and a Program (or an order) back to cells (:func:`format_torch_csv`).

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

from pipec.compiler.ir.plan import Mesh
from pipec.compiler.ir.program import COMM_OPS, COMPUTE_OPS, Instruction, Op, Program
from pipec.schedules.order import ComputeOrder
from pipec.schedules.torch_csv import Form, TorchAction, TorchCsv, TorchCsvError, check_form, compute_rows, format_rows

__all__ = [
    "TorchCsvError",
    "TorchAction",
    "TorchSchedule",
    "parse_torch_csv",
    "read_torch_csv",
    "format_torch_csv",
    "write_torch_csv",
]

_OP_OF_TYPE = {
    "F": Op.FWD, "B": Op.BWD, "I": Op.BWD_I, "W": Op.BWD_W,
    "SEND_F": Op.SEND_ACT, "RECV_F": Op.RECV_ACT, "SEND_B": Op.SEND_GRAD, "RECV_B": Op.RECV_GRAD,
    "UNSHARD": Op.UNSHARD, "RESHARD": Op.RESHARD,
}
"""Each torch type but REDUCE_GRAD (whose instructions depend on the mesh), and its op."""
_TYPE_OF_OP = {op: typ for typ, op in _OP_OF_TYPE.items()}


@dataclass(frozen=True, slots=True, kw_only=True)
class TorchSchedule(TorchCsv):
    """A torch schedule CSV, parsed and checked (:class:`~pipec.schedules.torch_csv.TorchCsv`), with its Program."""

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
        return Program(tuple(
            tuple(ins for a in row if a is not None for ins in _instructions(a, self.placement, mesh))
            + (Instruction(Op.OPTIM_STEP),)
            for row in self.rows
        ))


def _instructions(a: TorchAction, placement: tuple[int, ...], mesh: Mesh) -> tuple[Instruction, ...]:
    """What one cell is on ``mesh``: no instruction, one, or (HSDP's REDUCE_GRAD) two."""
    if a.type == "REDUCE_GRAD":
        if mesh.params_sharded:
            scatter = Instruction(Op.REDUCE_SCATTER, a.stage, group=mesh.shard_group)
            return (scatter, Instruction(Op.ALLREDUCE, a.stage, group="dp.replicate")) if mesh.hybrid else (scatter,)
        return (Instruction(Op.ALLREDUCE, a.stage, group="dp"),) if mesh.dp > 1 else ()
    op = _OP_OF_TYPE[a.type]
    if op is Op.UNSHARD or op is Op.RESHARD:
        return (Instruction(op, a.stage, group=mesh.shard_group),) if mesh.params_sharded else ()
    other = a.other_stage
    if other is None:
        return (Instruction(op, a.stage, a.microbatch),)
    return (Instruction(op, a.stage, a.microbatch, to_stage=other if a.is_send else None,
                        from_stage=None if a.is_send else other, peer=placement[other]),)


parse_torch_csv = TorchSchedule.parse
"""``parse_torch_csv(text, *, form=None, source="<csv>")``: a :class:`TorchSchedule`
(:meth:`~pipec.schedules.torch_csv.TorchCsv.parse` says what it checks)."""
read_torch_csv = TorchSchedule.read
"""``read_torch_csv(path, *, form=None)``: a :class:`TorchSchedule` read from a file (either form)."""


# ----------------------------------------------------------------------------- writing


def _cell(ins: Instruction) -> TorchAction:
    """The cell of an instruction (an ALLREDUCE or REDUCE_SCATTER: its stage's REDUCE_GRAD)."""
    if ins.op is Op.ALLREDUCE or ins.op is Op.REDUCE_SCATTER:
        return TorchAction(ins.stage, "REDUCE_GRAD")
    return TorchAction(ins.stage, _TYPE_OF_OP[ins.op], ins.microbatch)


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
            if ins.op in COMM_OPS:
                other = ins.to_stage if ins.to_stage is not None else ins.from_stage
                cell = _cell(ins)
                assert ins.stage is not None and other is not None
                if other != cell.other_stage:
                    raise TorchCsvError(
                        f"{where}: a skip edge between stages {ins.stage} and {other}; torch's "
                        f"{cell.type} only joins adjacent stages ({ins.stage} and "
                        f"{cell.other_stage}); repartition so that each stage only feeds "
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
            while j < len(instrs) and instrs[j].op in COMM_OPS:
                ins = instrs[j]
                if ins.op is Op.SEND_GRAD and (ins.stage, ins.microbatch) == (bwd.stage, bwd.microbatch):
                    at = j
                    break
                j += 1
        slots.setdefault(at, []).append(s)
    return slots


def _comms_rows(program: Program) -> list[list[TorchAction]]:
    rows = []
    for instrs in program.ranks:
        slots = _reduce_grad_slots(instrs)
        row = []
        for index, ins in enumerate(instrs):
            if ins.op is not Op.OPTIM_STEP and not (ins.op is Op.ALLREDUCE and ins.group == "dp.replicate"):
                row.append(_cell(ins))  # HSDP's replicate all-reduce is part of its stage's REDUCE_GRAD (FSDP2)
            row.extend(TorchAction(s, "REDUCE_GRAD") for s in slots.get(index, ()))
        rows.append(row)
    return rows


def format_torch_csv(source: Program | ComputeOrder, *, form: Form = "compute_only") -> str:
    """torch's CSV text for a Program or a ComputeOrder (see :func:`write_torch_csv`)."""
    check_form(form)
    if isinstance(source, ComputeOrder):
        if form == "compute_comms":
            raise TorchCsvError(
                "the compute_comms form needs a Program (sends and receives); lower the compute "
                "order first, or export form='compute_only'"
            )
        return format_rows(compute_rows(source))
    _check_exportable(source)
    if form == "compute_only":
        return format_rows([[_cell(i) for i in instrs if i.op in COMPUTE_OPS] for instrs in source.ranks])
    return format_rows(_comms_rows(source))


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

