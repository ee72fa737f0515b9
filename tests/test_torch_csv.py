"""Interop with torch.distributed.pipelining's schedule CSV, both forms.

torch's schedules are built without a process group: its schedule classes
only read a few attributes of their stages (num_stages, group_size,
group_rank, stage_index), so plain namespaces stand in for PipelineStage (as
torch's own visualizer does with mocks).
"""

from __future__ import annotations

import csv
import io
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest

from pipec.compiler.ir.program import Instruction, Op, Program, parse_program
from pipec.compiler.passes.lower import lower
from pipec.compiler.ir.plan import Mesh, Plan
from pipec.compiler.sim.simulate import chain_edges, plan_costs
from pipec.compiler.ir.torch_csv import (
    TorchAction,
    TorchCsvError,
    format_torch_csv,
    parse_torch_csv,
    read_torch_csv,
    write_torch_csv,
)
from pipec.compiler.passes.verify import verify
from pipec.schedules import build_order
from pipec.schedules.order import ComputeOrder, validate_order
from pipec.schedules.order import Action, Kind
from pipec.schedules.torch_csv import (
    COMM_TYPES, COMPUTE_TYPES, OTHER_TYPES, CellError, format_compute_csv, parse_cell, parse_compute_csv,
)

S = pytest.importorskip("torch.distributed.pipelining.schedules")


def fake_stages(P: int, v: int, placement: str = "loop") -> list[SimpleNamespace]:
    """The stages pp rank 0 holds, as torch's schedule constructors read them."""
    indices = [c * P for c in range(v)] if placement == "loop" else [0, 2 * P - 1]
    return [SimpleNamespace(num_stages=P * v, group_size=P, group_rank=0, stage_index=i, submod=None) for i in indices]


# (schedule class, P, v, M): multi-stage schedules that dump both CSV forms
TORCH_CASES = [
    ("Interleaved1F1B", 4, 2, 8),
    ("Interleaved1F1B", 2, 3, 4),
    ("LoopedBFS", 2, 2, 3),
    ("InterleavedZeroBubble", 4, 2, 8),
    ("ZBVZeroBubble", 4, 2, 8),
    ("ZBVZeroBubble", 2, 2, 5),
]


def torch_schedule(name: str, P: int, v: int, M: int):
    cls = S.get_schedule_class(name)
    return cls(fake_stages(P, v, "v" if name == "ZBVZeroBubble" else "loop"), M)


def torch_runtime(P: int, v: int, M: int, placement: str = "loop"):
    return S._PipelineScheduleRuntime(fake_stages(P, v, placement), M)


def csv_rows(path) -> list[list[str]]:
    with open(path, newline="") as f:
        return [list(r) for r in csv.reader(f)]


def one_f_one_b(P: int, M: int) -> ComputeOrder:
    return build_order("1f1b", num_ranks=P, num_microbatches=M)


def unit_plan(order: ComputeOrder, program: Program, dp: int = 1) -> Plan:
    return Plan(
        mesh=Mesh(pp=order.num_ranks, dp=dp),
        num_stages=order.num_stages,
        num_microbatches=order.num_microbatches,
        placement=order.placement,
        program=program,
    )


def lowered(order: ComputeOrder, dp: int = 1) -> Program:
    costs = plan_costs(unit_plan(order, Program(()), dp))
    return lower(order, edges=chain_edges(order.num_stages), costs=costs, dp=dp)


def unbatched(program: Program) -> Program:
    return Program(tuple(tuple(i._replace(batch=None) for i in r) for r in program.ranks))


def torch_order(actions: dict) -> list[list[str]]:
    return [[str(a) for a in actions[r] if a is not None] for r in sorted(actions)]


# ----------------------------------------------------------------------------- reading


def test_compute_only_text():
    t = parse_torch_csv("0F0,0F1,,0B0,0B1\n,1F0,1B0,1F1,1B1\n")
    assert (t.kind, t.placement, t.num_microbatches) == ("compute_only", (0, 1), 2)
    assert t.rows[0][2] is None and t.rows[1][1] == TorchAction(1, "F", 0)
    assert t.to_order().text() == "0: F0.0 F0.1 B0.0 B0.1\n1: F1.0 B1.0 F1.1 B1.1"
    with pytest.raises(TorchCsvError, match="compute_only schedule has no sends"):
        t.to_program()


