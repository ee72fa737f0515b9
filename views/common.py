"""What every view of a Timeline shares: the kinds and their colours, the lanes it draws, times and axes.

Every view draws a predicted Timeline, a measured one, or both: with
``measured``, each pp rank's predicted lane is followed by the measured lanes
of its dp replicas (a measured Timeline lists global ranks, placed by the run's
:class:`~pipec.compiler.ir.plan.Mesh`: the plan's, or the report's, which every
view takes as ``mesh``; :func:`run_mesh`). Two timelines in the same unit share one time axis,
so a measured step that runs long shows as long; a unit-cost prediction
(units) beside a measurement (seconds) has each scaled to its own step time
so that the two line up.

An event's kind comes from its fields (:func:`kind_of`): its op, or comm wait
for a wait. Compute blocks (F/B/I/W) and collectives (all-reduce, optimizer)
are drawn in one colour per kind, shared by every view; comm posts are
zero-length in predictions and are drawn only when they last (a measured
wait).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from pipec.compiler.ir.plan import Mesh, world_text
from pipec.compiler.ir.program import COMM_OPS, DP_GROUPS, Op
from pipec.compiler.ir.timeline import Event, Timeline
from pipec.compiler.sim.engine import OPTIM_GROUP
from pipec.errors import PipecError

__all__ = [
    "RenderError", "KindStyle", "KINDS", "COMPUTE_KINDS", "kind_of", "Lane", "lanes", "split_waits", "run_mesh",
    "span_of", "format_time", "axis_unit", "ticks", "darken", "tint", "headline",
]


class RenderError(PipecError):
    """A view cannot be drawn as asked (mismatched timelines, unknown picture format)."""


@dataclass(frozen=True, slots=True)
class KindStyle:
    letter: str
    name: str
    colour: str
    """Hex colour, shared by the terminal, the picture and the legend."""


KINDS: dict[str, KindStyle] = {
    "F": KindStyle("F", "forward", "#60a5fa"),
    "B": KindStyle("B", "backward", "#4ade80"),
    "I": KindStyle("I", "input grad", "#fbbf24"),
    "W": KindStyle("W", "weight grad", "#c084fc"),
    "AR": KindStyle("AR", "all-reduce", "#f87171"),
    "OPT": KindStyle("OPT", "optimizer", "#2dd4bf"),
    "UN": KindStyle("UN", "unshard (all-gather)", "#fb923c"),
    "RS": KindStyle("RS", "reduce-scatter", "#e879f9"),
    "RE": KindStyle("RE", "reshard", "#b45309"),  # not the comm wait's grey
    "comm": KindStyle("~", "comm wait", "#94a3b8"),
}
"""Per event kind: its letter, legend name and colour."""

COMPUTE_KINDS = ("F", "B", "I", "W")

_KIND_OF_OP = {Op.FWD: "F", Op.BWD: "B", Op.BWD_I: "I", Op.BWD_W: "W", Op.ALLREDUCE: "AR", Op.OPTIM_STEP: "OPT",
               Op.UNSHARD: "UN", Op.REDUCE_SCATTER: "RS", Op.RESHARD: "RE", **{op: "comm" for op in COMM_OPS}}
assert set(_KIND_OF_OP) == set(Op), "every op is drawn as some kind"


def kind_of(ev: Event) -> str:
    """The event's key of :data:`KINDS`: a wait (for its posts, the reductions it needs, or a peer of its
    collective) and a comm post are comm; the rest are their op's."""
    return "comm" if ev.wait else _KIND_OF_OP[ev.op]


# ----------------------------------------------------------------------------- lanes


@dataclass(frozen=True, slots=True)
class Lane:
    """One drawn row: one rank of one timeline, its events and its time scale."""

    label: str
    source: str
    """``"predicted"`` or ``"measured"``."""
    rank: int
    """The rank as that timeline lists it (pp rank, or global rank when measured)."""
    events: tuple[Event, ...]
    scale: float
    """Multiplies the timeline's times into the shared axis."""
    chunks: dict[int, int]
    """Stage -> chunk index on this rank (0 for its first stage in model order)."""
    title: str = ""
    """The row's name said in full, for a picture's axis: ``pp 1 predicted``, ``pp 1 dp 0 measured (global
    rank 2)``; ``label`` is the terminal's short form (``1 pred``, ``1 meas g2``)."""


