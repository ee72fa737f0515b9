"""1F1B: a warm-up of forwards, then one backward and one forward in turn.

Source: Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN
Training" (SOSP 2019), the 1F1B steady state, in the flushed form of
Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM" (SC 2021), Section 2.2.1 (PipeDream-Flush). The
per-rank order equals what torch 2.13's ``Schedule1F1B._step_microbatches``
(torch/distributed/pipelining/schedules.py) executes: ``min(M, P - r)``
warm-up forwards on rank r, then "1B1F" (a backward, then a forward while
forwards remain), then the remaining backwards. (Its ``pipeline_order`` is
wrong on the last rank, see notes/torch-pipelining.md §0.3; the runtime loop
is the reference.) torch refuses M < P; here M < P is the same loop with
the warm-up capped at M, and its rules (pipec.schedules) warn about it.
"""

from __future__ import annotations

from pipec.schedules.order import Action, ComputeOrder, Kind, gc_paused, loop_placement

__all__ = ["one_f_one_b", "one_f_one_b_rank"]


def one_f_one_b_rank(kind_b: Kind, stage: int, num_warmup: int, num_microbatches: int) -> list[Action]:
    """One rank's 1F1B order on ``stage``: ``num_warmup`` forwards, then
    backward-first alternation, then the remaining backwards; backwards are of
    ``kind_b`` (``B``, or ``I`` for a split backward)."""
    F = Kind.F
    out = [Action(F, stage, m) for m in range(num_warmup)]
    append = out.append
    for b in range(num_microbatches - num_warmup):
        append(Action(kind_b, stage, b))
        append(Action(F, stage, num_warmup + b))
    out += [Action(kind_b, stage, b) for b in range(num_microbatches - num_warmup, num_microbatches)]
    return out


def one_f_one_b(*, num_ranks: int, num_microbatches: int, num_chunks: int = 1) -> ComputeOrder:
    """Rank r: ``F`` x min(M, P-r), then ``B, F`` pairs, then the remaining ``B`` (counts checked by its
    rules, :mod:`pipec.schedules.rules`)."""
    M = num_microbatches
    with gc_paused():
        ranks = tuple(
            tuple(one_f_one_b_rank(Kind.B, r, min(M, num_ranks - r), M)) for r in range(num_ranks)
        )
    return ComputeOrder(
        num_ranks=num_ranks,
        num_microbatches=M,
        placement=loop_placement(num_ranks, num_ranks),
        ranks=ranks,
    )
