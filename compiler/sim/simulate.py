"""Predicted Timelines: a plan's cost model, run through the event loop.

The event loop itself (both comm models, deadlock reports) lives in
:mod:`pipec.compiler.sim.engine`; this module turns a plan into its costs (each
hop and collective on its axis's link, or by node: :class:`Pricing`; a tp
stage's compute share and tp collectives in :func:`plan_costs` alone, by
:mod:`pipec.compiler.sim.tensor_parallel`) and an execution into the Timeline
that views and report.json share.
"""

from __future__ import annotations

import random
import statistics
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Mapping, Sequence

from pipec.compiler.ir.plan import UNIT_COST, Edge, Link, Mesh, Plan, Tie, chain_edges, local_specs
from pipec.compiler.ir.program import Op, Program
from pipec.compiler.ir.tensor_parallel import in_effect
from pipec.compiler.ir.timeline import Interval, Timeline
from pipec.compiler.sim.contention import sharing_of
from pipec.compiler.sim.cost import COMPUTE_JITTER, TRANSFER_JITTER, CostModel
from pipec.compiler.sim.history import widened
from pipec.compiler.sim.engine import (BUFFERED, IN_ORDER, MODELS, Deadlock, Execution, decode, execute, group_members,
                                       spreads)
from pipec.compiler.sim.tensor_parallel import backend_of, collective_price, tp_cost

__all__ = [
    "BUFFERED", "IN_ORDER", "MODELS", "CostModel", "Deadlock", "Execution",
    "execute", "simulate", "plan_costs", "on_gloo", "Pricing", "NODE_SIDES", "link_sides", "emulated_costs", "simulate_costs",
    "simulate_draws", "execute_draws", "DRAWS", "OVERSLEEP", "HOP", "interval_of", "COVERAGE", "INTERVAL_DRAWS",
    "timeline_of", "chain_edges", "group_members",
]


def plan_costs(plan: Plan) -> CostModel:
    """The cost model of a plan: its stages' costs, its links, its edges' bytes.

    A plan whose costs are units (a schedule-only plan, or a model plan with
    ``costs unit``: F=1, B=2, I=W=1) has free communication and no host
    overhead, so the schedule table's formulas hold exactly and every time it
    predicts is in units. A plan in seconds is charged its ``overhead`` (the
    executor's host time per instruction kind) when it has one. Each hop and
    collective is priced on its axis's link, or by node (:class:`Pricing`).
    ``OPT`` holds its grad-norm collective over the pp ranks only when the plan's
    training config sets ``grad_clip`` (the runtime runs it only to clip).

    Tensor parallelism enters here and nowhere else: a stage whose ``tp`` is set
    (``mesh.tp`` >= 2) costs what one of its tp ranks does (:func:`_stage_costs`: its compute
    at ``compute_share(tp)`` plus its tp collectives, :mod:`.tensor_parallel`) and saves
    what one holds (:func:`_activation_bytes`); its dp, shard and tie collectives move
    one tp rank's part. With tp 1 or no ``Stage.tp`` every figure is as before.
    """
    num_stages = plan.num_stages
    unit = plan.unit_costs
    price = Pricing(plan)
    transfer, allreduce, shard = ({}, {}, {}) if unit else _priced(plan, price)
    act = _activation_bytes(plan)
    return CostModel(
        stages=(tuple(st.cost for st in plan.stages) if unit else _stage_costs(plan, price))
        or (UNIT_COST,) * num_stages,
        transfer=transfer,
        allreduce=allreduce,
        shard=shard,
        activation_bytes=act,
        overhead={} if unit or plan.overhead is None else dict(plan.overhead.seconds),
        time_unit="unit" if unit else "s",
        grad_norm=plan.spec.get("grad_clip") is not None,
        early_receives=not unit and on_gloo(plan),
        sharing=None if unit else sharing_of((plan.model or {}).get("profile"), plan.mesh),
        host_spread=None if unit else _host_spread((plan.model or {}).get("profile")),
        hop_spread=0.0 if unit else float(plan.links["pp"].spread or 0.0),
        overhead_spread={} if unit or plan.overhead is None else dict(plan.overhead.spread or {}),
        hop_draws=() if unit else _over(plan.links["pp"].samples, statistics.fmean),
        collective_draws={} if unit else {axis: got for axis in ("dp", "tie") if axis in plan.links
                                          and (got := _over(plan.links[axis].samples, statistics.median))},
        overhead_draws={} if unit or plan.overhead is None else
        {op: got for op, xs in (plan.overhead.samples or {}).items() if (got := _over(xs, statistics.median))},
    )


