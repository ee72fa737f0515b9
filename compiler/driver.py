"""The driver: one linear pass pipeline from a compile request to a verified plan.

Each line of :func:`_compile` is one named pass; nothing else in pipec
sequences them, and nothing else checks a named schedule's rules or builds a
compute order (:func:`schedule_order`). A complaint about a key raises a
:class:`~pipec.errors.PipecError` with ``key=`` and comes back as a
:class:`~pipec.errors.Diagnostic` when it is a warning or a note; the
language's boundary (:func:`compile_spec`) locates both once. A
schedule-only compile imports neither torch nor networkx (networkx is loaded
only to report a deadlock cycle; torch only when a model is traced).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Sequence

import pipec
from pipec.compiler.config import DEFAULTS, TrainingConfig
from pipec.compiler.ir.program import Program
from pipec.compiler.passes.lower import lower
from pipec.compiler.passes.memory import breakdown, check_memory
from pipec.compiler.ir.plan import (DEFAULT_LINKS, Link, Mesh, Plan, Stage, check_limits, check_nodes, check_shard,
                                    check_tp, tp_notes)
from pipec.compiler.request import CompileRequest
from pipec.compiler.sim.simulate import (BUFFERED, CostModel, Execution, chain_edges, execute, interval_of, plan_costs,
                                         timeline_of)
from pipec.compiler.passes.verify import verify
from pipec.errors import Diagnostic, PipecError
from pipec.schedules import check_rules, get_schedule, loop_placement, v_placement
from pipec.schedules.order import ComputeOrder, ScheduleError, gc_paused, validate_order
from pipec.schedules.policy import policy_order

__all__ = ["Compiled", "compile_request", "compile_plan", "compile_spec", "schedule_order", "prove_and_predict",
           "with_timeline", "bare_plan"]

BUBBLE_WARNING = 0.5
"""A predicted bubble above this fraction gets a warning."""


@dataclass(frozen=True, slots=True)
class Compiled:
    plan: Plan
    diagnostics: tuple[Any, ...] = ()
    """Warnings and notes, in the order the passes made them: :class:`~pipec.errors.Diagnostic`
    from the driver, located ones (``str()`` renders them) from :func:`compile_spec`."""


def compile_request(req: CompileRequest, *, graph=None, verify: bool = True, events: bool = True) -> Compiled:
    """Compile a request into a verified, predicted plan (see the module docstring). ``graph``: the
    model's :class:`~pipec.compiler.ir.graph.StageGraph` when the caller already built it for this request
    (``pipec tune`` cuts one trace many times); None: the front end builds it. ``verify=False``: the
    plan is predicted but not proven; ``events=False``: its timeline has no events (``pipec tune``
    proves only the plans it keeps and predicts their events then, with :func:`prove_and_predict`); the
    rest of the prediction is the same."""
    with gc_paused():  # hundreds of thousands of acyclic objects: collections would only rescan them
        return _compile(req, graph, verify, events)


def _compile(req: CompileRequest, graph=None, verify: bool = True, events: bool = True) -> Compiled:
    check_limits(pp=req.pp, num_stages=req.num_stages, num_microbatches=req.num_microbatches)  # too big
    mesh = req.mesh
    check_tp(mesh)                                               # tp's range; its groups inside nodes (or whole)
    check_shard(mesh)                                            # a sharding that can work
    check_nodes(mesh)                                            # whole nodes
    order, diagnostics = schedule_order(req)                     # the schedule's rules, then its order
    diagnostics += [Diagnostic("warning", note, key="tp") for note in tp_notes(mesh)]  # tp across nodes
    if graph is None and req.model:                              # trace, partition, costs; what fits checked
        graph = model_graph(req, before_timing=lambda g: check_untimed(req, order, g))  # before any timing
    if graph is not None:
        check_stage_count(graph, order)
        diagnostics += [Diagnostic("note", note, key="trace") for note in graph.notes]
        diagnostics += [Diagnostic("note", note, key="partition") for note in graph.cut_notes]
        diagnostics += [Diagnostic("warning", w, key="tensor_parallel") for w in graph.warnings]
    plan = bare_plan(req, graph, order.placement)                # everything but the program and prediction
    if graph is not None and req.model.costs == "profile" and req.origin("links").kind == "default":
        from pipec.costs.links import measure_links  # a job of two local ranks (torch)

        plan, notes = measure_links(plan)                        # links and host overhead, measured here
        diagnostics += [Diagnostic("note", note, key="links") for note in notes]
    costs = plan_costs(plan)                                     # unit, or the front end's costs
    program = lower(order, edges=plan.edges, costs=costs, mesh=mesh, ties=plan.ties)  # comm and collectives
    check_limits(pp=req.pp, num_stages=plan.num_stages, num_microbatches=req.num_microbatches,
                 instructions=program.num_instructions)
    plan = prove_and_predict(replace(plan, program=program), prove=verify, events=events, costs=costs)  # then predict
    if plan.prediction.bubble_fraction > BUBBLE_WARNING:
        diagnostics.append(Diagnostic(
            "warning", f"the predicted bubble is {plan.prediction.bubble_fraction:.0%} of the step; more "
            "microbatches or another schedule would waste less", key="microbatches"))
    if req.device_memory is not None:                            # refuse what does not fit
        check_memory(plan, req.device_memory)
    return Compiled(plan, tuple(diagnostics))


def check_stage_count(graph, order: ComputeOrder) -> None:
    """The model's stages against the schedule's."""
    if len(graph.stages) != order.num_stages:
        raise PipecError(f"the model was partitioned into {len(graph.stages)} stages but the schedule runs "
                         f"{order.num_stages}", key="partition")


def check_untimed(req: CompileRequest, order: ComputeOrder, graph) -> None:
    """The checks of a model plan that need no timing, run on its stage graph before the stages or links are
    timed (``graph``'s costs are unit): its stage count, and with ``device_memory`` every rank's peak memory.
    The peak is a function of byte counts and of each rank's instruction order, which the costs do not change
    (only where comm posts sit), so the plan lowered and simulated at unit costs holds what the timed one will."""
    check_stage_count(graph, order)
    if req.device_memory is None:
        return
    plan = bare_plan(req, graph, order.placement)
    costs = plan_costs(plan)
    program = lower(order, edges=plan.edges, costs=costs, mesh=req.mesh, ties=plan.ties)
    check_memory(prove_and_predict(replace(plan, program=program), prove=False, events=False, costs=costs),
                 req.device_memory)


def bare_plan(req: CompileRequest, graph, placement: tuple[int, ...]) -> Plan:
    """The request's plan but its program and prediction: mesh, stages placed, edges, ties, links and the
    resolved spec (``pipec tune`` prices its bounds on it with :func:`~pipec.compiler.sim.simulate.plan_costs`)."""
    if graph is not None and "init" in graph.model:  # the front end resolved `init auto`
        req = replace(req, training=replace(req.training, init=graph.model["init"]))
    return Plan(
        mesh=req.mesh,
        num_stages=len(placement),
        num_microbatches=req.num_microbatches,
        placement=placement,
        program=Program(()),
        stages=_placed(graph.stages, placement) if graph else tuple(
            Stage(stage=s, rank=r) for s, r in enumerate(placement)),
        edges=graph.edges if graph else chain_edges(len(placement)),
        ties=graph.ties if graph else (),
        links=dict(req.links),
        spec=req.spec_json(),
        model=_model_entry(graph, req) if graph else None,
        pipec_version=pipec.__version__,
    )


def schedule_order(req: CompileRequest) -> tuple[ComputeOrder, list[Diagnostic]]:
    """The request's compute order and its schedule's warnings.

    The one place a named schedule's rules are checked and an order is built:
    a named schedule's by its family, a policy's by :func:`policy_order`, an
    explicit one from its actions (its invariants checked once).
    """
    P, M, v = req.pp, req.num_microbatches, req.num_chunks
    if req.schedule == "order":
        order = ComputeOrder(num_ranks=P, num_microbatches=M, placement=req.placement, ranks=req.order)
        validate_order(order)
        return order, []
    if req.schedule == "policy":
        return policy_order(req.policy, num_ranks=P, num_microbatches=M, num_chunks=v), []
    info = get_schedule(req.schedule)
    warnings: list[Diagnostic] = list(check_rules(info.name, num_ranks=P, num_microbatches=M, num_chunks=v))
    order = _named_order(info.name, P, M, v)
    if req.placement is not None and req.placement != order.placement:
        raise ScheduleError(f"{info.name} needs placement {info.placement}, got {_placement_text(req.placement, P)}",
                            rule=f"{info.name}.placement", key="placement",
                            hints=(f"use placement {info.placement}, or an explicit order for another placement",))
    return order, warnings


@lru_cache(maxsize=64)
def _named_order(name: str, num_ranks: int, num_microbatches: int, num_chunks: int) -> ComputeOrder:
    """A named schedule's compute order, cached: a generator is a pure function of these integers and an
    order is immutable (``pipec tune`` compiles hundreds of candidates on a few dozen orders)."""
    return get_schedule(name).build(num_ranks=num_ranks, num_microbatches=num_microbatches, num_chunks=num_chunks)


def _placement_text(placement: tuple[int, ...], num_ranks: int) -> str:
    if placement == loop_placement(num_ranks, len(placement)):
        return "loop"
    if len(placement) == 2 * num_ranks and placement == v_placement(num_ranks, len(placement)):
        return "v"
    return ", ".join(map(str, placement))


def compile_plan(
    *,
    num_ranks: int,
    num_microbatches: int,
    schedule: str | None = None,
    num_chunks: int | None = None,
    dp: int = 1,
    tp: int = 1,
    shard: str = "none",
    shard_size: int | None = None,
    order: ComputeOrder | None = None,
    links: dict[str, Link] | None = None,
    training: TrainingConfig = DEFAULTS,
    device_memory: int | None = None,
) -> Compiled:
    """Compile a schedule-only plan: a named schedule, or a custom compute order (an imported one)."""
    if order is not None:
        choice = dict(schedule="order", order=order.ranks, placement=order.placement,
                      num_chunks=max(1, order.num_stages // max(1, num_ranks)))
    else:
        choice = dict(schedule=schedule, num_chunks=get_schedule(schedule).default_chunks if num_chunks is None
                      else num_chunks)
    return compile_request(CompileRequest(**choice, mesh=Mesh(pp=num_ranks, dp=dp, tp=tp, shard=shard,
                                                                               shard_size=shard_size),
                                          num_microbatches=num_microbatches, links=dict(links or DEFAULT_LINKS),
                                          training=training, device_memory=device_memory))


def compile_spec(spec, *, trace: bool = True) -> Compiled:
    """Compile the language's resolved spec, every complaint about a key located once.

    ``spec`` is a :class:`pipec.dsl.Spec` (the compiler does not import the
    language): ``spec.request`` is its :class:`CompileRequest`, and
    ``spec.locate`` turns an error or diagnostic about a key into one that
    prints ``file:line:col`` and a caret. The diagnostics are the language's
    own warnings, then the passes'. ``trace=False`` compiles the schedule
    alone (unit costs), without the model.
    """
    req = spec.request if trace else replace(spec.request, model=None)
    try:
        compiled = compile_request(req)
    except PipecError as err:
        raise spec.locate(err) from None
    return replace(compiled, diagnostics=(*spec.warnings, *(spec.locate(d) for d in compiled.diagnostics)))


def prove_and_predict(plan: Plan, *, prove: bool = True, events: bool = True, costs: CostModel | None = None) -> Plan:
    """Verify a plan (all four proofs, both comm models) and attach its predicted timeline; ``prove=False``:
    only the timeline (the buffered execution the proof would have made), without its events and its interval
    when ``events=False`` (the rest of it the same). ``costs``: the plan's (:func:`plan_costs`), when the caller
    has them."""
    costs = costs or plan_costs(plan)
    if prove:
        with gc_paused():
            ex = verify(plan).executions[BUFFERED]
    else:
        ex = execute(plan.program, placement=plan.placement, num_microbatches=plan.num_microbatches,
                     edges=plan.edges, costs=costs, model=BUFFERED, ties=plan.ties, record_events=events)
    return with_timeline(plan, ex, costs, interval=events)


def with_timeline(plan: Plan, ex: Execution, costs: CostModel | None = None, *, interval: bool = True) -> Plan:
    """The plan with the predicted timeline of ``ex``, a buffered execution of its program (``costs``: the
    plan's, :func:`~pipec.compiler.sim.simulate.plan_costs`, when the caller has them), and, where the costs
    carry a measured spread and ``interval`` is set, the range its steps are expected in
    (:func:`~pipec.compiler.sim.simulate.interval_of`); ``pipec tune`` gives a kept plan the timeline of its
    proof's execution, events and all."""
    costs = costs or plan_costs(plan)
    rows = breakdown(plan)
    state = None if rows is None else [m.state for m in rows]
    static = None if rows is None else [m.state + m.transient for m in rows]
    timeline = timeline_of(ex, costs, static, state)
    band = interval_of(plan, costs, point=timeline.step_time) if interval else None
    return replace(plan, prediction=timeline if band is None else replace(timeline, interval=band))


def _placed(stages: Sequence[Stage], placement: Sequence[int]) -> tuple[Stage, ...]:
    return tuple(replace(st, rank=placement[st.stage]) for st in stages)


# ----------------------------------------------------------------------------- the model


def model_graph(req: CompileRequest, *, before_timing=None):
    """Run the model front end (trace, partition, costs) for a request that names a model: it reads the
    request as it is, and times stages as a run of it on this machine runs them
    (:meth:`~pipec.compiler.frontend.Host.of`); ``before_timing`` as
    :func:`~pipec.compiler.frontend.cut_stage_graph` calls it."""
    from pipec.compiler.frontend import Host, build_stage_graph

    return build_stage_graph(req, host=Host.of(req.mesh), before_timing=before_timing)


def _model_entry(graph, req: CompileRequest) -> dict[str, Any]:
    """plan.json's ``model``: the front end's record (its notes too), with one replica's step FLOPs."""
    flops = sum(sum(f) for f in graph.flops) * req.num_microbatches  # forward + backward, one replica's step
    return {**graph.model, "flops_per_step": flops}
