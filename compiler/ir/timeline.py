"""The Timeline: where each rank's time went in one step, predicted or measured.

One type for both, so every view (terminal, picture, Perfetto trace) draws
either, or both overlaid. A predicted Timeline (the simulator's) lists pp
ranks; a measured one (the runtime's) lists global ranks. Times are seconds
from the step's start, or units for a unit-cost plan (``time_unit``).

Per rank, ``step_time = compute + comm_wait + idle``: ``compute`` is time in
compute instructions, ``comm_wait`` time blocked on communication (a receive
the next instruction needs, a collective), ``idle`` the rest (before the
first and after the last instruction, host overhead). The bubble of a rank is
``(comm_wait + idle) / step_time``; the Timeline's ``bubble_fraction`` is the
sum over listed ranks of their bubble time over ``num_ranks x step_time``.

An :class:`Event` is typed: the instruction it spans (its op, stage,
microbatch, peer, group) and whether the span is that instruction's wait.
Only the JSON form spells it as text (DESIGN: ``"events": [[rank, op_text,
start, end], ...]``, a wait ``~`` and the instruction's text): made from the
fields where it is written (:attr:`Event.text`), read back once where it is
read (:meth:`Event.parse`); nothing else reads text back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Iterable, Mapping, NamedTuple

from pipec.compiler.ir.program import Instruction, IRError, Op, parse_instruction

__all__ = ["Event", "RankTime", "Interval", "Timeline", "WAIT_PREFIX"]

WAIT_PREFIX = "~"
"""The text form of a wait (:attr:`Event.wait`): ``~`` and the instruction's text, ``~OPT``."""


class Event(NamedTuple):
    """One instruction's span on one rank, or (``wait``) the time it waited before its work.

    A wait is time an instruction spent blocked before its own work: for its
    rank's posts and reductions, or for a peer of its collective (the executor
    and the simulator record them; the views draw them as comm wait). A
    ``NamedTuple`` (immutable, typed, and cheap to build: timelines of large
    plans hold hundreds of thousands of events) that holds the instruction
    itself, so recording an event makes no text.
    """

    rank: int
    ins: Instruction
    """The instruction (typed: :attr:`op`, :attr:`stage`, :attr:`microbatch`, :attr:`peer`, :attr:`group`)."""
    start: float
    end: float
    wait: bool = False

    op = property(attrgetter("ins.op"), doc="The instruction's opcode (:class:`Op`).")
    stage = property(attrgetter("ins.stage"), doc="The stage (``None`` for ``OPT``).")
    microbatch = property(attrgetter("ins.microbatch"), doc="The microbatch (compute, sends and receives).")
    peer = property(attrgetter("ins.peer"), doc="Sends and receives: the pp rank at the other end.")
    group = property(attrgetter("ins.group"), doc="Collectives over a group: ``dp``, ``dp.shard``, ``dp.replicate``, "
                     "``tie.<name>``.")

    @property
    def text(self) -> str:
        """The JSON form's ``op_text``: the instruction's text (``F0.3``), a wait's with ``~`` before (``~OPT``)."""
        return WAIT_PREFIX + self.ins.text() if self.wait else self.ins.text()

    @classmethod
    def parse(cls, rank: int, text: str, start: float, end: float) -> "Event":
        """The event an ``op_text`` names; text that is no instruction (nor ``~`` and one) raises ``IRError``."""
        wait = text.startswith(WAIT_PREFIX)
        if wait:
            text = text[1:]
        op = _COMPUTE_OPS.get(text[:1])
        if op is not None:  # most events: F0.3 read without the regex (a large plan's prediction holds 100Ks)
            stage, dot, mb = text[1:].partition(".")
            if dot and stage.isdecimal() and mb.isdecimal():
                return cls(rank, Instruction(op, int(stage), int(mb)), start, end, wait)
        return cls(rank, parse_instruction(text), start, end, wait)


