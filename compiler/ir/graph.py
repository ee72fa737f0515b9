"""The stage graph (networkx): what the model front end hands the rest of the compiler.

A :class:`StageGraph` holds the plan's ``model``, ``stages``, ``edges`` and
``ties``, plus a networkx ``DiGraph`` over stage ids for views and checks. A
skip connection is a direct edge between non-adjacent stages; a tie group
(one weight held by several stages) is kept on the graph as
``graph.graph["ties"]``. Drawing it is :mod:`pipec.views.graph`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import networkx as nx

from pipec.compiler.ir.plan import Edge, Stage, Tie

__all__ = ["StageGraph", "make_graph", "human_bytes"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StageGraph:
    """The partitioned model: what plan.json's ``model``, ``stages``, ``edges`` and ``ties`` hold."""

    model: Mapping[str, Any]
    """plan.json ``model``: target, kwargs, trace, fingerprint (+ fingerprint_parts, inputs, traced_on)."""
    stages: tuple[Stage, ...]
    """Ranks are -1 until :meth:`place` sets them."""
    edges: tuple[Edge, ...]
    ties: tuple[Tie, ...]
    graph: nx.DiGraph = field(compare=False, repr=False)
    recompute: frozenset[int] = frozenset()
    full_activation_bytes: tuple[int, ...] = ()
    """Per stage, saved bytes per microbatch without recompute."""
    flops: tuple[tuple[int, int, int], ...] = ()
    """Per stage, forward / input-backward / weight-backward FLOPs per microbatch."""
    notes: tuple[str, ...] = ()
    """Decisions worth telling the user (why auto tracing fell back to export...)."""
    warnings: tuple[str, ...] = ()
    """What the user should act on: what ``tensor_parallel auto`` left replicated, and why."""
    cut_notes: tuple[str, ...] = ()
    """How the partition placed its cuts where that is not what balance alone gives (a cut kept out of a
    tensor-parallel pair)."""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def place(self, placement: Sequence[int]) -> "StageGraph":
        """The same graph with ``stages[s].rank = placement[s]``."""
        if len(placement) != self.num_stages:
            raise ValueError(f"placement needs one pp rank per stage ({self.num_stages}), got {len(placement)}")
        stages = tuple(dataclasses.replace(st, rank=int(r)) for st, r in zip(self.stages, placement))
        return dataclasses.replace(self, stages=stages, graph=make_graph(stages, self.edges, self.ties))


def make_graph(stages: Sequence[Stage], edges: Sequence[Edge], ties: Sequence[Tie]) -> nx.DiGraph:
    """networkx view: a node per stage (attribute ``stage``: the Stage), an edge per Edge
    (``tensors``, ``bytes``, ``skip``); ``graph["ties"]`` lists the Ties."""
    g = nx.DiGraph(ties=tuple(ties))
    for st in stages:
        g.add_node(st.stage, stage=st, rank=st.rank)
    for e in edges:
        g.add_edge(e.src_stage, e.dst_stage, tensors=e.tensors, bytes=e.num_bytes, skip=e.dst_stage - e.src_stage > 1)
    assert nx.is_directed_acyclic_graph(g), "stage edges must run forward"
    return g


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