def _over(samples: Sequence[float] | None, figure) -> tuple[float, ...]:
    """Measured samples each over their ``figure`` (the mean a link's latency is, the median an overhead is):
    what a draw scales its fixed cost by; empty where there are none or the figure is 0."""
    if not samples:
        return ()
    f = figure(samples)
    return tuple(x / f for x in samples) if f > 0 else ()


def _stage_costs(plan: Plan, price: Pricing) -> tuple:
    """Each stage's cost on one of its ranks: its own, or with tp (:func:`~pipec.compiler.sim.tensor_parallel.
    tp_cost`) its compute at its tp share plus its tp collectives, each a ring over its tp group
    (:meth:`Pricing.tp_ring`)."""
    tp = plan.mesh.tp
    if not _any_tp(plan):
        return tuple(st.cost for st in plan.stages)
    from pipec.compiler.passes.memory import local_params

    recomputed = set(plan.spec.get("recompute") or ())
    out = []
    for st in plan.stages:
        if (stp := in_effect(st.tp, tp)) is None:
            out.append(st.cost)
            continue
        fwd, bwd = price.tp_seconds(st)
        out.append(tp_cost(st.cost, stp, tp, forward_s=fwd, backward_s=bwd, recomputed=st.stage in recomputed,
                           state_share=local_params(st, tp) / st.num_params if st.num_params else 1.0))
    return tuple(out)


def _activation_bytes(plan: Plan) -> tuple[int, ...]:
    """Per stage: bytes saved per microbatch on one of its ranks (over tp: :func:`~pipec.compiler.passes.memory.
    tp_activation_bytes`); empty when some stage's are unknown."""
    if not plan.stages or any(st.activation_bytes is None for st in plan.stages):
        return ()
    if not _any_tp(plan):
        return tuple(st.activation_bytes or 0 for st in plan.stages)
    from pipec.compiler.passes.memory import tp_activation_bytes

    mesh = plan.mesh
    return tuple(tp_activation_bytes(st, mesh.tp, sequence_parallel=mesh.sequence_parallel) or 0
                 for st in plan.stages)


def _any_tp(plan: Plan) -> bool:
    """Whether tensor parallelism changes any stage of the plan (:func:`~pipec.compiler.ir.tensor_parallel.
    in_effect`)."""
    return any(in_effect(st.tp, plan.mesh.tp) is not None for st in plan.stages)


def _host_spread(profile: Mapping | None) -> float | None:
    """The profile's ``host_spread`` (the relative standard deviation of its reference kernel's times), if
    recorded."""
    value = (profile or {}).get("host_spread")
    return None if value is None else float(value)


def on_gloo(plan: Plan) -> bool:
    """Whether the plan's links were measured on gloo (``costs profile`` on CPU), the backend over which the
    executor posts every receive of a step when the step starts (:attr:`CostModel.early_receives`)."""
    return any(link.measured is not None and link.measured.backend == "gloo" for link in plan.links.values())


