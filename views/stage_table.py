"""``pipec show``'s cost and memory table: one row per stage, totals per rank.

Costs come from the plan's stages (seconds, or units for a plan whose costs
are units); memory is parameters, grads and optimizer state as the rank holds
them (:mod:`pipec.compiler.passes.memory`: 16 bytes per parameter copy for float32
AdamW, divided as the mesh's ``shard`` says) plus saved activations per
microbatch, with the predicted peak per rank from the simulator and, per
rank, its breakdown: params / grads / optimizer / unsharded / activations.
"""

from __future__ import annotations

import re
import textwrap

from rich.table import Table

from pipec.compiler.ir.plan import Plan
from pipec.compiler.ir.tensor_parallel import in_effect

__all__ = ["stage_table", "tp_lines"]


def _count(n: int) -> str:
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{suffix}"
    return str(n)


def stage_table(plan: Plan) -> Table | None:
    """The per-stage cost and memory table of a model plan (None for a schedule-only plan)."""
    if plan.model is None or not plan.stages:
        return None
    from pipec.compiler.passes.memory import breakdown, bytes_per_param, stage_state

    scale, tname = (1.0, "units") if plan.unit_costs else (1e3, "ms")
    mib = 2.0**20
    mesh = plan.mesh
    how = f"{sum(bytes_per_param(plan.spec))} B per parameter copy" + (
        f", shard {mesh.shard} over {mesh.num_shards} ranks" if mesh.sharded else "")
    t = Table(title=f"stages: cost per microbatch ({tname}; B = I + W), memory (MiB; state = {how}, "
                    "act = saved activations per microbatch)", title_justify="left", caption_justify="left")
    for col in ("stage", "rank", "params", "state", "act", "F", "B", "I", "W"):
        t.add_column(col, justify="right")
    peak = {r.rank: r for r in plan.prediction.per_rank} if plan.prediction else {}
    for rank in range(plan.mesh.pp):
        for st in (s for s in plan.stages if s.rank == rank):
            params = st.num_params or 0
            c = st.cost
            t.add_row(str(st.stage), str(rank), _count(params), f"{sum(stage_state(st, plan)) / mib:.1f}",
                      f"{(st.activation_bytes or 0) / mib:.1f}",
                      *(f"{x * scale:.3g}" for x in (c.fwd, c.bwd, c.bwd_i, c.bwd_w)))
        p = peak.get(rank)
        if p is not None and p.peak_memory_bytes is not None:
            t.add_row("peak", str(rank), "", f"{p.peak_memory_bytes / mib:.1f}", f"x{p.peak_activations}",
                      "", "", "", "", style="bold", end_section=True)
    rows = breakdown(plan) or ()
    for m in rows:
        p = peak.get(m.rank)
        act = "" if p is None or p.peak_memory_bytes is None else (
            f" + activations {(p.peak_memory_bytes - m.state - m.transient) / mib:.1f} = peak "
            f"{p.peak_memory_bytes / mib:.1f}")
        t.caption = (t.caption + "\n" if t.caption else "") + (
            f"rank {m.rank} (MiB): params {m.params / mib:.1f} + grads {m.grads / mib:.1f} + optimizer "
            f"{m.optimizer / mib:.1f} + unsharded {m.unsharded / mib:.1f} + buffers {m.buffers / mib:.1f}{act}")
    from pipec.compiler.passes.memory import checkpoint_memory, format_memory

    for c in checkpoint_memory(plan) or ():
        p = peak.get(c.rank)
        train = "" if p is None or p.peak_memory_bytes is None else (
            f"; training peak {format_memory(p.peak_memory_bytes)}")
        t.caption = (t.caption + "\n" if t.caption else "") + (
            f"rank {c.rank} checkpoint: save {format_memory(c.save_device)} on the device + staging copy "
            f"{format_memory(c.save_staging)} on the host; load {format_memory(c.load_device)}"
            + (f" (of each, {format_memory(c.tp_whole)} of tensor-parallel parameters and moments made whole on "
               "every tp rank)" if c.tp_whole else "") + train)
    for tie in plan.ties:
        t.caption = (t.caption + "; " if t.caption else "") + (
            f"tied weight {tie.name}: a copy on stages {', '.join(map(str, tie.stages))}, kept equal by an all-reduce")
    return t


def tp_lines(plan: Plan) -> list[str]:
    """What tensor parallelism does to each stage (``pipec show``): the modules by style (numbered layers folded
    into ``*`` with their count), the tp collectives per microbatch, whether the loss is computed on the logits'
    parts, and the share of the FLOPs on shards."""
    out = []
    for st in plan.stages:
        tp = in_effect(st.tp, plan.mesh.tp)
        if tp is None:
            continue
        by_style: dict[str, dict[str, int]] = {}
        for module, style in tp.modules:
            folded = re.sub(r"(?<=\.)\d+(?=\.|$)", "*", module)
            names = by_style.setdefault(style, {})
            names[folded] = names.get(folded, 0) + 1
        parts = [f"{style} " + ", ".join(n if k == 1 else f"{n} (x{k})" for n, k in names.items())
                 for style in ("colwise", "rowwise", "vocab", "replicated") if (names := by_style.get(style))]
        comm = []
        for phase in ("forward", "backward"):
            n = sum(c.phase == phase for c in tp.collectives)
            if n:
                comm.append(f"{n} in {phase} ({tp.collective_bytes(phase) / 1024:.1f} KiB)")
        line = (f"stage {st.stage} (tp {plan.mesh.tp}): {'; '.join(parts) or 'nothing to shard: replicated'}"
                + (f"; tp collectives per microbatch: {', '.join(comm)}" if comm else "")
                + ("; loss parallel (cross_entropy on the logits' vocabulary parts)" if tp.loss_parallel else "")
                + f"; {tp.sharded_flops:.0%} of its FLOPs on shards")
        out += textwrap.wrap(line, width=80, subsequent_indent="    ", break_on_hyphens=False)
    return out
