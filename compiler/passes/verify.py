"""The verifier: the four proofs of DESIGN for any program, hand-edited ones included.

1. **Work and dependencies.** Every (stage, microbatch) has exactly one
   ``FWD`` and one backward (``BWD``, or ``BWD_I`` then ``BWD_W``) on the rank
   that owns the stage. A forward comes after its producers' forwards (on the
   same rank) or after the receive of their output (posted earlier on this
   rank); a backward after its own forward and its consumers' backwards (or
   the receive of their grads); a send after the compute that makes its data.
2. **Matching.** Every send has exactly one receive: same edge, microbatch and
   peers, and equal signatures at both ends; between two ranks, in each
   direction, sends and receives are posted in the same order (gloo and NCCL
   match a pair's messages first-in, first-out, so another order would deliver
   the wrong tensor silently).
3. **No deadlock** under the ``buffered`` and the ``in_order`` comm model
   (see :mod:`pipec.compiler.sim.simulate`); a deadlock is reported as the cycle
   of waiting instructions, one line per rank.
4. **Collectives.** ``ALLREDUCE`` of a stage comes after its last backward;
   with dp > 1 every stage is reduced over dp exactly once; every tie group
   spanning several ranks is reduced once on each; members of a group issue
   their collectives in the same order; ``OPTIM_STEP`` ends every program.
5. **Sharding** (the mesh's ``shard`` is ``grads`` or ``full``). Every compute
   of a stage runs inside an unshard window of that stage (``UN<s>`` before
   it, no ``RE<s>`` between), windows open and close in pairs and are closed
   by the step's end; every shard instruction names the mesh's shard group.
   ``REDUCE_SCATTER`` replaces the stage's ``AR<s>:dp``: once, after its last
   backward; under HSDP ``AR<s>:dp.replicate`` once, after it; a tie
   all-reduce runs on the gradient shards, after the ``RS`` of every stage of
   its rank that holds the weight. Members of a shard group are the dp
   replicas of one pp rank, which run one program, so they issue the group's
   collectives in one order; members of a tie group (on the shards) are on
   several pp ranks, and proof 4 checks their order, the ``RS`` before it
   included: a tie all-reduce on one rank's full gradients and another's
   shards would mismatch. No deadlock (proof 3) covers the shard
   instructions under both comm models.

6. **Tensor parallelism** (tp > 1). Every member of a tp group is mapped to
   the same pp rank's program and the same dp rank (so all of them run one
   program and meet in the same collectives), the tp groups cut the world
   into disjoint groups of tp ranks, and the groups a rank's instructions
   name keep its tp rank: its pp peers (sends, receives, tie groups, the grad
   clip) and its dp groups (all-reduce, shard groups) are the ranks of the
   same tp rank.
   The mesh arithmetic is affine in each coordinate, so it is checked on every
   coordinate of an axis of up to 16, and on its ends and their neighbours
   beyond.

Errors name the rank and the instruction: ``rank 2, instruction 17 (F1.3):
needs RA1.3<0@0 posted earlier on rank 2``.

One pass over the program builds an :class:`_Index` (where every forward,
backward, send, receive and collective is), checking on the way what a single
instruction must satisfy by itself (its stage is on its rank, a post names an
edge and the right peer, a group exists, nothing comes twice); each proof is
then one function over that index (:data:`PROOFS`). Each reports its first
broken obligation with its place in the report order (:data:`Violation`), and
the earliest is raised: of several mistakes, the first in program order, so a
hand edit is fixed from the top. Proof 3 runs only on a program the others
accept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from pipec.compiler.ir.program import Instruction, Op, Program
from pipec.compiler.ir.plan import Edge, Mesh, Plan, Stage, Tie
from pipec.compiler.sim.cost import CostModel
from pipec.compiler.sim.engine import BUFFERED, MODELS, Deadlock, Execution, decode, execute
from pipec.compiler.sim.simulate import plan_costs
from pipec.errors import PipecError

__all__ = ["VerifyError", "Proof", "verify", "verify_program", "prove_tp"]


class VerifyError(PipecError):
    """The plan breaks a proof obligation; the message names the rank and instruction."""


@dataclass(frozen=True, slots=True)
class Proof:
    """A verified program, with its execution under each comm model."""

    executions: Mapping[str, Execution]


def _at(rank: int, index: int, ins: Instruction) -> str:
    return f"rank {rank}, instruction {index} ({ins.text()})"


Where = tuple[int, int]
"""(rank, index) of an instruction."""

Violation = tuple[tuple[int, int, float], str]
"""A broken obligation: its place in the report order, (phase, rank, index), and the message.
Phase 0 is program order (an instruction, or ``index = inf`` for the end of a rank); then a missing
compute (1), a message without its other end (2), collectives out of order (3)."""

END = float("inf")
"""The index of "after the rank's last instruction"."""


def _at_ins(r: int, i: int, ins: Instruction, text: str) -> Violation:
    return (0, r, i), f"{_at(r, i, ins)}: {text}"


@dataclass(slots=True, kw_only=True)
class _Index:
    """Where everything a program does is, by integer key (built once by :func:`_build_index`).

    Keys: ``s*M+m`` for a (stage, microbatch); ``(src*S+dst)*M+m`` for a message on edge
    src->dst, plus ``S*S*M`` for its grad.
    """

    program: Program
    placement: Sequence[int]
    num_microbatches: int
    dp: int
    mesh: Mesh
    ties: dict[str, Tie]
    """``tie.<name>`` -> its tie group."""
    producers: list[list[int]]
    consumers: list[list[int]]
    edge_keys: set[int]
    """``src*S+dst`` of every stage-graph edge."""
    num_stages: int
    fwd: dict[int, Where] = field(default_factory=dict)
    bwd: dict[int, Where] = field(default_factory=dict)
    """Full or input-grad backwards."""
    inp: dict[int, Where] = field(default_factory=dict)
    """Input-grad backwards (their W must follow)."""
    wgt: dict[int, Where] = field(default_factory=dict)
    sent: dict[int, Where] = field(default_factory=dict)
    received: dict[int, Where] = field(default_factory=dict)
    order_out: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    """(a, b) -> message keys rank a sends rank b, in order."""
    order_in: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    """(a, b) -> message keys rank b receives from rank a, in order."""
    last_backward: dict[int, int] = field(default_factory=dict)
    """Stage -> index (on its rank) of its last completing backward (B or W)."""
    num_backwards: dict[int, int] = field(default_factory=dict)
    allreduces: list[list[tuple[int, str, int]]] = field(default_factory=list)
    """Per rank: (index, group, stage) of each ALLREDUCE, in order."""
    collectives: list[list[str]] = field(default_factory=list)
    """Per rank: the groups of its tie all-reduces and OPT's pp collective, in order."""
    scattered: list[dict[int, int]] = field(default_factory=list)
    """Per rank: stage -> index of its REDUCE_SCATTER."""
    unsharded: dict[int, int] = field(default_factory=dict)
    """While indexing a rank: stage -> index of the UNSHARD of its open window."""
    broken: Violation | None = None
    """What stopped the build: the first instruction (program order) that is wrong by itself.
    The index holds everything before it, which is all the proofs of earlier instructions read."""

    def ins(self, where: Where) -> Instruction:
        return self.program.ranks[where[0]][where[1]]

    def at(self, where: Where) -> str:
        return _at(where[0], where[1], self.ins(where))

    def violation(self, where: Where, text: str) -> Violation:
        """A broken obligation of the instruction at ``where``."""
        return _at_ins(where[0], where[1], self.ins(where), text)


