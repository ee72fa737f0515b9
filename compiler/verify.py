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
   (see :mod:`pipec.compiler.simulate`); a deadlock is reported as the cycle
   of waiting instructions, one line per rank.
4. **Collectives.** ``ALLREDUCE`` of a stage comes after its last backward;
   with dp > 1 every stage is reduced over dp exactly once; every tie group
   spanning several ranks is reduced once on each; members of a group issue
   their collectives in the same order; ``OPTIM_STEP`` ends every program.

Errors name the rank and the instruction: ``rank 2, instruction 17 (F1.3):
needs RA1.3<0@0 posted earlier on rank 2``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from pipec.compiler.ir import Instruction, Op, Program, message_edge
from pipec.compiler.plan import Edge, Plan, Stage, Tie
from pipec.compiler.engine import BUFFERED, MODELS, Costs, Deadlock, Execution, decode, execute
from pipec.compiler.simulate import chain_edges, plan_costs
from pipec.errors import PipecError

__all__ = ["VerifyError", "Proof", "verify", "verify_program"]


class VerifyError(PipecError):
    """The plan breaks a proof obligation; the message names the rank and instruction."""


@dataclass(frozen=True, slots=True)
class Proof:
    """A verified program, with its execution under each comm model."""

    executions: Mapping[str, Execution]


def _at(rank: int, index: int, ins: Instruction) -> str:
    return f"rank {rank}, instruction {index} ({ins.text()})"


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