COMMS = (
    "0UNSHARD,0F0,0SEND_F0,0RECV_B0,0B0,0REDUCE_GRAD,0RESHARD\n"
    "1UNSHARD,1RECV_F0,1F0,1B0,1SEND_B0,1REDUCE_GRAD,1RESHARD\n"
)


def test_compute_comms_text_becomes_a_program():
    t = parse_torch_csv(COMMS)
    assert t.kind == "compute_comms"
    assert t.to_program().text() == "0: F0.0 SA0.0>1@1 RG0.0<1@1 B0.0 OPT\n1: RA1.0<0@0 F1.0 B1.0 SG1.0>0@0 OPT"
    assert t.to_program(dp=2).text() == (
        "0: F0.0 SA0.0>1@1 RG0.0<1@1 B0.0 AR0:dp OPT\n1: RA1.0<0@0 F1.0 B1.0 SG1.0>0@0 AR1:dp OPT"
    )


def test_shard_cells_map_to_sharding_instructions_both_ways():
    """On a mesh that shards parameters, UNSHARD / RESHARD / REDUCE_GRAD are UN / RE / RS (HSDP: RS then
    the replicate all-reduce, which goes back into REDUCE_GRAD); a pipec plan exports and imports back."""
    t = parse_torch_csv(COMMS)
    mesh = Mesh(pp=2, dp=2, shard="full")
    assert t.to_program(mesh=mesh).text() == (
        "0: UN0:dp F0.0 SA0.0>1@1 RG0.0<1@1 B0.0 RS0:dp RE0:dp OPT\n"
        "1: UN1:dp RA1.0<0@0 F1.0 B1.0 SG1.0>0@0 RS1:dp RE1:dp OPT")
    hsdp = Mesh(pp=2, dp=4, shard="grads", shard_size=2)
    assert t.to_program(mesh=hsdp).ranks[0][5:7] == (
        Instruction(Op.REDUCE_SCATTER, 0, group="dp.shard"), Instruction(Op.ALLREDUCE, 0, group="dp.replicate"))
    from pipec.compiler.driver import compile_plan

    for sched, v, m in (("interleaved_1f1b", 2, hsdp), ("zb_h1", 1, mesh)):
        plan = compile_plan(schedule=sched, num_ranks=2, num_microbatches=4, num_chunks=v, dp=m.dp, shard=m.shard,
                            shard_size=m.shard_size).plan
        text = format_torch_csv(plan.program, form="compute_comms")
        assert "UNSHARD" in text and "RESHARD" in text and "REDUCE_GRAD" in text and "dp" not in text
        back = parse_torch_csv(text).to_program(mesh=m)
        assert back == unbatched(plan.program)
        verify(replace(plan, program=back, prediction=None))


def test_peers_come_from_where_stages_are_computed():
    # V placement on 2 ranks: stages 0,3 on rank 0 and 1,2 on rank 1; 1 -> 2 is local (no comm)
    text = (
        "0F0,0SEND_F0,3RECV_F0,3F0,3B0,3SEND_B0,0RECV_B0,0B0\n"
        "1RECV_F0,1F0,2F0,2SEND_F0,2RECV_B0,2B0,1B0,1SEND_B0\n"
    )
    t = parse_torch_csv(text)
    assert t.placement == (0, 1, 1, 0)
    prog = t.to_program()
    assert prog.ranks[0][1] == Instruction(Op.SEND_ACT, 0, 0, to_stage=1, peer=1)
    assert prog.ranks[0][2] == Instruction(Op.RECV_ACT, 3, 0, from_stage=2, peer=1)
    assert prog.ranks[1][3] == Instruction(Op.SEND_ACT, 2, 0, to_stage=3, peer=0)
    verify(unit_plan(t.to_order(), prog))


