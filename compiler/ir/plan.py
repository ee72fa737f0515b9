"""plan.json (format ``pipec.plan/1``): the compiled plan, its types, reader and writer.

Every part of the compiler writes its fields (see DESIGN.md): the language
writes ``spec``, the tracer ``model``, the partitioner ``stages``, ``edges``
and ``ties``, the lowering ``ranks`` (here: ``program``), the simulator
``prediction``. A schedule-only plan has no ``model``, unit costs and
stages without signatures. :func:`read_plan` checks the whole schema and
names the exact field of a malformed file; inputs beyond :data:`LIMITS` are
refused, not attempted.

About 700 lines: the format's value types (the :class:`Mesh` with its rank and
node arithmetic among them), its writer and its schema-checking reader change
together with every new field, so they stay in one module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from pipec.compiler.ir.program import DP_GROUPS, FIELDS, GROUP_OPS, IRError, Instruction, Op, Program
from pipec.compiler.ir.schema import Reader, SchemaError
from pipec.compiler.ir.timeline import Timeline
from pipec.errors import PipecError
from pipec.schedules.order import gc_paused
from pipec.schedules.timing import UNIT, Cost

__all__ = [
    "FORMAT",
    "LIMITS",
    "PlanError",
    "Signature",
    "Cost",
    "Stage",
    "Edge",
    "Tie",
    "Link",
    "Measured",
    "Overhead",
    "SHARD_MODES",
    "Mesh",
    "check_shard",
    "check_nodes",
    "check_node_size",
    "Plan",
    "chain_edges",
    "check_limits",
    "read_plan",
    "read_links",
    "read_overhead",
    "load_plan",
    "write_plan",
    "plan_to_json",
]

FORMAT = "pipec.plan/1"

LIMITS = {"pp": 4096, "num_stages": 65536, "num_microbatches": 65536, "instructions": 5_000_000}
"""Checked before lowering and when reading a plan."""


class PlanError(SchemaError):
    """A plan file is unreadable, malformed, or beyond the limits."""


@dataclass(frozen=True, slots=True)
class Signature:
    """A tensor crossing a stage boundary: name, shape and dtype (``"float32"``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def num_bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * _DTYPE_BYTES.get(self.dtype, 4)


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
    inputs: tuple[Signature, ...] = ()
    outputs: tuple[Signature, ...] = ()
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


@dataclass(frozen=True, slots=True, kw_only=True)
class Edge:
    """Data flows from ``src_stage`` to ``dst_stage`` (a skip edge may jump stages)."""

    src_stage: int
    dst_stage: int
    tensors: tuple[Signature, ...] = ()

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

    def to_json(self) -> dict[str, Any]:
        return {"at": self.at, "backend": self.backend, "ranks": self.num_ranks} | ({"host": self.host} if self.host else {})


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    latency_s: float
    bandwidth_Bps: float
    measured: Measured | None = None
    """Set when a probe measured this link (``costs profile``, ``pipec.runtime.linkprobe``); None: given or
    the default."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Overhead:
    """The executor's own host time per instruction, by opcode name (plan.json ``overhead``): what the
    simulator charges on top of each instruction's work (:class:`~pipec.compiler.sim.engine.CostModel`)."""

    seconds: Mapping[str, float]
    """Opcode name (``"FWD"``, ``"SEND_ACT"``, ...) -> seconds per instruction; a missing opcode is free."""
    measured: Measured | None = None


DEFAULT_LINKS: Mapping[str, Link] = {
    "pp": Link(latency_s=1e-5, bandwidth_Bps=25e9),
    "dp": Link(latency_s=1e-5, bandwidth_Bps=25e9),
}


SHARD_MODES = ("none", "optimizer", "grads", "full")
"""Key ``shard``: how the dp replicas share a stage's state. ``optimizer`` (ZeRO-1): optimizer state
sharded; ``grads`` (FSDP2 ``reshard_after_forward=False``, ZeRO-2): gradients and optimizer state
sharded, parameters sharded at rest and gathered once per step; ``full`` (ZeRO-3, FSDP FULL_SHARD):
parameters resharded after each forward and gathered again for the backward."""


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

    @property
    def num_shards(self) -> int:
        """The effective shard size: ranks one stage's state is sharded over (1 when not sharded)."""
        if self.shard == "none":
            return 1
        return self.dp if self.shard_size is None else self.shard_size

    @property
    def sharded(self) -> bool:
        """Some state is sharded across dp (``shard`` is not ``none``)."""
        return self.shard != "none"

    @property
    def params_sharded(self) -> bool:
        """Parameters are sharded at rest and gathered by ``UNSHARD`` (``shard grads`` or ``full``)."""
        return self.shard in ("grads", "full")

    @property
    def hybrid(self) -> bool:
        """HSDP: shard groups smaller than dp, replicated across each other."""
        return self.sharded and self.num_shards < self.dp

    @property
    def shard_group(self) -> str:
        """The group a stage's state is sharded over: ``dp``, or ``dp.shard`` under HSDP."""
        return "dp.shard" if self.hybrid else "dp"

    def group_ranks(self, group: str, global_rank: int) -> tuple[int, ...]:
        """The global ranks of the dp group ``group`` (``dp``, ``dp.shard``, ``dp.replicate``) that
        ``global_rank`` belongs to, in dp order. Shard groups are consecutive dp ranks; a replicate
        group holds the same position in each shard group."""
        pp, d = self.coords(global_rank)
        n = self.num_shards if self.hybrid else self.dp
        if group == "dp":
            return tuple(self.replicas(pp))
        if group == "dp.shard":
            first = d - d % n
            return tuple(self.global_rank(pp, x) for x in range(first, first + n))
        if group == "dp.replicate":
            return tuple(self.global_rank(pp, x) for x in range(d % n, self.dp, n))
        raise KeyError(f"{group!r} is not a dp group (dp, dp.shard, dp.replicate)")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    def coords(self, global_rank: int) -> tuple[int, int]:
        """(pp rank, dp rank) of a global rank; global rank = pp x dp_size + dp."""
        return divmod(global_rank, self.dp)

    def global_rank(self, pp: int, dp: int = 0) -> int:
        """The global rank of (pp rank, dp rank): pp x dp_size + dp, so replicas are neighbours."""
        return pp * self.dp + dp

    def replicas(self, pp: int) -> range:
        """The global ranks of pp rank ``pp``'s dp replicas (its dp group)."""
        return range(pp * self.dp, (pp + 1) * self.dp)

    def where(self, global_rank: int) -> str:
        """``global rank G (pp P, dp D)``: how messages name a rank."""
        pp, dp = self.coords(global_rank)
        return f"global rank {global_rank} (pp {pp}, dp {dp})"

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
        check_node_size(mesh.devices_per_node, mesh.world_size,
                        f"the world size pp x dp = {mesh.pp} x {mesh.dp} = {mesh.world_size}")


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
    model: Mapping[str, Any] | None = None
    prediction: Timeline | None = None
    pipec_version: str = ""
    format: str = FORMAT

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


# ----------------------------------------------------------------------------- writing


def _instr_json(ins: Instruction) -> dict[str, Any]:
    d: dict[str, Any] = {"op": ins.op.value}
    for name in FIELDS[ins.op]:
        d[name] = getattr(ins, name)
    if ins.batch is not None:
        d["batch"] = ins.batch
    return d


def _mesh_json(mesh: Mesh) -> dict[str, Any]:
    """plan.json's ``mesh``: ``shard``, ``shard_size`` and ``devices_per_node`` only when set (absent: none,
    all of dp, not said)."""
    out: dict[str, Any] = {"pp": mesh.pp, "dp": mesh.dp}
    if mesh.shard != "none":
        out["shard"] = mesh.shard
    if mesh.shard_size is not None:
        out["shard_size"] = mesh.shard_size
    if mesh.devices_per_node is not None:
        out["devices_per_node"] = mesh.devices_per_node
    return out


def _link_json(link: Link) -> dict[str, Any]:
    out: dict[str, Any] = {"latency_s": link.latency_s, "bandwidth_Bps": link.bandwidth_Bps}
    if link.measured is not None:
        out["measured"] = link.measured.to_json()
    return out


def _sig_json(s: Signature) -> dict[str, Any]:
    return {"name": s.name, "shape": list(s.shape), "dtype": s.dtype}


def plan_to_json(plan: Plan) -> dict[str, Any]:
    """The plan as a JSON-ready dict (``ranks`` included)."""
    out: dict[str, Any] = {"format": plan.format, "pipec_version": plan.pipec_version, "spec": dict(plan.spec)}
    if plan.model is not None:
        out["model"] = dict(plan.model)
    out["mesh"] = _mesh_json(plan.mesh)
    out["num_stages"] = plan.num_stages
    out["num_microbatches"] = plan.num_microbatches
    out["placement"] = list(plan.placement)
    stages = []
    for st in plan.stages:
        d: dict[str, Any] = {
            "stage": st.stage,
            "rank": st.rank,
            "nodes": list(st.nodes),
            "params": list(st.params),
            "inputs": [_sig_json(s) for s in st.inputs],
            "outputs": [_sig_json(s) for s in st.outputs],
            "cost": {"fwd": st.cost.fwd, "bwd": st.cost.bwd, "bwd_i": st.cost.bwd_i, "bwd_w": st.cost.bwd_w,
                     "optim": st.cost.optim},
        }
        if st.activation_bytes is not None:
            d["activation_bytes"] = st.activation_bytes
        if st.param_bytes is not None:
            d["param_bytes"] = st.param_bytes
        if st.num_params is not None:
            d["num_params"] = st.num_params
        if st.param_shapes:
            d["param_shapes"] = [list(shape) for shape in st.param_shapes]
        stages.append(d)
    out["stages"] = stages
    out["edges"] = [
        {"src_stage": e.src_stage, "dst_stage": e.dst_stage, "tensors": [_sig_json(t) for t in e.tensors]}
        for e in plan.edges
    ]
    out["ties"] = [
        {"name": t.name, "stages": list(t.stages), "params": list(t.params)}
        | ({} if t.num_bytes is None else {"num_bytes": t.num_bytes})
        for t in plan.ties
    ]
    out["links"] = {k: _link_json(v) for k, v in plan.links.items()}
    if plan.overhead is not None:
        out["overhead"] = {"seconds": dict(plan.overhead.seconds)} | (
            {} if plan.overhead.measured is None else {"measured": plan.overhead.measured.to_json()})
    out["ranks"] = [
        {"rank": r, "instructions": [_instr_json(i) for i in instrs]} for r, instrs in enumerate(plan.program.ranks)
    ]
    if plan.prediction is not None:
        out["prediction"] = plan.prediction.to_json()
    return out


_OP_NAME = {op: op.value for op in Op}  # Enum.value is a slow property on this hot path


def _instr_line(ins: Instruction) -> str:
    """One instruction as compact JSON, formatted directly (json.dumps per instruction is the slow part)."""
    op = ins.op
    name = _OP_NAME[op]
    if op is Op.FWD or op is Op.BWD or op is Op.BWD_I or op is Op.BWD_W:
        return f'{{"op":"{name}","stage":{ins.stage},"microbatch":{ins.microbatch}}}'
    if op is Op.OPTIM_STEP:
        return '{"op":"OPTIM_STEP"}'
    if op in GROUP_OPS:
        return f'{{"op":"{name}","stage":{ins.stage},"group":{json.dumps(ins.group)}}}'
    other = f'"to_stage":{ins.to_stage}' if ins.to_stage is not None else f'"from_stage":{ins.from_stage}'
    batch = "" if ins.batch is None else f',"batch":{ins.batch}'
    return f'{{"op":"{name}","stage":{ins.stage},"microbatch":{ins.microbatch},{other},"peer":{ins.peer}{batch}}}'


def write_plan(plan: Plan, path: str) -> None:
    """Write plan.json: small fields indented, one instruction and one event per line."""
    head = plan_to_json(replace(plan, program=Program(()), prediction=None))
    del head["ranks"]
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(head, indent=1)[:-2])  # without the closing "\n}"
        f.write(',\n "ranks": [')
        for r, instrs in enumerate(plan.program.ranks):
            f.write(("," if r else "") + f'\n  {{"rank": {r}, "instructions": [\n   ')
            f.write(",\n   ".join(map(_instr_line, instrs)))
            f.write("\n  ]}")
        f.write("\n ]")
        if plan.prediction is not None:
            pred = plan.prediction.to_json(events=False)
            f.write(',\n "prediction": ' + json.dumps(pred, separators=(",", ":"))[:-1])
            f.write(',"events":[\n   ')
            f.write(",\n   ".join(
                f'[{e.rank},{json.dumps(e.op)},{e.start!r},{e.end!r}]' for e in plan.prediction.events))
            f.write("\n ]}")
        f.write("\n}\n")


