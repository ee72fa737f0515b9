"""The plan's types and their checks: what plan.json holds, in memory.

A :class:`Plan` is what every part of the compiler fills in (see DESIGN.md):
the language's resolved ``spec``, the tracer's ``model``, the partitioner's
``stages``, ``edges`` and ``ties``, the lowering's ``program``, the
simulator's ``prediction``; a schedule-only plan has no ``model``, unit costs
and stages without signatures. The :class:`Mesh` does the rank and node
arithmetic, and :func:`check_shard`, :func:`check_nodes` and
:func:`check_limits` refuse what cannot run. plan.json itself (the writer and
the reader of both formats) is :mod:`pipec.compiler.ir.plan_json`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from pipec.compiler.ir.program import Program
from pipec.compiler.ir.schema import SchemaError
from pipec.compiler.ir.tensor_parallel import StageTP
from pipec.compiler.ir.timeline import Timeline
from pipec.compiler.limits import LIMITS, MAX_TP
from pipec.errors import PipecError
from pipec.schedules.timing import UNIT, Cost

__all__ = [
    "PlanError",
    "TensorSpec",
    "Cost",
    "Stage",
    "Edge",
    "Tie",
    "Link",
    "Measured",
    "Overhead",
    "DEFAULT_LINKS",
    "ShardMode",
    "SHARDING",
    "SHARD_MODES",
    "Mesh",
    "check_shard",
    "check_nodes",
    "check_node_size",
    "check_tp",
    "tp_notes",
    "world_text",
    "check_limits",
    "Plan",
    "chain_edges",
    "local_specs",
]

class PlanError(SchemaError):
    """A plan file is unreadable, malformed, or beyond the limits."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A tensor by name, dtype and shape: ``tokens: int64[16, 128]``. One type from the schedule file to the
    run: the language's ``input`` and ``targets`` (one dp replica's batch: dim 0 is split into microbatches),
    the front end's microbatch inputs, and what crosses a stage boundary (a stage's inputs and outputs, an
    edge's tensors)."""

    name: str
    """The model's forward argument (an input), the targets' name, or the traced node's (a boundary tensor)."""
    dtype: str
    """A torch dtype's name (``"int64"``)."""
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * _DTYPE_BYTES.get(self.dtype, 4)

    def text(self) -> str:
        """The schedule-file syntax that writes it."""
        return f"{self.name}: {self.dtype}[{', '.join(map(str, self.shape))}]"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


_DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16,
}