# ----------------------------------------------------------------------------- the index (and per-instruction checks)


class _Broken(PipecError):
    """Stops the index build at an instruction that is wrong by itself (internal: never escapes)."""

    def __init__(self, violation: Violation) -> None:
        super().__init__()
        self.violation = violation


def _broken(r: int, i: int, ins: Instruction, text: str) -> _Broken:
    return _Broken(_at_ins(r, i, ins, text))


def _twice(first: Where, r: int, i: int, ins: Instruction, what: str) -> _Broken:
    return _broken(r, i, ins, f"second {what} of stage {ins.stage} microbatch {ins.microbatch} "
                              f"(the first is rank {first[0]}, instruction {first[1]})")


def _indexers(ix: _Index) -> dict[Op, Callable[[int, int, Instruction], None]]:
    """Per opcode: what one instruction adds to the index, and what it must satisfy by itself.
    (Closures over the index's tables: this runs once per instruction.) OPT is handled by
    :func:`_build_index`: it ends every program."""
    S, M, placement = ix.num_stages, ix.num_microbatches, ix.placement
    G = S * S * M
    fwd, bwd, inp, wgt, sent, received = ix.fwd, ix.bwd, ix.inp, ix.wgt, ix.sent, ix.received
    last_backward, num_backwards, edge_keys = ix.last_backward, ix.num_backwards, ix.edge_keys
    windows, group, unsharded = ix.mesh.params_sharded, ix.mesh.shard_group, ix.unsharded

    def compute(table: dict[int, Where], what: str, *, completes: bool,
                also: dict[int, Where] | None = None) -> Callable[[int, int, Instruction], None]:
        """A compute: once per (stage, microbatch) in ``table`` (and ``also``); ``completes``: the
        stage's last backward part (B or W), which its all-reduce must follow."""

        def index(r: int, i: int, ins: Instruction) -> None:
            s = ins.stage
            sm = s * M + ins.microbatch
            if sm in table:
                raise _twice(table[sm], r, i, ins, what)
            if windows and s not in unsharded:
                raise _broken(r, i, ins, f"runs outside an unshard window: stage {s}'s parameters are sharded "
                                         f"(shard {ix.mesh.shard}); post UN{s}:{group} before it, with no "
                                         f"RE{s}:{group} between")
            table[sm] = (r, i)
            if also is not None:
                also[sm] = (r, i)
            if completes:
                last_backward[s] = i
                num_backwards[s] = num_backwards.get(s, 0) + 1

        return index

    def poster(is_send: bool, is_act: bool) -> Callable[[int, int, Instruction], None]:
        """A send or receive: on an edge of the stage graph, to the rank holding the other stage,
        not to itself; once. ``message_edge`` inlined, one closure per opcode."""
        table, order, what = (sent, ix.order_out, "send") if is_send else (received, ix.order_in, "receive")
        offset = 0 if is_act else G
        # the other stage is downstream for an activation send or a grad receive
        downstream = is_send == is_act

        def post(r: int, i: int, ins: Instruction) -> None:
            s = ins.stage
            other = ins.to_stage if is_send else ins.from_stage
            src, dst = (s, other) if downstream else (other, s)
            if src * S + dst not in edge_keys:
                raise _broken(r, i, ins, f"there is no edge {src}->{dst} in the stage graph")
            peer = ins.peer
            if peer != placement[other]:
                raise _broken(r, i, ins, f"stage {other} is on rank {placement[other]}, "
                                  f"but the peer is {peer}")
            if peer == r:
                raise _broken(r, i, ins, f"stages {src} and {dst} are both on rank {r}; "
                                  "pass the tensor locally instead of a send to self")
            key = (src * S + dst) * M + ins.microbatch + offset
            if key in table:
                raise _twice(table[key], r, i, ins, what)
            table[key] = (r, i)
            pair = (r, peer) if is_send else (peer, r)
            keys = order.get(pair)
            if keys is None:
                order[pair] = [key]
            else:
                keys.append(key)

        return post

    def allreduce(r: int, i: int, ins: Instruction) -> None:
        """Over dp (HSDP: dp.replicate), or over a tie group that holds a copy on its stage."""
        group, s = ins.group, ins.stage
        want = "dp.replicate" if ix.mesh.hybrid and windows else "dp"
        if group.startswith("dp") and group != want:
            why = (f"under shard {ix.mesh.shard} gradients are reduce-scattered: RS{s}:{ix.mesh.shard_group} "
                   f"replaces AR{s}:dp" + (f", then AR{s}:dp.replicate" if ix.mesh.hybrid else "")
                   if windows else f"the mesh has no group {group} (shard {ix.mesh.shard}"
                   f"{'' if ix.mesh.shard_size is None else f', shard_size {ix.mesh.shard_size}'})")
            raise _broken(r, i, ins, f"{why}; write AR{s}:{want}" if not windows or ix.mesh.hybrid else why)
        if not group.startswith("dp"):
            tie = ix.ties.get(group)
            if tie is None:
                known = ", ".join(sorted(ix.ties)) or "none"
                raise _broken(r, i, ins, f"unknown group {group!r} (tie groups: {known})")
            if s not in tie.stages:
                raise _broken(r, i, ins, f"stage {s} holds no copy of tied weight {group[4:]!r}")
            ix.collectives[r].append(group)
        ix.allreduces[r].append((i, group, s))

    return {Op.FWD: compute(fwd, "forward", completes=False), Op.BWD: compute(bwd, "backward", completes=True),
            Op.BWD_I: compute(bwd, "backward", completes=False, also=inp),
            Op.BWD_W: compute(wgt, "weight-grad backward", completes=True),
            Op.SEND_ACT: poster(True, True), Op.RECV_ACT: poster(False, True), Op.SEND_GRAD: poster(True, False),
            Op.RECV_GRAD: poster(False, False), Op.ALLREDUCE: allreduce, **_shard_indexers(ix)}


