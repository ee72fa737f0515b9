"""Cost-only cuts: a cut's stages, edges, ties and costs read off the trace's nodes, no stage modules built.

``pipec tune`` cuts one traced model dozens of times and needs of each cut only what plan.json records
of it: per stage its nodes, parameters, input and output signatures, costs and activation bytes; the
edges with their tensors; the tie groups. :func:`~.partition.split_graph` gets those by building every
stage as a GraphModule with torch.fx ``split_module`` (a copy of the graph, routed, split and recompiled),
which is most of a cut's time. Here a :class:`NodeTable`, made once per trace, holds what each node
contributes (what it reads, in argument order; its signature; the parameters its module or attribute
holds; its FLOPs and saved storages), and :func:`cost_split` walks it once per cut following
``split_module``'s rules, as :func:`~.partition.split_graph` calls it:

- a stage's inputs are the values its nodes read from elsewhere, in the order first read (model inputs
  and tensors from other stages: signatures and edges; parameters read by ``get_attr``: held); its
  outputs are its values read elsewhere (or by the model's output), in the order first read;
- a constant crossing a cut is folded into its readers (read by none across); a model input a later
  stage reads leaves stage 0 by a passthrough node named ``<input>_to_stages`` (placed after the last
  model input, so the last input's first), and a model output made before the last stage reaches it by
  ``<value>_to_output``;
- a stage holds, first name first, the parameters of the attributes it reads (tensors, then modules),
  then of the modules it calls, in graph order.

Stage FLOPs and saved activations are sums over the stage's nodes (each node's FLOPs were counted
alone when the trace was annotated, so a stage's count is that sum on either path), costed by the rule
of :func:`~.costs.stage_costs` for ``unit`` and ``flops`` (``profile`` runs the stages: full cut).
The result equals the full cut's field by field (tests/test_cutcost.py); where the table cannot promise
that it declines: :func:`node_table` gives ``None`` for a graph with global-state nodes (autocast or
grad-mode regions, which ``split_module`` copies into stages), symbolic sizes, or names fx would change
when it rebuilds them; :func:`cost_split` gives ``None`` for a partition the full cut refuses (an empty
stage, a value that is no tensor crossing a cut, a model returning its input), so the full cut raises
its own error.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import torch
from torch import nn
from torch.fx import Graph, Node
from torch.fx.node import map_arg
from torch.fx.passes.shape_prop import TensorMetadata

from pipec.costs.costs import StageCost, with_recompute
from pipec.model.partition import StagePart, _foldable
from pipec.model.stages import resolve
from pipec.model.tensors import dtype_name
from pipec.model.trace import Traced, is_pipe_split
from pipec.compiler.ir.plan import UNIT_COST, Cost, Edge, TensorSpec, Tie
from pipec.errors import PipecError

__all__ = ["NodeTable", "CostSplit", "node_table", "cost_split", "cut_costs", "FAST_COSTS"]

FAST_COSTS = ("unit", "flops")
"""Cost sources a cost-only cut prices (``profile`` times the stage modules)."""

_PLACEHOLDER, _ATTR, _COMPUTE, _OUTPUT = range(4)
_GLOBAL_STATE = (torch.amp._enter_autocast, torch.amp._exit_autocast, torch._C._set_grad_enabled)


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeTable:
    """What every node of one traced graph contributes to a cut (ids: positions in the graph, pipe_split
    markers left out; hops get ids from ``num_nodes`` on, per cut)."""

    names: tuple[str, ...]
    name_set: frozenset[str]
    kind: tuple[int, ...]
    """placeholder, get_attr, compute or output (the last node)."""
    reads: tuple[tuple[int, ...], ...]
    """Ids read, in ``map_arg`` order over args then kwargs, repeats kept (compute nodes and the output)."""
    users: tuple[tuple[int, ...], ...]
    """Ids reading each model input (compute nodes and the output)."""
    sig: tuple[TensorSpec | None, ...]
    """A tensor's signature (named after the node); None for a value that is no tensor."""
    input_sig: Mapping[int, TensorSpec]
    """A model input's signature as a stage input (its own name: fx may rename the placeholder)."""
    foldable: tuple[bool, ...]
    """A constant the full cut folds into readers across a cut."""
    module_attr: frozenset[int]
    """get_attr nodes naming a module (``split_module`` reads them after the tensors)."""
    held: Mapping[int, tuple[tuple[str, str], ...]]
    """get_attr and call_module ids -> (canonical, local name) of each parameter reachable, in order."""
    flops: tuple[int, ...]
    uses_param: frozenset[int]
    """Compute nodes using a parameter (their backward splits into input and weight halves)."""
    saved: tuple[tuple[tuple[int, int], ...], ...]
    storage: tuple[tuple[Any, int] | None, ...]
    """A tensor result's storage ``(key, bytes)`` (``pipec_storage``)."""
    param_order: Mapping[str, int]
    param_bytes: Mapping[str, tuple[int, int]]
    """Canonical name -> (elements, bytes)."""
    param_shapes: Mapping[str, tuple[int, ...]]

    @property
    def num_nodes(self) -> int:
        return len(self.names)


