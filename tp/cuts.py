"""Where a pipeline cut would fall inside a tensor-parallel pair, so that the partition can keep it out.

Between a colwise module and its rowwise partner every rank holds only its part of the activation (its heads,
its MLP columns); a stage boundary there would send a shard to a stage whose analysis starts again from a
replicated input, and both halves of the pair would stay whole (:mod:`.analysis` replicates a candidate whose
shard reaches a stage output). :func:`inside_positions` runs the analysis once on the whole traced model, as
one stage, and returns the cut positions (:class:`~pipec.model.partition.Cuts`) that a sharded value crosses:
the balanced partition does not cut there, and a cut the user named there is refused
(:func:`~pipec.model.partition.assign_stages`).
"""

from __future__ import annotations

from typing import Any, Mapping

from torch.fx import Node

from pipec.model.partition import Cuts
from pipec.model.tensors import FrontendError
from pipec.model.trace import Traced
from pipec.tp.rules import Shard

__all__ = ["inside_positions"]


def _sharded(state: Any) -> bool:
    if isinstance(state, Shard):
        return not state.seq   # a sequence shard crosses a stage boundary as parts (sequence parallelism)
    return isinstance(state, (tuple, list)) and any(_sharded(s) for s in state)


def inside_positions(traced: Traced, cuts: Cuts, tp: int, patterns: Mapping[str, str] | None = None,
                     loss: str = "cross_entropy") -> dict[int, str]:
    """Cut position -> the sharded value crossing it, said (``node 'q' (blocks.3.attn.q_proj)``), for every
    position inside a tensor-parallel pair of the whole model at ``tp``. Empty at tp 1, and where the analysis
    refuses the whole model (the stages' own analysis says why)."""
    if tp < 2:
        return {}
    from pipec.tp.analysis import _styles_of, analyse

    gm = traced.gm
    try:
        styles = None
        if patterns is not None:
            from pipec.tp.rules import linear_like

            lins = {n: lin for n in gm.graph.nodes if (lin := linear_like(n, gm)) is not None}
            styles = _styles_of(gm, lins, patterns, "")[0]
        an, lins = analyse(gm, tp, styles, traced.canonical, loss_parallel=loss == "cross_entropy")
    except FrontendError:
        return {}
    index = {n: i for i, n in enumerate(cuts.nodes)}
    num = len(cuts.nodes)
    out: dict[int, str] = {}
    for n in cuts.nodes:
        if not _sharded(an.state.get(n)):
            continue
        d = index[n]
        last = max((num if u.op == "output" else index.get(u, -1) for u in n.users), default=-1)
        for pos in range(d + 1, min(last, num - 1) + 1):
            out.setdefault(pos, _said(n, lins, an))
    return out


def _said(n: Node, lins: Mapping[Node, Any], an: Any) -> str:
    """``node 'q' (blocks.3.attn.q_proj's shard)``: the crossing value and the colwise module it comes from."""
    state = an.state.get(n)
    shard = state if isinstance(state, Shard) else next(s for s in state if isinstance(s, Shard))
    paths = sorted(lin.path for m, lin in lins.items() if m.name in shard.sources)
    return f"node {n.name!r}" + (f" (a shard of {paths[0]}'s output)" if paths else "")
