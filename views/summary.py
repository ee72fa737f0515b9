"""The summary table (rich): per rank, where its step went, and the totals; and ``pipec show``'s print of both views.

Per rank: compute, comm wait, idle, bubble, peak activations and memory
(columns only where some rank has them: absent, never faked). With a measured
timeline, each pp rank's predicted row is followed by its replicas' measured
rows (:func:`~pipec.views.common.lanes`), and the totals of both close the
table. The caption gives the step and, where the prediction has one, the
interval its steps are expected in.

Beside a measured timeline, :func:`memory_table` puts the bytes the
prediction counts beside the same bytes measured: the state at rest and the
saved activations at their peak, and the peak itself (predicted, an upper
bound; measured, the allocator's, on GPU); each figure says what it is, and
one that was not measured is left blank.
"""

from __future__ import annotations

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from pipec.compiler.ir.plan import Mesh
from pipec.compiler.ir.timeline import Timeline
from pipec.views.common import format_time, lanes, run_mesh
from pipec.views.timeline import render_terminal

__all__ = ["render_summary", "memory_table", "show", "step_caption", "format_bytes"]


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
        cells.append("" if r.peak_memory_bytes is None else format_bytes(r.peak_memory_bytes))
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
        cells.append(f"max {format_bytes(max(mems))}" if mems else "")
    return cells


def format_bytes(n: int) -> str:
    """``512 B``, ``437.1 KiB``, ``28.3 MiB``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def render_summary(
    timeline: Timeline, *, measured: Timeline | None = None, mesh: Mesh | None = None, title: str = ""
) -> Table:
    """Per rank: compute, comm wait, idle, bubble, peak activations and memory; totals.

    With ``measured``, each pp rank's predicted row is followed by its
    replicas' measured rows (placed by the run's ``mesh``, the plan's: :func:`~pipec.views.common.run_mesh`),
    and the totals of both close the table; with ``mesh.tp`` > 1 a row stands for its tp ranks (tp rank 0's
    measured; the caption says so), the measured totals over every rank.
    """
    timelines = [timeline] if measured is None else [timeline, measured]
    has_act = any(r.peak_activations is not None for tl in timelines for r in tl.per_rank)
    has_mem = any(r.peak_memory_bytes is not None for tl in timelines for r in tl.per_rank)
    step = ", ".join(
        step_caption(tl, name) for name, tl in zip(("predicted " if measured else "", "measured "), timelines)
    )
    if mesh is not None and mesh.tp > 1:
        step += f"; tp {mesh.tp} ranks per row"
    table = Table(title=title or None, caption=step, caption_justify="left", header_style="bold")
    table.add_column("rank", justify="left", no_wrap=True)
    for name in ("compute", "comm wait", "idle", "bubble"):
        table.add_column(name, justify="right", no_wrap=True)
    if has_act:
        table.add_column("peak act.", justify="right", no_wrap=True)
    if has_mem:
        table.add_column("peak mem", justify="right", no_wrap=True)
    all_lanes, _ = lanes(timeline, measured=measured, mesh=mesh)
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


def interval_words(tl: Timeline) -> str:
    """``90% interval 480 ms-580 ms`` (and ``, widened to 6 earlier runs here`` where runs on this host widened it:
    compiler/sim/history.py); "" without an interval."""
    band = tl.interval
    if band is None:
        return ""
    lo, hi = band.step_time
    return (f"{band.coverage:.0%} interval {format_time(lo, tl.time_unit)}-{format_time(hi, tl.time_unit)}"
            + (f", widened to {band.runs} earlier run{'s' if band.runs != 1 else ''} here" if band.runs else ""))


def step_caption(tl: Timeline, name: str = "") -> str:
    """``predicted step 512 ms (90% interval 480 ms-580 ms; bubble 28.0-33.1%)``: the step, and its interval where
    the timeline has one."""
    out = f"{name}step {format_time(tl.step_time, tl.time_unit)}"
    band = tl.interval
    if band is not None:
        blo, bhi = band.bubble_fraction
        out += f" ({interval_words(tl)}; bubble {blo:.1%}-{bhi:.1%})"
    return out


_MEMORY = (("state", "state_bytes"), ("activations", "peak_activation_bytes"), ("peak", "peak_memory_bytes"))
"""The memory table's columns and the per-rank field each shows."""


MEMORY_NOTE = """\
state: params, grads, optimizer state (measured after the optimizer step)
activations: saved for the backward, at the peak (measured in the first step)
peak: predicted, an upper bound (state, unsharded parameters, collective
  buffers and activations, each at its own peak); measured, the allocator's
  peak (torch.cuda.max_memory_allocated; none on CPU)
blank: not measured"""
"""What each figure of :func:`memory_table` is, under it."""


def memory_table(predicted: Timeline, measured: Timeline, *, mesh: Mesh | None = None) -> Table | None:
    """Per pp rank, the bytes the prediction counts, then the same bytes its replicas measured (placed by the
    run's ``mesh``: :func:`~pipec.views.common.run_mesh`); None when the measured timeline has none of them (a
    run from before they were measured, ``--emulate``)."""
    if not any(getattr(r, field) is not None for r in measured.per_rank for _, field in _MEMORY):
        return None
    mesh = run_mesh(predicted, measured, mesh)
    table = Table(title="memory: what the prediction counts, and the same measured", header_style="bold",
                  caption=MEMORY_NOTE, caption_justify="left")
    table.add_column("rank", justify="left", no_wrap=True)
    for name, _ in _MEMORY:
        table.add_column(name, justify="right", no_wrap=True)
    meas = {r.rank: r for r in measured.per_rank}
    for i, p in enumerate(predicted.per_rank):
        table.add_row(f"{p.rank} pred", *_memory_cells(p), style="bold")
        for g in mesh.replicas(i):
            if g in meas:
                table.add_row(f"{p.rank} meas" if mesh.dp == 1 and mesh.tp == 1 else f"{p.rank} meas g{g}",
                              *_memory_cells(meas[g], p))
    return table


def _memory_cells(r, pred=None) -> list[str]:
    """A row's figures; a measured one's with its difference from the prediction where both are counts."""
    cells = []
    for name, field in _MEMORY:
        value = getattr(r, field)
        if value is None:
            cells.append("")
            continue
        want = None if pred is None or name == "peak" else getattr(pred, field)
        diff = f" ({(value - want) / want:+.1%})" if want else ""
        cells.append(format_bytes(value) + diff)
    return cells


def show(
    timeline: Timeline,
    *,
    measured: Timeline | None = None,
    mesh: Mesh | None = None,
    console: Console | None = None,
    width: int | None = None,
    title: str = "",
) -> None:
    """Print the timeline view and the summary table (``pipec show``); ``mesh``: the run's (the plan's, or
    report.json's)."""
    console = console or Console()
    view = render_terminal(timeline, measured=measured, mesh=mesh, width=width, title=title)
    parts = [view, Text(), render_summary(timeline, measured=measured, mesh=mesh)]
    memory = None if measured is None else memory_table(timeline, measured, mesh=mesh)
    if memory is not None:
        parts += [Text(), memory]
    console.print(Group(*parts))
