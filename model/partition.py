"""Partition a traced graph into contiguous stages and split it with torch.fx.

Which node goes to which stage is a policy (split points by module path,
``pipe_split()`` markers, or an automatic balance); how the stages are built
is ``torch.fx.passes.split_module`` with that policy as its callback. Stages
are contiguous runs of the graph's compute nodes in order, so a partition is a
list of cut positions.

A cut is possible where every value crossing it is a tensor, or a Python
constant (``B, T, C = x.shape``) that the consumer gets folded in as a
literal (the plan's shapes are static). A tuple of tensors or another
non-tensor value crossing a cut makes it impossible; the error names the node.
The balancer minimises the slowest stage over every possible cut, and
prefers cuts between *units* (one repeated layer: the element of the first
``ModuleList``/``Sequential`` on a node's module path, or the node itself
outside such lists) when they make the slowest stage at most
:data:`UNIT_SLACK` slower: fewer tensors cross there.

:func:`split_graph` also routes model inputs a later stage uses through stage
0 and model outputs an earlier stage makes through the last stage, so data
enters at stage 0 and the loss reads the last stage's outputs; a value used by
several later stages is a direct (skip) edge to each.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn
from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.shape_prop import TensorMetadata
from torch.fx.passes.split_module import split_module

from pipec.compiler.ir.plan import Edge, TensorSpec, Tie
from pipec.compiler.request import BALANCE_BY, Partition  # the one partition type, torch-free
from pipec.model.tensors import FrontendError, dtype_name
from pipec.model.trace import Traced, compute_nodes, is_pipe_split, module_path, pipe_split

__all__ = [
    "pipe_split",
    "Partition",
    "AUTO_BALANCE",
    "resolved",
    "Cuts",
    "analyse_cuts",
    "balance",
    "assign_stages",
    "StagePart",
    "Split",
    "split_graph",
]

AUTO_BALANCE = Partition("balanced", "flops")
"""What ``auto`` cuts by when the model has no ``pipe_split()`` markers."""


def resolved(partition: Partition, cuts: Cuts) -> Partition:
    """``partition`` with ``auto`` decided: the model's ``pipe_split()`` markers if it has any, else
    :data:`AUTO_BALANCE`."""
    if partition.method != "auto":
        return partition
    return Partition("markers") if cuts.marker_cuts else AUTO_BALANCE


# ----------------------------------------------------------------------------- cut analysis


def _foldable(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return True
    if isinstance(value, (tuple, list, torch.Size)):
        return all(_foldable(v) for v in value)
    return False


def _tensor_meta(node: Node) -> TensorMetadata | None:
    tm = node.meta.get("tensor_meta")
    return tm if isinstance(tm, TensorMetadata) else None


def _nbytes(tm: TensorMetadata) -> int:
    n = 1
    for d in tm.shape:
        n *= int(d)
    return n * torch.empty((), dtype=tm.dtype).element_size()


@dataclass(frozen=True, slots=True, kw_only=True)
class Cuts:
    """Where the compute nodes can be cut; position ``i`` cuts before ``nodes[i]``."""

    nodes: tuple[Node, ...]
    """Compute nodes in graph order, ``pipe_split`` markers left out."""
    crossing_bytes: tuple[int, ...]
    """Bytes of the tensors crossing each position (model inputs included)."""
    valid: tuple[bool, ...]
    """No value other than a tensor or a foldable constant crosses the position."""
    unit_start: tuple[bool, ...]
    """The position is a boundary between units (repeated layers)."""
    marker_cuts: tuple[int, ...]
    """Positions just after each ``pipe_split`` marker."""


def _unit_key(node: Node, model: nn.Module) -> str:
    path = module_path(node)
    if path:
        parts = path.split(".")
        for k in range(1, len(parts)):
            try:
                mod = model.get_submodule(".".join(parts[:k]))
            except AttributeError:
                break
            if isinstance(mod, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
                return ".".join(parts[: k + 1])
    return "node:" + node.name


def analyse_cuts(traced: Traced) -> Cuts:
    """Crossing bytes, validity and unit boundaries of every cut position."""
    all_nodes = compute_nodes(traced.gm)
    nodes = [n for n in all_nodes if not is_pipe_split(n)]
    index = {n: i for i, n in enumerate(nodes)}
    num = len(nodes)
    out_node = next(n for n in traced.gm.graph.nodes if n.op == "output")
    add_bytes = [0] * (num + 2)
    add_bad = [0] * (num + 2)
    producers = [n for n in traced.gm.graph.nodes if n.op == "placeholder"] + nodes
    for v in producers:
        d = index.get(v, -1)
        last = max((num if u is out_node else index.get(u, -1) for u in v.users), default=-1)
        if last <= d:
            continue
        lo, hi = max(d + 1, 1), last  # cuts lo..hi (position 0 never cuts)
        if lo > hi:
            continue
        tm = _tensor_meta(v)
        if tm is not None:
            add_bytes[lo] += _nbytes(tm)
            add_bytes[hi + 1] -= _nbytes(tm)
        elif "pipec_value" in v.meta and _foldable(v.meta["pipec_value"]):
            continue
        else:
            add_bad[lo] += 1
            add_bad[hi + 1] -= 1
    crossing, valid = [], []
    b = bad = 0
    for i in range(num):
        b += add_bytes[i]
        bad += add_bad[i]
        crossing.append(b)
        valid.append(i > 0 and bad == 0)
    keys = [_unit_key(n, traced.model) for n in nodes]
    unit_start = tuple(i > 0 and keys[i] != keys[i - 1] for i in range(num))
    markers = []
    pos = 0
    for n in all_nodes:
        if is_pipe_split(n):
            markers.append(pos)
        else:
            pos += 1
    return Cuts(nodes=tuple(nodes), crossing_bytes=tuple(crossing), valid=tuple(valid), unit_start=unit_start, marker_cuts=tuple(markers))


def _blocker(cuts: Cuts, pos: int) -> str:
    """Describe the non-tensor value that makes cut ``pos`` impossible."""
    after = set(cuts.nodes[pos:])
    for v in cuts.nodes[:pos]:
        users = [u for u in v.users if u in after or u.op == "output"]
        if users and _tensor_meta(v) is None and not _foldable(v.meta.get("pipec_value", object())):
            kind = type(v.meta.get("pipec_value", None)).__name__ if "pipec_value" in v.meta else "tuple of tensors"
            return f"node {v.name!r} ({kind}) is used after the cut by {users[0].name!r}"
    return "a non-tensor value crosses it"


# ----------------------------------------------------------------------------- balancing


def balance(weights: Sequence[float], num_stages: int) -> tuple[list[int], float]:
    """Split ``weights`` into ``num_stages`` contiguous non-empty groups minimising the largest sum.

    Returns the start index of groups 1..S-1 and the largest sum. Exact:
    dp[s][j] = min over i of max(dp[s-1][i], W(i..j)), with the crossing point
    found by bisection since dp[s-1] rises and W(i..j) falls in i; each stage
    count's row is one vectorised pass over j (the same float operations, in
    the same order, as one j at a time).
    """
    k = len(weights)
    assert 1 <= num_stages <= k
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    pre = np.array(prefix)
    inf = float("inf")
    dp = np.array([prefix[j] if j >= 1 else inf for j in range(k + 1)])
    choice: list[np.ndarray] = []
    for s in range(2, num_stages + 1):
        j = np.arange(s, k - (num_stages - s) + 1)
        lo = s - 1
        # smallest i in [lo, j-1] with dp[i] >= prefix[j] - prefix[i]
        a, b = np.full(len(j), lo), j - 1
        while True:
            open_ = a < b
            if not open_.any():
                break
            mid = (a + b) // 2
            up = dp[mid] >= pre[j] - pre[mid]
            b = np.where(open_ & up, mid, b)
            a = np.where(open_ & ~up, mid + 1, a)
        best, best_i = np.full(len(j), inf), np.full(len(j), lo)
        for i in (a - 1, a):  # the crossing point and the one before it, the first one kept on a tie
            ok = i >= lo
            safe = np.where(ok, i, lo)
            val = np.where(ok, np.maximum(dp[safe], pre[j] - pre[safe]), inf)
            better = val < best
            best, best_i = np.where(better, val, best), np.where(better, i, best_i)
        new, arg = np.full(k + 1, inf), np.zeros(k + 1, dtype=np.int64)
        new[j], arg[j] = best, best_i
        dp = new
        choice.append(arg)
    starts = []
    at = k
    for arg in reversed(choice):
        at = int(arg[at])
        starts.append(at)
    return sorted(starts), float(dp[k])


def _check_count(what: str, num_cuts: int, num_stages: int) -> None:
    if num_cuts + 1 != num_stages:
        raise FrontendError(
            f"{what} gives {num_cuts + 1} stages but stages is {num_stages}; "
            f"list {num_stages - 1} split point{'s' if num_stages != 2 else ''} or set stages {num_cuts + 1}",
            key="partition",
        )


def _cut_before_path(cuts: Cuts, path: str, index: int) -> int:
    for i, n in enumerate(cuts.nodes):
        p = module_path(n)
        if p == path or p.startswith(path + "."):
            return i
    known = sorted({".".join(parts[:k]) for n in cuts.nodes if (parts := module_path(n).split(".")) != [""]
                    for k in range(1, len(parts) + 1)})
    layers = _layer_ranges(known)
    same_index = [f"{prefix}.{path.rpartition('.')[2]}" for prefix in layers
                  if f"{prefix}.{path.rpartition('.')[2]}" in known]
    close = list(dict.fromkeys(same_index + difflib.get_close_matches(path, known, n=3)))[:3]
    context = (f"the model's layers are {' and '.join(f'{p}.{lo} .. {p}.{hi}' for p, (lo, hi) in layers.items())}"
               if layers else f"module paths look like {', '.join(known[:4])}")
    raise FrontendError(f"split before {path!r}: no node of the traced graph belongs to module {path!r}; "
                        + (f"did you mean {', '.join(close)}? ({context})" if close else context),
                        key="partition", index=index)


def _layer_ranges(paths: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Repeated layers among module paths: ``{"blocks": (0, 7)}`` for ``blocks.0`` .. ``blocks.7``."""
    found: dict[str, list[int]] = {}
    for p in paths:
        prefix, _, last = p.rpartition(".")
        if prefix and last.isdigit():
            found.setdefault(prefix, []).append(int(last))
    return {prefix: (min(ix), max(ix)) for prefix, ix in found.items() if len(ix) > 1}


