"""The instruction set, programs, and their text form.

A :class:`Program` is, for each pp rank, an ordered tuple of
:class:`Instruction`. All dp replicas of a pp rank run the same program. The
opcode set is closed; each opcode's fields:

- ``FWD`` (``F0.3``): ``stage``, ``microbatch``. Forward of the stage; the
  last stage also computes the loss. Its inputs come from the ``RECV_ACT``
  posted earlier on this rank (or from a local producer stage); its outputs go
  to the ``SEND_ACT`` posted after it.
- ``BWD`` (``B0.3``): ``stage``, ``microbatch``. Full backward (input and
  weight grads). Needs the ``RECV_GRAD`` of every consumer edge; pairs with the
  ``SEND_GRAD`` posted after it.
- ``BWD_I`` (``I0.3``): input grads only; keeps what ``BWD_W`` needs.
- ``BWD_W`` (``W0.3``): weight grads only, after its ``BWD_I``; no comm.
- ``SEND_ACT`` (``SA0.3>1@1``): ``stage``, ``microbatch``, ``to_stage``,
  ``peer``. Post the send of the stage's output to ``to_stage`` on pp rank
  ``peer``; pairs with that rank's ``RECV_ACT`` (``RA1.3<0@0``).
- ``RECV_ACT`` (``RA1.3<0@0``): ``stage``, ``microbatch``, ``from_stage``,
  ``peer``. Post the receive of the stage's input from ``from_stage``.
- ``SEND_GRAD`` (``SG1.3>0@0``): ``stage``, ``microbatch``, ``to_stage``,
  ``peer``. Post the send of the grad w.r.t. the stage's input (coming from
  ``to_stage``); pairs with the producer's ``RECV_GRAD``.
- ``RECV_GRAD`` (``RG0.3<1@1``): ``stage``, ``microbatch``, ``from_stage``,
  ``peer``. Post the receive of the grad w.r.t. the stage's output.
- ``ALLREDUCE`` (``AR0:dp``, ``AR0:tie.wte``): ``stage``, ``group``. Reduce the
  stage's param grads over its dp replicas (``dp``), or a tied weight's grads
  over its tie group (``tie.<name>``).
- ``UNSHARD`` (``UN0:dp``, ``UN0:dp.shard``): ``stage``, ``group``. Sharded
  data parallelism (``shard grads`` or ``full``): start gathering the stage's
  parameter shards over its shard group (an all-gather, posted early so it
  overlaps the compute before it); the stage's next compute waits for it. From
  here to the stage's next ``RESHARD`` is an *unshard window*: every compute of
  a sharded stage runs inside one.
- ``RESHARD`` (``RE0:dp``): ``stage``, ``group``. Free the gathered parameters;
  the stage is back to its shards (no communication).
- ``REDUCE_SCATTER`` (``RS0:dp``): ``stage``, ``group``. Reduce the stage's
  param grads over its shard group, each member keeping its shard; after the
  stage's last backward (its last ``BWD_W`` under zero-bubble schedules), in
  place of ``AR<s>:dp``. With HSDP (``shard_size`` < dp) the group is
  ``dp.shard`` and ``AR<s>:dp.replicate`` then reduces the shards across the
  shard groups.
- ``OPTIM_STEP`` (``OPT``): no fields. Grad clipping if set (a collective over
  the pp group, and over the shard group when sharded), optimizer step
  (``shard optimizer``: on this rank's optimizer-state shard, then the updated
  parameters gathered over the shard group), zero grads.

Groups (``group``): ``dp`` (all dp replicas of the pp rank), ``dp.shard``
(HSDP: the consecutive dp ranks that shard a stage among themselves),
``dp.replicate`` (HSDP: one rank of each shard group, holding the same shard),
``tie.<name>`` (a tied weight's copies, one per pp rank holding it).

Communication posts are asynchronous; the instruction that uses a received
buffer waits for it. Posts that go out together (one ``batch_isend_irecv``)
share a ``batch`` id, unique within a rank, and are written ``[SA0.3>1@1
RG0.2<1@1]`` in text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from itertools import groupby
from typing import Iterable, Iterator, NamedTuple
from pipec.errors import PipecError

__all__ = [
    "Op",
    "Instruction",
    "Program",
    "IRError",
    "COMPUTE_OPS",
    "SEND_OPS",
    "RECV_OPS",
    "COMM_OPS",
    "SHARD_OPS",
    "GROUP_OPS",
    "DP_GROUPS",
    "message_edge",
    "parse_instruction",
    "parse_program",
    "format_program",
]


class IRError(PipecError):
    """Malformed instruction text, program or plan; the message says where."""


class Op(str, Enum):
    """Opcodes. The value is the opcode's name in plan.json."""

    FWD = "FWD"
    BWD = "BWD"
    BWD_I = "BWD_I"
    BWD_W = "BWD_W"
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"
    ALLREDUCE = "ALLREDUCE"
    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"
    REDUCE_SCATTER = "REDUCE_SCATTER"
    OPTIM_STEP = "OPTIM_STEP"


