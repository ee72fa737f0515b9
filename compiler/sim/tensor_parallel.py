"""What tensor parallelism does to a stage's costs: its compute at its tp share, plus its tp collectives.

A stage whose :attr:`~pipec.compiler.ir.plan.Stage.tp` is set (a :class:`~pipec.compiler.ir.tensor_parallel.
StageTP`, in a plan of ``mesh.tp`` >= 2: :func:`~pipec.compiler.ir.tensor_parallel.in_effect`) runs, on each of
its tp ranks, ``compute_share(tp)`` of its unsharded compute (forward,
input-backward, weight-backward: the FLOP-derived times of the whole stage; under ``costs profile`` the sharded
stage is timed as one tp rank runs it, ``costs_local``, and its cost is taken as it is) and, per microbatch,
its tp collectives: the forward ones inside ``F``, the backward ones inside the input half (``I``, or ``B``
unsplit). A recomputed stage runs its forward collectives again before its backward, in the half its
recomputed forward sits in (:func:`~pipec.costs.costs.with_recompute`). Its optimizer step walks
the parameters a tp rank holds (:func:`~pipec.compiler.passes.memory.local_params`), so it scales by their
share. :func:`tp_cost` is the one place these terms are added; :func:`~pipec.compiler.sim.simulate.plan_costs`
calls it for every stage of a plan in seconds (unit costs are units: a stage's tp changes none of them).

Each collective is a ring over the stage's tp group (:meth:`~pipec.compiler.sim.simulate.Pricing.tp_ring`):
``latency + f (n - 1) / n x bytes / bandwidth`` with f = 2 for an all-reduce and 1 for an all-gather or a
reduce-scatter (sequence parallelism), on the ``tp`` link when the plan has one; otherwise priced as the dp
collectives are, on the ``dp`` link, or by node with ``devices_per_node`` and ``intra`` / ``inter`` links
(one node: ``intra``; spanning nodes: the hierarchical ring).

torch-free.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from pipec.compiler.ir.tensor_parallel import Collective, StageTP
from pipec.schedules.timing import Cost

__all__ = ["RING_FACTOR", "tp_cost", "phase_collectives"]

RING_FACTOR = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0}
"""Bytes each rank moves, in multiples of ``(n - 1) / n x bytes``, per collective kind."""


def tp_cost(cost: Cost, stp: StageTP, tp: int, *, forward_s: float, backward_s: float, recomputed: bool = False,
            state_share: float = 1.0) -> Cost:
    """A stage's cost on one of its ``tp`` ranks: every compute part at ``stp.compute_share(tp)``, the forward
    collectives' ``forward_s`` added to ``F`` (and, when ``recomputed``, to the half of the backward that holds
    the recomputed forward), the backward collectives' ``backward_s`` to the input half (``I``; ``W`` when the
    stage has no input half, a stage fed only by model inputs), the optimizer step at ``state_share`` (the
    share of the stage's parameters a tp rank holds). A cost ``costs profile`` timed on the sharded stage
    (:attr:`~pipec.compiler.ir.tensor_parallel.StageTP.costs_local`) is one rank's already: only the collectives
    are added."""
    if stp.costs_local:  # timed as one tp rank runs it: its shares are in the cost already
        k, state_share = 1.0, 1.0
    else:
        k = stp.compute_share(tp)
    fwd, bwd_i, bwd_w = cost.fwd * k + forward_s, cost.bwd_i * k, cost.bwd_w * k
    extra = backward_s + (forward_s if recomputed else 0.0)
    if cost.bwd_i > 0:
        bwd_i += extra
    else:
        bwd_w += extra
    return replace(cost, fwd=fwd, bwd=cost.bwd * k + extra, bwd_i=bwd_i, bwd_w=bwd_w, optim=cost.optim * state_share)


def phase_collectives(stp: StageTP, phase: str) -> Sequence[Collective]:
    """The stage's collectives of ``phase`` (``forward`` or ``backward``), in order."""
    return tuple(c for c in stp.collectives if c.phase == phase)