def assign_stages(
    traced: Traced, cuts: Cuts, partition: Partition, num_stages: int, weights: Sequence[float] | None = None,
    *, inside: Mapping[int, str] | None = None, notes: list[str] | None = None,
) -> dict[str, int]:
    """Node name -> stage, for every compute node (markers excluded).

    ``weights`` (one per node of ``cuts.nodes``) drive ``balanced``; ``auto`` is :func:`resolved` first.
    ``inside``: the positions inside a tensor-parallel pair (:func:`~pipec.tp.cuts.inside_positions`: position
    -> the shard crossing it): ``balanced`` cuts elsewhere (``notes`` gets a line where that moved a cut), and
    a split point or marker there is refused.
    """
    inside = inside or {}
    if num_stages < 1:
        raise FrontendError(f"stages must be at least 1, got {num_stages}", key="stages")
    partition = resolved(partition, cuts)
    positions: list[int]
    if partition.method == "split":
        paths = partition.split_before
        _check_count(f"split before {', '.join(paths)}", len(paths), num_stages)
        positions = [_cut_before_path(cuts, p, i) for i, p in enumerate(paths)]
        for i, (path, pos, prev) in enumerate(zip(paths, positions, [-1] + positions[:-1])):
            if pos == 0:
                raise FrontendError(f"split before {path!r} leaves stage 0 empty (it is where the graph starts); "
                                    "drop that split point", key="partition", index=i)
            if pos <= prev:
                raise FrontendError(
                    f"split before {path!r} does not come after the previous split point in the graph's order; "
                    "list split points in model order, each once", key="partition", index=i,
                )
            if not cuts.valid[pos]:
                raise FrontendError(f"cannot split before {path!r}: {_blocker(cuts, pos)}; split before another module",
                                    key="partition", index=i)
            if pos in inside:
                raise _inside_pair(traced, cuts, inside, pos, f"split before {path!r}", index=i)
    elif partition.method == "markers":
        if not cuts.marker_cuts:
            raise FrontendError("partition by pipe_split markers, but the traced model has none; call pipe_split() in "
                                "forward or use balanced(by=flops)", key="partition")
        positions = list(cuts.marker_cuts)
        _check_count(f"{len(positions)} pipe_split markers", len(positions), num_stages)
        for k, pos in enumerate(positions):
            if pos == 0 or pos >= len(cuts.nodes) or (k and pos == positions[k - 1]):
                raise FrontendError(f"pipe_split marker {k + 1} leaves a stage empty; remove it or move it between "
                                    "layers", key="partition")
            if not cuts.valid[pos]:
                raise FrontendError(f"cannot split at pipe_split marker {k + 1}: {_blocker(cuts, pos)}", key="partition")
            if pos in inside:
                raise _inside_pair(traced, cuts, inside, pos, f"pipe_split marker {k + 1}")
    elif partition.method == "balanced":
        if partition.by not in BALANCE_BY:
            raise FrontendError(f"balanced(by=...) must be one of {', '.join(BALANCE_BY)}, got {partition.by!r}",
                                key="partition")
        assert weights is not None and len(weights) == len(cuts.nodes)
        positions = _balanced_positions(cuts, weights, num_stages, inside)
        if inside and notes is not None:
            moved = [p for p in _balanced_positions(cuts, weights, num_stages) if p in inside]
            if moved and set(positions) & set(inside):
                notes.append(f"the balanced partition cuts inside a tensor-parallel pair before node "
                             f"{cuts.nodes[moved[0]].name!r} ({inside[moved[0]]} crosses it): the model has too few "
                             "places between its pairs for so many stages, and that pair stays replicated")
            elif moved:
                notes.append(f"the balanced cut before node {cuts.nodes[moved[0]].name!r} ({_where(cuts, moved[0])}) "
                             f"fell inside a tensor-parallel pair ({inside[moved[0]]} crosses it)"
                             + (f" and {len(moved) - 1} more" if len(moved) > 1 else "")
                             + "; the stages are cut between the pairs instead, before "
                             + ", ".join(_where(cuts, p) for p in positions))
    else:
        raise AssertionError(partition)
    stage_of: dict[str, int] = {}
    s = 0
    bounds = set(positions)
    for i, n in enumerate(cuts.nodes):
        if i in bounds:
            s += 1
        stage_of[n.name] = s
    return stage_of