# ----------------------------------------------------------------------------- reading


def check_limits(*, pp: int, num_stages: int, num_microbatches: int, instructions: int | None = None) -> None:
    """Refuse configurations beyond DESIGN's limits, before any work is done."""
    got = {"pp": pp, "num_stages": num_stages, "num_microbatches": num_microbatches}
    if instructions is not None:
        got["instructions"] = instructions
    names = {"pp": "pp ranks", "num_stages": "stages", "num_microbatches": "microbatches", "instructions": "instructions"}
    for key, value in got.items():
        if value > LIMITS[key]:
            raise PlanError(
                f"{value} {names[key]} is beyond pipec's limit of {LIMITS[key]}; "
                f"use at most {LIMITS[key]} {names[key]}"
            )


def _sigs(rd: Reader, key: str) -> tuple[Signature, ...]:
    out = []
    for s in rd.items(key, required=False):
        out.append(Signature(s.str("name"), s.ints("shape", lo=0), s.str("dtype")))
    return tuple(out)


_GROUPS_OF = {Op.ALLREDUCE: ("dp", "dp.replicate"), Op.UNSHARD: DP_GROUPS[:2], Op.RESHARD: DP_GROUPS[:2],
              Op.REDUCE_SCATTER: DP_GROUPS[:2]}
