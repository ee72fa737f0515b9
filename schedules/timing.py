"""A tiny unit-cost estimator for compute orders: list scheduling over a chain of stages.

Each rank runs its actions in order; an action starts when its rank is free
and its cross-stage dependency is done (communication is free):

- ``F(s, m)`` after ``F(s-1, m)``;
- ``B(s, m)`` / ``I(s, m)`` after ``F(s, m)`` and after the backward
  (``B`` or ``I``) of ``s+1`` on ``m``;
- ``W(s, m)`` after ``I(s, m)``.

This is the "add_time" pass of the Zero Bubble runtime (sail-sg
Megatron-LM fork, ``scheduler/passes.py``: per-stage clocks, start = max(stage
clock, producer completion)) restricted to the chain stage graph and unit
costs. It is pure Python over integers, for the schedule tests, for quick
checks, and for the schedules that place work by unit-cost timing
(:func:`place_weight_grads`, used by ``zb_h1`` and policy schedules with
``weight_grad="bubbles"``). The compiler's simulator (``compiler/sim/simulate.py``)
is the full model: lowered programs, real costs, communication.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Mapping, Sequence

from pipec.schedules.order import Action, ComputeOrder, Kind, ScheduleError

__all__ = [
    "Cost",
    "UNIT",
    "Estimate",
    "estimate",
    "ListSchedule",
    "list_schedule",
    "peak_in_flight",
    "place_weight_grads",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Cost:
    """Per-microbatch duration of a stage's forward, backward and its two halves.

    The one cost type of pipec: a plan's per stage ``cost`` (plan.json), the
    compiler's simulator and lowering, and this estimator (one for every
    stage, or one per stage) all use it.
    """

    fwd: float = 1.0
    """``F``."""
    bwd: float = 2.0
    """Full backward ``B`` (= ``bwd_i + bwd_w`` under unit costs)."""
    bwd_i: float = 1.0
    """Input-grad ``I``."""
    bwd_w: float = 1.0
    """Weight-grad ``W``."""
    optim: float = 0.0
    """The optimizer step over the stage's parameters, once per step (not part of the order)."""
    spread: float | None = None
    """How much the stage's measured compute times scatter: the relative standard deviation of its timed
    samples (their standard deviation over their median, one figure for all its parts). None where nothing
    was timed (unit and flops costs): such a cost has no spread, and a prediction from it no interval."""
    level_spread: float | None = None
    """How far the profile's level of this stage's cost may sit from a run's, by the stage's own timing: the
    relative standard error of the median of its rounds alone (1.2533 x their spread / sqrt(rounds)). Drawn once
    per drawn step for the stage. None: not measured."""
    crowd_spread: float | None = None
    """How far the crowd's slowdown (the factor every cost of one profile shares) may sit from a run's: the
    relative standard deviation of the crowd's repeats, widened for a next repeat's distance from their median
    (:func:`~pipec.costs.profile.crowd_spread`). Drawn once per drawn step for every stage at once
    (one host, one crowd). None: no crowd measured (one rank here)."""

    def of(self, kind: Kind) -> float:
        if kind is Kind.F:
            return self.fwd
        if kind is Kind.B:
            return self.bwd
        if kind is Kind.I:
            return self.bwd_i
        return self.bwd_w


