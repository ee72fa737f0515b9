"""Lowering: compute order + placement + stage graph -> Program.

The compute order says what each pp rank computes; the lowering adds the
communication each compute needs and the collectives of the step:

1. List-schedule the compute order under the plan's costs (each rank in
   order; an action starts when its rank is free and its inputs have arrived)
   to get every action's finish time. An order that cannot run is refused
   here, with the cycle of waiting actions.
2. Every cross-rank edge use becomes a message keyed by the time its send is
   posted (the producer's finish), ties broken by (rank, position). The send
   is posted right after its producer; the receive is posted on the consumer's
   rank right after the last compute that finishes no later than the send, so
   it is in flight while that rank computes (torch's 1F1B and Megatron post
   ``send_forward_recv_backward`` at the same point).
3. On every rank, the posts of one slot (between two computes) are sorted by
   key and go out as one batch. Since each rank's comm posts appear in the
   order of one global sequence, the first unfinished message always heads
   both its ranks' queues: the program cannot deadlock under the in-order
   model, and so not under the buffered one either. The verifier proves it
   again for every plan.
4. With dp > 1, ``ALLREDUCE <stage>:dp`` follows the stage's last backward
   (overlapping the rank's remaining backwards); each tie group is reduced
   once per rank at the end (``AR<stage>:tie.<name>``, sorted by name, as
   Megatron-LM reduces its embedding group after the pipeline flush), then
   ``OPTIM_STEP``.
5. Sharded data parallelism (the mesh's ``shard``; :func:`unshard_windows`).
   ``optimizer`` adds nothing (``OPT`` steps its shard and gathers). Under
   ``grads`` and ``full`` every stage's computes run in *unshard windows*:
   ``UN<s>:<group>`` is posted one compute before the window's first (so the
   all-gather overlaps that compute: prefetch), ``RE<s>:<group>`` follows its
   last. ``grads`` has one window per stage, from its first compute to its last
   backward; ``full`` one per run of the stage's consecutive computes on the
   rank (a forward run, a backward run), runs at most one compute apart merged
   (the prefetch would unshard right where the reshard is). After the stage's
   last backward, ``RS<s>:<group>`` replaces ``AR<s>:dp``; under HSDP
   (``dp.shard``) ``AR<s>:dp.replicate`` follows it; then the window's
   ``RE``. The tie all-reduces run at the end, on the gradient shards.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any, Hashable, Sequence

from pipec.compiler.ir.program import Instruction, Op, Program
from pipec.compiler.ir.plan import SHARDING, Edge, Mesh, Tie
from pipec.compiler.sim.cost import CostModel
from pipec.schedules.timing import list_schedule
from pipec.schedules.order import ComputeOrder, Kind

__all__ = ["lower", "schedule_times", "unshard_windows", "PREFETCH", "PerOrder"]

PREFETCH = 1
"""Computes an ``UNSHARD`` is posted ahead of its window's first compute."""

_END = float("inf")

_MIN_DURATION = 1e-9
"""Zero-cost actions are given this length so that finish times strictly increase on a rank."""


def schedule_times(order: ComputeOrder, producers: Sequence[Sequence[int]], consumers: Sequence[Sequence[int]],
                   costs: CostModel) -> tuple[tuple[float, ...], ...]:
    """Finish time of every action of every rank under the costs (buffered comm); see
    :func:`pipec.schedules.timing.list_schedule`, which raises a ``ScheduleError`` when the order
    cannot run. Cached per (order, stage graph, stage costs, transfers), all it reads (``pipec tune``
    lowers one order under one cost model for every shard mode)."""
    key = (tuple(map(tuple, producers)), tuple(map(tuple, consumers)), costs.stages, tuple(costs.transfer.items()))
    got = _FINISHES.get(order, key)
    if got is None:
        got = _FINISHES.put(order, key, list_schedule(
            order, producers=producers, consumers=consumers, durations=costs.stages, transfer=costs.transfer,
            min_duration=_MIN_DURATION).finishes)
    return got


