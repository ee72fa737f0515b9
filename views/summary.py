"""The summary table (rich): per rank, where its step went, and the totals; and ``pipec show``'s print of both views.

Per rank: compute, comm wait, idle, bubble, peak activations and memory
(columns only where some rank has them: absent, never faked). With a measured
timeline, each pp rank's predicted row is followed by its replicas' measured
rows (:func:`~pipec.views.common.lanes`), and the totals of both close the
table.
"""

from __future__ import annotations

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from pipec.compiler.ir.timeline import Timeline
from pipec.views.common import format_time, lanes
from pipec.views.timeline import render_terminal

__all__ = ["render_summary", "show"]


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