@pytest.mark.parametrize(
    "text, message",
    [
        ("0F0,0X1", r"rank 0 \(row 1\), column 2 \('0X1'\): not a torch action"),
        ("0F0,(0F1;1B0)OVERLAP_F_B,0B0", r"column 2 .*OVERLAP_F_B .* is not supported"),
        ("0B0,0F0", r"column 1 \('0B0'\): backward of stage 0 microbatch 0 before its forward 0F0"),
        ("0F0,0F0,0B0", r"column 2 \('0F0'\): second forward"),
        ("0F0,0B0,0B0", r"column 3 \('0B0'\): second backward"),
        ("0F0,0W0", r"column 2 \('0W0'\): weight-grad W .* needs its input-grad 0I0"),
        ("0F0,0B0,0F1", r"rank 0 \(row 1\): stage 0 microbatch 1 is missing a backward"),
        ("0F0,0I0", r"stage 0 microbatch 0 is missing 0W0"),
        ("0F0,0B0\n1F0,0F1,1B0,0B1", r"rank 1 \(row 2\), column 2 \('0F1'\): stage 0 is computed on rank 0"),
        ("0F0,0B0\n2F0,2B0", r"stage 1 has no compute action in any row"),
        ("0F0,0B0\n,,\n1F0,1B0", r"rank 1 \(row 2\) computes no stage"),
        ("0F,0B0", r"column 1 \('0F'\): F needs a microbatch number"),
        ("0F0,0SEND_F,0B0", r"column 2 \('0SEND_F'\): SEND_F needs a microbatch"),
        ("0F0,0B0,0REDUCE_GRAD1", r"REDUCE_GRAD takes no microbatch"),
        ("0F0,0F1,0B0,0REDUCE_GRAD,0B1", r"column 4 \('0REDUCE_GRAD'\): .* after 1 of its 2 backwards"),
        ("0F0,0B0,0REDUCE_GRAD,0REDUCE_GRAD", r"column 4 .* a second one"),
        ("0F0,0I0,0REDUCE_GRAD,0W0", r"after 0 of its 1 backwards"),
        ("0F0,0B0,1SEND_B0\n1F0,1B0", r"rank 0 \(row 1\), column 3 \('1SEND_B0'\): stage 1 is computed on rank 1"),
        ("0F0,0SEND_F0,0B0", r"column 2 \('0SEND_F0'\): SEND_F of stage 0 goes to stage 1, which does not exist"),
        ("0F0,0RECV_F0,0B0", r"RECV_F of stage 0 goes to stage -1"),
        ("0F0,0SEND_F0,1F0,1B0,0B0", r"stages 0 and 1 are both on rank 0; torch passes tensors between them locally"),
        ("", r"no actions"),
    ],
)
def test_errors_name_the_rank_row_column_and_text(text, message):
    with pytest.raises(TorchCsvError, match=message):
        parse_torch_csv(text, source="s.csv")


def test_a_sent_forward_to_a_rank_that_sends_nothing_back_is_left_to_the_verifier():
    # well-formed cells whose comms do not pair up: the reader keeps them, the verifier refuses
    t = parse_torch_csv("0F0,0SEND_F0,0B0\n1F0,1B0\n")
    with pytest.raises(ValueError):
        verify(unit_plan(t.to_order(), t.to_program()))


def test_form_is_checked_when_given(tmp_path):
    with pytest.raises(TorchCsvError, match=r"column 1 \('0UNSHARD'\): a compute_only schedule holds F, B, I and W"):
        parse_torch_csv(COMMS, form="compute_only")
    assert parse_torch_csv("0F0,0B0", form="compute_comms").to_program().text() == "0: F0.0 B0.0 OPT"
    # on one rank REDUCE_GRAD marks the lowered form: named as the cell at fault (it was a StopIteration)
    with pytest.raises(TorchCsvError, match=r"column 3 \('0REDUCE_GRAD'\): a compute_only schedule holds"):
        parse_torch_csv("0F0,0B0,0REDUCE_GRAD", form="compute_only")
    with pytest.raises(TorchCsvError, match="form must be one of"):
        parse_torch_csv("0F0,0B0", form="both")
    with pytest.raises(TorchCsvError, match="cannot read"):
        read_torch_csv(tmp_path / "missing.csv")


def test_torch_1f1b_pipeline_order_is_refused_naming_its_bug():
    # torch 2.13's Schedule1F1B.pipeline_order gives the last rank F1..F(M) and no F0
    P, M = 4, 8
    s = S.Schedule1F1B(fake_stages(P, 1)[0], M)
    out = io.StringIO()
    csv.writer(out).writerows(s.pipeline_order[r] for r in range(P))
    with pytest.raises(TorchCsvError, match=r"rank 3 \(row 4\), column 2 \('3B0'\): backward of stage 3 microbatch 0 before its forward"):
        parse_torch_csv(out.getvalue())