class PerOrder:
    """A small cache of values per (compute order, key): the order by identity (hashing one walks all its
    actions; an order is immutable and its entries hold it, so its id is not reused while they last); past
    ``size`` entries the oldest is dropped."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: dict[tuple[int, Any], tuple[ComputeOrder, Any]] = {}

    def get(self, order: ComputeOrder, key: Hashable) -> Any:
        """The value kept for (order, key), or None."""
        entry = self.entries.get((id(order), key))
        return entry[1] if entry is not None and entry[0] is order else None

    def put(self, order: ComputeOrder, key: Hashable, value: Any) -> Any:
        """Keep ``value`` for (order, key); returns it."""
        if len(self.entries) >= self.size:
            del self.entries[next(iter(self.entries))]
        self.entries[(id(order), key)] = (order, value)
        return value


_FINISHES = PerOrder(256)
"""(order, stage graph and costs) -> :func:`schedule_times`."""
_COMPUTES = PerOrder(64)
"""order -> per rank, its compute instructions (the same in every program lowered from the order)."""

_new = tuple.__new__
"""``_new(Instruction, fields)``: an instruction from all its fields at once (a quarter of the cost of the keyword
constructor; lowering builds millions)."""


def _computes(order: ComputeOrder) -> tuple[tuple[Instruction, ...], ...]:
    got = _COMPUTES.get(order, None)
    if got is None:
        got = _COMPUTES.put(order, None, tuple(tuple(Instruction(_COMPUTE_OP[a.kind], a.stage, a.microbatch)
                                                     for a in actions) for actions in order.ranks))
    return got


def lower(
    order: ComputeOrder,
    *,
    edges: Sequence[Edge],
    costs: CostModel,
    dp: int = 1,
    ties: Sequence[Tie] = (),
    mesh: Mesh | None = None,
) -> Program:
    """Turn a compute order into a Program (see the module docstring); ``mesh`` (its dp and sharding)
    overrides ``dp``."""
    mesh = mesh or Mesh(pp=order.num_ranks, dp=dp)
    dp = mesh.dp
    placement = order.placement
    S = order.num_stages
    P = order.num_ranks
    producers: list[list[int]] = [[] for _ in range(S)]
    consumers: list[list[int]] = [[] for _ in range(S)]
    for e in edges:
        producers[e.dst_stage].append(e.src_stage)
        consumers[e.src_stage].append(e.dst_stage)
    finish = schedule_times(order, producers, consumers, costs)

    # slots[r][i + 1]: p2p posts after compute i of rank r (slot 0: before the first), each its sort key and
    # the instruction's fields but its batch: (key, op, stage, microbatch, to_stage, from_stage, peer);
    # groups[r][i + 1]: the group ops there, (key, op, stage, group). Keys are unique, so a slot sorts as
    # its keys do.
    slots: list[list[list[tuple]]] = [[[] for _ in range(len(order.ranks[r]) + 1)] for r in range(P)]
    groups = [_Slots() for _ in range(P)]
    last_backward: dict[int, tuple[int, int]] = {}
    # enum members as locals: their attribute lookup (Kind.B, Op.SEND_ACT) costs more than the rest of a test
    F, B, W = Kind.F, Kind.B, Kind.W
    forward_ops, backward_ops = (Op.SEND_ACT, Op.RECV_ACT), (Op.SEND_GRAD, Op.RECV_GRAD)
    for r, actions in enumerate(order.ranks):
        fin = finish[r]
        mine = slots[r]
        for i, a in enumerate(actions):
            s, m, kind = a.stage, a.microbatch, a.kind
            if kind is F:
                others = consumers[s]
                send_op, recv_op = forward_ops
            elif kind is W:
                last_backward[s] = (r, i)
                continue
            else:
                if kind is B:
                    last_backward[s] = (r, i)
                others = producers[s]
                send_op, recv_op = backward_ops
            f = fin[i]
            for j, other in enumerate(others):
                q = placement[other]
                if q == r:
                    continue
                key = (f, r, i, j)
                mine[i + 1].append((key, send_op, s, m, other, None, q))
                slots[q][bisect_right(finish[q], f)].append((key, recv_op, other, m, None, s, r))
    if mesh.params_sharded:
        _place_shard_ops(order, finish, groups, last_backward, mesh)
    elif dp > 1:
        for s, (r, i) in last_backward.items():
            groups[r][i + 1].append(((finish[r][i], r, i, _END, 0), Op.ALLREDUCE, s, "dp"))

    computes = _computes(order)
    ranks = []
    for r, actions in enumerate(order.ranks):
        out: list[Instruction] = []
        batch = 0
        mine, work, grouped = slots[r], computes[r], groups[r]
        for i in range(len(actions) + 1):
            if i:
                out.append(work[i - 1])
            posts = mine[i]
            if grouped and i in grouped:
                batch = _merged(posts + grouped[i], out, batch)
            elif len(posts) == 1:  # a lone post (the common slots inlined: lowering's hottest loop)
                _key, op, s, m, to, frm, peer = posts[0]
                out.append(_new(Instruction, (op, s, m, to, frm, peer, None, None)))
            elif posts:
                posts.sort()
                for _key, op, s, m, to, frm, peer in posts:
                    out.append(_new(Instruction, (op, s, m, to, frm, peer, None, batch)))
                batch += 1
        for tie in sorted(ties, key=lambda t: t.name):
            mine = sorted(s for s in tie.stages if placement[s] == r)
            if mine and len(tie.ranks(placement)) > 1:
                out.append(Instruction(Op.ALLREDUCE, mine[0], group=f"tie.{tie.name}"))
        out.append(Instruction(Op.OPTIM_STEP))
        ranks.append(tuple(out))
    return Program(tuple(ranks))


def unshard_windows(stages: Sequence[int], mode: str) -> list[tuple[int, int, int]]:
    """The unshard windows of one rank's computes (``stages[i]``: the stage of compute i) under shard mode
    ``mode`` (its :attr:`~pipec.compiler.ir.plan.ShardMode.unshard`), as (stage, first, last) compute indices, in
    order of their first compute (see the module docstring)."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    runs: list[list[int]] = []
    for i, s in enumerate(stages):
        first.setdefault(s, i)
        last[s] = i
        if runs and runs[-1][0] == s:
            runs[-1][2] = i
        else:
            runs.append([s, i, i])
    if SHARDING[mode].unshard == "step":
        return sorted(((s, first[s], last[s]) for s in first), key=lambda w: w[1])
    merged: dict[int, list[int]] = {}  # stage -> its open window
    out: list[list[int]] = []
    for s, a, b in runs:
        open_ = merged.get(s)
        if open_ is not None and a - open_[2] - 1 <= PREFETCH:
            open_[2] = b
            continue
        merged[s] = [s, a, b]
        out.append(merged[s])
    return [tuple(w) for w in out]


