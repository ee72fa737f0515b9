"""The verifier against corrupted plans: every broken proof obligation is rejected, located, never a hang.

Property tests (hypothesis) corrupt valid plans the ways a hand edit or a
buggy generator would, and run ``pipec check`` on them in-process.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipec.compiler.driver import compile_plan
from pipec.compiler.sim.engine import MODELS, Deadlock, execute
from pipec.compiler.ir.program import COMPUTE_OPS, COMM_OPS, Op, Program, parse_program
from pipec.compiler.passes.lower import lower
from pipec.compiler.ir.plan import Plan, Tie
from pipec.compiler.ir.plan_json import plan_to_json
from pipec.compiler.sim.simulate import chain_edges, plan_costs
from pipec.compiler.passes.verify import VerifyError, verify
from pipec.cli import main
from pipec.schedules import build_order

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _tied(P: int, M: int) -> Plan:
    """A 1f1b plan whose first and last stages share a tied weight."""
    base = compile_plan(schedule="1f1b", num_ranks=P, num_microbatches=M).plan
    ties = (Tie(name="wte", stages=(0, P - 1), params=("wte.weight", "lm_head.weight")),)
    order = build_order("1f1b", num_ranks=P, num_microbatches=M)
    program = lower(order, edges=base.edges, costs=plan_costs(base), ties=ties)
    plan = replace(base, ties=ties, program=program, prediction=None)
    verify(plan)
    return plan


BASES = {
    "1f1b_dp2": compile_plan(schedule="1f1b", num_ranks=3, num_microbatches=4, dp=2).plan,
    "interleaved": compile_plan(schedule="interleaved_1f1b", num_ranks=2, num_microbatches=4, num_chunks=2).plan,
    "zbv": compile_plan(schedule="zbv", num_ranks=2, num_microbatches=3, num_chunks=2).plan,
    "zb_h1": compile_plan(schedule="zb_h1", num_ranks=3, num_microbatches=3).plan,
    "tied": _tied(3, 3),
}

LOCATED = re.compile(r"rank \d+")


def check_rejects(plan: Plan, tmp_path, capsys) -> str:
    """``pipec check`` on the plan: exit 2 and a located message; returns the message."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_to_json(plan)))
    rc = main(["check", str(path)])
    err = capsys.readouterr().err
    assert rc == 2, f"accepted a corrupt plan:\n{plan.program.text()}"
    assert err.startswith("pipec: error: ") and "Traceback" not in err
    return err


def with_ranks(plan: Plan, ranks) -> Plan:
    return replace(plan, program=Program(tuple(tuple(r) for r in ranks)), prediction=None)


def pick(data, plan: Plan, ops) -> tuple[int, int]:
    choices = [(r, i) for r, instrs in enumerate(plan.program.ranks) for i, ins in enumerate(instrs) if ins.op in ops]
    return data.draw(st.sampled_from(choices))


@SETTINGS
@given(data=st.data(), base=st.sampled_from(sorted(BASES)))
def test_dropped_or_duplicated_compute_is_rejected(tmp_path, capsys, data, base):
    plan = BASES[base]
    r, i = pick(data, plan, COMPUTE_OPS)
    ranks = [list(x) for x in plan.program.ranks]
    ins = ranks[r][i]
    if data.draw(st.booleans()):
        del ranks[r][i]
    else:
        ranks[r].insert(data.draw(st.integers(0, len(ranks[r]) - 1)), ins)
    err = check_rejects(with_ranks(plan, ranks), tmp_path, capsys)
    assert LOCATED.search(err)
    assert f"{ins.text()[0]}{ins.stage}.{ins.microbatch}" in err or "instruction" in err


@SETTINGS
@given(data=st.data(), base=st.sampled_from(sorted(BASES)))
def test_broken_communication_is_rejected(tmp_path, capsys, data, base):
    plan = BASES[base]
    if not any(ins.op in COMM_OPS for r in plan.program.ranks for ins in r):
        return
    r, i = pick(data, plan, COMM_OPS)
    ranks = [list(x) for x in plan.program.ranks]
    ins = ranks[r][i]
    how = data.draw(st.sampled_from(["drop", "microbatch", "peer", "stage"]))
    if how == "drop":
        del ranks[r][i]
    elif how == "microbatch":
        ranks[r][i] = ins._replace(microbatch=(ins.microbatch + 1) % plan.num_microbatches)
        if plan.num_microbatches == 1:
            return
    elif how == "peer":
        ranks[r][i] = ins._replace(peer=(ins.peer + 1) % plan.mesh.pp)
    else:
        field = "to_stage" if ins.to_stage is not None else "from_stage"
        ranks[r][i] = ins._replace(**{field: (getattr(ins, field) + 1) % plan.num_stages})
    err = check_rejects(with_ranks(plan, ranks), tmp_path, capsys)
    assert LOCATED.search(err) and ("instruction" in err or "rank" in err)


