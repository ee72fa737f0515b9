"""Execute a Program under a comm model and a cost model: the predicted Timeline.

One linear-time event loop serves both the simulator and the verifier's
deadlock proof. Each rank runs its instructions in order; an instruction
waits only for what it needs. Two comm models (DESIGN, "What the verifier
proves"):

- ``buffered`` (gloo-like): posts never block; a send and its receive
  complete once both are posted (plus the transfer time); uses of received
  buffers wait; collectives block every member until all have arrived;
  ``OPT`` waits for the rank's outstanding posts.
- ``in_order`` (NCCL-like): a rank's comm posts, collectives included,
  complete in the order posted. A batch is one unit: its posts may complete
  in any order, and the next unit starts when the whole batch is done. A send
  completes only when its receive is in the unit heading the peer's queue; a
  collective when it heads the queue of every member. Collectives do not
  block the host; ``OPT`` waits for the rank's queue to drain.

If no rank can move while some have instructions left, the program
deadlocks: :class:`Deadlock` carries the cycle of waiting instructions, one
line per rank.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Mapping, Sequence

from pipec.compiler.ir import Instruction, Op, Program
from pipec.compiler.plan import UNIT_COST, Edge, Plan, Tie
from pipec.compiler.timeline import Event, Timeline

__all__ = [
    "BUFFERED", "IN_ORDER", "MODELS", "Costs", "Deadlock", "Execution",
    "execute", "simulate", "plan_costs", "timeline_of", "chain_edges", "group_members",
]

BUFFERED = "buffered"
IN_ORDER = "in_order"
MODELS = (BUFFERED, IN_ORDER)

OPTIM_GROUP = "pp"
"""The group of the grad-norm collective inside ``OPT``: all pp ranks."""


class Deadlock(Exception):
    """No rank can move. ``lines`` describe the waiting instructions, one per rank."""

    def __init__(self, model: str, lines: Sequence[str]) -> None:
        self.model = model
        self.lines = tuple(lines)
        super().__init__(f"deadlock under the {model} model:\n" + "\n".join("  " + ln for ln in lines))


@dataclass(frozen=True, slots=True, kw_only=True)
class Costs:
    """Durations of everything a program does, in seconds (or units)."""

    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    bwd_i: tuple[float, ...]
    bwd_w: tuple[float, ...]
    transfer: Mapping[tuple[int, int], float]
    """Per edge (src_stage, dst_stage): one microbatch's message over the pp link."""
    allreduce: Mapping[tuple[str, int], float]
    """Per (group, stage): the all-reduce's duration."""
    optim_step: float = 0.0
    activation_bytes: tuple[int, ...] = ()
    """Per stage: bytes saved per microbatch in flight (empty when unknown)."""
    time_unit: str = "s"


