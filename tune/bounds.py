"""``pipec tune``'s bounds: lower bounds on a candidate's step and peak memory before it is lowered.

A candidate is bounded on its :class:`Frame`: the plan the driver would build but the program
(:func:`~pipec.compiler.driver.bare_plan`: stages placed, state sharded, links priced by
:func:`~pipec.compiler.sim.simulate.plan_costs`) and its compute order. Each bound follows what the
simulator's buffered model charges (:mod:`pipec.compiler.sim.engine`), so it holds for the predicted
step of any program the lowering makes from that order (tests/test_tune.py checks it for every
candidate of a small space); the search prunes on them (:mod:`.search`).

torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Sequence

from pipec.compiler.sim.cost import CostModel
from pipec.compiler.ir.program import Op
from pipec.compiler.passes.lower import PerOrder
from pipec.compiler.passes.memory import breakdown, tp_activation_bytes
from pipec.compiler.ir.plan import Mesh, Plan
from pipec.compiler.request import CompileRequest
from pipec.compiler.sim.simulate import plan_costs
from pipec.schedules import SCHEDULES
from pipec.schedules.order import ComputeOrder, Kind
from pipec.schedules.timing import Cost

if TYPE_CHECKING:
    from pipec.tune.space import Candidate

__all__ = ["Frame", "order_cache", "candidate_frame", "peak_activations", "memory_bound", "bounds", "step_bound", "uncrowded"]


@dataclass(frozen=True, slots=True)
class Frame:
    """What a candidate's bounds are computed on, before lowering: its plan but the program (stages
    placed, state sharded), the priced costs and its compute order."""

    plan: Plan
    costs: CostModel
    order: ComputeOrder
    priced: bool
    """Whether the comm costs are the ones the compile will use (not under measured links)."""


def order_cache() -> Callable[[Candidate], ComputeOrder]:
    """One compute order per (schedule, pp, microbatches, chunks): layouts, shards and cuts share it."""
    cache: dict[tuple, ComputeOrder] = {}

    def order(c: Candidate) -> ComputeOrder:
        key = (c.schedule, c.pp, c.num_microbatches, c.num_chunks)
        if key not in cache:
            cache[key] = SCHEDULES[c.schedule].build(num_ranks=c.pp, num_microbatches=c.num_microbatches,
                                                     num_chunks=c.num_chunks)
        return cache[key]
    return order


def candidate_frame(req: CompileRequest, graph, order: ComputeOrder) -> Frame:
    """The frame of a candidate's compile request, its model cut as ``graph`` (see :class:`Frame`)."""
    from pipec.compiler.driver import bare_plan

    plan = bare_plan(req, graph, order.placement)
    measured = req.model.costs == "profile" and req.origin("links").kind == "default"
    return Frame(plan, uncrowded(plan_costs(plan)), order, priced=not measured)


def uncrowded(costs: CostModel) -> CostModel:
    """The costs a bound may take under processor sharing (:mod:`pipec.compiler.sim.contention`): a compute runs
    at most at its rate alone, its cost over the slowdown the crowd measured, however few ranks compute with it."""
    sharing = costs.sharing
    if sharing is None:
        return costs
    f, b, i, w = (sharing.rate_cap(op) for op in ("FWD", "BWD", "BWD_I", "BWD_W"))
    stages = tuple(replace(c, fwd=c.fwd / f, bwd=c.bwd / b, bwd_i=c.bwd_i / i, bwd_w=c.bwd_w / w)
                   for c in costs.stages)
    return replace(costs, stages=stages, sharing=None)


def peak_activations(order: ComputeOrder, act: Sequence[int]) -> list[int]:
    """Per rank: the most activation bytes held at once, as the simulator counts them (a forward saves
    its stage's bytes per microbatch, a ``B`` or ``W`` frees them) in the rank's compute order."""
    out = []
    F, I = Kind.F, Kind.I  # locals: an enum member's attribute lookup costs more than the test
    for actions in order.ranks:
        held = peak = 0
        for a in actions:
            kind = a.kind
            if kind is F:
                held += act[a.stage]
                if held > peak:
                    peak = held
            elif kind is not I:
                held -= act[a.stage]
        out.append(peak)
    return out


def _peaks(order: ComputeOrder, act: tuple[int, ...]) -> list[int]:
    """:func:`peak_activations`, cached per (order, bytes per stage): the bisection on recompute asks for the same
    ones from every layout and shard mode."""
    got = _PEAKS.get(order, act)
    return _PEAKS.put(order, act, peak_activations(order, act)) if got is None else got


_PEAKS = PerOrder(1024)


def memory_bound(frame: Frame, stages) -> tuple[int, int]:
    """(peak, state) lower bounds of a plan with these stages (their activations): per rank its state
    at rest (padded shards, exact) plus its activations at their peak in its order (exact; a tp stage's on one
    tp rank, :func:`~pipec.compiler.passes.memory.tp_activation_bytes`); the
    gathered parameters of ``shard grads`` / ``full`` are left out. (0, 0) when activations are unknown
    (nothing is checked against the budget then)."""
    if any(st.activation_bytes is None for st in stages):
        return 0, 0
    state = [m.state for m in breakdown(frame.plan) or ()] or [0] * frame.plan.mesh.pp
    tp, sp = frame.plan.mesh.tp, frame.plan.mesh.sequence_parallel
    act = _peaks(frame.order, tuple(st.activation_bytes if st.tp is None else
                                    tp_activation_bytes(st, tp, sequence_parallel=sp) for st in stages))
    return max(s + a for s, a in zip(state, act)), max(state)


