"""The picture of a Timeline (matplotlib): SVG or PNG.

One lane per rank (with a measured timeline: each pp rank's predicted lane,
then its replicas' measured lanes, :func:`~pipec.views.common.lanes`),
blocks in :data:`~pipec.views.common.KINDS` colours, and a measurement scaled
onto a unit-cost prediction gets its own axis in seconds on top. A prediction
records a shard collective's post as an instant (the host posts it and goes
on): it is drawn as a thin block of its kind, as a run's measured one is, and
the legend names every kind drawn. matplotlib is imported only when a picture
is drawn.
"""

from __future__ import annotations

import os

from pipec.compiler.ir.plan import Mesh
from pipec.compiler.ir.timeline import Timeline
from pipec.views.common import KINDS, RenderError, axis_unit, headline, kind_of, lanes, span_of, tint

__all__ = ["render_image", "figure"]

_FORMATS = {".svg": "svg", ".png": "png"}

_INSTANTS = frozenset(("UN", "RE", "RS"))
"""Kinds a prediction records as instants, drawn :data:`INSTANT_WIDTH` of the axis wide."""

INSTANT_WIDTH = 0.004


def render_image(
    timeline: Timeline,
    path: str | os.PathLike[str],
    *,
    measured: Timeline | None = None,
    mesh: Mesh | None = None,
    title: str = "",
) -> None:
    """Draw the timeline to ``path``: SVG or PNG by its extension (``mesh``: the run's, the plan's; with tp > 1 a
    row stands for its tp ranks).

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
    figure(timeline, measured=measured, mesh=mesh, title=title).savefig(os.fspath(path), format=_FORMATS[ext])


def figure(timeline: Timeline, *, measured: Timeline | None = None, mesh: Mesh | None = None, title: str = ""):
    """The matplotlib Figure :func:`render_image` saves."""
    from matplotlib.figure import Figure  # lazy: the compile path never imports matplotlib
    from matplotlib.patches import Patch

    all_lanes, span = lanes(timeline, measured=measured, mesh=mesh)
    fig_w = 12.0
    fig = Figure(figsize=(fig_w, 1.8 + 0.42 * len(all_lanes)), layout="constrained")
    ax = fig.add_subplot()
    points_per_unit = (fig_w - 1.5) * 72 / span
    fontsize = 7.0
    kinds: set[str] = set()
    chunked = False
    for y, lane in enumerate(all_lanes):
        bars, colours, instants = [], [], []
        for ev in lane.events:
            k = kind_of(ev)
            instant = k in _INSTANTS and (ev.end - ev.start) * lane.scale < INSTANT_WIDTH * span
            if ev.end <= ev.start and not instant:
                continue
            kinds.add(k)
            start, dur = ev.start * lane.scale, (ev.end - ev.start) * lane.scale
            if instant:  # drawn over whatever follows it at the same time (a wait), after one just before
                at = max(start, instants[-1][0][0] + instants[-1][0][1]) if instants else start
                instants.append(((at, INSTANT_WIDTH * span), KINDS[k].colour))
                continue
            chunk = lane.chunks.get(ev.stage, 0) if ev.stage is not None else 0
            chunked = chunked or chunk > 0
            colour = KINDS[k].colour
            bars.append((start, dur))
            colours.append(tint(colour, 0.5) if chunk else colour)
            if ev.microbatch is not None:
                label = str(ev.microbatch)
                if dur * points_per_unit >= 0.62 * fontsize * len(label) + 2:
                    ax.text(start + dur / 2, y, label, ha="center", va="center", fontsize=fontsize, clip_on=True)
        alpha = 1.0 if lane.source == "predicted" else 0.85
        coll = ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=colours, edgecolors="white", linewidths=0.4, alpha=alpha)
        coll.set_gid(f"lane-{lane.source}-{lane.rank}")
        if instants:
            marks = ax.broken_barh([b for b, _ in instants], (y - 0.4, 0.8), facecolors=[c for _, c in instants],
                                   linewidths=0, zorder=3)
            marks.set_gid(f"instants-{lane.source}-{lane.rank}")
    ax.set_yticks(range(len(all_lanes)), [lane.title or lane.label for lane in all_lanes])
    ax.set_ylim(len(all_lanes) - 0.5, -0.5)
    ax.set_xlim(0, span)
    factor, name = axis_unit(span, timeline.time_unit)
    ax.set_xlabel(f"time ({name})")
    if factor != 1.0:
        ax.xaxis.set_major_formatter(lambda x, _pos: f"{x * factor:g}")
    if measured is not None and measured.time_unit != timeline.time_unit:
        scale = next(lane.scale for lane in all_lanes if lane.source == "measured")
        m_factor, m_name = axis_unit(span_of(measured), measured.time_unit)
        top = ax.secondary_xaxis("top", functions=(lambda x: x / scale * m_factor, lambda x: x * scale / m_factor))
        top.set_xlabel(f"measured time ({m_name})")
    handles = [Patch(facecolor=KINDS[k].colour, label=KINDS[k].name) for k in KINDS if k in kinds]
    if chunked:
        handles.append(Patch(facecolor=tint(KINDS["F"].colour, 0.5), label="later chunk (lighter)"))
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 7), frameon=False)
    head = headline(timeline)
    if measured is not None:
        head = f"predicted {head}; measured {headline(measured)}"
    ax.set_title(f"{title}\n{head}" if title else head, fontsize=10)
    return fig

