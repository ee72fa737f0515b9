"""What ``pipec tune`` prints and writes: the table, the frontier, why the winner wins, its
schedule-file lines, and the JSON for tools (``docs/reference.md``, *pipec tune --json*).

torch-free; rich only when the table is drawn.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from pipec.compiler.ir.graph import human_bytes
from pipec.compiler.passes.memory import bytes_per_param
from pipec.tune.search import Scored, TuneResult
from pipec.tune.space import Candidate

__all__ = ["TUNE_FORMAT", "candidate_json", "result_json", "pipe_lines", "why", "table", "frontier_table"]

TUNE_FORMAT = "pipec.tune/1"


def _seconds(t: float) -> str:
    return f"{t * 1e3:.2f} ms" if t < 1 else f"{t:.3f} s"


def candidate_json(s: Scored) -> dict[str, Any]:
    """One candidate: its keys as the schedule file writes them, and its prediction."""
    c = s.candidate
    out: dict[str, Any] = {
        "pp": c.pp, "dp": c.dp, "tp": c.tp, "shard": c.shard, "shard_size": c.shard_size, "schedule": c.schedule,
        "virtual": c.num_chunks, "microbatches": c.num_microbatches,
        "partition": {"method": "balanced", "by": c.partition_by} if c.partition_by else None,
        "recompute": sorted(c.recompute), "step_time": s.step_time, "tokens_per_s": s.tokens_per_s, "mfu": s.mfu,
        "scaling_efficiency": s.scaling_efficiency, "bubble": s.bubble, "peak_memory_bytes": s.peak_memory,
    }
    if s.measured_step is not None:
        out["measured_step_time"] = s.measured_step
    if s.summed_step is not None:
        out["summed_step_time"] = s.summed_step
    return out


def result_json(r: TuneResult, *, plan_path: str | None = None, pipe: str | None = None,
                notes: Sequence[str] = ()) -> dict[str, Any]:
    """``pipec tune --json``: every field is documented in docs/reference.md."""
    return {
        "format": TUNE_FORMAT,
        "devices": r.num_devices,
        "global_batch": r.global_batch,
        "device_memory": r.device_memory,
        "peak_flops": r.peak_flops,
        "search": {"candidates": r.num_candidates, "compiled": r.num_compiled, "pruned": r.num_pruned,
                   "over_budget": r.num_over_budget, "unbuildable": r.num_unbuildable, "traces": r.num_traces,
                   "cuts": r.num_cuts, "pieces": r.num_pieces, "timed": r.num_timed, "level": r.level,
                   "seconds": r.seconds},
        "best": candidate_json(r.best),
        "top": [candidate_json(s) for s in r.top],
        "frontier": [candidate_json(s) for s in r.frontier],
        "start": candidate_json(r.start_scored) if r.start_scored else None,
        "best_tp1": candidate_json(r.best_tp1) if r.best_tp1 else None,
        "why": why(r),
        "pipe": pipe_lines(r.best.candidate, r.best.plan),
        "plan": plan_path,
        "notes": list(notes),
    }


def pipe_lines(c: Candidate, plan) -> list[str]:
    """The schedule-file lines of the keys tune set (the rest of the file stays as written); ``plan``:
    the candidate's."""
    shard = "" if c.shard == "none" else f"  shard {c.shard}" + (f"  shard_size {c.shard_size}" if c.shard_size else "")
    rec = "none" if not c.recompute else "stages " + ", ".join(map(str, sorted(c.recompute)))
    tp = f"  tp {c.tp}" if c.tp > 1 else ""
    lines = [f"pp {c.pp}  dp {c.dp}{tp}{shard}",
             f"schedule {c.schedule}  virtual {c.num_chunks}  microbatches {c.num_microbatches}"]
    if c.partition_by:
        lines.append(f"partition balanced(by={c.partition_by})")
    lines.append(f"recompute {rec}")
    if plan.mesh.devices_per_node:  # --devices-per-node's, in place of the file's
        lines.append(f"devices_per_node {plan.mesh.devices_per_node}")
    for key in ("input", "targets"):
        tensors = plan.spec.get(key) or ()
        if tensors:
            lines.append(f"{key} " + ", ".join(f"{t['name']}: {t['dtype']}[{', '.join(map(str, t['shape']))}]"
                                               for t in tensors))
    return lines


def _state_bytes(plan) -> tuple[int, int]:
    """(parameters, bytes of params + grads + optimizer state) of the whole model, unsharded."""
    num = sum(st.num_params or 0 for st in plan.stages)
    return num, num * sum(bytes_per_param(plan.spec))


def _best(r: TuneResult, pred: Callable[[Candidate], bool]) -> Scored | None:
    return next((s for s in sorted(r.top + r.frontier, key=Scored.rank_key) if pred(s.candidate)), None)


