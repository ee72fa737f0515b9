"""Custom schedules declared by policy: a few knobs in, a compute order out.

A :class:`Policy` says how each pp rank orders its work; :func:`policy_order`
turns it into a :class:`ComputeOrder` for (P, M, v). Every rank:

1. lists its forwards and its backwards in chunk order. Microbatches go in
   rounds; ``depth_first`` rounds hold ``mpr = M // max(1, M // P)``
   microbatches (torch's ``ScheduleInterleaved1F1B``; where the rounds do not
   divide M, the last rounds take one more), ``breadth_first`` has one round of all M (torch's
   ``ScheduleLoopedBFS``). Within a round, forwards visit the rank's chunks
   0..v-1 and backwards v-1..0, each over the round's microbatches
   (ascending, or descending with ``backward_microbatches="descending"``);
2. runs ``warmup(rank)`` forwards, then alternates one forward and one
   backward (``priority`` says which of the two goes first in each pair)
   while forwards remain, then the remaining backwards;
3. with ``split_backward``, runs each backward as an input-grad ``I`` and
   places its weight-grad ``W``: right after the ``I`` (``immediate``), all
   after the last ``I`` (``end``), or into the slots where the rank would wait
   under unit costs, never holding more than ``max_in_flight`` microbatches
   (``bubbles``; the Zero Bubble paper's W filling, Qi et al., ICLR 2024 §3).

The named schedules gpipe, 1f1b, interleaved_1f1b, looped_bfs and zb_h1 are
presets of it (:data:`PRESETS`); the tests check that each preset builds
exactly its named form's order. The knobs follow prior art: Megatron-LM's
warm-up count (``forward_backward_pipelining_without_interleaving``:
``P - r - 1`` warm-up microbatches, then forward-first pairs), torch's
interleaved warm-up formula (``_get_warmup_ops``) and depth-first rounds, the
BFS paper's breadth-first loop (Lamy-Poirier, MLSys 2023), and the Zero Bubble
W placement. A policy that cannot run raises :class:`ScheduleError` (rule
``policy.<what>``) saying why; generation is a fixed number of linear passes,
so it never loops.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Callable, Union

from pipec.schedules.interleaved import interleaved_rounds, interleaved_warmup
from pipec.schedules.order import (
    Action,
    ComputeOrder,
    Kind,
    ScheduleError,
    check_counts,
    gc_paused,
    loop_placement,
    v_placement,
)
from pipec.schedules.timing import estimate, place_weight_grads

__all__ = ["Policy", "policy_order", "PRESETS", "default_warmup"]

Warmup = Union[Callable[[int], int], str, None]
"""A rank's warm-up: a callable of the rank, ``"all"`` (every forward first), or None (the default)."""
MaxInFlight = Union[Callable[[int], int], str, None]
"""The ``bubbles`` bound: a callable of the rank, ``"max"``, or None (see :class:`Policy`)."""

