"""plan.json: the plan written and read, format ``pipec.plan/3``; older formats read through one adapter each.

:func:`write_plan` writes small fields indented and one instruction and one
event per line; :func:`read_plan` (:func:`load_plan` for parsed JSON) checks
the whole schema and names the exact field of a malformed file, and refuses
inputs beyond :data:`~pipec.compiler.limits.LIMITS` instead of attempting
them. Each value appears once: the mesh (``shard`` and ``tp`` among it) in
``mesh``, the stage count and placement in ``num_stages`` and ``placement``,
the model's factory and arguments in ``model``, the links in ``links``, and in
``spec`` only the resolved keys none of those hold
(:meth:`~pipec.compiler.request.CompileRequest.spec_json`).

The reader reads :data:`FORMAT` only. A plan of an older format is first
brought up to it by :func:`upgrade`: :data:`UPGRADES` holds, per older
version, a function from that version's dict to the next version's, applied
in turn (``pipec.plan/1`` -> ``/2`` -> ``/3``). A changed field bumps the
version and adds the adapter from the one before; a field that is new and
optional (absent meaning what it meant before it existed) does not. A format
this pipec does not know, a newer one included, is refused.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Any, Callable, Mapping

from pipec.compiler.ir.plan import (
    DEFAULT_LINKS,
    UNIT_COST,
    Cost,
    Edge,
    Link,
    Measured,
    Mesh,
    Overhead,
    Plan,
    PlanError,
    TensorSpec,
    Stage,
    Tie,
    check_limits,
    check_nodes,
    check_shard,
    check_tp,
)
from pipec.compiler.ir.tensor_parallel import StageTP
from pipec.compiler.ir.program import DP_GROUPS, FIELDS, GROUP_OPS, IRError, Instruction, Op, Program
from pipec.compiler.ir.schema import Reader, SchemaError
from pipec.compiler.ir.timeline import Timeline
from pipec.compiler.limits import LIMITS
from pipec.errors import PipecError
from pipec.schedules.order import gc_paused

__all__ = [
    "FORMAT",
    "FORMAT_V1",
    "FORMAT_V2",
    "UPGRADES",
    "READS",
    "ELSEWHERE",
    "upgrade",
    "read_plan",
    "load_plan",
    "read_links",
    "read_overhead",
    "write_plan",
    "plan_to_json",
]

FORMAT = "pipec.plan/3"
"""The format this module writes and :func:`load_plan` reads (older ones through :func:`upgrade`). Changed from
``pipec.plan/2``: a stage's tp record no longer repeats the degree (``stages[].tp.tp``; it is ``mesh.tp``)."""
FORMAT_V2 = "pipec.plan/2"
"""Each value in one home (changed from ``pipec.plan/1``: ``spec`` no longer repeats the plan's fields)."""
FORMAT_V1 = "pipec.plan/1"
"""The first format."""

ELSEWHERE: Mapping[str, str] = {
    "pp": "mesh.pp", "dp": "mesh.dp", "shard": "mesh.shard", "shard_size": "mesh.shard_size",
    "devices_per_node": "mesh.devices_per_node", "tp": "mesh.tp", "sequence_parallel": "mesh.sequence_parallel",
    "stages": "num_stages",
    "virtual": "num_stages / mesh.pp",
    "placement": "placement", "microbatches": "num_microbatches", "model": "model.target",
    "model_args": "model.kwargs", "links": "links",
}
"""Keys a ``pipec.plan/1`` spec repeated, and the field of the plan that holds each: since ``pipec.plan/2`` a
spec has none of them."""


# ----------------------------------------------------------------------------- writing


def _instr_json(ins: Instruction) -> dict[str, Any]:
    d: dict[str, Any] = {"op": ins.op.value}
    for name in FIELDS[ins.op]:
        d[name] = getattr(ins, name)
    if ins.batch is not None:
        d["batch"] = ins.batch
    return d