def _where(cuts: Cuts, pos: int) -> str:
    """``blocks.4`` (the module the node after cut ``pos`` belongs to), or ``node 'add_3'``."""
    return module_path(cuts.nodes[pos]) or f"node {cuts.nodes[pos].name!r}"


def _inside_pair(traced: Traced, cuts: Cuts, inside: Mapping[int, str], pos: int, what: str,
                 index: int | None = None) -> FrontendError:
    """The refusal of a cut the user named at ``pos``, inside a tensor-parallel pair, with the nearest cuts
    between layers on either side that are not."""
    keys = [_unit_key(n, traced.model) for n in cuts.nodes]
    near = [p for p in (max((p for p in range(1, pos) if _between(cuts, inside, keys, p)), default=None),
                        min((p for p in range(pos + 1, len(cuts.nodes)) if _between(cuts, inside, keys, p)),
                            default=None)) if p is not None]
    hint = (f"split before {' or '.join(repr(keys[p]) for p in near)} instead (between the layers)" if near else
            "cut between the model's layers, or use balanced(by=flops)")
    return FrontendError(f"{what} cuts inside a tensor-parallel pair: {inside[pos]} crosses it, and a stage boundary "
                         "there would leave the pair's modules replicated on every tp rank", key="partition",
                         index=index, hints=(hint,))


