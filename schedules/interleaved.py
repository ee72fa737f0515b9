"""Multi-chunk schedules on the loop placement: interleaved 1F1B and looped BFS.

Rank r holds chunks c = 0..v-1, chunk c being stage ``c*P + r``.

``interleaved_1f1b``: Narayanan et al., "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM" (SC 2021), Section 2.2.2, in the
form of torch 2.13's ``ScheduleInterleaved1F1B`` (``_calculate_single_rank_operations``
with ``_get_warmup_ops`` and ``_get_1f1b_rank_ops``,
torch/distributed/pipelining/schedules.py), which relaxes the paper's
``M % P == 0`` to rounds: ``rounds = max(1, M // P)`` rounds of
``mpr = M // rounds`` microbatches, legal when ``M % rounds == 0``. Forwards
go round by round, within a round chunk by chunk (depth first); backwards
likewise with the chunks reversed. Rank r runs
``min((v-1)*mpr + 2*(P-1-r), v*M)`` warm-up forwards, then (forward, backward)
pairs, then the remaining backwards. The order equals the compute actions
of torch's ``pipeline_order`` in order (the runtime drops its idle slots).

``looped_bfs``: Lamy-Poirier, "Breadth-First Pipeline Parallelism" (MLSys
2023), in the form of torch 2.13's ``ScheduleLoopedBFS._calculate_single_rank_operations``:
all forwards of chunk 0, then of chunk 1, ...; then the backwards of the
last chunk down to chunk 0, each in reverse microbatch order.
"""

from __future__ import annotations

from pipec.schedules.order import Action, ComputeOrder, Kind, gc_paused, loop_placement

__all__ = ["interleaved_1f1b", "interleaved_rounds", "num_rounds", "interleaved_warmup", "depth_first", "looped_bfs"]


def interleaved_rounds(num_ranks: int, num_microbatches: int) -> tuple[int, int]:
    """``(rounds, microbatches per round)`` as torch's ``ScheduleInterleaved1F1B.__init__``."""
    rounds = max(1, num_microbatches // num_ranks)
    return rounds, num_microbatches // rounds


def num_rounds(num_ranks: int, num_microbatches: int) -> int:
    """``max(1, M // P)``: what torch needs the microbatch count to be a multiple of (interleaved's rule)."""
    return interleaved_rounds(num_ranks, num_microbatches)[0]


def interleaved_warmup(rank: int, *, num_ranks: int, num_microbatches: int, num_chunks: int, per_hop: int = 2) -> int:
    """Warm-up forwards on ``rank``: torch's ``_get_warmup_ops``,
    ``min((v-1)*mpr + per_hop*(P-1-rank), v*M)``; ``per_hop`` is 2 for interleaved 1F1B
    (its ``multiply_factor``), 1 for interleaved zero bubble."""
    _, per_round = interleaved_rounds(num_ranks, num_microbatches)
    return min((num_chunks - 1) * per_round + per_hop * (num_ranks - 1 - rank), num_chunks * num_microbatches)


def depth_first(num_ranks: int, num_microbatches: int, num_chunks: int) -> tuple[list[int], list[int], list[int]]:
    """A rank's k-th forward and k-th backward, k in 0..v*M-1, in torch's depth-first rounds:
    ``(forward stage offset, backward stage offset, microbatch)`` per k, the stage being offset + rank.

    The k-th forward (or backward) is in round k // (mpr*v), on chunk (k // mpr) % v
    (reversed for backwards), microbatch round*mpr + k % mpr (M a multiple of the rounds)."""
    P, v = num_ranks, num_chunks
    _, mpr = interleaved_rounds(P, num_microbatches)
    total = v * num_microbatches
    fwd_offset = [((k // mpr) % v) * P for k in range(total)]
    bwd_offset = [(v - 1) * P - o for o in fwd_offset]
    return fwd_offset, bwd_offset, [(k // (mpr * v)) * mpr + k % mpr for k in range(total)]


def interleaved_1f1b(*, num_ranks: int, num_microbatches: int, num_chunks: int = 2) -> ComputeOrder:
    """The interleaved 1F1B order (see the module docstring; counts checked by its rules)."""
    P, M, v = num_ranks, num_microbatches, num_chunks
    F, B = Kind.F, Kind.B
    total = v * M
    fwd_offset, bwd_offset, mb_of = depth_first(P, M, v)
    ranks = []
    with gc_paused():
        for r in range(P):
            warmup = interleaved_warmup(r, num_ranks=P, num_microbatches=M, num_chunks=v)
            out = [Action(F, fwd_offset[k] + r, mb_of[k]) for k in range(warmup)]
            append = out.append
            for k in range(total - warmup):
                f = warmup + k
                append(Action(F, fwd_offset[f] + r, mb_of[f]))
                append(Action(B, bwd_offset[k] + r, mb_of[k]))
            out += [Action(B, bwd_offset[k] + r, mb_of[k]) for k in range(total - warmup, total)]
            ranks.append(tuple(out))
    return ComputeOrder(
        num_ranks=P, num_microbatches=M, placement=loop_placement(P, v * P), ranks=tuple(ranks)
    )


def looped_bfs(*, num_ranks: int, num_microbatches: int, num_chunks: int = 2) -> ComputeOrder:
    """The looped BFS order (see the module docstring; counts checked by its rules)."""
    P, M, v = num_ranks, num_microbatches, num_chunks
    F, B = Kind.F, Kind.B
    ranks = []
    with gc_paused():
        for r in range(P):
            stages = range(r, v * P, P)
            out = [Action(F, s, m) for s in stages for m in range(M)]
            out += [Action(B, s, m) for s in reversed(stages) for m in reversed(range(M))]
            ranks.append(tuple(out))
    return ComputeOrder(
        num_ranks=P, num_microbatches=M, placement=loop_placement(P, v * P), ranks=tuple(ranks)
    )