def _shard_indexers(ix: _Index) -> dict[Op, Callable[[int, int, Instruction], None]]:
    """UNSHARD opens a stage's window, RESHARD closes it, REDUCE_SCATTER comes once per stage; all on the
    mesh's shard group, and only on a mesh that shards parameters."""
    mesh, unsharded = ix.mesh, ix.unsharded

    def checked(r: int, i: int, ins: Instruction) -> None:
        if not mesh.params_sharded:
            raise _broken(r, i, ins, f"the mesh does not shard parameters (shard {mesh.shard}, dp {mesh.dp}); "
                                     "only shard grads or full gather and scatter them")
        if ins.group != mesh.shard_group:
            raise _broken(r, i, ins, f"stage {ins.stage} is sharded over {mesh.shard_group}, not {ins.group}; "
                                     f"write {ins.text().split(':')[0]}:{mesh.shard_group}")

    def unshard(r: int, i: int, ins: Instruction) -> None:
        checked(r, i, ins)
        if ins.stage in unsharded:
            raise _broken(r, i, ins, f"stage {ins.stage} is already unsharded (by instruction "
                                     f"{unsharded[ins.stage]}); reshard it first, or drop this UNSHARD")
        unsharded[ins.stage] = i

    def reshard(r: int, i: int, ins: Instruction) -> None:
        checked(r, i, ins)
        if unsharded.pop(ins.stage, None) is None:
            raise _broken(r, i, ins, f"stage {ins.stage} is not unsharded here; a RESHARD closes the window "
                                     f"an UN{ins.stage}:{ins.group} opened")

    def scatter(r: int, i: int, ins: Instruction) -> None:
        checked(r, i, ins)
        done = ix.scattered[r]
        if ins.stage in done:
            raise _broken(r, i, ins, f"second reduce-scatter of stage {ins.stage} (the first is instruction "
                                     f"{done[ins.stage]})")
        done[ins.stage] = i

    return {Op.UNSHARD: unshard, Op.RESHARD: reshard, Op.REDUCE_SCATTER: scatter}