_COMPUTE_OPS = {"F": Op.FWD, "B": Op.BWD, "I": Op.BWD_I, "W": Op.BWD_W}
"""The compute ops by the letter of their text form (``F0.3``), as :func:`parse_instruction` reads them."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankTime:
    """One rank's share of the step."""

    rank: int
    compute: float
    comm_wait: float
    idle: float
    bubble_fraction: float
    peak_activations: int | None = None
    """Most microbatches whose activations this rank held at once (F done, backward not)."""
    peak_memory_bytes: int | None = None
    """Predicted: params, grads, optimizer state, transiently unsharded parameters and activations (an upper
    bound: each part at its own peak); measured: the allocator's peak (``torch.cuda.max_memory_allocated``; absent
    on CPU, where no allocator counts the tensors)."""
    state_bytes: int | None = None
    """Params, grads and optimizer state at rest as this rank holds them (sharded as the mesh's ``shard`` says;
    padding included): predicted from the counts; measured, the tensors' storages after the optimizer step."""
    peak_activation_bytes: int | None = None
    """Saved activations at the rank's peak: what autograd saves in each stage's forward, and the stage's outputs,
    per microbatch held from its ``FWD`` to its last backward, summed over what is held at once. Predicted from the
    trace's byte counts; measured from the storages the stages saved in the run's first step."""


