"""Views of a Timeline: the terminal (rich), a summary table, and a picture (matplotlib).

Every view draws a predicted Timeline, a measured one, or both: with
``measured``, each pp rank's predicted lane is followed by the measured lanes
of its dp replicas (a measured Timeline lists global ranks; global rank ``g``
is pp rank ``g // dp``). Two timelines in the same unit share one time axis,
so a measured step that runs long shows as long; a unit-cost prediction
(units) beside a measurement (seconds) has each scaled to its own step time
so that the two line up, and the picture adds the measured axis on top.

Events carry their instruction's text form (``F0.3``, ``SA0.3>1@1``,
``AR0:dp``, ``OPT``); :func:`classify` derives the kind, stage and microbatch
from it. Compute blocks (F/B/I/W) and collectives (all-reduce, optimizer)
are drawn in one colour per kind, shared by every view; comm posts are
zero-length in predictions and are drawn only when they last (a measured
wait). matplotlib is imported only when a picture is drawn.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from itertools import groupby
from typing import Sequence

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from pipec.compiler.sim.engine import WAIT_PREFIX
from pipec.compiler.ir.program import COMM_OPS, DP_GROUPS, IRError, Op, parse_instruction
from pipec.compiler.ir.plan import Mesh
from pipec.compiler.ir.timeline import Event, Timeline
from pipec.errors import PipecError

__all__ = [
    "RenderError",
    "KINDS",
    "OpInfo",
    "classify",
    "Lane",
    "lanes",
    "split_waits",
    "infer_dp",
    "TimelineView",
    "render_terminal",
    "render_summary",
    "show",
    "render_image",
    "format_time",
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
    "RE": KindStyle("RE", "reshard", "#a3a3a3"),
    "comm": KindStyle("~", "comm wait", "#94a3b8"),
    "other": KindStyle("?", "other", "#d4d4d8"),
}
"""Per event kind: its letter, legend name and colour."""

COMPUTE_KINDS = ("F", "B", "I", "W")


@dataclass(frozen=True, slots=True)
class OpInfo:
    """What an event's op text says: ``kind`` is a key of :data:`KINDS`."""

    kind: str
    stage: int | None = None
    microbatch: int | None = None


_KIND_OF_OP = {Op.FWD: "F", Op.BWD: "B", Op.BWD_I: "I", Op.BWD_W: "W", Op.ALLREDUCE: "AR", Op.OPTIM_STEP: "OPT",
               Op.UNSHARD: "UN", Op.REDUCE_SCATTER: "RS", Op.RESHARD: "RE", **{op: "comm" for op in COMM_OPS}}
assert set(_KIND_OF_OP) == set(Op), "every op is drawn as some kind"


# An event whose op is ``~`` + an instruction's text (WAIT_PREFIX) is that instruction's wait (for its posts, the
# reductions it needs, or a peer of its collective), drawn as comm wait: the executor and the simulator record
# these, and :func:`lanes` splits them out of an older prediction's collectives.


def classify(op: str) -> OpInfo:
    """Kind, stage and microbatch of an op text (``F0.3``, ``RG0.3<1@1``, ``AR1:dp``, ``OPT``, a wait ``~OPT``),
    read by the IR's own parser; text that is no instruction is ``other``."""
    wait = op.startswith(WAIT_PREFIX)
    try:
        ins = parse_instruction(op[1:] if wait else op)
    except IRError:
        return OpInfo("other")
    return OpInfo("comm" if wait else _KIND_OF_OP[ins.op], ins.stage, ins.microbatch)


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


def infer_dp(timeline: Timeline, measured: Timeline, dp: int | None = None) -> int:
    """The measured run's dp size: ``dp`` checked, or measured ranks / predicted ranks."""
    num_pp, num_meas = timeline.num_ranks, measured.num_ranks
    if dp is None:
        if num_pp == 0 or num_meas % num_pp:
            raise RenderError(
                f"the measured timeline lists {num_meas} global ranks and the predicted one "
                f"{num_pp} pp ranks: the measured count must be pp x dp; pass dp= explicitly"
            )
        dp = num_meas // num_pp
    if dp < 1 or num_meas != num_pp * dp:
        raise RenderError(
            f"the measured timeline lists {num_meas} global ranks, expected pp x dp = "
            f"{num_pp} x {dp} = {num_pp * dp}; pass the run's dp (report.json's mesh.dp)"
        )
    return dp