def _priced(plan: Plan, price: Pricing) -> tuple[dict, dict, dict]:
    """(transfer, allreduce, shard) seconds of a plan in seconds: each edge's message, each dp and tie
    all-reduce, sharding's collectives."""
    mesh, pp = plan.mesh, plan.links["pp"]
    # each tp rank's message: with sequence parallelism, its part of the sequence
    transfer = {(e.src_stage, e.dst_stage): price.hop(plan.placement[e.src_stage], plan.placement[e.dst_stage],
                                                      sum(t.num_bytes for t in local_specs(plan, e.src_stage,
                                                                                           e.tensors)))
                for e in plan.edges}
    allreduce: dict[tuple[str, int], float] = {}
    dp = plan.links.get("dp", pp)
    tp = _any_tp(plan)
    if tp:
        from pipec.compiler.passes.memory import local_param_bytes, tie_bytes
    for st in plan.stages:
        if mesh.dp > 1 and st.param_bytes:
            num_bytes = local_param_bytes(st, mesh.tp) if tp else st.param_bytes
            allreduce[("dp", st.stage)] = price.ring("dp", dp, _dp_groups(mesh, "dp", st.rank), num_bytes)
    shard = _shard_costs(plan, allreduce, price)
    tl = plan.links.get("tie", pp)
    for tie in plan.ties:
        ranks = tie.ranks(plan.placement)
        groups = [tuple(mesh.global_rank(p, d, t) for p in ranks) for d in range(mesh.dp) for t in _tp_ranks(mesh)]
        num_bytes = tie_bytes(plan, tie) if tp else tie.num_bytes or 0
        cost = price.ring("tie", tl, groups, num_bytes) if len(ranks) > 1 else 0.0
        for s in tie.stages:
            allreduce[(f"tie.{tie.name}", s)] = cost
    return transfer, allreduce, shard


NODE_SIDES = ("intra", "inter")
"""The ``links`` axes that price by node: within one node, across nodes."""


