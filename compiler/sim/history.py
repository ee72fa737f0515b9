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
import statistics
from dataclasses import replace
from typing import Any, Mapping, Sequence

from pipec.costs import cache
from pipec.compiler.ir.plan import Plan
from pipec.compiler.ir.timeline import Interval

__all__ = ["history_key", "record", "widened", "profiled_under_load", "load_warning", "MIN_RUNS", "KEEP_RUNS",
           "KEEP_STEPS", "LOAD_MATCH"]

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


def _quiet_runs_ratio(runs: Sequence[Mapping[str, Any]], load: float) -> float | None:
    """Of the kept runs run on a quiet host (run load within :data:`LOAD_MATCH` of 0), the least median step
    over its point among those profiled at ``load``, over the median of those profiled quiet (1 where none was):
    how much faster than predicted a plan profiled at ``load`` ran quiet. None where no such run is kept."""
    def median_of(run_load: float) -> list[float]:
        return [statistics.median(float(x) for x in r["ratios"]) for r in runs
                if r.get("load") is not None and abs(float(r["load"]) - run_load) <= LOAD_MATCH
                and r.get("run_load") is not None and float(r["run_load"]) <= LOAD_MATCH]
    loaded, quiet = median_of(load), median_of(0.0)
    if not loaded:
        return None
    return min(loaded) / (statistics.median(quiet) if quiet else 1.0)


def profiled_under_load(plan: Plan) -> str | None:
    """``profiled under load 2.3 (3 of 4 stages): predictions may be slow by up to 40% ...``: a plan whose profile
    marked timings as taken under load (:mod:`pipec.costs.load`), with how much slower than a quiet host its
    prediction may be: from this host's kept runs at both loads (:func:`_quiet_runs_ratio`), else the contention
    model's (:func:`~pipec.compiler.sim.contention.load_factor`); None for any other plan."""
    from pipec.compiler.sim.contention import load_factor

    profile = (plan.model or {}).get("profile") or {}
    stages = profile.get("stages") or []
    marked = [s for s in stages if s.get("loaded")]
    crowd = (profile.get("crowd") or {}).get("loaded", False)
    if not marked and not crowd:
        return None
    loads = [float(s["load"]) for s in marked] + ([float(profile["crowd"]["load"])] if crowd else [])
    load = float(profile.get("host_load", max(loads)))
    key = history_key(plan)
    ratio = _quiet_runs_ratio(_runs(key), load) if key is not None else None
    if ratio is not None:
        source = "as this host's runs at both loads measured"
    else:
        factor = load_factor({**profile, "host_load": load}, 0.0)
        ratio, source = (factor, "the contention model's figure, no quiet run kept yet") if factor else (None, "")
    what = f"{len(marked)} of {len(stages)} stages" + (" and the crowd" if crowd else "") if marked else "the crowd"
    slow = f": predictions may be slow by up to {max(0.0, 1 - ratio):.0%} ({source})" if ratio is not None else ""
    return (f"profiled under load {load:g} ({what}){slow}; a compile on a quieter host times them again by "
            "itself, or use --reprofile")


def load_warning(steps: Sequence[float], band: tuple[float, float] | None, point: float,
                 host_load: Mapping[str, Any] | None) -> str | None:
    """The run's load warning, from the steps it measured (those held to the interval ``band``, after the first):
    None where the median step is inside the interval or no more than half the steps are outside; else which way
    the step moved and by how much, measured, and whether the host's load (``host_load``: the profile's and the
    run's, read before the first step) moved with it."""
    if band is None or not steps or point <= 0:
        return None
    lo, hi = band
    med = statistics.median(steps)
    outside = sum(1 for s in steps if not lo <= s <= hi)
    if lo <= med <= hi or 2 * outside <= len(steps):
        return None
    slower = med > hi
    text = (f"the steps ran {'slower' if slower else 'faster'} than predicted: median {med:.3f} s, "
            f"{med / point:.2f}x the predicted {point:.3f} s; {outside} of {len(steps)} steps "
            f"{'above' if slower else 'below'} the interval {lo:.3f}-{hi:.3f} s")
    prof = (host_load or {}).get("profile")
    run = (host_load or {}).get("run")
    if prof is None or run is None:
        return text + "; recompile with --reprofile to time the stages again"
    prof, run = float(prof), float(run)
    if abs(run - prof) <= LOAD_MATCH:
        return (text + f"; the host's load ({run:g}) is the one the plan was profiled at ({prof:g}): not the load's "
                "doing; recompile with --reprofile to time the stages again")
    with_it = (run > prof) == slower
    factor = (host_load or {}).get("factor")
    expected = f", which the contention model puts at {factor:.2f}x" if isinstance(factor, (int, float)) else ""
    return (text + f"; the host's load is {run:g}, {prof:g} when the plan was profiled"
            + (f": the load moved the way the step did{expected}; recompile where the run's load is the profile's"
               if with_it else ": the load moved the other way, so it is not the cause; recompile with --reprofile"))