def run_mesh(timeline: Timeline, measured: Timeline, mesh: Mesh | None = None) -> Mesh:
    """The mesh the measured run ran on: ``mesh`` (the plan's, or the run's report's) checked against the
    timelines (the predicted one lists its pp ranks, the measured one every global rank); None: pp x dp at tp 1,
    dp the measured ranks over the predicted ones (timelines drawn without their plan)."""
    num_pp, num_meas = timeline.num_ranks, measured.num_ranks
    if mesh is None:
        if num_pp == 0 or num_meas % num_pp:
            raise RenderError(
                f"the measured timeline lists {num_meas} global ranks and the predicted one "
                f"{num_pp} pp ranks: the measured count must be pp x dp; pass the run's mesh (report.json's mesh)"
            )
        return Mesh(pp=num_pp, dp=num_meas // num_pp)
    if mesh.pp != num_pp or mesh.world_size != num_meas:
        raise RenderError(
            f"the measured timeline lists {num_meas} global ranks and the predicted one {num_pp} pp ranks, "
            f"expected {world_text(mesh)}; pass the run's mesh (report.json's mesh)"
        )
    return mesh


def _by_rank(timeline: Timeline) -> dict[int, list[Event]]:
    out: dict[int, list[Event]] = {r.rank: [] for r in timeline.per_rank}
    for ev in timeline.events:
        out.setdefault(ev.rank, []).append(ev)
    for evs in out.values():
        evs.sort(key=lambda e: (e.start, e.end))
    return out


def _chunks(events: Sequence[Event]) -> dict[int, int]:
    stages = {ev.stage for ev in events if kind_of(ev) in COMPUTE_KINDS}
    return {s: i for i, s in enumerate(sorted(s for s in stages if s is not None))}


def span_of(timeline: Timeline) -> float:
    """The step, or the last event's end if one ends later (nothing is cut off at the right edge)."""
    return max(timeline.step_time, max((e.end for e in timeline.events), default=0.0)) or 1.0


def _collective_waits(by_rank: dict[int, list[Event]]) -> dict[int, list[Event]]:
    """A prediction's collectives split into the wait and the work: a collective's event runs from the rank's
    arrival, and until the last member of its group arrives the rank only waits (a wait event of its own).

    Members are matched by group and call count, as the simulator matches them: ``OPT`` (the grad-norm
    collective) over every pp rank, a tie all-reduce over the ranks holding the tie; a dp all-reduce has no
    peer in a prediction (its lanes are one replica), so it stays whole. A timeline that carries waits already
    (a run's: the executor records them; the simulator's) is left as it is.
    """
    if any(ev.wait for evs in by_rank.values() for ev in evs):
        return by_rank  # the waits are recorded already
    calls: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for rank, evs in by_rank.items():
        seen: dict[str, int] = {}
        for i, ev in enumerate(evs):
            if ev.op is Op.OPTIM_STEP:
                group = OPTIM_GROUP
            elif ev.op is Op.ALLREDUCE and ev.group not in DP_GROUPS:
                group = ev.group
            else:
                continue
            k = seen.get(group, 0)
            seen[group] = k + 1
            calls.setdefault((group, k), []).append((rank, i))
    cuts: dict[tuple[int, int], float] = {}
    for members in calls.values():
        last = max(by_rank[r][i].start for r, i in members)
        for r, i in members:
            if by_rank[r][i].start < last:
                cuts[(r, i)] = min(last, by_rank[r][i].end)
    if not cuts:
        return by_rank
    out: dict[int, list[Event]] = {}
    for rank, evs in by_rank.items():
        row = out[rank] = []
        for i, ev in enumerate(evs):
            cut = cuts.get((rank, i))
            if cut is None:
                row.append(ev)
            else:
                row += [ev._replace(end=cut, wait=True), ev._replace(start=cut)]
    return out


def split_waits(timeline: Timeline) -> list[Event]:
    """The timeline's events with each collective's wait its own event (:func:`_collective_waits`): what every
    view draws. Nothing to split: the events as they are, in their order; else by rank and time."""
    by_rank = _by_rank(timeline)
    split = _collective_waits(by_rank)
    if split is by_rank:
        return list(timeline.events)
    return [ev for evs in split.values() for ev in evs]


def lanes(timeline: Timeline, *, measured: Timeline | None = None,
          mesh: Mesh | None = None) -> tuple[list[Lane], float]:
    """The rows every view draws, in order, and the length of the shared time axis.

    Without ``measured``: one lane per rank. With it: per pp rank, its
    predicted lane, then one lane per dp replica (global rank ``p x dp + d``),
    placed by the run's ``mesh`` (:func:`run_mesh`). With ``mesh.tp`` > 1 a row
    stands for the replica's tp ranks (they run one program in step): its
    measured lane is tp rank 0's (global rank ``(p x dp + d) x tp``), and the
    predicted lane's title says so.
    """
    pred = _collective_waits(_by_rank(timeline))
    span = span_of(timeline)
    tp = 1 if mesh is None else mesh.tp
    per_row = "" if tp == 1 else f" (tp {tp} ranks per row)"
    if measured is None:
        return [Lane(f"rank {r}", "predicted", r, tuple(evs), 1.0, _chunks(evs), f"pp rank {r}{per_row}")
                for r, evs in pred.items()], span
    mesh = run_mesh(timeline, measured, mesh)
    dp = mesh.dp
    meas = _by_rank(measured)
    if measured.time_unit == timeline.time_unit:
        span = max(span, span_of(measured))
        meas_scale = 1.0
    else:
        meas_scale = span / span_of(measured)
    out = []
    for i, (p, evs) in enumerate(pred.items()):
        out.append(Lane(f"{p} pred", "predicted", p, tuple(evs), 1.0, _chunks(evs), f"pp {p} predicted{per_row}"))
        for d, g in enumerate(mesh.replicas(i)):
            mevs = meas.get(g, [])
            label = f"{p} meas" if dp == 1 and tp == 1 else f"{p} meas g{g}"
            title = (f"pp {p} measured" if dp == 1 and tp == 1 else
                     f"pp {p} dp {d} measured (global rank {g}{'' if tp == 1 else f', tp rank 0 of {tp}'})")
            out.append(Lane(label, "measured", g, tuple(mevs), meas_scale, _chunks(mevs), title))
    return out, span


# ----------------------------------------------------------------------------- times, axes, colours


def format_time(t: float, unit: str) -> str:
    """``12.5 units``, ``712 ms``, ``1.23 s``, ``45 µs``."""
    if unit == "unit":
        return f"{t:.4g} units"
    a = abs(t)
    if a >= 1 or a == 0:
        return f"{t:.3g} s"
    if a >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} µs"


