"""Cuts priced from timed pieces: how ``pipec tune`` prices its cuts under ``costs profile`` without timing each.

A search cuts one traced model dozens of ways at each microbatch shape (stages, balance); timing every stage of
every cut is most of a search's time (the example GPT for 4 devices: 41 cuts timed, 250 s of 277). Instead a
cut's stages are priced as runs of *pieces* (:class:`Pieces`):

- The grid: every place where a layer (a ModuleList's) starts or ends and only tensors cross (:func:`grid_of`). A
  stage from position a to b is its pieces: it cut at the grid's positions inside it. A cut off the grid (inside a
  layer, or among the nodes around the layers) makes pieces of a grid piece; each is priced at its nodes' share
  of the grid piece's forward time (as ``balanced(by=time)`` measures the nodes), nothing more is timed.
- Pieces alike (the same code, modules and shapes: a transformer's layers) are timed once, as the first of them
  (one :func:`~.timings.stage_digest`), the way ``costs profile`` times a stage (:func:`~.timings.profile_stages`:
  alone, the crowd's slowdown, the profile cache). The crowd runs the layers' pieces: the nodes around the layers
  take a fraction of a millisecond, and a piece that short, in a crowd of more ranks than cores, waits out whole
  time slices that no stage of a run is short enough to meet.
- One crowd prices every shape: it is measured at one microbatch shape (``crowd``: the model traced there; the
  search's own candidate's shape, else the middle one) and every other shape whose crowd the profile cache lacks is
  priced at its slowdown, kept under that shape's key as measured at the other (:mod:`.timings`). The crowds of the
  example GPT's 5 shapes, measured apart in one search, had medians 2.05-2.89 and 1.42-4.22 across repeats: within
  their own noise of each other, so one crowd saves 4 of the 5 (about 2 s each on 2 cores) and takes the crowd's
  noise out of the ranking across shapes.
- A stage of k pieces costs their sum, per part, less k - 1 times the per-stage overhead (what a stage pays once
  and each piece timed alone paid again: its call, autograd's start, the optimizer's fixed cost). The overhead is
  what the pieces of the whole model took beyond the whole model timed as one stage, (sum - whole) / (n - 1), at
  the smallest microbatch shape the search prices (the cheapest whole; the overhead is a fixed cost): a one-stage
  cut at that shape is priced at the whole's own timing.

So a search times the whole model once and, per microbatch shape, one of each kind of piece (the example GPT:
an embedding's few nodes, one block, the head's), where it timed every stage of every cut. A summed price is
within the pieces' own noise of the cut's timing (bench/tune.py prints both); ``pipec tune`` times the stages of
the candidate it picks, and re-ranks, before it reports (tune/search.py).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

from torch import nn

from pipec.costs import costs as costs_pass
from pipec.model.partition import Split, _unit_key, split_graph
from pipec.costs.profile import Profiling
from pipec.model.stages import resolve
from pipec.model.tensors import FrontendError
from pipec.costs.timings import profile_stages, stage_digest
from pipec.compiler.ir.graph import make_graph
from pipec.compiler.ir.plan import Cost

__all__ = ["Pieces", "grid_of", "cut_positions"]

_PARTS = ("fwd", "bwd", "bwd_i", "bwd_w", "optim")


def grid_of(tm: Any) -> tuple[int, ...]:
    """The grid of a traced model (:class:`~pipec.compiler.frontend.TracedModel`): the positions where a layer (a
    ModuleList's, Sequential's or ModuleDict's child) starts or ends and only tensors cross. The nodes between two
    layers (an embedding's, a head's) stay one piece unless a cut falls among them."""
    cuts, model = tm.cuts, tm.traced.model
    keys = [_unit_key(n, model) for n in cuts.nodes]
    return tuple(i for i in range(1, len(cuts.nodes)) if cuts.valid[i] and keys[i] != keys[i - 1]
                 and not (keys[i].startswith("node:") and keys[i - 1].startswith("node:")))


def cut_positions(tm: Any, graph: Any) -> tuple[int, ...]:
    """Where ``graph`` (a StageGraph cut from ``tm``) cuts: each stage's first node's position but stage 0's."""
    index = {n.name: i for i, n in enumerate(tm.cuts.nodes)}
    return tuple(min(index[n] for n in st.nodes if n in index) for st in graph.stages[1:])


def _stage_of(tm: Any, positions: Sequence[int]) -> dict[str, int]:
    bounds, s, out = set(positions), 0, {}
    for i, n in enumerate(tm.cuts.nodes):
        if i in bounds:
            s += 1
        out[n.name] = s
    return out


def _in_layers(split: Split, s: int) -> bool:
    """Whether stage ``s`` of ``split`` is a layer's nodes (a ModuleList's child), not the nodes around them."""
    nodes = {n.name: n for n in split.traced.gm.graph.nodes}
    return all(not _unit_key(nodes[name], split.traced.model).startswith("node:")
               for name in split.parts[s].nodes if name in nodes)


@dataclass(slots=True)
class _Trace:
    """One traced model's pieces: each piece (start, end) timed or read off one alike, and the profile record."""

    tm: Any
    grid: tuple[int, ...]
    costs: dict[tuple[int, int], Cost] = field(default_factory=dict)
    by_kind: dict[str, Cost] = field(default_factory=dict)
    record: dict[str, Any] | None = None
    split: Split | None = None
    """The model cut at every grid position."""
    params: list[dict[str, int]] | None = None
    """Per node, the parameters it holds (:meth:`Pieces._held`)."""
    weights: list[float] | None = None
    """Per node, what a piece off the grid is priced by (:meth:`Pieces._share`)."""


class Pieces:
    """Cut prices from timed pieces (the module docstring), for one model at any microbatch shape.

    ``calibration``: the model traced at the smallest microbatch shape priced (where the per-stage overhead is
    measured); traced when first needed. ``crowd``: the model traced at the shape whose crowd prices every shape
    (None: each shape its own); traced, its pieces timed and its crowd measured, before any other shape's."""

    def __init__(self, profile: Profiling, *, kwargs: Mapping[str, Any], calibration: Callable[[], Any],
                 crowd: Callable[[], Any] | None = None) -> None:
        # from one sample up: the stop rules (the median known to the stated spread, alone and in the crowd) still
        # hold, but a crowd's repeat takes one sample of a long piece where it took three (most of a search's crowd)
        self.profile, self.kwargs, self.calibration = replace(profile, reps=1), dict(kwargs), calibration
        self._traces: dict[int, _Trace] = {}
        self._overhead: tuple[float, ...] | None = None
        self._crowd = crowd
        self._crowd_tm: Any = None
        self.num_timed = 0
        """Pieces timed (or read from the profile cache): one of each kind per microbatch shape."""

    def _trace(self, tm: Any) -> _Trace:
        if id(tm) not in self._traces:
            self._traces[id(tm)] = _Trace(tm=tm, grid=grid_of(tm))
        return self._traces[id(tm)]

    def _crowd_from(self, tm: Any) -> Any:
        """The traced graph whose crowd prices ``tm``'s shape: the crowd's shape's, its pieces timed first (their
        crowd measured, or read from the cache); None where ``tm`` is that shape, or each shape has its own."""
        if self._crowd is None or self.profile.num_ranks <= 1:
            return None
        if self._crowd_tm is None:
            self._crowd_tm = self._crowd()
            tr = self._trace(self._crowd_tm)
            if tr.record is None:
                self._time(tr, self._pieces(tr, 0, len(tr.tm.cuts.nodes)))
        return None if tm is self._crowd_tm else self._crowd_tm.traced

    def _time(self, tr: _Trace, pieces: Sequence[tuple[int, int]]) -> None:
        """Time ``pieces`` of a trace (each from one grid position to another): the model cut at the grid, one
        piece of each kind not timed before."""
        tm = tr.tm
        crowd_from = self._crowd_from(tm)
        ends = list(tr.grid)
        if tr.split is None:
            tr.split = split_graph(tm.traced, _stage_of(tm, ends), len(ends) + 1)
        split = tr.split
        at = {(a, b): s for s, (a, b) in enumerate(zip([0, *ends], [*ends, len(tm.cuts.nodes)]))}
        kinds = {p: stage_digest(split, at[p]) for p in pieces}
        todo = list(dict.fromkeys(k for k in kinds.values() if k not in tr.by_kind))
        if todo:
            first = {k: at[p] for p, k in reversed(list(kinds.items()))}
            layers = [i for i, k in enumerate(todo) if _in_layers(split, first[k])]
            got, record = profile_stages(split, self.profile, autocast=tm.autocast, target=tm.src.target,
                                         kwargs=self.kwargs, search_path=tm.src.search_path,
                                         stages=[first[k] for k in todo], crowd_of=layers or None,
                                         crowd_from=crowd_from)
            self.num_timed += len(todo)
            tr.by_kind.update(zip(todo, got))
            if tr.record is None:
                tr.record = {k: v for k, v in record.items() if k != "stages"}
        for p, k in kinds.items():
            tr.costs[p] = tr.by_kind[k]

    def _pieces(self, tr: _Trace, a: int, b: int) -> list[tuple[int, int]]:
        inside = [g for g in tr.grid if a < g < b]
        return list(zip([a, *inside], [*inside, b]))

    def _enclosing(self, tr: _Trace, piece: tuple[int, int]) -> tuple[int, int]:
        """The grid's piece a piece lies in (itself where its ends are on the grid)."""
        a, b = piece
        return (max((g for g in (0, *tr.grid) if g <= a)),
                min((g for g in (*tr.grid, len(tr.tm.cuts.nodes)) if g >= b)))

    def _share(self, tr: _Trace, piece: tuple[int, int], whole: tuple[int, int]) -> float:
        """A piece's share of the grid piece it lies in: its nodes' forward times over the grid piece's (measured
        on a CPU copy, as ``balanced(by=time)`` weighs them; FLOPs where that copy cannot be made)."""
        if tr.weights is None:
            tm = tr.tm
            try:
                times = costs_pass.time_nodes(tm.traced, tm.src.target, self.kwargs, threads=self.profile.threads,
                                              search_path=tm.src.search_path)
                tr.weights = costs_pass.node_weights(tm.traced, tm.cuts, "time", times=times)
            except FrontendError:
                tr.weights = costs_pass.node_weights(tm.traced, tm.cuts, "flops")
        w = tr.weights
        total = sum(w[whole[0]:whole[1]])
        if total <= 0:
            return (piece[1] - piece[0]) / (whole[1] - whole[0])
        return sum(w[piece[0]:piece[1]]) / total

    def _held(self, tr: _Trace, piece: tuple[int, int]) -> dict[str, int]:
        """The parameters a piece's nodes hold (canonical name -> elements)."""
        if tr.params is None:
            traced = tr.tm.traced
            canon = {id(p): c for c, p in traced.param_of.items()}
            tr.params = []
            for n in tr.tm.cuts.nodes:
                found = list(traced.gm.get_submodule(str(n.target)).parameters()) if n.op == "call_module" else []
                found += [obj for a in n.all_input_nodes if a.op == "get_attr"
                          and isinstance(obj := resolve(traced.gm, str(a.target)), nn.Parameter)]
                tr.params.append({canon[id(p)]: p.numel() for p in found if id(p) in canon})
        out: dict[str, int] = {}
        for held in tr.params[piece[0]:piece[1]]:
            out.update(held)
        return out

    def _optim_shares(self, tr: _Trace, pieces: Sequence[tuple[int, int]]) -> list[float]:
        """Per piece of one stage, the share of its parameters' elements no earlier piece of the stage holds: a weight
        tied across pieces (an embedding and its head) is stepped once by the stage that holds both."""
        seen: set[str] = set()
        out = []
        for p in pieces:
            held = self._held(tr, p)
            total = sum(held.values())
            out.append(sum(v for k, v in held.items() if k not in seen) / total if total else 1.0)
            seen |= set(held)
        return out

    def _cost(self, tr: _Trace, piece: tuple[int, int], over: Sequence[float]) -> Cost:
        """A piece's cost: its own timing on the grid, else its share of the grid piece's (the share of what the
        grid piece took beyond one stage's overhead, plus an overhead of its own; the optimizer's by its parameters'
        elements, the rest by :meth:`_share`)."""
        whole = self._enclosing(tr, piece)
        timed = tr.costs[whole]
        if whole == piece:
            return timed
        f = self._share(tr, piece, whole)
        mine, all_ = sum(self._held(tr, piece).values()), sum(self._held(tr, whole).values())
        shares = [f] * (len(_PARTS) - 1) + [mine / all_ if all_ else f]   # the optimizer's: its parameters' share
        return replace(timed, **{k: o + x * (getattr(timed, k) - o) for k, o, x in zip(_PARTS, over, shares)})

    def overhead(self) -> tuple[float, ...]:
        """Per part (:data:`_PARTS`), what a piece timed alone pays that a stage of several pays once (seconds)."""
        if self._overhead is None:
            tr = self._trace(self.calibration())
            n = len(tr.tm.cuts.nodes)
            pieces = self._pieces(tr, 0, n)
            if any(p not in tr.costs for p in pieces):
                self._time(tr, [p for p in pieces if p not in tr.costs])
            whole = self._whole(tr)
            if len(pieces) < 2:
                self._overhead = (0.0,) * len(_PARTS)
            else:
                over = [(sum(getattr(tr.costs[p], k) for p in pieces) - getattr(whole, k)) / (len(pieces) - 1)
                        for k in _PARTS]
                # the optimizer's: the whole steps a tied weight once (:meth:`_optim_shares`), so solved with
                # the shares, as :meth:`price` sums the pieces
                f = self._optim_shares(tr, pieces)
                ties = len(pieces) - 1 - sum(1 - x for x in f)
                if ties > 0:
                    over[-1] = (sum(x * tr.costs[p].optim for x, p in zip(f, pieces)) - whole.optim) / ties
                self._overhead = tuple(over)
        return self._overhead

    def _whole(self, tr: _Trace) -> Cost:
        tm = tr.tm
        split = split_graph(tm.traced, _stage_of(tm, ()), 1)
        got, _ = profile_stages(split, self.profile, autocast=tm.autocast, target=tm.src.target, kwargs=self.kwargs,
                                search_path=tm.src.search_path, crowd_from=self._crowd_from(tm))
        self.num_timed += 1
        return got[0]

    def price(self, tm: Any, graph: Any) -> Any:
        """``graph`` (a StageGraph cut from ``tm``, its costs unit) with every stage's cost summed from its pieces
        and ``model["profile"]`` the pieces' record, ``summed`` added."""
        assert not graph.recompute, "price a cut without recompute (derive it after)"
        tr = self._trace(tm)
        n = len(tm.cuts.nodes)
        positions = cut_positions(tm, graph)
        per_stage = [self._pieces(tr, a, b) for a, b in zip([0, *positions], [*positions, n])]
        todo = list(dict.fromkeys(w for ps in per_stage for p in ps if (w := self._enclosing(tr, p)) not in tr.costs))
        if todo:
            self._time(tr, todo)
        over = self.overhead()
        stages = []
        for st, ps in zip(graph.stages, per_stage):
            got = [self._cost(tr, p, over) for p in ps]
            got = [replace(c, optim=over[-1] + f * (c.optim - over[-1])) if f < 1 else c
                   for c, f in zip(got, self._optim_shares(tr, ps))]
            parts = {k: max(0.0, sum(getattr(c, k) for c in got) - (len(got) - 1) * o) for k, o in zip(_PARTS, over)}
            weights = [c.fwd + c.bwd for c in got]
            spreads = [c.spread or 0.0 for c in got]
            spread = sum(w * x for w, x in zip(weights, spreads)) / sum(weights) if sum(weights) > 0 else \
                statistics.median(spreads)
            cost = Cost(**parts, spread=spread)
            if not any(e.dst_stage == st.stage for e in graph.edges):  # fed by model inputs only
                cost = costs_pass._no_input_grad(cost)
            stages.append(replace(st, cost=cost))
        record = dict(tr.record or {})
        record["summed"] = {"pieces": sum(len(ps) for ps in per_stage),
                            "overhead_s": dict(zip(_PARTS, (round(o, 9) for o in over)))}
        stages = tuple(stages)
        return replace(graph, stages=stages, graph=make_graph(stages, graph.edges, graph.ties),
                       model={**graph.model, "profile": record})
