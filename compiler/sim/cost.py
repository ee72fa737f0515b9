"""The cost model: what everything a Program does takes, the one input the event loop prices with.

The lowering reads it to order work by cost, the verifier and the simulator to run the event loop
(:mod:`.engine`); :mod:`.simulate` builds it from a plan's stage costs, links and overheads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from pipec.compiler.sim.contention import Sharing
from pipec.schedules.timing import Cost

__all__ = ["COMPUTE_JITTER", "TRANSFER_JITTER", "CostModel"]

COMPUTE_JITTER = "compute"
TRANSFER_JITTER = "transfer"
"""The :attr:`CostModel.jitter` kinds beside the opcode names."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CostModel:
    """What everything a program does takes, in seconds (or units)."""

    stages: tuple[Cost, ...]
    """Per stage: its compute costs and its optimizer step (pipec's one cost type)."""
    transfer: Mapping[tuple[int, int], float]
    """Per edge (src_stage, dst_stage): one microbatch's message over the pp link."""
    allreduce: Mapping[tuple[str, int], float]
    """Per (group, stage): the all-reduce's duration."""
    shard: Mapping[tuple[str, int], float] = field(default_factory=dict)
    """Per (opcode name, stage): an ``UNSHARD``'s all-gather or a ``REDUCE_SCATTER``'s duration;
    ``("OPTIM_STEP", stage)``: the gather of the stage's updated parameters inside ``OPT``
    (``shard optimizer``). Missing: free."""
    activation_bytes: tuple[int, ...] = ()
    """Per stage: bytes saved per microbatch in flight (empty when unknown)."""
    overhead: Mapping[str, float] = field(default_factory=dict)
    """Per opcode name (``"FWD"``, ``"SEND_ACT"``, ...): the host's own seconds per instruction (the
    executor's dispatch and bookkeeping), on top of the work. Missing: free. How the loop charges it: a
    compute starts that long after its inputs are in; a post, a shard instruction or a collective's
    arrival happens that long after the rank's clock (the host is busy, neither computing nor waiting)."""
    time_unit: str = "s"
    grad_norm: bool = True
    """Whether ``OPT`` holds the grad-norm collective over the pp ranks (the run clips gradients). False: ``OPT``
    waits only for its own rank's posts and all-reduces (``--emulate`` runs no optimizer, so no collective)."""
    jitter: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    """Measured spread, per kind a tuple of samples as deviations from the fixed cost: an opcode name (the host
    overhead of one instruction of it), :data:`COMPUTE_JITTER` (a compute's duration, one that takes time),
    :data:`TRANSFER_JITTER` (a message's transfer). Empty: every cost is fixed. Only an :func:`execute` given a
    ``random.Random`` draws from them (each instruction instance, each message apart); otherwise ignored."""
    early_receives: bool = False
    """Whether the run posts every receive of a step when the step starts (the executor does over gloo, whose posts
    never block): a message then moves once its send is posted. False: each receive is posted where the program
    puts it. Only the buffered model reads it (NCCL keeps the plan's positions)."""
    host_spread: float | None = None
    """How much the host's speed scattered while the costs were timed (the relative standard deviation of the
    profile's reference kernel), or None where it was not measured. With every stage's :attr:`Cost.spread` (and its
    ``level_spread`` and ``crowd_spread``), what :func:`~pipec.compiler.sim.simulate.interval_of` draws from: each
    draw runs the whole step at one host speed and one level of the crowd, each stage at one level of its own,
    each compute at its own draw of its stage's spread."""
    overhead_spread: Mapping[str, float] = field(default_factory=dict)
    """Per opcode name: the probe's measured scatter of its instructions' host overhead
    (:attr:`~pipec.compiler.ir.plan.Overhead.spread`); the interval's draws scale each instruction's overhead by
    a lognormal draw of it whose mean is 1. Empty: not measured."""
    hop_spread: float = 0.0
    """The pp link's measured :attr:`~pipec.compiler.ir.plan.Link.spread` (0: none): the interval's draws scale
    each message's transfer, the same on its send and its receive, by a lognormal draw of it whose mean is 1."""
    hop_draws: tuple[float, ...] = ()
    """The pp link's measured :attr:`~pipec.compiler.ir.plan.Link.samples`, each over their mean (empty: none):
    where given, the interval's draws scale each message's transfer, the same on its send and its receive, by one
    of them picked at random instead of by :attr:`hop_spread` (the probe's tail, as often as it met it)."""
    collective_draws: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    """Per link axis of an all-reduce (``"dp"`` for a dp group's, ``"tie"`` for a tie group's): that link's
    measured :attr:`~pipec.compiler.ir.plan.Link.samples`, each over their median (the figure its fit took);
    the interval's draws scale each such ``ALLREDUCE``'s duration by one picked at random. Empty: fixed."""
    overhead_draws: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    """Per opcode name: the probe's :attr:`~pipec.compiler.ir.plan.Overhead.samples`, each over their median;
    where an opcode has them, the interval's draws scale each of its instructions' overhead by one picked at
    random instead of by :attr:`overhead_spread`."""
    sharing: Sharing | None = None
    """Ranks that share a host's cores (``costs profile`` timed the stages in a crowd): every run prices each
    compute at the share of the cores it gets (:mod:`pipec.compiler.sim.contention`). None: each compute takes its
    cost."""