"""The dp groups each group opcode may name (an all-reduce also a tie group)."""


def _shapes(rd: Reader, num_params: int) -> tuple[tuple[int, ...], ...]:
    """A stage's ``param_shapes``: absent, or one shape per parameter."""
    raw = rd.list("param_shapes", required=False)
    if raw is None:
        return ()
    if len(raw) != num_params or not all(isinstance(sh, list) and all(type(d) is int and d >= 0 for d in sh)
                                         for sh in raw):
        raise rd.error("param_shapes", f"expected one shape (a list of sizes) per parameter ({num_params})",
                       raw)
    return tuple(tuple(sh) for sh in raw)


def _read_instructions(rd: Reader, num_ranks: int, num_stages: int, num_mb: int) -> Program:
    ranks = []
    seen = 0
    for r, rank_rd in enumerate(rd.items("ranks")):
        got_rank = rank_rd.int("rank")
        if got_rank != r:
            raise rank_rd.error("rank", f"expected {r} (ranks are listed in order)", got_rank)
        raw = rank_rd.list("instructions")
        seen += len(raw)
        if seen > LIMITS["instructions"]:
            raise PlanError(f"{rd.where}.ranks: more than {LIMITS['instructions']} instructions; refused")
        out = []
        bounds = {"stage": num_stages, "to_stage": num_stages, "from_stage": num_stages, "microbatch": num_mb, "peer": num_ranks}
        for i, d in enumerate(raw):
            where = f"{rd.where}.ranks[{r}].instructions[{i}]"
            if not isinstance(d, dict):
                raise PlanError(f"{where}: expected an object, got {d!r:.60}")
            try:
                op = Op(d.get("op"))
            except ValueError:
                raise PlanError(
                    f"{where}.op: unknown opcode {d.get('op')!r}; expected one of "
                    + ", ".join(o.value for o in Op)
                ) from None
            kw: dict[str, Any] = {}
            for name in FIELDS[op]:
                v = d.get(name)
                if name == "group":
                    if not isinstance(v, str) or v not in _GROUPS_OF[op] and not (
                            op is Op.ALLREDUCE and v.startswith("tie.")):
                        want = ("'dp' or 'tie.<name>' (HSDP: 'dp.replicate')" if op is Op.ALLREDUCE else
                                "'dp' or 'dp.shard' (HSDP)")
                        raise PlanError(f"{where}.group: expected {want}, got {v!r:.60}")
                elif type(v) is not int or not 0 <= v < bounds[name]:
                    raise PlanError(f"{where}.{name}: expected an integer in 0..{bounds[name] - 1}, got {v!r:.60}")
                kw[name] = v
            extra = set(d) - set(FIELDS[op]) - {"op", "batch"}
            if extra:
                raise PlanError(f"{where}: {op.value} takes no field {sorted(extra)[0]!r}")
            b = d.get("batch")
            if b is not None:
                if type(b) is not int or b < 0:
                    raise PlanError(f"{where}.batch: expected a non-negative integer, got {b!r:.60}")
                if op in GROUP_OPS or op is Op.OPTIM_STEP or op in (Op.FWD, Op.BWD, Op.BWD_I, Op.BWD_W):
                    raise PlanError(f"{where}.batch: only sends and receives can be batched, not {op.value}")
                kw["batch"] = b
            out.append(Instruction(op, **kw))
        ranks.append(tuple(out))
    if len(ranks) != num_ranks:
        raise PlanError(f"{rd.where}.ranks: expected {num_ranks} ranks (mesh.pp), got {len(ranks)}")
    return Program(tuple(ranks))