def _between(cuts: Cuts, inside: Mapping[int, str], keys: Sequence[str], p: int) -> bool:
    return cuts.valid[p] and cuts.unit_start[p] and p not in inside and not keys[p].startswith("node:")


UNIT_SLACK = 0.05
"""The balancer keeps cuts between layers when that makes the slowest stage at most this much slower."""


def _best_cuts(candidates: list[int], weights: Sequence[float], num_nodes: int, num_stages: int) -> tuple[list[int], float]:
    bounds = [0] + candidates + [num_nodes]
    groups = [sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])]
    starts, worst = balance(groups, num_stages)
    return [bounds[g] for g in starts], worst


def _balanced_positions(cuts: Cuts, weights: Sequence[float], num_stages: int,
                        inside: Mapping[int, str] | None = None) -> list[int]:
    if num_stages == 1:
        return []
    valid = [i for i in range(len(cuts.nodes)) if cuts.valid[i]]
    if len(valid) < num_stages - 1:
        raise FrontendError(
            f"cannot cut the model into {num_stages} stages: it has only {len(valid)} places where only tensors "
            f"cross; use at most {len(valid) + 1} stages", key="partition",
        )
    between = [i for i in valid if i not in (inside or {})]
    if len(between) >= num_stages - 1:
        valid = between
    anywhere, worst = _best_cuts(valid, weights, len(cuts.nodes), num_stages)
    units = [i for i in valid if cuts.unit_start[i]]
    if len(units) >= num_stages - 1:
        between, worst_units = _best_cuts(units, weights, len(cuts.nodes), num_stages)
        if worst_units <= worst * (1 + UNIT_SLACK):
            return between
    return anywhere