def verify_program(
    program: Program,
    *,
    placement: Sequence[int],
    num_microbatches: int,
    edges: Sequence[Edge],
    costs: Costs,
    dp: int = 1,
    ties: Sequence[Tie] = (),
    stages: Sequence[Stage] = (),
) -> Proof:
    """Run all four proofs; raise :class:`VerifyError` at the first broken obligation."""
    P = program.num_ranks
    S = len(placement)
    M = num_microbatches
    if len(placement) and max(placement) >= P:
        raise VerifyError(f"placement names pp rank {max(placement)}, but the program has {P} ranks")
    edge_set = {(e.src_stage, e.dst_stage) for e in edges}
    producers: list[list[int]] = [[] for _ in range(S)]
    consumers: list[list[int]] = [[] for _ in range(S)]
    for s, t in edge_set:
        producers[t].append(s)
        consumers[s].append(t)
    ties_by_group = {f"tie.{t.name}": t for t in ties}
    _check_signatures(stages, edges)

    # proof 1 and the raw material of proofs 2 and 4, in one pass per rank. Keys are integers:
    # s*M+m for a (stage, microbatch), (src*S+dst)*M+m for a message on edge src->dst (+G for grads).
    G = S * S * M
    edge_keys = {src * S + dst for src, dst in edge_set}
    fwd: dict[int, tuple[int, int]] = {}   # forwards done -> (rank, index)
    bwd: dict[int, tuple[int, int]] = {}   # full or input-grad backwards done
    inp: set[int] = set()                  # input-grad backwards (their W must follow)
    wgt: dict[int, tuple[int, int]] = {}   # weight-grad backwards
    sent: dict[int, tuple[int, int]] = {}
    received: dict[int, tuple[int, int]] = {}
    order_out: dict[tuple[int, int], list[int]] = {}  # (a, b) -> message keys a sends b, in order
    order_in: dict[tuple[int, int], list[int]] = {}   # (a, b) -> message keys b receives from a
    backwards_done: dict[int, int] = {}               # stage -> completed backwards
    collectives: list[list[str]] = []
    FWD, BWD, BWD_I, BWD_W, AR, OPT = Op.FWD, Op.BWD, Op.BWD_I, Op.BWD_W, Op.ALLREDUCE, Op.OPTIM_STEP
    SEND_ACT, SEND_GRAD = Op.SEND_ACT, Op.SEND_GRAD
    for r, instrs in enumerate(program.ranks):
        reduced: set[tuple[str, int]] = set()
        colls: list[str] = []
        last_batch, closed = None, set()
        n = len(instrs)
        for i, ins in enumerate(instrs):
            op, s, m, batch = ins.op, ins.stage, ins.microbatch, ins.batch
            if batch != last_batch:
                if batch is not None and batch in closed:
                    raise VerifyError(f"{_at(r, i, ins)}: batch {batch} is split; posts of one batch must be adjacent")
                if last_batch is not None:
                    closed.add(last_batch)
                last_batch = batch
            if op is OPT:
                if i != n - 1:
                    raise VerifyError(f"{_at(r, i, ins)}: OPT must be the last instruction of the step")
                colls.append("pp")
                continue
            if placement[s] != r:
                raise VerifyError(f"{_at(r, i, ins)}: stage {s} is placed on rank {placement[s]}, not here")
            sm = s * M + m if m is not None else -1
            if op is FWD:
                if sm in fwd:
                    _twice(fwd, sm, r, i, ins, "forward", s, m)
                fwd[sm] = (r, i)
                for p in producers[s]:
                    if placement[p] == r:
                        if p * M + m not in fwd:
                            raise VerifyError(f"{_at(r, i, ins)}: needs F{p}.{m} earlier on rank {r}")
                    elif (p * S + s) * M + m not in received:
                        raise VerifyError(f"{_at(r, i, ins)}: needs RA{s}.{m}<{p}@{placement[p]} earlier on rank {r}")
            elif op is BWD or op is BWD_I:
                if sm in bwd:
                    _twice(bwd, sm, r, i, ins, "backward", s, m)
                if sm not in fwd:
                    raise VerifyError(f"{_at(r, i, ins)}: backward before its forward F{s}.{m}")
                bwd[sm] = (r, i)
                if op is BWD_I:
                    inp.add(sm)
                else:
                    backwards_done[s] = backwards_done.get(s, 0) + 1
                for c in consumers[s]:
                    if placement[c] == r:
                        if c * M + m not in bwd:
                            raise VerifyError(f"{_at(r, i, ins)}: needs B{c}.{m} (or I{c}.{m}) earlier on rank {r}")
                    elif G + (s * S + c) * M + m not in received:
                        raise VerifyError(f"{_at(r, i, ins)}: needs RG{s}.{m}<{c}@{placement[c]} earlier on rank {r}")
            elif op is BWD_W:
                if sm not in inp:
                    raise VerifyError(f"{_at(r, i, ins)}: weight-grad W needs I{s}.{m} earlier on rank {r}")
                if sm in wgt:
                    _twice(wgt, sm, r, i, ins, "weight-grad backward", s, m)
                wgt[sm] = (r, i)
                backwards_done[s] = backwards_done.get(s, 0) + 1
            elif op is AR:
                group = ins.group
                if group != "dp" and group not in ties_by_group:
                    known = ", ".join(sorted(ties_by_group)) or "none"
                    raise VerifyError(f"{_at(r, i, ins)}: unknown group {group!r} (tie groups: {known})")
                if group != "dp" and s not in ties_by_group[group].stages:
                    raise VerifyError(f"{_at(r, i, ins)}: stage {s} holds no copy of tied weight {group[4:]!r}")
                if group == "dp" and backwards_done.get(s, 0) != M:
                    raise VerifyError(
                        f"{_at(r, i, ins)}: comes before the last backward of stage {s} "
                        f"({backwards_done.get(s, 0)} of {M} done); its grads would be incomplete")
                if group != "dp":
                    for ts in ties_by_group[group].stages:
                        if placement[ts] == r and backwards_done.get(ts, 0) != M:
                            raise VerifyError(
                                f"{_at(r, i, ins)}: comes before the last backward of stage {ts}, which holds "
                                f"a copy of {group[4:]!r}")
                key = (group, s if group == "dp" else -1)
                if key in reduced:
                    raise VerifyError(f"{_at(r, i, ins)}: second all-reduce of {'stage %d' % s if group == 'dp' else group}")
                reduced.add(key)
                if group != "dp":
                    colls.append(group)
            else:  # sends and receives
                is_send = op is SEND_ACT or op is SEND_GRAD
                other = ins.to_stage if is_send else ins.from_stage
                is_act, src, dst = message_edge(ins)
                if src * S + dst not in edge_keys:
                    raise VerifyError(f"{_at(r, i, ins)}: there is no edge {src}->{dst} in the stage graph")
                peer = ins.peer
                if peer != placement[other]:
                    raise VerifyError(f"{_at(r, i, ins)}: stage {other} is on rank {placement[other]}, "
                                      f"but the peer is {peer}")
                if peer == r:
                    raise VerifyError(f"{_at(r, i, ins)}: stages {src} and {dst} are both on rank {r}; "
                                      "pass the tensor locally instead of a send to self")
                key = (src * S + dst) * M + m + (0 if is_act else G)
                if is_send:
                    if sm not in (fwd if is_act else bwd):
                        what = f"F{s}.{m}" if is_act else f"B{s}.{m} (or I{s}.{m})"
                        raise VerifyError(f"{_at(r, i, ins)}: sends data that {what} makes, which has not run yet on rank {r}")
                    if key in sent:
                        _twice(sent, key, r, i, ins, "send", s, m)
                    sent[key] = (r, i)
                    order_out.setdefault((r, peer), []).append(key)
                else:
                    if key in received:
                        _twice(received, key, r, i, ins, "receive", s, m)
                    received[key] = (r, i)
                    order_in.setdefault((peer, r), []).append(key)
        if not instrs or instrs[-1].op is not Op.OPTIM_STEP:
            raise VerifyError(f"rank {r}: the program must end with OPT (the optimizer step)")
        # proof 4, per rank: every stage reduced over dp, every spanning tie reduced
        for s in (st for st in range(S) if placement[st] == r):
            if dp > 1 and ("dp", s) not in reduced:
                raise VerifyError(f"rank {r}: stage {s} is never all-reduced over dp (dp={dp}); "
                                  f"add AR{s}:dp after its last backward")
        for name, tie in ties_by_group.items():
            ranks_of_tie = {placement[ts] for ts in tie.stages}
            if r in ranks_of_tie and len(ranks_of_tie) > 1 and (name, -1) not in reduced:
                raise VerifyError(f"rank {r}: tied weight {tie.name!r} is never all-reduced over its tie group; "
                                  f"the copies would drift")
        collectives.append(colls)

    if len(fwd) != S * M or len(bwd) != S * M or len(wgt) != len(inp):
        for s in range(S):
            for m in range(M):
                sm = s * M + m
                if sm not in fwd:
                    raise VerifyError(f"rank {placement[s]}: stage {s} microbatch {m} has no forward F{s}.{m}")
                if sm not in bwd:
                    raise VerifyError(f"rank {placement[s]}: stage {s} microbatch {m} has no backward B{s}.{m}")
                if sm in inp and sm not in wgt:
                    raise VerifyError(f"rank {placement[s]}: stage {s} microbatch {m} has I{s}.{m} but no W{s}.{m}")

    # proof 2: matching and FIFO order per directed pair
    for key, (r, i) in sent.items():
        if key not in received:
            ins = program.ranks[r][i]
            raise VerifyError(f"{_at(r, i, ins)}: no rank posts the matching receive")
    for key, (r, i) in received.items():
        if key not in sent:
            ins = program.ranks[r][i]
            raise VerifyError(f"{_at(r, i, ins)}: no rank posts the matching send")
    for pair, outs in order_out.items():
        ins_order = order_in.get(pair, [])
        if outs != ins_order:
            k = next(j for j, (a, b) in enumerate(zip(outs, ins_order)) if a != b)
            sr, si = sent[outs[k]]
            rr, ri = received[ins_order[k]]
            raise VerifyError(
                f"{_at(sr, si, program.ranks[sr][si])} is send #{k} from rank {pair[0]} to rank {pair[1]}, but "
                f"receive #{k} there is {_at(rr, ri, program.ranks[rr][ri])}: the two ranks post them in different "
                "orders, and gloo and NCCL match a pair's messages first-in, first-out")

    # proof 4: members of a group issue their collectives in the same order
    members: dict[str, set[int]] = {g: {placement[s] for s in t.stages} for g, t in ties_by_group.items()}
    members["pp"] = set(range(P))
    involved = sorted({r for g, ms in members.items() if g != "pp" and len(ms) > 1 for r in ms})
    for a_i, a in enumerate(involved):
        for b in involved[a_i + 1:]:
            shared = {g for g, ms in members.items() if a in ms and b in ms}
            seq_a = [g for g in collectives[a] if g in shared]
            seq_b = [g for g in collectives[b] if g in shared]
            if seq_a != seq_b:
                raise VerifyError(f"ranks {a} and {b} issue their shared collectives in different orders: "
                                  f"rank {a}: {', '.join(seq_a)}; rank {b}: {', '.join(seq_b)}")

    # proof 3: no deadlock, under both comm models
    executions = {}
    decoded = decode(program, placement=placement, num_microbatches=M, edges=edges, costs=costs)
    for model in MODELS:
        try:
            executions[model] = execute(program, placement=placement, num_microbatches=M, edges=edges, costs=costs,
                                        model=model, ties=ties, decoded=decoded, record_events=model == BUFFERED)
        except Deadlock as e:
            raise VerifyError(str(e)) from None
    return Proof(executions)


def _twice(table: dict, key: int, r: int, i: int, ins: Instruction, what: str, s: int, m: int) -> None:
    first = table[key]
    raise VerifyError(f"{_at(r, i, ins)}: second {what} of stage {s} microbatch {m} "
                      f"(the first is rank {first[0]}, instruction {first[1]})")


def verify(plan: Plan) -> Proof:
    """Prove a plan (all four proofs, both comm models); raise :class:`VerifyError` if any fails."""
    if plan.program.num_ranks != plan.mesh.pp:
        raise VerifyError(f"the program has {plan.program.num_ranks} ranks but mesh.pp is {plan.mesh.pp}")
    return verify_program(
        plan.program,
        placement=plan.placement,
        num_microbatches=plan.num_microbatches,
        edges=plan.edges or chain_edges(plan.num_stages),
        costs=plan_costs(plan),
        dp=plan.mesh.dp,
        ties=plan.ties,
        stages=plan.stages,
    )