def _mesh_json(mesh: Mesh) -> dict[str, Any]:
    """plan.json's ``mesh``: ``tp`` above 1, ``sequence_parallel`` on, ``shard``, ``shard_size`` and
    ``devices_per_node`` only when set (absent: tp 1, off, none, all of dp, not said)."""
    out: dict[str, Any] = {"pp": mesh.pp, "dp": mesh.dp}
    if mesh.tp != 1:
        out["tp"] = mesh.tp
    if mesh.sequence_parallel:
        out["sequence_parallel"] = True
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
    if link.spread is not None:
        out["spread"] = link.spread
    if link.samples is not None:
        out["samples"] = list(link.samples)
    return out


def _cost_spreads(c: Cost) -> dict[str, float]:
    """A cost's measured spreads as plan.json writes them (each absent where not measured)."""
    return {k: v for k, v in (("spread", c.spread), ("level_spread", c.level_spread),
                              ("crowd_spread", c.crowd_spread)) if v is not None}


def _sig_json(s: TensorSpec) -> dict[str, Any]:
    return {"name": s.name, "shape": list(s.shape), "dtype": s.dtype}


def plan_to_json(plan: Plan) -> dict[str, Any]:
    """The plan as a JSON-ready dict (``ranks`` included)."""
    out: dict[str, Any] = {"format": FORMAT, "pipec_version": plan.pipec_version, "spec": dict(plan.spec)}
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
                     "optim": st.cost.optim, **_cost_spreads(st.cost)},
        }
        if st.activation_bytes is not None:
            d["activation_bytes"] = st.activation_bytes
        if st.param_bytes is not None:
            d["param_bytes"] = st.param_bytes
        if st.num_params is not None:
            d["num_params"] = st.num_params
        if st.param_shapes:
            d["param_shapes"] = [list(shape) for shape in st.param_shapes]
        if st.tp is not None:
            d["tp"] = st.tp.to_json()
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
            {} if plan.overhead.spread is None else {"spread": dict(plan.overhead.spread)}) | (
            {} if plan.overhead.samples is None
            else {"samples": {k: list(v) for k, v in plan.overhead.samples.items()}}) | (
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
                f'[{e.rank},{json.dumps(e.text)},{e.start!r},{e.end!r}]' for e in plan.prediction.events))
            f.write("\n ]}")
        f.write("\n}\n")


# ----------------------------------------------------------------------------- reading


def _sigs(rd: Reader, key: str) -> tuple[TensorSpec, ...]:
    out = []
    for s in rd.items(key, required=False):
        out.append(TensorSpec(s.str("name"), s.str("dtype"), s.ints("shape", lo=0)))
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


def _stage_tp(rd: Reader) -> StageTP | None:
    """A stage's ``tp`` (:meth:`StageTP.to_json`): absent in a plan at tp 1 or from before tensor parallelism; the
    ``tp`` field of a record written before the degree lived on ``mesh.tp`` alone is ignored."""
    raw = rd.dict("tp", required=False)
    if raw is None:
        return None
    try:
        return StageTP.from_json(raw)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise rd.error("tp", f"expected a stage's tensor-parallel record (modules, params, collectives; "
                       f"{type(e).__name__}: {e})", raw) from None


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
        bounds = {"stage": num_stages, "to_stage": num_stages, "from_stage": num_stages, "microbatch": num_mb,
                  "peer": num_ranks}
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


# ----------------------------------------------------------------------------- older formats


_V1_UNUSED = ("policy", "order", "input", "targets")
"""Keys a ``pipec.plan/1`` spec wrote as null where they did not apply."""


def _v1_to_v2(obj: dict[str, Any], where: str) -> dict[str, Any]:
    """``pipec.plan/1`` -> ``/2``. The spec without the keys the plan holds elsewhere (:data:`ELSEWHERE`: v1
    repeated them), without what did not apply (a null policy, order, input or targets; a schedule-only plan's
    partition and trace), an order as its ranks; a stage's cost with ``optim`` (0 in a v1 plan from before the
    optimizer step was costed)."""
    out = dict(obj, format=FORMAT_V2)
    spec = obj.get("spec")
    if isinstance(spec, dict):
        has_model = obj.get("model") is not None
        spec = {k: v for k, v in spec.items() if k not in ELSEWHERE and not (k in _V1_UNUSED and v is None)
                and (has_model or k not in ("partition", "trace"))}
        if isinstance(spec.get("order"), dict):
            spec["order"] = {"ranks": spec["order"].get("ranks")}
        out["spec"] = spec
    stages = obj.get("stages")
    if isinstance(stages, list):
        no_optim = lambda st: isinstance(st, dict) and isinstance(st.get("cost"), dict) and (  # noqa: E731
            st["cost"].get("optim") is None)
        out["stages"] = [dict(st, cost=dict(st["cost"], optim=0.0)) if no_optim(st) else st for st in stages]
    return out