def load_plan(obj: Any, where: str = "plan") -> Plan:
    """Build a :class:`Plan` from parsed JSON, checking the whole schema."""
    try:
        rd = Reader(obj, where)
        fmt = rd.str("format")
        if fmt != FORMAT:
            raise rd.error("format", f"expected {FORMAT!r}", fmt)
        mesh_rd = rd.sub("mesh")
        mesh = Mesh(pp=mesh_rd.int("pp", lo=1), dp=mesh_rd.int("dp", lo=1),
                    shard=mesh_rd.str("shard", required=False, choices=SHARD_MODES) or "none",
                    shard_size=mesh_rd.int("shard_size", lo=1, required=False),
                    devices_per_node=mesh_rd.int("devices_per_node", lo=1, required=False))
        try:
            check_shard(mesh)
            check_nodes(mesh)
        except PipecError as e:
            raise PlanError(f"{where}.mesh.{e.key}: {e}") from None
        num_stages = rd.int("num_stages", lo=1)
        num_mb = rd.int("num_microbatches", lo=1)
        check_limits(pp=mesh.pp, num_stages=num_stages, num_microbatches=num_mb)
        placement = rd.ints("placement", lo=0, hi=mesh.pp - 1)
        if len(placement) != num_stages:
            raise rd.error("placement", f"expected one pp rank per stage ({num_stages})", list(placement))
        stages = []
        for i, s in enumerate(rd.items("stages", required=False)):
            c = s.sub("cost", required=False)
            cost = UNIT_COST if c is None else Cost(
                fwd=c.num("fwd", lo=0), bwd=c.num("bwd", lo=0), bwd_i=c.num("bwd_i", lo=0), bwd_w=c.num("bwd_w", lo=0),
                optim=c.num("optim", lo=0, required=False) or 0.0,
            )
            params = s.strs("params", required=False) or ()
            stage = Stage(
                stage=s.int("stage", lo=0, hi=num_stages - 1),
                rank=s.int("rank", lo=0, hi=mesh.pp - 1),
                nodes=s.strs("nodes", required=False) or (),
                params=params,
                inputs=_sigs(s, "inputs"),
                outputs=_sigs(s, "outputs"),
                cost=cost,
                activation_bytes=s.int("activation_bytes", lo=0, required=False),
                param_bytes=s.int("param_bytes", lo=0, required=False),
                num_params=s.int("num_params", lo=0, required=False),
                param_shapes=_shapes(s, len(params)),
            )
            if stage.stage != i:
                raise s.error("stage", f"expected {i} (stages are listed in order)", stage.stage)
            if stage.rank != placement[i]:
                raise s.error("rank", f"expected {placement[i]} (placement[{i}])", stage.rank)
            stages.append(stage)
        if stages and len(stages) != num_stages:
            raise rd.error("stages", f"expected {num_stages} stages", f"{len(stages)} stages")
        edges = tuple(
            Edge(
                src_stage=e.int("src_stage", lo=0, hi=num_stages - 1),
                dst_stage=e.int("dst_stage", lo=0, hi=num_stages - 1),
                tensors=_sigs(e, "tensors"),
            )
            for e in rd.items("edges", required=False)
        )
        ties = tuple(
            Tie(
            name=t.str("name"),
            stages=t.ints("stages", lo=0, hi=num_stages - 1),
            params=t.strs("params"),
            num_bytes=t.int("num_bytes", lo=0, required=False),
        )
            for t in rd.items("ties", required=False)
        )
        links = read_links(rd)
        overhead = read_overhead(rd)
        program = _read_instructions(rd, mesh.pp, num_stages, num_mb)
        pred = rd.dict("prediction", required=False)
        return Plan(
            mesh=mesh,
            num_stages=num_stages,
            num_microbatches=num_mb,
            placement=placement,
            program=program,
            stages=tuple(stages),
            edges=edges,
            ties=ties,
            links=links,
            overhead=overhead,
            spec=rd.dict("spec", required=False) or {},
            model=rd.dict("model", required=False),
            prediction=None if pred is None else Timeline.from_json(pred, f"{where}.prediction"),
            pipec_version=rd.str("pipec_version", required=False) or "",
        )
    except (SchemaError, IRError) as e:
        if isinstance(e, PlanError):
            raise
        raise PlanError(str(e)) from None


