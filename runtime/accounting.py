"""Bubble accounting: per-rank measurements -> the measured Timeline and report.json.

Every rank times each instruction (compute) and each wait (receives it
needs, send completions and collectives at the step's end); what is left of
the step is idle. The measured Timeline lists global ranks; the report puts
it beside the plan's prediction (DESIGN, "report.json").
"""

from __future__ import annotations

import statistics
from typing import Any, Mapping, Sequence

from pipec.compiler.ir.plan import Mesh, Plan
from pipec.compiler.ir.timeline import Interval, Timeline
from pipec.compiler.sim.metrics import plan_single_device_step, scaling_efficiency
from pipec.runtime.executor import RankStep

__all__ = ["measured_timeline", "median_step", "stragglers", "state_bytes_report", "interval_report", "scaling_report",
           "build_report", "STRAGGLER_FACTOR"]

STRAGGLER_FACTOR = 1.25
"""A rank whose compute exceeds the median rank's compute by this factor is a straggler."""


def measured_timeline(steps: Sequence[RankStep]) -> Timeline:
    """One step of every global rank as a Timeline (times from the step's common start)."""
    step_time = max(s.step_time for s in steps)
    events = sorted((e for s in steps for e in s.events), key=lambda e: (e.rank, e.start))
    mem = {s.global_rank: s.peak_memory_bytes for s in steps if s.peak_memory_bytes is not None}
    state = {s.global_rank: sum(s.state_bytes.values()) for s in steps if s.state_bytes is not None}
    acts = {s.global_rank: s.peak_activation_bytes for s in steps if s.peak_activation_bytes is not None}
    return Timeline.build(
        step_time=step_time,
        busy={s.global_rank: (s.compute, s.comm_wait) for s in steps},
        events=events,
        peak_memory_bytes=mem or None,
        state_bytes=state or None,
        peak_activation_bytes=acts or None,
    )