def bounds(c: Candidate, frame: Frame) -> tuple[float, int, int]:
    """(step, peak memory, state) lower bounds of a candidate before lowering it (:func:`_step_bound`,
    :func:`_memory`)."""
    return (step_bound(c, frame), *memory_bound(frame, frame.plan.stages))


def step_bound(c: Candidate, frame: Frame) -> float:
    """A lower bound on the simulated step (the buffered model), from the compute order and the costs.

    Per rank r (first stage f), what it must do before it reaches ``OPT``, each a lower bound:

    - its computes (exact, from its order) after the forwards of one microbatch through the stages
      before f and the messages between them (``head``);
    - each all-reduce of its stages (``AR<s>:dp``, HSDP's ``dp.replicate``, a tie's) is posted
      asynchronously after the stage's last backward and ``OPT`` waits for it: the computes up to that
      backward plus the all-reduce's length;
    - its dp lane: the shard collectives (one ``UNSHARD`` and one ``REDUCE_SCATTER`` per stage at
      least) run one after another and ``OPT`` waits for the last;
    - on a chain whose rank ends on a backward (``B`` or ``I``) of stage f: that backward's grads
      pass back through the stages before f (``tail``), after which stage 0's rank reduces stage 0.

    When the run clips, ``OPT`` waits for every pp rank (the grad norm's collective), then each steps
    its optimizer: the step is at least the latest arrival plus the largest optimizer step; without
    clipping each rank steps on its own: the latest of arrival plus own step. Host overhead is left
    out (it only adds)."""
    plan, costs, order = frame.plan, frame.costs, frame.order
    placement, mesh, stages = plan.placement, plan.mesh, costs.stages
    S, P = len(stages), c.pp
    transfer = costs.transfer if frame.priced else {}
    shard = costs.shard if frame.priced else {}
    allreduce = costs.allreduce if frame.priced else {}
    lane, optim = [0.0] * P, [0.0] * P
    reduce = [_stage_reductions(mesh, allreduce, s) for s in range(S)]
    for s, cost in enumerate(stages):
        r = placement[s]
        optim[r] += cost.optim + shard.get(("OPTIM_STEP", s), 0.0)
        lane[r] += shard.get((Op.UNSHARD.value, s), 0.0) + shard.get((Op.REDUCE_SCATTER.value, s), 0.0)
    for tie in plan.ties:
        if len(tie.ranks(placement)) > 1:
            for s in tie.stages:
                reduce[s] = max(reduce[s], allreduce.get((f"tie.{tie.name}", s), 0.0))
    chain = {(e.src_stage, e.dst_stage) for e in plan.edges} == {(s, s + 1) for s in range(S - 1)}
    hop = [transfer.get((s, s + 1), 0.0) if placement[s] != placement[s + 1] else 0.0 for s in range(S - 1)]
    computes, back = _computes(order, stages)
    head, tail = [0.0], [0.0]
    for s in range(S - 1):
        head.append(head[-1] + stages[s].fwd + hop[s])
        tail.append(tail[-1] + back[s] + hop[s])
    after0 = max(reduce[0], shard.get((Op.REDUCE_SCATTER.value, 0), 0.0))
    arrivals = []
    for r, actions in enumerate(order.ranks):
        f = min((s for s in range(S) if placement[s] == r), default=0)
        start = head[f] if chain else 0.0
        done, last_backward = computes[r]
        arrival = max(start + done, lane[r], *(start + t + reduce[s] for s, t in last_backward))
        last = actions[-1] if actions else None
        if chain and last is not None and last.kind in (Kind.B, Kind.I) and last.stage == f and f > 0:
            arrival = max(arrival, start + done + tail[f] + after0)
        arrivals.append(arrival)
    if not arrivals:
        return max(optim, default=0.0)
    if costs.grad_norm:
        return max(arrivals) + max(optim, default=0.0)
    return max(a + o for a, o in zip(arrivals, optim))


def _stage_reductions(mesh: Mesh, allreduce, s: int) -> float:
    """The all-reduce of stage s that ``OPT`` waits for: ``AR<s>:dp`` (unsharded parameters) or
    HSDP's ``AR<s>:dp.replicate``."""
    if mesh.params_sharded:
        return allreduce.get(("dp.replicate", s), 0.0) if mesh.hybrid else 0.0
    return allreduce.get(("dp", s), 0.0) if mesh.dp > 1 else 0.0


def _computes(order: ComputeOrder, stages: tuple[Cost, ...]) -> tuple[list, list[float]]:
    """What :func:`step_bound` reads of the order under the stages' costs, cached per (order, costs):
    per rank (its computes' total, (stage, the total at its last backward part) per stage), and
    :func:`_backward_in_chain`."""
    got = _COMPUTES.get(order, stages)
    if got is None:
        ranks = []
        for actions in order.ranks:
            done, last_backward = 0.0, {}
            for a in actions:
                done += stages[a.stage].of(a.kind)
                if a.kind is not Kind.F:
                    last_backward[a.stage] = done
            ranks.append((done, tuple(last_backward.items())))
        got = _COMPUTES.put(order, stages, (ranks, _backward_in_chain(order, stages)))
    return got


_COMPUTES = PerOrder(256)
"""(order, stage costs) -> :func:`_computes` (the layouts, shard modes and microbatch shapes of a search share
an order; the shard modes and dp of one cut share its costs)."""


def _backward_in_chain(order: ComputeOrder, stages) -> list[float]:
    """Per stage: the shortest backward part that passes its input grad on (``B``, or ``I`` where the
    order splits it), over the kinds its order uses."""
    used: list[set] = [set() for _ in stages]
    for actions in order.ranks:
        for a in actions:
            if a.kind in (Kind.B, Kind.I):
                used[a.stage].add(a.kind)
    return [min((stages[s].of(k) for k in kinds), default=0.0) for s, kinds in enumerate(used)]