UNIT_COST = UNIT
"""Unit costs (F=1, B=2, I=W=1): a schedule-only plan's."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Stage:
    stage: int
    rank: int
    nodes: tuple[str, ...] = ()
    params: tuple[str, ...] = ()
    """Canonical parameter names (as in the unpartitioned model's state dict)."""
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    cost: Cost = UNIT_COST
    """Per microbatch (:class:`pipec.schedules.timing.Cost`, pipec's one cost type)."""
    activation_bytes: int | None = None
    """Bytes saved for backward per microbatch."""
    param_bytes: int | None = None
    num_params: int | None = None
    """Parameters this stage holds (a tied weight counts on each stage holding a copy)."""
    param_shapes: tuple[tuple[int, ...], ...] = ()
    """The shape of each of ``params``, in order (empty: unknown); sharding pads each parameter's
    dim 0 to a multiple of the shard size, as FSDP2 does."""
    tp: StageTP | None = None
    """What tensor parallelism does to this stage at the plan's ``mesh.tp`` (None: tp 1, or a schedule-only
    plan)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Edge:
    """Data flows from ``src_stage`` to ``dst_stage`` (a skip edge may jump stages)."""

    src_stage: int
    dst_stage: int
    tensors: tuple[TensorSpec, ...] = ()

    @property
    def num_bytes(self) -> int:
        return sum(t.num_bytes for t in self.tensors)


@dataclass(frozen=True, slots=True, kw_only=True)
class Tie:
    """A weight used by several stages; ``name`` is its canonical name."""

    name: str
    stages: tuple[int, ...]
    params: tuple[str, ...]
    """The name of the tied parameter in each stage of ``stages``."""
    num_bytes: int | None = None
    """Size of the tied weight (for the all-reduce's cost)."""

    def ranks(self, placement: Sequence[int]) -> tuple[int, ...]:
        """The pp ranks holding a copy, in order (its tie group's members; one rank: no all-reduce)."""
        return tuple(sorted({placement[s] for s in self.stages}))


@dataclass(frozen=True, slots=True, kw_only=True)
class Measured:
    """Where a measured cost comes from (plan.json: ``"measured": {"at": ..., "backend": ..., "ranks": N}``)."""

    at: str
    """When: an ISO 8601 UTC timestamp."""
    backend: str
    """On what: the torch.distributed backend (``gloo``, ``nccl``)."""
    num_ranks: int = 2
    """How many processes the probe ran."""
    host: str = ""
    """The machine the probe ran on (the first rank's host name)."""
    reused: bool = False
    """Measured by an earlier compile and kept in the profile cache (``at`` says when); plan.json: ``"reused": true``."""

    def to_json(self) -> dict[str, Any]:
        out = {"at": self.at, "backend": self.backend, "ranks": self.num_ranks}
        return out | ({"host": self.host} if self.host else {}) | ({"reused": True} if self.reused else {})


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    latency_s: float
    bandwidth_Bps: float
    measured: Measured | None = None
    """Set when a probe measured this link (``costs profile``, ``pipec.runtime.linkprobe``); None: given or
    the default."""
    spread: float | None = None
    """The relative standard deviation of the probe's timings of one message on this link (its smallest size:
    the latency's scatter); the step's interval draws each message's transfer from it where ``samples`` are
    absent. None: not measured."""
    samples: tuple[float, ...] | None = None
    """The probe's seconds of each of its timed rounds of that smallest message, tail included; the step's interval
    draws each message's transfer as the transfer x one of them over their mean (an empirical draw: the stalls the
    probe met, as often as it met them). None: not measured (a plan from before, or links given)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Overhead:
    """The executor's own host time per instruction, by opcode name (plan.json ``overhead``): what the
    simulator charges on top of each instruction's work (:class:`~pipec.compiler.sim.engine.CostModel`)."""

    seconds: Mapping[str, float]
    """Opcode name (``"FWD"``, ``"SEND_ACT"``, ...) -> seconds per instruction; a missing opcode is free."""
    measured: Measured | None = None
    spread: Mapping[str, float] | None = None
    """Opcode name -> how its instructions' host seconds scattered in the probe (1.4826 x their median absolute
    deviation over their median); the step's interval draws each instruction's overhead from it where ``samples``
    has none of its opcode. None: not measured."""
    samples: Mapping[str, tuple[float, ...]] | None = None
    """Opcode name -> the probe's host seconds of each of its instructions, tail included; the step's interval
    draws each instruction's overhead as its seconds x one of them over their median (an empirical draw). None: not
    measured."""


DEFAULT_LINKS: Mapping[str, Link] = {
    "pp": Link(latency_s=1e-5, bandwidth_Bps=25e9),
    "dp": Link(latency_s=1e-5, bandwidth_Bps=25e9),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardMode:
    """What one value of key ``shard`` shards across a shard group: the one statement of it that the memory
    model, ``pipec tune``'s bounds, the simulator, the lowering and the runtime read."""

    name: str
    params: bool = False
    """Parameters sharded at rest, gathered by ``UNSHARD`` around their computes (FSDP2)."""
    grads: bool = False
    """Gradients reduce-scattered to shards (``REDUCE_SCATTER``) instead of all-reduced whole."""
    optimizer: bool = False
    """Optimizer state held as shards; with whole parameters ``OPTIM_STEP`` gathers the updated ones."""
    unshard: str | None = None
    """The unshard windows (:func:`~pipec.compiler.passes.lower.unshard_windows`): ``step`` (one per stage and
    step, from its first compute to its last), ``runs`` (resharded after each run of the stage's computes and
    gathered again), None (no ``UNSHARD``: the parameters stay whole)."""

    def state(self, per: tuple[int, int, int], full: float, shard: float) -> tuple[float, float, float]:
        """(params, grads, optimizer) bytes of a stage's parameters held whole (``full`` of them) or as one
        rank's shard (``shard`` of them), at ``per`` = (param, grad, optimizer-state) bytes per parameter."""
        p, g, o = per
        return ((shard if self.params else full) * p, (shard if self.grads else full) * g,
                (shard if self.optimizer else full) * o)


SHARDING: Mapping[str, ShardMode] = {m.name: m for m in (
    ShardMode(name="none"),
    ShardMode(name="optimizer", optimizer=True),
    ShardMode(name="grads", params=True, grads=True, optimizer=True, unshard="step"),
    ShardMode(name="full", params=True, grads=True, optimizer=True, unshard="runs"),
)}
"""Key ``shard``'s values, by name: how the dp replicas share a stage's state. ``optimizer`` (ZeRO-1):
optimizer state sharded; ``grads`` (FSDP2 ``reshard_after_forward=False``, ZeRO-2): gradients and optimizer
state sharded, parameters sharded at rest and gathered once per step; ``full`` (ZeRO-3, FSDP FULL_SHARD):
parameters resharded after each forward and gathered again for the backward."""

SHARD_MODES = tuple(SHARDING)
"""Key ``shard``'s values, in order (:data:`SHARDING`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Mesh:
    pp: int
    dp: int = 1
    shard: str = "none"
    """One of :data:`SHARD_MODES` (key ``shard``)."""
    shard_size: int | None = None
    """Replicas that shard a stage's state among themselves (key ``shard_size``); None: all of dp.
    Shard groups are consecutive dp ranks; with fewer than dp (HSDP) the state is replicated across
    the groups."""
    devices_per_node: int | None = None
    """Devices G per node (key ``devices_per_node``): nodes hold G consecutive global ranks, so
    global rank g sits on node g // G. None: not said (the ``pp`` and ``dp`` links price every hop)."""
    tp: int = 1
    """Tensor-parallel ranks per (pp, dp) coordinate (key ``tp``): the innermost mesh dimension, so a tp group
    is ``tp`` consecutive global ranks."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism inside each tp group (key ``sequence_parallel``)."""

    @property
    def num_shards(self) -> int:
        """The effective shard size: ranks one stage's state is sharded over (1 when not sharded)."""
        if self.shard == "none":
            return 1
        return self.dp if self.shard_size is None else self.shard_size

    @property
    def shard_mode(self) -> ShardMode:
        """What ``shard`` shards (:data:`SHARDING`)."""
        return SHARDING[self.shard]

    @property
    def sharded(self) -> bool:
        """Some state is sharded across dp (``shard`` is not ``none``)."""
        return self.shard != "none"

    @property
    def params_sharded(self) -> bool:
        """Parameters are sharded at rest and gathered by ``UNSHARD`` (``shard grads`` or ``full``)."""
        return SHARDING[self.shard].params

    @property
    def hybrid(self) -> bool:
        """HSDP: shard groups smaller than dp, replicated across each other."""
        return self.sharded and self.num_shards < self.dp

    @property
    def shard_group(self) -> str:
        """The group a stage's state is sharded over: ``dp``, or ``dp.shard`` under HSDP."""
        return "dp.shard" if self.hybrid else "dp"

    def dp_groups(self, group: str) -> tuple[range, ...]:
        """The dp ranks of each group that dp group ``group`` (``dp``, ``dp.shard``, ``dp.replicate``) cuts the
        replicas into, in dp order (the same for every pp rank and tp rank). Shard groups are consecutive dp
        ranks; a replicate group holds the same position in each shard group."""
        n = self.num_shards if self.hybrid else self.dp
        if group == "dp":
            return (range(self.dp),)
        if group == "dp.shard":
            return tuple(range(first, first + n) for first in range(0, self.dp, n))
        if group == "dp.replicate":
            return tuple(range(d, self.dp, n) for d in range(n))
        raise KeyError(f"{group!r} is not a dp group (dp, dp.shard, dp.replicate)")

    def group_ranks(self, group: str, global_rank: int) -> tuple[int, ...]:
        """The global ranks of the dp group ``group`` (:meth:`dp_groups`) that ``global_rank`` belongs to, in dp
        order: ranks of the same pp rank and the same tp rank."""
        pp, d = self.coords(global_rank)
        t = self.tp_rank(global_rank)
        ds = next(ds for ds in self.dp_groups(group) if d in ds)
        return tuple(self.global_rank(pp, x, t) for x in ds)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def coords(self, global_rank: int) -> tuple[int, int]:
        """(pp rank, dp rank) of a global rank; global rank = (pp x dp_size + dp) x tp_size + tp."""
        return divmod(global_rank // self.tp, self.dp)

    def tp_rank(self, global_rank: int) -> int:
        """The tp rank of a global rank (0 with tp 1)."""
        return global_rank % self.tp

    def global_rank(self, pp: int, dp: int = 0, tp: int = 0) -> int:
        """The global rank of (pp rank, dp rank, tp rank): (pp x dp_size + dp) x tp_size + tp, so a tp group is
        consecutive ranks and replicas are neighbours (with tp 1: pp x dp_size + dp)."""
        return (pp * self.dp + dp) * self.tp + tp

    def tp_group(self, global_rank: int) -> tuple[int, ...]:
        """The global ranks of ``global_rank``'s tp group, in tp order."""
        first = global_rank - global_rank % self.tp
        return tuple(range(first, first + self.tp))

    def replicas(self, pp: int, tp: int = 0) -> range:
        """The global ranks of pp rank ``pp``'s dp replicas of tp rank ``tp`` (its dp group), in dp order."""
        return range(self.global_rank(pp, 0, tp), self.global_rank(pp + 1, 0, tp), self.tp)

    def pp_ranks(self, pp: int) -> range:
        """Every global rank running pp rank ``pp``'s program (its dp x tp ranks, consecutive), in rank order."""
        return range(self.global_rank(pp), self.global_rank(pp + 1))

    def pp_group(self, global_rank: int) -> tuple[int, ...]:
        """The global ranks of ``global_rank``'s pipeline: every pp rank with its dp rank and its tp rank, in pp
        order (the p2p peers, the tie groups' and the grad clip's members)."""
        _, d = self.coords(global_rank)
        t = self.tp_rank(global_rank)
        return tuple(self.global_rank(p, d, t) for p in range(self.pp))

    def where(self, global_rank: int) -> str:
        """``global rank G (pp P, dp D)``, and ``, tp T`` with tp > 1: how messages name a rank."""
        pp, dp = self.coords(global_rank)
        tp = f", tp {self.tp_rank(global_rank)}" if self.tp > 1 else ""
        return f"global rank {global_rank} (pp {pp}, dp {dp}{tp})"

    def node_of(self, global_rank: int) -> int:
        """The node holding a global rank: nodes are ``devices_per_node`` consecutive global ranks (one
        node when it is not set)."""
        return 0 if self.devices_per_node is None else global_rank // self.devices_per_node

    @property
    def num_nodes(self) -> int:
        """Nodes the world spans (1 when ``devices_per_node`` is not set or holds all of it)."""
        return self.node_of(self.world_size - 1) + 1


def check_shard(mesh: Mesh) -> None:
    """Refuse a sharding that cannot work (key ``shard`` or ``shard_size``), saying why and the fix."""
    if mesh.shard not in SHARD_MODES:
        raise PipecError(f"shard must be one of {', '.join(SHARD_MODES)}, got {mesh.shard!r}", key="shard")
    size = mesh.shard_size
    if size is not None and (size < 1 or mesh.dp % size):
        raise PipecError(f"shard_size {size} does not divide dp {mesh.dp}: shard groups are consecutive dp "
                         "ranks of equal size", key="shard_size",
                         hints=(f"use a divisor of {mesh.dp} ({', '.join(map(str, _divisors(mesh.dp)))}), "
                                "or leave shard_size out (all of dp)",))
    if mesh.sharded and mesh.dp < 2:
        raise PipecError(f"shard {mesh.shard} needs dp >= 2: with one replica there is no one to share the "
                         f"state with (dp is {mesh.dp})", key="shard",
                         hints=("set dp 2 or more, or shard none",))
    if size is not None and not mesh.sharded:
        raise PipecError(f"shard_size {size} is set but shard is none: nothing is sharded", key="shard_size",
                         hints=("set shard optimizer, grads or full, or leave shard_size out",))


def check_nodes(mesh: Mesh) -> None:
    """Refuse a ``devices_per_node`` that does not cut the world into whole nodes."""
    if mesh.devices_per_node is not None:
        check_node_size(mesh.devices_per_node, mesh.world_size, f"the world size {world_text(mesh)}")


def world_text(mesh: Mesh) -> str:
    """``pp x dp = 2 x 2 = 4`` (``pp x dp x tp = ...`` with tp > 1): the world size, said in full."""
    if mesh.tp == 1:
        return f"pp x dp = {mesh.pp} x {mesh.dp} = {mesh.world_size}"
    return f"pp x dp x tp = {mesh.pp} x {mesh.dp} x {mesh.tp} = {mesh.world_size}"


def check_tp(mesh: Mesh) -> None:
    """Refuse a ``tp`` beyond :data:`~pipec.compiler.limits.MAX_TP`, or one whose tp groups straddle a node
    boundary (with ``devices_per_node`` G: tp divides G, or G divides tp and each tp group spans whole nodes;
    that second case is legal and :func:`tp_notes` warns of its cost)."""
    tp, g = mesh.tp, mesh.devices_per_node
    if not 1 <= tp <= MAX_TP:
        raise PipecError(f"tp must be in 1..{MAX_TP} (pipec's limit), got {tp}", key="tp",
                         hints=(f"use tp 1..{MAX_TP}",))
    if g is None or tp == 1:
        return
    if tp <= g and g % tp:
        raise PipecError(f"tp {tp} does not divide devices_per_node {g}: tp groups are {tp} consecutive global "
                         f"ranks, so some would straddle two nodes", key="tp",
                         hints=(f"use a tp that divides {g} ({', '.join(map(str, _divisors(g)))})",))
    if tp > g and tp % g:
        raise PipecError(f"tp {tp} is larger than devices_per_node {g} and not a multiple of it: a tp group "
                         "would hold part of a node", key="tp",
                         hints=(f"use a tp that divides {g} ({', '.join(map(str, _divisors(g)))}) to keep each "
                                f"tp group inside a node, or a multiple of {g}",))


def tp_notes(mesh: Mesh) -> list[str]:
    """Warnings about a legal but costly tp: a tp group across nodes (``tp`` > ``devices_per_node``)."""
    tp, g = mesh.tp, mesh.devices_per_node
    if g is None or tp <= g:
        return []
    return [f"tp {tp} is larger than devices_per_node {g}: each tp group spans {tp // g} nodes, so every tp "
            "collective (an all-reduce per sharded layer pair, forward and backward, every microbatch) crosses "
            "the inter-node link; keep tp within a node (tp <= devices_per_node) and use pp or dp across nodes"]


def check_node_size(devices_per_node: int, num_devices: int, what: str) -> None:
    """``devices_per_node`` must be >= 1 and divide ``num_devices`` (``what`` names it) or be at least it."""
    g, n = devices_per_node, num_devices
    fix = (f"use a divisor of {n} ({', '.join(map(str, _divisors(n)))}), or {n} or more (one node holds "
           "every rank)",)
    if g < 1:
        raise PipecError(f"devices_per_node must be at least 1, got {g}", key="devices_per_node", hints=fix)
    if g < n and n % g:
        raise PipecError(f"devices_per_node {g} must divide {what} or be at least it: nodes are whole groups "
                         f"of {g} consecutive global ranks, and {n} ranks leave a node of {n % g}",
                         key="devices_per_node", hints=fix)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def chain_edges(num_stages: int) -> tuple[Edge, ...]:
    """The stage graph of a schedule-only plan: stage s feeds stage s+1."""
    return tuple(Edge(src_stage=s, dst_stage=s + 1) for s in range(num_stages - 1))


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A compiled plan. ``edges`` is never empty between stages: a plan built or read without
    edges (a schedule-only plan) gets the chain, so no pass needs a fallback."""

    mesh: Mesh
    num_stages: int
    num_microbatches: int
    placement: tuple[int, ...]
    program: Program
    stages: tuple[Stage, ...] = ()
    edges: tuple[Edge, ...] = ()
    ties: tuple[Tie, ...] = ()
    links: Mapping[str, Link] = field(default_factory=lambda: dict(DEFAULT_LINKS))
    """Per axis: ``pp`` (point to point), ``dp`` (dp all-reduce, sharding's collectives), optionally ``tie``
    (the tie all-reduces; absent: ``pp``), ``shard`` (all-gather / reduce-scatter; absent: ``dp``), and
    ``intra`` / ``inter`` (within a node / across nodes: with ``mesh.devices_per_node`` they price each
    hop and collective by where its ranks sit, :func:`pipec.compiler.sim.simulate.plan_costs`)."""
    overhead: Overhead | None = None
    """The executor's host time per instruction kind (None: free, as in plans before it was measured)."""
    spec: Mapping[str, Any] = field(default_factory=dict)
    """plan.json's ``spec``: the resolved keys that the plan's other fields do not hold (the schedule, the
    model's input and partition, costs, the training settings; :meth:`~pipec.compiler.request.CompileRequest.
    spec_json` writes it from the compile request)."""
    model: Mapping[str, Any] | None = None
    prediction: Timeline | None = None
    pipec_version: str = ""

    def __post_init__(self) -> None:
        if not self.edges and self.num_stages > 1:
            object.__setattr__(self, "edges", chain_edges(self.num_stages))

    @property
    def unit_costs(self) -> bool:
        """Costs are units, not seconds: a schedule-only plan, or a model plan compiled with ``costs unit``."""
        return self.model is None or self.spec.get("costs") == "unit"

    def tie(self, name: str) -> Tie:
        """The tie group called ``name`` (its canonical parameter name)."""
        for t in self.ties:
            if t.name == name:
                return t
        raise KeyError(f"no tied weight {name!r} in the plan (ties: {', '.join(t.name for t in self.ties) or 'none'})")

    def tie_ranks(self, name: str) -> tuple[int, ...]:
        """The pp ranks holding a copy of tied weight ``name``, in order (its tie group)."""
        return self.tie(name).ranks(self.placement)


def local_specs(plan: "Plan", src: int, tensors: Sequence[TensorSpec]) -> tuple[TensorSpec, ...]:
    """An edge's tensors as each tp rank sends and receives them: with sequence parallelism, the outputs its
    producer sends as parts (:attr:`~pipec.compiler.ir.tensor_parallel.StageTP.seq_outputs`) have the sequence
    dim divided by tp (the plan's signatures are the model's, whole)."""
    record = plan.stages[src].tp if plan.stages and src < len(plan.stages) else None
    if record is None or plan.mesh.tp == 1 or not record.seq_outputs:
        return tuple(tensors)
    out = []
    for t in tensors:
        d = record.seq_dim(t.name)
        out.append(t if d is None else replace(
            t, shape=tuple(n // plan.mesh.tp if i == d else n for i, n in enumerate(t.shape))))
    return tuple(out)


def check_limits(*, pp: int, num_stages: int, num_microbatches: int, instructions: int | None = None) -> None:
    """Refuse configurations beyond DESIGN's limits, before any work is done (``tp``'s is :func:`check_tp`'s)."""
    got = {"pp": pp, "num_stages": num_stages, "num_microbatches": num_microbatches}
    if instructions is not None:
        got["instructions"] = instructions
    names = {"pp": "pp ranks", "num_stages": "stages", "num_microbatches": "microbatches",
             "instructions": "instructions"}
    for key, value in got.items():
        if value > LIMITS[key]:
            raise PlanError(
                f"{value} {names[key]} is beyond pipec's limit of {LIMITS[key]}; "
                f"use at most {LIMITS[key]} {names[key]}"
            )

