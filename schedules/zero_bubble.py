"""Zero-bubble schedules: the backward split into input-grad ``I`` and weight-grad ``W``.

Source: Qi, Wan, Huang, Lin, "Zero Bubble Pipeline Parallelism" (ICLR 2024,
arXiv 2401.10241). ``I`` (their B) of stage s needs only ``I`` of s+1, so it
is on the critical path; ``W`` needs only its own ``I`` and can wait to fill
bubbles.

``zb_h1`` (their Section 3.1, ZB-H1, Figure 3 top): 1F1B's order of
forwards and input grads (torch 2.13's ``Schedule1F1B`` runtime loop: warm-up
``min(P - r, M)`` forwards on rank r, then backward first, with ``B`` read as
``I``), and each ``W`` delayed into the slots where the rank would otherwise
wait, while no rank holds more than ``min(P, M)`` microbatches in flight
(from ``F`` to its ``W``): 1F1B's peak, which 1F1B reaches on rank 0. This is
the paper's memory rule ("the first worker, which holds the most
activations, does not exceed the peak memory of 1F1B"; every stage then has
the same number of microbatches in flight). The W placement is a unit-cost
list schedule (F = I = W = 1), see
:func:`pipec.schedules.timing.place_weight_grads`. Under unit costs the step
is 3M + P - 1 against 1F1B's 3M + 3P - 3 (B = 2): the idle time per rank
falls from 3(P-1) to P-1, the paper's "one third of 1F1B's bubble" (their
(p-1)(T_F + T_B - T_W)).

A stricter bound, rank r holding at most 1F1B's own ``min(P - r, M)``,
cannot do better than 2(P-1) idle per rank: the last rank then runs F, I, W
of one microbatch after another (3M units from time P-1), and the last
microbatch's input grads still walk back P-1 ranks before rank 0's last
``W``. The policy schedules offer that variant (``weight_grad="bubbles"``
with the default per-rank bound).

``zbv`` (their Section 6, ZB-V): exactly 2 chunks per rank on the V
placement (rank r holds stages r and 2P-1-r); the order equals the compute
actions of torch 2.13's ``ScheduleZBVZeroBubble._calculate_single_rank_operations``
(torch/distributed/pipelining/schedules.py): it is built for
``max(2P - 1, M)`` microbatches and the ones >= M are dropped.

``interleaved_zb`` (ZB1P of the paper over v >= 2 chunks per rank on the loop
placement): the order of torch 2.13's ``ScheduleInterleavedZeroBubble``
(``_calculate_single_rank_operations``: ``_get_warmup_ops`` with factor 1 and
``_get_1f1b_rank_ops`` with ``enable_zero_bubble``). Forwards and input grads go
in interleaved 1F1B's depth-first rounds (torch's microbatch rule: M a multiple
of ``max(1, M // P)``), rank r runs ``min((v-1)*mpr + (P-1-r), v*M)`` warm-up
forwards (one per hop to the last rank, where interleaved 1F1B has two), then
(F, I) pairs while forwards remain, then the remaining I; each ``W`` trails its
``I`` by r input grads (it goes right after the I r places later; the last r at
the end), so the weight grads fill the slots where rank r would wait for the
input grads walking back from the last rank. torch's ``_add_bubbles_to_actions``
only inserts idle slots, so this is also the order it executes.
"""

from __future__ import annotations

from pipec.schedules.interleaved import depth_first, interleaved_warmup
from pipec.schedules.one_f_one_b import one_f_one_b_rank
from pipec.schedules.order import Action, ComputeOrder, Kind, gc_paused, loop_placement, v_placement
from pipec.schedules.timing import place_weight_grads

__all__ = ["zb_h1", "zbv", "interleaved_zb"]


def zb_h1(*, num_ranks: int, num_microbatches: int, num_chunks: int = 1) -> ComputeOrder:
    """The ZB-H1 order (see the module docstring; counts checked by its rules)."""
    P, M = num_ranks, num_microbatches
    placement = loop_placement(P, P)
    with gc_paused():
        base = [one_f_one_b_rank(Kind.I, r, min(P - r, M), M) for r in range(P)]
        ranks = place_weight_grads(base, placement=placement, num_microbatches=M, bounds=[min(P, M)] * P)
    return ComputeOrder(
        num_ranks=P, num_microbatches=M, placement=placement, ranks=tuple(map(tuple, ranks))
    )