def _by_rank(timeline: Timeline) -> dict[int, list[Event]]:
    out: dict[int, list[Event]] = {r.rank: [] for r in timeline.per_rank}
    for ev in timeline.events:
        out.setdefault(ev.rank, []).append(ev)
    for evs in out.values():
        evs.sort(key=lambda e: (e.start, e.end))
    return out


def _chunks(events: Sequence[Event]) -> dict[int, int]:
    stages = {info.stage for info in map(classify, (e.op for e in events)) if info.kind in COMPUTE_KINDS}
    return {s: i for i, s in enumerate(sorted(s for s in stages if s is not None))}


def _span(timeline: Timeline) -> float:
    """The step, or the last event's end if one ends later (nothing is cut off at the right edge)."""
    return max(timeline.step_time, max((e.end for e in timeline.events), default=0.0)) or 1.0


_COLLECTIVE_KINDS = ("AR", "OPT")


def _collective_waits(by_rank: dict[int, list[Event]]) -> dict[int, list[Event]]:
    """A prediction's collectives split into the wait and the work: a collective's event runs from the rank's
    arrival, and until the last member of its group arrives the rank only waits (``~`` + its text).

    Members are matched by group and call count, as the simulator matches them: ``OPT`` (the grad-norm
    collective) over every pp rank, a tie all-reduce over the ranks holding the tie; a dp all-reduce has no
    peer in a prediction (its lanes are one replica), so it stays whole. A timeline that carries waits already
    (a run's: the executor records them) is left as it is.
    """
    if any(ev.op.startswith(WAIT_PREFIX) for evs in by_rank.values() for ev in evs):
        return by_rank  # a run's trace: the executor recorded its waits itself
    calls: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for rank, evs in by_rank.items():
        seen: dict[str, int] = {}
        for i, ev in enumerate(evs):
            if ev.op.startswith(WAIT_PREFIX) or classify(ev.op).kind not in _COLLECTIVE_KINDS:
                continue
            group = "pp" if ev.op == "OPT" else ev.op.partition(":")[2]
            if group in DP_GROUPS:
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
                row += [Event(rank, WAIT_PREFIX + ev.op, ev.start, cut), Event(rank, ev.op, cut, ev.end)]
    return out


def split_waits(timeline: Timeline) -> list[Event]:
    """The timeline's events with each collective's wait its own ``~`` event (:func:`_collective_waits`): what
    every view draws. Nothing to split: the events as they are, in their order; else by rank and time."""
    by_rank = _by_rank(timeline)
    split = _collective_waits(by_rank)
    if split is by_rank:
        return list(timeline.events)
    return [ev for evs in split.values() for ev in evs]


def lanes(timeline: Timeline, *, measured: Timeline | None = None, dp: int | None = None) -> tuple[list[Lane], float]:
    """The rows every view draws, in order, and the length of the shared time axis.

    Without ``measured``: one lane per rank. With it: per pp rank, its
    predicted lane, then one lane per dp replica (global rank ``p x dp + d``).
    """
    pred = _collective_waits(_by_rank(timeline))
    span = _span(timeline)
    if measured is None:
        return [Lane(f"rank {r}", "predicted", r, tuple(evs), 1.0, _chunks(evs)) for r, evs in pred.items()], span
    dp = infer_dp(timeline, measured, dp)
    meas = _by_rank(measured)
    if measured.time_unit == timeline.time_unit:
        span = max(span, _span(measured))
        meas_scale = 1.0
    else:
        meas_scale = span / _span(measured)
    out = []
    mesh = Mesh(pp=len(pred), dp=dp)
    for i, (p, evs) in enumerate(pred.items()):
        out.append(Lane(f"{p} pred", "predicted", p, tuple(evs), 1.0, _chunks(evs)))
        for g in mesh.replicas(i):
            mevs = meas.get(g, [])
            label = f"{p} meas" if dp == 1 else f"{p} meas g{g}"
            out.append(Lane(label, "measured", g, tuple(mevs), meas_scale, _chunks(mevs)))
    return out, span


