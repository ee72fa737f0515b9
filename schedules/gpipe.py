"""GPipe: every forward, then every backward (fill and drain).

Source: Huang et al., "GPipe: Efficient Training of Giant Neural Networks
using Pipeline Parallelism" (NeurIPS 2019), Section 2.2. The per-rank order
equals what torch 2.13's ``ScheduleGPipe._step_microbatches``
(torch/distributed/pipelining/schedules.py) executes: ``forward_one_chunk`` for
microbatches 0..M-1, then ``backward_one_chunk`` for 0..M-1. (Its
``pipeline_order`` draws the same actions with idle slots.)
"""

from __future__ import annotations

from pipec.schedules.order import Action, ComputeOrder, Kind, gc_paused, loop_placement

__all__ = ["gpipe"]


def gpipe(*, num_ranks: int, num_microbatches: int, num_chunks: int = 1) -> ComputeOrder:
    """Rank r: ``F r.0 .. F r.(M-1)``, then ``B r.0 .. B r.(M-1)`` (counts checked by its rules)."""
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