@dataclass(slots=True)
class Pricing:
    """Which link prices each hop and collective of a plan, and what it costs.

    Without ``mesh.devices_per_node``, or with neither ``intra`` nor ``inter`` among the plan's
    links, every hop is on its axis's link (``pp``; ``dp``, ``tie``, ``shard``) as in a plan that
    does not know its nodes. Otherwise, with nodes of G consecutive global ranks:

    - a pp edge between pp ranks a and b crosses nodes when, for some replica d, global ranks
      (a, d) and (b, d) sit on different nodes (the step waits for the slowest replica): it costs
      ``inter``'s latency + bytes / bandwidth, else ``intra``'s;
    - a collective over a group of n global ranks (a dp group, a tie group per replica, a shard
      group) is a ring on ``intra`` when one node holds them all:
      ``latency + f (n - 1) / n x bytes / bandwidth``, f = 2 for an all-reduce, 1 for an all-gather
      or reduce-scatter; spanning k nodes, with at most m_hi and at least m_lo members on one
      node, a hierarchical ring: ``intra.latency + f (m_hi - 1) / m_hi x bytes / intra.bandwidth``
      (absent when m_hi = 1) ``+ inter.latency + f (k - 1) / k x (bytes / m_lo) / inter.bandwidth``
      (each node's share crosses the nodes); of several groups (one per replica) the slowest.

    A side not given falls back to the axis's own link (``intra`` or ``inter`` missing: ``pp`` for a
    pp edge, ``dp`` for a dp group, ...). :attr:`sides` records, per priced item, which side it took.
    """

    plan: Plan
    sides: dict[tuple[str, object], str] = field(default_factory=dict)
    """(axis, item) -> ``"intra"`` | ``"inter"``: a pp edge is ``("pp", (a, b))`` (its pp ranks), a
    collective ``(axis, first group)``; empty when not pricing by node."""

    @property
    def by_node(self) -> bool:
        return self.plan.mesh.devices_per_node is not None and any(a in self.plan.links for a in NODE_SIDES)

    def _link(self, side: str, axis_link: Link) -> Link:
        return self.plan.links.get(side, axis_link)

    def hop(self, a: int, b: int, num_bytes: int) -> float:
        """Seconds of one message between pp ranks ``a`` and ``b``."""
        link = self.plan.links["pp"]
        if self.by_node:
            mesh = self.plan.mesh
            crosses = any(mesh.node_of(mesh.global_rank(a, d)) != mesh.node_of(mesh.global_rank(b, d))
                          for d in range(mesh.dp))
            side = self.sides[("pp", (a, b))] = "inter" if crosses else "intra"
            link = self._link(side, link)
        return link.latency_s + num_bytes / link.bandwidth_Bps

    def ring(self, axis: str, axis_link: Link, groups: Sequence[tuple[int, ...]], num_bytes: float,
             factor: float = 2.0) -> float:
        """Seconds of one collective over each of ``groups`` (global ranks; the slowest counts)."""
        if not self.by_node:
            n = len(groups[0])
            return axis_link.latency_s + factor * (n - 1) / n * num_bytes / axis_link.bandwidth_Bps
        seconds, side = max(self._ring_by_node(axis_link, g, num_bytes, factor) for g in groups)
        self.sides[(axis, groups[0])] = side
        return seconds

    def tp_seconds(self, stage) -> tuple[float, float]:
        """(forward, backward) seconds of a tp stage's collectives per microbatch, each a :meth:`tp_ring` of what
        the run issues for it on the plan's backend, in the dtype it moves
        (:func:`~pipec.compiler.sim.tensor_parallel.collective_price`)."""
        out = {"forward": 0.0, "backward": 0.0}
        seen: dict[tuple[float, float], float] = {}
        backend, dtype = backend_of(self.plan), str(self.plan.spec.get("dtype", "float32"))
        for c in stage.tp.collectives:
            key = collective_price(c, backend, dtype)
            if key not in seen:
                seen[key] = self.tp_ring(stage.rank, key[1], key[0])
            out[c.phase] = out.get(c.phase, 0.0) + seen[key]
        return out["forward"], out["backward"]

    def tp_ring(self, pp: int, num_bytes: float, factor: float = 2.0) -> float:
        """Seconds of one collective over the tp groups of pp rank ``pp`` (one per replica; the slowest counts):
        on the ``tp`` link when the plan has one, else as a dp collective is priced (the ``dp`` link, or by node:
        ``intra`` for a group inside one node, the hierarchical ring across nodes)."""
        mesh = self.plan.mesh
        groups = [mesh.tp_group(mesh.global_rank(pp, d)) for d in (range(1) if _aligned(mesh) else range(mesh.dp))]
        link = self.plan.links.get("tp")
        if link is not None:
            n = len(groups[0])
            return link.latency_s + factor * (n - 1) / n * num_bytes / link.bandwidth_Bps
        return self.ring("tp", self.plan.links.get("dp", self.plan.links["pp"]), groups, num_bytes, factor)

    def _ring_by_node(self, axis_link: Link, group: tuple[int, ...], num_bytes: float,
                      factor: float) -> tuple[float, str]:
        per_node = Counter(self.plan.mesh.node_of(g) for g in group)
        intra, n, k = self._link("intra", axis_link), len(group), len(per_node)
        if k == 1:
            return intra.latency_s + factor * (n - 1) / n * num_bytes / intra.bandwidth_Bps, "intra"
        inter, hi, lo = self._link("inter", axis_link), max(per_node.values()), min(per_node.values())
        seconds = inter.latency_s + factor * (k - 1) / k * (num_bytes / lo) / inter.bandwidth_Bps
        if hi > 1:
            seconds += intra.latency_s + factor * (hi - 1) / hi * num_bytes / intra.bandwidth_Bps
        return seconds, "inter"


def link_sides(plan: Plan) -> dict[str, dict[str, int]]:
    """Per axis (``pp`` edges between pp ranks; ``dp``, ``tie``, ``dp.shard``, ``dp.replicate``, ``tp`` groups),
    how many of its hops or collectives were priced on ``intra`` and on ``inter``; empty when the plan is
    not priced by node (no ``devices_per_node``, no ``intra`` / ``inter`` link, or unit costs)."""
    if plan.unit_costs:
        return {}
    price = Pricing(plan)
    if not price.by_node:
        return {}
    _priced(plan, price)
    for st in plan.stages:
        if in_effect(st.tp, plan.mesh.tp) is not None:
            price.tp_seconds(st)
    out: dict[str, dict[str, int]] = {}
    for (axis, _), side in price.sides.items():
        out.setdefault(axis, dict.fromkeys(NODE_SIDES, 0))[side] += 1
    return out


