"""A stage rewritten to one tp rank's part (:func:`shard_stage`), and the proof that the rewrite holds.

:func:`shard_stage` rewrites a stage for one tp rank from its :class:`~pipec.compiler.ir.tensor_parallel.StageTP`
(the analysis is deterministic, so a plan's record is enough: it is run again and must give the same record):
the sizes in views, expands and splits of a sharded value become local ints, sizes read off sharded tensors
are folded to their full values, f/g are :class:`~pipec.tp.comm.TPComm` call_modules, rowwise biases follow
the all-reduce, vocab-parallel lookups are :class:`~pipec.tp.comm.VocabLookup` ones, sharded parameters are
sliced (:func:`~.params.shard_param`), and the random ops of the sharded region draw from the stage's own
stream on this tp rank (:mod:`.rng`). Then it proves the rewrite (:func:`_prove`): shapes are propagated
again on fake tensors and every node must have its full shape with the sharded dim divided by tp.
"""

from __future__ import annotations

import copy
import operator
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata

from pipec.compiler.ir.tensor_parallel import StageTP
from pipec.model.stages import StageModule, clone_tree, resolve
from pipec.model.tensors import FrontendError
from pipec.model.trace import Traced, quiet_torch
from pipec.tp.analysis import Analysis, analyse, refusal
from pipec.tp.comm import TPComm, TPGroup, VocabLookup, set_group
from pipec.tp.params import local_shape, shard_param
from pipec.tp.record import canonical_of, record
from pipec.tp.rng import TPStream, derived_seed, is_random, wrap_random
from pipec.tp.rules import KEY, SHAPE_OF, SIZED_VIEWS, Lin, Shard, arg, norm_dim, op_name, tensor_shape, value_of
from pipec.tp.sequence import SP, fused_group, io_names, sp_run

__all__ = ["shard_stage"]

_aten = torch.ops.aten