# ----------------------------------------------------------------------------- formatting


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


def _axis_unit(span: float, unit: str) -> tuple[float, str]:
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


def _ticks(span: float, num: int) -> list[float]:
    step = _nice_step(span / max(1, num))
    return [i * step for i in range(int(span / step + 1e-9) + 1)]


def _darken(colour: str, factor: float) -> str:
    r, g, b = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
    return "#{:02x}{:02x}{:02x}".format(*(max(0, min(255, round(c * factor))) for c in (r, g, b)))


def _tint(colour: str, amount: float) -> str:
    """Mix ``colour`` with white (``amount`` 0..1)."""
    r, g, b = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
    return "#{:02x}{:02x}{:02x}".format(*(round(c + (255 - c) * amount) for c in (r, g, b)))


# ----------------------------------------------------------------------------- terminal

IDLE = "·"


def _block(info: OpInfo, width: int) -> str:
    """A block's text, its kind always first: ``B3 `` (kind, microbatch and a gap) when wide enough, ``B3``
    when it just fits, else the kind's letter (``B``; ``OPT`` shortens to ``O``) alone; a wait is ``~~~``."""
    style = KINDS[info.kind]
    if info.kind == "comm":
        return style.letter * width
    text = style.letter if info.microbatch is None else f"{style.letter}{info.microbatch}"
    if len(text) > width:
        text = style.letter if len(style.letter) <= width else style.letter[0]
    return text.ljust(width)[:width]


def _block_style(info: OpInfo, chunk: int) -> str:
    colour = KINDS[info.kind].colour
    if info.microbatch is not None and info.microbatch % 2:
        colour = _darken(colour, 0.78)  # neighbours of one kind stay apart
    return f"black on {colour}" + (" underline" if chunk > 0 else "")


def _lane_text(lane: Lane, span: float, bar: int) -> Text:
    cells = [-1] * bar
    k = bar / span if span > 0 else 0.0
    events = lane.events
    for index, ev in enumerate(events):
        a = max(0, round(ev.start * lane.scale * k))
        b = min(bar, round(ev.end * lane.scale * k))
        if b > a:
            cells[a:b] = [index] * (b - a)
    text = Text(no_wrap=True, overflow="crop")
    for index, run in groupby(cells):
        n = sum(1 for _ in run)
        if index < 0:
            text.append(IDLE * n, style="dim")
            continue
        info = classify(events[index].op)
        chunk = lane.chunks.get(info.stage, 0) if info.stage is not None else 0
        text.append(_block(info, n), style=_block_style(info, chunk))
    return text


