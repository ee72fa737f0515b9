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
from pipec.views.common import RenderError, infer_dp, kind_of, split_waits

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


def _process(
    timeline: Timeline, kind: str, dp: int | None, out: list[dict[str, Any]], tp: int = 1
) -> None:
    pid = _PID[kind]
    us = US_PER[timeline.time_unit]
    out.append(_meta(pid, None, "process_name", kind))
    out.append(_meta(pid, None, "process_sort_index", pid))
    ranks = sorted({r.rank for r in timeline.per_rank} | {e.rank for e in timeline.events})
    mesh = Mesh(pp=max(1, len(ranks) // ((dp or 1) * tp)), dp=dp or 1, tp=tp)
    for rank in ranks:
        if kind == "measured" and dp is not None:
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
    dp: int | None = None,
    kind: str = "predicted",
    tp: int = 1,
) -> dict[str, Any]:
    """The trace as a JSON-ready dict ``{"traceEvents": [...], "otherData": {...}}``.

    ``kind`` names ``timeline``'s process (``"measured"`` for a run's own
    trace, then ``dp`` names each global rank's coordinates). With
    ``measured``, ``timeline`` is the prediction and ``dp`` defaults to
    measured ranks / predicted ranks.
    """
    if kind not in _PID:
        raise RenderError(f"kind must be 'predicted' or 'measured', got {kind!r}")
    if measured is not None:
        if kind != "predicted":
            raise RenderError("with measured=, the first timeline is the prediction: leave kind='predicted'")
        dp = infer_dp(timeline, measured, dp, tp)
    events: list[dict[str, Any]] = []
    _process(timeline, kind, dp, events, tp)
    units = {kind: timeline.time_unit}
    if measured is not None:
        _process(measured, "measured", dp, events, tp)
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
    dp: int | None = None,
    kind: str = "predicted",
    tp: int = 1,
) -> None:
    """Write the trace of :func:`trace_events` to ``path`` (open it in ui.perfetto.dev)."""
    obj = trace_events(timeline, measured=measured, dp=dp, kind=kind, tp=tp)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, separators=(",", ":"))
