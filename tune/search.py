"""``pipec tune``'s search: the candidates of :mod:`.space` compiled, bounded, pruned and ranked.

The model is traced once per microbatch shape and each distinct cut (stages, microbatch shape,
balance) is costed once; recompute and the data record are derived from the cut (:class:`_Graphs`).
Recompute is the least that fits, so the space has one point per layout, schedule, chunks,
microbatches and balance: a candidate whose memory bound is over the budget gets stages 0..k-1
recomputed, the least k its bound allows found by bisection (more recompute only adds time and
lowers the peak); one the compile still finds over budget (gathered shards) gets one stage more.

The search is best-first branch and bound (:class:`_Search`) on the lower bounds of
:mod:`.bounds`: the step, communication included (pp transfers on fill and drain, the
collectives that block a rank, the shard collectives on its lane, the optimizer step after the last
arrival), and the peak memory (the state at rest plus the activations at their peak in the
candidate's compute order, exact unless parameters are sharded). A candidate over the budget by
its bound is refused uncompiled; once the top table is full and the next bound cannot beat its last
row, the rest are pruned. Candidates are compiled by the driver as ``pipec compile`` would
(:func:`~pipec.compiler.driver.compile_request`) but without the proof and the timeline's events,
which only the plans kept need: the table, the frontier and the file's own candidate are proven
(:func:`~pipec.compiler.passes.verify.verify`) and given the timeline of the proof's execution, events and
all; one that fails is dropped and the search goes on, so every plan tune reports or writes is a
verified plan. The table and the winner are so exactly what
compiling and proving every candidate would give; the time-memory frontier is the Pareto set of the
candidates compiled, exact for steps below the table's last row (slower, smaller ones may be
missing).

torch-free at import: the front end is loaded only when a model is traced, as the driver does.
The output (table, reasons, JSON) is in :mod:`.report`, runs in :mod:`.measure`.
"""

from __future__ import annotations

import bisect
import heapq
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

from pipec.compiler.driver import compile_request, with_timeline
from pipec.compiler.ir.plan import Mesh, Plan
from pipec.compiler.passes.memory import MemoryBudgetError, bytes_per_param
from pipec.compiler.sim.metrics import mfu as mfu_of, scaling_efficiency, single_device_step
from pipec.compiler.passes.verify import VerifyError, verify
from pipec.compiler.sim.engine import BUFFERED, Deadlock
from pipec.schedules.order import gc_paused
from pipec.tune.bounds import Frame, candidate_frame, memory_bound, order_cache, step_bound
from pipec.tune.space import (Candidate, TuneError, TuneRequest, candidate_request, candidates, memory_budget,
                              start_candidate, total_batch)