COMPUTE_OPS = frozenset({Op.FWD, Op.BWD, Op.BWD_I, Op.BWD_W})
SEND_OPS = frozenset({Op.SEND_ACT, Op.SEND_GRAD})
RECV_OPS = frozenset({Op.RECV_ACT, Op.RECV_GRAD})
COMM_OPS = SEND_OPS | RECV_OPS
"""Point-to-point posts."""
SHARD_OPS = frozenset({Op.UNSHARD, Op.RESHARD, Op.REDUCE_SCATTER})
"""Sharded data parallelism's instructions (``stage`` and ``group``)."""
GROUP_OPS = SHARD_OPS | {Op.ALLREDUCE}
"""Instructions over a group (``stage`` and ``group``)."""
DP_GROUPS = ("dp", "dp.shard", "dp.replicate")
"""The groups over dp replicas of one pp rank (the rest are ``tie.<name>``)."""

# The fields each opcode carries (besides the optional ``batch`` of comm posts).
FIELDS: dict[Op, tuple[str, ...]] = {
    Op.FWD: ("stage", "microbatch"),
    Op.BWD: ("stage", "microbatch"),
    Op.BWD_I: ("stage", "microbatch"),
    Op.BWD_W: ("stage", "microbatch"),
    Op.SEND_ACT: ("stage", "microbatch", "to_stage", "peer"),
    Op.RECV_ACT: ("stage", "microbatch", "from_stage", "peer"),
    Op.SEND_GRAD: ("stage", "microbatch", "to_stage", "peer"),
    Op.RECV_GRAD: ("stage", "microbatch", "from_stage", "peer"),
    Op.ALLREDUCE: ("stage", "group"),
    Op.UNSHARD: ("stage", "group"),
    Op.RESHARD: ("stage", "group"),
    Op.REDUCE_SCATTER: ("stage", "group"),
    Op.OPTIM_STEP: (),
}

_COMPUTE_LETTER = {Op.FWD: "F", Op.BWD: "B", Op.BWD_I: "I", Op.BWD_W: "W"}
_COMM_LETTERS = {Op.SEND_ACT: "SA", Op.RECV_ACT: "RA", Op.SEND_GRAD: "SG", Op.RECV_GRAD: "RG"}
_GROUP_LETTERS = {Op.ALLREDUCE: "AR", Op.UNSHARD: "UN", Op.RESHARD: "RE", Op.REDUCE_SCATTER: "RS"}
_LETTER_OP = {v: k for k, v in {**_COMPUTE_LETTER, **_COMM_LETTERS, **_GROUP_LETTERS}.items()}


class Instruction(NamedTuple):
    """One instruction of a rank's program. Fields an opcode does not carry are None.

    A typed, immutable record like the frozen dataclasses elsewhere, but a
    ``NamedTuple``: building one costs a quarter of a frozen dataclass, and the
    large plans of the compile benchmark hold 780K of them.
    """

    op: Op
    stage: int | None = None
    microbatch: int | None = None
    to_stage: int | None = None
    """Sends: the stage at the other end of the edge."""
    from_stage: int | None = None
    """Receives: the stage at the other end of the edge."""
    peer: int | None = None
    """Sends and receives: the pp rank that owns the other end."""
    group: str | None = None
    """``ALLREDUCE``, ``UNSHARD``, ``RESHARD``, ``REDUCE_SCATTER``: one of :data:`DP_GROUPS` or ``"tie.<name>"``."""
    batch: int | None = None
    """Comm posts issued together share a batch id (unique within the rank)."""

    def text(self) -> str:
        """The instruction's text form, without its batch brackets."""
        op = self.op
        if op in _COMPUTE_LETTER:
            return f"{_COMPUTE_LETTER[op]}{self.stage}.{self.microbatch}"
        if op is Op.SEND_ACT or op is Op.SEND_GRAD:
            return f"{_COMM_LETTERS[op]}{self.stage}.{self.microbatch}>{self.to_stage}@{self.peer}"
        if op is Op.RECV_ACT or op is Op.RECV_GRAD:
            return f"{_COMM_LETTERS[op]}{self.stage}.{self.microbatch}<{self.from_stage}@{self.peer}"
        if op in _GROUP_LETTERS:
            return f"{_GROUP_LETTERS[op]}{self.stage}:{self.group}"
        return "OPT"

    __str__ = text


def message_edge(ins: Instruction) -> tuple[bool, int, int]:
    """The message a send or receive carries: (is_activation, src, dst) of its stage-graph edge.

    Edges point in model direction: an activation travels src -> dst, its
    grad dst -> src. ``SA0.3>1`` and ``RA1.3<0`` are both (True, 0, 1);
    ``SG1.3>0`` and ``RG0.3<1`` are both (False, 0, 1).
    """
    op = ins.op
    if op is Op.SEND_ACT:
        return True, ins.stage, ins.to_stage
    if op is Op.RECV_ACT:
        return True, ins.from_stage, ins.stage
    if op is Op.SEND_GRAD:
        return False, ins.to_stage, ins.stage
    return False, ins.stage, ins.from_stage


