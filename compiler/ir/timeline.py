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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, NamedTuple

__all__ = ["Event", "RankTime", "Timeline"]


class Event(NamedTuple):
    """One instruction on one rank: ``op`` is its text form (``F0.3``, ``AR0:dp``).

    A ``NamedTuple`` (immutable, typed, and cheap to build: timelines of large
    plans hold hundreds of thousands of events).
    """

    rank: int
    op: str
    start: float
    end: float


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
    """Predicted: params, grads, optimizer state, transiently unsharded parameters and activations;
    measured: the allocator's peak."""
    state_bytes: int | None = None
    """Predicted: params, grads and optimizer state at rest as this rank holds them (sharded as the
    mesh's ``shard`` says; padding included)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeline:
    step_time: float
    bubble_fraction: float
    per_rank: tuple[RankTime, ...]
    events: tuple[Event, ...] = field(default=(), repr=False)
    time_unit: str = "s"
    """``"s"`` for seconds, ``"unit"`` for a unit-cost plan."""

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
            if r.peak_activations is not None:
                d["peak_activations"] = r.peak_activations
            if r.peak_memory_bytes is not None:
                d["peak_memory_bytes"] = r.peak_memory_bytes
            if r.state_bytes is not None:
                d["state_bytes"] = r.state_bytes
            per_rank.append(d)
        return {
            "step_time": self.step_time,
            "bubble_fraction": self.bubble_fraction,
            "time_unit": self.time_unit,
            "per_rank": per_rank,
            **({"events": [[e.rank, e.op, e.start, e.end] for e in self.events]} if events else {}),
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
            events.append(Event(ev[0], ev[1], float(ev[2]), float(ev[3])))
        unit = rd.str("time_unit", required=False) or "s"
        if unit not in ("s", "unit"):
            raise rd.error("time_unit", "expected 's' or 'unit'", unit)
        return Timeline(
            step_time=rd.num("step_time", lo=0),
            bubble_fraction=rd.num("bubble_fraction", lo=0, hi=1.000001),
            per_rank=per_rank,
            events=tuple(events),
            time_unit=unit,
        )