def _v2_to_v3(obj: dict[str, Any], where: str) -> dict[str, Any]:
    """``pipec.plan/2`` -> ``/3``: a stage's tp record without ``tp``, the degree it repeated; it must equal
    ``mesh.tp`` (absent: 1), the degree's one home."""
    out = dict(obj, format=FORMAT)
    stages = obj.get("stages")
    if not isinstance(stages, list):
        return out
    mesh = obj.get("mesh")
    tp = mesh.get("tp") if isinstance(mesh, dict) else None
    tp = 1 if tp is None else tp
    out["stages"] = []
    for i, st in enumerate(stages):
        if isinstance(st, dict) and isinstance(st.get("tp"), dict):
            record = dict(st["tp"])
            degree = record.pop("tp", None)
            if type(tp) is int and (type(degree) is not int or degree != tp):  # a malformed mesh.tp: the reader's
                raise PlanError(f"{where}.stages[{i}].tp.tp: the stage's tensor-parallel record is for tp "
                                f"{degree!r:.60}, but mesh.tp is {tp}; recompile the plan for tp {tp}")
            st = dict(st, tp=record)
        out["stages"].append(st)
    return out


UPGRADES: Mapping[str, tuple[str, Callable[[dict[str, Any], str], dict[str, Any]]]] = {
    FORMAT_V1: (FORMAT_V2, _v1_to_v2),
    FORMAT_V2: (FORMAT, _v2_to_v3),
}
"""Per older format, the next one and the adapter from a plan of the old format (parsed JSON; ``where`` names
it in messages) to one of the next: :func:`upgrade` applies them in turn."""

READS = (FORMAT_V1, FORMAT_V2, FORMAT)
"""The plan.json formats this pipec reads."""

_VERSION = re.compile(r"pipec\.plan/([0-9]+)")


def upgrade(obj: Any, where: str = "plan") -> Any:
    """Parsed plan.json in :data:`FORMAT`: each older version's adapter applied in turn (``obj`` itself is left
    as it was). A format this pipec does not read, a newer one included, is refused: what it got, the formats
    this pipec reads, and to compile the plan again."""
    rd = Reader(obj, where)
    fmt = rd.str("format")
    while fmt != FORMAT:
        if fmt not in UPGRADES:
            reads = ", ".join(READS)
            m = _VERSION.fullmatch(fmt)
            if m and int(m.group(1)) > int(_VERSION.fullmatch(FORMAT).group(1)):
                by = obj.get("pipec_version")
                raise PlanError(f"{where}.format: {fmt!r} is newer than this pipec reads ({reads})"
                                + (f"; the plan was written by pipec {by}" if isinstance(by, str) and by else "")
                                + "; compile it again with this pipec (pipec compile), or read it with the "
                                "pipec that wrote it")
            raise PlanError(f"{where}.format: expected a plan.json format this pipec reads ({reads}), got "
                            f"{fmt!r:.60}; compile the plan again with this pipec (pipec compile)")
        fmt, adapt = UPGRADES[fmt]
        obj = adapt(obj, where)
    return obj


# ----------------------------------------------------------------------------- the plan