def _build_index(program: Program, placement: Sequence[int], num_microbatches: int, edges: Sequence[Edge],
                 ties: Sequence[Tie], mesh: Mesh) -> _Index:
    """One pass over the program: the index, and every per-instruction check (stage placed on this
    rank, batches adjacent, OPT last, nothing twice, posts on real edges, known groups)."""
    P = program.num_ranks
    S = len(placement)
    if S and max(placement) >= P:
        raise VerifyError(f"placement names pp rank {max(placement)}, but the program has {P} ranks")
    edge_set = {(e.src_stage, e.dst_stage) for e in edges}
    producers: list[list[int]] = [[] for _ in range(S)]
    consumers: list[list[int]] = [[] for _ in range(S)]
    for src, dst in edge_set:
        producers[dst].append(src)
        consumers[src].append(dst)
    ix = _Index(program=program, placement=placement, num_microbatches=num_microbatches, dp=mesh.dp, mesh=mesh,
                ties={f"tie.{t.name}": t for t in ties}, producers=producers, consumers=consumers,
                edge_keys={src * S + dst for src, dst in edge_set}, num_stages=S)
    try:
        _index_ranks(ix, _indexers(ix))
    except _Broken as e:
        ix.broken = e.violation
    return ix


def _index_ranks(ix: _Index, indexers: dict[Op, Callable[[int, int, Instruction], None]]) -> None:
    placement = ix.placement
    for r, instrs in enumerate(ix.program.ranks):
        ix.allreduces.append([])
        ix.collectives.append([])
        ix.scattered.append({})
        ix.unsharded.clear()
        last_batch, closed = None, set()
        n = len(instrs)
        for i, ins in enumerate(instrs):
            batch = ins.batch
            if batch != last_batch:
                if batch is not None and batch in closed:
                    raise _broken(r, i, ins, f"batch {batch} is split; posts of one batch must be adjacent")
                if last_batch is not None:
                    closed.add(last_batch)
                last_batch = batch
            op = ins.op
            if op is Op.OPTIM_STEP:
                if i != n - 1:
                    raise _broken(r, i, ins, "OPT must be the last instruction of the step")
                if ix.unsharded:
                    s = min(ix.unsharded)
                    raise _broken(r, i, ins, f"stage {s} is still unsharded at the step's end (since instruction "
                                             f"{ix.unsharded[s]}); add RE{s}:{ix.mesh.shard_group} after its "
                                             "last compute")
                ix.collectives[r].append("pp")
                continue
            s = ins.stage
            if placement[s] != r:
                raise _broken(r, i, ins, f"stage {s} is placed on rank {placement[s]}, not here")
            indexers[op](r, i, ins)
        if not instrs or instrs[-1].op is not Op.OPTIM_STEP:
            raise _Broken(((0, r, END), f"rank {r}: the program must end with OPT (the optimizer step)"))