def test_torch_gpipe_order_with_reduce_grad_reads_as_compute_only():
    P, M = 3, 4
    s = S.ScheduleGPipe(fake_stages(P, 1)[0], M)
    out = io.StringIO()
    csv.writer(out).writerows(s.pipeline_order[r] for r in range(P))
    t = parse_torch_csv(out.getvalue())
    assert t.kind == "compute_only" and t.placement == (0, 1, 2)
    assert t.to_order().text().splitlines()[1] == "1: F1.0 F1.1 F1.2 F1.3 B1.0 B1.1 B1.2 B1.3"


# ----------------------------------------------------------------------------- torch's own files


def torch_file(tmp_path, form: str, name: str, P: int, v: int, M: int):
    """torch's schedule, the file it dumps in ``form``, and that file as pipec reads it (of that form)."""
    sched = torch_schedule(name, P, v, M)
    path = tmp_path / "s.csv"
    sched._dump_csv(path, format=form)
    t = read_torch_csv(path)
    assert t.kind == form
    return sched, path, t


@pytest.mark.parametrize("name, P, v, M", TORCH_CASES)
def test_torch_compute_only_file_imports_as_its_order(tmp_path, name, P, v, M):
    sched, _, t = torch_file(tmp_path, "compute_only", name, P, v, M)
    assert (t.num_ranks, t.num_stages, t.num_microbatches) == (P, P * v, M)
    assert t.placement == tuple(sched.stage_index_to_group_rank[s] for s in range(P * v))
    order = t.to_order()
    validate_order(order)
    ours = [[f"{a.stage}{a.kind.value}{a.microbatch}" for a in actions] for actions in order.ranks]
    assert ours == torch_order(sched.pipeline_order)


@pytest.mark.parametrize("name, P, v, M", TORCH_CASES)
def test_torch_compute_comms_file_imports_as_a_verified_program(tmp_path, name, P, v, M):
    _, path, t = torch_file(tmp_path, "compute_comms", name, P, v, M)
    order = t.to_order()
    for dp in (1, 2):
        program = t.to_program(dp=dp)
        verify(unit_plan(order, program, dp))  # all four proofs, both comm models
        assert all(r[-1].op is Op.OPTIM_STEP for r in program.ranks)
        num_ar = sum(i.op is Op.ALLREDUCE for r in program.ranks for i in r)
        assert num_ar == (0 if dp == 1 else P * v)
    # back to torch's form: the same cells, less UNSHARD/RESHARD (with dp = 2, REDUCE_GRAD stays put)
    torch_cells = [[c for c in row if c and "SHARD" not in c] for row in csv_rows(path)]
    again = [list(r) for r in csv.reader(io.StringIO(format_torch_csv(t.to_program(dp=2), form="compute_comms")))]
    assert again == torch_cells
    at_dp1 = [list(r) for r in csv.reader(io.StringIO(format_torch_csv(t.to_program(dp=1), form="compute_comms")))]
    assert [[c for c in r if "REDUCE" not in c] for r in at_dp1] == [[c for c in r if "REDUCE" not in c] for r in torch_cells]
    assert sorted(c for r in at_dp1 for c in r if "REDUCE" in c) == sorted(c for r in torch_cells for c in r if "REDUCE" in c)


def test_torch_dualpipev_is_refused_for_overlap_f_b(tmp_path):
    sched = S.ScheduleDualPipeV(fake_stages(2, 2, "v"), 4)
    path = tmp_path / "dpv.csv"
    sched._dump_csv(path, format="compute_only")
    with pytest.raises(TorchCsvError, match=r"rank \d \(row \d\), column \d+ \('\(\d+F\d+;\d+B\d+\)OVERLAP_F_B'\)"):
        read_torch_csv(path)


# ----------------------------------------------------------------------------- ours -> torch


def our_orders() -> list[ComputeOrder]:
    """pipec's own schedules (P, M, v), and a few torch orders read back."""
    configs = [
        ("gpipe", 3, 4, 1), ("1f1b", 4, 8, 1), ("1f1b", 1, 3, 1), ("1f1b", 3, 2, 1),
        ("interleaved_1f1b", 4, 8, 2), ("looped_bfs", 2, 3, 2), ("zb_h1", 4, 8, 1), ("zbv", 4, 8, 2),
        ("interleaved_zb", 4, 8, 2), ("interleaved_zb", 3, 6, 3),
    ]
    orders = [build_order(n, num_ranks=P, num_microbatches=M, num_chunks=v) for n, P, M, v in configs]
    for name, P, v, M in (TORCH_CASES[0], TORCH_CASES[3]):
        rows = torch_order(torch_schedule(name, P, v, M).pipeline_order)
        orders.append(parse_torch_csv("\n".join(",".join(r) for r in rows)).to_order())
    return orders