def _zbv_rank(rank: int, num_ranks: int, num_microbatches: int) -> list:
    """One rank's ZB-V order, phase by phase as torch's ScheduleZBVZeroBubble."""
    F, I, W = Kind.F, Kind.I, Kind.W
    P, M = num_ranks, num_microbatches
    fill = max(2 * P - 1, M)
    down, up = rank, 2 * P - 1 - rank  # chunk 0 (going up the ranks), chunk 1 (coming down)
    out = []
    emit = out.append
    f0 = f1 = i0 = i1 = 0
    # warm-up: chunk-0 forwards, then chunk-1/chunk-0 pairs, then chunk-1 F-I-W.
    for _ in range(2 * (P - rank) - 1):
        emit((F, down, f0))
        f0 += 1
    for _ in range(rank):
        emit((F, up, f1))
        f1 += 1
        emit((F, down, f0))
        f0 += 1
    for _ in range(P - rank):
        emit((F, up, f1))
        emit((I, up, i1))
        emit((W, up, i1))
        f1 += 1
        i1 += 1
    # steady state: (F, I, W) on chunk 0 then on chunk 1, while forwards remain.
    while f1 < f0 or f0 < fill:
        if f0 < fill:
            emit((F, down, f0))
            f0 += 1
        emit((I, down, i0))
        emit((W, down, i0))
        i0 += 1
        emit((F, up, f1))
        emit((I, up, i1))
        emit((W, up, i1))
        f1 += 1
        i1 += 1
    # cool-down: paired input grads, then chunk-0 I-W, then the weight grads left.
    w0, w1 = i0, i1
    for _ in range(rank):
        emit((I, down, i0))
        emit((I, up, i1))
        i0 += 1
        i1 += 1
    for _ in range(P - rank):
        emit((I, down, i0))
        emit((W, down, w0))
        i0 += 1
        w0 += 1
    for m in range(w1, i1):
        emit((W, up, m))
    for m in range(w0, i0):
        emit((W, down, m))
    assert f0 == i0 == fill and f1 == i1 == fill, (rank, f0, i0, f1, i1, fill)
    return [Action(k, s, m) for k, s, m in out if m < M]


def zbv(*, num_ranks: int, num_microbatches: int, num_chunks: int = 2) -> ComputeOrder:
    """The ZB-V order (see the module docstring; counts checked by its rules)."""
    P, M = num_ranks, num_microbatches
    with gc_paused():
        ranks = tuple(tuple(_zbv_rank(r, P, M)) for r in range(P))
    return ComputeOrder(num_ranks=P, num_microbatches=M, placement=v_placement(P, 2 * P), ranks=ranks)


def interleaved_zb(*, num_ranks: int, num_microbatches: int, num_chunks: int = 2) -> ComputeOrder:
    """The interleaved zero-bubble (ZB1P) order (see the module docstring; counts checked by its rules)."""
    P, M, v = num_ranks, num_microbatches, num_chunks
    F, I, W = Kind.F, Kind.I, Kind.W
    total = v * M
    fwd_offset, bwd_offset, mb_of = depth_first(P, M, v)
    ranks = []
    with gc_paused():
        for r in range(P):
            warmup = interleaved_warmup(r, num_ranks=P, num_microbatches=M, num_chunks=v, per_hop=1)
            grads = [(bwd_offset[k] + r, mb_of[k]) for k in range(total)]
            out = [Action(F, fwd_offset[k] + r, mb_of[k]) for k in range(warmup)]
            append = out.append
            for k, (stage, mb) in enumerate(grads):
                if warmup + k < total:
                    append(Action(F, fwd_offset[warmup + k] + r, mb_of[warmup + k]))
                append(Action(I, stage, mb))
                if k >= r:
                    append(Action(W, *grads[k - r]))
            out += [Action(W, stage, mb) for stage, mb in grads[max(total - r, 0):]]
            ranks.append(tuple(out))
    return ComputeOrder(
        num_ranks=P, num_microbatches=M, placement=loop_placement(P, v * P), ranks=tuple(ranks)
    )
