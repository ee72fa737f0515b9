"""What earlier runs on this host measured against their predictions, and the interval widened to hold it.

The simulator's interval (:func:`~pipec.compiler.sim.simulate.interval_of`) covers what the profile measured:
each cost's spread, the profile's level, the links' samples. A host can move a step by more than that: stalls
no profile meets, a neighbour's work between the compile and the run, a level that drifts from one process to
the next. Every ``pipec run`` of a plan with an interval keeps, in the profile cache (kind ``runs``), each step it
measured (its last :data:`KEEP_STEPS`) as a ratio to the plan's point prediction: the ratios of the last
:data:`KEEP_RUNS` runs per host key
(the host and torch the profile was taken on, the backend, the ranks sharing the host). A compile with at least
:data:`MIN_RUNS` such runs profiled at its host load widens its interval to hold the same share of them,
split-conformally with the run as the unit (a run's steps move together: its profile's level, its load): of k runs,
the steps pooled are read at the quantiles ``ceil((k + 1)(1 + c) / 2) / k`` and ``floor((k + 1)(1 - c) / 2) / k``
(the greatest and the least below 19 runs at c = 0.9), times the point; the union with the simulator's range.
Where the host's past runs are like its next, a share ``c`` of the next run's steps falls inside; the first runs
on a host have the simulator's range alone.

Only the step's range is widened (a run's bubble is not kept); the point stays the simulator's.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Mapping, Sequence

from pipec.costs import cache
from pipec.compiler.ir.plan import Plan
from pipec.compiler.ir.timeline import Interval

__all__ = ["history_key", "record", "widened", "MIN_RUNS", "KEEP_RUNS", "KEEP_STEPS", "LOAD_MATCH"]

MIN_RUNS = 3
"""The fewest earlier runs (at the plan's host load) that widen an interval."""
KEEP_RUNS = 40
"""The runs kept per host key, the latest."""
KEEP_STEPS = 32
"""The steps kept of a run, its last: a long run weighs no more than a short one in the pooled steps (the run is the
unit), and an entry stays a few kilobytes."""
LOAD_MATCH = 0.5
"""Runs whose plans were profiled at a host load within this of the plan's are its like."""


def history_key(plan: Plan) -> dict[str, Any] | None:
    """The runs a plan is compared with: profiled on the same host and torch (``model.profile.host``), run over the
    same backend with as many ranks on the host. None for a plan without a profile's host (unit or flops costs)."""
    profile = (plan.model or {}).get("profile") or {}
    host = profile.get("host")
    if not isinstance(host, Mapping):
        return None
    backends = sorted({link.measured.backend for link in plan.links.values() if link.measured is not None})
    return {"host": dict(host), "backends": backends, "ranks": int(profile.get("concurrent_ranks", 1))}


def _check(value: Mapping[str, Any]) -> None:
    """A ``runs`` entry's value its readers can use (raises on one they cannot: the cache names it damaged)."""
    for run in value["runs"]:
        for k in ("load", "run_load"):
            if run.get(k) is not None:
                float(run[k])
        if not all(float(x) > 0 for x in run["ratios"]):
            raise ValueError("a ratio that is not positive")


def _profile_load(plan: Plan) -> float | None:
    """The host load the plan was profiled at (``model.profile.host_load``), where the profile recorded it."""
    load = ((plan.model or {}).get("profile") or {}).get("host_load")
    return None if load is None else float(load)


def _runs(key: Mapping[str, Any]) -> list[dict[str, Any]]:
    entry = cache.lookup("runs", key, _check)
    return list(entry.value["runs"]) if entry is not None else []


def _like(run: Mapping[str, Any], load: float | None) -> bool:
    """Whether a kept run is like a next run of a plan profiled at host load ``load``: its plan profiled at that
    load and the run meeting it too (a run whose load had moved, which ``pipec run`` warns of, is not)."""
    if load is None:
        return run["load"] is None
    run_load = run.get("run_load")
    return run["load"] is not None and abs(float(run["load"]) - load) <= LOAD_MATCH and \
        (run_load is None or abs(float(run_load) - load) <= LOAD_MATCH)


def record(plan: Plan, steps: Sequence[float], run_load: float | None = None) -> None:
    """Keep a run's measured ``steps`` (those it holds the interval to: after the first) as ratios to the plan's
    point prediction, with the host load the plan was profiled at and the run's (``run_load``: the trainer's
    reading before the first step, where it took one); nothing for a plan without a history key or a point. Two
    runs ending at once may keep one of the two (each entry is written whole, :mod:`pipec.costs.cache`)."""
    key = history_key(plan)
    point = plan.prediction.step_time if plan.prediction is not None else 0.0
    if key is None or point <= 0 or not steps:
        return
    run = {"load": _profile_load(plan), "run_load": run_load, "point": point,
           "ratios": [s / point for s in steps[-KEEP_STEPS:]]}
    cache.store("runs", key, {"runs": [*_runs(key), run][-KEEP_RUNS:]})


def _at(xs: Sequence[float], q: float) -> float:
    """The sorted ``xs`` at quantile ``q``: the ``ceil(q n)``-th least (the least at 0)."""
    return xs[min(len(xs), max(1, math.ceil(q * len(xs)))) - 1]


def widened(plan: Plan, band: Interval | None, point: float) -> Interval | None:
    """``band`` (the simulator's, around the step ``point``) widened to hold the share ``band.coverage`` of the steps
    earlier runs of this host key measured, as ratios to their points, at the plan's host load (the module
    docstring); ``band`` itself where fewer than :data:`MIN_RUNS` such runs are kept."""
    key = history_key(plan)
    if band is None or key is None or point <= 0:
        return band
    like = [r for r in _runs(key) if _like(r, _profile_load(plan))]
    if len(like) < MIN_RUNS:
        return band
    ratios = sorted(float(x) for r in like for x in r["ratios"])
    k, c = len(like), band.coverage
    hi = _at(ratios, min(1.0, math.ceil((k + 1) * (1 + c) / 2) / k))
    lo = _at(ratios, max(0.0, math.floor((k + 1) * (1 - c) / 2) / k))
    step = (min(band.step_time[0], point * lo), max(band.step_time[1], point * hi))
    return replace(band, step_time=step, runs=len(like))