# ----------------------------------------------------------------------------- proof 1: work and dependencies


Need = tuple[dict[int, Where], int, str]
"""Something a compute needs earlier on its rank: (index table, its key at microbatch 0, the
complaint when it is missing, with ``{m}`` left to fill)."""


def _needs(ix: _Index) -> dict[str, list[tuple[Need, ...]]]:
    """Proof 1's rules, per compute kind and stage: what each needs earlier on its rank, in the order
    they are checked. A neighbour on the same rank gives its compute; one elsewhere its message."""
    S, M, placement = ix.num_stages, ix.num_microbatches, ix.placement
    G = S * S * M

    def forward(s: int) -> tuple[Need, ...]:
        r = placement[s]
        return tuple((ix.fwd, o * M, f"needs F{o}.{{m}} earlier on rank {r}") if placement[o] == r else
                     (ix.received, (o * S + s) * M, f"needs RA{s}.{{m}}<{o}@{placement[o]} earlier on rank {r}")
                     for o in ix.producers[s])

    def backward(s: int) -> tuple[Need, ...]:
        r = placement[s]
        return ((ix.fwd, s * M, f"backward before its forward F{s}.{{m}}"),) + tuple(
            (ix.bwd, o * M, f"needs B{o}.{{m}} (or I{o}.{{m}}) earlier on rank {r}") if placement[o] == r else
            (ix.received, (s * S + o) * M + G, f"needs RG{s}.{{m}}<{o}@{placement[o]} earlier on rank {r}")
            for o in ix.consumers[s])

    def weight_grad(s: int) -> tuple[Need, ...]:
        return ((ix.inp, s * M, f"weight-grad W needs I{s}.{{m}} earlier on rank {placement[s]}"),)

    return {kind: [rule(s) for s in range(S)] for kind, rule in
            (("F", forward), ("B", backward), ("W", weight_grad))}


Violation = tuple[Where, str]
"""A broken obligation: where, and the complaint."""


def _check_needs(ix: _Index, table: dict[int, Where], needs: list[tuple[Need, ...]]) -> Violation | None:
    """The first compute in ``table`` (program order) that comes before something it needs (``needs[stage]``)."""
    M = ix.num_microbatches
    for sm, (r, i) in table.items():
        s, m = divmod(sm, M)
        for where, key, text in needs[s]:
            got = where.get(key + m)
            if got is None or got[1] > i:
                return ix.violation((r, i), text.format(m=m))
    return None


def _check_sends(ix: _Index) -> Violation | None:
    """The first send (program order) before the compute that makes its data: F of its stage, or its B (or I)."""
    S, M = ix.num_stages, ix.num_microbatches
    G = S * S * M
    for key, (r, i) in ix.sent.items():
        if key < G:  # an activation: sent by the edge's source
            edge, m = divmod(key, M)
            s, table = edge // S, ix.fwd
        else:        # a grad: sent by the edge's destination
            edge, m = divmod(key - G, M)
            s, table = edge % S, ix.bwd
        got = table.get(s * M + m)
        if got is None or got[1] > i:
            what = f"F{s}.{m}" if key < G else f"B{s}.{m} (or I{s}.{m})"
            return ix.violation((r, i), f"sends data that {what} makes, which has not run yet on rank {r}")
    return None