def _rewrite(an: Analysis, lins: Mapping[Node, Lin], graph: Graph, env: dict[Node, Node],
             comms: dict[str, tuple[str, int, int]], lookups: dict[str, tuple[int, int | None]]) -> dict[Node, Node]:
    """Rewrite the copy ``graph`` (``env``: original node -> copy) to local sizes; original node -> its result.
    ``comms`` gets the :class:`TPComm` modules the rewrite calls (target -> kind, dim, segments), ``lookups`` the
    :class:`~pipec.tp.comm.VocabLookup` ones (target -> the whole table's rows, its padding_idx)."""
    tp, result = an.tp, dict(env)
    copies: dict[Node, Node] = {}
    made: dict[tuple[Node, str, int, int], Node] = {}

    def comm(kind: str, dim: int = 1, segments: int = 1) -> str:
        name = f"tp_{kind}" if kind in ("copy", "reduce") else f"tp_{kind}_{dim}" + (
            f"_{segments}" if segments > 1 else "")
        comms[name] = (kind, dim, segments)
        return name

    def after(x: Node, kind: str, dim: int = 1, segments: int = 1) -> Node:
        """One ``kind`` collective of original node ``x``'s result, shared by its users."""
        key = (x, kind, dim, segments)
        if key not in made:
            with graph.inserting_after(result[x]):
                made[key] = graph.call_module(comm(kind, dim, segments), (result[x],))
            made[key].meta = dict(x.meta)
        return made[key]

    for n in list(an.gm.graph.nodes):
        new, op = env[n], op_name(n)
        x0 = n.args[0] if n.args else None
        s0 = an.of(x0)
        if op in SHAPE_OF and isinstance(s0, Shard) and isinstance(n.meta.get("pipec_value"), (int, tuple)):
            value = n.meta["pipec_value"]  # a size read off a sharded tensor keeps its full value
            for u in list(new.users):
                u.args = torch.fx.node.map_arg(u.args, lambda a: value if a is new else a)
                u.kwargs = torch.fx.node.map_arg(u.kwargs, lambda a: value if a is new else a)
        elif op in SIZED_VIEWS and isinstance(s0, Shard):
            local = list(local_shape(tensor_shape(n), an.of(n), tp))
            if op == "unflatten":
                new.target, new.op = "reshape", "call_method"
            new.args = (new.args[0], *local) if new.op == "call_method" else (new.args[0], local)
            new.kwargs = {}
        elif op == "expand" and isinstance(s0, Shard):
            local = list(local_shape(tensor_shape(n), an.of(n), tp))
            new.args = (new.args[0], *local) if new.op == "call_method" else (new.args[0], local)
        elif op in ("split", "split_with_sizes") and isinstance(s0, Shard) and isinstance(an.of(n)[0], Shard):
            dim = norm_dim(int(arg(n, 2, "dim", 0)), len(tensor_shape(x0)))
            if dim == s0.dim:
                sizes = value_of(new.args[1])
                sizes = [int(v) // tp for v in sizes] if isinstance(sizes, (list, tuple)) else int(sizes) // tp
                new.args = (new.args[0], sizes, *new.args[2:])
        lin = lins.get(n)
        if lin is None:
            continue
        sx = an.of(lin.x)
        seq = isinstance(sx, Shard) and sx.seq
        if seq and n.name not in an.active:  # a replicated consumer of a sequence shard: gathered whole
            new.replace_input_with(result[lin.x], after(lin.x, "gather_whole", sx.dim, sx.segments))
        if lin.kind == "embedding":
            if n.name in an.vocab_on:
                result[n] = _lookup(an, graph, new, lin, result[lin.x], comm, lookups)
            continue
        if group := fused_group(an, lins, lin.x):
            if n is group[0]:  # one GatheredLinear for the group, before its first; each member its output
                with graph.inserting_before(new):
                    params = [graph.get_attr(a) if a else None for m in group for a in (lins[m].weight, lins[m].bias)]
                    y = graph.call_module(comm("gather_linear", sx.dim, sx.segments), (result[lin.x], *params))
                    outs = [y] if len(group) == 1 else [graph.call_function(operator.getitem, (y, i))
                                                         for i in range(len(group))]
                for m, out in zip(group, outs):
                    out.meta = dict(env[m].meta)
                    env[m].replace_all_uses_with(out)
                    graph.erase_node(env[m])
                    result[m] = out
            continue
        if n.name in an.active:
            x = result[lin.x]
            if lin.x not in copies:  # f, or sequence parallelism's all-gather
                copies[lin.x] = after(lin.x, "gather", sx.dim, sx.segments) if seq else after(lin.x, "copy")
            new.replace_input_with(x, copies[lin.x])
            if lin.kind == "conv1d":
                result[n] = _functional(graph, new, lin, copies[lin.x], reduce=None)
        elif n.name in an.rowwise:  # g, or sequence parallelism's reduce-scatter
            out = an.of(n)
            reduce = comm("scatter", out.dim, out.segments) if isinstance(out, Shard) and out.seq else comm("reduce")
            result[n] = _functional(graph, new, lin, result[lin.x], reduce=reduce)
    for (a, u), (d, segs) in an.splits.items():  # replicated operands cut to this rank's positions
        result[u].replace_input_with(result[a], after(a, "split", d, segs))
    out_new = result[next(n for n in an.gm.graph.nodes if n.op == "output")]
    for x, how in an.gathers.items():  # the last stage's outputs, whole for the loss
        if "gather_whole" in how and any(u.op == "output" for u in x.users):
            out_new.replace_input_with(result[x], after(x, "gather_whole", an.of(x).dim, an.of(x).segments))
    return result


def _lookup(an: Analysis, graph: Graph, new: Node, lin: Lin, ids: Node, comm: Callable[..., str],
            lookups: dict[str, tuple[int, int | None]]) -> Node:
    """A vocab-parallel embedding ``new`` as this rank's masked lookup, then g (or a reduce-scatter)."""
    if new.op == "call_module":
        mod = resolve(an.gm, lin.path)
        pad = mod.padding_idx
    else:
        aten = isinstance(new.target, torch._ops.OpOverload)
        pad = value_of(arg(new, 2, "padding_idx", -1 if aten else None))
        pad = None if pad is None or (aten and pad == -1) else int(pad)
    name = f"tp_lookup_{len(lookups)}"
    lookups[name] = (int(resolve(an.gm, lin.weight).shape[0]), pad)
    out = an.of(lin.node)
    reduce = comm("scatter", out.dim, out.segments) if isinstance(out, Shard) and out.seq else comm("reduce")
    with graph.inserting_before(new):
        y = graph.call_module(reduce, (graph.call_module(name, (ids, graph.get_attr(lin.weight))),))
    y.meta = dict(new.meta)
    new.replace_all_uses_with(y)
    graph.erase_node(new)
    return y


def _functional(graph: Graph, new: Node, lin: Lin, x: Node, *, reduce: str | None) -> Node:
    """``new`` (a Linear-like node) as matmul [-> g or reduce-scatter, the ``reduce`` TPComm target] [-> + bias];
    the node that now gives its value."""
    with graph.inserting_before(new):
        if lin.kind in ("linear", "conv1d") and new.op == "call_module":
            w = graph.get_attr(lin.weight)
            y = graph.call_function(F.linear if lin.kind == "linear" else torch.matmul, (x, w))
            bias = graph.get_attr(lin.bias) if lin.bias else None
            add: Any = operator.add
        elif lin.kind == "linear":
            y = graph.call_function(_aten.linear.default, (x, new.args[1]))
            bias, add = arg(new, 2, "bias"), _aten.add.Tensor
        else:  # addmm(bias, x, w) or mm(x, w)
            y = graph.call_function(_aten.mm.default, (x, new.args[2] if lin.kind == "addmm" else new.args[1]))
            bias, add = (new.args[0] if lin.kind == "addmm" else None), _aten.add.Tensor
        if reduce:
            y = graph.call_module(reduce, (y,))
        if bias is not None:
            y = graph.call_function(add, (y, bias))
    y.meta = dict(new.meta)
    new.replace_all_uses_with(y)
    graph.erase_node(new)
    return y


def shard_stage(stage: GraphModule, plan: StageTP, rank: int, *, tp: int, group: TPGroup | None = None,
                canonical: Mapping[str, str] | None = None, traced: Traced | None = None, where: str = "",
                check: bool = True) -> GraphModule:
    """Tp rank ``rank``'s copy (of ``tp``: the plan's ``mesh.tp``) of ``stage`` (unmodified) as ``plan`` shards it:
    local sizes, f/g inserted (with ``group``; None runs one rank's shapes alone), sharded parameters sliced. A
    :class:`StageModule` gives a StageModule. ``check`` proves the rewrite on fake tensors (see the module doc)."""
    canonical = canonical_of(stage, canonical)
    if tp == 1:
        return stage
    an, lins = analyse(stage, tp, dict(plan.modules), canonical, {sp.name: sp.segments for sp in plan.params},
                       loss_parallel=plan.loss_parallel)
    if plan.sequence_parallel and not an.failures:
        given = dict(plan.seq_inputs)
        sp = SP(plan.seq_len, {h: given[v] for h, v in io_names(stage)[0].items() if v in given},
                last=not plan.seq_outputs)
        an = sp_run(an, sp, where, traced)
    # the stage inputs' partial gradients were refused on compile (which knows the earlier stages): none here
    rec = None if an.failures else record(an, lins, canonical, where=where, traced=traced, grad_inputs=())
    if rec is None or (rec.params, rec.seq_outputs, rec.partial_params, rec.loss_parallel) != (
            plan.params, plan.seq_outputs, plan.partial_params, plan.loss_parallel):
        raise FrontendError(f"the plan's tensor-parallel sharding{where} does not hold for this stage's graph; "
                            "re-compile the plan", key=KEY)
    graph = Graph()
    graph._codegen = copy.deepcopy(stage.graph._codegen)
    env: dict[Node, Node] = {}
    graph.output(graph.graph_copy(stage.graph, env))
    out_old = next(n for n in stage.graph.nodes if n.op == "output")
    env[out_old] = next(n for n in graph.nodes if n.op == "output")
    comms: dict[str, tuple[str, int, int]] = {}
    lookups: dict[str, tuple[int, int | None]] = {}
    result = _rewrite(an, lins, graph, env, comms, lookups)
    memo: dict[int, nn.Module] = {}
    attrs: dict[str, Any] = {}
    drawing = [env[n] for n in an.gm.graph.nodes if is_random(an.gm, n) and _on_shard(an, n)]
    if drawing:  # Megatron's per-tp-rank stream: seeded afresh by the runtime (runtime/checkpoint.py)
        device = next((t.device for t in (*stage.parameters(), *stage.buffers())), torch.device("cpu"))
        stream = TPStream(device, derived_seed("pipec-tp-rng", getattr(stage, "stage", 0), rank))
        wrap_random(graph, drawing, lambda path: clone_tree(resolve(stage, path), memo), stream, _STREAM)
        attrs[_STREAM] = stream
    sharded = {sp.name: sp for sp in plan.params}
    fresh: dict[str, nn.Parameter] = {}

    def local(p: nn.Parameter, name: str) -> nn.Parameter:
        canon = canonical.get(name, name)
        if canon not in fresh:  # a replicated one shares the data, not the gradient
            data = shard_param(p.detach(), sharded[canon], tp, rank).clone() if canon in sharded else p.detach()
            fresh[canon] = nn.Parameter(data, requires_grad=p.requires_grad)
        return fresh[canon]

    attrs.update((name, TPComm(kind, dim, size=tp, rank=rank, segments=segs))
                 for name, (kind, dim, segs) in comms.items())
    attrs.update((name, VocabLookup(rows // tp, rank=rank, padding_idx=pad)) for name, (rows, pad) in lookups.items())
    for n in graph.nodes:
        if n.op not in ("call_module", "get_attr") or n.target in attrs:
            continue
        obj = resolve(stage, str(n.target))
        if isinstance(obj, nn.Module):
            obj = clone_tree(obj, memo)
            for mod_name, mod in obj.named_modules(prefix=str(n.target), remove_duplicate=False):
                for key, p in list(mod._parameters.items()):
                    if p is not None:
                        mod._parameters[key] = local(p, f"{mod_name}.{key}")
        elif isinstance(obj, nn.Parameter):
            obj = local(obj, str(n.target))
        attrs[str(n.target)] = obj
    if isinstance(stage, StageModule):
        gm: GraphModule = StageModule(attrs, graph, stage=stage.stage, input_names=stage.input_names,
                                      output_names=stage.output_names, canonical=stage.canonical,
                                      param_order=stage.param_order)
    else:
        gm = GraphModule(attrs, graph, type(stage).__name__)
    gm.graph.eliminate_dead_code()  # the sizes folded in
    gm.graph.lint()
    gm.recompile()
    if check:
        _prove(an, gm, result, where, traced)
    set_group(gm, group)
    return gm


_STREAM = "tp_rng"
"""The rewritten stage's :class:`~pipec.tp.rng.TPStream` (its random ops on shards call it)."""


def _on_shard(an: Analysis, n: Node) -> bool:
    """Whether node ``n`` reads or gives a sharded value."""
    def sharded(st: Any) -> bool:
        return isinstance(st, Shard) or (isinstance(st, (tuple, list)) and any(isinstance(x, Shard) for x in st))
    return sharded(an.of(n)) or any(sharded(an.of(a)) for a in n.all_input_nodes)


class _Prop(ShapeProp):
    current: Node | None = None

    def run_node(self, n: Node) -> Any:
        self.current = n
        return super().run_node(n)


def _prove(an: Analysis, gm: GraphModule, result: Mapping[Node, Node], where: str, traced: Traced | None) -> None:
    """Every original node's value in the rewritten graph has its full shape with the sharded dim / tp."""
    device = next((t.device for t in (*gm.parameters(), *gm.buffers())), torch.device("cpu"))
    inputs = []
    origin = {v: k for k, v in result.items()}
    for n in gm.graph.nodes:
        if n.op == "placeholder":  # a sequence shard arrives as this rank's part
            tm = n.meta["tensor_meta"]
            shape = local_shape(tuple(int(d) for d in tm.shape), an.state.get(origin.get(n, n)), an.tp)
            inputs.append(torch.zeros(shape, dtype=tm.dtype, device=device))
    prop = _Prop(gm, fake_mode=FakeTensorMode(allow_non_fake_inputs=True))
    prop.extra_traceback = False
    try:
        with quiet_torch():
            prop.propagate(*inputs)
    except Exception as e:  # noqa: BLE001 - a local shape the rewrite got wrong, said where
        node = origin.get(prop.current, prop.current)
        raise refusal(an.tp, where, node, f"the sharded graph fails here: {type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}", traced, ()) from None
    live = set(gm.graph.nodes)
    for old, new in result.items():
        full, got = old.meta.get("tensor_meta"), new.meta.get("tensor_meta")
        if new not in live or full is None or got is None:
            continue
        st = an.state.get(old)
        pairs = zip(full, got, st if isinstance(st, tuple) else [None] * len(full)) if isinstance(full, (list, tuple)) \
            else [(full, got, st)]
        for f, g, s in pairs:
            if not isinstance(f, TensorMetadata) or not isinstance(g, TensorMetadata):
                continue
            want = local_shape(tuple(int(d) for d in f.shape), s, an.tp)
            if tuple(int(d) for d in g.shape) != want:
                raise refusal(an.tp, where, old, f"the sharded graph gives shape {list(g.shape)} here, not the local "
                              f"{list(want)} (full {list(f.shape)})", traced, ("report this model to pipec",))
