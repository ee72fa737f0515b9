"""The stage graph drawn with graphviz.

:func:`render_graph` draws a StageGraph or a Plan: stages coloured by pp
rank, edges labelled with each tensor's shape and the bytes crossing, tie
groups as dashed red links. Without the ``dot`` program it writes the
``.dot`` source and says how to render it.
"""

from __future__ import annotations

import os
import shutil

import graphviz

from pipec.compiler.ir.graph import StageGraph, human_bytes
from pipec.compiler.ir.plan import Plan
from pipec.errors import PipecError

__all__ = ["graph_source", "render_graph", "RENDER_FORMATS"]

RENDER_FORMATS = ("svg", "png", "pdf")

_PALETTE = ("#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5",
            "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f")


def _count(n: int) -> str:
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{suffix}"
    return str(n)


def graph_source(source: StageGraph | Plan) -> graphviz.Digraph:
    """The graphviz drawing of a stage graph or a plan's stages."""
    stages, edges, ties = source.stages, source.edges, source.ties
    title = ""
    if isinstance(source, Plan) and source.model:
        title = str(source.model.get("target", ""))
    elif isinstance(source, StageGraph):
        title = str(source.model.get("target", ""))
    dot = graphviz.Digraph("stages", graph_attr={"rankdir": "LR", "label": title, "labelloc": "t", "fontname": "Helvetica"},
                           node_attr={"shape": "box", "style": "rounded,filled", "fontname": "Helvetica", "fontsize": "10"},
                           edge_attr={"fontname": "Helvetica", "fontsize": "9"})
    for st in stages:
        rank = f"rank {st.rank}" if st.rank >= 0 else "unplaced"
        lines = [f"stage {st.stage} · {rank}"]
        if st.num_params is not None:
            lines.append(f"{_count(st.num_params)} params")
        if st.activation_bytes is not None:
            lines.append(f"{human_bytes(st.activation_bytes)} saved / microbatch")
        c = st.cost
        lines.append(f"F {c.fwd:.3g}  I {c.bwd_i:.3g}  W {c.bwd_w:.3g}")
        color = _PALETTE[st.rank % len(_PALETTE)] if st.rank >= 0 else "#eeeeee"
        dot.node(f"s{st.stage}", "\n".join(lines), fillcolor=color)
    for e in edges:
        label = "\n".join(f"{t.name} {list(t.shape)} {t.dtype}" for t in e.tensors)
        label += f"\n{human_bytes(e.num_bytes)}"
        skip = e.dst_stage - e.src_stage > 1
        dot.edge(f"s{e.src_stage}", f"s{e.dst_stage}", label=label, style="bold" if skip else "solid",
                 color="#1f78b4" if skip else "black")
    for t in ties:
        for a, b in zip(t.stages, t.stages[1:]):
            dot.edge(f"s{a}", f"s{b}", label=f"tie {t.name}", style="dashed", color="red", fontcolor="red",
                     dir="none", constraint="false")
    return dot


def render_graph(source: StageGraph | Plan, path: str | os.PathLike[str]) -> str:
    """Draw ``source`` to ``path`` (``.svg``, ``.png``, ``.pdf``, or ``.dot`` for the source only).

    Returns a one-line message saying what was written. When graphviz's
    ``dot`` program is missing, writes the ``.dot`` source next to ``path``
    and the message says how to render it.
    """
    path = os.fspath(path)
    base, ext = os.path.splitext(path)
    fmt = ext.lstrip(".").lower()
    dot = graph_source(source)
    if fmt in ("dot", "gv"):
        with open(path, "w", encoding="utf-8") as f:
            f.write(dot.source)
        return f"wrote {path}"
    if fmt not in RENDER_FORMATS:
        raise PipecError(f"graph file must end in .svg, .png, .pdf or .dot, got {path!r}; e.g. --graph stages.svg")
    if shutil.which("dot") is None:
        src = base + ".dot"
        with open(src, "w", encoding="utf-8") as f:
            f.write(dot.source)
        return (
            f"graphviz's dot program is not installed, so {path} was not drawn; wrote {src} instead. "
            f"Render it with: dot -T{fmt} {src} -o {path}  (Debian/Ubuntu: apt-get install graphviz)"
        )
    with open(path, "wb") as f:
        f.write(dot.pipe(format=fmt))
    return f"wrote {path}"
