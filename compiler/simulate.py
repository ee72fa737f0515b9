"""Predicted Timelines: a plan's cost model, run through the event loop.

The event loop itself (both comm models, deadlock reports) lives in
:mod:`pipec.compiler.engine`; this module turns a plan into its costs and an
execution into the Timeline that views and report.json share.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

from pipec.compiler.engine import (
    BUFFERED,
    IN_ORDER,
    MODELS,
    CostModel,
    Deadlock,
    Execution,
    execute,
    group_members,
)
from pipec.compiler.ir import Op
from pipec.compiler.plan import UNIT_COST, Plan, chain_edges
from pipec.compiler.timeline import Timeline

__all__ = [
    "BUFFERED", "IN_ORDER", "MODELS", "CostModel", "Deadlock", "Execution",
    "execute", "simulate", "plan_costs", "emulated_costs", "simulate_costs", "timeline_of", "chain_edges",
    "group_members",
]


def plan_costs(plan: Plan) -> CostModel:
    """The cost model of a plan: its stages' costs, its links, its edges' bytes.

    A plan whose costs are units (a schedule-only plan, or a model plan with
    ``costs unit``: F=1, B=2, I=W=1) has free communication and no host
    overhead, so the schedule table's formulas hold exactly and every time it
    predicts is in units. A plan in seconds is charged its ``overhead`` (the
    executor's host time per instruction kind) when it has one.
    """
    num_stages = plan.num_stages
    unit = plan.unit_costs
    transfer: dict[tuple[int, int], float] = {}
    allreduce: dict[tuple[str, int], float] = {}
    shard: dict[tuple[str, int], float] = {}
    if not unit:
        pp = plan.links["pp"]
        for e in plan.edges:
            transfer[(e.src_stage, e.dst_stage)] = pp.latency_s + e.num_bytes / pp.bandwidth_Bps
        dp = plan.links.get("dp", pp)
        d = plan.mesh.dp
        for st in plan.stages:
            if d > 1 and st.param_bytes:
                allreduce[("dp", st.stage)] = dp.latency_s + 2 * (d - 1) / d * st.param_bytes / dp.bandwidth_Bps
        shard = _shard_costs(plan, allreduce)
        tl = plan.links.get("tie", pp)
        for tie in plan.ties:
            n = len(tie.ranks(plan.placement))
            cost = tl.latency_s + 2 * (n - 1) / n * (tie.num_bytes or 0) / tl.bandwidth_Bps if n > 1 else 0.0
            for s in tie.stages:
                allreduce[(f"tie.{tie.name}", s)] = cost
    act = tuple(st.activation_bytes or 0 for st in plan.stages) if plan.stages and all(
        st.activation_bytes is not None for st in plan.stages) else ()
    return CostModel(
        stages=tuple(st.cost for st in plan.stages) or (UNIT_COST,) * num_stages,
        transfer=transfer,
        allreduce=allreduce,
        shard=shard,
        activation_bytes=act,
        overhead={} if unit or plan.overhead is None else dict(plan.overhead.seconds),
        time_unit="unit" if unit else "s",
    )


def emulated_costs(plan: Plan, *, seconds_per_unit: float, latency_s: float, collective_s: float,
                   overhead: Mapping[str, float], oversleep_s: float = 0.0) -> CostModel:
    """What ``pipec run --emulate`` pays, in seconds: each compute sleeps its cost x ``seconds_per_unit``
    (plus the ``oversleep_s`` a sleep takes beyond what it asks), every message is a placeholder of one
    element per tensor (``latency_s``), every all-reduce and shard collective a one-element all-reduce
    (``collective_s``), the optimizer step is empty, and each instruction costs the host ``overhead``."""
    base = plan_costs(plan)

    def scaled(c):
        return replace(c, **{k: (v * seconds_per_unit + oversleep_s if v > 0 else 0.0)
                             for k, v in (("fwd", c.fwd), ("bwd", c.bwd), ("bwd_i", c.bwd_i), ("bwd_w", c.bwd_w))},
                       optim=0.0)

    shard = {(op.value, st.stage): collective_s for st in plan.stages for op in (Op.UNSHARD, Op.REDUCE_SCATTER)} \
        if plan.mesh.params_sharded else {}
    allreduce = {key: collective_s for key in base.allreduce}
    if plan.mesh.dp > 1:
        for st in plan.stages:
            allreduce[("dp", st.stage)] = collective_s
    return CostModel(
        stages=tuple(scaled(c) for c in base.stages),
        transfer={(e.src_stage, e.dst_stage): latency_s for e in plan.edges},
        allreduce=allreduce,
        shard=shard,
        activation_bytes=base.activation_bytes,
        overhead=dict(overhead),
        time_unit="s",
    )


def _shard_costs(plan: Plan, allreduce: dict[tuple[str, int], float]) -> dict[tuple[str, int], float]:
    """Sharding's collectives as rings on the dp link, ``(n - 1) / n x bytes / bandwidth + latency`` over
    a shard group of n: an ``UNSHARD``'s all-gather and a ``REDUCE_SCATTER`` of the stage's padded
    parameters (in the compute dtype, as FSDP2's mixed precision moves them), ``OPT``'s gather of the
    updated parameters (``shard optimizer``, float32); HSDP's replicate all-reduce of the shards over the
    dp / n groups goes into ``allreduce``."""
    from pipec.compiler.memory import COMPUTE_BYTES, padded_params

    mesh = plan.mesh
    n = mesh.num_shards
    out: dict[tuple[str, int], float] = {}
    if not mesh.sharded or n < 2 and not mesh.hybrid:
        return out
    link = plan.links.get("shard", plan.links.get("dp", plan.links["pp"]))
    elem = COMPUTE_BYTES.get(str(plan.spec.get("dtype", "float32")), 4) if mesh.params_sharded else 4
    for st in plan.stages:
        padded = padded_params(st, n)
        ring = link.latency_s + (n - 1) / n * padded * elem / link.bandwidth_Bps if n > 1 else 0.0
        if mesh.shard == "optimizer":
            out[("OPTIM_STEP", st.stage)] = ring
            continue
        out[(Op.UNSHARD.value, st.stage)] = out[(Op.REDUCE_SCATTER.value, st.stage)] = ring
        k = mesh.dp // n
        if mesh.hybrid:
            allreduce[("dp.replicate", st.stage)] = link.latency_s + 2 * (k - 1) / k * padded // n * elem \
                / link.bandwidth_Bps
        allreduce.pop(("dp", st.stage), None)
    return out


def timeline_of(ex: Execution, costs: CostModel, static_bytes: Sequence[int] | None = None,
                state_bytes: Sequence[int] | None = None) -> Timeline:
    """The Timeline of an execution; ``static_bytes`` adds params/grads/optimizer state (and the
    unsharded peak) per rank to the peak activations; ``state_bytes``: the state at rest per rank."""
    num_ranks = len(ex.compute)
    mem = None
    if costs.activation_bytes and static_bytes is not None:
        mem = {r: static_bytes[r] + ex.peak_activation_bytes[r] for r in range(num_ranks)}
    return Timeline.build(
        step_time=ex.step_time,
        busy={r: (ex.compute[r], ex.comm_wait[r]) for r in range(num_ranks)},
        events=ex.events,
        peak_activations=dict(enumerate(ex.peak_activations)),
        peak_memory_bytes=mem,
        state_bytes=None if state_bytes is None else dict(enumerate(state_bytes)),
        time_unit=costs.time_unit,
    )


def simulate(plan: Plan, model: str = BUFFERED) -> Timeline:
    """The predicted Timeline of a plan under a comm model."""
    return simulate_costs(plan, plan_costs(plan), model)


def simulate_costs(plan: Plan, costs: CostModel, model: str = BUFFERED) -> Timeline:
    """The Timeline of a plan's program under other costs (a run's measured ones, :func:`emulated_costs`)."""
    ex = execute(plan.program, placement=plan.placement, num_microbatches=plan.num_microbatches,
                 edges=plan.edges, costs=costs, model=model, ties=plan.ties)
    return timeline_of(ex, costs)