def load_plan(obj: Any, where: str = "plan") -> Plan:
    """Build a :class:`Plan` from parsed JSON of any format :data:`READS` names (:func:`upgrade`), checking the
    whole schema."""
    try:
        rd = Reader(upgrade(obj, where), where)
        mesh_rd = rd.sub("mesh")
        mesh = Mesh(pp=mesh_rd.int("pp", lo=1), dp=mesh_rd.int("dp", lo=1),
                    shard=mesh_rd.str("shard", required=False) or "none",
                    shard_size=mesh_rd.int("shard_size", lo=1, required=False),
                    devices_per_node=mesh_rd.int("devices_per_node", lo=1, required=False),
                    tp=mesh_rd.int("tp", lo=1, required=False) or 1,
                    sequence_parallel=mesh_rd.bool("sequence_parallel", required=False) or False)
        try:
            check_tp(mesh)
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
                optim=c.num("optim", lo=0), spread=c.num("spread", lo=0, required=False),
                level_spread=c.num("level_spread", lo=0, required=False),
                crowd_spread=c.num("crowd_spread", lo=0, required=False),
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
                tp=_stage_tp(s),
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
        model = rd.dict("model", required=False)
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
            spec=_spec(rd),
            model=model,
            prediction=None if pred is None else Timeline.from_json(pred, f"{where}.prediction"),
            pipec_version=rd.str("pipec_version", required=False) or "",
        )
    except (SchemaError, IRError) as e:
        if isinstance(e, PlanError):
            raise
        raise PlanError(str(e)) from None


def _spec(rd: Reader) -> dict[str, Any]:
    """The plan's ``spec``: it may not repeat a key the plan holds elsewhere (:data:`ELSEWHERE`)."""
    spec = rd.dict("spec", required=False) or {}
    for key in spec:
        if key in ELSEWHERE:
            raise rd.error(f"spec.{key}", f"plan.json keeps {key} in {ELSEWHERE[key]}, not in spec", spec[key])
    return spec


def _read_measured(rd: Reader) -> Measured | None:
    m = rd.sub("measured", required=False)
    if m is None:
        return None
    return Measured(at=m.str("at"), backend=m.str("backend"), num_ranks=m.int("ranks", lo=1, required=False) or 2,
                    host=m.str("host", required=False) or "", reused=m.bool("reused", required=False) or False)


def read_links(rd: Reader) -> dict[str, Link]:
    """The ``links`` of a plan (or of a probe's links file): every axis given, over the defaults."""
    links_rd = rd.sub("links", required=False)
    links = dict(DEFAULT_LINKS)
    if links_rd is not None:
        for axis in links_rd.obj:
            lk = links_rd.sub(axis)
            links[axis] = Link(latency_s=lk.num("latency_s", lo=0), bandwidth_Bps=lk.num("bandwidth_Bps", lo=1e-30),
                               measured=_read_measured(lk), spread=lk.num("spread", lo=0, required=False),
                               samples=_samples(lk, "samples"))
    return links


def _samples(rd: Reader, key: str) -> tuple[float, ...] | None:
    """A non-empty list of measured seconds, each a number >= 0 (a probe's samples), or None where absent."""
    items = rd.list(key, required=False)
    if items is None:
        return None
    if not items:
        raise rd.error(key, "expected a non-empty list of seconds", items)
    for i, v in enumerate(items):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0:
            raise rd.error(f"{key}[{i}]", "expected a number >= 0 (seconds)", v)
    return tuple(float(v) for v in items)


def read_overhead(rd: Reader) -> Overhead | None:
    """A plan's ``overhead`` (absent where the link probe did not measure it)."""
    o = rd.sub("overhead", required=False)
    if o is None:
        return None
    secs = o.sub("seconds")
    names = {op.value for op in Op}
    for name in secs.obj:
        if name not in names:
            raise secs.error(name, "expected an opcode name (" + ", ".join(sorted(names)) + ")", name)
    spread = o.sub("spread", required=False)
    samples = o.sub("samples", required=False)
    for part in (spread, samples):
        for name in () if part is None else part.obj:
            if name not in names:
                raise part.error(name, "expected an opcode name (" + ", ".join(sorted(names)) + ")", name)
    return Overhead(seconds={name: secs.num(name, lo=0) for name in secs.obj}, measured=_read_measured(o),
                    spread=None if spread is None else {name: spread.num(name, lo=0) for name in spread.obj},
                    samples=None if samples is None else {name: _samples(samples, name) for name in samples.obj})


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