_CHOICES = {
    "priority": ("backward", "forward"),
    "weight_grad": ("immediate", "bubbles", "end"),
    "chunk_order": ("depth_first", "breadth_first"),
    "placement": ("loop", "v"),
    "backward_microbatches": ("ascending", "descending"),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """How each pp rank orders its forwards and backwards (see the module docstring)."""

    warmup: Warmup = None
    """Forwards rank r runs before it starts alternating: ``warmup(r)`` (an int in
    0..v*M), ``"all"`` (v*M: every forward first, as GPipe), or None: the
    chunk order's default (:func:`default_warmup`), which gives 1F1B's order
    on one chunk and torch's interleaved order on several, whatever the priority
    (raised, where the rounds or backward order need it, to the least warm-up
    that keeps every backward after its own forward)."""
    priority: str = "backward"
    """``"backward"``: after the warm-up each pair is (backward, forward), as torch's
    ``Schedule1F1B`` loop; ``"forward"``: (forward, backward), as torch's interleaved
    ``_get_1f1b_rank_ops``. With priority backward the warm-up is the number of
    forwards before the first backward; with forward, one more runs first."""
    split_backward: bool = False
    """Run each backward as ``I`` then ``W`` (zero-bubble split)."""
    weight_grad: str = "immediate"
    """Where ``W`` goes with ``split_backward``: ``"immediate"`` (right after its ``I``),
    ``"bubbles"`` (into idle slots, see ``max_in_flight``) or ``"end"`` (after the last ``I``)."""
    chunk_order: str = "depth_first"
    """Multi-chunk order: ``"depth_first"`` (rounds of about P microbatches, chunk by
    chunk within a round: torch's interleaved) or ``"breadth_first"`` (all microbatches
    of one chunk, then the next: looped BFS)."""
    placement: str = "loop"
    """``"loop"`` (stage s on rank s mod P) or ``"v"`` (the V shape; needs v = 2)."""
    backward_microbatches: str = "ascending"
    """Microbatch order of the backwards within a round: ``"ascending"`` (first in, first
    out: the 1F1B family) or ``"descending"`` (last in, first out: torch's looped BFS)."""
    max_in_flight: MaxInFlight = None
    """For ``weight_grad="bubbles"``: most (stage, microbatch) pairs rank r may hold
    from F to W. None: what the same policy without the split holds on that rank
    (1F1B's min(P - r, M)); ``"max"``: the most it holds on any rank (the Zero
    Bubble paper's ZB-H1 rule); or a callable of the rank."""

    def __post_init__(self) -> None:
        for field, allowed in _CHOICES.items():
            value = getattr(self, field)
            if value not in allowed:
                close = difflib.get_close_matches(str(value), allowed, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ScheduleError(
                    f"policy {field} must be one of {', '.join(map(repr, allowed))}, got {value!r}; {hint}"
                    f"use {field}={allowed[0]!r} or another of those",
                    rule=f"policy.{field}",
                )
        if not isinstance(self.split_backward, bool):
            raise ScheduleError(
                f"policy split_backward must be true or false, got {self.split_backward!r}",
                rule="policy.split_backward", key="policy",
            )
        if not (self.warmup is None or self.warmup == "all" or callable(self.warmup)):
            raise ScheduleError(
                f"policy warmup must be an expression of the rank, 'all' or absent, got {self.warmup!r}",
                rule="policy.warmup", key="policy",
            )
        if not self.split_backward and self.weight_grad != "immediate":
            raise ScheduleError(
                f"policy weight_grad {self.weight_grad!r} places the W of a split backward, but "
                "split_backward is off; turn split_backward on, or drop weight_grad",
                rule="policy.weight_grad", key="policy",
            )
        if self.max_in_flight is not None:
            if self.weight_grad != "bubbles":
                raise ScheduleError(
                    f"policy max_in_flight bounds weight_grad 'bubbles' only, got weight_grad "
                    f"{self.weight_grad!r}; use weight_grad 'bubbles' or drop max_in_flight",
                    rule="policy.max_in_flight", key="policy",
                )
            if not (self.max_in_flight == "max" or callable(self.max_in_flight)):
                raise ScheduleError(
                    f"policy max_in_flight must be an expression of the rank, 'max' or absent, "
                    f"got {self.max_in_flight!r}",
                    rule="policy.max_in_flight", key="policy",
                )


PRESETS: dict[str, Policy] = {
    "gpipe": Policy(warmup="all"),
    "1f1b": Policy(),
    "interleaved_1f1b": Policy(priority="forward"),
    "looped_bfs": Policy(chunk_order="breadth_first", backward_microbatches="descending"),
    "zb_h1": Policy(split_backward=True, weight_grad="bubbles", max_in_flight="max"),
}
"""Named schedules as policies; ``policy_order(PRESETS[name], ...)`` equals ``build_order(name, ...)``."""


def _rounds(policy: Policy, num_ranks: int, num_microbatches: int) -> list[range]:
    """The rounds, as ranges of microbatches.

    Depth first: torch's ``max(1, M // P)`` rounds of ``M // rounds``; when
    they do not divide M (torch refuses), the last ``M % rounds`` rounds take
    one microbatch more, so that the first round, which the warm-up fills, keeps
    torch's size and every round still holds at least P microbatches.
    """
    M = num_microbatches
    if policy.chunk_order == "breadth_first":
        return [range(M)]
    count, size = interleaved_rounds(num_ranks, M)
    extra = M - count * size
    out, start = [], 0
    for i in range(count):
        length = size + (1 if i >= count - extra else 0)
        out.append(range(start, start + length))
        start += length
    assert start == M
    return out


def default_warmup(policy: Policy, rank: int, *, num_ranks: int, num_microbatches: int, num_chunks: int) -> int:
    """Forwards before the first backward on ``rank`` when the policy gives no warm-up.

    - breadth first: all v*M (looped BFS);
    - one chunk: ``min(P - r, M)`` (torch's ``Schedule1F1B`` loop; Megatron's
      P - r - 1 plus the first steady-state forward);
    - several chunks on the loop: torch's interleaved ``_get_warmup_ops``
      plus its first steady-state forward, ``min((v-1)*mpr + 2*(P-1-r) + 1, v*M)``;
    - the V placement: ``min(mpr + P, 2M)``: past the V's turn (rank r's
      first backward, on stage 2P-1-r, needs its own chunk-1 forward, the
      (mpr+1)-th). It runs, but is not tuned: depth-first rounds suit the loop,
      and on the V their unit-cost bubble stays far above ``zbv``'s.
    """
    P, M, v = num_ranks, num_microbatches, num_chunks
    if policy.chunk_order == "breadth_first":
        return v * M
    if policy.placement == "v":
        per_round = interleaved_rounds(P, M)[1]
        return min(per_round + P, 2 * M)
    if v == 1:
        return min(P - rank, M)
    return min(interleaved_warmup(rank, num_ranks=P, num_microbatches=M, num_chunks=v) + 1, v * M)


def _warmups(policy: Policy, P: int, M: int, v: int, least: int) -> list[int]:
    """Warm-up forwards per rank; ``least`` is the smallest that keeps every
    backward after its own forward (a default is raised to it)."""
    total = v * M
    if policy.warmup == "all":
        return [total] * P
    if policy.warmup is None:
        counts = [default_warmup(policy, r, num_ranks=P, num_microbatches=M, num_chunks=v) for r in range(P)]
        shift = 0 if policy.priority == "backward" else 1
        return [max(c - shift, least) for c in counts]
    out = []
    for r in range(P):
        w = policy.warmup(r)
        if isinstance(w, bool) or not isinstance(w, int):
            raise ScheduleError(
                f"policy warm-up on rank {r} must be a whole number, got {w!r}", rule="policy.warmup", key="policy",
                rank=r,
            )
        if not 0 <= w <= total:
            fix = "cap it with min(..., chunks*M)" if w > total else "use max(0, ...)"
            raise ScheduleError(
                f"policy warm-up on rank {r} must be in 0..{total} (the rank's forwards: "
                f"{v} chunks x {M} microbatches), got {w}; {fix}",
                rule="policy.warmup", key="policy", rank=r,
            )
        out.append(w)
    return out


def _merge(fwd: list, bwd: list, warmup: int, backward_first: bool) -> list:
    """Warm-up forwards, then (backward, forward) or (forward, backward) pairs, then the rest."""
    total = len(fwd)
    out = fwd[:warmup]
    append = out.append
    for k in range(total - warmup):
        if backward_first:
            append(bwd[k])
            append(fwd[warmup + k])
        else:
            append(fwd[warmup + k])
            append(bwd[k])
    out += bwd[total - warmup:]
    return out


def _peak(sequence: list, back: Kind) -> int:
    held = peak = 0
    for kind, _, _ in sequence:
        if kind is Kind.F:
            held += 1
            peak = max(peak, held)
        elif kind is back:
            held -= 1
    return peak


def policy_order(policy: Policy, *, num_ranks: int, num_microbatches: int, num_chunks: int) -> ComputeOrder:
    """The compute order ``policy`` gives for P ranks, M microbatches and v chunks per rank.

    Raises :class:`ScheduleError` when the counts are out of range, the
    placement does not fit the chunks, a warm-up is outside 0..v*M, a rank
    would run a backward before its own forward (with the smallest warm-up
    that avoids it), or the ranks would wait on each other forever (with
    the waiting actions).
    """
    check_counts("policy", num_ranks=num_ranks, num_microbatches=num_microbatches, num_chunks=num_chunks)
    P, M, v = num_ranks, num_microbatches, num_chunks
    if policy.placement == "v":
        if v != 2:
            raise ScheduleError(
                "policy placement 'v' needs exactly 2 chunks per rank (or placement 'loop')",
                got=(("virtual", v),), fix=((("virtual", 2),),), rule="policy.chunks", key="virtual",
            )
        placement = v_placement(P, 2 * P)
    else:
        placement = loop_placement(P, v * P)
    F, back = Kind.F, Kind.I if policy.split_backward else Kind.B
    rounds = _rounds(policy, P, M)
    descending = policy.backward_microbatches == "descending"
    # (chunk, microbatch) sequences, the same on every rank
    fwd_cm = [(c, m) for mbs in rounds for c in range(v) for m in mbs]
    bwd_cm = [(c, m) for mbs in rounds for c in reversed(range(v)) for m in (reversed(mbs) if descending else mbs)]
    backward_first = policy.priority == "backward"
    least, worst = _least_warmup(fwd_cm, bwd_cm, backward_first)
    warmups = _warmups(policy, P, M, v, least)
    for r, w in enumerate(warmups):
        if w < least:
            c, m = bwd_cm[worst]
            raise ScheduleError(
                f"policy cannot make progress on rank {r}: after a warm-up of {w} forwards, its "
                f"backward of chunk {c} microbatch {m} would come before that chunk's forward "
                f"(chunk order {policy.chunk_order}, priority {policy.priority}, backward microbatches "
                f"{policy.backward_microbatches}); the warm-up must be at least {least} on every rank",
                rule="policy.warmup", key="policy", rank=r,
            )
    stages = [sorted(s for s in range(len(placement)) if placement[s] == r) for r in range(P)]
    sequences = []
    for r in range(P):
        own = stages[r]
        fwd = [(F, own[c], m) for c, m in fwd_cm]
        bwd = [(back, own[c], m) for c, m in bwd_cm]
        sequences.append(_merge(fwd, bwd, warmups[r], backward_first))
    with gc_paused():
        if policy.split_backward and policy.weight_grad == "bubbles":
            ranks = _fill_bubbles(policy, sequences, placement, P, M)
        else:
            ranks = [_place_w(policy, seq) for seq in sequences]
        order = ComputeOrder(
            num_ranks=P, num_microbatches=M, placement=placement, ranks=tuple(map(tuple, ranks))
        )
    try:
        estimate(order)
    except ScheduleError as error:
        raise ScheduleError(
            f"policy cannot make progress with P={P}, M={M}, v={v}: {error}", rule="policy.deadlock", key="policy"
        ) from None
    return order


def _least_warmup(fwd_cm: list, bwd_cm: list, backward_first: bool) -> tuple[int, int]:
    """(the least warm-up that keeps every backward after its own forward, the backward that needs it).

    Before its k-th backward a rank has run min(w + k, v*M) forwards (one more
    with forward priority), so w >= position of that backward's forward - k (+1).
    """
    position = {cm: i for i, cm in enumerate(fwd_cm)}
    slack = 1 if backward_first else 0
    need, worst = 0, 0
    for k, cm in enumerate(bwd_cm):
        least = position[cm] - k + slack
        if least > need:
            need, worst = least, k
    return need, worst


def _place_w(policy: Policy, sequence: list) -> list[Action]:
    """Actions of one rank with W right after each I, or all W at the end."""
    out = []
    append = out.append
    if not policy.split_backward:
        for kind, s, m in sequence:
            append(Action(kind, s, m))
        return out
    W, I = Kind.W, Kind.I
    tail = []
    for kind, s, m in sequence:
        append(Action(kind, s, m))
        if kind is I:
            if policy.weight_grad == "immediate":
                append(Action(W, s, m))
            else:
                tail.append(Action(W, s, m))
    return out + tail


def _fill_bubbles(policy: Policy, sequences: list, placement, P: int, M: int) -> list[list[Action]]:
    peaks = [_peak(seq, Kind.I) for seq in sequences]
    if policy.max_in_flight is None:
        bounds = peaks
    elif policy.max_in_flight == "max":
        bounds = [max(peaks)] * P
    else:
        bounds = []
        for r in range(P):
            b = policy.max_in_flight(r)
            if isinstance(b, bool) or not isinstance(b, int) or b < peaks[r]:
                raise ScheduleError(
                    f"policy max_in_flight on rank {r} must be a whole number >= {peaks[r]} (the "
                    f"microbatches its warm-up and priority alone keep in flight), got {b!r}; raise "
                    "max_in_flight or lower the warm-up",
                    rule="policy.max_in_flight", key="policy", rank=r,
                )
            bounds.append(b)
    base = [[Action(kind, s, m) for kind, s, m in seq] for seq in sequences]
    try:
        return place_weight_grads(base, placement=placement, num_microbatches=M, bounds=bounds)
    except ScheduleError as error:
        raise ScheduleError(f"policy cannot make progress: {error}", rule="policy.deadlock", key="policy") from None