ORDERS = our_orders()


@pytest.mark.parametrize("order", ORDERS, ids=lambda o: f"P{o.num_ranks}S{o.num_stages}M{o.num_microbatches}")
def test_round_trip_ours_csv_ours(tmp_path, order):
    path = tmp_path / "o.csv"
    write_torch_csv(order, path)
    assert read_torch_csv(path).to_order() == order
    for dp in (1, 2):
        program = lowered(order, dp)
        write_torch_csv(program, path, form="compute_comms")
        back = read_torch_csv(path)
        assert back.kind == "compute_comms"
        assert back.to_program(dp=dp) == unbatched(program)  # batch ids are all torch's CSV loses
        assert back.to_order() == order
        write_torch_csv(program, path, form="compute_only")
        assert read_torch_csv(path).to_order() == order


def _placement_style(order: ComputeOrder) -> str:
    P = order.num_ranks
    return "v" if order.num_stages == 2 * P and order.placement[P] == P - 1 and P > 1 else "loop"


@pytest.mark.parametrize("order", ORDERS, ids=lambda o: f"P{o.num_ranks}S{o.num_stages}M{o.num_microbatches}")
def test_torch_loads_our_files_in_both_forms(tmp_path, order):
    P, S_, M = order.num_ranks, order.num_stages, order.num_microbatches
    v, style = S_ // P, _placement_style(order)
    # compute_only: torch validates it and runs its own lowering over it
    path = tmp_path / "only.csv"
    write_torch_csv(order, path)
    rt = torch_runtime(P, v, M, style)
    rt._load_csv(str(path), format="compute_only")
    assert torch_order(rt.pipeline_order) == [[f"{a.stage}{a.kind.value}{a.microbatch}" for a in r] for r in order.ranks]
    assert [rt.stage_index_to_group_rank[s] for s in range(S_)] == list(order.placement)
    # compute_comms: torch takes our lowering as is; its own simulator runs it without a hang
    program = lowered(order, dp=2)
    path = tmp_path / "comms.csv"
    write_torch_csv(program, path, form="compute_comms")
    rt = torch_runtime(P, v, M, style)
    rt._load_csv(str(path), format="compute_comms")
    cells = torch_order(rt.pipeline_order_with_comms)
    assert cells == csv_rows(path)
    assert sum(c.endswith("REDUCE_GRAD") for r in cells for c in r) == S_
    no_reduce = {r: [a for a in acts if a.computation_type != S.REDUCE_GRAD] for r, acts in rt.pipeline_order_with_comms.items()}
    S._simulate_comms_compute(no_reduce, lambda s: rt.stage_index_to_group_rank[s], S_)


def test_reduce_grad_goes_after_each_stages_last_backward_at_dp1():
    program = parse_program("0: F0.0 F0.1 B0.0 B0.1 OPT\n")
    assert format_torch_csv(program, form="compute_comms") == "0F0,0F1,0B0,0B1,0REDUCE_GRAD\r\n"
    # after the last B's own send, when it is among the posts right after it
    program = parse_program("0: RA1.0<0@1 F1.0 RG1.0<2@2 B1.0 [RG1.1<2@2 SG1.0>0@1] RA1.1<0@1 OPT")
    assert format_torch_csv(program, form="compute_comms").rstrip() == (
        "1RECV_F0,1F0,1RECV_B0,1B0,1RECV_B1,1SEND_B0,1REDUCE_GRAD,1RECV_F1"
    )
    # with a split backward, after the last W
    program = parse_program("0: F0.0 I0.0 F0.1 W0.0 I0.1 W0.1 F1.0 B1.0 OPT")
    assert format_torch_csv(program, form="compute_comms").rstrip() == (
        "0F0,0I0,0F1,0W0,0I1,0W1,0REDUCE_GRAD,1F0,1B0,1REDUCE_GRAD"
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ("0: F0.0 SA0.0>2@2 B0.0 OPT\n1: OPT\n2: OPT", r"rank 0, instruction 1 \(SA0.0>2@2\): a skip edge between stages 0 and 2"),
        ("0: RA2.0<0@0 OPT", r"a skip edge between stages 2 and 0"),
        ("0: F0.0 B0.0 AR0:tie.wte OPT", r"rank 0, instruction 2 \(AR0:tie.wte\): torch's schedule has no tie-group all-reduce"),
        ("0: F0.0 SA0.0>1@0 F1.0 OPT", r"a send or receive within rank 0"),
    ],
)
def test_export_refuses_what_torch_cannot_express(text, message):
    program = parse_program(text)
    for form in ("compute_only", "compute_comms"):
        with pytest.raises(TorchCsvError, match=message):
            format_torch_csv(program, form=form)