def why(r: TuneResult) -> list[str]:
    """Why the winner wins, in the source note's terms: does the state fit one device, what forced
    sharding, pipeline stages and recompute, what data parallelism buys."""
    b = r.best
    c = b.candidate
    num, state = _state_bytes(b.plan)
    out = []
    budget = r.device_memory
    if budget is not None:
        fits_one = state <= budget
        out.append(f"the {human_bytes(state)} of parameters, gradients and optimizer state ({num:,} parameters) "
                   + (f"fits one {human_bytes(budget)} device unsharded" if fits_one else
                      f"does not fit one {human_bytes(budget)} device unsharded: it must be split over pipeline "
                      "stages or sharded across replicas"))
    if c.tp > 1:
        out.append(_tp_reason(r))
    for axis, pred, what in (
            ("pipeline stages", lambda x: x.pp == 1, f"pp {c.pp}"),
            ("sharding", lambda x: x.shard == "none", f"shard {c.shard}"),
            ("recompute", lambda x: not x.recompute, f"recompute {c.recompute_text}")):
        if pred(c):
            continue
        alt = _best(r, pred)
        over = [mem for mem, x in r.refused if pred(x)]
        if alt is None and over:
            out.append(f"{what}: {len(over)} candidates without {axis} are over {human_bytes(budget)}"
                       + (" even with recompute" if axis != "recompute" else "") + "; the rest are slower than the table")
        elif alt is None:
            out.append(f"{what}: every candidate without {axis} is slower than the table")
        else:
            out.append(f"{what}: {alt.step_time / b.step_time:.2f}x faster than the best without {axis} "
                       f"({alt.candidate.layout}, {alt.candidate.schedule}, {_seconds(alt.step_time)})")
    if c.recompute:
        out.append(f"recompute {c.recompute_text} is the least recompute that brings this layout under "
                   f"{human_bytes(budget)}")
    if c.dp > 1:
        out.append(f"dp {c.dp}: once the model fits, replicas scale the throughput (the cheapest axis)")
    out.extend(_microbatch_reasons(r))
    if b.scaling_efficiency is not None:
        same = b.mfu is not None and abs(b.mfu - b.scaling_efficiency) < 1e-6
        out.append(f"scaling efficiency {b.scaling_efficiency:.1%}: its throughput over {r.num_devices} x one "
                   "device's (the whole model on one rank, predicted from the same costs)"
                   + ("; MFU the same (costs from FLOPs: one device runs at peak)" if same else
                      f"; MFU {b.mfu:.1%}" if b.mfu is not None else ""))
    if r.start_scored is not None and r.start_scored.candidate != c:
        s = r.start_scored
        out.append(f"the file's own layout ({s.candidate.layout}, {s.candidate.schedule}, M {s.candidate.num_microbatches}) "
                   f"predicts {_seconds(s.step_time)}: the winner is {s.step_time / b.step_time:.2f}x faster")
    return out


def _tp_reason(r: TuneResult) -> str:
    """Why tensor parallelism: the winner against the best plan without it (:attr:`TuneResult.best_tp1`)."""
    b, c = r.best, r.best.candidate
    stp = next((st.tp for st in b.plan.stages if st.tp is not None), None)
    share = f"each tp rank computes {stp.compute_share(c.tp):.1%} of its stage" if stp is not None else ""
    links = b.plan.links
    where = "the tp link" if "tp" in links else ("NVLink-class intra-node links" if "intra" in links
                                                  else "the dp link")
    head = (f"tp {c.tp} inside each node: {share}, its activations' all-reduces (2 per block each way) on {where}, "
            f"and it divides the sharded parameters' state by {c.tp}")
    alt = r.best_tp1
    if alt is None:
        return head + "; no candidate without tensor parallelism fits"
    a = alt.candidate
    return (head + f"; {alt.step_time / b.step_time:.2f}x faster than the best plan without it ({a.layout}, "
            f"{a.schedule}, M {a.num_microbatches}, recompute {a.recompute_text}: {_seconds(alt.step_time)}, "
            f"bubble {alt.bubble:.1%}" + (f", MFU {alt.mfu:.1%}" if alt.mfu is not None else "") + ")")