# ----------------------------------------------------------------------------- splitting


def _passthrough(x: Any) -> Any:
    """Identity: a model input a later stage needs leaves stage 0 through this node."""
    return x


@dataclass(frozen=True, slots=True, kw_only=True)
class StagePart:
    """One stage of a split graph, named in the traced graph's terms."""

    stage: int
    nodes: tuple[str, ...]
    """Compute nodes of the traced graph in this stage (plan ``nodes``)."""
    inputs: tuple[TensorSpec, ...]
    sources: tuple[int, ...]
    """Producing stage of each input (-1: a model input, stage 0 only)."""
    outputs: tuple[TensorSpec, ...]
    params: tuple[str, ...]
    """Canonical names of the parameters this stage holds (a tied weight in each holder)."""
    local_params: Mapping[str, str]
    """Canonical name -> the name the stage module holds it under."""
    num_params: int
    param_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Split:
    traced: Traced
    split_gm: GraphModule
    """split_module's result: a top-level graph calling ``submod_<s>``."""
    parts: tuple[StagePart, ...]
    edges: tuple[Edge, ...]
    ties: tuple[Tie, ...]
    stage_of: Mapping[str, int]
    graph_module: GraphModule
    """The graph split_module ran on (the traced graph after folding and routing)."""
    qualname_map: Mapping[str, str]

    @property
    def num_stages(self) -> int:
        return len(self.parts)

    def stage_graph(self, s: int) -> Graph:
        """Stage ``s``'s graph with the model's own attribute paths: call_module targets
        and parameters/buffers read through ``get_attr`` (not passed in as inputs)."""
        sub = self.split_gm.get_submodule(f"submod_{s}")
        graph = Graph()
        env: dict[Node, Node] = {}
        out = graph.graph_copy(sub.graph, env)
        graph.output(out)
        orig = {n.name: n for n in self.graph_module.graph.nodes}
        first = next((n for n in graph.nodes if n.op != "placeholder"), None)
        for node in list(graph.nodes):
            if node.op == "call_module":
                node.target = self.qualname_map.get(f"submod_{s}.{node.target}", node.target)
            elif node.op == "placeholder" and orig.get(node.name) is not None and orig[node.name].op == "get_attr":
                with graph.inserting_before(first):
                    attr = graph.get_attr(orig[node.name].target)
                attr.meta = dict(node.meta)
                node.replace_all_uses_with(attr)
                graph.erase_node(node)
        graph.lint()
        return graph