@dataclass(frozen=True, slots=True, kw_only=True)
class CostSplit:
    """A cut as :class:`~.partition.Split` describes it, without the stage modules."""

    parts: tuple[StagePart, ...]
    edges: tuple[Edge, ...]
    ties: tuple[Tie, ...]
    storage: tuple[tuple[tuple[Any, int] | None, ...], ...]
    """Per stage, the storage of each output (a passthrough's is its source's)."""

    @property
    def num_stages(self) -> int:
        return len(self.parts)


def _tensor_sig(node: Node) -> TensorSpec | None:
    tm = node.meta.get("tensor_meta")
    if not isinstance(tm, TensorMetadata):
        return None
    return TensorSpec(node.name, dtype_name(tm.dtype), tuple(int(d) for d in tm.shape))


def _held(obj: Any, target: str, canon_by_id: Mapping[int, str]) -> tuple[tuple[str, str], ...]:
    """:func:`~.partition._hold`'s pairs for attribute ``target``, in its order."""
    if isinstance(obj, nn.Module):
        return tuple((canon_by_id[id(p)], name) for name, p in obj.named_parameters(prefix=target, remove_duplicate=False))
    if isinstance(obj, nn.Parameter):
        return ((canon_by_id[id(obj)], target),)
    return ()


def _names_stable(nodes: Sequence[Node]) -> bool:
    """fx keeps every name when it rebuilds the nodes as placeholders, and no two call_module or module
    attribute targets share ``split_module``'s flattened name (``a.b`` and ``a_b``)."""
    g = Graph()
    if any(g.placeholder(n.name).name != n.name for n in nodes if n.op != "output"):
        return False
    flat: dict[str, str] = {}
    for n in nodes:
        if n.op == "call_module":
            t = str(n.target)
            if flat.setdefault(t.replace(".", "_"), t) != t:
                return False
    return not any(n.op == "get_attr" and flat.get(str(n.target), str(n.target)) != str(n.target) for n in nodes)


def node_table(traced: Traced) -> NodeTable | None:
    """The table of ``traced`` (annotated by :func:`~.trace.propagate`), or None where a cost-only cut
    could differ from the full one (see the module docstring), or where the graph holds what the table
    cannot name (a marker's value read, a parameter that is not the model's): the full cut then says."""
    try:
        return _node_table(traced)
    except (KeyError, AttributeError):
        return None