def plan_costs(plan: Plan) -> Costs:
    """The cost model of a plan: its stages' costs, its links, its edges' bytes.

    A schedule-only plan (no model) has unit costs: F=1, B=2, I=W=1, and free
    communication, so the schedule table's formulas hold exactly.
    """
    num_stages = plan.num_stages
    stage_costs = [st.cost for st in plan.stages] or [UNIT_COST] * num_stages
    unit = plan.model is None
    transfer: dict[tuple[int, int], float] = {}
    allreduce: dict[tuple[str, int], float] = {}
    if not unit:
        pp = plan.links["pp"]
        for e in plan.edges:
            transfer[(e.src_stage, e.dst_stage)] = pp.latency_s + e.num_bytes / pp.bandwidth_Bps
        dp = plan.links.get("dp", pp)
        d = plan.mesh.dp
        for st in plan.stages:
            if d > 1 and st.param_bytes:
                allreduce[("dp", st.stage)] = dp.latency_s + 2 * (d - 1) / d * st.param_bytes / dp.bandwidth_Bps
        for tie in plan.ties:
            n = len({plan.placement[s] for s in tie.stages})
            cost = pp.latency_s + 2 * (n - 1) / n * (tie.num_bytes or 0) / pp.bandwidth_Bps if n > 1 else 0.0
            for s in tie.stages:
                allreduce[(f"tie.{tie.name}", s)] = cost
    act = tuple(st.activation_bytes or 0 for st in plan.stages) if plan.stages and all(
        st.activation_bytes is not None for st in plan.stages) else ()
    return Costs(
        fwd=tuple(c.fwd for c in stage_costs),
        bwd=tuple(c.bwd for c in stage_costs),
        bwd_i=tuple(c.bwd_i for c in stage_costs),
        bwd_w=tuple(c.bwd_w for c in stage_costs),
        transfer=transfer,
        allreduce=allreduce,
        activation_bytes=act,
        time_unit="unit" if unit else "s",
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Execution:
    """What one run of the event loop found."""

    model: str
    step_time: float
    compute: tuple[float, ...]
    comm_wait: tuple[float, ...]
    peak_activations: tuple[int, ...]
    """Per rank: most microbatches held at once (F done, last backward part not)."""
    peak_activation_bytes: tuple[int, ...]
    events: tuple[Event, ...]


# Keys of things instructions wait for:
#   ("A", src, dst, mb) activation message on edge src->dst; ("G", src, dst, mb) its grad
#   ("F", s, mb) / ("B", s, mb) local completion of a forward / input-grad backward
#   ("C", group, k) the k-th collective of a group; ("D", rank) the rank's comm drained


def _message(ins: Instruction) -> tuple:
    op = ins.op
    if op is Op.SEND_ACT:
        return ("A", ins.stage, ins.to_stage, ins.microbatch)
    if op is Op.RECV_ACT:
        return ("A", ins.from_stage, ins.stage, ins.microbatch)
    if op is Op.SEND_GRAD:
        return ("G", ins.to_stage, ins.stage, ins.microbatch)
    return ("G", ins.stage, ins.from_stage, ins.microbatch)  # RECV_GRAD


def _message_text(key: tuple, placement: Sequence[int], send: bool) -> str:
    kind, src, dst, mb = key
    if kind == "A":
        return f"SA{src}.{mb}>{dst}@{placement[dst]}" if send else f"RA{dst}.{mb}<{src}@{placement[src]}"
    return f"SG{dst}.{mb}>{src}@{placement[src]}" if send else f"RG{src}.{mb}<{dst}@{placement[dst]}"


def group_members(group: str, rank: int, num_ranks: int, ties: Sequence[Tie], placement: Sequence[int]) -> tuple[int, ...]:
    """The pp ranks taking part in a collective of ``group`` issued on ``rank``."""
    if group == "dp":
        return (rank,)  # dp replicas of one pp rank run the same program
    if group == OPTIM_GROUP:
        return tuple(range(num_ranks))
    name = group[4:]
    for t in ties:
        if t.name == name:
            return tuple(sorted({placement[s] for s in t.stages}))
    raise KeyError(group)


class _Engine:
    """The event loop. Times are resolved by dataflow: an instruction starts at
    the latest of its rank's clock and the completion of what it needs."""

    def __init__(self, program: Program, placement: Sequence[int], edges: Sequence[Edge],
                 ties: Sequence[Tie], costs: Costs, model: str) -> None:
        self.program = program
        self.placement = placement
        self.ties = ties
        self.costs = costs
        self.model = model
        num_stages = len(placement)
        self.producers: list[list[int]] = [[] for _ in range(num_stages)]
        self.consumers: list[list[int]] = [[] for _ in range(num_stages)]
        for e in edges:
            self.producers[e.dst_stage].append(e.src_stage)
            self.consumers[e.src_stage].append(e.dst_stage)
        P = program.num_ranks
        self.P = P
        self.done: dict[tuple, float] = {}
        self.waiters: dict[tuple, list[int]] = {}
        self.runnable: deque[int] = deque(range(P))
        self.pc = [0] * P
        self.clock = [0.0] * P
        self.compute = [0.0] * P
        self.wait = [0.0] * P
        self.blocked_on: list[tuple | None] = [None] * P
        self.events: list[Event] = []
        self.in_flight = [0] * P
        self.in_flight_bytes = [0] * P
        self.peak = [0] * P
        self.peak_bytes = [0] * P
        self.coll_calls: list[dict[str, int]] = [{} for _ in range(P)]
        self.arrivals: dict[tuple, list] = {}
        self.arrived = [False] * P
        self.members: dict[tuple[str, int], tuple[int, ...]] = {}
        # buffered model
        self.posted: dict[tuple, tuple[int, float]] = {}
        self.outstanding = [0] * P
        self.comm_done = [0.0] * P
        # in-order model: per rank a deque of units; a unit is [ops, pending, done_time]
        self.queues: list[deque] = [deque() for _ in range(P)]
        self.at_head: dict[tuple, tuple[list, float]] = {}
        self.coll_heads: dict[tuple, list] = {}

    # ------------------------------------------------------------------ helpers

    def resolve(self, key: tuple, t: float) -> None:
        self.done[key] = t
        ws = self.waiters.pop(key, None)
        if ws:
            self.runnable.extend(ws)

    def block(self, r: int, key: tuple) -> None:
        self.blocked_on[r] = key
        self.waiters.setdefault(key, []).append(r)

    def transfer(self, key: tuple) -> float:
        return self.costs.transfer.get((key[1], key[2]), 0.0)

    def collective_key(self, r: int, group: str) -> tuple:
        calls = self.coll_calls[r]
        k = calls.get(group, 0)
        calls[group] = k + 1
        members = group_members(group, r, self.P, self.ties, self.placement)
        # tie collectives are one instance per tie group, whatever stage each member names
        return ("C", group, k), members

    # ------------------------------------------------------------------ buffered p2p

    def post_buffered(self, r: int, key: tuple, is_send: bool) -> None:
        other = self.posted.pop((key, not is_send), None)
        self.outstanding[r] += 1
        if other is None:
            self.posted[(key, is_send)] = (r, self.clock[r])
            return
        q, t_other = other
        t = max(self.clock[r], t_other) + self.transfer(key)
        self.finish_p2p(key, t, (r, q))

    def finish_p2p(self, key: tuple, t: float, ranks: tuple[int, int]) -> None:
        self.resolve(key, t)
        for x in ranks:
            self.outstanding[x] -= 1
            if t > self.comm_done[x]:
                self.comm_done[x] = t
            if self.outstanding[x] == 0:
                self.resolve(("D", x), self.comm_done[x])

    # ------------------------------------------------------------------ in-order queues

    def enqueue(self, r: int, ops: list) -> None:
        """ops: list of [kind, key, post_time, duration, members]; kind 'S', 'R' or 'C'."""
        unit = [ops, len(ops), 0.0]
        q = self.queues[r]
        q.append(unit)
        if len(q) == 1:
            self.activate(r, self.clock[r])

    def activate(self, r: int, head_time: float) -> None:
        """Make the unit at the head of rank r's queue current; chain completions."""
        todo = [(r, head_time)]
        while todo:
            r, head_time = todo.pop()
            q = self.queues[r]
            if not q:
                continue
            unit = q[0]
            for op in unit[0]:
                kind, key, post, dur, members = op
                ready = post if post > head_time else head_time
                if kind == "C":
                    slot = self.coll_heads.setdefault(key, [len(members), ready, []])
                    slot[0] -= 1
                    slot[1] = max(slot[1], ready)
                    slot[2].append((r, unit))
                    if slot[0] == 0:
                        del self.coll_heads[key]
                        t = slot[1] + dur
                        self.resolve(key, t)
                        for (x, u) in slot[2]:
                            self.unit_op_done(x, u, t, todo)
                    continue
                side = kind == "S"
                other = self.at_head.pop((key, not side), None)
                if other is None:
                    self.at_head[(key, side)] = (r, unit, ready)
                    continue
                x, u, ready_other = other
                t = max(ready, ready_other) + dur
                self.resolve(key, t)
                self.unit_op_done(r, unit, t, todo)
                self.unit_op_done(x, u, t, todo)

    def unit_op_done(self, r: int, unit: list, t: float, todo: list) -> None:
        unit[1] -= 1
        if t > unit[2]:
            unit[2] = t
        if unit[1] == 0:
            q = self.queues[r]
            assert q[0] is unit
            q.popleft()
            todo.append((r, unit[2]))

    # ------------------------------------------------------------------ the rank loop

    def advance(self, r: int) -> None:
        instrs = self.program.ranks[r]
        n = len(instrs)
        pc = self.pc[r]
        clock = self.clock[r]
        costs = self.costs
        placement = self.placement
        done = self.done
        in_order = self.model == IN_ORDER
        while pc < n:
            ins = instrs[pc]
            op = ins.op
            if op is Op.FWD or op is Op.BWD or op is Op.BWD_I or op is Op.BWD_W:
                s, m = ins.stage, ins.microbatch
                start = clock
                if op is Op.FWD:
                    deps = [("F", p, m) if placement[p] == r else ("A", p, s, m) for p in self.producers[s]]
                elif op is Op.BWD_W:
                    deps = [("B", s, m)]
                else:
                    deps = [("F", s, m)]
                    deps += [("B", c, m) if placement[c] == r else ("G", s, c, m) for c in self.consumers[s]]
                for key in deps:
                    t = done.get(key)
                    if t is None:
                        self.pc[r], self.clock[r] = pc, clock
                        self.block(r, key)
                        return
                    if t > start:
                        start = t
                self.wait[r] += start - clock
                if op is Op.FWD:
                    dur = costs.fwd[s]
                    end = start + dur
                    self.resolve(("F", s, m), end)
                    self.in_flight[r] += 1
                    if self.in_flight[r] > self.peak[r]:
                        self.peak[r] = self.in_flight[r]
                    if costs.activation_bytes:
                        self.in_flight_bytes[r] += costs.activation_bytes[s]
                        if self.in_flight_bytes[r] > self.peak_bytes[r]:
                            self.peak_bytes[r] = self.in_flight_bytes[r]
                else:
                    dur = costs.bwd[s] if op is Op.BWD else costs.bwd_i[s] if op is Op.BWD_I else costs.bwd_w[s]
                    end = start + dur
                    if op is not Op.BWD_W:
                        self.resolve(("B", s, m), end)
                    if op is not Op.BWD_I:
                        self.in_flight[r] -= 1
                        if costs.activation_bytes:
                            self.in_flight_bytes[r] -= costs.activation_bytes[s]
                self.compute[r] += dur
                self.events.append(Event(r, ins.text(), start, end))
                clock = end
                pc += 1
            elif op is Op.SEND_ACT or op is Op.RECV_ACT or op is Op.SEND_GRAD or op is Op.RECV_GRAD:
                self.clock[r] = clock
                if not in_order:
                    self.post_buffered(r, _message(ins), op is Op.SEND_ACT or op is Op.SEND_GRAD)
                    pc += 1
                    continue
                batch = ins.batch
                ops = []
                while True:
                    key = _message(ins)
                    is_send = ins.op is Op.SEND_ACT or ins.op is Op.SEND_GRAD
                    ops.append(["S" if is_send else "R", key, clock, self.transfer(key), None])
                    pc += 1
                    if batch is None or pc >= n:
                        break
                    ins = instrs[pc]
                    if ins.batch != batch:
                        break
                self.enqueue(r, ops)
            elif op is Op.ALLREDUCE or op is Op.OPTIM_STEP:
                is_opt = op is Op.OPTIM_STEP
                if not self.arrived[r]:
                    group = OPTIM_GROUP if is_opt else ins.group
                    dur = costs.optim_step if is_opt else costs.allreduce.get((group, ins.stage), 0.0)
                    arrive = clock
                    if is_opt and not in_order:
                        # the step needs every posted send and receive complete
                        if self.outstanding[r]:
                            done.pop(("D", r), None)
                            self.pc[r], self.clock[r] = pc, clock
                            self.block(r, ("D", r))
                            return
                        arrive = max(clock, self.comm_done[r])
                    ckey, members = self.collective_key(r, group)
                    self.arrived[r] = True
                    self.blocked_on[r] = ckey
                    if in_order:
                        self.clock[r] = clock
                        self.enqueue(r, [["C", ckey, clock, dur, members]])
                        if not is_opt:  # an all-reduce does not block the host
                            self.arrived[r] = False
                            self.blocked_on[r] = None
                            self.events.append(Event(r, ins.text(), clock, clock))
                            pc += 1
                            continue
                    else:
                        slot = self.arrivals.setdefault(ckey, [len(members), arrive])
                        slot[0] -= 1
                        if arrive > slot[1]:
                            slot[1] = arrive
                        if slot[0] == 0:
                            del self.arrivals[ckey]
                            self.resolve(ckey, slot[1] + dur)
                ckey = self.blocked_on[r]
                t = done.get(ckey)
                if t is None:
                    self.pc[r], self.clock[r] = pc, clock
                    self.waiters.setdefault(ckey, []).append(r)
                    return
                self.arrived[r] = False
                self.blocked_on[r] = None
                end = t if t > clock else clock
                self.wait[r] += end - clock
                self.events.append(Event(r, ins.text(), clock, end))
                clock = end
                pc += 1
            else:  # pragma: no cover - the schema admits no other opcode
                raise AssertionError(op)
        self.pc[r], self.clock[r] = pc, clock
        self.blocked_on[r] = None

    def run(self) -> Execution:
        runnable = self.runnable
        while runnable:
            self.advance(runnable.popleft())
        stuck = [r for r in range(self.P) if self.pc[r] < len(self.program.ranks[r])]
        leftover = [r for r in range(self.P) if self.queues[r]] if self.model == IN_ORDER else [
            r for r in range(self.P) if self.outstanding[r]]
        if stuck or leftover:
            raise Deadlock(self.model, self.explain(stuck or leftover))
        end = max(self.clock + (self.comm_done if self.model == BUFFERED else []), default=0.0)
        return Execution(
            model=self.model,
            step_time=end,
            compute=tuple(self.compute),
            comm_wait=tuple(self.wait),
            peak_activations=tuple(self.peak),
            peak_activation_bytes=tuple(self.peak_bytes),
            events=tuple(self.events),
        )

    # ------------------------------------------------------------------ deadlock reports

    def explain(self, ranks: list[int]) -> list[str]:
        """One line per rank of the wait-for cycle (or of every stuck rank if none)."""
        waits: dict[int, tuple[str, int | None]] = {}
        for r in range(self.P):
            line, other = self.describe(r)
            if line is not None:
                waits[r] = (line, other)
        cycle = _find_cycle({r: o for r, (_, o) in waits.items() if o is not None})
        chosen = cycle if cycle else sorted(waits)
        return [f"rank {r}: {waits[r][0]}" for r in chosen if r in waits]

    def describe(self, r: int) -> tuple[str | None, int | None]:
        """What rank r waits for, and which rank should provide it."""
        instrs = self.program.ranks[r]
        pc = self.pc[r]
        here = f"{instrs[pc].text()} (instruction {pc})" if pc < len(instrs) else "end of program"
        if self.model == IN_ORDER and self.queues[r]:
            head = self.queues[r][0]
            for kind, key, _post, _dur, members in head[0]:
                if kind == "C":
                    if key in self.done:
                        continue
                    arrived = {x for x, _ in self.coll_heads.get(key, [0, 0, []])[2]}
                    missing = [x for x in members if x not in arrived]
                    if missing:
                        return f"{here} waits; its queue is headed by collective {key[1]} #{key[2]}, which rank {missing[0]} has not reached", missing[0]
                    continue
                if key in self.done:
                    continue
                send = kind == "S"
                other = self.placement[key[2]] if (send == (key[0] == "A")) else self.placement[key[1]]
                return (f"{here} waits; its comm queue is headed by {_message_text(key, self.placement, send)}, "
                        f"whose {'receive' if send else 'send'} {_message_text(key, self.placement, not send)} "
                        f"is not at the head of rank {other}'s queue"), other
        key = self.blocked_on[r]
        if key is None:
            if pc >= len(instrs) and self.model == BUFFERED and self.outstanding[r]:
                for (k, is_send), (x, _t) in self.posted.items():
                    if x == r:
                        return f"posted {_message_text(k, self.placement, is_send)}, which is never matched", None
            return None, None
        kind = key[0]
        if kind in ("A", "G"):
            sender = self.placement[key[1]] if kind == "A" else self.placement[key[2]]
            return f"{here} waits for {_message_text(key, self.placement, False)}, which rank {sender} has not sent", sender
        if kind in ("F", "B"):
            return f"{here} waits for {'F' if kind == 'F' else 'B'}{key[1]}.{key[2]}, which comes later on the same rank", r
        if kind == "C":
            slot = self.arrivals.get(key)
            group = key[1]
            members = group_members(group, r, self.P, self.ties, self.placement)
            waiting = [x for x in members if x != r and self.blocked_on[x] != key]
            other = waiting[0] if waiting else None
            name = "OPT's grad-norm collective" if group == OPTIM_GROUP else f"collective {group} #{key[2]}"
            who = f", which rank {other} has not reached" if other is not None else ""
            del slot
            return f"{here} waits in {name}{who}", other
        if kind == "D":
            for (k, is_send), (x, _t) in self.posted.items():
                if x == r:
                    other = self.placement[k[2]] if (is_send == (k[0] == "A")) else self.placement[k[1]]
                    return f"{here} waits for {_message_text(k, self.placement, is_send)} to complete, which rank {other} never matches", other
            return f"{here} waits for its posted communication to complete", None
        return f"{here} waits for {key}", None


def _find_cycle(edges: Mapping[int, int]) -> list[int]:
    """A cycle in a functional wait-for graph (each rank waits for at most one)."""
    if not edges:
        return []
    import networkx as nx  # off the fast path: only for deadlock reports

    g = nx.DiGraph(list(edges.items()))
    try:
        cyc = nx.find_cycle(g)
    except nx.NetworkXNoCycle:
        return []
    return [u for u, _ in cyc]


def execute(
    program: Program,
    *,
    placement: Sequence[int],
    edges: Sequence[Edge],
    costs: Costs,
    model: str = BUFFERED,
    ties: Sequence[Tie] = (),
) -> Execution:
    """Run the event loop; raises :class:`Deadlock` if the program cannot finish."""
    if model not in MODELS:
        raise ValueError(f"unknown comm model {model!r}; expected one of {', '.join(MODELS)}")
    return _Engine(program, placement, edges, ties, costs, model).run()


def timeline_of(ex: Execution, costs: Costs, static_bytes: Sequence[int] | None = None) -> Timeline:
    """The Timeline of an execution; ``static_bytes`` adds params/grads/optimizer state per rank."""
    num_ranks = len(ex.compute)
    mem = None
    if costs.activation_bytes and static_bytes is not None:
        mem = {r: static_bytes[r] + ex.peak_activation_bytes[r] for r in range(num_ranks)}
    return Timeline.build(
        step_time=ex.step_time,
        busy={r: (ex.compute[r], ex.comm_wait[r]) for r in range(num_ranks)},
        events=ex.events,
        peak_activations=dict(enumerate(ex.peak_activations)),
        peak_memory_bytes=mem,
        time_unit=costs.time_unit,
    )


def simulate(plan: Plan, model: str = BUFFERED) -> Timeline:
    """The predicted Timeline of a plan under a comm model."""
    costs = plan_costs(plan)
    ex = execute(plan.program, placement=plan.placement, edges=plan.edges or chain_edges(plan.num_stages),
                 costs=costs, model=model, ties=plan.ties)
    return timeline_of(ex, costs)


def chain_edges(num_stages: int) -> tuple[Edge, ...]:
    """The stage graph of a schedule-only plan: stage s feeds stage s+1."""
    return tuple(Edge(src_stage=s, dst_stage=s + 1) for s in range(num_stages - 1))
