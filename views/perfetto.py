"""Timelines as a Chrome/Perfetto trace (trace-event JSON).

Open the file at https://ui.perfetto.dev (or chrome://tracing). Layout: one
process per timeline kind (``predicted``, ``measured``), one thread per rank
(named ``rank 3`` for a pp rank, ``rank 5 (pp 2, dp 1)`` for a measured
global rank), one complete (``"ph": "X"``) event per Timeline event, named by
its text form (``F0.3``, :attr:`~pipec.compiler.ir.timeline.Event.text`), with
``cat`` its kind (``F``, ``B``, ``I``, ``W``, ``comm``, ``AR``, ``OPT``,
:func:`~pipec.views.common.kind_of`) and its stage and microbatch in ``args``;
time a rank waits inside a collective is its own ``comm`` event (``~OPT``), as
the terminal draws it (:func:`~pipec.views.common.split_waits`).
``ts`` and ``dur`` are microseconds: seconds x 1e6, and for a unit-cost
timeline 1 unit = 1 ms, which the trace's ``otherData`` states.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pipec.compiler.ir.plan import Mesh
from pipec.compiler.ir.timeline import Timeline
from pipec.views.common import RenderError, kind_of, run_mesh, split_waits

__all__ = ["trace_events", "write_perfetto", "US_PER"]

US_PER = {"s": 1e6, "unit": 1e3}
"""Microseconds per time unit: a second, or one cost unit (drawn as 1 ms)."""

_PID = {"predicted": 1, "measured": 2}


def _meta(pid: int, tid: int | None, name: str, value: Any) -> dict[str, Any]:
    """A metadata event: ``process_name``/``thread_name`` take a name, ``*_sort_index`` an index."""
    key = "name" if name.endswith("_name") else "sort_index"
    ev: dict[str, Any] = {"ph": "M", "pid": pid, "name": name, "args": {key: value}}
    if tid is not None:
        ev["tid"] = tid
    return ev


def _process(timeline: Timeline, kind: str, mesh: Mesh | None, out: list[dict[str, Any]]) -> None:
    pid = _PID[kind]
    us = US_PER[timeline.time_unit]
    out.append(_meta(pid, None, "process_name", kind))
    out.append(_meta(pid, None, "process_sort_index", pid))
    ranks = sorted({r.rank for r in timeline.per_rank} | {e.rank for e in timeline.events})
    for rank in ranks:
        if kind == "measured" and mesh is not None:
            name = f"rank {rank} ({mesh.where(rank).partition('(')[2]}"
        else:
            name = f"rank {rank}"
        out.append(_meta(pid, rank, "thread_name", name))
        out.append(_meta(pid, rank, "thread_sort_index", rank))
    for ev in split_waits(timeline):
        args: dict[str, Any] = {}
        if ev.stage is not None:
            args["stage"] = ev.stage
        if ev.microbatch is not None:
            args["microbatch"] = ev.microbatch
        out.append(
            {
                "ph": "X",
                "pid": pid,
                "tid": ev.rank,
                "name": ev.text,
                "cat": kind_of(ev),
                "ts": ev.start * us,
                "dur": max(0.0, ev.end - ev.start) * us,
                "args": args,
            }
        )


def trace_events(
    timeline: Timeline,
    *,
    measured: Timeline | None = None,
    mesh: Mesh | None = None,
    kind: str = "predicted",
) -> dict[str, Any]:
    """The trace as a JSON-ready dict ``{"traceEvents": [...], "otherData": {...}}``.

    ``kind`` names ``timeline``'s process (``"measured"`` for a run's own
    trace, then the run's ``mesh``, the plan's, names each global rank's
    coordinates). With ``measured``, ``timeline`` is the prediction and the
    mesh is checked against both (None: pp x dp from their rank counts,
    :func:`~pipec.views.common.run_mesh`).
    """
    if kind not in _PID:
        raise RenderError(f"kind must be 'predicted' or 'measured', got {kind!r}")
    if measured is not None:
        if kind != "predicted":
            raise RenderError("with measured=, the first timeline is the prediction: leave kind='predicted'")
        mesh = run_mesh(timeline, measured, mesh)
    events: list[dict[str, Any]] = []
    _process(timeline, kind, mesh, events)
    units = {kind: timeline.time_unit}
    if measured is not None:
        _process(measured, "measured", mesh, events)
        units["measured"] = measured.time_unit
    other: dict[str, Any] = {"generator": "pipec", "time_unit": units}
    if "unit" in units.values():
        other["note"] = "unit-cost timeline: 1 unit = 1 ms (ts and dur are microseconds)"
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def write_perfetto(
    timeline: Timeline,
    path: str | os.PathLike[str],
    *,
    measured: Timeline | None = None,
    mesh: Mesh | None = None,
    kind: str = "predicted",
) -> None:
    """Write the trace of :func:`trace_events` to ``path`` (open it in ui.perfetto.dev)."""
    obj = trace_events(timeline, measured=measured, mesh=mesh, kind=kind)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, separators=(",", ":"))