def test_export_form_rules():
    order = one_f_one_b(2, 2)
    with pytest.raises(TorchCsvError, match="compute_comms form needs a Program"):
        format_torch_csv(order, form="compute_comms")
    with pytest.raises(TorchCsvError, match="form must be one of"):
        format_torch_csv(order, form="comms")
    # compute_only never carries REDUCE_GRAD (torch's loader refuses it there)
    assert "REDUCE_GRAD" not in format_torch_csv(lowered(order, dp=2))


@pytest.mark.parametrize("order", ORDERS, ids=lambda o: f"P{o.num_ranks}S{o.num_stages}M{o.num_microbatches}")
def test_schedules_compute_only_reader_round_trips_and_agrees_with_the_compiler(order):
    text = format_compute_csv(order)
    assert parse_compute_csv(text) == order == parse_torch_csv(text).to_order()
    assert text == format_torch_csv(order)


@pytest.mark.parametrize(
    "cell, got",
    [("2F0", TorchAction(2, "F", 0)), (" 1I3 ", TorchAction(1, "I", 3)), ("0SEND_B3", TorchAction(0, "SEND_B", 3)),
     ("1REDUCE_GRAD", TorchAction(1, "REDUCE_GRAD")), ("", None), ("  ", None)],
)
def test_cell_grammar(cell, got):
    assert parse_cell(cell) == got


def test_cell_grammar_both_ways_for_every_type():
    """Every torch type reads and writes through one grammar; comms know their other stage."""
    for typ in (*COMPUTE_TYPES, *COMM_TYPES):
        a = TorchAction(3, typ, 12)
        assert parse_cell(a.text()) == a and a.text() == f"3{typ}12"
    for typ in OTHER_TYPES:
        assert parse_cell(f"3{typ}") == TorchAction(3, typ) and TorchAction(3, typ).text() == f"3{typ}"
    assert [TorchAction(3, t, 0).other_stage for t in COMM_TYPES] == [4, 2, 2, 4]
    assert [TorchAction(3, t, 0).is_send for t in COMM_TYPES] == [True, False, True, False]
    assert TorchAction(3, "F", 0).other_stage is None and TorchAction(3, "REDUCE_GRAD").kind is None
    assert [TorchAction(0, t, 0).kind.value for t in COMPUTE_TYPES] == list(COMPUTE_TYPES)
    assert TorchAction.of(Action(Kind.W, 2, 5)).text() == "2W5"


@pytest.mark.parametrize(
    "cell, reason, typ",
    [("(0F7;3B1)OVERLAP_F_B", "overlap", None), ("2X0", "unknown", None), ("0F", "microbatch", "F"),
     ("0REDUCE_GRAD2", "microbatch", "REDUCE_GRAD")],
)
def test_cell_errors_say_why(cell, reason, typ):
    with pytest.raises(CellError) as e:
        parse_cell(cell)
    assert (e.value.reason, e.value.type) == (reason, typ)


def test_compute_only_reader_refuses_comms_at_the_cell():
    with pytest.raises(TorchCsvError, match=r"s.csv: rank 0 \(row 1\), column 2 \('0SEND_F0'\): a compute_only"):
        parse_compute_csv("0F0,0SEND_F0,0B0\n1F0,1B0\n", "s.csv")


def test_library_module_does_not_import_torch():
    code = "import sys, pipec.compiler.ir.torch_csv, pipec.schedules.torch_csv\nassert 'torch' not in sys.modules\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