__all__ = ["Scored", "TuneResult", "tune", "banded"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Scored:
    """A compiled candidate and its prediction."""

    candidate: Candidate
    plan: Plan = field(repr=False, compare=False)
    step_time: float
    peak_memory: int | None
    """The most any rank holds at its peak (bytes)."""
    bubble: float
    tokens_per_s: float | None
    mfu: float | None
    scaling_efficiency: float | None = None
    """Throughput over the devices' count x one device's, that one predicted from the same costs
    (:mod:`pipec.compiler.sim.metrics`)."""
    measured_step: float | None = None
    """``--measure``: the median step under ``pipec run``."""
    summed_step: float | None = None
    """Under costs profile, a row not timed on its own stages: its plan's step, summed from pieces; ``step_time``
    (and tokens/s, MFU, scaling efficiency with it) is that x the pieces' level (:attr:`TuneResult.level`). None: the
    row is its plan's prediction."""

    def rank_key(self) -> tuple:
        """Fastest first (to 9 significant digits: float noise is no difference), then smallest, then the
        space's order."""
        return (float(f"{self.step_time:.9g}"), self.peak_memory or 0, self.candidate.sort_key())


@dataclass(frozen=True, slots=True, kw_only=True)
class TuneResult:
    best: Scored
    top: tuple[Scored, ...]
    """The fastest fitting candidates, fastest first."""
    frontier: tuple[Scored, ...]
    """The time-memory Pareto set of the fitting candidates, fastest first."""
    start: Candidate | None
    """The file's own layout and schedule as a candidate (None when it is outside the space)."""
    start_scored: Scored | None
    global_batch: int
    num_devices: int
    device_memory: int | None
    peak_flops: float | None
    num_candidates: int
    num_compiled: int
    num_over_budget: int
    """Refused: over ``device_memory`` (by the bound before compiling, or by the compile)."""
    num_pruned: int
    """Skipped by the bounds: they could not enter the table."""
    refused: tuple[tuple[int, Candidate], ...] = ()
    """The candidates over budget, each with a lower bound on (or the measure of) what it needs (bytes)."""
    num_unbuildable: int
    """Cuts the model does not have (more stages than places to cut) or that the front end refused."""
    num_unproven: int = 0
    """Plans the search compiled that failed their proof (dropped; a compiler bug if ever non-zero)."""
    num_traces: int
    num_cuts: int
    seconds: float
    num_pieces: int | None = None
    """Under costs profile: the pieces timed that every cut was priced from (:mod:`pipec.costs.pieces`);
    None: the cuts were priced as they are (unit or flops costs)."""
    num_timed: int = 0
    """Under costs profile: the cuts timed on their own stages (the file's own, the fastest until the fastest is
    timed so)."""
    level: float | None = None
    """Under costs profile: the pieces' level, the median of timed / summed step over the cuts timed on their own
    stages (:meth:`_Search.level`); every row summed from pieces is ranked and shown at its summed step x this.
    None: nothing was summed."""
    best_tp1: Scored | None = None
    """When the winner has tp > 1: the fastest fitting candidate without tensor parallelism, proven (found past
    the table's pruning, by the same bounds); None when the winner is tp 1 or no tp 1 candidate fits."""


# ----------------------------------------------------------------------------- traces and cuts


class _Graphs:
    """The front end, cached: one trace per microbatch shape (the first one's fx graph annotated again at
    each other shape), one cut per (stages, microbatch shape, balance, the tp pairs it keeps whole), the data record per (microbatch
    shape, microbatches, dp) and recompute derived from them, each graph built once (:attr:`graphs`).
    Cuts are cost-only (read off the trace's nodes, the same StageGraph without the stage modules); a tp > 1
    candidate's cut carries each stage's record from the compile's own analysis (:mod:`.tp_layout`). The
    winner's is confirmed the full way (:meth:`confirm`)."""

    cost_only = True

    def __init__(self, treq: TuneRequest, batch: int, space: Sequence[Candidate] = ()):
        self.treq, self.batch = treq, batch
        self.traces: dict[int, Any] = {}
        self.cuts: dict[tuple[int, int, str | None], Any] = {}
        self.data: dict[tuple[int, int, int], Any] = {}
        self.graphs: dict[tuple, Any] = {}
        """(cut key, data key, recompute) -> the candidate's StageGraph: all :meth:`graph` reads of a candidate
        (the bisection on recompute asks for the same graphs from every schedule and shard mode)."""
        self.timed_cuts: dict[tuple[int, int, str | None], Any] = {}
        """Under costs profile, the cuts timed on their own stages (:meth:`timed`)."""
        self.pairs: dict[tuple[int, int], tuple] = {}
        """(microbatch size, tp) -> the cut key's part for the positions inside a tensor-parallel pair."""
        self.pieces = None
        """Under costs profile, what the cuts are priced by (:class:`~pipec.costs.pieces.Pieces`)."""
        self._layouts = None
        if space and treq.base.model is not None and treq.base.model.costs == "profile":
            from pipec.compiler.frontend import Host
            from pipec.costs.costs import profiling
            from pipec.costs.pieces import Pieces

            mreq = self._request(space[0])
            host = Host.of(mreq.mesh)
            smallest = min(space, key=lambda c: self._mb(c))
            crowd = self._crowd_candidate(space)
            self.pieces = Pieces(profiling(local_ranks=host.local_ranks, threads=host.threads_per_rank,
                                           reps=host.profile_reps), kwargs=mreq.model.kwargs,
                                 calibration=lambda: self._traced(smallest), crowd=lambda: self._traced(crowd))

    def _crowd_candidate(self, space: Sequence[Candidate]) -> Candidate:
        """A candidate at the microbatch shape whose crowd prices every shape (:class:`~pipec.costs.pieces.
        Pieces`): the file's own candidate's shape where the space has it (the plan a compile of the file would
        time), else the middle of the space's shapes."""
        by_shape = {self._mb(c): c for c in reversed(space)}   # the first candidate of each shape
        start = start_candidate(self.treq)
        mb = self._mb(start) if start is not None else None
        if mb not in by_shape:
            shapes = sorted(by_shape)
            mb = shapes[len(shapes) // 2]
        return by_shape[mb]

    def _request(self, c: Candidate):
        """The candidate's compile request without recompute (derived from the cut, :meth:`_finish`)."""
        req = candidate_request(self.treq, c, global_batch=self.batch)
        return replace(req, training=replace(req.training, recompute=()))

    def _keys(self, c: Candidate) -> tuple[int, tuple, tuple]:
        """The candidate's microbatch size, its cut's key (stages, microbatch, balance, and at tp > 1 the cut
        positions inside a tensor-parallel pair, which the cut keeps out of) and its data's."""
        mb = self._mb(c)
        return mb, (c.num_stages, mb, c.partition_by, *self._pairs(c)), (mb, c.num_microbatches, c.dp)

    def _mb(self, c: Candidate) -> int:
        """The candidate's microbatch size."""
        return self.batch // c.dp // c.num_microbatches

    def _pairs(self, c: Candidate) -> tuple:
        """The cut positions inside a tensor-parallel pair at the candidate's tp, as a compile of it cuts
        (:func:`~pipec.compiler.frontend.inside_tp_pairs`); () at tp 1."""
        if c.tp == 1 or c.num_stages == 1:
            return ()
        from pipec.compiler.frontend import inside_tp_pairs

        at = (self._mb(c), c.tp)   # the trace's shape and the tp: all they depend on
        if at not in self.pairs:
            self.pairs[at] = (tuple(sorted(inside_tp_pairs(self._traced(c), self._request(c)))),)
        return self.pairs[at]

    def graph(self, c: Candidate):
        """The candidate's StageGraph, or None when the model cannot be cut that way."""
        mb, key, data_key = self._keys(c)
        whole = (key, data_key, c.recompute, c.tp)
        if whole not in self.graphs:
            if c.tp == 1:
                self.graphs[whole] = self._graph(c, key, data_key, mb)
            elif key == self._keys(replace(c, tp=1))[1]:   # no pair to keep whole: the tp 1 cut
                self.graphs[whole] = self._sharded(self.graph(replace(c, tp=1)), c)
            else:
                self.graphs[whole] = self._sharded(self._graph(replace(c, tp=1), key, data_key, mb, cut_tp=c.tp), c)
        return self.graphs[whole]

    def _sharded(self, graph, c: Candidate):
        """``graph`` (the candidate's cut at tp 1) with every stage's record at the candidate's tp, as a compile
        of the candidate shards it (:class:`~pipec.tune.tp_layout.Layouts`: the compile's analysis, once per
        cut and tp); None where the model cannot be cut so or the analysis refuses the cut at that tp."""
        if graph is None:
            return None
        from pipec.tune.tp_layout import with_layout

        layout = self.layouts.of(self._keys(c)[1], self._traced(c).traced, graph, c.tp)
        return None if layout is None else with_layout(graph, layout)

    @property
    def layouts(self):
        """The search's tensor-parallel layouts (:class:`~pipec.tune.tp_layout.Layouts`), made at the first tp > 1
        candidate."""
        if self._layouts is None:
            from pipec.tune.space import tp_options
            from pipec.tune.tp_layout import Layouts

            base = self.treq.base
            self._layouts = Layouts(degrees=tp_options(self.treq), tensor_parallel=base.tensor_parallel,
                                    sequence_parallel=base.mesh.sequence_parallel, loss=base.training.loss)
        return self._layouts

    def _graph(self, c: Candidate, key: tuple, data_key: tuple, mb: int, cut_tp: int | None = None):
        """The cut under ``key`` (``cut_tp``: keeping that tp's pairs whole, :meth:`_keys`) for candidate ``c``."""
        from pipec.compiler.frontend import FrontendError, cut_stage_graph

        mreq = None
        if key not in self.cuts or data_key not in self.data:
            mreq = self._request(c)
        tm = self._traced(c)
        if key not in self.cuts:
            try:
                if self.pieces is None:
                    self.cuts[key] = cut_stage_graph(tm, mreq, runnable=not self.cost_only, cut_tp=cut_tp)
                else:   # priced from the pieces' timings: the cut itself is cost-only
                    unit = replace(mreq, model=replace(mreq.model, costs="unit"))
                    self.cuts[key] = self.pieces.price(tm, cut_stage_graph(tm, unit, runnable=False, cut_tp=cut_tp))
            except FrontendError as err:
                if err.key not in ("partition", "stages"):
                    raise
                self.cuts[key] = None
        return self._finish(self.cuts[key], c, data_key, mreq)

    def _finish(self, cut, c: Candidate, data_key: tuple, mreq):
        """A cut given the candidate's data record and recompute."""
        from pipec.compiler.frontend import with_data, with_recompute_stages

        if cut is None:
            return None
        if data_key not in self.data:
            self.data[data_key] = with_data(cut, self._traced(c), mreq).model["data"]
        cut = replace(cut, model={**cut.model, "data": self.data[data_key]})
        return with_recompute_stages(cut, c.recompute) if c.recompute else cut

    def _traced(self, c: Candidate):
        """The model traced at the candidate's microbatch shape (once per shape)."""
        from pipec.compiler.frontend import trace_request

        mb = self._mb(c)
        if mb not in self.traces:
            self.traces[mb] = trace_request(self._request(c), like=next(iter(self.traces.values()), None))
        return self.traces[mb]

    def timed(self, c: Candidate):
        """Under costs profile, the candidate's graph with its own stages timed (a full cut, as ``pipec compile``
        cuts and times it; tp > 1: the tp 1 cut timed, given the compile's layout, :meth:`_sharded`)."""
        mb, key, data_key = self._keys(c)
        if c.tp > 1:
            return self._sharded(self._timed(replace(c, tp=1), key, data_key, c.tp), c)
        return self._timed(c, key, data_key)

    def _timed(self, c: Candidate, key: tuple, data_key: tuple, cut_tp: int | None = None):
        from pipec.compiler.frontend import cut_stage_graph

        mreq = self._request(c)
        if key not in self.timed_cuts:
            self.timed_cuts[key] = cut_stage_graph(self._traced(c), mreq, cut_tp=cut_tp)
        return self._finish(self.timed_cuts[key], c, data_key, mreq)

    def final(self, c: Candidate):
        """The graph a candidate is reported by: under costs profile its own stages timed (:meth:`timed`), else the
        one it was searched by (:meth:`graph`)."""
        return self.graph(c) if self.pieces is None else self.timed(c)

    def confirm(self, c: Candidate) -> None:
        """Cut the candidate's stages the full way (their modules built and, at tp > 1, analysed, as a compile
        and a run build them) and check that the cost-only cut it was priced by is the same, its tp records
        included (:meth:`_sharded`)."""
        from pipec.compiler.frontend import confirm_cut

        mb, key, _ = self._keys(c)
        if self.cost_only and self.pieces is None:   # under pieces the pick was cut and timed the full way
            cut = self.cuts[key] if c.tp == 1 else self._sharded(self.cuts[key], c)
            confirm_cut(self.traces[mb], self._request(c), cut)


# ----------------------------------------------------------------------------- bounds and the search


def _per_param(c: Candidate, spec) -> float:
    """State bytes per parameter one rank holds at least (shards unpadded; every parameter taken as sharded
    over tp, which only lowers it)."""
    mesh = Mesh(pp=c.pp, dp=c.dp, shard=c.shard, shard_size=c.shard_size)
    return sum(mesh.shard_mode.state(bytes_per_param(spec), 1.0, 1.0 / mesh.num_shards)) / c.tp


def _score(c: Candidate, plan: Plan, tokens: int, peak_flops: float | None, num_devices: int,
           single_step: float | None = None) -> Scored:
    """``single_step``: one device's predicted step over the same batch (for the scaling efficiency)."""
    pred = plan.prediction
    peaks = [r.peak_memory_bytes for r in pred.per_rank if r.peak_memory_bytes is not None]
    mfu = mfu_of((plan.model or {}).get("flops_per_step"), step_time=pred.step_time, dp=c.dp,
                 num_devices=num_devices, peak_flops=peak_flops)
    return Scored(candidate=c, plan=plan, step_time=pred.step_time, peak_memory=max(peaks) if peaks else None,
                  bubble=pred.bubble_fraction, tokens_per_s=tokens / pred.step_time if pred.step_time else None,
                  mfu=mfu, scaling_efficiency=scaling_efficiency(pred.step_time, num_devices, single_step))


def banded(s: Scored) -> Scored:
    """A kept candidate with its plan's interval (:func:`~pipec.compiler.sim.simulate.interval_of`), as a plan
    written for a run has it (the table's rows go without: 20 runs of the event loop each)."""
    from pipec.compiler.sim.simulate import interval_of

    pred = s.plan.prediction
    if pred.interval is not None:
        return s
    band = interval_of(s.plan, point=pred.step_time)
    return replace(s, plan=replace(s.plan, prediction=replace(pred, interval=band)))


def _pareto(scored: Iterable[Scored], key: Callable[[Scored], tuple] = Scored.rank_key) -> tuple[Scored, ...]:
    out: list[Scored] = []
    for s in sorted(scored, key=key):
        if not out or (s.peak_memory or 0) < (out[-1].peak_memory or 0):
            out.append(s)
    return tuple(out)


def tune(treq: TuneRequest) -> TuneResult:
    """Search the space; the best fitting candidate and the table (see the module docstring)."""
    # the plans compiled are millions of acyclic objects: collections would only rescan them, and one as the
    # collector resumes would scan them all, so it resumes once the search (all but the result) is freed
    with gc_paused():
        return _tune(treq, time.perf_counter())


def _tune(treq: TuneRequest, t0: float) -> TuneResult:
    batch = total_batch(treq)
    space = candidates(treq)
    if not space:
        raise TuneError(f"no candidate: {treq.num_devices} devices, global batch {batch} and the kept keys "
                        f"({', '.join(sorted(treq.keep)) or 'none'}) leave no layout whose replicas split the "
                        "batch; keep fewer keys or choose another --global-batch")
    search = _Search(treq, batch, space)
    for c in space:
        search.add(c)
    progress = lambda j: treq.progress and treq.progress(min(j, len(space)), len(space))  # noqa: E731
    search.run(progress)
    start = start_candidate(treq)
    if search.graphs.pieces is not None:   # summed prices: the file's own and the fastest timed on their stages
        search.retime(next((s for s in search.fits if _same_base(s.candidate, start)), None))
        while search.retime_fastest():
            search.run(progress)
    if not search.fits:
        raise TuneError(_no_fit(treq, batch, search.refused, search.graphs), key="device_memory")
    ranked = [search.proven(s) for s in search.ranked()[:treq.num_top]]   # proven by search.run
    assert search.graphs.pieces is None or ranked[0].candidate in search.retimed, "the plan written is timed"
    search.graphs.confirm(ranked[0].candidate)   # the plan written (a run checks its own cut: runtime.stages)
    frontier = search.proven_frontier()
    start_scored = next((kept for s in search.fits if _same_base(s.candidate, start)
                         and (kept := search.proven(s)) is not None), None)
    if start_scored is None and start is not None and any(_same_base(c, start) for c in space):
        start_scored = search.settle(start)     # pruned: compiled anyway, the winner is compared with it
    num_pruned = len(search.queue)
    best_tp1 = search.best_where(lambda x: x.tp == 1) if ranked[0].candidate.tp > 1 else None
    ranked[0] = banded(ranked[0])   # the plan written
    shown = search.shown
    return TuneResult(best=ranked[0], top=tuple(map(shown, ranked)), frontier=tuple(map(shown, frontier)),
                      start=start, start_scored=shown(start_scored), global_batch=batch, num_devices=treq.num_devices,
                      device_memory=search.budget, peak_flops=search.peak_flops, num_candidates=len(space),
                      num_compiled=search.num_compiled, num_over_budget=len(search.refused),
                      num_pruned=num_pruned, num_unbuildable=search.num_unbuildable, best_tp1=shown(best_tp1),
                      num_unproven=search.num_unproven, refused=tuple(search.refused),
                      num_traces=len(search.graphs.traces),
                      num_cuts=sum(1 for g in search.graphs.cuts.values() if g is not None),
                      num_pieces=search.graphs.pieces.num_timed if search.graphs.pieces is not None else None,
                      num_timed=len(search.graphs.timed_cuts),
                      level=search.level() if search.graphs.pieces is not None else None,
                      seconds=time.perf_counter() - t0)


def _same_base(a: Candidate, b: Candidate | None) -> bool:
    """The same candidate but for recompute (the search adds the least recompute that fits)."""
    return b is not None and replace(a, recompute=frozenset()) == replace(b, recompute=frozenset())


_CUT, _COMPILE = 0, 1
"""Queue stages: a candidate queued by the bound that needs no cut, or by its own bounds."""


class _Search:
    """Best-first branch and bound (see the module docstring). Every candidate is queued first by a
    bound that needs no cut of its own (M x the whole model's compute at its microbatch shape / pp:
    the average rank's); popped, it is cut, given the least recompute of stages 0..k-1 its memory
    bound allows (found by bisection; none: refused), and queued again by its own bounds; popped
    again, it is compiled without its proof. One the compile finds over budget is queued again with
    one stage more recomputed. Once the table is full and the head of the queue cannot beat its last
    row, the table is proven (:func:`~pipec.compiler.passes.verify.verify`); a plan that fails is dropped and
    the search goes on from the queue, so the table holds proven plans only."""

    def __init__(self, treq: TuneRequest, batch: int, space: Sequence[Candidate] = ()):
        self.treq, self.batch = treq, batch
        self.graphs = _Graphs(treq, batch, space)
        self.order = order_cache()
        self.budget = memory_budget(treq)
        self.peak_flops = treq.peak_flops if treq.peak_flops is not None else treq.base.training.peak_flops
        self.tokens = batch * _numel(treq.base.model.inputs[0].shape[1:])
        self.queue: list[tuple[float, tuple, int, Candidate, Any]] = []
        self.fits: list[Scored] = []
        self.refused: list[tuple[int, Candidate]] = []
        self.num_compiled = self.num_unbuildable = self.num_unproven = 0
        self._times: list[float] = []
        self._proofs: dict[Candidate, bool] = {}
        self._whole: dict[int, Any] = {}
        self.retimed: set[Candidate] = set()
        """The candidates compiled again on their own stages' timings (:meth:`retime`)."""
        self._ratios: list[float] = []
        """Per candidate retimed that fits, its timed step over its summed step (:meth:`level`)."""

    def _whole_model(self, c: Candidate):
        """The model as one stage at the candidate's microbatch shape (its compute and parameters)."""
        mb = self.batch // c.dp // c.num_microbatches
        if mb not in self._whole:
            one = replace(c, pp=1, dp=c.dp, tp=1, num_chunks=1, shard="none", shard_size=None, recompute=frozenset())
            self._whole[mb] = self.graphs.graph(one)
        return self._whole[mb]

    def add(self, c: Candidate) -> None:
        """Queue a candidate by the bound that needs no cut, or refuse it by the average rank's state."""
        whole = self._whole_model(c)
        if whole is None:                       # the model as one stage: the front end refused a cut
            self.num_unbuildable += 1
            return
        num_params = sum(st.num_params or 0 for st in whole.stages)
        average = num_params * _per_param(c, self.treq.base.spec_json()) / c.pp
        if self.budget is not None and average > self.budget:
            self.refused.append((int(average), c))
            return
        step = c.num_microbatches * sum(st.cost.fwd + st.cost.bwd for st in whole.stages) / c.pp
        heapq.heappush(self.queue, (step * self._tp_share(c), c.sort_key(), _CUT, c, None))

    @staticmethod
    def _tp_share(c: Candidate) -> float:
        """A lower bound on the share of a stage's compute one tp rank of the candidate does: 1 / tp (its replicated
        part and its collectives only add; for the example GPT every traced FLOP is a sharded matmul's, so the
        bound is also the share)."""
        return 1.0 / c.tp

    def single_step(self, c: Candidate) -> float | None:
        """One device's predicted step over the global batch at the candidate's microbatch shape
        (:func:`~pipec.compiler.sim.metrics.single_device_step`: the whole model's costs)."""
        whole = self._whole_model(c)
        if whole is None:
            return None
        return single_device_step([st.cost for st in whole.stages], c.dp * c.num_microbatches)

    def score(self, c: Candidate, plan: Plan) -> Scored:
        return _score(c, plan, self.tokens, self.peak_flops, self.treq.num_devices, self.single_step(c))

    def _frame(self, c: Candidate):
        """The candidate's graph and frame, or None when the model cannot be cut that way."""
        graph = self.graphs.graph(c)
        if graph is None:
            return None
        return graph, candidate_frame(candidate_request(self.treq, c, global_batch=self.batch), graph, self.order(c))

    def _bound(self, c: Candidate) -> None:
        """Cut a candidate, give it the least recompute its memory bound allows, and queue it by its own
        bounds (or refuse it)."""
        got = self._frame(c)
        if got is None:
            self.num_unbuildable += 1
            return
        graph, frame = got
        mem, state = memory_bound(frame, graph.stages)
        if self.budget is not None and mem > self.budget:
            if state > self.budget or "recompute" in self.treq.keep:
                self.refused.append((mem, c))
                return
            least = self._least_recompute(c, frame, len(c.recompute) + 1)
            if least is None:
                self.refused.append((memory_bound(frame, self._recomputed(c, c.num_stages).stages)[0], c))
                return
            c = replace(c, recompute=frozenset(range(least)))
            got = self._frame(c)
        self._push(c, *got)

    def _push(self, c: Candidate, graph, frame: Frame) -> None:
        heapq.heappush(self.queue, (step_bound(c, frame), c.sort_key(), _COMPILE, c, graph))

    def _recomputed(self, c: Candidate, k: int):
        return self.graphs.graph(replace(c, recompute=frozenset(range(k))))

    def _least_recompute(self, c: Candidate, frame: Frame, lo: int) -> int | None:
        """The least k >= lo whose memory bound (stages 0..k-1 recomputed) is within the budget, by
        bisection (the bound falls as k grows); None when even all stages do not bring it under."""
        hi, found = c.num_stages, None
        while lo <= hi:
            mid = (lo + hi) // 2
            if memory_bound(frame, self._recomputed(c, mid).stages)[0] <= self.budget:
                found, hi = mid, mid - 1
            else:
                lo = mid + 1
        return found

    def _escalate(self, c: Candidate) -> None:
        """A compiled candidate over budget (its gathered parameters): queue it with one stage more
        recomputed, or refuse it."""
        k = len(c.recompute)
        if "recompute" in self.treq.keep or k >= c.num_stages:
            got = self._frame(c)
            self.refused.append((memory_bound(got[1], got[0].stages)[0], c))
            return
        more = replace(c, recompute=frozenset(range(k + 1)))
        self._push(more, *self._frame(more))

    def run(self, progress: Callable[[int], Any]) -> None:
        """Search until nothing queued can enter the table, prove the table; again while a proof fails."""
        while True:
            self._search(progress)
            failed = [s for s in self.ranked()[:self.treq.num_top] if self.proven(s) is None]
            if not failed:
                return
            for s in failed:
                self._drop(s)

    def _search(self, progress: Callable[[int], Any]) -> None:
        K = self.treq.num_top
        while self.queue:
            step, _, stage, c, graph = self.queue[0]
            if len(self._times) >= K and _beyond(step, self._times[K - 1]):
                return                          # the table is full: nothing queued can enter it
            heapq.heappop(self.queue)
            if stage != _CUT:
                progress(self.num_compiled + len(self.refused) + self.num_unbuildable)
            self._process(stage, c, graph)

    def _process(self, stage: int, c: Candidate, graph) -> None:
        """One entry popped off the queue: a candidate cut and bounded, or compiled and scored."""
        if stage == _CUT:
            self._bound(c)
            return
        self._keep(c, self._compile(c, graph))

    def _keep(self, c: Candidate, plan: Plan | None | bool) -> None:
        """A compiled candidate scored into the table; one over budget queued with more recompute; one that cannot
        run dropped."""
        if plan is None:
            self._escalate(c)
        elif plan is not False:
            s = self.score(c, plan)
            self.fits.append(s)
            bisect.insort(self._times, self._bounded(s))

    def best_where(self, pred: Callable[[Candidate], bool]) -> Scored | None:
        """The fastest fitting candidate that ``pred`` holds for, proven: the branch and bound carried on past
        the table over the queued candidates ``pred`` holds for, until none queued can beat the best found."""
        while True:
            best = min((s for s in self.fits if pred(s.candidate)), key=self.rank_key, default=None)
            heads = [e for e in self.queue if pred(e[3])]
            head = min(heads, key=lambda e: e[:3]) if heads else None
            if head is not None and (best is None or not _beyond(head[0], self._bounded(best))):
                self.queue.remove(head)
                heapq.heapify(self.queue)
                self._process(head[2], head[3], head[4])
                continue
            if best is None:
                return None
            kept = self.proven(best)
            if kept is not None:
                return kept
            self._drop(best)

    def _compile(self, c: Candidate, graph) -> Plan | None | bool:
        """The candidate's plan, predicted but not proven, its timeline without events (:meth:`proven` gives a
        kept plan its own); None when it is over budget, False when it cannot run (the simulator found a
        deadlock: a plan no proof would pass)."""
        self.num_compiled += 1
        try:
            return compile_request(candidate_request(self.treq, c, global_batch=self.batch), graph=graph,
                                   verify=False, events=False).plan
        except MemoryBudgetError:
            return None
        except Deadlock:
            self.num_unproven += 1
            return False

    def settle(self, c: Candidate) -> Scored | None:
        """A candidate the search pruned, scored alone (the file's own): its least recompute that fits,
        compiled and proven; None when none fits or its plan fails its proof."""
        got = self._frame(c)
        if got is None:
            return None
        keep = "recompute" in self.treq.keep
        k = len(c.recompute) if keep or self.budget is None else self._least_recompute(c, got[1], 0)
        while k is not None:
            cand = c if keep else replace(c, recompute=frozenset(range(k)))
            plan = self._compile(cand, self.graphs.final(cand))
            if plan is False:
                return None
            if plan is not None:
                return self.proven(self.score(cand, plan))
            k = None if keep or k >= c.num_stages else k + 1
        return None

    def retime_fastest(self) -> bool:
        """Under summed prices (:class:`~pipec.costs.pieces.Pieces`): the fastest candidate (summed ones at
        the pieces' level, :meth:`rank_key`) compiled again on its own stages' timings, and again the fastest, until the
        fastest is one so timed; whether any was. It ends: each turn times a candidate not timed before."""
        any_ = False
        while self.fits and (head := self.ranked()[0]).candidate not in self.retimed:
            self.retime(head)
            any_ = True
        return any_

    def retime(self, s: Scored | None) -> None:
        """A summed candidate's row replaced by its compile on its own stages' timings (:meth:`_Graphs.timed`), its
        timed / summed step kept as evidence of the pieces' level (:meth:`level`); one over budget then goes to the
        queue with more recompute, one that cannot run leaves."""
        if s is None or s.candidate in self.retimed:
            return
        c = s.candidate
        self.retimed.add(c)
        self._drop(s)
        self._proofs.pop(c, None)
        plan = self._compile(c, self.graphs.timed(c))
        if isinstance(plan, Plan) and s.step_time > 0:
            self._ratios.append(plan.prediction.step_time / s.step_time)
            self._times = sorted(map(self._bounded, self.fits))   # the level moved: the timed rows' entries with it
        self._keep(c, plan)

    def level(self) -> float:
        """The pieces' level now: the median of timed / summed step over the candidates retimed that fit (1 before
        any). A cut timed on its own stages is timed at another moment than its pieces were, and on this kind of
        host the moment moves every timing by 15-50% (the example GPT: summed 619 ms, timed 760-999 ms for three
        cuts of one shape); the ratio is that moment's evidence, and its median over the cuts timed the best guess
        of what timing any other cut now would give."""
        return statistics.median(self._ratios) if self._ratios else 1.0

    def _priced(self, s: Scored) -> float:
        """The step a row is ranked by: timed on its own stages, its own; summed from pieces, that x :meth:`level`."""
        return s.step_time if s.candidate in self.retimed else s.step_time * self.level()

    def _bounded(self, s: Scored) -> float:
        """A row's entry in the table's steps the bounds are compared with (:attr:`_times`), in the bounds' own
        terms, summed prices: summed, its step; timed, its step / :meth:`level` (1 before any retime). It orders the
        rows as :meth:`_priced` does (one positive factor apart), so a candidate queued with a bound past the K-th
        entry prices, at the level, past the K-th row as ranked: pruning it is as safe as it was unscaled."""
        return s.step_time / self.level() if s.candidate in self.retimed else s.step_time

    def rank_key(self, s: Scored) -> tuple:
        """:meth:`Scored.rank_key` at the step :meth:`_priced` gives."""
        return (float(f"{self._priced(s):.9g}"), s.peak_memory or 0, s.candidate.sort_key())

    def shown(self, s: Scored | None) -> Scored | None:
        """A row as reported: summed from pieces, at its step x :meth:`level` (and its rates with it), its plan's
        own step kept as :attr:`Scored.summed_step`; timed, as it is."""
        if s is None or s.candidate in self.retimed or self.graphs.pieces is None:
            return s
        f = self.level()
        return replace(s, step_time=s.step_time * f, summed_step=s.step_time,
                       tokens_per_s=None if s.tokens_per_s is None else s.tokens_per_s / f,
                       mfu=None if s.mfu is None else s.mfu / f,
                       scaling_efficiency=None if s.scaling_efficiency is None else s.scaling_efficiency / f)

    def proven(self, s: Scored) -> Scored | None:
        """The candidate as kept: its plan proven by the verifier and given the timeline of the proof's buffered
        execution, events and all (the search predicts without them; the rest is the same); None when the plan
        fails its proof. Proven once."""
        if s.candidate not in self._proofs:
            try:
                plan = with_timeline(s.plan, verify(s.plan).executions[BUFFERED], interval=False)
                # the search predicts without events or an interval (a kept plan gets events; a written one, its
                # interval: :func:`banded`)
                assert replace(plan.prediction, events=(), interval=None) == s.plan.prediction, \
                    "a proof predicts what the search did"
                self._proofs[s.candidate] = replace(s, plan=plan)
            except VerifyError:
                self._proofs[s.candidate] = None
                self.num_unproven += 1
        return self._proofs[s.candidate]

    def _drop(self, s: Scored) -> None:
        self.fits.remove(s)
        self._times.pop(bisect.bisect_left(self._times, self._bounded(s)))

    def ranked(self) -> list[Scored]:
        """The compiled candidates that fit, fastest first (:meth:`rank_key`: summed ones at the pieces' level)."""
        return sorted(self.fits, key=self.rank_key)

    def proven_frontier(self) -> tuple[Scored, ...]:
        """The Pareto set of the compiled candidates whose plans are proven (one that fails is dropped), as
        kept (:meth:`proven`)."""
        while True:
            frontier = [(s, self.proven(s)) for s in _pareto(self.fits, self.rank_key)]
            failed = [s for s, kept in frontier if kept is None]
            if not failed:
                return tuple(kept for _, kept in frontier)
            for s in failed:
                self._drop(s)


def _beyond(bound: float, kth: float) -> bool:
    """Whether a candidate whose step is at least ``bound`` ranks after the table's last row ``kth``:
    compared as :meth:`Scored.rank_key` rounds them (an equal step may still win on memory), with room
    for the bound's own rounding."""
    return float(f"{bound * (1 - 1e-12):.9g}") > float(f"{kth:.9g}")


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _no_fit(treq: TuneRequest, batch: int, refused: list[tuple[int, Candidate]], graphs: _Graphs) -> str:
    """Why nothing fits, and what would, computed: the least any candidate needs, and the devices,
    recompute and sharding that would bring the state under the budget."""
    from pipec.compiler.ir.graph import human_bytes

    budget = memory_budget(treq)
    if not refused:
        refusals = graphs._layouts.refusals if graphs._layouts is not None else {}
        if not refusals:
            return "no candidate could be cut into its stages: the model has too few places to cut for these layouts"
        return ("no candidate could be built (each needs more stages than the model has places to cut, or tensor "
                "parallelism refuses its cut, as a compile of it would); " +
                "; ".join(f"at tp {tp}: {err}" for tp, err in sorted(refusals.items())))
    least_mem, least = min(refused, key=lambda x: (x[0], x[1].sort_key()))
    total = sum(st.num_params or 0 for st in graphs.graph(least).stages)
    parts = [f"no candidate fits device_memory {human_bytes(budget)} on {treq.num_devices} devices (global batch "
             f"{batch}): the least any needs is {human_bytes(least_mem)} or more ({least.layout}, {least.schedule}, "
             f"recompute {least.recompute_text})"]
    if total:
        per = sum(bytes_per_param(treq.base.spec_json()))
        state = total * per
        need = -(-state // budget)
        parts.append(f"the model's parameters, gradients and optimizer state are {human_bytes(state)} "
                     f"({total:,} parameters x {per} bytes): split over pp stages or sharded with shard full they "
                     f"need at least {need} devices of {human_bytes(budget)} before any activation")
        if need <= treq.num_devices:
            parts.append("the state alone would fit these devices: the activations do not; recompute all stages, "
                         "fewer sequences per microbatch (a smaller --global-batch) or more devices would help")
        else:
            parts.append(f"use --devices {_pow2_at_least(need)} or more, or a device with more memory")
    return "; ".join(parts)


def _pow2_at_least(n: int) -> int:
    k = 1
    while k < n:
        k *= 2
    return k
