"""The compiler's front end, one entry point: :func:`build_stage_graph`.

It takes the driver's typed :class:`~pipec.compiler.request.CompileRequest` as it is (the model keys in
``model``, the training keys in ``training``, dp, tp and sequence parallelism on the ``mesh``) and a
:class:`Host` (what the machine decides: the threads each rank runs with, the ranks on one machine); it runs
the model layer's passes (:mod:`pipec.model`: load, trace, annotate, weights, partition, stages, data), the costs
(:mod:`pipec.costs`) and, at tp > 1, the tensor-parallel analysis (:mod:`pipec.tp`) in order, and returns the
:class:`~pipec.compiler.ir.graph.StageGraph` that becomes plan.json's ``model``, ``stages``, ``edges`` and
``ties``. :func:`cut_stage_graph` cuts one trace many times (``pipec tune``: the cut's stages, edges, ties and
costs read off the trace's nodes, :mod:`pipec.costs.cutcost`, ``runnable=False``; equal to the full cut).

Every :class:`FrontendError` names the key it is about (``key=``, and ``index=`` for one split point), so the
language can print it at that key.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from pipec.model.lazy_dynamo import defer_dynamo_import

defer_dynamo_import()  # before the first meta op: a compile that needs no dynamo never imports it

from pipec.costs import costs as costs_pass
from pipec.costs.cutcost import FAST_COSTS, NodeTable, cost_split, cut_costs, node_table
from pipec.model.data import check_data_source, data_of
from pipec.compiler.ir.graph import StageGraph, make_graph
from pipec.model.partition import AUTO_BALANCE, Split, analyse_cuts, assign_stages, resolved, split_graph
from pipec.model.stages import materialize
from pipec.compiler.ir.plan import Mesh, Stage
from pipec.compiler.ir.tensor_parallel import StageTP
from pipec.compiler.request import CompileRequest, ModelSpec, Partition, check_batch
from pipec.model.annotate import at_shapes, propagate
from pipec.model.load import ModelSource, instantiate, locate_model
from pipec.model.tensors import FrontendError, TensorSpec, example_inputs, to_dtype
from pipec.model.trace import Traced, trace_model
from pipec.model.weights import EXACT_MAX_PARAMS, INIT_MODES, resolve_init

__all__ = ["Host", "TracedModel", "TensorSpec", "Partition", "FrontendError", "INIT_MODES", "EXACT_MAX_PARAMS",
           "microbatch_inputs", "build_stage_graph", "trace_request", "cut_stage_graph", "with_data",
           "with_recompute_stages", "confirm_cut", "resolve_init"]

_AUTOCAST = ("bfloat16", "float16")


@dataclass(frozen=True, slots=True, kw_only=True)
class Host:
    """What the machine compiling decides, not the request: how ``costs profile`` and ``balanced(by=time)`` time
    the stages (:meth:`of`: as a run of the request will run them here)."""

    threads_per_rank: int = 1
    """Threads each rank runs with."""
    local_ranks: int = 1
    """Ranks the run starts on each machine: ``costs profile`` times the stages in as many processes at once."""
    profile_reps: int = 3
    """Timed repetitions of each stage under ``costs profile``."""

    @classmethod
    def of(cls, mesh: Mesh) -> Host:
        """The host of a run on ``mesh``: one thread per rank when it starts several (torchrun's default), else
        torch's thread count; the ranks that share one machine: a node's when ``devices_per_node`` is given, else
        every rank."""
        world = mesh.world_size
        return cls(threads_per_rank=1 if world > 1 else torch.get_num_threads(),
                   local_ranks=min(world, mesh.devices_per_node or world))


def _model(req: CompileRequest) -> ModelSpec:
    assert req.model is not None, "the front end runs for a request that names a model"
    return req.model


def microbatch_inputs(req: CompileRequest) -> tuple[TensorSpec, ...]:
    """The inputs of one microbatch: dim 0 divided by ``num_microbatches`` (at least 1: the driver's
    schedule rules refuse fewer before the front end runs)."""
    assert req.num_microbatches >= 1, req.num_microbatches
    inputs = _model(req).inputs
    if not inputs:
        raise FrontendError("a model needs at least one input, e.g. input tokens: int64[16, 128]", key="input")
    out = []
    for spec in inputs:
        if not spec.shape:
            raise FrontendError(f"input {spec.name!r} needs a batch dimension (dim 0), got a scalar", key="input")
        to_dtype(spec.dtype, f"input {spec.name!r}'s dtype", "input")
    check_batch(inputs, req.num_microbatches)
    for spec in inputs:
        out.append(TensorSpec(spec.name, spec.dtype, (spec.shape[0] // req.num_microbatches, *spec.shape[1:])))
    return tuple(out)


def _recompute_set(req: CompileRequest) -> frozenset[int]:
    recompute = frozenset(req.training.recompute)
    bad = sorted(s for s in recompute if not 0 <= s < req.num_stages)
    if bad:
        raise FrontendError(f"recompute names stage {bad[0]}, but stages are 0..{req.num_stages - 1}", key="recompute")
    return recompute


@dataclass(frozen=True, slots=True, kw_only=True)
class TracedModel:
    """A model traced at one microbatch shape: the front end's passes before the partition
    (:func:`trace_request`), cut into stages as often as asked (:func:`cut_stage_graph`)."""

    src: ModelSource
    init: str
    traced: Traced
    inputs: tuple[TensorSpec, ...]
    """One microbatch's inputs."""
    autocast: str | None
    cuts: Any
    """Where cuts can go (:func:`~.partition.analyse_cuts`)."""
    fake_mode: Any = None
    """The FakeTensorMode the model was built and annotated under (autocast), else None (meta)."""
    model_key: tuple = ()
    """What the trace depends on but the microbatch shape (:func:`_model_key`)."""
    table: NodeTable | None = None
    """What each node contributes to a cut (:func:`~.cutcost.node_table`; None: cost-only cuts decline)."""
    inside: dict = field(default_factory=dict, compare=False, repr=False)
    """(tp, patterns, loss) -> the cut positions inside a tensor-parallel pair (:func:`inside_tp_pairs`)."""


def build_stage_graph(req: CompileRequest, *, host: Host | None = None, placement: Sequence[int] | None = None,
                      before_timing: Callable[[StageGraph], None] | None = None) -> StageGraph:
    """Trace, partition and cost the model of ``req``; stages get ranks from ``placement`` if given;
    ``host`` and ``before_timing`` as :func:`cut_stage_graph` takes them."""
    return cut_stage_graph(trace_request(req), req, host=host, placement=placement, before_timing=before_timing)


def trace_request(req: CompileRequest, *, like: TracedModel | None = None) -> TracedModel:
    """The passes that depend only on the model and one microbatch's shape (steps 0-6 below): a
    :class:`TracedModel` that :func:`cut_stage_graph` cuts into any number of stages (``pipec tune``
    traces once per microbatch shape and cuts many times). ``like``: the same model traced at another
    microbatch shape; an fx trace of it is annotated again at this shape on a copy of its graph (fx does
    not look at shapes: tracing again would give the same graph), an export trace is traced again."""
    m, training = _model(req), req.training
    inputs = microbatch_inputs(req)
    if training.dtype not in ("float32", *_AUTOCAST):
        raise FrontendError(f"dtype must be float32, bfloat16 or float16, got {training.dtype!r}", key="dtype")
    autocast = training.dtype if training.dtype in _AUTOCAST else None
    # 0. the data, the loss and the targets, as far as they need no model (a token file, a data function)
    check_data_source(training.data, inputs=m.inputs, loss=training.loss, dp=req.mesh.dp, targets=m.targets,
                      search_path=m.search_path)
    key = _model_key(req, autocast)
    if like is not None and like.model_key == key and like.traced.path == "fx":
        src, init, fake_mode = like.src, like.init, like.fake_mode  # steps 1-3 as they were
        with fake_mode if fake_mode else contextlib.nullcontext():
            example = example_inputs(inputs, device="cpu" if fake_mode else "meta")
        traced = at_shapes(like.traced, inputs)
    else:
        # 1. find the model (search path, model file), and resolve init on the meta device
        src = locate_model(m.target, m.search_path)
        init = resolve_init(training.init, src.target, m.kwargs, search_path=src.search_path)
        # 2. build the model with no real memory: meta, or fake CPU tensors when autocast decides dtypes
        fake_mode = FakeTensorMode() if autocast else None
        model, _ = instantiate(src.target, m.kwargs, mode="fake" if fake_mode else "meta",
                               search_path=src.search_path, fake_mode=fake_mode)
        with fake_mode if fake_mode else contextlib.nullcontext():
            example = example_inputs(inputs, device="cpu" if fake_mode else "meta")
        # 3. trace (fx, or torch.export where fx cannot or would hide layers a split point names)
        traced = trace_model(model, inputs, example, mode=m.trace, split_paths=_split_paths(m))
    # 4. shapes, dtypes, FLOPs and saved bytes on every node
    propagate(traced, example, fake_mode=fake_mode, autocast=autocast)
    # 5. the data the run trains on, described; the loss checked against its targets on meta
    tm = TracedModel(src=src, init=init, traced=traced, inputs=inputs, autocast=autocast, cuts=None,
                     fake_mode=fake_mode, model_key=key)
    _data(tm, req)
    # 6. where cuts can go, and what each node gives a cost-only cut
    return replace(tm, cuts=analyse_cuts(traced), table=node_table(traced))


def _split_paths(m: ModelSpec) -> tuple[str, ...]:
    """The module paths a ``split before`` partition names (the trace keeps those layers), else ()."""
    return m.partition.split_before if m.partition.method == "split" else ()


def _model_key(req: CompileRequest, autocast: str | None) -> tuple:
    """What a trace depends on besides the microbatch shape: the model, how it is traced and built, the
    inputs' names and dtypes."""
    m = _model(req)
    return (m.target, m.search_path, repr(sorted(m.kwargs.items())), m.trace, _split_paths(m), autocast,
            req.training.init, tuple((s.name, s.dtype) for s in m.inputs))


def _data(tm: TracedModel, req: CompileRequest) -> Mapping[str, Any]:
    """The data a run of ``req`` trains on, described (one replica's batch: microbatches x dp matter)."""
    training = req.training
    return data_of(tm.traced, data=training.data, loss=training.loss, num_microbatches=req.num_microbatches,
                   dp=req.mesh.dp, targets=_model(req).targets, search_path=tm.src.search_path)


def with_data(graph: StageGraph, tm: TracedModel, req: CompileRequest) -> StageGraph:
    """``graph`` (cut from ``tm``) for ``req``, another microbatch count or dp at the same microbatch
    shape: the model record's ``data`` described again (the stages do not change)."""
    return replace(graph, model={**graph.model, "data": dict(_data(tm, req))})


def cut_stage_graph(tm: TracedModel, req: CompileRequest, *, host: Host | None = None,
                    placement: Sequence[int] | None = None, runnable: bool = True,
                    before_timing: Callable[[StageGraph], None] | None = None, cut_tp: int | None = None) -> StageGraph:
    """Partition, split and cost a traced model into ``req.num_stages`` stages (steps 7-9); ``req`` is
    the one ``tm`` was traced for, or one differing only in stages, partition, recompute and costs.
    ``host``: how the stages are timed (``costs profile``, ``balanced(by=time)``); None: :meth:`Host.of` the
    request's mesh, as a compile of it times them.
    ``runnable=False``: a cost-only cut where it can (:mod:`.cutcost`: costs unit or flops), the same
    StageGraph without building the stage modules; :func:`confirm_cut` checks one the full way.
    ``before_timing``: called, when ``costs profile`` is about to time the stages, with the stage graph as
    cut, its costs unit (its byte counts are final), so the caller's checks (memory) run first; with
    ``balanced(by=time)`` the partition itself is timed, and the call follows that timing.
    ``cut_tp``: the tp whose pairs the cut keeps whole (:func:`inside_tp_pairs`; default the request's), for
    ``pipec tune``, which cuts at tp 1 and shards the cut after."""
    traced, src, cuts = tm.traced, tm.src, tm.cuts
    m, peak_flops = _model(req), req.training.peak_flops
    host = host if host is not None else Host.of(req.mesh)
    recompute = _recompute_set(req)
    ranks = list(placement) if placement is not None else [-1] * req.num_stages
    if len(ranks) != req.num_stages:
        raise FrontendError(f"placement needs one pp rank per stage ({req.num_stages}), got {len(ranks)}")
    # 7. the partition
    partition = resolved(m.partition, cuts)
    weights = None
    if partition.method == "balanced":
        times = None
        if partition.by == "time":  # the stage count checked before the nodes are timed
            assign_stages(traced, cuts, AUTO_BALANCE, req.num_stages, costs_pass.node_weights(traced, cuts, "flops"))
            times = costs_pass.time_nodes(traced, src.target, m.kwargs, threads=host.threads_per_rank,
                                          search_path=src.search_path)
        weights = costs_pass.node_weights(traced, cuts, partition.by, times=times)
    cut_notes: list[str] = []
    stage_of = assign_stages(traced, cuts, partition, req.num_stages, weights, inside=inside_tp_pairs(tm, req, cut_tp),
                             notes=cut_notes)
    # 8. split with torch.fx split_module: stage inputs/outputs, skip edges, tie groups; 9. costs and saved
    # activations per stage (or both read off the trace's nodes: a cost-only cut)
    split, stage_costs = _cost_only(tm, req, stage_of, recompute) if not runnable else (None, None)
    tps: tuple[StageTP | None, ...] = ()
    said: list[str] = []  # what tensor_parallel auto leaves replicated: the compile's warnings
    if split is None:
        split = split_graph(traced, stage_of, req.num_stages)
        tps = tensor_parallel_stages(split, req, said)
        if m.costs == "profile" and before_timing is not None:  # every check before the first timing
            before_timing(_stage_graph(tm, req, split, costs_pass.stage_costs(split, "unit", recompute=recompute),
                                       ranks, recompute, tps))
        profile = costs_pass.profiling(local_ranks=host.local_ranks, threads=host.threads_per_rank,
                                       reps=host.profile_reps)
        stage_costs = costs_pass.stage_costs(
            split, m.costs, recompute=recompute, peak_flops=peak_flops, profile=profile, autocast=tm.autocast,
            target=src.target, kwargs=m.kwargs, search_path=src.search_path, tps=tps, tp=req.mesh.tp,
        )
        if m.costs == "profile" and req.mesh.tp > 1:  # each sharded stage was timed as its tp rank runs it
            tps = tuple(replace(t, costs_local=True) if t is not None else t for t in tps)
    return replace(_stage_graph(tm, req, split, stage_costs, ranks, recompute, tps), warnings=tuple(said),
                   cut_notes=tuple(cut_notes))


def inside_tp_pairs(tm: TracedModel, req: CompileRequest, tp: int | None = None) -> Mapping[int, str]:
    """The cut positions of ``tm`` inside a tensor-parallel pair at ``tp`` (default the request's;
    :func:`~pipec.tp.cuts.inside_positions`: the whole model analysed once per tp, patterns and loss); empty at
    tp 1."""
    tp = req.mesh.tp if tp is None else tp
    if tp == 1 or req.num_stages == 1:
        return {}
    patterns = None if req.tensor_parallel == "auto" else dict(req.tensor_parallel)
    key = (tp, None if patterns is None else tuple(patterns.items()), req.training.loss)
    if key not in tm.inside:
        from pipec.tp.cuts import inside_positions

        tm.inside[key] = inside_positions(tm.traced, tm.cuts, tp, patterns, req.training.loss)
    return tm.inside[key]


def tensor_parallel_stages(split: Split, req: CompileRequest,
                           warnings: list[str] | None = None) -> tuple[StageTP | None, ...]:
    """Each stage's tensor-parallel sharding at the mesh's tp > 1 (:func:`~pipec.tp.analysis.plan_stages` on the
    stage modules, built on meta: no weights); () at tp 1. ``warnings`` gets what auto leaves replicated."""
    tp = req.mesh.tp
    if tp == 1:
        return ()
    from pipec.tp.analysis import plan_stages

    traced = split.traced
    values = {c: torch.empty_like(p, device="meta") for c, p in traced.param_of.items()}
    buffers = {n: torch.empty_like(b, device="meta") for n, b in traced.gm.named_buffers(remove_duplicate=False)}
    modules = [materialize(split, s, values, buffers, "meta", traced_on="meta") for s in range(split.num_stages)]
    patterns = None if req.tensor_parallel == "auto" else dict(req.tensor_parallel)
    plans = plan_stages(modules, tp, patterns=patterns, traced=traced, sequence_parallel=req.mesh.sequence_parallel,
                        loss=req.training.loss, warnings=warnings)
    return tuple(plans)


def _stage_graph(tm: TracedModel, req: CompileRequest, split: Any, stage_costs: Sequence[Any], ranks: Sequence[int],
                 recompute: frozenset[int], tps: Sequence[StageTP | None] = ()) -> StageGraph:
    """The StageGraph of a cut: its split (or cost-only split), each stage's costs and its tensor-parallel
    sharding (``tps``; none given: none)."""
    traced, src = tm.traced, tm.src
    stages = tuple(
        Stage(
            stage=p.stage, rank=int(ranks[p.stage]), nodes=p.nodes, params=p.params, inputs=p.inputs, outputs=p.outputs,
            cost=c.cost, activation_bytes=c.activation_bytes, param_bytes=p.param_bytes, num_params=p.num_params,
            param_shapes=tuple(tuple(traced.param_of[name].shape) for name in p.params),
            tp=tps[p.stage] if tps else None,
        )
        for p, c in zip(split.parts, stage_costs)
    )
    notes = (f"trace: auto fell back to torch.export: {traced.fallback}",) if traced.fallback else ()
    model = _model_record(src, req, traced, tm.inputs, traced_on="fake" if tm.autocast else "meta", init=tm.init,
                          notes=notes, data=_data(tm, req))
    if stage_costs and stage_costs[0].profile:  # costs profile: how the stages were timed
        model["profile"] = dict(stage_costs[0].profile)
    return StageGraph(
        model=model,
        stages=stages, edges=split.edges, ties=split.ties,
        graph=make_graph(stages, split.edges, split.ties), recompute=recompute,
        full_activation_bytes=tuple(c.full_activation_bytes for c in stage_costs),
        flops=tuple(c.flops for c in stage_costs),
        notes=(*notes, *(stage_costs[0].profile or {}).get("notes", ())) if stage_costs else notes,  # the cache's
    )


def _priced_off_table(req: CompileRequest) -> bool:
    """Whether a cut's costs can be read off the trace's table (unit or flops costs); ``costs profile`` times
    the stages it builds, so its cuts are always made the full way."""
    costs, peak_flops = _model(req).costs, req.training.peak_flops
    return costs == "unit" or bool(costs in FAST_COSTS and peak_flops and peak_flops > 0)


def _cost_only(tm: TracedModel, req: CompileRequest, stage_of: Mapping[str, int],
               recompute: frozenset[int]) -> tuple[Any, Any]:
    """A cost-only cut's split and stage costs, or (None, None) where it declines (the full cut then runs,
    and raises what it raises)."""
    split = cost_split(tm.table, stage_of, req.num_stages) if _priced_off_table(req) and tm.table is not None else None
    if split is None:
        return None, None
    return split, cut_costs(tm.table, split, _model(req).costs, recompute=recompute,
                            peak_flops=req.training.peak_flops)


def confirm_cut(tm: TracedModel, req: CompileRequest, graph: StageGraph, *, host: Host | None = None) -> None:
    """Cut ``req`` the full way (its stage modules built with torch.fx, as every rank builds them) and
    check that it equals ``graph``, a cost-only cut of the same stages, but for the data record (a cut
    serves several microbatch counts and dp); ``host`` as :func:`cut_stage_graph` takes it."""
    if not _priced_off_table(req):
        return  # made the full way already (a profile's timings would not repeat)
    full = cut_stage_graph(tm, req, host=host)
    assert _but_data(full) == _but_data(graph), "a cost-only cut differs from the full cut"


def _but_data(graph: StageGraph) -> StageGraph:
    """The graph but its data record and its warnings (what tp's analysis says of the stages it built: a cost-only
    cut builds none)."""
    return replace(graph, model={k: v for k, v in graph.model.items() if k != "data"}, warnings=())


def with_recompute_stages(graph: StageGraph, recompute: frozenset[int]) -> StageGraph:
    """``graph`` (cut without recompute) as :func:`cut_stage_graph` would cut it with ``recompute``: each
    recomputed stage's backward gains its forward and it saves only its inputs (the cost pass's rule)."""
    assert not graph.recompute, "derive recompute from a graph cut without it"
    stages = tuple(replace(st, cost=costs_pass.with_recompute(st.cost),
                           activation_bytes=sum(x.num_bytes for x in st.inputs)) if st.stage in recompute else st
                   for st in graph.stages)
    return replace(graph, stages=stages, recompute=frozenset(recompute), graph=make_graph(stages, graph.edges, graph.ties))


def _model_record(src: ModelSource, req: CompileRequest, traced: Traced, inputs: Sequence[TensorSpec], *, traced_on: str,
                  init: str, notes: Sequence[str], data: Mapping[str, Any]) -> dict[str, Any]:
    """plan.json's ``model``. ``target`` is cwd-independent (a model file's absolute path); ``data`` describes
    one replica's inputs and targets (:mod:`.data`); ``search_path``, ``notes`` (what the user should be told,
    e.g. the auto-trace fallback) only when there are any."""
    out: dict[str, Any] = {
        "target": src.target,
        "kwargs": dict(_model(req).kwargs),
        "trace": traced.path,
        "fingerprint": traced.fingerprint,
        "fingerprint_parts": dict(traced.fingerprint_parts),
        "inputs": [{"name": s.name, "shape": list(s.shape), "dtype": s.dtype} for s in inputs],
        "traced_on": traced_on,
        "init": init,
        "data": dict(data),
    }
    if src.search_path:
        out["search_path"] = list(src.search_path)
    if notes:
        out["notes"] = list(notes)
    return out