OVERSLEEP = "oversleep"
HOP = "hop"
"""The kinds of measured samples :func:`emulated_costs` takes beside the opcode names (host seconds): a sleep's
excess, a message's hop."""
DRAWS = 15
"""How many drawn steps :func:`simulate_draws` runs; the median step's is the prediction."""
SEED = 0
TAIL = 0.97
"""The quantile each kind's samples are capped at before they are drawn (:func:`_deviations`). The rarer stalls
above it are mostly the whole host's (other processes on few cores): they hold up every rank at once, and the run
pays each once, but drawn apart per instruction they would be paid on every near-critical path. Measured on a
loaded 2-core host (every schedule at 4 and 8 ranks): uncapped draws over-predict the bubble by about 0.008, the
fixed means under-predict it by 0.011; capped here the two meet (+0.003)."""


def emulated_costs(plan: Plan, *, seconds_per_unit: float, latency_s: float, collective_s: float,
                   overhead: Mapping[str, float], oversleep_s: float = 0.0,
                   jitter: Mapping[str, Sequence[float]] | None = None) -> CostModel:
    """What ``pipec run --emulate`` pays, in seconds: each compute sleeps its cost x ``seconds_per_unit``
    (plus the ``oversleep_s`` a sleep takes beyond what it asks), every message is a placeholder of one
    element per tensor (``latency_s``), every all-reduce and shard collective a one-element all-reduce
    (``collective_s``), the optimizer step is empty, and each instruction costs the host ``overhead``.

    ``jitter``: the measured samples behind those figures, per opcode name (host seconds of one instruction),
    :data:`OVERSLEEP` and :data:`HOP`; they become the cost model's :attr:`CostModel.jitter` (each as its
    deviation from the fixed figure, capped at its :data:`TAIL` quantile), which :func:`simulate_draws` draws
    from. The fixed costs are the same with or without them."""
    base = plan_costs(plan)

    def scaled(c):  # a sleep scatters by its oversleep, not by the compute's spread
        return replace(c, **{k: (v * seconds_per_unit + oversleep_s if v > 0 else 0.0)
                             for k, v in (("fwd", c.fwd), ("bwd", c.bwd), ("bwd_i", c.bwd_i), ("bwd_w", c.bwd_w))},
                       optim=0.0, spread=None)

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
        grad_norm=False,  # no optimizer runs, so OPT holds no grad-norm collective
        jitter=_deviations(jitter or {}, overhead, oversleep_s, latency_s),
        host_spread=None,
    )


def _deviations(samples: Mapping[str, Sequence[float]], overhead: Mapping[str, float], oversleep_s: float,
                latency_s: float) -> dict[str, tuple[float, ...]]:
    """Measured samples as :attr:`CostModel.jitter`'s deviations from the fixed figures they replace, each
    sample capped at its kind's :data:`TAIL` quantile (the sorted samples' ``int(TAIL x n)``-th)."""
    fixed = {**{op: (op, v) for op, v in overhead.items()},
             OVERSLEEP: (COMPUTE_JITTER, oversleep_s), HOP: (TRANSFER_JITTER, latency_s)}
    out = {}
    for k, xs in samples.items():
        if xs and k in fixed:
            cap = sorted(xs)[min(len(xs) - 1, int(TAIL * len(xs)))]
            out[fixed[k][0]] = tuple(min(x, cap) - fixed[k][1] for x in xs)
    return out


