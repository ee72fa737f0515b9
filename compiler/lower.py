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
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from typing import Sequence

from pipec.compiler.ir import Instruction, Op, Program
from pipec.compiler.plan import Edge, Tie
from pipec.compiler.simulate import Costs
from pipec.schedules.order import Action, ComputeOrder, Kind, ScheduleError

__all__ = ["lower", "schedule_times"]

_MIN_DURATION = 1e-9
"""Zero-cost actions are given this length so that finish times strictly increase on a rank."""


def schedule_times(order: ComputeOrder, producers: Sequence[Sequence[int]], consumers: Sequence[Sequence[int]],
                   costs: Costs) -> list[list[float]]:
    """Finish time of every action of every rank under the costs (buffered comm).

    Raises :class:`ScheduleError` with the waiting actions when the order
    cannot run (an action waits for one that comes later).
    """
    placement = order.placement
    ranks = order.ranks
    P = order.num_ranks
    finish: list[list[float]] = [[] for _ in range(P)]
    done: dict[tuple, float] = {}
    waiters: dict[tuple, list[int]] = {}
    pc = [0] * P
    clock = [0.0] * P
    blocked: list[tuple | None] = [None] * P
    runnable = deque(range(P))
    fwd, bwd, bwd_i, bwd_w, transfer = costs.fwd, costs.bwd, costs.bwd_i, costs.bwd_w, costs.transfer
    F, B, I = Kind.F, Kind.B, Kind.I
    while runnable:
        r = runnable.popleft()
        actions = ranks[r]
        i, t = pc[r], clock[r]
        while i < len(actions):
            a = actions[i]
            s, m, kind = a.stage, a.microbatch, a.kind
            start = t
            missing = None
            if kind is F:
                for p in producers[s]:
                    d = done.get(("F", p, m))
                    if d is None:
                        missing = ("F", p, m)
                        break
                    if placement[p] != r:
                        d += transfer.get((p, s), 0.0)
                    start = max(start, d)
                dur = fwd[s]
            elif kind is B or kind is I:
                d = done.get(("F", s, m))
                if d is None:
                    missing = ("F", s, m)
                else:
                    start = max(start, d)
                    for c in consumers[s]:
                        d = done.get(("B", c, m))
                        if d is None:
                            missing = ("B", c, m)
                            break
                        if placement[c] != r:
                            d += transfer.get((s, c), 0.0)
                        start = max(start, d)
                dur = bwd[s] if kind is B else bwd_i[s]
            else:
                d = done.get(("B", s, m))
                if d is None:
                    missing = ("B", s, m)
                else:
                    start = max(start, d)
                dur = bwd_w[s]
            if missing is not None:
                blocked[r] = missing
                waiters.setdefault(missing, []).append(r)
                break
            t = start + max(dur, _MIN_DURATION)
            finish[r].append(t)
            key = ("F" if kind is F else "B" if kind is not Kind.W else "W", s, m)
            done[key] = t
            ws = waiters.pop(key, None)
            if ws:
                runnable.extend(ws)
            i += 1
        pc[r], clock[r] = i, t
    stuck = [r for r in range(P) if pc[r] < len(ranks[r])]
    if stuck:
        lines = []
        for r in stuck:
            k = blocked[r]
            what = f"{'F' if k[0] == 'F' else 'B/I' if k[0] == 'B' else 'W'}{k[1]}.{k[2]}"
            lines.append(f"  rank {r}: {ranks[r][pc[r]]} (action {pc[r]}) waits for {what} on rank {placement[k[1]]}")
        raise ScheduleError(
            "the compute order cannot run: every waiting action needs one that comes later\n" + "\n".join(lines),
            rule="order.deadlock",
        )
    return finish


def lower(
    order: ComputeOrder,
    *,
    edges: Sequence[Edge],
    costs: Costs,
    dp: int = 1,
    ties: Sequence[Tie] = (),
) -> Program:
    """Turn a compute order into a Program (see the module docstring)."""
    placement = order.placement
    S = order.num_stages
    P = order.num_ranks
    producers: list[list[int]] = [[] for _ in range(S)]
    consumers: list[list[int]] = [[] for _ in range(S)]
    for e in edges:
        producers[e.dst_stage].append(e.src_stage)
        consumers[e.src_stage].append(e.dst_stage)
    finish = schedule_times(order, producers, consumers, costs)

    # slots[r][i + 1]: the (key, instruction) posts after compute i of rank r (slot 0: before the first)
    slots: list[list[list[tuple]]] = [[[] for _ in range(len(order.ranks[r]) + 1)] for r in range(P)]
    last_backward: dict[int, tuple[int, int]] = {}
    for r, actions in enumerate(order.ranks):
        for i, a in enumerate(actions):
            s, m, kind = a.stage, a.microbatch, a.kind
            f = finish[r][i]
            if kind is Kind.F:
                others = [c for c in consumers[s] if placement[c] != r]
            elif kind is Kind.W:
                others = []
            else:
                others = [p for p in producers[s] if placement[p] != r]
            if kind is Kind.B or kind is Kind.W:
                last_backward[s] = (r, i)
            for j, other in enumerate(others):
                q = placement[other]
                key = (f, r, i, j)
                if kind is Kind.F:
                    send = Instruction(Op.SEND_ACT, s, m, to_stage=other, peer=q)
                    recv = Instruction(Op.RECV_ACT, other, m, from_stage=s, peer=r)
                else:
                    send = Instruction(Op.SEND_GRAD, s, m, to_stage=other, peer=q)
                    recv = Instruction(Op.RECV_GRAD, other, m, from_stage=s, peer=r)
                slots[r][i + 1].append((key, send))
                slots[q][bisect_right(finish[q], f)].append((key, recv))
    if dp > 1:
        for s, (r, i) in last_backward.items():
            slots[r][i + 1].append(((finish[r][i], r, i, float("inf")), Instruction(Op.ALLREDUCE, s, group="dp")))

    ranks = []
    for r, actions in enumerate(order.ranks):
        out: list[Instruction] = []
        batch = 0
        for i in range(len(actions) + 1):
            if i:
                out.append(_compute(actions[i - 1]))
            posts = slots[r][i]
            if not posts:
                continue
            posts.sort(key=lambda kv: kv[0])
            run: list[Instruction] = []
            for _key, ins in posts:
                if ins.op is Op.ALLREDUCE:
                    batch = _flush(run, out, batch)
                    out.append(ins)
                else:
                    run.append(ins)
            batch = _flush(run, out, batch)
        for tie in sorted(ties, key=lambda t: t.name):
            mine = sorted(s for s in tie.stages if placement[s] == r)
            if mine and len({placement[s] for s in tie.stages}) > 1:
                out.append(Instruction(Op.ALLREDUCE, mine[0], group=f"tie.{tie.name}"))
        out.append(Instruction(Op.OPTIM_STEP))
        ranks.append(tuple(out))
    return Program(tuple(ranks))


_COMPUTE_OP = {Kind.F: Op.FWD, Kind.B: Op.BWD, Kind.I: Op.BWD_I, Kind.W: Op.BWD_W}


def _compute(a: Action) -> Instruction:
    return Instruction(_COMPUTE_OP[a.kind], a.stage, a.microbatch)


def _flush(run: list[Instruction], out: list[Instruction], batch: int) -> int:
    """Append a run of p2p posts: a lone post as is, several as one batch."""
    if len(run) == 1:
        out.append(run[0])
    elif run:
        out.extend(Instruction(i.op, i.stage, i.microbatch, i.to_stage, i.from_stage, i.peer, batch=batch) for i in run)
        batch += 1
    run.clear()
    return batch