def _sig(node: Node) -> TensorSpec:
    tm = _tensor_meta(node)
    assert tm is not None, node
    return TensorSpec(node.name, dtype_name(tm.dtype), tuple(int(d) for d in tm.shape))


def _fold_and_route(gm: GraphModule, stage_of: dict[str, int], num_stages: int) -> None:
    """Fold constants crossing cuts into their consumers; route inputs via stage 0 and outputs via the last stage."""
    graph = gm.graph
    for node in list(graph.nodes):
        if is_pipe_split(node):
            graph.erase_node(node)
    out_node = next(n for n in graph.nodes if n.op == "output")

    def stage(n: Node) -> int:
        return num_stages - 1 if n is out_node else stage_of[n.name]

    for node in list(graph.nodes):
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        far = [u for u in node.users if stage(u) != stage_of[node.name]]
        if not far or _tensor_meta(node) is not None:
            continue
        value = node.meta.get("pipec_value", None)
        if "pipec_value" not in node.meta or not _foldable(value):
            raise FrontendError(
                f"node {node.name!r} (a non-tensor value) crosses from stage {stage_of[node.name]} to stage "
                f"{stage(far[0])} (used by {far[0].name!r}); only tensors and constants can cross, cut elsewhere",
                key="partition",
            )
        for u in far:
            u.args = torch.fx.node.map_arg(u.args, lambda a: value if a is node else a)
            u.kwargs = torch.fx.node.map_arg(u.kwargs, lambda a: value if a is node else a)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for p in placeholders:
        later = [u for u in p.users if stage(u) > 0]
        if not later:
            continue
        with graph.inserting_after(placeholders[-1]):
            hop = graph.create_node("call_function", _passthrough, (p,), name=f"{p.name}_to_stages")
        hop.meta = dict(p.meta)
        stage_of[hop.name] = 0
        for u in later:
            u.replace_input_with(p, hop)
    for v in list(out_node.all_input_nodes):
        if v.op == "get_attr" or _tensor_meta(v) is None:
            continue
        if v.op == "placeholder":
            raise FrontendError(f"the model returns its input {v.name!r} unchanged; return only computed tensors",
                                key="model")
        if stage_of[v.name] != num_stages - 1:
            with graph.inserting_before(out_node):
                hop = graph.create_node("call_function", _passthrough, (v,), name=f"{v.name}_to_output")
            hop.meta = dict(v.meta)
            stage_of[hop.name] = num_stages - 1
            out_node.replace_input_with(v, hop)
    graph.lint()
    gm.recompile()