@SETTINGS
@given(data=st.data(), base=st.sampled_from(sorted(BASES)))
def test_backward_moved_before_its_forward_is_rejected(tmp_path, capsys, data, base):
    plan = BASES[base]
    r, i = pick(data, plan, {Op.BWD, Op.BWD_I})
    ranks = [list(x) for x in plan.program.ranks]
    ins = ranks[r].pop(i)
    f = next(j for j, x in enumerate(ranks[r]) if x.op is Op.FWD and x.stage == ins.stage and x.microbatch == ins.microbatch)
    ranks[r].insert(f, ins)
    err = check_rejects(with_ranks(plan, ranks), tmp_path, capsys)
    assert f"rank {r}, instruction {f}" in err


@pytest.mark.parametrize("base", sorted(BASES))
def test_dropped_rank_and_unknown_op_are_rejected(tmp_path, capsys, base):
    plan = BASES[base]
    obj = plan_to_json(plan)
    obj["ranks"].pop()
    (tmp_path / "a.json").write_text(json.dumps(obj))
    assert main(["check", str(tmp_path / "a.json")]) == 2
    assert "ranks: expected" in capsys.readouterr().err
    obj = plan_to_json(plan)
    obj["ranks"][0]["instructions"][1]["op"] = "TELEPORT"
    (tmp_path / "b.json").write_text(json.dumps(obj))
    assert main(["check", str(tmp_path / "b.json")]) == 2
    assert "ranks[0].instructions[1].op: unknown opcode 'TELEPORT'" in capsys.readouterr().err


def _batch_start(instrs, j: int) -> int:
    """The index of the first post of instruction j's batch (j itself when unbatched)."""
    b = instrs[j].batch
    while b is not None and j > 0 and instrs[j - 1].batch == b:
        j -= 1
    return j


@SETTINGS
@given(data=st.data(), base=st.sampled_from(sorted(BASES)))
def test_compute_moved_before_the_receive_it_needs_is_rejected(data, base):
    """Known from the IR alone: a forward (backward) uses the buffer of the RA (RG) of its own stage and
    microbatch; moved in front of that receive (and its batch), it must be refused, naming both."""
    plan = BASES[base]
    needs = {Op.FWD: Op.RECV_ACT, Op.BWD: Op.RECV_GRAD, Op.BWD_I: Op.RECV_GRAD}
    choices = [(r, i, j) for r, instrs in enumerate(plan.program.ranks) for i, ins in enumerate(instrs)
               if ins.op in needs for j, rcv in enumerate(instrs[:i])
               if rcv.op is needs[ins.op] and (rcv.stage, rcv.microbatch) == (ins.stage, ins.microbatch)]
    r, i, j = data.draw(st.sampled_from(choices))
    ranks = [list(x) for x in plan.program.ranks]
    pos = _batch_start(ranks[r], j)
    ins, rcv = ranks[r][i], ranks[r][j]
    ranks[r].insert(pos, ranks[r].pop(i))
    with pytest.raises(VerifyError) as e:
        verify(with_ranks(plan, ranks))
    assert str(e.value) == f"rank {r}, instruction {pos} ({ins.text()}): needs {rcv.text()} earlier on rank {r}"


def _independent(a, b, edges) -> bool:
    """Two computes neither of which uses the other's result: other microbatches, or stages with no edge."""
    if a.microbatch != b.microbatch:
        return True
    pair = {a.stage, b.stage}
    return len(pair) == 2 and not any({e.src_stage, e.dst_stage} == pair for e in edges)


def _swappable(plan: Plan) -> list[tuple[int, int]]:
    return [(r, i) for r, instrs in enumerate(plan.program.ranks) for i, (a, b) in enumerate(zip(instrs, instrs[1:]))
            if a.op in COMPUTE_OPS and b.op in COMPUTE_OPS and _independent(a, b, plan.edges)]


SWAPPABLE = {name: got for name, plan in BASES.items() if (got := _swappable(plan))}


@SETTINGS
@given(data=st.data(), base=st.sampled_from(sorted(SWAPPABLE)))
def test_swapping_adjacent_independent_computes_verifies(data, base):
    """Known from the IR alone: two adjacent computes that do not feed each other can trade places (every
    post keeps its place, and each compute still follows the same posts), so the program must still verify."""
    assert len(SWAPPABLE) >= 2  # the lowering's 1f1b puts posts between most computes; zero-bubble W's fill gaps
    plan = BASES[base]
    r, i = data.draw(st.sampled_from(SWAPPABLE[base]))
    ranks = [list(x) for x in plan.program.ranks]
    ranks[r][i], ranks[r][i + 1] = ranks[r][i + 1], ranks[r][i]
    proof = verify(with_ranks(plan, ranks))
    assert set(proof.executions) == set(MODELS)


