"""Stage costs (seconds per microbatch) and the per-node weights the balancer uses.

Sources, most trusted first (DESIGN, *Cost model*):

- ``profile``: each stage runs here on real tensors of the plan's microbatch
  shape, the way the run will run it: alone, then in as many processes at once
  as the run has ranks on this machine, each with the thread count each rank
  will run with (:mod:`.profile`; on a machine with fewer cores than ranks a
  stage costs what it costs while the others compute); forward, full backward,
  optimizer step and the split backward's two halves are timed, and kept in
  the profile cache for the next compile.
- ``flops``: forward FLOPs from ``torch.utils.flop_counter`` at a device peak.
  Backward: a node that uses parameters (a linear layer) costs its forward
  FLOPs once for the input gradient and once for the weight gradient; any other
  node (attention's matmuls) twice its forward FLOPs, all input gradient.
- ``unit``: F=1, B=2, I=W=1.

A stage fed only by model inputs (stage 0) sends no gradient, so its input
backward is 0 and its weight backward is the whole backward (torch's rule for
the zero-bubble split; the runtime runs that stage's whole backward at ``BWD_W``).

With recompute on for a stage, the forward is run again before the backward:
input backward (and so the full backward) gains one forward, and the saved
activations shrink to the stage's inputs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import torch
from torch import nn
from torch.fx import Interpreter, Node

from pipec.model.load import instantiate
from pipec.model.partition import Cuts, Split
from pipec.costs.profile import MAX_PROFILE_RANKS, Profiling, _threads, profiling
from pipec.model.tensors import FrontendError, example_inputs
from pipec.costs.timings import profile_stages
from pipec.model.trace import Traced, trace_model
from pipec.compiler.ir.plan import UNIT_COST, Cost

__all__ = [
    "COST_SOURCES",
    "StageCost",
    "node_weights",
    "stage_flops",
    "stage_activation_bytes",
    "stage_costs",
    "with_recompute",
    "time_nodes",
    "Profiling",
    "profiling",
    "MAX_PROFILE_RANKS",
]

COST_SOURCES = ("unit", "flops", "profile")


@dataclass(frozen=True, slots=True, kw_only=True)
class StageCost:
    """What the cost pass knows of one stage (per microbatch)."""

    cost: Cost
    activation_bytes: int
    """Saved for backward (with recompute: the stage's inputs)."""
    full_activation_bytes: int
    """Saved for backward without recompute: what a recomputed stage holds during its backward."""
    flops: tuple[int, int, int]
    """Forward, input-backward and weight-backward FLOPs."""
    profile: Mapping[str, Any] | None = None
    """``costs profile``: how the stages were timed (plan.json's ``model["profile"]``, the same for every stage:
    :mod:`.profile`)."""


def _param_nodes(traced: Traced) -> set[Node]:
    """Compute nodes that use a parameter (the weight-gradient side of the backward)."""
    params = {id(p) for p in traced.param_of.values()}
    out = set()
    for node in traced.gm.graph.nodes:
        if node.op == "call_module":
            if any(True for _ in traced.gm.get_submodule(str(node.target)).parameters()):
                out.add(node)
        elif node.op == "get_attr":
            obj: Any = traced.gm
            for part in str(node.target).split("."):
                obj = getattr(obj, part)
            if id(obj) in params:
                out.update(node.users)
    return out


def _node_flops(traced: Traced, nodes: Sequence[Node], with_params: set[Node] | None = None) -> tuple[int, int, int]:
    with_params = _param_nodes(traced) if with_params is None else with_params
    fwd = bwd_i = bwd_w = 0
    for n in nodes:
        f = int(n.meta.get("pipec_flops", 0))
        fwd += f
        if n in with_params:
            bwd_i += f
            bwd_w += f
        else:
            bwd_i += 2 * f
    return fwd, bwd_i, bwd_w


def _stage_nodes(split: Split, s: int) -> list[Node]:
    by_name = {n.name: n for n in split.traced.gm.graph.nodes}
    return [by_name[name] for name in split.parts[s].nodes]


def stage_flops(split: Split, s: int, with_params: set[Node] | None = None) -> tuple[int, int, int]:
    """Forward, input-backward and weight-backward FLOPs of stage ``s`` per microbatch (``with_params``:
    :func:`_param_nodes` of the split's trace, when the caller has it for every stage)."""
    return _node_flops(split.traced, _stage_nodes(split, s), with_params)


def stage_activation_bytes(split: Split, s: int) -> int:
    """Bytes autograd saves in stage ``s`` per microbatch, plus the outputs it keeps for its backward."""
    saved: dict[int, int] = {}
    for n in _stage_nodes(split, s):
        for key, nbytes in n.meta.get("pipec_saved", ()):
            saved[key] = nbytes
    by_name = {n.name: n for n in split.graph_module.graph.nodes}
    for sig in split.parts[s].outputs:
        key, nbytes = by_name[sig.name].meta.get("pipec_storage", (("out", sig.name), sig.num_bytes))
        saved[key] = nbytes
    return sum(saved.values())


def with_recompute(cost: Cost) -> Cost:
    """The stage's forward runs again before its backward (in the input half, or the weight half
    of a stage whose input half does nothing)."""
    if cost.bwd_i == 0:
        return replace(cost, bwd=cost.bwd + cost.fwd, bwd_w=cost.bwd_w + cost.fwd)
    return replace(cost, bwd=cost.bwd + cost.fwd, bwd_i=cost.bwd_i + cost.fwd)


def _no_input_grad(cost: Cost) -> Cost:
    """A stage fed only by model inputs sends no gradient: its ``BWD_I`` does nothing and its ``BWD_W`` is its whole
    backward, unsplit (the runtime runs it so), to the bit as the cost-only cut prices it."""
    return replace(cost, bwd_i=0.0, bwd_w=cost.bwd)


# ----------------------------------------------------------------------------- balancer weights


def node_weights(traced: Traced, cuts: Cuts, by: str, *, times: Mapping[str, float] | None = None,
                 bytes_per_param: int = 16) -> list[float]:
    """One weight per node of ``cuts.nodes`` for ``balanced(by=...)``.

    ``params``: parameters first used by the node; ``flops``: forward FLOPs;
    ``time``: measured forward seconds (``times``, from :func:`time_nodes`);
    ``memory``: ``bytes_per_param`` x first-used parameters plus the bytes
    the node saves for backward.
    """
    if by == "flops":
        return [float(n.meta.get("pipec_flops", 0)) for n in cuts.nodes]
    if by == "time":
        assert times is not None
        return [times.get(n.name, 0.0) for n in cuts.nodes]
    first_use = _first_use_params(traced, cuts)
    if by == "params":
        return [float(first_use.get(n, 0)) for n in cuts.nodes]
    if by == "memory":
        return [
            float(bytes_per_param * first_use.get(n, 0) + sum(b for _, b in n.meta.get("pipec_saved", ())))
            for n in cuts.nodes
        ]
    raise FrontendError(f"balanced(by=...) must be one of params, flops, time, memory, got {by!r}", key="partition")


def _first_use_params(traced: Traced, cuts: Cuts) -> dict[Node, int]:
    canon_by_id = {id(p): c for c, p in traced.param_of.items()}
    seen: set[str] = set()
    out: dict[Node, int] = {}
    for n in cuts.nodes:
        found: list[nn.Parameter] = []
        if n.op == "call_module":
            found.extend(traced.gm.get_submodule(str(n.target)).parameters())
        for a in n.all_input_nodes:
            if a.op == "get_attr":
                obj: Any = traced.gm
                for part in str(a.target).split("."):
                    obj = getattr(obj, part)
                if isinstance(obj, nn.Parameter):
                    found.append(obj)
        for p in found:
            c = canon_by_id.get(id(p))
            if c is not None and c not in seen:
                seen.add(c)
                out[n] = out.get(n, 0) + p.numel()
    return out


# ----------------------------------------------------------------------------- measuring


class _NodeTimer(Interpreter):
    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.times: dict[str, float] = {}

    def run_node(self, n: Node) -> Any:
        t0 = time.perf_counter()
        out = super().run_node(n)
        self.times[n.name] = time.perf_counter() - t0
        return out


_NODE_TIMES: dict[tuple, dict[str, float]] = {}
""":func:`time_nodes`'s results by what decides them (``pipec tune`` cuts one trace many ways)."""


def time_nodes(traced: Traced, target: str, kwargs: Mapping[str, Any], *, threads: int = 1, reps: int = 3,
               search_path: Sequence[str] = ()) -> dict[str, float]:
    """Median forward seconds of every node, on a real CPU copy of the model (it must fit in memory); once per
    trace, microbatch shape and threads in a process."""
    key = (traced.fingerprint, repr(traced.inputs), target, repr(sorted(kwargs.items())), threads, reps,
           tuple(search_path))
    if key not in _NODE_TIMES:
        _NODE_TIMES[key] = _time_nodes(traced, target, kwargs, threads=threads, reps=reps, search_path=search_path)
    return _NODE_TIMES[key]


def _time_nodes(traced: Traced, target: str, kwargs: Mapping[str, Any], *, threads: int, reps: int,
                search_path: Sequence[str]) -> dict[str, float]:
    model, _ = instantiate(target, kwargs, mode="cpu", seed=0, search_path=search_path)
    example = example_inputs(traced.inputs, device="cpu")
    real = trace_model(model, traced.inputs, example, mode=traced.path)
    if real.fingerprint != traced.fingerprint:
        raise FrontendError("balanced(by=time): the model traces differently on CPU than on meta; balance by flops "
                            "instead", key="partition")
    restore = _threads(threads)
    try:
        runs: dict[str, list[float]] = {}
        args = [example[n.target] for n in real.gm.graph.nodes if n.op == "placeholder"]
        for rep in range(reps + 1):
            timer = _NodeTimer(real.gm)
            timer.run(*args)
            if rep:
                for k, v in timer.times.items():
                    runs.setdefault(k, []).append(v)
    finally:
        restore()
    return {k: statistics.median(v) for k, v in runs.items()}


def stage_costs(
    split: Split,
    source: str,
    *,
    recompute: frozenset[int] = frozenset(),
    peak_flops: float | None = None,
    profile: Profiling = Profiling(),
    autocast: str | None = None,
    target: str = "",
    kwargs: Mapping[str, Any] | None = None,
    search_path: Sequence[str] = (),
    tps: Sequence[Any] = (),
    tp: int = 1,
) -> tuple[StageCost, ...]:
    """Costs and activation bytes of every stage of ``split`` from ``source`` (``unit``/``flops``/``profile``,
    the last timed as ``profile`` says: a stage with tensor parallelism, ``tps`` at ``tp`` ranks, as its tp rank 0
    runs it)."""
    if source not in COST_SOURCES:
        raise FrontendError(f"costs must be one of {', '.join(COST_SOURCES)}, got {source!r}", key="costs")
    num = split.num_stages
    record = None
    with_params = _param_nodes(split.traced)  # once for all stages: it walks the whole graph
    flops = [stage_flops(split, s, with_params) for s in range(num)]
    if source == "unit":
        base = [UNIT_COST] * num
    elif source == "flops":
        if not peak_flops or peak_flops <= 0:
            raise FrontendError(
                "costs flops converts FLOPs to seconds at a device peak, but peak_flops is not set; "
                "set peak_flops (e.g. peak_flops 989e12 for an H100 in bf16) or use costs profile", key="costs",
            )
        base = [Cost(fwd=f / peak_flops, bwd=(i + w) / peak_flops, bwd_i=i / peak_flops, bwd_w=w / peak_flops) for f, i, w in flops]
    else:
        base, record = profile_stages(split, profile, autocast=autocast, target=target, kwargs=kwargs or {},
                                      search_path=search_path, tps=tps, tp=tp)
    out = []
    for s in range(num):
        if source != "unit" and all(src < 0 for src in split.parts[s].sources):
            base[s] = _no_input_grad(base[s])
        full = stage_activation_bytes(split, s)
        if s in recompute:
            cost, act = with_recompute(base[s]), sum(x.num_bytes for x in split.parts[s].inputs)
        else:
            cost, act = base[s], full
        out.append(StageCost(cost=cost, activation_bytes=act, full_activation_bytes=full, flops=flops[s],
                             profile=record))
    return tuple(out)