def _place_shard_ops(order: ComputeOrder, finish, groups: list[_Slots],
                     last_backward: dict[int, tuple[int, int]], mesh: Mesh) -> None:
    """UNSHARD, RESHARD and REDUCE_SCATTER (and HSDP's replicate all-reduce) into the slots' group ops."""
    group = mesh.shard_group
    for r in range(order.num_ranks):
        fin = finish[r]
        slots = groups[r]
        for s, a, b in _windows(order, r, mesh.shard):
            k = max(a - PREFETCH, 0)  # slot k: after compute k - 1
            # windows come in order of their first compute a; two whose UNSHARDs both go before the first
            # compute (k = 0) keep that order by it
            slots[k].append(((fin[k - 1] if k else -1.0, r, k - 1, _END, 3, a), Op.UNSHARD, s, group))
            end = (fin[b], r, b, _END)
            if last_backward.get(s) == (r, b):
                slots[b + 1].append((end + (0,), Op.REDUCE_SCATTER, s, group))
                if mesh.hybrid:
                    slots[b + 1].append((end + (1,), Op.ALLREDUCE, s, "dp.replicate"))
            slots[b + 1].append((end + (2,), Op.RESHARD, s, group))


_COMPUTE_OP = {Kind.F: Op.FWD, Kind.B: Op.BWD, Kind.I: Op.BWD_I, Kind.W: Op.BWD_W}


class _Slots(dict):
    """One rank's group ops by slot, a slot's list made when first asked for."""

    def __missing__(self, k: int) -> list[tuple]:
        got = self[k] = []
        return got


def _windows(order: ComputeOrder, r: int, mode: str) -> list[tuple[int, int, int]]:
    """:func:`unshard_windows` of rank r of the order, cached per (order, rank, mode)."""
    got = _WINDOWS.get(order, (r, mode))
    if got is None:
        got = _WINDOWS.put(order, (r, mode), unshard_windows([x.stage for x in order.ranks[r]], mode))
    return got


_WINDOWS = PerOrder(1024)


def _merged(posts: list[tuple], out: list[Instruction], batch: int) -> int:
    """Append a slot's p2p posts and group ops in key order: each run of p2p posts between group ops as
    :func:`_flush` appends it."""
    posts.sort()
    run: list[tuple] = []
    for post in posts:
        if len(post) == 4:  # a group op
            batch = _flush(run, out, batch)
            out.append(_new(Instruction, (post[1], post[2], None, None, None, None, post[3], None)))
        else:
            run.append(post)
    return _flush(run, out, batch)


def _flush(run: list[tuple], out: list[Instruction], batch: int) -> int:
    """Append a run of p2p posts: a lone post as is, several as one batch."""
    if not run:
        return batch
    if len(run) == 1:
        _key, op, s, m, to, frm, peer = run[0]
        out.append(_new(Instruction, (op, s, m, to, frm, peer, None, None)))
        run.clear()
        return batch
    for _key, op, s, m, to, frm, peer in run:
        out.append(_new(Instruction, (op, s, m, to, frm, peer, None, batch)))
    run.clear()
    return batch + 1