def _node_table(traced: Traced) -> NodeTable | None:
    gm = traced.gm
    nodes = [n for n in gm.graph.nodes if not is_pipe_split(n)]
    if nodes[-1].op != "output" or any(n.op == "output" for n in nodes[:-1]):
        return None
    for n in nodes:
        if n.op == "call_function" and n.target in _GLOBAL_STATE:
            return None
        if "example_value" in n.meta or "unbacked_bindings" in n.meta:
            return None
    if not _names_stable(nodes):
        return None
    ids = {n: i for i, n in enumerate(nodes)}
    kinds = {"placeholder": _PLACEHOLDER, "get_attr": _ATTR, "output": _OUTPUT}
    canon_by_id = {id(p): c for c, p in traced.param_of.items()}
    params = {id(p) for p in traced.param_of.values()}
    reads, sig, held, module_attr, uses_param, users = [], [], {}, set(), set(), []
    for i, n in enumerate(nodes):
        got: list[int] = []
        if n.op not in ("placeholder", "get_attr"):
            for part in (n.args, n.kwargs):
                map_arg(part, lambda a: got.append(ids[a]))
        reads.append(tuple(got))
        sig.append(_tensor_sig(n))
        users.append(tuple(ids[u] for u in n.users) if n.op == "placeholder" else ())
        if n.op == "get_attr":
            obj = resolve(gm, str(n.target))
            held[i] = _held(obj, str(n.target), canon_by_id)
            if isinstance(obj, nn.Module):
                module_attr.add(i)
            elif id(obj) in params:
                uses_param.update(ids[u] for u in n.users)
        elif n.op == "call_module":
            mod = gm.get_submodule(str(n.target))
            held[i] = _held(mod, str(n.target), canon_by_id)
            if any(True for _ in mod.parameters()):
                uses_param.add(i)
    input_sig = {i: TensorSpec(str(n.target), s.dtype, s.shape) for i, (n, s) in enumerate(zip(nodes, sig))
                 if n.op == "placeholder" and s is not None}
    return NodeTable(
        names=tuple(n.name for n in nodes), name_set=frozenset(n.name for n in nodes), kind=tuple(kinds.get(n.op, _COMPUTE) for n in nodes), reads=tuple(reads),
        users=tuple(users), sig=tuple(sig), input_sig=input_sig,
        foldable=tuple("pipec_value" in n.meta and _foldable(n.meta["pipec_value"]) for n in nodes),
        module_attr=frozenset(module_attr), held=held, flops=tuple(int(n.meta.get("pipec_flops", 0)) for n in nodes),
        uses_param=frozenset(uses_param), saved=tuple(tuple(n.meta.get("pipec_saved", ())) for n in nodes),
        storage=tuple(n.meta.get("pipec_storage") for n in nodes),
        param_order={c: k for k, c in enumerate(traced.param_of)},
        param_bytes={c: (p.numel(), p.numel() * p.element_size()) for c, p in traced.param_of.items()},
        param_shapes={c: tuple(p.shape) for c, p in traced.param_of.items()},
    )


class _Declined(PipecError):
    """The full cut would refuse this partition (or do what the table does not model): always caught
    here (the full cut then runs and reports any mistake itself), never a user's message."""


@dataclass(slots=True)
class _Cut:
    """One cut's working state: stage per id (None: read by every stage alike), passthroughs, and
    split_module's order of first reads."""

    table: NodeTable
    stage: list[int | None]
    sig: list[TensorSpec | None]
    storage: list[tuple[Any, int] | None]
    inputs: list[dict[int, None]]
    outputs: list[dict[int, None]]

    hop_names: list[str]

    def hop(self, src: int, name: str, stage: int) -> int:
        """A passthrough node in ``stage`` reading ``src`` (its metadata a copy of the source's)."""
        self.stage.append(stage)
        s = self.sig[src]
        self.sig.append(TensorSpec(name, s.dtype, s.shape) if s is not None else None)
        self.storage.append(self.storage[src])
        self.hop_names.append(name)
        return len(self.stage) - 1

    def name(self, node: int) -> str:
        n = self.table.num_nodes
        return self.table.names[node] if node < n else self.hop_names[node - n]

    def read(self, src: int, stage: int | None) -> None:
        """``split_module``'s record of a cross-stage read (``stage`` None: the model's output)."""
        made = self.stage[src]
        if made != stage:
            if made is not None:
                self.outputs[made].setdefault(src)
            if stage is not None:
                self.inputs[stage].setdefault(src)


def cost_split(table: NodeTable, stage_of: Mapping[str, int], num_stages: int) -> CostSplit | None:
    """The cut of ``stage_of`` (node name -> stage, compute nodes) as :func:`~.partition.split_graph`
    describes it, or None where the full cut would refuse it (it then says why)."""
    try:
        return _cost_split(table, stage_of, num_stages)
    except _Declined:
        return None


