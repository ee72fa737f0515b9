"""The event loop that executes a Program under a comm model: simulator and deadlock proof.

Each rank runs its instructions in order; an instruction starts at the latest
of its rank's clock and the completion of what it needs (a dataflow over
times, so no priority queue: the loop is linear in the number of
instructions). Two comm models (DESIGN, "What the verifier proves"):

- ``buffered`` (gloo-like): posts never block; a send and its receive
  complete once both are posted (plus the transfer time); uses of received
  buffers wait. An ``ALLREDUCE`` is posted asynchronously, as the executor
  posts it: it completes once every member has posted it (plus its
  duration) and the host goes on; a tie all-reduce first waits for the
  rank's all-reduces still in flight (the executor sums the dp-averaged
  copies), and ``OPT`` for its outstanding posts and all-reduces, then its
  grad-norm collective blocks every member until all have arrived.
- ``in_order`` (NCCL-like): a rank's comm posts, collectives included,
  complete in the order posted. A batch is one unit: its posts may complete
  in any order, and the next unit starts when the whole batch is done. A send
  completes only when its receive is in the unit heading the peer's queue; a
  collective when it heads the queue of every member. Collectives do not
  block the host; ``OPT`` waits for its own completion, so for the queue.

``OPT``'s grad-norm collective (over the pp ranks) is there when the run
clips gradients (:attr:`CostModel.grad_norm`); without it ``OPT`` is a
collective of its rank alone: it still waits for what the rank posted, but
for no peer. The time a rank waits inside a collective (``OPT``, a tie
all-reduce) is its own event, a wait (:attr:`Event.wait`), so a view draws it
as waiting (as the executor records its waits).

Sharded data parallelism's ``UNSHARD``, ``RESHARD`` and ``REDUCE_SCATTER``
are collectives over a dp group, posted asynchronously under both models (the
host goes on; FSDP2 runs them on their own streams and communicator): on
each rank they complete one after another on its dp lane, in the order
posted, ``buffered`` as soon as they arrive, ``in_order`` through a second
queue of the rank (the dp group's communicator, apart from the pp group's
point-to-point queue). A compute of a stage waits for the stage's last
``UNSHARD`` before it; ``OPT`` for the rank's last shard instruction. A
``REDUCE_SCATTER`` is waited for, as the executor waits for it, in ``OPT``,
or first by a reduction of the gradient shards it writes: HSDP's
``ALLREDUCE`` over ``dp.replicate`` waits for its own stage's, a tie
all-reduce for every one of its rank still in flight; under both models the
host waits (a ``~`` event) before it posts the all-reduce.

If no rank can move while some have instructions left, the program
deadlocks: :class:`Deadlock` carries the cycle of waiting instructions, one
line per rank.

A cost model may carry measured spread (:attr:`CostModel.jitter`, every stage's
:attr:`Cost.spread` and the host's); only a run given a seeded
``random.Random`` draws from it (:func:`drawn`: each instruction's host
overhead, each compute, each message's transfer), so every prediction stays
deterministic, its interval too.

Internally every instruction is decoded once into a tuple and every thing an
instruction can wait for is an integer key, which keeps the loop fast enough
for the 780K-instruction plans of the compile benchmark.

The comm model is a strategy the rank loop calls (:class:`_Buffered`,
:class:`_InOrder`: how posts and collectives complete, what is left over at
the end, how a wait reads in a deadlock report); compute and the waits on data
are the loop's own. This module is past 600 lines on purpose: the loop, its
decoding and its two strategies share the integer keys and the hot state, and
splitting them would put attribute lookups across modules on the fastest path.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

from pipec.compiler.sim.contention import ITERATIONS, TOLERANCE
from pipec.compiler.sim.cost import COMPUTE_JITTER, TRANSFER_JITTER, CostModel
from pipec.compiler.ir.program import COMM_OPS, DP_GROUPS, SEND_OPS, SHARD_OPS, Op, Program, message_edge
from pipec.compiler.ir.plan import Edge, Tie
from pipec.compiler.ir.timeline import Event
from pipec.errors import PipecError
from pipec.schedules.timing import Cost

__all__ = ["BUFFERED", "IN_ORDER", "MODELS", "OPTIM_GROUP", "Deadlock", "Execution", "Decoded", "decode", "drawn",
           "execute", "group_members", "levels", "spreads"]

BUFFERED = "buffered"
IN_ORDER = "in_order"
MODELS = (BUFFERED, IN_ORDER)
"""The comm models (DESIGN, "What the verifier proves"); each is a strategy of the event loop."""

OPTIM_GROUP = "pp"
"""The group of the grad-norm collective inside ``OPT``: all pp ranks."""

# decoded opcodes
_COMPUTE, _SEND, _RECV, _AR, _OPT, _SHARD = range(6)


class Deadlock(PipecError):
    """No rank can move. ``lines`` describe the waiting instructions, one per rank."""

    def __init__(self, model: str, lines: Sequence[str]) -> None:
        self.model = model
        self.lines = tuple(lines)
        super().__init__(f"deadlock under the {model} model:\n" + "\n".join("  " + ln for ln in lines))


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


def group_members(group: str, rank: int, num_ranks: int, ties: Sequence[Tie], placement: Sequence[int]) -> tuple[int, ...]:
    """The pp ranks taking part in a collective of ``group`` issued on ``rank``."""
    if group in DP_GROUPS:
        return (rank,)  # dp replicas of one pp rank run the same program
    if group == OPTIM_GROUP:
        return tuple(range(num_ranks))
    name = group[4:]
    for t in ties:
        if t.name == name:
            return t.ranks(placement)
    raise KeyError(group)


class _Keys:
    """Integer keys for what instructions wait for.

    Messages on edge src->dst for microbatch m: activations ``(src*S+dst)*M+m``,
    grads offset by S*S*M; local completions of a forward or an input-grad
    backward follow. Collectives and drains use tuples (they are rare).
    """

    def __init__(self, num_stages: int, num_mb: int) -> None:
        S, M = num_stages, num_mb
        self.S, self.M = S, M
        self.grad = S * S * M
        self.fwd_done = 2 * S * S * M
        self.bwd_done = self.fwd_done + S * M

    def act(self, src: int, dst: int, m: int) -> int:
        return (src * self.S + dst) * self.M + m

    def gradk(self, src: int, dst: int, m: int) -> int:
        return self.grad + (src * self.S + dst) * self.M + m

    def describe(self, key: int) -> tuple[str, int, int, int]:
        """(kind, a, b, m): ("A"|"G", src, dst, m) or ("F"|"B", stage, -1, m)."""
        if key >= self.fwd_done:
            kind = "F" if key < self.bwd_done else "B"
            rest = key - (self.fwd_done if kind == "F" else self.bwd_done)
            return kind, rest // self.M, -1, rest % self.M
        kind = "A" if key < self.grad else "G"
        rest = key - (0 if kind == "A" else self.grad)
        edge, m = divmod(rest, self.M)
        src, dst = divmod(edge, self.S)
        return kind, src, dst, m


def _message_text(kind: str, src: int, dst: int, m: int, placement: Sequence[int], send: bool) -> str:
    if kind == "A":
        return f"SA{src}.{m}>{dst}@{placement[dst]}" if send else f"RA{dst}.{m}<{src}@{placement[src]}"
    return f"SG{dst}.{m}>{src}@{placement[src]}" if send else f"RG{src}.{m}<{dst}@{placement[dst]}"


@dataclass(frozen=True, slots=True)
class Decoded:
    """A program decoded for the loop; reusable across comm models with the same costs."""

    ranks: tuple[tuple[tuple, ...], ...]
    keys: _Keys
    early_receives: bool = False
    """:attr:`CostModel.early_receives` of the costs decoded."""


def decode(program: Program, *, placement: Sequence[int], num_microbatches: int, edges: Sequence[Edge],
           costs: CostModel) -> Decoded:
    """Decode every instruction once: its waits as integer keys, its duration."""
    S = len(placement)
    keys = _Keys(S, num_microbatches)
    producers: list[list[int]] = [[] for _ in range(S)]
    consumers: list[list[int]] = [[] for _ in range(S)]
    for e in edges:
        producers[e.dst_stage].append(e.src_stage)
        consumers[e.src_stage].append(e.dst_stage)
    M = num_microbatches
    act_bytes = costs.activation_bytes or (0,) * S
    stage_costs = costs.stages
    optim = [0.0] * program.num_ranks  # per rank: the optimizer steps of its stages
    for s, c in enumerate(stage_costs):
        optim[placement[s]] += c.optim + costs.shard.get(("OPTIM_STEP", s), 0.0)
    transfer = costs.transfer
    host = {op: costs.overhead.get(op.value, 0.0) for op in Op}
    fwd_done, bwd_done = keys.fwd_done, keys.bwd_done
    # a message's (code, key at microbatch 0, transfer, host overhead) per (opcode, stage, stage at the other end)
    message_cache: dict[int, tuple[int, int, float, float]] = {}
    op_index = {op: k for k, op in enumerate(Op)}
    # the opcodes as locals: an enum member's attribute lookup (Op.FWD) costs more than the rest of a test
    FWD, BWD, BWD_I, BWD_W, UNSHARD, REDUCE_SCATTER, ALLREDUCE = (
        Op.FWD, Op.BWD, Op.BWD_I, Op.BWD_W, Op.UNSHARD, Op.REDUCE_SCATTER, Op.ALLREDUCE)
    opt_group = OPTIM_GROUP if costs.grad_norm else None  # None: a collective of the rank alone
    out = []
    for r, instrs in enumerate(program.ranks):
        dec = []
        deps_cache: dict[int, tuple[int, ...]] = {}  # (opcode, stage) -> the compute's waits at microbatch 0
        unsharded: dict[int, tuple] = {}  # stage -> the key of its last UNSHARD so far
        last_shard = None
        calls: dict[str | None, int] = {}  # group -> collectives of it so far: the k of key ("C", group, k)
        in_flight: list[tuple] = []  # keys of the all-reduces posted since the host last waited for them
        scatters: dict[int, tuple] = {}  # stage -> the key of its REDUCE_SCATTER posted and not yet waited for
        for pc, ins in enumerate(instrs):
            op, s, m, to_stage, from_stage, _peer, _group, batch = ins
            if op is FWD or op is BWD or op is BWD_I or op is BWD_W:
                dkey = op_index[op] * S + s  # (opcode, stage) as one integer
                base = deps_cache.get(dkey)
                if base is None:
                    # dependency keys at microbatch 0; microbatch m adds m
                    if op is FWD:
                        base = tuple(fwd_done + p * M if placement[p] == r else keys.act(p, s, 0) for p in producers[s])
                    elif op is BWD_W:
                        base = (bwd_done + s * M,)
                    else:
                        base = (fwd_done + s * M,) + tuple(
                            bwd_done + c * M if placement[c] == r else keys.gradk(s, c, 0) for c in consumers[s])
                    deps_cache[dkey] = base
                deps = (base[0] + m,) if len(base) == 1 else tuple([k + m for k in base])
                if unsharded:
                    un = unsharded.get(s)
                    if un is not None:
                        deps += (un,)
                c = stage_costs[s]
                h = host[op]
                if op is FWD:
                    dec.append((_COMPUTE, deps, c.fwd, fwd_done + s * M + m, 1, act_bytes[s], h))
                elif op is BWD:
                    dec.append((_COMPUTE, deps, c.bwd, bwd_done + s * M + m, -1, -act_bytes[s], h))
                elif op is BWD_I:
                    dec.append((_COMPUTE, deps, c.bwd_i, bwd_done + s * M + m, 0, 0, h))
                else:
                    dec.append((_COMPUTE, deps, c.bwd_w, -1, -1, -act_bytes[s], h))
            elif op in COMM_OPS:
                # (opcode, stage, the stage at the other end) as one integer: no tuple made per post
                mkey = (op_index[op] * S + s) * S + (from_stage if to_stage is None else to_stage)
                message = message_cache.get(mkey)
                if message is None:
                    is_act, src, dst = message_edge(ins)
                    message = message_cache[mkey] = (
                        _SEND if op in SEND_OPS else _RECV, keys.act(src, dst, 0) if is_act else keys.gradk(src, dst, 0),
                        transfer.get((src, dst), 0.0), host[op])
                code, key, seconds, h = message
                dec.append((code, key + m, seconds, batch, h))
            elif op in SHARD_OPS:
                key = ("S", r, pc)
                if op is UNSHARD:
                    unsharded[ins.stage] = key
                elif op is REDUCE_SCATTER:
                    scatters[ins.stage] = key
                last_shard = key
                dec.append((_SHARD, ins.group, costs.shard.get((op.value, ins.stage), 0.0), key, host[op]))
            else:
                # a collective: (code, group, its duration, the optimizer step, what the host waits for before it
                # arrives: (under in_order: shard instructions only, under buffered: all-reduces too), its key,
                # host overhead)
                group = ins.group if op is ALLREDUCE else opt_group
                k = calls.get(group, 0)
                calls[group] = k + 1
                ckey = ("C", group, k)
                if op is ALLREDUCE:
                    dur = costs.allreduce.get((ins.group, ins.stage), 0.0)
                    if ins.group.startswith("tie."):
                        # the executor sums a tie's dp-reduced copies: it waits for every reduction in flight first
                        shard, waits = tuple(scatters.values()), tuple(in_flight)
                        scatters.clear()
                        in_flight.clear()
                    else:  # HSDP's replicate all-reduce works on its stage's gradient shards: their RS first
                        rs = scatters.pop(ins.stage, None)
                        shard, waits = () if rs is None else (rs,), ()
                    dec.append((_AR, group, dur, 0.0, (shard, shard + waits), ckey, host[op]))
                    in_flight.append(ckey)
                else:
                    # the grad-norm collective (free), then this rank's own optimizer step (after its shard ops)
                    shard = () if last_shard is None else (last_shard,)
                    dec.append((_OPT, group, 0.0, optim[r], (shard, shard + tuple(in_flight)), ckey, host[op]))
                    in_flight.clear()
                    scatters.clear()
        out.append(tuple(dec))
    return Decoded(tuple(out), keys, costs.early_receives)


def drawn(decoded: Decoded, program: Program, jitter: Mapping[str, Sequence[float]], rng: random.Random, *,
          spread: Sequence[float] = (), host_spread: float = 0.0, hop_spread: float = 0.0,
          levels: Sequence[tuple[float, float]] = (), overhead_spread: Mapping[str, float] | None = None,
          hop_draws: Sequence[float] = (), overhead_draws: Mapping[str, Sequence[float]] | None = None,
          collective_draws: Mapping[str, Sequence[float]] | None = None) -> Decoded:
    """A copy of ``decoded`` with one draw from ``jitter`` (:attr:`CostModel.jitter`) added to each cost it
    covers: every instruction's host overhead (by its opcode), every compute's duration (a compute that takes
    time), every message's transfer (one draw per message, the same on its send and its receive). ``spread``
    (per stage, :attr:`Cost.spread`: a relative standard deviation) scales each compute of a stage by its own
    draw, ``exp(spread x z - spread^2 / 2)`` for a standard normal z (a lognormal whose mean is 1: a cost is a mean,
    the profile's slowdown a ratio of sums), and ``host_spread`` every compute of the copy by one draw the same way
    (the host's speed over the step), ``hop_spread`` (:attr:`CostModel.hop_spread`) each message's transfer by
    one draw, the same on its send and its receive. ``levels`` (per stage, its :attr:`Cost.level_spread` and
    :attr:`Cost.crowd_spread`, 0 where not measured) scale every compute of a stage by one draw of its own level
    and one of the crowd's, the crowd's z the same for every stage (one host, one crowd); ``overhead_spread``
    (:attr:`CostModel.overhead_spread`) each instruction's host overhead by its own draw. ``hop_draws`` and
    ``overhead_draws`` (:attr:`CostModel.hop_draws`, :attr:`CostModel.overhead_draws`: measured samples, each over
    its figure) replace the lognormal of ``hop_spread`` and of an opcode's ``overhead_spread``: each message's
    transfer, each instruction's overhead, scaled by one of them picked at random; ``collective_draws``
    (:attr:`CostModel.collective_draws`) each dp or tie ``ALLREDUCE``'s duration the same way. Draws are taken in
    program order, rank by rank (the levels first), so a seeded ``rng`` gives the same copy every time."""
    compute, transfer = jitter.get(COMPUTE_JITTER), jitter.get(TRANSFER_JITTER)
    choice, gauss = rng.choice, rng.gauss
    speed = math.exp(gauss(0.0, host_spread) - host_spread * host_spread / 2) if host_spread else 1.0
    shift = [x * x / 2 for x in spread]
    if levels and any(a or b for a, b in levels):
        crowd_z = gauss(0.0, 1.0)
        level = [math.exp(a * gauss(0.0, 1.0) - a * a / 2 + b * crowd_z - b * b / 2) for a, b in levels]
    else:
        level = []
    odraws = {k: v for k, v in (overhead_draws or {}).items() if v}
    cdraws = {k: v for k, v in (collective_draws or {}).items() if v}
    ospread = {k: v for k, v in (overhead_spread or {}).items() if v > 0 and k not in odraws}
    hops: dict[int, float] = {}
    ranks = []
    for instrs, dec in zip(program.ranks, decoded.ranks):
        out = []
        for ins, d in zip(instrs, dec):
            code, host = d[0], jitter.get(ins.op.value)
            h = 6 if code == _COMPUTE or code == _AR or code == _OPT else 4  # where the host overhead is
            d = list(d)
            if host:
                d[h] += choice(host)
            if odraws and d[h] > 0 and (xs := odraws.get(ins.op.value)):
                d[h] *= choice(xs)
            elif ospread and d[h] > 0 and (o := ospread.get(ins.op.value)):
                d[h] *= math.exp(gauss(0.0, o) - o * o / 2)
            if code == _AR and cdraws and d[2] > 0 and (xs := cdraws.get("tie" if d[1].startswith("tie.") else d[1])):
                d[2] *= choice(xs)
            if code == _COMPUTE and spread and d[2] > 0:
                d[2] *= speed * math.exp(gauss(0.0, spread[ins.stage]) - shift[ins.stage])
                if level:
                    d[2] *= level[ins.stage]
            if code == _COMPUTE and compute and d[2] > 0:
                d[2] += choice(compute)
            elif (code == _SEND or code == _RECV) and (transfer or hop_spread or hop_draws):
                hop = hops.get(d[1])
                if hop is None:
                    hop = hops[d[1]] = (choice(transfer) if transfer else 0.0, choice(hop_draws) if hop_draws else
                                        math.exp(gauss(0.0, hop_spread) - hop_spread * hop_spread / 2)
                                        if hop_spread else 1.0)
                d[2] = d[2] * hop[1] + hop[0]
            out.append(tuple(d))
        ranks.append(tuple(out))
    return replace(decoded, ranks=tuple(ranks))


class _Buffered:
    """The ``buffered`` comm model (gloo-like): posts never block; a send and its receive complete once
    both are posted (plus the transfer time); an all-reduce is posted asynchronously and completes once
    every member has posted it; ``OPT`` first waits for the rank's outstanding posts and all-reduces,
    then its collective blocks every member until all have arrived."""

    name = BUFFERED
    waits_index = 1
    """Which of a collective's two wait lists the host waits for before arriving: the rank's in-flight
    all-reduces too (the executor waits for them on the host)."""

    def __init__(self, eng: _Engine) -> None:
        self.eng = eng
        P = eng.P
        self.posted: dict[int, tuple[int, float]] = {}
        """2 x message key + (1 for a send, 0 for a receive) -> (rank, time) of a post whose other end is not
        posted yet (an integer: no tuple made per post)."""
        self.drained = [("D", r) for r in range(P)]
        """Per rank: the key that resolves when its posts have all completed."""
        self.outstanding = [0] * P
        self.comm_done = [0.0] * P
        """Per rank: when its last completed post completed."""
        self.arrivals: dict[tuple, list] = {}
        """Collective key -> [members still to arrive, latest arrival, the members arrived]."""
        self.lane = [0.0] * P
        """Per rank: when its dp lane (the shard instructions, one after another) is free."""
        self.early = eng.early_receives
        """Every receive counts as posted when the step starts (:attr:`CostModel.early_receives`)."""

    def shard(self, r: int, key: tuple, dur: float, t: float) -> None:
        """A shard instruction posted at t: it runs on rank r's dp lane once the lane is free."""
        start = t if t > self.lane[r] else self.lane[r]
        self.lane[r] = start + dur
        self.eng.resolve(key, start + dur)

    def post(self, r: int, dec: tuple, pc: int, clock: float) -> tuple[int, float]:
        """Post instruction ``pc`` of rank r and the sends and receives right after it, each after its host
        overhead (posts never block); returns the next pc and the clock."""
        # the hottest path of a search: the engine's resolve inlined, the two ends' bookkeeping unrolled
        eng = self.eng
        done, waiters, runnable = eng.done, eng.waiters, eng.runnable
        outstanding, comm_done, drained = self.outstanding, self.comm_done, self.drained
        posted, early = self.posted, self.early
        n = len(dec)
        d = dec[pc]
        while True:
            pc += 1
            clock += d[4]
            key = d[1]
            side = key + key
            other = posted.pop(side if d[0] == _SEND else side + 1, None)
            at = 0.0 if early and d[0] == _RECV else clock  # when this end counts as posted
            if other is None:
                outstanding[r] += 1
                posted[side + 1 if d[0] == _SEND else side] = (r, at)
            else:
                q, t_other = other
                done_t = (at if at > t_other else t_other) + d[2]
                done[key] = done_t
                ws = waiters.pop(key, None)
                if ws:
                    runnable.extend(ws)
                if done_t > comm_done[r]:   # r's own post completes at once: outstanding[r] is as it was
                    comm_done[r] = done_t
                if outstanding[r] == 0:
                    eng.resolve(drained[r], comm_done[r])
                outstanding[q] -= 1
                if done_t > comm_done[q]:
                    comm_done[q] = done_t
                if outstanding[q] == 0:
                    eng.resolve(drained[q], comm_done[q])
            if pc >= n:
                return pc, clock
            d = dec[pc]
            if d[0] != _SEND and d[0] != _RECV:
                return pc, clock

    def ready(self, r: int, clock: float, is_opt: bool) -> float | None:
        """When rank r reaches a collective; None: it first waits (``OPT`` for its posts) and is blocked."""
        if not is_opt:
            return clock
        if self.outstanding[r]:
            self.eng.done.pop(("D", r), None)
            self.eng.block(r, ("D", r))
            return None
        return max(clock, self.comm_done[r])

    def arrive(self, r: int, ckey: tuple, members: tuple[int, ...], dur: float, t: float, is_opt: bool) -> bool:
        """Rank r arrives at collective ``ckey`` at t; the collective resolves when every member has.
        Returns whether the host waits for it: ``OPT`` does; an all-reduce is posted and the host goes on."""
        slot = self.arrivals.get(ckey)
        if slot is None:
            slot = self.arrivals[ckey] = [len(members), t, set()]
        slot[0] -= 1
        slot[2].add(r)
        if t > slot[1]:
            slot[1] = t
        if slot[0] == 0:
            del self.arrivals[ckey]
            self.eng.resolve(ckey, slot[1] + dur)
        return is_opt

    def arrived(self, ckey: tuple) -> set[int]:
        """The members that have posted collective ``ckey`` (it is not complete)."""
        slot = self.arrivals.get(ckey)
        return set() if slot is None else slot[2]

    def unfinished(self) -> list[int]:
        return [r for r in range(self.eng.P) if self.outstanding[r]]

    def end_times(self) -> list[float]:
        return self.comm_done

    def describe(self, r: int, here: str) -> tuple[str, int | None] | None:
        """What rank r waits for that only this model knows: its own posts."""
        eng = self.eng
        key = eng.blocked_on[r]
        at_end = key is None and eng.pc[r] >= len(eng.dec[r]) and self.outstanding[r]
        if not at_end and not (isinstance(key, tuple) and key[0] == "D"):
            return None
        for side, (x, _t) in self.posted.items():
            if x == r:
                text, other = eng.message_text(side >> 1, bool(side & 1))
                if at_end:
                    return f"posted {text}, which rank {other} never matches", other
                return f"{here} waits for {text} to complete, which rank {other} never matches", other
        return f"{here} waits for its posted communication to complete", None


class _InOrder:
    """The ``in_order`` comm model (NCCL-like): a rank's comm posts, collectives included, complete in
    the order posted. A batch is one unit: its posts may complete in any order, and the next unit
    starts when the whole batch is done. A send completes only when its receive is in the unit heading
    the peer's queue; a collective when it heads the queue of every member. Collectives do not block
    the host; ``OPT`` waits for its own completion, so for the queue."""

    name = IN_ORDER
    waits_index = 0
    """A collective's host waits before arriving: the shard instructions it needs only (a wait on an all-reduce
    does not block the host: NCCL's ``wait`` orders the stream)."""

    def __init__(self, eng: _Engine) -> None:
        self.eng = eng
        self.queues: dict = {q: deque() for r in range(eng.P) for q in (r, (r, "dp"))}
        """Per queue (rank r: its p2p posts and collectives; ``(r, "dp")``: its shard instructions): units
        [ops, pending, done_time]; op = (kind "S"|"R"|"C", key, post, dur, members)."""
        self.at_head: dict = {}
        """(key, is_send) -> (rank, unit, ready) of a p2p op heading its rank's queue, unmatched."""
        self.coll_heads: dict[tuple, list] = {}
        """Collective key -> [members still to reach it at a queue head, latest ready, [(rank, unit)]]."""
        self.free_at: dict = dict.fromkeys(self.queues, 0.0)
        """Per queue: when its last unit completed (a unit queued after, even one posted earlier, starts then)."""

    def post(self, r: int, dec: tuple, pc: int, clock: float) -> tuple[int, float]:
        """Queue instruction ``pc`` of rank r, with the rest of its batch, as one unit, after the batch's host
        overhead (the executor posts a batch at once); returns the next pc and the clock."""
        d = dec[pc]
        batch = d[3]
        n = len(dec)
        ops = []
        while True:
            clock += d[4]
            ops.append(["S" if d[0] == _SEND else "R", d[1], 0.0, d[2], None])
            pc += 1
            if batch is None or pc >= n:
                break
            d = dec[pc]
            if (d[0] != _SEND and d[0] != _RECV) or d[3] != batch:
                break
        for op in ops:
            op[2] = clock
        self.enqueue(r, [tuple(op) for op in ops], clock)
        return pc, clock

    def ready(self, r: int, clock: float, is_opt: bool) -> float:
        return clock

    def shard(self, r: int, key: tuple, dur: float, t: float) -> None:
        """A shard instruction joins rank r's dp queue (a collective of one member: its dp replicas run
        the same program)."""
        self.enqueue((r, "dp"), [("C", key, t, dur, (r,))], t)

    def arrive(self, r: int, ckey: tuple, members: tuple[int, ...], dur: float, t: float, is_opt: bool) -> bool:
        """Queue the collective; only ``OPT`` makes the host wait for it."""
        self.enqueue(r, [("C", ckey, t, dur, members)], t)
        return is_opt

    def arrived(self, ckey: tuple) -> set[int]:
        """The members whose queue this collective heads."""
        return {x for x, _ in self.coll_heads.get(ckey, [0, 0, []])[2]}

    def enqueue(self, r: int, ops: list, t: float) -> None:
        q = self.queues[r]
        q.append([ops, len(ops), 0.0])
        if len(q) == 1:
            free = self.free_at[r]
            self.activate(r, t if t > free else free)

    def activate(self, r: int, head_time: float) -> None:
        """Make the unit heading rank r's queue current; chain the completions it allows."""
        resolve = self.eng.resolve
        todo = [(r, head_time)]
        while todo:
            r, head_time = todo.pop()  # r: a queue
            q = self.queues[r]
            if not q:
                continue
            unit = q[0]
            for kind, key, post, dur, members in unit[0]:
                ready = post if post > head_time else head_time
                if kind == "C":
                    slot = self.coll_heads.get(key)
                    if slot is None:
                        slot = self.coll_heads[key] = [len(members), ready, []]
                    slot[0] -= 1
                    if ready > slot[1]:
                        slot[1] = ready
                    slot[2].append((r, unit))
                    if slot[0] == 0:
                        del self.coll_heads[key]
                        t = slot[1] + dur
                        resolve(key, t)
                        for x, u in slot[2]:
                            self._unit_op_done(x, u, t, todo)
                    continue
                side = kind == "S"
                other = self.at_head.pop((key, not side), None)
                if other is None:
                    self.at_head[(key, side)] = (r, unit, ready)
                    continue
                x, u, ready_other = other
                t = (ready if ready > ready_other else ready_other) + dur
                resolve(key, t)
                self._unit_op_done(r, unit, t, todo)
                self._unit_op_done(x, u, t, todo)

    def _unit_op_done(self, r: int, unit: list, t: float, todo: list) -> None:
        unit[1] -= 1
        if t > unit[2]:
            unit[2] = t
        if unit[1] == 0:
            q = self.queues[r]
            assert q[0] is unit
            q.popleft()
            self.free_at[r] = unit[2]
            todo.append((r, unit[2]))

    def unfinished(self) -> list[int]:
        return [r for r in range(self.eng.P) if self.queues[r] or self.queues[(r, "dp")]]

    def end_times(self) -> list[float]:
        return []  # a queue empties no later than the OPT that waits for it

    def describe(self, r: int, here: str) -> tuple[str, int | None] | None:
        """What heads rank r's queue and is not matched."""
        eng = self.eng
        if not self.queues[r]:
            return None
        for kind, key, _post, _dur, members in self.queues[r][0][0]:
            if key in eng.done:
                continue
            if kind == "C":
                arrived = {x for x, _ in self.coll_heads.get(key, [0, 0, []])[2]}
                missing = [x for x in members if x not in arrived]
                if missing:
                    return (f"{here} waits; its comm queue is headed by collective {key[1]} #{key[2]}, which "
                            f"rank {missing[0]} has not reached"), missing[0]
                continue
            send = kind == "S"
            mine, other = eng.message_text(key, send)
            theirs, _ = eng.message_text(key, not send)
            return (f"{here} waits; its comm queue is headed by {mine}, whose "
                    f"{'receive' if send else 'send'} {theirs} is not at the head of rank {other}'s queue"), other
        return None


_COMM_MODELS = {BUFFERED: _Buffered, IN_ORDER: _InOrder}
"""Comm model name -> its strategy: how posts and collectives complete (the loop calls it)."""


class _Engine:
    """The rank loop: compute and the waits on data are the same under every comm model; posts and
    collectives go to the comm model's strategy (``self.comm``)."""

    def __init__(self, program: Program, decoded: Decoded, placement: Sequence[int], ties: Sequence[Tie],
                 model: str, record_events: bool) -> None:
        self.program = program
        self.dec = decoded.ranks
        self.keys = decoded.keys
        self.early_receives = decoded.early_receives
        self.placement = placement
        self.ties = ties
        self.record_events = record_events
        P = program.num_ranks
        self.P = P
        self.done: dict = {}
        self.waiters: dict = {}
        self.runnable: deque[int] = deque(range(P))
        self.pc = [0] * P
        self.clock = [0.0] * P
        self.compute = [0.0] * P
        self.wait = [0.0] * P
        self.blocked_on: list = [None] * P
        self.events: list[Event] = []
        self.in_flight = [0] * P
        self.in_flight_bytes = [0] * P
        self.peak = [0] * P
        self.peak_bytes = [0] * P
        self.arrived = [False] * P
        self.members_cache: dict[tuple[str, int], tuple[int, ...]] = {}
        self.comm = _COMM_MODELS[model](self)

    def resolve(self, key, t: float) -> None:
        self.done[key] = t
        ws = self.waiters.pop(key, None)
        if ws:
            self.runnable.extend(ws)

    def block(self, r: int, key) -> None:
        self.blocked_on[r] = key
        w = self.waiters.get(key)
        if w is None:
            self.waiters[key] = [r]
        else:
            w.append(r)

    def members(self, group: str | None, r: int) -> tuple[int, ...]:
        """The pp ranks of a collective of ``group`` issued on r (``None``: r alone, an ``OPT`` without its
        grad-norm collective)."""
        got = self.members_cache.get((group, r))
        if got is None:
            got = (r,) if group is None else group_members(group, r, self.P, self.ties, self.placement)
            self.members_cache[(group, r)] = got
        return got

    def event(self, r: int, pc: int, start: float, end: float, waited_from: float) -> None:
        """Instruction pc's event; the time it waited before (from ``waited_from``) is a wait event of its own."""
        ins = self.program.ranks[r][pc]
        if start > waited_from:
            self.events.append(Event(r, ins, waited_from, start, True))
        self.events.append(Event(r, ins, start, end))

    # ------------------------------------------------------------------ the rank loop

    def advance(self, r: int) -> None:
        # the hottest loop of the simulator: the rank's running sums are locals, written back whenever it stops
        # (_park); resolving a compute's completion is inlined
        dec = self.dec[r]
        instrs = self.program.ranks[r]
        n = len(dec)
        pc = self.pc[r]
        clock = self.clock[r]
        done, waiters, runnable = self.done, self.waiters, self.runnable
        comm = self.comm
        post = comm.post
        waits_index = comm.waits_index
        record = self.record_events
        wait, compute = self.wait[r], self.compute[r]
        held, held_bytes = self.in_flight[r], self.in_flight_bytes[r]
        peak, peak_bytes = self.peak[r], self.peak_bytes[r]
        while pc < n:
            d = dec[pc]
            code = d[0]
            if code == _COMPUTE:
                start = clock
                for key in d[1]:
                    t = done.get(key)
                    if t is None:
                        self._park(r, pc, clock, wait, compute, held, held_bytes, peak, peak_bytes, key)
                        return
                    if t > start:
                        start = t
                wait += start - clock
                start += d[6]  # the host's own time, once the inputs are in
                end = start + d[2]
                key = d[3]
                if key >= 0:
                    done[key] = end
                    ws = waiters.pop(key, None)
                    if ws:
                        runnable.extend(ws)
                if d[4]:
                    held += d[4]
                    held_bytes += d[5]
                    if d[4] > 0:
                        if held > peak:
                            peak = held
                        if held_bytes > peak_bytes:
                            peak_bytes = held_bytes
                compute += d[2]
                if record:
                    self.events.append(Event(r, instrs[pc], start, end))
                clock = end
                pc += 1
            elif code == _SEND or code == _RECV:
                pc, clock = post(r, dec, pc, clock)
            elif code == _SHARD:  # posted after the host's own time; the host goes on
                clock += d[4]
                comm.shard(r, d[3], d[2], clock)
                if record:
                    self.events.append(Event(r, instrs[pc], clock, clock))
                pc += 1
            else:  # a collective: ALLREDUCE, or OPT (its grad-norm collective, or its rank's alone)
                is_opt = code == _OPT
                # the host's waits before it arrives (shard instructions; under buffered, all-reduces in flight)
                keys = d[4][waits_index]
                missing = next((key for key in keys if key not in done), None)
                if missing is not None:
                    self._park(r, pc, clock, wait, compute, held, held_bytes, peak, peak_bytes, missing)
                    return
                ready = max([clock, *(done[key] for key in keys)])
                ckey = d[5]
                if not self.arrived[r]:
                    arrive = comm.ready(r, ready, is_opt)
                    if arrive is None:  # blocked before it can arrive
                        self._park(r, pc, clock, wait, compute, held, held_bytes, peak, peak_bytes)
                        return
                    arrive += d[6]  # the host's own time before it arrives
                    self.arrived[r] = True
                    self.blocked_on[r] = ckey
                    if not comm.arrive(r, ckey, self.members(d[1], r), d[2], arrive, is_opt):
                        # posted: the host goes on at once
                        self.arrived[r] = False
                        self.blocked_on[r] = None
                        wait += arrive - d[6] - clock
                        if record:
                            self.event(r, pc, arrive, arrive, clock + d[6])
                        clock = arrive
                        pc += 1
                        continue
                t = done.get(ckey)
                if t is None:
                    self._park(r, pc, clock, wait, compute, held, held_bytes, peak, peak_bytes, ckey)
                    return
                self.arrived[r] = False
                self.blocked_on[r] = None
                # from clock to end the rank waits, but for its own time (the host's, not a wait)
                end = t if t > clock + d[6] else clock + d[6]
                wait += end - clock - d[6]
                start = end
                if is_opt:  # the optimizer step itself is compute
                    compute += d[3]
                    end += d[3]
                if record:
                    self.event(r, pc, start, end, clock + d[6])
                clock = end
                pc += 1
        self._park(r, pc, clock, wait, compute, held, held_bytes, peak, peak_bytes)
        self.blocked_on[r] = None

    def _park(self, r: int, pc: int, clock: float, wait: float, compute: float, held: int, held_bytes: int,
              peak: int, peak_bytes: int, on=None) -> None:
        """Where rank r stopped and its running sums (:meth:`advance` keeps them in locals); blocked ``on`` a key
        until it resolves, if given."""
        self.pc[r], self.clock[r] = pc, clock
        self.wait[r], self.compute[r] = wait, compute
        self.in_flight[r], self.in_flight_bytes[r] = held, held_bytes
        self.peak[r], self.peak_bytes[r] = peak, peak_bytes
        if on is not None:
            self.block(r, on)

    def run(self) -> Execution:
        runnable = self.runnable
        advance = self.advance
        while runnable:
            advance(runnable.popleft())
        stuck = [r for r in range(self.P) if self.pc[r] < len(self.dec[r])]
        if stuck or self.comm.unfinished():
            raise Deadlock(self.comm.name, self.explain())
        return Execution(
            model=self.comm.name,
            step_time=max(self.clock + self.comm.end_times(), default=0.0),
            compute=tuple(self.compute),
            comm_wait=tuple(self.wait),
            peak_activations=tuple(self.peak),
            peak_activation_bytes=tuple(self.peak_bytes),
            events=tuple(self.events),
        )

    # ------------------------------------------------------------------ deadlock reports

    def explain(self) -> list[str]:
        """One line per rank of the wait-for cycle (or of every waiting rank if there is none)."""
        waits: dict[int, tuple[str, int | None]] = {}
        for r in range(self.P):
            line, other = self.describe(r)
            if line is not None:
                waits[r] = (line, other)
        cycle = _find_cycle({r: o for r, (_, o) in waits.items() if o is not None})
        chosen = cycle if cycle else sorted(waits)
        return [f"rank {r}: {waits[r][0]}" for r in chosen]

    def message_text(self, key: int, send: bool) -> tuple[str, int]:
        """The post of a message key, and the rank at its other end."""
        kind, src, dst, m = self.keys.describe(key)
        text = _message_text(kind, src, dst, m, self.placement, send)
        # the other end: the receiver of a send, the sender of a receive
        sender = self.placement[src] if kind == "A" else self.placement[dst]
        receiver = self.placement[dst] if kind == "A" else self.placement[src]
        return text, (receiver if send else sender)

    def describe(self, r: int) -> tuple[str | None, int | None]:
        """What rank r waits for, and which rank should provide it."""
        instrs = self.program.ranks[r]
        pc = self.pc[r]
        here = f"{instrs[pc].text()} (instruction {pc})" if pc < len(instrs) else "end of program"
        got = self.comm.describe(r, here)
        if got is not None:
            return got
        key = self.blocked_on[r]
        if key is None:
            return None, None
        if isinstance(key, int):
            kind, a, _b, m = self.keys.describe(key)
            if kind in ("F", "B"):
                return f"{here} waits for {kind}{a}.{m}, which comes later on the same rank", r
            text, sender = self.message_text(key, False)
            return f"{here} waits for {text}, which rank {sender} has not sent", sender
        if key[0] == "S":  # ("S", rank, pc): a shard instruction on this rank's dp lane
            return f"{here} waits for {instrs[key[2]].text()} (instruction {key[2]}) to complete", r
        group = key[1]  # ("C", group, k): a collective (this rank's, or an all-reduce it waits for)
        members = self.members(group, r)
        arrived = self.comm.arrived(key)
        waiting = [x for x in members if x != r and x not in arrived and self.blocked_on[x] != key]
        other = waiting[0] if waiting else None
        name = "OPT's grad-norm collective" if group == OPTIM_GROUP else f"collective {group} #{key[2]}"
        who = f", which rank {other} has not reached" if other is not None else ""
        return f"{here} waits in {name}{who}", other


def _find_cycle(edges: Mapping[int, int]) -> list[int]:
    """A cycle in the wait-for graph (each rank waits for at most one other)."""
    if not edges:
        return []
    import networkx as nx  # off the fast path: only for deadlock reports

    try:
        cyc = nx.find_cycle(nx.DiGraph(list(edges.items())))
    except nx.NetworkXNoCycle:
        return []
    return [u for u, _ in cyc]


def execute(
    program: Program,
    *,
    placement: Sequence[int],
    num_microbatches: int,
    edges: Sequence[Edge],
    costs: CostModel,
    model: str = BUFFERED,
    ties: Sequence[Tie] = (),
    decoded: Decoded | None = None,
    record_events: bool = True,
    rng: random.Random | None = None,
) -> Execution:
    """Run the event loop; raises :class:`Deadlock` if the program cannot finish. With ``rng``, each cost
    :attr:`CostModel.jitter` covers is drawn from its samples (:func:`drawn`); without, every cost is fixed."""
    if model not in _COMM_MODELS:
        raise ValueError(f"unknown comm model {model!r}; expected one of {', '.join(MODELS)}")
    if decoded is None:
        decoded = decode(program, placement=placement, num_microbatches=num_microbatches, edges=edges, costs=costs)
    spread = spreads(costs)
    if rng is not None and (costs.jitter or spread or costs.hop_spread or costs.overhead_spread or costs.hop_draws
                            or costs.overhead_draws or costs.collective_draws):
        decoded = drawn(decoded, program, costs.jitter, rng, spread=spread, host_spread=costs.host_spread or 0.0,
                        hop_spread=costs.hop_spread, levels=levels(costs) if spread else (),
                        overhead_spread=costs.overhead_spread, hop_draws=costs.hop_draws,
                        overhead_draws=costs.overhead_draws, collective_draws=costs.collective_draws)
    sharing = costs.sharing
    ex = _Engine(program, decoded, placement, ties, model, record_events or sharing is not None).run()
    return ex if sharing is None else _shared(program, decoded, placement, ties, model, record_events, sharing, ex)


def levels(costs: CostModel) -> tuple[tuple[float, float], ...]:
    """Per stage, its (:attr:`Cost.level_spread`, :attr:`Cost.crowd_spread`), 0 where not measured."""
    return tuple((c.level_spread or 0.0, c.crowd_spread or 0.0) for c in costs.stages)


def spreads(costs: CostModel) -> tuple[float, ...]:
    """Every stage's :attr:`Cost.spread` (a relative standard deviation), or ``()`` unless every stage has one: a
    run over costs of which some were never timed draws none of them."""
    out = tuple(c.spread for c in costs.stages)
    return () if not out or None in out else out  # type: ignore[return-value]


def _shared(program: Program, decoded: Decoded, placement: Sequence[int], ties: Sequence[Tie], model: str,
            record_events: bool, sharing: Sharing, ex: Execution) -> Execution:
    """The run under processor sharing (:mod:`pipec.compiler.sim.contention`): the loop re-run with every compute's
    duration scaled until the scales settle (``ex``: the run at the costs as they are)."""
    where = [(r, pc) for r, dec in enumerate(decoded.ranks) for pc, d in enumerate(dec) if d[0] == _COMPUTE and d[2] > 0]
    keys = [(r, program.ranks[r][pc]) for r, pc in where]
    ops = [ins.op.value for _, ins in keys]
    scales = [1.0] * len(where)
    for _ in range(ITERATIONS):
        span = {(e.rank, e.ins): (e.start, e.end) for e in ex.events if not e.wait}
        new = sharing.scales([(r, op, *span[key]) for (r, _), op, key in zip(where, ops, keys)], scales)
        settled = all(abs(a - b) <= TOLERANCE * b for a, b in zip(new, scales))
        scales = new
        ranks = [list(dec) for dec in decoded.ranks]
        for (r, pc), f in zip(where, scales):
            d = ranks[r][pc]
            ranks[r][pc] = d[:2] + (d[2] * f,) + d[3:]
        ex = _Engine(program, replace(decoded, ranks=tuple(map(tuple, ranks))), placement, ties, model, True).run()
        if settled:
            break
    return ex if record_events else replace(ex, events=())