UNIT = Cost()
"""DESIGN's unit costs of a schedule-only plan: F=1, B=2, I=W=1."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimate:
    """The unit-cost timing of a compute order (all ranks start at time 0)."""

    step_time: float
    """Finish time of the last action on any rank."""
    busy: tuple[float, ...]
    """Per rank, total compute time."""
    starts: tuple[tuple[float, ...], ...]
    """Per rank, the start time of each action, in order."""
    peak_in_flight: tuple[int, ...]
    """Per rank, most microbatches held at once (see :func:`peak_in_flight`)."""

    @property
    def num_ranks(self) -> int:
        return len(self.busy)

    def rank_bubble(self, rank: int) -> float:
        """Idle time of ``rank`` over the step time."""
        if self.step_time == 0:
            return 0.0
        return (self.step_time - self.busy[rank]) / self.step_time

    @property
    def bubble_fraction(self) -> float:
        """Sum of idle over ``num_ranks x step_time`` (DESIGN's Timeline definition)."""
        if self.step_time == 0:
            return 0.0
        idle = sum(self.step_time - b for b in self.busy)
        return idle / (self.num_ranks * self.step_time)


def peak_in_flight(order: ComputeOrder) -> tuple[int, ...]:
    """Per rank, the most (stage, microbatch) pairs held at once.

    A pair is in flight from its ``F`` until its last backward part: ``B``, or
    ``W`` of a split backward (``I`` keeps it in flight). This is the count
    the Zero Bubble paper bounds for ZB-H1 and the one the compiler's
    simulator reports as ``peak_activations``.
    """
    peaks = []
    for actions in order.ranks:
        held = peak = 0
        for a in actions:
            kind = a.kind
            if kind is Kind.F:
                held += 1
                if held > peak:
                    peak = held
            elif kind is not Kind.I:
                held -= 1
        peaks.append(peak)
    return tuple(peaks)


_F, _BACK, _W = 0, 1, 2
"""Completion tables: forward, input-side backward (``B`` or ``I``), weight-grad."""


def _dependencies(kind: Kind, s: int, m: int, num_stages: int) -> list[tuple[int, int, int]]:
    """The (table, stage, microbatch) entries ``kind`` of (s, m) waits for."""
    if kind is Kind.F:
        return [(_F, s - 1, m)] if s > 0 else []
    if kind is Kind.W:
        return [(_BACK, s, m)]
    deps = [(_F, s, m)]
    if s + 1 < num_stages:
        deps.append((_BACK, s + 1, m))
    return deps


def _deadlock(order_ranks: Sequence[Sequence[Action]], pc: Sequence[int],
              waits: dict[int, tuple[int, int, int]], placement: Sequence[int]) -> ScheduleError:
    names = {_F: "F", _BACK: "backward (B or I)", _W: "W"}
    lines = []
    for r, actions in enumerate(order_ranks):
        if pc[r] >= len(actions):
            continue
        table, s, m = waits.get(r, (None, -1, -1))
        what = (f"waits for {names[table]} of stage {s} microbatch {m} on rank {placement[s]}, "
                "which comes later in that rank's order" if table is not None else "cannot start")
        lines.append(f"  rank {r}: action {pc[r]} ({actions[pc[r]]}) {what}")
    return ScheduleError(
        "the order cannot complete: every unfinished rank waits for an action that never runs\n"
        + "\n".join(lines)
        + "\nreorder so that each rank reaches the actions the others wait for (for a policy: "
        "raise the warm-up of the waiting ranks)",
        rule="order.deadlock",
    )


@dataclass(frozen=True, slots=True)
class ListSchedule:
    """Start and finish time of every action, per rank in order, and each rank's busy time."""

    starts: tuple[tuple[float, ...], ...]
    finishes: tuple[tuple[float, ...], ...]
    busy: tuple[float, ...]


def list_schedule(
    order: ComputeOrder,
    *,
    producers: Sequence[Sequence[int]] | None = None,
    consumers: Sequence[Sequence[int]] | None = None,
    durations: Sequence[Cost] | Cost = UNIT,
    transfer: Mapping[tuple[int, int], float] | None = None,
    min_duration: float = 0.0,
) -> ListSchedule:
    """List-schedule ``order``: each rank runs its actions in order, each as soon as its inputs are done.

    The stage graph is the chain unless ``producers``/``consumers`` (per stage)
    are given; ``durations`` is one :class:`Cost` for every stage or one per
    stage; ``transfer[(src, dst)]`` delays a dependency between stages on
    different ranks; every action lasts at least ``min_duration``. Linear in
    the number of actions. Raises :class:`ScheduleError` (rule
    ``order.deadlock``) naming every blocked rank, its action and what it
    waits for, when the order cannot run to completion.
    """
    num_ranks, num_mb, num_stages = order.num_ranks, order.num_microbatches, order.num_stages
    placement = order.placement
    if producers is None or consumers is None:
        producers = [[s - 1] if s else [] for s in range(num_stages)]
        consumers = [[s + 1] if s + 1 < num_stages else [] for s in range(num_stages)]
    per_stage = [durations] * num_stages if isinstance(durations, Cost) else list(durations)
    transfer = transfer or {}
    size = num_stages * num_mb
    # completion times, flat: table * size + stage * M + microbatch (None: not run yet)
    done: list[float | None] = [None] * (3 * size)
    # per (kind, stage, rank): the (flat offset at microbatch 0, delay) pairs an action waits for
    deps_cache: dict[tuple[Kind, int], tuple[tuple[int, float], ...]] = {}
    F, B, W = Kind.F, Kind.B, Kind.W
    ranks = order.ranks
    pc = [0] * num_ranks
    clock = [0.0] * num_ranks
    busy = [0.0] * num_ranks
    starts: list[list[float]] = [[] for _ in range(num_ranks)]
    finishes: list[list[float]] = [[] for _ in range(num_ranks)]
    waiting: dict[int, list[int]] = {}
    waits: dict[int, int] = {}
    runnable = deque(range(num_ranks))
    while runnable:
        r = runnable.popleft()
        actions = ranks[r]
        i, t = pc[r], clock[r]
        n = len(actions)
        while i < n:
            a = actions[i]
            kind, s, m = a.kind, a.stage, a.microbatch
            deps = deps_cache.get((kind, s))
            if deps is None:
                if kind is F:
                    deps = tuple((p * num_mb, transfer.get((p, s), 0.0) if placement[p] != placement[s] else 0.0)
                                 for p in producers[s])
                elif kind is W:
                    deps = ((size + s * num_mb, 0.0),)
                else:
                    deps = ((s * num_mb, 0.0),) + tuple(
                        (size + c * num_mb, transfer.get((s, c), 0.0) if placement[c] != placement[s] else 0.0)
                        for c in consumers[s])
                deps_cache[(kind, s)] = deps
            start = t
            blocked = -1
            for base, delay in deps:
                end = done[base + m]
                if end is None:
                    blocked = base + m
                    break
                end += delay
                if end > start:
                    start = end
            if blocked >= 0:
                waiting.setdefault(blocked, []).append(r)
                waits[r] = blocked
                break
            c = per_stage[s]
            dur = c.fwd if kind is F else c.bwd if kind is B else c.bwd_w if kind is W else c.bwd_i
            if dur < min_duration:
                dur = min_duration
            t = start + dur
            busy[r] += dur
            starts[r].append(start)
            finishes[r].append(t)
            key = (0 if kind is F else 2 * size if kind is W else size) + s * num_mb + m
            done[key] = t
            woken = waiting.pop(key, None)
            if woken:
                runnable.extend(woken)
            i += 1
        pc[r], clock[r] = i, t
    if any(pc[r] < len(ranks[r]) for r in range(num_ranks)):
        unflat = {r: (k // size, (k % size) // num_mb, k % num_mb) for r, k in waits.items()}
        raise _deadlock(ranks, pc, unflat, placement)
    return ListSchedule(tuple(map(tuple, starts)), tuple(map(tuple, finishes)), tuple(busy))


def estimate(order: ComputeOrder, *, costs: Cost = UNIT) -> Estimate:
    """List-schedule ``order`` over the chain stage graph under ``costs`` (see :func:`list_schedule`)."""
    sched = list_schedule(order, durations=costs)
    return Estimate(
        step_time=max((f[-1] for f in sched.finishes if f), default=0.0),
        busy=sched.busy,
        starts=sched.starts,
        peak_in_flight=peak_in_flight(order),
    )


def place_weight_grads(
    base: Sequence[Sequence[Action]],
    *,
    placement: Sequence[int],
    num_microbatches: int,
    bounds: Sequence[int],
) -> list[list[Action]]:
    """Insert each ``I``'s weight-grad ``W`` into the idle slots of a unit-cost run.

    ``base[r]`` is rank r's order of ``F`` and ``I`` actions. The ranks are
    list-scheduled together under unit costs (F = I = W = 1, communication
    free); a rank that is free at time t runs:

    1. the oldest pending ``W`` if its next action is an ``F`` that would put
       more than ``bounds[r]`` (stage, microbatch) pairs in flight (a pair is
       in flight from its ``F`` to its ``W``);
    2. else its next action, if its inputs are done by t;
    3. else the oldest pending ``W`` (filling what would be a bubble);
    4. else it waits for the input.

    Leftover ``W`` run at the end, oldest first. This is the W placement of
    the Zero Bubble paper (Qi et al., ICLR 2024, Section 3: "W can be
    flexibly scheduled to fill the bubbles"; ZB-H1 keeps 1F1B's in-flight
    count), done greedily as in the heuristic of their ``zb.py``
    (``no_bubble_greedy``), on the chain stage graph. Raises
    :class:`ScheduleError` when the base orders cannot run or a bound is
    below what the base order itself needs.
    """
    num_ranks = len(base)
    num_stages = len(placement)
    num_mb = num_microbatches
    size = num_stages * num_mb
    done: list[list[int | None]] = [[None] * size for _ in range(2)]
    out: list[list[Action]] = [[] for _ in range(num_ranks)]
    pending: list[deque[Action]] = [deque() for _ in range(num_ranks)]
    held = [0] * num_ranks
    pc = [0] * num_ranks
    waiting: dict[tuple[int, int, int], list[int]] = {}
    waits: dict[int, tuple[int, int, int]] = {}
    heap = [(0, r) for r in range(num_ranks)]
    F, I, W = Kind.F, Kind.I, Kind.W
    while heap:
        t, r = heapq.heappop(heap)
        actions = base[r]
        queue = pending[r]
        if pc[r] == len(actions):
            while queue:
                out[r].append(queue.popleft())
            continue
        a = actions[pc[r]]
        kind, s, m = a.kind, a.stage, a.microbatch
        if kind is F and held[r] >= bounds[r]:
            if not queue:
                raise ScheduleError(
                    f"rank {r}: {a} would hold {held[r] + 1} microbatches in flight, above the "
                    f"bound of {bounds[r]}, and no weight-grad is pending to free one; raise the "
                    "bound or lower the warm-up of this rank",
                    rule="policy.in_flight",
                )
            out[r].append(queue.popleft())
            held[r] -= 1
            heapq.heappush(heap, (t + 1, r))
            continue
        ready: int | None = t
        blocked = None
        for dep in _dependencies(kind, s, m, num_stages):
            table, ds, dm = dep
            end = done[table][ds * num_mb + dm]
            if end is None:
                ready, blocked = None, dep
                break
            if end > ready:
                ready = end
        if ready is not None and ready <= t:
            out[r].append(a)
            pc[r] += 1
            key = (_F if kind is F else _BACK, s, m)
            done[key[0]][s * num_mb + m] = t + 1
            if kind is F:
                held[r] += 1
            else:
                assert kind is I, f"place_weight_grads takes F and I only, got {a}"
                queue.append(Action(W, s, m))
            for other in waiting.pop(key, ()):
                waits.pop(other, None)
                heapq.heappush(heap, (t + 1, other))
            heapq.heappush(heap, (t + 1, r))
        elif queue:
            out[r].append(queue.popleft())
            held[r] -= 1
            heapq.heappush(heap, (t + 1, r))
        elif ready is not None:
            heapq.heappush(heap, (ready, r))
        else:
            assert blocked is not None
            waiting.setdefault(blocked, []).append(r)
            waits[r] = blocked
    if any(pc[r] < len(base[r]) for r in range(num_ranks)):
        raise _deadlock(base, pc, waits, placement)
    return out