def _cost_split(table: NodeTable, stage_of: Mapping[str, int], num_stages: int) -> CostSplit:
    last, n = num_stages - 1, table.num_nodes
    kind = table.kind
    if any(k == _COMPUTE and name not in stage_of for name, k in zip(table.names, kind)):
        raise _Declined  # a node in no stage
    cut = _Cut(table=table, stage=[stage_of[name] if k == _COMPUTE else None for name, k in zip(table.names, kind)],
               sig=list(table.sig), storage=list(table.storage), inputs=[{} for _ in range(num_stages)],
               outputs=[{} for _ in range(num_stages)], hop_names=[])
    stage = cut.stage
    out_id = n - 1
    # model inputs a later stage reads leave stage 0 by a passthrough (the last input's first)
    to_stages: dict[int, int] = {}
    placeholders = [i for i in range(n) if kind[i] == _PLACEHOLDER]
    for p in placeholders:
        if any((last if u == out_id else stage[u]) > 0 for u in table.users[p]):
            to_stages[p] = cut.hop(p, f"{table.names[p]}_to_stages", 0)
    # the model's outputs: a tensor made before the last stage reaches it by a passthrough
    out_reads = []
    to_output: dict[int, int] = {}
    for v in table.reads[out_id]:
        k = kind[v]
        if k == _PLACEHOLDER or (k == _COMPUTE and table.sig[v] is None and (stage[v] == last or not table.foldable[v])):
            raise _Declined  # the model returns an input, or a non-tensor the full cut refuses
        if k == _COMPUTE and table.sig[v] is None:
            continue  # a constant, folded into the output
        if k == _COMPUTE and stage[v] != last:
            if v not in to_output:
                to_output[v] = cut.hop(v, f"{table.names[v]}_to_output", last)
            v = to_output[v]
        out_reads.append(v)
    hops = [*to_stages.values(), *to_output.values()]
    names = {cut.name(h) for h in hops}
    if len(names) != len(hops) or names & table.name_set:
        raise _Declined  # fx would rename a passthrough
    # split_module's walk: nodes in graph order (passthroughs of inputs after the last input)
    body: list[list[int]] = [[] for _ in range(num_stages)]
    last_input = placeholders[-1] if placeholders else -1
    order = [i for i in range(n) if kind[i] == _COMPUTE]
    cut_at = next((k for k, i in enumerate(order) if i > last_input), len(order))
    walk = [*order[:cut_at], *reversed(list(to_stages.values())), *order[cut_at:], *to_output.values()]
    src_of = {h: p for p, h in to_stages.items()} | {h: v for v, h in to_output.items()}
    for u in walk:
        t = stage[u]
        body[t].append(u)
        for d in ((src_of[u],) if u in src_of else table.reads[u]):
            kd = kind[d]
            if kd == _PLACEHOLDER and t > 0:
                d = to_stages[d]
            elif kd == _COMPUTE and table.sig[d] is None and stage[d] != t:
                if not table.foldable[d]:
                    raise _Declined  # a non-tensor value crosses the cut
                continue
            cut.read(d, t)
    for v in out_reads:
        cut.read(v, None)
    if any(not b for b in body):
        raise _Declined  # an empty stage
    return _describe(cut, body)