def _axis_lines(span: float, unit: str, bar: int, pad: int) -> list[Text]:
    factor, name = _axis_unit(span, unit)
    ruler = ["─"] * bar
    labels = [" "] * bar
    last_end = -1
    for t in _ticks(span, max(1, bar // 12)):
        pos = min(bar - 1, round(t / span * bar)) if span > 0 else 0
        ruler[pos] = "┴"
        label = f"{t * factor:g}"
        start = min(max(0, pos - len(label) // 2), bar - len(label))
        if start > last_end and start >= 0:
            labels[start : start + len(label)] = label
            last_end = start + len(label)
    # the unit sits under the rank labels, where there is always room
    unit_label = name.rjust(pad - 1) + " " if len(name) < pad else " " * pad
    return [
        Text(" " * pad + "".join(ruler), style="dim", no_wrap=True, overflow="crop"),
        Text(unit_label + "".join(labels), style="dim", no_wrap=True, overflow="crop"),
    ]


def _legend_lines(kinds: set[str], chunked: bool, width: int) -> list[Text]:
    entries = []
    for key, style in KINDS.items():
        if key in kinds:
            entries.append(Text.assemble((f" {style.letter} ", f"black on {style.colour}"), f" {style.name}"))
    entries.append(Text.assemble((IDLE * 3, "dim"), " idle"))
    if chunked:
        entries.append(Text.assemble(("F3", "black on #60a5fa underline"), " later chunk"))
    lines, line = [], Text(no_wrap=True, overflow="crop")
    for entry in entries:
        if len(line) and len(line) + 2 + len(entry) > width:
            lines.append(line)
            line = Text(no_wrap=True, overflow="crop")
        if len(line):
            line.append("  ")
        line.append_text(entry)
    lines.append(line)
    return lines


@dataclass(frozen=True, slots=True, kw_only=True)
class TimelineView:
    """A rich renderable: one row per lane, time scaled to the width it is given.

    Blocks are coloured by kind (:data:`KINDS`), odd microbatches a shade
    darker so neighbours stay apart, labelled ``F3`` or ``3`` when wide
    enough; a rank's later chunks are underlined; idle time is dim dots.
    """

    timeline: Timeline
    measured: Timeline | None = None
    dp: int | None = None
    width: int | None = None
    title: str = ""

    def lines(self, width: int) -> list[Text]:
        """The view as lines of at most ``width`` cells."""
        all_lanes, span = lanes(self.timeline, measured=self.measured, dp=self.dp)
        pad = max((len(lane.label) for lane in all_lanes), default=0) + 1
        bar = max(8, width - pad)
        out: list[Text] = []
        if self.title:
            out.append(Text(self.title, style="bold"))
        tl, ms = self.timeline, self.measured
        head = f"step {format_time(tl.step_time, tl.time_unit)}, bubble {tl.bubble_fraction:.1%}"
        if ms is None:
            out.append(Text(head, style="dim"))
        else:
            out.append(Text(f"predicted: {head}", style="dim"))
            out.append(
                Text(
                    f"measured:  step {format_time(ms.step_time, ms.time_unit)}, bubble "
                    f"{ms.bubble_fraction:.1%}"
                    + (" (rows scaled to the predicted step)" if ms.time_unit != tl.time_unit else ""),
                    style="dim",
                )
            )
        kinds: set[str] = set()
        chunked = False
        for lane in all_lanes:
            row = Text(lane.label.ljust(pad), style="bold" if lane.source == "predicted" else "")
            row.append_text(_lane_text(lane, span, bar))
            out.append(row)
            kinds.update(classify(e.op).kind for e in lane.events if e.end > e.start)
            chunked = chunked or len(lane.chunks) > 1
        out.extend(_axis_lines(span, tl.time_unit, bar, pad))
        out.extend(_legend_lines(kinds, chunked, width))
        for line in out:
            line.no_wrap = True
            line.truncate(width, overflow="ellipsis")
        return out

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield from self.lines(min(self.width or options.max_width, options.max_width))

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        width = min(self.width or options.max_width, options.max_width)
        return Measurement(min(width, 20), width)


def render_terminal(
    timeline: Timeline,
    *,
    measured: Timeline | None = None,
    dp: int | None = None,
    width: int | None = None,
    title: str = "",
) -> TimelineView:
    """The per-rank timeline as a rich renderable (``Console().print(view)``).

    ``width``: total columns (default: the console's). ``dp``: the measured
    run's dp size (default: measured ranks / predicted ranks).
    """
    if measured is not None:
        infer_dp(timeline, measured, dp)  # fail here, not while printing
    return TimelineView(timeline=timeline, measured=measured, dp=dp, width=width, title=title)


# ----------------------------------------------------------------------------- summary table


def _rank_cells(tl: Timeline, rank: int, has_act: bool, has_mem: bool) -> list[str]:
    r = next((x for x in tl.per_rank if x.rank == rank), None)
    if r is None:  # a rank with events but no totals: nothing to say, so say nothing
        return [""] * (4 + has_act + has_mem)
    cells = [
        format_time(r.compute, tl.time_unit),
        format_time(r.comm_wait, tl.time_unit),
        format_time(r.idle, tl.time_unit),
        f"{r.bubble_fraction:.1%}",
    ]
    if has_act:
        cells.append("" if r.peak_activations is None else str(r.peak_activations))
    if has_mem:
        cells.append("" if r.peak_memory_bytes is None else _bytes(r.peak_memory_bytes))
    return cells


def _total_cells(tl: Timeline, has_act: bool, has_mem: bool) -> list[str]:
    pr = tl.per_rank
    cells = [
        format_time(sum(r.compute for r in pr), tl.time_unit),
        format_time(sum(r.comm_wait for r in pr), tl.time_unit),
        format_time(sum(r.idle for r in pr), tl.time_unit),
        f"{tl.bubble_fraction:.1%}",
    ]
    if has_act:
        acts = [r.peak_activations for r in pr if r.peak_activations is not None]
        cells.append(f"max {max(acts)}" if acts else "")
    if has_mem:
        mems = [r.peak_memory_bytes for r in pr if r.peak_memory_bytes is not None]
        cells.append(f"max {_bytes(max(mems))}" if mems else "")
    return cells


def _bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def render_summary(
    timeline: Timeline, *, measured: Timeline | None = None, dp: int | None = None, title: str = ""
) -> Table:
    """Per rank: compute, comm wait, idle, bubble, peak activations and memory; totals.

    With ``measured``, each pp rank's predicted row is followed by its
    replicas' measured rows, and the totals of both close the table.
    """
    timelines = [timeline] if measured is None else [timeline, measured]
    has_act = any(r.peak_activations is not None for tl in timelines for r in tl.per_rank)
    has_mem = any(r.peak_memory_bytes is not None for tl in timelines for r in tl.per_rank)
    step = ", ".join(
        f"{name}step {format_time(tl.step_time, tl.time_unit)}"
        for name, tl in zip(("predicted " if measured else "", "measured "), timelines)
    )
    table = Table(title=title or None, caption=step, caption_justify="left", header_style="bold")
    table.add_column("rank", justify="left", no_wrap=True)
    for name in ("compute", "comm wait", "idle", "bubble"):
        table.add_column(name, justify="right", no_wrap=True)
    if has_act:
        table.add_column("peak act.", justify="right", no_wrap=True)
    if has_mem:
        table.add_column("peak mem", justify="right", no_wrap=True)
    all_lanes, _ = lanes(timeline, measured=measured, dp=dp)
    for lane in all_lanes:
        tl = timeline if lane.source == "predicted" else measured
        assert tl is not None
        style = "bold" if measured is not None and lane.source == "predicted" else None
        label = lane.label if measured is not None else str(lane.rank)
        table.add_row(label, *_rank_cells(tl, lane.rank, has_act, has_mem), style=style)
    table.add_section()
    if measured is None:
        table.add_row("all", *_total_cells(timeline, has_act, has_mem), style="bold")
    else:
        table.add_row("all pred", *_total_cells(timeline, has_act, has_mem), style="bold")
        table.add_row("all meas", *_total_cells(measured, has_act, has_mem), style="bold")
    return table


def show(
    timeline: Timeline,
    *,
    measured: Timeline | None = None,
    dp: int | None = None,
    console: Console | None = None,
    width: int | None = None,
    title: str = "",
) -> None:
    """Print the timeline view and the summary table (``pipec show``)."""
    console = console or Console()
    view = render_terminal(timeline, measured=measured, dp=dp, width=width, title=title)
    console.print(Group(view, Text(), render_summary(timeline, measured=measured, dp=dp)))


# ----------------------------------------------------------------------------- picture

_FORMATS = {".svg": "svg", ".png": "png"}


def render_image(
    timeline: Timeline,
    path: str | os.PathLike[str],
    *,
    measured: Timeline | None = None,
    dp: int | None = None,
    title: str = "",
) -> None:
    """Draw the timeline to ``path``: SVG or PNG by its extension.

    One lane per rank (with ``measured``: each pp rank's predicted lane, then
    its replicas' measured lanes), blocks in :data:`KINDS` colours with their
    microbatch number where it fits, a rank's later chunks in a lighter tint,
    a legend, and an axis in the timeline's unit (a measurement scaled onto a
    unit-cost prediction gets its own axis in seconds on top). Each lane's
    bars are one collection with gid ``lane-<source>-<rank>``.
    """
    ext = os.path.splitext(os.fspath(path))[1].lower()
    if ext not in _FORMATS:
        raise RenderError(f"a picture path must end in .svg or .png, got {os.fspath(path)!r}")
    from matplotlib.figure import Figure  # lazy: the compile path never imports matplotlib
    from matplotlib.patches import Patch

    all_lanes, span = lanes(timeline, measured=measured, dp=dp)
    fig_w = 12.0
    fig = Figure(figsize=(fig_w, 1.8 + 0.42 * len(all_lanes)), layout="constrained")
    ax = fig.add_subplot()
    points_per_unit = (fig_w - 1.5) * 72 / span
    fontsize = 7.0
    kinds: set[str] = set()
    chunked = False
    for y, lane in enumerate(all_lanes):
        bars, colours = [], []
        for ev in lane.events:
            if ev.end <= ev.start:
                continue
            info = classify(ev.op)
            kinds.add(info.kind)
            start, dur = ev.start * lane.scale, (ev.end - ev.start) * lane.scale
            chunk = lane.chunks.get(info.stage, 0) if info.stage is not None else 0
            chunked = chunked or chunk > 0
            colour = KINDS[info.kind].colour
            bars.append((start, dur))
            colours.append(_tint(colour, 0.5) if chunk else colour)
            if info.microbatch is not None:
                label = str(info.microbatch)
                if dur * points_per_unit >= 0.62 * fontsize * len(label) + 2:
                    ax.text(start + dur / 2, y, label, ha="center", va="center", fontsize=fontsize, clip_on=True)
        alpha = 1.0 if lane.source == "predicted" else 0.85
        coll = ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=colours, edgecolors="white", linewidths=0.4, alpha=alpha)
        coll.set_gid(f"lane-{lane.source}-{lane.rank}")
    ax.set_yticks(range(len(all_lanes)), [lane.label for lane in all_lanes])
    ax.set_ylim(len(all_lanes) - 0.5, -0.5)
    ax.set_xlim(0, span)
    factor, name = _axis_unit(span, timeline.time_unit)
    ax.set_xlabel(f"time ({name})")
    if factor != 1.0:
        ax.xaxis.set_major_formatter(lambda x, _pos: f"{x * factor:g}")
    if measured is not None and measured.time_unit != timeline.time_unit:
        scale = next(lane.scale for lane in all_lanes if lane.source == "measured")
        m_factor, m_name = _axis_unit(_span(measured), measured.time_unit)
        top = ax.secondary_xaxis("top", functions=(lambda x: x / scale * m_factor, lambda x: x * scale / m_factor))
        top.set_xlabel(f"measured time ({m_name})")
    handles = [Patch(facecolor=KINDS[k].colour, label=KINDS[k].name) for k in KINDS if k in kinds]
    if chunked:
        handles.append(Patch(facecolor=_tint(KINDS["F"].colour, 0.5), label="later chunk (lighter)"))
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 7), frameon=False)
    head = f"step {format_time(timeline.step_time, timeline.time_unit)}, bubble {timeline.bubble_fraction:.1%}"
    if measured is not None:
        head = (
            f"predicted {head}; measured step {format_time(measured.step_time, measured.time_unit)}, "
            f"bubble {measured.bubble_fraction:.1%}"
        )
    ax.set_title(f"{title}\n{head}" if title else head, fontsize=10)
    fig.savefig(os.fspath(path), format=_FORMATS[ext])