def test_known_deadlock_is_caught_under_the_in_order_model():
    """Two neighbours each post a send before the receive the other's send needs, unbatched."""
    program = parse_program(
        "0: F0.0 SA0.0>1@1 F0.1 SA0.1>1@1 RG0.0<1@1 B0.0 RG0.1<1@1 B0.1 OPT\n"
        "1: RA1.0<0@0 F1.0 B1.0 SG1.0>0@0 RA1.1<0@0 F1.1 B1.1 SG1.1>0@0 OPT"
    )
    base = compile_plan(schedule="1f1b", num_ranks=2, num_microbatches=2).plan
    costs = plan_costs(base)
    # fine when posts never block...
    execute(program, placement=(0, 1), num_microbatches=2, edges=chain_edges(2), costs=costs, model="buffered")
    deadlocked = parse_program(
        "0: F0.0 F0.1 SA0.0>1@1 SA0.1>1@1 RG0.0<1@1 B0.0 RG0.1<1@1 B0.1 OPT\n"
        "1: RA1.0<0@0 F1.0 B1.0 SG1.0>0@0 RA1.1<0@0 F1.1 B1.1 SG1.1>0@0 OPT"
    )
    execute(deadlocked, placement=(0, 1), num_microbatches=2, edges=chain_edges(2), costs=costs, model="buffered")
    with pytest.raises(Deadlock) as e:
        execute(deadlocked, placement=(0, 1), num_microbatches=2, edges=chain_edges(2), costs=costs, model="in_order")
    lines = e.value.lines
    assert len(lines) == 2 and lines[0].startswith("rank 0: ") and lines[1].startswith("rank 1: ")
    assert "SA0.1>1@1" in lines[0] and "SG1.0>0@0" in lines[1]
    with pytest.raises(VerifyError, match="deadlock under the in_order model"):
        verify(replace(base, program=deadlocked, prediction=None))
    # the same posts batched together are fine: a batch completes as one unit
    batched = parse_program(
        "0: F0.0 F0.1 [SA0.0>1@1 SA0.1>1@1] RG0.0<1@1 B0.0 RG0.1<1@1 B0.1 OPT\n"
        "1: RA1.0<0@0 F1.0 B1.0 [SG1.0>0@0 RA1.1<0@0] F1.1 B1.1 SG1.1>0@0 OPT"
    )
    verify(replace(base, program=batched, prediction=None))


def test_posting_order_mismatch_is_caught_by_matching():
    base = compile_plan(schedule="gpipe", num_ranks=2, num_microbatches=2).plan
    swapped = parse_program(
        "0: F0.0 F0.1 SA0.1>1@1 SA0.0>1@1 RG0.0<1@1 RG0.1<1@1 B0.0 B0.1 OPT\n"
        "1: RA1.0<0@0 RA1.1<0@0 F1.0 F1.1 B1.0 B1.1 SG1.0>0@0 SG1.1>0@0 OPT"
    )
    with pytest.raises(VerifyError, match="different orders") as e:
        verify(replace(base, program=swapped, prediction=None))
    assert "rank 0, instruction 2 (SA0.1>1@1)" in str(e.value) and "rank 1, instruction 0 (RA1.0<0@0)" in str(e.value)


def test_collective_rules():
    plan = BASES["1f1b_dp2"]
    ranks = [list(x) for x in plan.program.ranks]
    ar = next(i for i, x in enumerate(ranks[1]) if x.op is Op.ALLREDUCE)
    ranks[1].insert(1, ranks[1].pop(ar))  # before the stage's last backward
    with pytest.raises(VerifyError, match="comes before the last backward of stage 1"):
        verify(with_ranks(plan, ranks))
    ranks = [list(x) for x in plan.program.ranks]
    del ranks[2][-2]  # no dp all-reduce at all: replicas would drift apart
    with pytest.raises(VerifyError, match="never all-reduced over dp"):
        verify(with_ranks(plan, ranks))
    tied = BASES["tied"]
    ranks = [list(x) for x in tied.program.ranks]
    del ranks[2][-2]
    with pytest.raises(VerifyError, match="tied weight 'wte' is never all-reduced"):
        verify(with_ranks(tied, ranks))
    ranks = [list(x) for x in tied.program.ranks]
    ranks[0].insert(len(ranks[0]) - 1, ranks[0][-2]._replace(group="tie.nope"))
    with pytest.raises(VerifyError, match="unknown group 'tie.nope'"):
        verify(with_ranks(tied, ranks))