_INSTR_RE = re.compile(
    r"(?P<cl>[FBIW])(?P<cs>\d+)\.(?P<cm>\d+)$"
    r"|(?P<ml>SA|SG|RA|RG)(?P<ms>\d+)\.(?P<mm>\d+)(?P<dir>[<>])(?P<mo>\d+)@(?P<mp>\d+)$"
    r"|(?P<gl>AR|UN|RE|RS)(?P<as>\d+):(?P<ag>dp\.shard|dp\.replicate|dp|tie\.[A-Za-z0-9_.]+)$"
    r"|(?P<opt>OPT)$"
)


def parse_instruction(token: str, batch: int | None = None) -> Instruction:
    """Parse one text token such as ``F0.3``, ``SA0.3>1@1``, ``AR0:dp``, ``UN0:dp.shard`` or ``OPT``."""
    m = _INSTR_RE.match(token)
    if m is None:
        raise IRError(
            f"not an instruction: {token!r} (expected F0.3, B0.3, I0.3, W0.3, SA0.3>1@1, "
            "RA1.3<0@0, SG1.3>0@0, RG0.3<1@1, AR0:dp, AR0:tie.NAME, UN0:dp, RE0:dp, RS0:dp, "
            "RS0:dp.shard or OPT)"
        )
    if m["cl"]:
        return Instruction(_LETTER_OP[m["cl"]], int(m["cs"]), int(m["cm"]))
    if m["ml"]:
        op = _LETTER_OP[m["ml"]]
        want = ">" if op in SEND_OPS else "<"
        if m["dir"] != want:
            raise IRError(f"{token!r}: {m['ml']} takes '{want}' before the other stage")
        other = int(m["mo"])
        return Instruction(
            op,
            int(m["ms"]),
            int(m["mm"]),
            to_stage=other if want == ">" else None,
            from_stage=other if want == "<" else None,
            peer=int(m["mp"]),
            batch=batch,
        )
    if m["gl"]:
        return Instruction(_LETTER_OP[m["gl"]], int(m["as"]), group=m["ag"])
    return Instruction(Op.OPTIM_STEP)


@dataclass(frozen=True, slots=True)
class Program:
    """Per pp rank, the ordered instructions it runs in one step."""

    ranks: tuple[tuple[Instruction, ...], ...]

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def num_instructions(self) -> int:
        return sum(len(r) for r in self.ranks)

    def __iter__(self) -> Iterator[tuple[Instruction, ...]]:
        return iter(self.ranks)

    def text(self) -> str:
        return format_program(self)


def _rank_tokens(instructions: Iterable[Instruction]) -> Iterator[str]:
    for batch, group in groupby(instructions, key=lambda ins: ins.batch):
        if batch is None:
            yield from (ins.text() for ins in group)
        else:
            yield "[" + " ".join(ins.text() for ins in group) + "]"


def format_program(program: Program) -> str:
    """The text form: one line per pp rank, ``<rank>: <tokens>``, batches bracketed."""
    return "\n".join(
        f"{r}: " + " ".join(_rank_tokens(instrs)) for r, instrs in enumerate(program.ranks)
    )


_LINE_RE = re.compile(r"\s*(\d+)\s*:(.*)$")
_TOKEN_RE = re.compile(r"\[|\]|[^\s\[\]]+")


def parse_program(text: str) -> Program:
    """Parse the text form written by :func:`format_program`.

    Lines are ``<rank>: tokens``; ranks must appear once each, in order from 0.
    Blank lines and ``#`` comments are ignored. Batch ids are numbered from 0
    on each rank in order of appearance, as the lowering numbers them.
    """
    ranks: list[tuple[Instruction, ...]] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0]
        if not line.strip():
            continue
        m = _LINE_RE.match(line)
        if m is None:
            raise IRError(f"line {lineno}: expected '<rank>: instructions', got {raw.strip()!r}")
        rank = int(m[1])
        if rank != len(ranks):
            raise IRError(f"line {lineno}: expected rank {len(ranks)}, got rank {rank}")
        out: list[Instruction] = []
        batch: int | None = None
        next_batch = 0
        for tok in _TOKEN_RE.findall(m[2]):
            if tok == "[":
                if batch is not None:
                    raise IRError(f"line {lineno}: nested '[' in rank {rank}")
                batch, next_batch = next_batch, next_batch + 1
                continue
            if tok == "]":
                if batch is None:
                    raise IRError(f"line {lineno}: ']' without '[' in rank {rank}")
                batch = None
                continue
            try:
                ins = parse_instruction(tok, batch)
            except IRError as e:
                raise IRError(f"line {lineno}, rank {rank}: {e}") from None
            if batch is not None and ins.op not in COMM_OPS:
                raise IRError(f"line {lineno}, rank {rank}: only sends and receives can be batched, got {tok}")
            out.append(ins)
        if batch is not None:
            raise IRError(f"line {lineno}: '[' not closed in rank {rank}")
        ranks.append(tuple(out))
    if not ranks:
        raise IRError("empty program: expected one '<rank>: instructions' line per pp rank")
    return Program(tuple(ranks))