def _prove_work(ix: _Index) -> Violation | None:
    """Proof 1: one forward and one backward per (stage, microbatch), each after what it needs."""
    needs = _needs(ix)
    found = [v for v in (*(_check_needs(ix, table, needs[kind]) for kind, table in
                           (("F", ix.fwd), ("B", ix.bwd), ("W", ix.wgt))), _check_sends(ix)) if v is not None]
    if found or ix.broken is not None:  # a partial index: what is missing may come after the break
        return min(found, default=None)
    S, M = ix.num_stages, ix.num_microbatches
    if len(ix.fwd) == S * M and len(ix.bwd) == S * M and len(ix.wgt) == len(ix.inp):
        return None
    for s in range(S):
        for m in range(M):
            sm = s * M + m
            missing = (f"has no forward F{s}.{m}" if sm not in ix.fwd else
                       f"has no backward B{s}.{m}" if sm not in ix.bwd else
                       f"has I{s}.{m} but no W{s}.{m}" if sm in ix.inp and sm not in ix.wgt else None)
            if missing:
                return (1, 0, 0), f"rank {ix.placement[s]}: stage {s} microbatch {m} {missing}"
    return None


# ----------------------------------------------------------------------------- proof 2: matching


def _check_signatures(stages: Sequence[Stage], edges: Sequence[Edge]) -> None:
    """Both ends of an edge agree on what crosses it."""
    if not stages or not any(st.inputs or st.outputs for st in stages):
        return
    for e in edges:
        outs = {sig.name: sig for sig in stages[e.src_stage].outputs}
        ins = {sig.name: sig for sig in stages[e.dst_stage].inputs}
        for sig in e.tensors:
            for side, table, stage in (("outputs", outs, e.src_stage), ("inputs", ins, e.dst_stage)):
                got = table.get(sig.name)
                if got is None or got.shape != sig.shape or got.dtype != sig.dtype:
                    have = "missing" if got is None else f"{got.dtype}{list(got.shape)}"
                    raise VerifyError(
                        f"edge {e.src_stage}->{e.dst_stage}: tensor {sig.name!r} is {sig.dtype}{list(sig.shape)} "
                        f"on the edge but {have} in stage {stage}'s {side}; the two ends must agree"
                    )


def _prove_matching(ix: _Index) -> Violation | None:
    """Proof 2: every send has one receive and the reverse; each directed pair posts them in one order."""
    for key, where in ix.sent.items():
        if key not in ix.received:
            return (2, 0, 0), f"{ix.at(where)}: no rank posts the matching receive"
    for key, where in ix.received.items():
        if key not in ix.sent:
            return (2, 0, 0), f"{ix.at(where)}: no rank posts the matching send"
    for pair, outs in ix.order_out.items():
        ins_order = ix.order_in.get(pair, [])
        if outs != ins_order:
            k = next(j for j, (a, b) in enumerate(zip(outs, ins_order)) if a != b)
            return (2, 0, 0), (
                f"{ix.at(ix.sent[outs[k]])} is send #{k} from rank {pair[0]} to rank {pair[1]}, but "
                f"receive #{k} there is {ix.at(ix.received[ins_order[k]])}: the two ranks post them in different "
                "orders, and gloo and NCCL match a pair's messages first-in, first-out")
    return None


# ----------------------------------------------------------------------------- proof 4: collectives


def _after_backwards(ix: _Index, r: int, i: int, group: str, s: int) -> Violation | None:
    """An all-reduce comes after the last backward of every stage whose grads it reduces."""
    M = ix.num_microbatches
    dp_group = group.startswith("dp")
    stages = (s,) if dp_group else tuple(ts for ts in ix.ties[group].stages if ix.placement[ts] == r)
    for ts in stages:
        if ix.num_backwards.get(ts, 0) == M and ix.last_backward[ts] < i:
            continue
        if not dp_group:
            return ix.violation((r, i), f"comes before the last backward of stage {ts}, which holds "
                                        f"a copy of {group[4:]!r}")
        done = sum(1 for x in ix.program.ranks[r][:i] if x.stage == ts and (x.op is Op.BWD or x.op is Op.BWD_W))
        return ix.violation((r, i), f"comes before the last backward of stage {ts} "
                                    f"({done} of {M} done); its grads would be incomplete")
    return None