def _read_measured(rd: Reader) -> Measured | None:
    m = rd.sub("measured", required=False)
    if m is None:
        return None
    return Measured(at=m.str("at"), backend=m.str("backend"), num_ranks=m.int("ranks", lo=1, required=False) or 2,
                    host=m.str("host", required=False) or "")


def read_links(rd: Reader) -> dict[str, Link]:
    """The ``links`` of a plan (or of a probe's links file): every axis given, over the defaults."""
    links_rd = rd.sub("links", required=False)
    links = dict(DEFAULT_LINKS)
    if links_rd is not None:
        for axis in links_rd.obj:
            lk = links_rd.sub(axis)
            links[axis] = Link(latency_s=lk.num("latency_s", lo=0), bandwidth_Bps=lk.num("bandwidth_Bps", lo=1e-30),
                               measured=_read_measured(lk))
    return links


def read_overhead(rd: Reader) -> Overhead | None:
    """A plan's ``overhead`` (absent in plans from before it was measured)."""
    o = rd.sub("overhead", required=False)
    if o is None:
        return None
    secs = o.sub("seconds")
    names = {op.value for op in Op}
    for name in secs.obj:
        if name not in names:
            raise secs.error(name, "expected an opcode name (" + ", ".join(sorted(names)) + ")", name)
    return Overhead(seconds={name: secs.num(name, lo=0) for name in secs.obj}, measured=_read_measured(o))


def read_plan(path: str) -> Plan:
    """Read and schema-check a plan file; errors name the file and the field."""
    try:
        with open(path, encoding="utf-8") as f, gc_paused():
            obj = json.load(f)
    except OSError as e:
        raise PlanError(f"{path}: cannot read plan: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"{path}: not a JSON file: {e}") from None
    try:
        with gc_paused():
            return load_plan(obj)
    except PlanError as e:
        raise PlanError(f"{path}: {e}") from None