def median_step(per_step: Sequence[Sequence[RankStep]]) -> int:
    """Index of the step with the median step time, leaving out the first (warm-up) when there are more."""
    candidates = list(range(1, len(per_step))) if len(per_step) > 1 else [0]
    times = sorted(candidates, key=lambda i: max(s.step_time for s in per_step[i]))
    return times[(len(times) - 1) // 2]


def stragglers(timeline: Timeline, mesh: Mesh) -> list[dict[str, Any]]:
    """Ranks whose compute runs well past the median (by :data:`STRAGGLER_FACTOR`).

    Compute differs by stage, so a rank is compared with the median compute of
    the ranks holding the same pp position (its dp replicas) when dp > 1, else
    with the median over all ranks.
    """
    out = []
    by_pp: dict[int, list[float]] = {}
    for r in timeline.per_rank:
        by_pp.setdefault(mesh.coords(r.rank)[0], []).append(r.compute)
    overall = statistics.median(r.compute for r in timeline.per_rank)
    for r in timeline.per_rank:
        pp, dp = mesh.coords(r.rank)
        peers = by_pp[pp]
        ref = statistics.median(peers) if len(peers) > 1 else overall
        if ref > 0 and r.compute > STRAGGLER_FACTOR * ref:
            out.append({"rank": r.rank, "pp": pp, "dp": dp,
                        **({"tp": mesh.tp_rank(r.rank)} if mesh.tp > 1 else {}), "compute": r.compute,
                        "median_compute": ref, "ratio": r.compute / ref})
    return out


def state_bytes_report(plan: Plan, ranks: Sequence[RankStep]) -> list[dict[str, Any]]:
    """report.json's ``state_bytes``: per global rank, the parameters, grads and optimizer state it held after
    its last optimizer step (measured, and their sum) beside the plan's prediction for its pp rank."""
    predicted = {r.rank: r.state_bytes for r in plan.prediction.per_rank} if plan.prediction is not None else {}
    out = []
    for s in sorted(ranks, key=lambda s: s.global_rank):
        if s.state_bytes is None:
            continue
        entry: dict[str, Any] = {"rank": s.global_rank, "measured": sum(s.state_bytes.values())}
        pred = predicted.get(plan.mesh.coords(s.global_rank)[0])
        if pred is not None:
            entry["predicted"] = pred
        out.append({**entry, **{k: s.state_bytes[k] for k in ("params", "grads", "optimizer")}})
    return out


def interval_report(band: Interval, steps: Sequence[Mapping[str, Any]], measured: Timeline) -> dict[str, Any]:
    """report.json's ``interval``: the plan's, and how the run's steps fell in it: the median step (and its bubble),
    and how many steps were inside, of those after the first when there are more (the first warms up, as
    :func:`median_step` leaves it out)."""
    counted = steps[1:] if len(steps) > 1 else steps
    return {"coverage": band.coverage, "step_time": list(band.step_time),
            "bubble_fraction": list(band.bubble_fraction), "draws": band.draws,
            "median_inside": band.holds(measured.step_time),
            "bubble_inside": band.bubble_fraction[0] <= measured.bubble_fraction <= band.bubble_fraction[1],
            "steps_inside": sum(1 for e in counted if e["in_interval"]), "steps_counted": len(counted),
            "after_first": len(steps) > 1}


def scaling_report(step_time: float, num_devices: int, *, measured_single: float | None,
                   predicted_single: float | None) -> dict[str, Any] | None:
    """report.json's ``scaling_efficiency``: ``{"value": T_1 / (num_devices x step_time), "against"}``, T_1 the
    single device's step measured (``--baseline``) where there is one, ``"against": "measured"``, else predicted
    from the plan's costs (:func:`~pipec.compiler.sim.metrics.plan_single_device_step`), ``"predicted"``; None
    where neither is known (a plan in units)."""
    single, against = (measured_single, "measured") if measured_single is not None else (predicted_single, "predicted")
    value = scaling_efficiency(step_time, num_devices, single)
    return None if value is None else {"value": value, "against": against}


def build_report(
    plan: Plan,
    plan_path: str,
    per_step: Sequence[Sequence[RankStep]],
    *,
    tokens_per_step: int | None,
    flops_per_step: float | None,
    peak_flops: float | None,
    first_step: int = 0,
    check: Mapping[str, Any] | None = None,
    goodput: Mapping[str, Any] | None = None,
    predicted: Timeline | None = None,
    emulation: Mapping[str, Any] | None = None,
    host_load: Mapping[str, Any] | None = None,
    baseline: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """report.json; fields that do not apply are absent, never faked.

    ``predicted``: the plan's program re-simulated under what the run measured (``--emulate``: the link
    latency and the executor's overhead); report.json's ``predicted`` is then that, and the plan's own
    prediction is kept beside it as ``planned``. None: ``predicted`` is the plan's own, and where it has an
    interval, each step says whether it fell inside (``in_interval``) and ``interval`` sums it up
    (:func:`interval_report`). ``host_load``: the load the plan was profiled at and the run's (the trainer's
    ``check_load``). ``baseline``: one device's step measured (runtime/baseline.py), which the scaling
    efficiency is then against (:func:`scaling_report`)."""
    steps = []
    for i, ranks in enumerate(per_step):
        step_time = max(s.step_time for s in ranks)
        loss = next((s.loss for s in ranks if s.loss is not None), None)
        entry: dict[str, Any] = {"step": first_step + i + 1, "step_time": step_time}  # counted from 1, as printed
        if loss is not None:
            # each replica's last stage holds its replica's loss: the step's loss is their mean
            losses = [s.loss for s in ranks if s.loss is not None]
            entry["loss"] = sum(losses) / len(losses)
        if tokens_per_step:
            entry["tokens_per_s"] = tokens_per_step / step_time
        steps.append(entry)
    med = median_step(per_step)
    measured = measured_timeline(per_step[med])
    band = plan.prediction.interval if predicted is None and plan.prediction is not None else None
    if band is not None:
        for entry in steps:
            entry["in_interval"] = band.holds(entry["step_time"])
    report: dict[str, Any] = {
        "plan": plan_path,
        "mesh": {"pp": plan.mesh.pp, "dp": plan.mesh.dp, **({"tp": plan.mesh.tp} if plan.mesh.tp > 1 else {}),
                 **({"sequence_parallel": True} if plan.mesh.sequence_parallel else {}),
                 **({"shard": plan.mesh.shard, "shard_size": plan.mesh.num_shards} if plan.mesh.sharded else {})},
        "steps": steps,
        "median_step": first_step + med + 1,
        "measured": measured.to_json(),
    }
    planned = plan.prediction
    if predicted is None:
        predicted, planned = plan.prediction, None
    if predicted is not None:
        report["predicted"] = predicted.to_json()
    if planned is not None:
        report["planned"] = planned.to_json()
    if emulation is not None:
        report["emulation"] = dict(emulation)
    report["bubble_fraction"] = {"measured": measured.bubble_fraction}
    if predicted is not None:
        report["bubble_fraction"]["predicted"] = predicted.bubble_fraction
    if planned is not None:
        report["bubble_fraction"]["planned"] = planned.bubble_fraction
    if tokens_per_step:
        report["tokens_per_s"] = tokens_per_step / measured.step_time
    if flops_per_step and peak_flops:
        report["mfu"] = flops_per_step / measured.step_time / (peak_flops * plan.mesh.world_size)
    if baseline is not None:
        report["baseline"] = dict(baseline)
    scaling = scaling_report(measured.step_time, plan.mesh.world_size, predicted_single=plan_single_device_step(plan),
                             measured_single=baseline["step_time_s"] if baseline is not None else None)
    if scaling is not None:
        report["scaling_efficiency"] = scaling
    if band is not None:
        report["interval"] = interval_report(band, steps, measured)
    if host_load is not None:
        report["host_load"] = dict(host_load)
    mems = [r.peak_memory_bytes for r in measured.per_rank if r.peak_memory_bytes is not None]
    if mems:
        report["peak_memory_bytes"] = max(mems)
    resident = [s.resident_bytes for s in per_step[med] if s.resident_bytes is not None]
    if resident:
        report["resident_bytes"] = max(resident)
    held = state_bytes_report(plan, per_step[-1])
    if held:
        report["state_bytes"] = held
    report["stragglers"] = stragglers(measured, plan.mesh)
    if check is not None:
        report["check"] = dict(check)
    if goodput is not None:
        report["goodput"] = dict(goodput)
    return report