_OPTIONAL = ("peak_activations", "peak_memory_bytes", "state_bytes", "peak_activation_bytes")
"""The fields of :class:`RankTime` that JSON holds only where they are known."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Interval:
    """How sure a prediction is: the share ``coverage`` of steps is expected to take ``step_time[0]`` to
    ``step_time[1]`` (and waste ``bubble_fraction[0]`` to ``[1]``), the range of ``draws`` simulations over the
    measured spread of the costs (JSON: the Timeline's ``step_time_interval``, ``bubble_fraction_interval``,
    ``coverage`` and ``interval_draws``). A prediction from costs without spread has none."""

    step_time: tuple[float, float]
    bubble_fraction: tuple[float, float]
    coverage: float
    draws: int
    runs: int = 0
    """Earlier runs on this host whose measured steps widened the step's range (:mod:`pipec.compiler.sim.history`;
    JSON ``interval_runs``); 0: the simulations' range alone."""

    def holds(self, step_time: float) -> bool:
        """Whether a measured step time falls inside."""
        return self.step_time[0] <= step_time <= self.step_time[1]


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeline:
    step_time: float
    bubble_fraction: float
    per_rank: tuple[RankTime, ...]
    events: tuple[Event, ...] = field(default=(), repr=False)
    time_unit: str = "s"
    """``"s"`` for seconds, ``"unit"`` for a unit-cost plan."""
    interval: Interval | None = None
    """A predicted Timeline whose costs carry a measured spread: the range its steps are expected in."""

    @property
    def num_ranks(self) -> int:
        return len(self.per_rank)

    @staticmethod
    def build(
        *,
        step_time: float,
        busy: Mapping[int, tuple[float, float]],
        events: Iterable[Event] = (),
        peak_activations: Mapping[int, int] | None = None,
        peak_memory_bytes: Mapping[int, int] | None = None,
        state_bytes: Mapping[int, int] | None = None,
        peak_activation_bytes: Mapping[int, int] | None = None,
        time_unit: str = "s",
    ) -> "Timeline":
        """Assemble a Timeline from per-rank ``(compute, comm_wait)`` totals.

        ``idle`` is what is left of ``step_time``; bubble fractions follow the
        definitions of the module docstring.
        """
        per_rank = []
        bubble_total = 0.0
        for rank in sorted(busy):
            compute, comm_wait = (max(0.0, x) for x in busy[rank])  # sums of differences: -1e-20 is a rounded 0
            idle = max(0.0, step_time - compute - comm_wait)
            bubble = comm_wait + idle
            bubble_total += bubble
            per_rank.append(
                RankTime(
                    rank=rank,
                    compute=compute,
                    comm_wait=comm_wait,
                    idle=idle,
                    bubble_fraction=bubble / step_time if step_time > 0 else 0.0,
                    peak_activations=None if peak_activations is None else peak_activations.get(rank),
                    peak_memory_bytes=None if peak_memory_bytes is None else peak_memory_bytes.get(rank),
                    state_bytes=None if state_bytes is None else state_bytes.get(rank),
                    peak_activation_bytes=None if peak_activation_bytes is None else peak_activation_bytes.get(rank),
                )
            )
        denom = len(per_rank) * step_time
        return Timeline(
            step_time=step_time,
            bubble_fraction=bubble_total / denom if denom > 0 else 0.0,
            per_rank=tuple(per_rank),
            events=tuple(events),
            time_unit=time_unit,
        )

    def to_json(self, *, events: bool = True) -> dict[str, Any]:
        """The JSON form; ``events=False`` leaves the (possibly long) event list out."""
        per_rank = []
        for r in self.per_rank:
            d: dict[str, Any] = {
                "rank": r.rank,
                "compute": r.compute,
                "comm_wait": r.comm_wait,
                "idle": r.idle,
                "bubble_fraction": r.bubble_fraction,
            }
            for name in _OPTIONAL:
                value = getattr(r, name)
                if value is not None:
                    d[name] = value
            per_rank.append(d)
        band = self.interval
        return {
            "step_time": self.step_time,
            "bubble_fraction": self.bubble_fraction,
            **({} if band is None else {"step_time_interval": list(band.step_time),
                                        "bubble_fraction_interval": list(band.bubble_fraction),
                                        "coverage": band.coverage, "interval_draws": band.draws,
                                        **({"interval_runs": band.runs} if band.runs else {})}),
            "time_unit": self.time_unit,
            "per_rank": per_rank,
            **({"events": [[e.rank, e.text, e.start, e.end] for e in self.events]} if events else {}),
        }

    @staticmethod
    def from_json(obj: Any, where: str = "timeline") -> "Timeline":
        """Read a Timeline; a malformed one raises ``ValueError`` naming the field."""
        from pipec.compiler.ir.schema import Reader

        rd = Reader(obj, where)
        per_rank = tuple(
            RankTime(
                rank=r.int("rank", lo=0),
                compute=r.num("compute", lo=0),
                comm_wait=r.num("comm_wait", lo=0),
                idle=r.num("idle", lo=0),
                bubble_fraction=r.num("bubble_fraction", lo=0, hi=1.000001),
                peak_activations=r.int("peak_activations", lo=0, required=False),
                peak_memory_bytes=r.int("peak_memory_bytes", lo=0, required=False),
                state_bytes=r.int("state_bytes", lo=0, required=False),
                peak_activation_bytes=r.int("peak_activation_bytes", lo=0, required=False),
            )
            for r in rd.items("per_rank")
        )
        events = []
        for i, ev in enumerate(rd.list("events", required=False) or ()):
            ok = (
                isinstance(ev, list)
                and len(ev) == 4
                and type(ev[0]) is int
                and isinstance(ev[1], str)
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in ev[2:])
            )
            if not ok:
                raise rd.error(f"events[{i}]", "expected [rank, op_text, start, end]", ev)
            try:
                events.append(Event.parse(ev[0], ev[1], float(ev[2]), float(ev[3])))
            except IRError:
                raise rd.error(f"events[{i}][1]", "expected an instruction's text (F0.3, AR0:dp, OPT), or ~ and one "
                               "(a wait: ~OPT)", ev[1]) from None
        unit = rd.str("time_unit", required=False) or "s"
        if unit not in ("s", "unit"):
            raise rd.error("time_unit", "expected 's' or 'unit'", unit)
        return Timeline(
            step_time=rd.num("step_time", lo=0),
            bubble_fraction=rd.num("bubble_fraction", lo=0, hi=1.000001),
            per_rank=per_rank,
            events=tuple(events),
            time_unit=unit,
            interval=_interval(rd),
        )


def _interval(rd) -> Interval | None:
    """A Timeline's interval: absent, or all four of its fields (a range that holds its prediction's order)."""
    names = ("step_time_interval", "bubble_fraction_interval", "coverage", "interval_draws")
    if not any(n in rd.obj for n in names):
        return None
    ranges = []
    for name, hi in zip(names[:2], (None, 1.000001)):
        raw = rd.list(name)
        if len(raw) != 2 or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in raw) \
                or not 0 <= raw[0] <= raw[1] or hi is not None and raw[1] > hi:
            raise rd.error(name, "expected [lo, hi] with 0 <= lo <= hi", raw)
        ranges.append((float(raw[0]), float(raw[1])))
    return Interval(step_time=ranges[0], bubble_fraction=ranges[1], coverage=rd.num("coverage", lo=0, hi=1),
                    draws=rd.int("interval_draws", lo=1), runs=rd.int("interval_runs", lo=0, required=False) or 0)