def _microbatch_reasons(r: TuneResult) -> list[str]:
    """Why these microbatches and chunks: the bubble they leave against what each microbatch costs, beside
    the same layout and schedule at the nearest other counts the search kept (the table and the frontier)."""
    b, c = r.best, r.best.candidate
    per_rank = b.plan.prediction.per_rank if b.plan.prediction else ()
    compute = sum(x.compute for x in per_rank) / len(per_rank) if per_rank else 0.0
    head = (f"{c.schedule} with {c.num_microbatches} microbatches" + (f" x {c.num_chunks} chunks" if c.num_chunks > 1
            else "") + f": predicted bubble {b.bubble:.1%} ({_short_seconds(b.step_time * b.bubble)} of "
            f"{_short_seconds(b.step_time)}), {_short_seconds(compute / c.num_microbatches)} of compute per "
            "microbatch per rank")
    out = [head]
    kept = {s.candidate: s for s in (*r.top, *r.frontier)}.values()
    for what, field, why in (
            ("microbatches", "num_microbatches", "fewer microbatches leave more of the step idle (the bubble); more "
             "pay each microbatch's fixed cost (its messages, host time) for less compute each"),
            ("chunks", "num_chunks", "more chunks fill the pipeline sooner but send each microbatch over more "
             "hops")):
        same = [s for s in kept if s.candidate != c and _but(s.candidate, field) == _but(c, field)]
        near = [min(sides, key=lambda s: abs(getattr(s.candidate, field) - getattr(c, field))) for sides in (
            [s for s in same if getattr(s.candidate, field) < getattr(c, field)],
            [s for s in same if getattr(s.candidate, field) > getattr(c, field)]) if sides]
        if not near and field == "num_chunks":
            continue
        name = "M" if field == "num_microbatches" else "v"
        shown = "; ".join(_beside(name, getattr(s.candidate, field), s, b) for s in near) if near else (
            f"no other {what} of {c.layout} {c.schedule} made the table")
        out.append(f"{name} {getattr(c, field)}: {shown}; {why}")
    return out


def _beside(name: str, value: int, s: Scored, best: Scored) -> str:
    """``M 4 is slower: 27.3 us (bubble 61.2%)``; a tie (the winner holds less) names both peaks."""
    if f"{s.step_time:.9g}" != f"{best.step_time:.9g}":
        return f"{name} {value} is slower: {_short_seconds(s.step_time)} (bubble {s.bubble:.1%})"
    return (f"{name} {value} ties at {_short_seconds(s.step_time)} (bubble {s.bubble:.1%}) but holds "
            f"{_short_bytes(s.peak_memory)} at its peak, against {_short_bytes(best.peak_memory)}")


def _but(c: Candidate, field: str) -> tuple:
    """What identifies a candidate but ``field`` (microbatches or chunks)."""
    return tuple(v for k, v in (("layout", c.layout), ("schedule", c.schedule), ("num_chunks", c.num_chunks),
                                ("num_microbatches", c.num_microbatches), ("partition", c.partition_by),
                                ("recompute", c.recompute_text)) if k != field)


def _short_seconds(t: float) -> str:
    """Three significant digits: ``23.4 us``, ``120 ms``, ``1.23 s``."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if t >= scale or unit == "us":
            return f"{t / scale:.3g} {unit}"
    raise AssertionError(t)


def _short_bytes(n: int | None) -> str:
    """``617 KiB``, ``1.2 MiB``: three significant digits at most."""
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


_COLUMNS = ("layout", "schedule", "v", "M", "partition", "recompute", "step", "MFU", "tokens/s", "bubble", "peak")
_LEFT = frozenset(("layout", "schedule", "partition", "recompute"))
_HEADS = {"partition": "part", "recompute": "recomp"}
"""Headers shorter than their key, to keep the table within 80 columns."""
_ELIDED = ("partition", "recompute")
"""Columns said once above the table when every row has the same value."""


def _cells(s: Scored) -> dict[str, str]:
    c = s.candidate
    return {"layout": c.layout, "schedule": c.schedule, "v": str(c.num_chunks), "M": str(c.num_microbatches),
            "partition": c.partition_by or "file", "recompute": c.recompute_text,
            "step": _short_seconds(s.step_time), "MFU": f"{s.mfu:.1%}" if s.mfu is not None else "-",
            "tokens/s": f"{s.tokens_per_s:,.0f}" if s.tokens_per_s else "-", "bubble": f"{s.bubble:.1%}",
            "peak": _short_bytes(s.peak_memory)}


def table(rows: Sequence[Scored], title: str, measured: bool = False):
    """A rich table of candidates (``measured``: a measured-step column beside the predicted), within 80
    columns: step, tokens/s and MFU say one thing for one model and global batch, so tokens/s is left out
    where MFU is known; a partition or recompute every row shares is said once in the title."""
    from rich import box
    from rich.table import Table

    cells = [_cells(s) for s in rows]
    columns = [h for h in _COLUMNS if not (h == "tokens/s" and cells and all(c["MFU"] != "-" for c in cells))]
    same = [h for h in _ELIDED if cells and len({c[h] for c in cells}) == 1]
    columns = [h for h in columns if h not in same]
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, padding=0,
              caption=("every row: " + ", ".join(f"{h} {cells[0][h]}" for h in same)) if same else None,
              caption_justify="left")
    for h in columns + (["measured"] if measured else []):
        t.add_column(_HEADS.get(h, h), justify="left" if h in _LEFT else "right", no_wrap=True)
    for s, c in zip(rows, cells):
        t.add_row(*(c[h] for h in columns),
                  *([_short_seconds(s.measured_step) if s.measured_step else "skipped"] if measured else []))
    return t


def frontier_table(r: TuneResult):
    return table(r.frontier, "time-memory frontier (no candidate is both faster and smaller)")