def split_graph(traced: Traced, stage_of: Mapping[str, int], num_stages: int) -> Split:
    """Split the traced graph by ``stage_of`` (node name -> stage) with ``split_module``."""
    src = traced.gm
    graph = Graph()
    env: dict[Node, Node] = {}
    graph.output(graph.graph_copy(src.graph, env))
    gm = GraphModule(src, graph, "Traced")
    stage_of = dict(stage_of)
    for n in compute_nodes(gm):
        if not is_pipe_split(n) and n.name not in stage_of:
            raise FrontendError(f"node {n.name!r} of the traced graph is in no stage; re-compile the plan for this model")
    _fold_and_route(gm, stage_of, num_stages)
    qualname_map: dict[str, str] = {}
    try:
        split_gm = split_module(
            gm, traced.model, lambda n: stage_of[n.name], qualname_map,
            keep_original_order=True, keep_original_node_name=True, tuple_return=True,
        )
    except RuntimeError as e:
        raise FrontendError(f"torch.fx split_module refused the partition: {e}; choose contiguous stages in model order",
                            key="partition") from None
    orig = {n.name: n for n in gm.graph.nodes}
    canon_by_id = {id(p): c for c, p in traced.param_of.items()}
    order = {c: i for i, c in enumerate(traced.param_of)}
    parts = []
    edge_tensors: dict[tuple[int, int], list[TensorSpec]] = {}
    holders: dict[str, dict[int, str]] = {}
    node_lists: dict[int, list[str]] = {s: [] for s in range(num_stages)}
    for n in compute_nodes(traced.gm):
        if not is_pipe_split(n):
            node_lists[stage_of[n.name]].append(n.name)
    for s in range(num_stages):
        if not hasattr(split_gm, f"submod_{s}"):
            raise FrontendError(f"stage {s} is empty; use fewer stages or other split points", key="partition")
        sub = split_gm.get_submodule(f"submod_{s}")
        inputs, sources = [], []
        local: dict[str, str] = {}
        for node in sub.graph.nodes:
            if node.op == "placeholder":
                o = orig[node.name]
                if o.op == "get_attr":
                    _hold(traced, str(o.target), canon_by_id, local)
                    continue
                if o.op == "placeholder":
                    assert s == 0, (s, o.name)
                    sources.append(-1)
                else:
                    sources.append(stage_of[o.name])
                    edge_tensors.setdefault((stage_of[o.name], s), []).append(_sig(o))
                if _tensor_meta(o) is None:
                    raise FrontendError(f"stage {s} would receive {o.name!r}, which is not a tensor; cut elsewhere",
                                        key="partition")
                sig = _sig(o)
                # a model input keeps its own name (fx renames a placeholder that shadows a builtin: input -> input_1)
                inputs.append(TensorSpec(str(o.target), sig.dtype, sig.shape) if o.op == "placeholder" else sig)
            elif node.op in ("call_module", "get_attr"):
                _hold(traced, qualname_map.get(f"submod_{s}.{node.target}", str(node.target)), canon_by_id, local)
        out_node = next(n for n in sub.graph.nodes if n.op == "output")
        outputs = tuple(_sig(orig[a.name]) for a in out_node.args[0])
        for canon, name in local.items():
            holders.setdefault(canon, {})[s] = name
        num_params = sum(traced.param_of[c].numel() for c in local)
        param_bytes = sum(traced.param_of[c].numel() * traced.param_of[c].element_size() for c in local)
        parts.append(StagePart(
            stage=s, nodes=tuple(node_lists[s]), inputs=tuple(inputs), sources=tuple(sources), outputs=outputs,
            params=tuple(sorted(local, key=order.__getitem__)), local_params=dict(local), num_params=num_params,
            param_bytes=param_bytes,
        ))
    edges = tuple(Edge(src_stage=a, dst_stage=b, tensors=tuple(t)) for (a, b), t in sorted(edge_tensors.items()))
    ties = tuple(
        Tie(
            name=canon, stages=tuple(sorted(by_stage)), params=tuple(by_stage[s] for s in sorted(by_stage)),
            num_bytes=traced.param_of[canon].numel() * traced.param_of[canon].element_size(),
        )
        for canon, by_stage in sorted(holders.items(), key=lambda kv: order[kv[0]])
        if len(by_stage) > 1
    )
    return Split(
        traced=traced, split_gm=split_gm, parts=tuple(parts), edges=edges, ties=ties, stage_of=stage_of,
        graph_module=gm, qualname_map=qualname_map,
    )


def _hold(traced: Traced, target: str, canon_by_id: Mapping[int, str], local: dict[str, str]) -> None:
    """Record the parameters reachable from attribute ``target`` (a module or a tensor)."""
    obj = traced.gm
    for part in target.split("."):
        obj = getattr(obj, part)
    if isinstance(obj, nn.Module):
        for name, p in obj.named_parameters(prefix=target, remove_duplicate=False):
            local.setdefault(canon_by_id[id(p)], name)
    elif isinstance(obj, nn.Parameter):
        local.setdefault(canon_by_id[id(obj)], target)
