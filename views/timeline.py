"""The terminal timeline (rich): one row per lane, time scaled to the width it is given.

Blocks are coloured by kind (:data:`~pipec.views.common.KINDS`), odd
microbatches a shade darker so neighbours stay apart, labelled ``F3`` or
``3`` when wide enough; a rank's later chunks are underlined; idle time is
dim dots; waiting is ``~``. With a measured timeline, each pp rank's
predicted row is followed by its replicas' measured rows
(:func:`~pipec.views.common.lanes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby

from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.text import Text

from pipec.compiler.ir.plan import Mesh
from pipec.compiler.ir.timeline import Event, Timeline
from pipec.views.common import KINDS, Lane, axis_unit, darken, headline, kind_of, lanes, run_mesh, ticks

__all__ = ["TimelineView", "render_terminal", "IDLE"]

IDLE = "·"


def _block(ev: Event, k: str, width: int) -> str:
    """A block's text, its kind always first: ``B3 `` (kind, microbatch and a gap) when wide enough, ``B3``
    when it just fits, else the kind's letter (``B``; ``OPT`` shortens to ``O``) alone; a wait is ``~~~``."""
    style = KINDS[k]
    if k == "comm":
        return style.letter * width
    text = style.letter if ev.microbatch is None else f"{style.letter}{ev.microbatch}"
    if len(text) > width:
        text = style.letter if len(style.letter) <= width else style.letter[0]
    return text.ljust(width)[:width]


def _block_style(ev: Event, k: str, chunk: int) -> str:
    colour = KINDS[k].colour
    if ev.microbatch is not None and ev.microbatch % 2:
        colour = darken(colour, 0.78)  # neighbours of one kind stay apart
    return f"black on {colour}" + (" underline" if chunk > 0 else "")


def _lane_text(lane: Lane, span: float, bar: int) -> Text:
    cells = [-1] * bar
    cols = bar / span if span > 0 else 0.0  # columns per time unit
    events = lane.events
    for index, ev in enumerate(events):
        a = max(0, round(ev.start * lane.scale * cols))
        b = min(bar, round(ev.end * lane.scale * cols))
        if b > a:
            cells[a:b] = [index] * (b - a)
    text = Text(no_wrap=True, overflow="crop")
    for index, run in groupby(cells):
        n = sum(1 for _ in run)
        if index < 0:
            text.append(IDLE * n, style="dim")
            continue
        ev = events[index]
        k = kind_of(ev)
        chunk = lane.chunks.get(ev.stage, 0) if ev.stage is not None else 0
        text.append(_block(ev, k, n), style=_block_style(ev, k, chunk))
    return text


def _axis_lines(span: float, unit: str, bar: int, pad: int) -> list[Text]:
    factor, name = axis_unit(span, unit)
    ruler = ["─"] * bar
    labels = [" "] * bar
    last_end = -1
    for t in ticks(span, max(1, bar // 12)):
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


def _legend_lines(kinds: set[str], chunked: bool, width: int, replicas: bool = False) -> list[Text]:
    """The kinds drawn, idle, a later chunk's underline, and (``replicas``) what a measured row's ``gN`` is."""
    entries = []
    for key, style in KINDS.items():
        if key in kinds:
            entries.append(Text.assemble((f" {style.letter} ", f"black on {style.colour}"), f" {style.name}"))
    entries.append(Text.assemble((IDLE * 3, "dim"), " idle"))
    if chunked:
        entries.append(Text.assemble(("F3", "black on #60a5fa underline"), " later chunk"))
    if replicas:
        entries.append(Text("meas gN: measured on global rank N"))
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
    """A rich renderable: one row per lane, time scaled to the width it is given (see the module doc)."""

    timeline: Timeline
    measured: Timeline | None = None
    mesh: Mesh | None = None
    """The run's mesh (the plan's; :func:`~pipec.views.common.run_mesh`): with tp > 1 a row stands for its tp
    ranks (tp rank 0's measured)."""
    width: int | None = None
    title: str = ""

    def lines(self, width: int) -> list[Text]:
        """The view as lines of at most ``width`` cells."""
        all_lanes, span = lanes(self.timeline, measured=self.measured, mesh=self.mesh)
        pad = max((len(lane.label) for lane in all_lanes), default=0) + 1
        bar = max(8, width - pad)
        out: list[Text] = []
        if self.title:
            out.append(Text(self.title, style="bold"))
        tl, ms = self.timeline, self.measured
        tp = 1 if self.mesh is None else self.mesh.tp
        per_row = "" if tp == 1 else f" (tp {tp} ranks per row)"
        if ms is None:
            out.append(Text(headline(tl) + per_row, style="dim"))
        else:
            out.append(Text(f"predicted: {headline(tl)}{per_row}", style="dim"))
            out.append(
                Text(
                    f"measured:  {headline(ms)}"
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
            kinds.update(kind_of(e) for e in lane.events if e.end > e.start)
            chunked = chunked or len(lane.chunks) > 1
        out.extend(_axis_lines(span, tl.time_unit, bar, pad))
        out.extend(_legend_lines(kinds, chunked, width, replicas=any(" g" in lane.label for lane in all_lanes)))
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
    mesh: Mesh | None = None,
    width: int | None = None,
    title: str = "",
) -> TimelineView:
    """The per-rank timeline as a rich renderable (``Console().print(view)``).

    ``width``: total columns (default: the console's). ``mesh``: the run's (the plan's; with ``measured`` and
    None, pp x dp at tp 1 from the rank counts: :func:`~pipec.views.common.run_mesh`).
    """
    if measured is not None:
        run_mesh(timeline, measured, mesh)  # fail here, not while printing
    return TimelineView(timeline=timeline, measured=measured, mesh=mesh, width=width, title=title)
