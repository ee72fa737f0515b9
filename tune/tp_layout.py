"""The tensor-parallel layouts ``pipec tune`` prices and writes: the compile's analysis, run on tune's cuts.

``pipec compile`` at tp > 1 shards every stage by the dataflow analysis of :mod:`pipec.tp`
(:func:`~pipec.tp.plan_stages` on the cut's stage modules, built on meta), and a run analyses its stages again
and refuses a record that differs. Tune cuts its traces cost-only (each cut read off the trace's nodes, no
stage modules: :mod:`pipec.costs.cutcost`), so for the tp > 1 candidates it prices, :class:`Layouts` splits
the cut with torch.fx (:func:`~pipec.model.partition.split_graph`), gives each stage a module over the
trace's own meta parameters (the analysis reads graphs, shapes, module classes and parameter names, never
values, so nothing is copied) and runs the same analysis at every tp of the search.

What decides a stage's record: its graph (nodes, modules, parameters, inputs and outputs at the microbatch's
shapes, what :func:`~pipec.costs.timings.stage_digest` fingerprints), tp, the keys ``tensor_parallel`` and
``sequence_parallel``, the loss, and its place in the cut, which the analysis decides the stages together
for: the last stage's head may be loss-parallel, a stage's inputs arrive as parts from the stages before it
under sequence parallelism, and a tied weight is sharded alike in every stage that holds it. One search has
one set of those keys and one trace per microbatch shape, and a cut's key (stages, microbatch, balance)
names its stages' graphs and places, so the layouts are kept per (cut, tp): every distinct stage is analysed
once per tp, whatever schedule, microbatch count, replicas, sharding or recompute its candidates add. They
are not kept in the profile cache (:mod:`pipec.costs.cache`): its kinds are timings, and a cut's analysis
takes tens of milliseconds beside the split it needs, which only a stage's module could give.

A cut the analysis refuses at a tp (a width tp does not divide, grouped-query attention with fewer kv heads
than tp: what a compile would refuse) has no layout at it; its candidates are not built, the first refusal
at each tp kept (:attr:`Layouts.refusals`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Hashable, Iterable, Mapping

from torch import nn

from pipec.compiler.ir.graph import StageGraph, make_graph
from pipec.compiler.ir.tensor_parallel import StageTP
from pipec.model.partition import Split, split_graph
from pipec.model.stages import StageModule, resolve
from pipec.model.tensors import FrontendError
from pipec.model.trace import Traced
from pipec.tp import plan_stages

__all__ = ["Layouts", "stage_module", "with_layout"]


def stage_module(split: Split, s: int) -> StageModule:
    """Stage ``s`` of ``split`` as the analysis reads it: its graph over the traced model's own modules and meta
    parameters (by reference, as :func:`~pipec.model.stages.materialize` would copy them), with the stage's input
    and output names and each local parameter name's canonical one."""
    part = split.parts[s]
    graph = split.stage_graph(s)
    canon_by_id = {id(p): c for c, p in split.traced.param_of.items()}
    canonical: dict[str, str] = {}
    for node in graph.nodes:
        if node.op not in ("call_module", "get_attr"):
            continue
        target = str(node.target)
        obj = resolve(split.traced.gm, target)
        if isinstance(obj, nn.Module):
            for path, mod in obj.named_modules(prefix=target, remove_duplicate=False):
                for key, p in mod._parameters.items():
                    if p is not None:
                        canonical[f"{path}.{key}"] = canon_by_id[id(p)]
        elif isinstance(obj, nn.Parameter):
            canonical[target] = canon_by_id[id(obj)]
    return StageModule(split.traced.gm, graph, stage=s, input_names=tuple(x.name for x in part.inputs),
                       output_names=tuple(x.name for x in part.outputs), canonical=canonical, param_order=part.params)


def with_layout(graph: StageGraph, layout: Iterable[StageTP | None]) -> StageGraph:
    """``graph`` with each stage's tensor-parallel record (as :func:`~pipec.compiler.frontend.cut_stage_graph`
    sets it at tp > 1)."""
    stages = tuple(replace(st, tp=stp) for st, stp in zip(graph.stages, layout, strict=True))
    return replace(graph, stages=stages, graph=make_graph(stages, graph.edges, graph.ties))


class Layouts:
    """One search's layouts, per (cut, tp) (see the module doc). ``degrees``: the tp > 1 the search prices (a cut
    is split once and analysed at all of them); ``tensor_parallel``, ``sequence_parallel``, ``loss``: the file's
    keys, as :attr:`~pipec.compiler.request.CompileRequest.tensor_parallel` and the mesh and training hold them."""

    def __init__(self, *, degrees: Iterable[int], tensor_parallel: Any = "auto", sequence_parallel: bool = False,
                 loss: str = "cross_entropy"):
        self.degrees = tuple(sorted({int(t) for t in degrees if t > 1}))
        self.patterns: Mapping[str, str] | None = None if tensor_parallel == "auto" else dict(tensor_parallel)
        self.sequence_parallel, self.loss = sequence_parallel, loss
        self.layouts: dict[tuple[Hashable, int], tuple[StageTP, ...] | FrontendError] = {}
        """(cut key, tp) -> every stage's record, or the analysis's refusal."""
        self.refusals: dict[int, FrontendError] = {}
        """tp -> the first refusal at it."""
        self.num_splits = 0
        """Cuts split for their stages' modules."""

    def of(self, key: Hashable, traced: Traced, graph: StageGraph, tp: int) -> tuple[StageTP, ...] | None:
        """The records of the cut ``graph`` (cut from ``traced``; ``key`` names it in the search) at ``tp`` > 1,
        or None where the analysis refuses it."""
        assert tp > 1, tp
        if (key, tp) not in self.layouts:
            self._analyse(key, traced, graph, sorted({tp, *self.degrees}))
        got = self.layouts[(key, tp)]
        return None if isinstance(got, FrontendError) else got

    def _analyse(self, key: Hashable, traced: Traced, graph: StageGraph, degrees: Iterable[int]) -> None:
        """Split the cut, build its stages' modules, and analyse them at each of ``degrees`` not analysed yet."""
        stage_of = {name: st.stage for st in graph.stages for name in st.nodes}
        split = split_graph(traced, stage_of, graph.num_stages)
        self.num_splits += 1
        modules = [stage_module(split, s) for s in range(split.num_stages)]
        for tp in degrees:
            if (key, tp) in self.layouts:
                continue
            try:
                got: tuple[StageTP, ...] | FrontendError = tuple(plan_stages(
                    modules, tp, patterns=self.patterns, traced=traced, sequence_parallel=self.sequence_parallel,
                    loss=self.loss))
            except FrontendError as err:
                got = err
                self.refusals.setdefault(tp, err)
            self.layouts[(key, tp)] = got
