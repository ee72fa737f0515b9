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

Each collective is priced as what the run issues for it (:func:`collective_price`), a ring over the stage's tp
group (:meth:`~pipec.compiler.sim.simulate.Pricing.tp_ring`): ``latency + f (n - 1) / n x bytes / bandwidth``.
``f`` is the collective's ring factor on the plan's backend (:func:`backend_of`): 2 for an all-reduce; an
all-gather or a reduce-scatter (sequence parallelism) takes the backend's own factor from
:data:`~pipec.compiler.ir.tensor_parallel.NATIVE` (NCCL 1 and 1, gloo 1 and 2: its reduce-scatter is an
all-reduce), and 2 on a backend that lacks the call (the runtime all-reduces the zero-padded whole). ``bytes``
are the whole tensor's in the dtype the run moves (:func:`wire_bytes`): under a 2-byte run dtype (autocast, or
FSDP2's mixed precision) every floating payload moves in it, whatever its traced dtype (a norm's float32
output, the gradient into it), but for the loss-parallel loss's per-token values (float32). The ring is on the
``tp`` link when the plan has one; otherwise priced as the dp collectives are, on the ``dp`` link, or by node
with ``devices_per_node`` and ``intra`` / ``inter`` links (one node: ``intra``; spanning nodes: the
hierarchical ring).

torch-free.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from pipec.compiler.ir.plan import Plan
from pipec.compiler.ir.tensor_parallel import NATIVE, Collective, StageTP
from pipec.schedules.timing import Cost

__all__ = ["ALL_REDUCE_FACTOR", "ELEMENT_BYTES", "backend_of", "ring_factor", "wire_bytes", "collective_price",
           "tp_cost", "phase_collectives"]

ALL_REDUCE_FACTOR = 2.0
"""Bytes each rank of a ring all-reduce moves, in multiples of ``(n - 1) / n x bytes``: a reduce-scatter, then an
all-gather."""

ELEMENT_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of the floating dtypes a collective's payload is traced in or a run moves."""


def backend_of(plan: Plan) -> str:
    """The torch.distributed backend the plan's run uses, as the plan tells it: the one its links were measured
    on (``costs profile``'s probe); else ``gloo`` for a plan whose stages were profiled (``costs profile`` times
    them on this host's CPU, where the runtime takes gloo); else ``nccl`` (a plan priced from FLOPs and
    given links: GPUs, where the runtime takes NCCL)."""
    measured = sorted({link.measured.backend for link in plan.links.values() if link.measured is not None})
    if measured:
        return measured[0]
    return "gloo" if (plan.model or {}).get("profile") else "nccl"


def ring_factor(kind: str, backend: str) -> float:
    """Bytes each rank moves in one collective of ``kind`` on ``backend``, in multiples of ``(n - 1) / n x bytes``
    of the whole tensor: the backend's own all-gather or reduce-scatter where it has one (:data:`NATIVE`), else
    (and for an all-reduce) an all-reduce's."""
    if kind == "all_reduce":
        return ALL_REDUCE_FACTOR
    return NATIVE.get(backend, {}).get(kind, ALL_REDUCE_FACTOR)


def wire_bytes(c: Collective, run_dtype: str) -> float:
    """The whole tensor's bytes as the run moves them: in ``run_dtype`` (the plan's ``dtype``) where it is a
    reduced precision and the payload is floating (tp's collectives cast to the autocast dtype, ``tp/comm.py``'s
    ``wire_dtype``; under FSDP2's mixed precision the values are in it already), else as traced; the loss-parallel
    loss's values (``of == "loss"``) stay float32."""
    run, own = ELEMENT_BYTES.get(run_dtype), ELEMENT_BYTES.get(c.dtype)
    if c.of == "loss" or own is None or run is None or run >= 4:
        return float(c.num_bytes)
    return c.num_bytes / own * run


def collective_price(c: Collective, backend: str, run_dtype: str) -> tuple[float, float]:
    """(ring factor, bytes) of collective ``c`` as a run on ``backend`` in ``run_dtype`` issues it."""
    return ring_factor(c.kind, backend), wire_bytes(c, run_dtype)


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