def _rank_reductions(ix: _Index, r: int) -> Violation | None:
    """Rank r's all-reduces: each after its backwards and once; every stage over dp, every spanning tie."""
    reduced: set[tuple[str, int]] = set()
    scattered = ix.scattered[r]
    sharded = ix.mesh.params_sharded
    for s, i in scattered.items():
        late = _after_backwards(ix, r, i, "dp", s)
        if late is not None:
            return late
    for i, group, s in ix.allreduces[r]:
        late = _after_backwards(ix, r, i, group, s) or (_after_scatter(ix, r, i, group, s) if sharded else None)
        if late is not None:
            return late
        key = (group, s if group.startswith("dp") else -1)
        if key in reduced:
            return ix.violation((r, i), f"second all-reduce of {group if key[1] < 0 else 'stage %d' % s}")
        reduced.add(key)
    for s in (st for st in range(ix.num_stages) if ix.placement[st] == r):
        if ix.dp < 2:
            continue
        group = ix.mesh.shard_group
        if sharded and s not in scattered:
            return (0, r, END), (f"rank {r}: stage {s} is never reduce-scattered over {group} (shard "
                                 f"{ix.mesh.shard}); add RS{s}:{group} after its last backward")
        want = "dp.replicate" if sharded and ix.mesh.hybrid else None if sharded else "dp"
        if want is not None and (want, s) not in reduced:
            return (0, r, END), (f"rank {r}: stage {s} is never all-reduced over {want} (dp={ix.dp}); "
                                 f"add AR{s}:{want} after its "
                                 + (f"RS{s}:{group}" if sharded else "last backward"))
    for name, tie in ix.ties.items():
        ranks_of_tie = tie.ranks(ix.placement)
        if r in ranks_of_tie and len(ranks_of_tie) > 1 and (name, -1) not in reduced:
            return (0, r, END), (f"rank {r}: tied weight {tie.name!r} is never all-reduced over its tie group; "
                                 "the copies would drift")
    return None


def _after_scatter(ix: _Index, r: int, i: int, group: str, s: int) -> Violation | None:
    """Under sharding, an all-reduce (HSDP's replicate one, a tie's) runs on gradient shards: after the
    ``RS`` of every stage of its rank whose grads it reduces."""
    stages = (s,) if group.startswith("dp") else tuple(ts for ts in ix.ties[group].stages if ix.placement[ts] == r)
    for ts in stages:
        at = ix.scattered[r].get(ts)
        if at is None or at > i:
            return ix.violation((r, i), f"runs on the gradient shards, so after RS{ts}:{ix.mesh.shard_group}; "
                                        f"stage {ts}'s gradients are not reduce-scattered yet, and the members "
                                        "would reduce tensors of different sizes")
    return None


def _collective_order(ix: _Index) -> Violation | None:
    """Members of a group issue their collectives in the same order (any two ranks sharing groups)."""
    members: dict[str, set[int]] = {g: set(t.ranks(ix.placement)) for g, t in ix.ties.items()}
    members["pp"] = set(range(ix.program.num_ranks))
    involved = sorted({r for g, ms in members.items() if g != "pp" and len(ms) > 1 for r in ms})
    for a_i, a in enumerate(involved):
        for b in involved[a_i + 1:]:
            shared = {g for g, ms in members.items() if a in ms and b in ms}
            seq_a = [g for g in ix.collectives[a] if g in shared]
            seq_b = [g for g in ix.collectives[b] if g in shared]
            if seq_a != seq_b:
                return (3, 0, 0), (f"ranks {a} and {b} issue their shared collectives in different orders: "
                                   f"rank {a}: {', '.join(seq_a)}; rank {b}: {', '.join(seq_b)}")
    return None


def _prove_collectives(ix: _Index) -> Violation | None:
    """Proof 4: all-reduces after the backwards, once each, none missing; groups agree on their order."""
    for r in range(len(ix.allreduces)):
        got = _rank_reductions(ix, r)
        if got is not None:
            return got
    if ix.broken is not None:
        return None
    return _collective_order(ix)


# ----------------------------------------------------------------------------- proof 3: no deadlock