def _describe(cut: _Cut, body: Sequence[Sequence[int]]) -> CostSplit:
    """Stage parts, edges and ties from the walk's first reads (split_graph's reading of split_module)."""
    table, stage = cut.table, cut.stage
    parts, storage = [], []
    edge_tensors: dict[tuple[int, int], list[TensorSpec]] = {}
    holders: dict[str, dict[int, str]] = {}
    for s, reads in enumerate(cut.inputs):
        inputs, sources, local = [], [], {}
        attrs = [d for d in reads if d in table.module_attr]
        for d in [d for d in reads if d not in table.module_attr]:
            k = table.kind[d] if d < table.num_nodes else _COMPUTE
            if k == _ATTR:
                _hold(table.held[d], local)
                continue
            sig = cut.sig[d]
            if sig is None:
                raise _Declined  # a stage would receive a value that is no tensor
            if k == _PLACEHOLDER:
                sources.append(-1)
                inputs.append(table.input_sig[d])
            else:
                sources.append(stage[d])
                edge_tensors.setdefault((stage[d], s), []).append(sig)
                inputs.append(sig)
        for d in attrs:
            _hold(table.held[d], local)
        for u in body[s]:
            if u in table.held:
                _hold(table.held[u], local)
        outs = [cut.sig[d] for d in cut.outputs[s]]
        if any(o is None for o in outs):
            raise _Declined
        for canon, name in local.items():
            holders.setdefault(canon, {})[s] = name
        parts.append(StagePart(
            stage=s, nodes=tuple(table.names[u] for u in body[s] if u < table.num_nodes), inputs=tuple(inputs),
            sources=tuple(sources), outputs=tuple(outs), params=tuple(sorted(local, key=table.param_order.__getitem__)),
            local_params=dict(local), num_params=sum(table.param_bytes[c][0] for c in local),
            param_bytes=sum(table.param_bytes[c][1] for c in local),
        ))
        storage.append(tuple(cut.storage[d] for d in cut.outputs[s]))
    edges = tuple(Edge(src_stage=a, dst_stage=b, tensors=tuple(t)) for (a, b), t in sorted(edge_tensors.items()))
    ties = tuple(
        Tie(name=canon, stages=tuple(sorted(by)), params=tuple(by[s] for s in sorted(by)),
            num_bytes=table.param_bytes[canon][1])
        for canon, by in sorted(holders.items(), key=lambda kv: table.param_order[kv[0]]) if len(by) > 1
    )
    return CostSplit(parts=tuple(parts), edges=edges, ties=ties, storage=tuple(storage))


def _hold(pairs: Sequence[tuple[str, str]], local: dict[str, str]) -> None:
    for canon, name in pairs:
        local.setdefault(canon, name)


# ----------------------------------------------------------------------------- costs


def cut_costs(table: NodeTable, split: CostSplit, source: str, *, recompute: frozenset[int] = frozenset(),
              peak_flops: float | None = None) -> tuple[StageCost, ...]:
    """:func:`~.costs.stage_costs` of the cut for ``source`` in :data:`FAST_COSTS` (``flops`` with a
    positive ``peak_flops``: the caller checks, the full cut raises the error)."""
    assert source in FAST_COSTS and (source == "unit" or (peak_flops and peak_flops > 0)), source
    ids = {name: i for i, name in enumerate(table.names)}
    out = []
    for s, part in enumerate(split.parts):
        nodes = [ids[name] for name in part.nodes]
        flops = _flops(table, nodes)
        if source == "unit":
            base = UNIT_COST
        else:
            f, i, w = flops
            base = Cost(fwd=f / peak_flops, bwd=(i + w) / peak_flops, bwd_i=i / peak_flops, bwd_w=w / peak_flops)
            if all(src < 0 for src in part.sources):  # fed by model inputs only: no input gradient
                base = replace(base, bwd_i=0.0, bwd_w=base.bwd)
        saved: dict[Any, int] = {}
        for u in nodes:
            for key, nbytes in table.saved[u]:
                saved[key] = nbytes
        for sig, st in zip(part.outputs, split.storage[s]):
            key, nbytes = st if st is not None else (("out", sig.name), sig.num_bytes)
            saved[key] = nbytes
        full = sum(saved.values())
        if s in recompute:
            cost, act = with_recompute(base), sum(x.num_bytes for x in part.inputs)
        else:
            cost, act = base, full
        out.append(StageCost(cost=cost, activation_bytes=act, full_activation_bytes=full, flops=flops))
    return tuple(out)


def _flops(table: NodeTable, nodes: Sequence[int]) -> tuple[int, int, int]:
    """Forward, input-backward and weight-backward FLOPs of a stage (the rule of :mod:`.costs`)."""
    fwd = bwd_i = bwd_w = 0
    for u in nodes:
        f = table.flops[u]
        fwd += f
        if u in table.uses_param:
            bwd_i += f
            bwd_w += f
        else:
            bwd_i += 2 * f
    return fwd, bwd_i, bwd_w