def headline(timeline: Timeline) -> str:
    """``step 33 units, bubble 27.3%``."""
    return f"step {format_time(timeline.step_time, timeline.time_unit)}, bubble {timeline.bubble_fraction:.1%}"


def axis_unit(span: float, unit: str) -> tuple[float, str]:
    """Factor and name to print axis ticks in (units, s, ms or µs)."""
    if unit == "unit":
        return 1.0, "units"
    if span >= 1:
        return 1.0, "s"
    if span >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def _nice_step(raw: float) -> float:
    if raw <= 0:
        return 1.0
    exp = math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if m * 10**exp >= raw:
            return m * 10**exp
    return 10 ** (exp + 1)


def ticks(span: float, num: int) -> list[float]:
    """About ``num`` round tick positions from 0 to ``span``."""
    step = _nice_step(span / max(1, num))
    return [i * step for i in range(int(span / step + 1e-9) + 1)]


def darken(colour: str, factor: float) -> str:
    r, g, b = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
    return "#{:02x}{:02x}{:02x}".format(*(max(0, min(255, round(c * factor))) for c in (r, g, b)))


def tint(colour: str, amount: float) -> str:
    """Mix ``colour`` with white (``amount`` 0..1)."""
    r, g, b = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
    return "#{:02x}{:02x}{:02x}".format(*(round(c + (255 - c) * amount) for c in (r, g, b)))
