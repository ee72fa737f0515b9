"""GPipe: every forward, then every backward (fill and drain).

Source: Huang et al., "GPipe: Efficient Training of Giant Neural Networks
using Pipeline Parallelism" (NeurIPS 2019), Section 2.2. The per-rank order
equals what torch 2.13's ``ScheduleGPipe._step_microbatches``
(torch/distributed/pipelining/schedules.py) executes: ``forward_one_chunk`` for
microbatches 0..M-1, then ``backward_one_chunk`` for 0..M-1. (Its
``pipeline_order`` draws the same actions with idle slots.)
"""

from __future__ import annotations

from pipec.schedules.order import (
    Action,
    ComputeOrder,
    Kind,
    ScheduleError,
    ScheduleWarning,
    check_counts,
    gc_paused,
    loop_placement,
)

__all__ = ["gpipe", "check_gpipe"]


def check_gpipe(*, num_ranks: int, num_microbatches: int, num_chunks: int = 1) -> list[ScheduleWarning]:
    """GPipe's rules: one chunk per rank, any M >= 1 (torch allows M < P).

    Returns warnings for legal but wasteful settings.
    """
    check_counts("gpipe", num_ranks=num_ranks, num_microbatches=num_microbatches, num_chunks=num_chunks)
    if num_chunks != 1:
        raise ScheduleError(
            "gpipe runs exactly 1 chunk per rank (looped_bfs is its order over several chunks)",
            got=(("virtual", num_chunks),), fix=((("virtual", 1),), (("schedule", "looped_bfs"),)),
            rule="gpipe.chunks", key="virtual",
        )
    warnings = []
    if num_microbatches < num_ranks:
        warnings.append(ScheduleWarning(
            "warning", f"gpipe with fewer microbatches ({num_microbatches}) than ranks ({num_ranks}): "
            f"every rank idles at least {num_ranks - 1} of {num_microbatches + num_ranks - 1} slots",
            key="microbatches", fix=((("microbatches", f">= {num_ranks}"),),), rule="gpipe.microbatches",
        ))
    return warnings


def gpipe(*, num_ranks: int, num_microbatches: int, num_chunks: int = 1) -> ComputeOrder:
    """Rank r: ``F r.0 .. F r.(M-1)``, then ``B r.0 .. B r.(M-1)`` (counts checked by :func:`check_gpipe`)."""
    mbs = range(num_microbatches)
    F, B = Kind.F, Kind.B
    with gc_paused():
        ranks = tuple(
            tuple([Action(F, r, m) for m in mbs] + [Action(B, r, m) for m in mbs])
            for r in range(num_ranks)
        )
    return ComputeOrder(
        num_ranks=num_ranks,
        num_microbatches=num_microbatches,
        placement=loop_placement(num_ranks, num_ranks),
        ranks=ranks,
    )