def _prove_no_deadlock(ix: _Index, edges: Sequence[Edge], costs: CostModel, ties: Sequence[Tie]) -> dict[str, Execution]:
    """Proof 3: the program finishes under every comm model (the simulator's event loop)."""
    kw = dict(placement=ix.placement, num_microbatches=ix.num_microbatches, edges=edges, costs=costs)
    decoded = decode(ix.program, **kw)
    executions = {}
    for model in MODELS:
        try:
            executions[model] = execute(ix.program, **kw, model=model, ties=ties, decoded=decoded,
                                        record_events=model == BUFFERED)
        except Deadlock as e:
            raise VerifyError(str(e)) from None
    return executions


PROOFS: tuple[Callable[[_Index], Violation | None], ...] = (_prove_work, _prove_matching, _prove_collectives)
"""The proofs over the index; proof 3 (no deadlock) runs once they hold."""


def verify_program(
    program: Program,
    *,
    placement: Sequence[int],
    num_microbatches: int,
    edges: Sequence[Edge],
    costs: CostModel,
    dp: int = 1,
    ties: Sequence[Tie] = (),
    stages: Sequence[Stage] = (),
    mesh: Mesh | None = None,
) -> Proof:
    """Run all four proofs; raise :class:`VerifyError` at the first broken obligation (see the module docstring)."""
    _check_signatures(stages, edges)
    mesh = mesh or Mesh(pp=program.num_ranks, dp=dp)
    ix = _build_index(program, placement, num_microbatches, edges, ties, mesh)
    found = [v for v in (ix.broken, *(prove(ix) for prove in PROOFS)) if v is not None]
    if found:
        raise VerifyError(min(found)[1])
    return Proof(_prove_no_deadlock(ix, edges, costs, ties))


def _axis(n: int) -> list[int]:
    """The coordinates of an axis of size ``n`` the tp proof checks: all up to 16, else the ends and neighbours."""
    return list(range(n)) if n <= 16 else sorted({0, 1, 2, n // 2, n - 3, n - 2, n - 1})


def prove_tp(plan: Plan) -> None:
    """Proof 6 (see the module docstring): tp groups and the groups around them are consistent."""
    mesh = plan.mesh
    if mesh.tp == 1:
        return
    dp_groups = ["dp"] + (["dp.shard", "dp.replicate"] if mesh.hybrid else [])
    for p in _axis(mesh.pp):
        for d in _axis(mesh.dp):
            for t in _axis(mesh.tp):
                g = mesh.global_rank(p, d, t)
                if mesh.coords(g) != (p, d) or mesh.tp_rank(g) != t:
                    raise VerifyError(f"{mesh.where(g)} does not map back to (pp {p}, dp {d}, tp {t})")
                group = mesh.tp_group(g)
                if len(set(group)) != mesh.tp or g not in group:
                    raise VerifyError(f"the tp group of {mesh.where(g)} is {list(group)}: expected {mesh.tp} ranks "
                                      "holding it")
                for m in group:
                    if mesh.coords(m) != (p, d) or mesh.tp_group(m) != group:
                        raise VerifyError(f"tp group {list(group)} of {mesh.where(g)} holds {mesh.where(m)}: every "
                                          f"member must run pp rank {p}'s program as dp rank {d}, in one group")
                for name, members in (("pp", mesh.pp_group(g)),
                                      *((n, mesh.group_ranks(n, g)) for n in dp_groups)):
                    for m in members:
                        if mesh.tp_rank(m) != t:
                            raise VerifyError(f"the {name} group of {mesh.where(g)} holds {mesh.where(m)}, of "
                                              f"another tp rank; its members must all be tp rank {t}")


def verify(plan: Plan) -> Proof:
    """Prove a plan (all the proofs, both comm models); raise :class:`VerifyError` if any fails."""
    if plan.program.num_ranks != plan.mesh.pp:
        raise VerifyError(f"the program has {plan.program.num_ranks} ranks but mesh.pp is {plan.mesh.pp}")
    prove_tp(plan)
    return verify_program(
        plan.program,
        placement=plan.placement,
        num_microbatches=plan.num_microbatches,
        edges=plan.edges,
        costs=plan_costs(plan),
        dp=plan.mesh.dp,
        ties=plan.ties,
        stages=plan.stages,
        mesh=plan.mesh,
    )