def simulate_draws(plan: Plan, costs: CostModel, model: str = BUFFERED, *, draws: int = DRAWS,
                   seed: int = SEED) -> Timeline:
    """The Timeline of the median step of ``draws`` runs of the event loop, each drawing every cost
    :attr:`CostModel.jitter` covers from its samples (one ``random.Random(seed)`` for all, so the same every
    time). A step is the longest of many near-critical paths, each paying its own stalls, so the fixed mean
    costs fall short of it; the drawn median does not. Without jitter: :func:`simulate_costs`."""
    if not costs.jitter:
        return simulate_costs(plan, costs, model)
    return timeline_of(execute_draws(plan.program, placement=plan.placement, num_microbatches=plan.num_microbatches,
                                     edges=plan.edges, costs=costs, model=model, ties=plan.ties, draws=draws,
                                     seed=seed), costs)


def execute_draws(program: Program, *, placement: Sequence[int], num_microbatches: int, edges: Sequence[Edge],
                  costs: CostModel, model: str = BUFFERED, ties: Sequence[Tie] = (), draws: int = DRAWS,
                  seed: int = SEED) -> Execution:
    """The median step's :class:`Execution` of ``draws`` runs of the event loop, each drawing from
    :attr:`CostModel.jitter` (one ``random.Random(seed)`` for all; of an even count, the upper middle)."""
    rng = random.Random(seed)
    decoded = decode(program, placement=placement, num_microbatches=num_microbatches, edges=edges, costs=costs)
    runs = sorted((execute(program, placement=placement, num_microbatches=num_microbatches, edges=edges,
                           costs=costs, model=model, ties=ties, decoded=decoded, rng=rng)
                   for _ in range(draws)), key=lambda ex: ex.step_time)
    return runs[len(runs) // 2]


COVERAGE = 0.9
"""The share of steps a predicted interval is meant to hold (:func:`interval_of`)."""
INTERVAL_DRAWS = 20
"""How many drawn steps an interval is read from."""


def interval_of(plan: Plan, costs: CostModel | None = None, model: str = BUFFERED, *, draws: int = INTERVAL_DRAWS,
                coverage: float = COVERAGE, seed: int = SEED, point: float | None = None) -> Interval | None:
    """The range the plan's steps are expected in: the event loop run ``draws`` times, each drawing every compute
    from its stage's :attr:`Cost.spread` and the whole step's host speed from :attr:`CostModel.host_spread`
    (:func:`~pipec.compiler.sim.engine.drawn`; one ``random.Random(seed)``, so the same every time), and the middle
    ``coverage`` of the drawn step times and bubbles (quantiles interpolated between the sorted draws). None where
    the costs carry no spread (unit or flops costs, or some stage never timed): no interval rather than a made-up
    one. With the plan's ``point`` step, the step's range is widened to hold what earlier runs on this host
    measured against their points (:func:`~pipec.compiler.sim.history.widened`)."""
    costs = costs or plan_costs(plan)
    if costs.time_unit != "s" or not spreads(costs):
        return None
    rng = random.Random(seed)
    kw = dict(placement=plan.placement, num_microbatches=plan.num_microbatches, edges=plan.edges, costs=costs)
    decoded = decode(plan.program, **kw)
    steps, bubbles = [], []
    for _ in range(draws):
        ex = execute(plan.program, **kw, model=model, ties=plan.ties, decoded=decoded, record_events=False, rng=rng)
        steps.append(ex.step_time)
        n = len(ex.compute)
        bubbles.append(sum(ex.step_time - c for c in ex.compute) / (n * ex.step_time) if ex.step_time > 0 else 0.0)
    band = Interval(step_time=_middle(steps, coverage), bubble_fraction=_middle(bubbles, coverage),
                    coverage=coverage, draws=draws)
    return band if point is None else widened(plan, band, point)


def _middle(values: Sequence[float], coverage: float) -> tuple[float, float]:
    """The range of ``values`` a next value falls in with probability ``coverage``: the sorted values' j-th at j =
    (n + 1)(1 - coverage) / 2 and (n + 1)(1 + coverage) / 2, interpolated between them and kept within the first and
    the last (the k-th of n draws sits, on average, at the (k / (n + 1)) quantile of what is drawn: of 20 draws a
    90% range is nearly the least to the greatest, where the 5% and 95% quantiles of the 20 would hold 81%)."""
    xs = sorted(values)
    n = len(xs)

    def at(j: float) -> float:
        j = min(max(j, 1.0), float(n)) - 1
        i = int(j)
        return xs[i] if i + 1 >= n else xs[i] + (xs[i + 1] - xs[i]) * (j - i)

    return at((n + 1) * (1 - coverage) / 2), at((n + 1) * (1 + coverage) / 2)


def _shard_costs(plan: Plan, allreduce: dict[tuple[str, int], float],
                 price: Pricing) -> dict[tuple[str, int], float]:
    """Sharding's collectives as rings on the ``shard`` link (absent: ``dp``), ``latency + (n - 1) / n x
    bytes / bandwidth`` over a shard group of n (by node: :class:`Pricing`): an ``UNSHARD``'s all-gather
    and a ``REDUCE_SCATTER`` of the stage's padded parameters (in the compute dtype, as FSDP2's mixed
    precision moves them), ``OPT``'s gather of the updated parameters (``shard optimizer``, float32);
    HSDP's replicate all-reduce of the shards (bytes / n) over the dp / n groups goes into ``allreduce``."""
    from pipec.compiler.passes.memory import COMPUTE_BYTES, padded_params

    mesh = plan.mesh
    mode, n = mesh.shard_mode, mesh.num_shards
    out: dict[tuple[str, int], float] = {}
    if not mesh.sharded or n < 2 and not mesh.hybrid:
        return out
    link = plan.links.get("shard", plan.links.get("dp", plan.links["pp"]))
    elem = COMPUTE_BYTES.get(str(plan.spec.get("dtype", "float32")), 4) if mode.params else 4

    for st in plan.stages:
        padded = padded_params(st, n, mesh.tp)
        ring = price.ring(mesh.shard_group, link, _dp_groups(mesh, mesh.shard_group, st.rank), padded * elem,
                          factor=1.0) if n > 1 else 0.0
        if not mode.params:  # whole parameters, sharded optimizer state: the step gathers the updated ones
            out[("OPTIM_STEP", st.stage)] = ring
            continue
        out[(Op.UNSHARD.value, st.stage)] = out[(Op.REDUCE_SCATTER.value, st.stage)] = ring
        if mesh.hybrid:
            allreduce[("dp.replicate", st.stage)] = price.ring(
                "dp.replicate", link, _dp_groups(mesh, "dp.replicate", st.rank), padded // n * elem)
        allreduce.pop(("dp", st.stage), None)
    return out


@lru_cache(maxsize=4096)
def _dp_groups(mesh: Mesh, group: str, pp: int) -> tuple[tuple[int, ...], ...]:
    """The distinct groups ``group`` (``dp``, ``dp.shard``, ``dp.replicate``: :meth:`Mesh.dp_groups`) splits pp
    rank ``pp``'s replicas into, in dp order, as global ranks: one set per tp rank t (the replicas of tp rank t;
    with tp 1 the only one; only tp rank 0's where :func:`_aligned`, the rest costing the same). Cached on its
    arguments, all it reads (``pipec tune`` prices thousands of candidates on a few dozen meshes)."""
    blocks = mesh.dp_groups(group)
    return tuple(tuple(mesh.global_rank(pp, d, t) for d in ds) for t in _tp_ranks(mesh) for ds in blocks)


def _aligned(mesh: Mesh) -> bool:
    """Whether tp divides the node size (or nodes are not said): then every tp group sits in one node, and the
    groups of tp rank t (dp, shard, tie groups) sit on the nodes tp rank 0's do, so one of them prices them all."""
    return mesh.devices_per_node is None or mesh.devices_per_node % mesh.tp == 0


def _tp_ranks(mesh: Mesh) -> range:
    """The tp ranks whose groups are priced: tp rank 0 alone when :func:`_aligned` (the rest cost the same)."""
    return range(1) if _aligned(mesh) else range(mesh.tp)


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
        peak_activation_bytes=dict(enumerate(ex.peak_activation_bytes)) if costs.activation_bytes else None,
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

