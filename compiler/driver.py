"""The driver: one linear pass pipeline from resolved keys to a verified plan.

Each line of :func:`compile_plan` is one named pass; nothing else in pipec
sequences them. A schedule-only compile imports neither torch nor networkx
(networkx is loaded only to report a deadlock cycle; torch only when a model
is traced).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import pipec
from pipec.compiler.ir import Program
from pipec.compiler.lower import lower
from pipec.compiler.plan import DEFAULT_LINKS, Edge, Link, Mesh, Plan, Stage, Tie, check_limits
from pipec.compiler.simulate import BUFFERED, chain_edges, plan_costs, timeline_of
from pipec.compiler.verify import verify
from pipec.schedules import build_order, check_rules
from pipec.schedules.order import ComputeOrder, ScheduleError, gc_paused, validate_order

__all__ = ["Compiled", "StageGraphParts", "compile_plan", "prove_and_predict"]

BUBBLE_WARNING = 0.5
"""A predicted bubble above this fraction gets a warning."""


@dataclass(frozen=True, slots=True)
class Compiled:
    plan: Plan
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class StageGraphParts:
    """What the model front end contributes to a plan."""

    model: Mapping[str, Any]
    stages: tuple[Stage, ...]
    edges: tuple[Edge, ...]
    ties: tuple[Tie, ...] = ()
    static_bytes: tuple[int, ...] | None = None
    """Per pp rank: params, grads and optimizer state."""


def compile_plan(
    *,
    num_ranks: int,
    num_microbatches: int,
    schedule: str | None = None,
    num_chunks: int | None = None,
    dp: int = 1,
    order: ComputeOrder | None = None,
    graph: StageGraphParts | None = None,
    links: Mapping[str, Link] | None = None,
    spec: Mapping[str, Any] | None = None,
    device_memory: int | None = None,
) -> Compiled:
    """Compile a schedule (by name, or a custom compute order) into a verified plan."""
    with gc_paused():  # hundreds of thousands of acyclic objects: collections would only rescan them
        return _compile(num_ranks=num_ranks, num_microbatches=num_microbatches, schedule=schedule,
                        num_chunks=num_chunks, dp=dp, order=order, graph=graph, links=links, spec=spec,
                        device_memory=device_memory)


def _compile(*, num_ranks, num_microbatches, schedule, num_chunks, dp, order, graph, links, spec,
             device_memory) -> Compiled:
    num_stages = (order.num_stages if order is not None else num_ranks * (num_chunks or 1))
    check_limits(pp=num_ranks, num_stages=num_stages, num_microbatches=num_microbatches)  # refuse what is too big
    warnings: list[str] = []
    if order is None:                                            # the named schedule's rules, then its order
        warnings += check_rules(schedule, num_ranks=num_ranks, num_microbatches=num_microbatches, num_chunks=num_chunks)
        order = build_order(schedule, num_ranks=num_ranks, num_microbatches=num_microbatches, num_chunks=num_chunks)
    else:
        validate_order(order)                                     # a custom order must hold the invariants
    if order.num_ranks != num_ranks or order.num_microbatches != num_microbatches:
        raise ScheduleError(
            f"the order is for {order.num_ranks} ranks and {order.num_microbatches} microbatches, but "
            f"{num_ranks} ranks and {num_microbatches} microbatches were asked for", rule="order.shape")
    if graph is not None and len(graph.stages) != order.num_stages:
        raise ScheduleError(f"the model was partitioned into {len(graph.stages)} stages but the schedule runs "
                            f"{order.num_stages}", rule="order.stages")
    stages = _placed(graph.stages, order.placement) if graph else tuple(
        Stage(stage=s, rank=r) for s, r in enumerate(order.placement))
    plan = Plan(                                                 # everything but the program and prediction
        mesh=Mesh(pp=num_ranks, dp=dp),
        num_stages=order.num_stages,
        num_microbatches=num_microbatches,
        placement=order.placement,
        program=Program(()),
        stages=stages,
        edges=graph.edges if graph else chain_edges(order.num_stages),
        ties=graph.ties if graph else (),
        links=dict(links or DEFAULT_LINKS),
        spec=dict(spec or {}),
        model=graph.model if graph else None,
        pipec_version=pipec.__version__,
    )
    costs = plan_costs(plan)                                     # unit, or the front end's costs
    program = lower(order, edges=plan.edges, costs=costs, dp=dp, ties=plan.ties)  # comm and collectives
    check_limits(pp=num_ranks, num_stages=plan.num_stages, num_microbatches=num_microbatches,
                 instructions=program.num_instructions)
    plan = prove_and_predict(replace(plan, program=program), graph.static_bytes if graph else None)
    if plan.prediction.bubble_fraction > BUBBLE_WARNING:
        warnings.append(f"the predicted bubble is {plan.prediction.bubble_fraction:.0%} of the step; more "
                        "microbatches or another schedule would waste less")
    if device_memory is not None:                                # refuse what does not fit
        _check_memory(plan.prediction.per_rank, device_memory)
    return Compiled(plan, tuple(warnings))


def prove_and_predict(plan: Plan, static_bytes: Sequence[int] | None = None) -> Plan:
    """Verify a plan (all four proofs, both comm models) and attach its predicted timeline."""
    with gc_paused():
        proof = verify(plan)
    return replace(plan, prediction=timeline_of(proof.executions[BUFFERED], plan_costs(plan), static_bytes))


def _placed(stages: Sequence[Stage], placement: Sequence[int]) -> tuple[Stage, ...]:
    return tuple(replace(st, rank=placement[st.stage]) for st in stages)


class MemoryError_(ValueError):
    """The predicted memory of a rank exceeds the device memory."""


def _check_memory(per_rank, device_memory: int) -> None:
    for rt in per_rank:
        if rt.peak_memory_bytes is not None and rt.peak_memory_bytes > device_memory:
            raise MemoryError_(
                f"pp rank {rt.rank} needs {rt.peak_memory_bytes / 2**30:.2f} GiB at its peak "
                f"({rt.peak_activations} microbatches of activations in flight) but device_memory is "
                f"{device_memory / 2**30:.2f} GiB; use more pp ranks, recompute, fewer microbatches in flight "
                "(1f1b instead of gpipe), or a smaller model")
