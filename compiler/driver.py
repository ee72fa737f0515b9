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

__all__ = ["Compiled", "StageGraphParts", "compile_plan", "compile_spec", "prove_and_predict", "state_bytes",
           "MemoryBudgetError"]

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
    plan = prove_and_predict(replace(plan, program=program))
    if plan.prediction.bubble_fraction > BUBBLE_WARNING:
        warnings.append(f"the predicted bubble is {plan.prediction.bubble_fraction:.0%} of the step; more "
                        "microbatches or another schedule would waste less")
    if device_memory is not None:                                # refuse what does not fit
        _check_memory(plan, device_memory)
    return Compiled(plan, tuple(warnings))


def prove_and_predict(plan: Plan) -> Plan:
    """Verify a plan (all four proofs, both comm models) and attach its predicted timeline."""
    with gc_paused():
        proof = verify(plan)
    return replace(plan, prediction=timeline_of(proof.executions[BUFFERED], plan_costs(plan), state_bytes(plan)))


BYTES_PER_PARAM = 16
"""Mixed-precision Adam: fp16 weights and grads, fp32 master weights, momentum and variance."""


def state_bytes(plan: Plan) -> list[int] | None:
    """Per pp rank: params, grads and optimizer state of every parameter copy it holds; None if unknown."""
    if not plan.stages or any(st.num_params is None for st in plan.stages):
        return None
    out = [0] * plan.mesh.pp
    for st in plan.stages:
        out[st.rank] += BYTES_PER_PARAM * st.num_params
    return out


def _placed(stages: Sequence[Stage], placement: Sequence[int]) -> tuple[Stage, ...]:
    return tuple(replace(st, rank=placement[st.stage]) for st in stages)


class MemoryBudgetError(ValueError):
    """The predicted memory of a rank exceeds the device memory."""


def _check_memory(plan: Plan, device_memory: int) -> None:
    state = state_bytes(plan)
    for rt in plan.prediction.per_rank:
        if rt.peak_memory_bytes is not None and rt.peak_memory_bytes > device_memory:
            params = sum(st.num_params for st in plan.stages if st.rank == rt.rank)
            raise MemoryBudgetError(
                f"pp rank {rt.rank} needs {_gib(rt.peak_memory_bytes)} at its peak but device_memory is "
                f"{_gib(device_memory)}: parameters, gradients and optimizer state {_gib(state[rt.rank])} "
                f"({params:,} parameters x {BYTES_PER_PARAM} bytes) + activations "
                f"{_gib(rt.peak_memory_bytes - state[rt.rank])} ({rt.peak_activations} stage-microbatches in flight "
                "at the peak); use more pp ranks, recompute, a schedule with fewer microbatches in flight, or a "
                "larger device_memory")


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


# ----------------------------------------------------------------------------- from a schedule file


def compile_spec(spec) -> Compiled:
    """Compile a resolved :class:`pipec.dsl.Spec` (a schedule file plus flags) into a verified plan."""
    order = spec.compute_order()                                 # a policy or explicit order, or None
    graph = model_graph(spec) if spec["model"] else None         # trace, partition, costs (model plans)
    links = {axis: Link(latency_s=v["latency_s"], bandwidth_Bps=v["bandwidth_Bps"])
             for axis, v in spec.to_json()["links"].items()}
    compiled = compile_plan(
        num_ranks=spec["pp"],
        num_microbatches=spec["microbatches"],
        schedule=None if order is not None else spec["schedule"],
        num_chunks=spec["virtual"],
        dp=spec["dp"],
        order=order,
        graph=graph,
        links=links,
        spec=spec.to_json(),
        device_memory=spec["device_memory"],
    )
    return Compiled(compiled.plan, tuple(str(w) for w in spec.warnings) + compiled.warnings)


def model_graph(spec) -> StageGraphParts:
    """Run the model front end for a spec that names a model."""
    from pipec.compiler.frontend import Balanced, InputSpec, Markers, ModelRequest, SplitBefore, build_stage_graph

    part = spec["partition"]
    partition = {"split": lambda: SplitBefore(tuple(part.split_before)), "balanced": lambda: Balanced(part.by),
                 "markers": lambda: Markers(), "auto": lambda: None}[part.method]()
    world = spec["pp"] * spec["dp"]
    req = ModelRequest(
        target=spec["model"],
        kwargs=dict(spec["model_args"] or {}),
        inputs=tuple(InputSpec(t.name, t.dtype, tuple(t.shape)) for t in spec["input"]),
        num_microbatches=spec["microbatches"],
        num_stages=spec["stages"],
        partition=partition,
        costs=spec["costs"],
        trace=spec["trace"],
        recompute=frozenset(spec["recompute"] or ()),
        dtype=spec["dtype"],
        peak_flops=spec["peak_flops"],
        threads_per_rank=1 if world > 1 else _threads(),
    )
    sg = build_stage_graph(req)
    flops = sum(sum(f) for f in sg.flops) * spec["microbatches"]  # forward + backward, one replica's step
    return StageGraphParts(model={**sg.model, "flops_per_step": flops}, stages=sg.stages, edges=sg.edges,
                           ties=sg.ties)


def _threads() -> int:
    import torch

    return torch.get_num_threads()
