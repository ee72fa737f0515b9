"""Predictions that hold: the simulator charges the executor's host overhead exactly as specified, measured
links and overhead travel through plan.json (old plans load), --emulate re-simulates under what it measured."""

from __future__ import annotations

import json
import threading

import pytest

from pipec.compiler.config import TrainingConfig
from pipec.compiler.driver import compile_plan
from pipec.compiler.sim.cost import CostModel
from pipec.compiler.sim.engine import BUFFERED, execute
from pipec.compiler.ir.program import Op
from pipec.compiler.ir.plan import Link, Measured, Overhead, PlanError
from pipec.compiler.ir.plan_json import load_plan, plan_to_json, read_plan, write_plan
from pipec.compiler.sim.simulate import emulated_costs, plan_costs, simulate, simulate_costs
from pipec.schedules.timing import Cost

H = {"FWD": 0.1, "BWD": 0.2, "SEND_ACT": 0.01, "RECV_ACT": 0.02, "RECV_GRAD": 0.03, "SEND_GRAD": 0.04,
     "OPTIM_STEP": 0.5}


def _gpipe_2x1():
    """rank 0: F0.0 SA0.0>1 RG0.0<1 B0.0 OPT; rank 1: RA1.0<0 F1.0 B1.0 SG1.0>0 OPT."""
    return compile_plan(num_ranks=2, num_microbatches=1, schedule="gpipe").plan


def test_overhead_is_charged_as_specified_by_hand():
    plan = _gpipe_2x1()
    assert [[i.text() for i in r] for r in plan.program.ranks] == [
        ["F0.0", "SA0.0>1@1", "RG0.0<1@1", "B0.0", "OPT"], ["RA1.0<0@0", "F1.0", "B1.0", "SG1.0>0@0", "OPT"]]
    cost = Cost(fwd=1.0, bwd=2.0, bwd_i=1.0, bwd_w=1.0, optim=0.0)
    costs = CostModel(stages=(cost, cost), transfer={(0, 1): 0.25}, allreduce={}, overhead=H)
    ex = execute(plan.program, placement=plan.placement, num_microbatches=1, edges=plan.edges, costs=costs,
                 model=BUFFERED)
    # rank 0: F0.0 starts after its 0.1 (ends 1.1); SA posted at 1.11, RG at 1.14.
    # rank 1: RA posted at 0.02, done at 1.11 + 0.25 = 1.36; F1.0 1.46-2.46; B1.0 2.66-4.66; SG posted at 4.70,
    #   done 4.95 (its receive was posted at 1.14). rank 0: B0.0 5.15-7.15; OPT arrives at 7.65, rank 1 at
    #   max(4.70, its last completion 4.95) + 0.5 = 5.45: the step ends at 7.65.
    starts = {e.text: (round(e.start, 9), round(e.end, 9)) for e in ex.events if e.op in (Op.FWD, Op.BWD)}
    assert starts == {"F0.0": (0.1, 1.1), "F1.0": (1.46, 2.46), "B1.0": (2.66, 4.66), "B0.0": (5.15, 7.15)}
    assert ex.step_time == pytest.approx(7.65)
    # the host's own time is neither compute nor a wait
    assert ex.compute == (3.0, 3.0)
    assert ex.comm_wait == pytest.approx((4.95 - 1.14, (1.36 - 0.02) + (7.65 - 5.2)))


def test_no_overhead_is_the_plan_prediction():
    plan = compile_plan(num_ranks=4, num_microbatches=8, schedule="1f1b").plan
    costs = emulated_costs(plan, seconds_per_unit=1.0, latency_s=0.0, collective_s=0.0, overhead={})
    assert simulate_costs(plan, costs).step_time == pytest.approx(plan.prediction.step_time)


def test_overhead_on_the_critical_path_of_in_order():
    plan = compile_plan(num_ranks=4, num_microbatches=8, schedule="1f1b").plan
    base = plan_costs(plan)
    free = execute(plan.program, placement=plan.placement, num_microbatches=8, edges=plan.edges, costs=base,
                   model="in_order")
    charged = execute(plan.program, placement=plan.placement, num_microbatches=8, edges=plan.edges,
                      costs=CostModel(stages=base.stages, transfer=base.transfer, allreduce={}, overhead=H),
                      model="in_order")
    assert charged.step_time > free.step_time
    assert charged.compute == free.compute


def test_measured_links_and_overhead_round_trip_through_plan_json(tmp_path):
    when = Measured(at="2025-01-01T00:00:00+00:00", backend="gloo", num_ranks=2, host="box")
    plan = _gpipe_2x1()
    from dataclasses import replace

    plan = replace(plan, links={**plan.links, "pp": Link(latency_s=3e-4, bandwidth_Bps=2e9, measured=when)},
                   overhead=Overhead(seconds={"FWD": 1e-4, "SEND_ACT": 3e-5}, measured=when))
    path = tmp_path / "plan.json"
    write_plan(plan, str(path))
    back = read_plan(str(path))
    assert back.links["pp"] == plan.links["pp"] and back.links["pp"].measured == when
    assert back.links["dp"].measured is None
    assert back.overhead == plan.overhead
    assert plan_to_json(back)["overhead"] == {"seconds": {"FWD": 1e-4, "SEND_ACT": 3e-5},
                                              "measured": {"at": when.at, "backend": "gloo", "ranks": 2,
                                                           "host": "box"}}


def test_old_plans_load_without_overhead_and_a_bad_opcode_is_named():
    obj = plan_to_json(_gpipe_2x1())
    assert "overhead" not in obj and all("measured" not in v for v in obj["links"].values())
    assert load_plan(json.loads(json.dumps(obj))).overhead is None
    obj["overhead"] = {"seconds": {"FORWARD": 1e-4}}
    with pytest.raises(PlanError, match=r"plan\.overhead\.seconds\.FORWARD: expected an opcode name "
                                        r"\(ALLREDUCE, .*\), got 'FORWARD'"):
        load_plan(obj)


def test_a_seconds_plan_is_charged_its_overhead_and_a_unit_plan_is_not():
    from dataclasses import replace

    plan = _gpipe_2x1()
    with_overhead = replace(plan, overhead=Overhead(seconds=H))
    assert simulate(with_overhead).step_time == simulate(plan).step_time  # units: free
    assert plan_costs(with_overhead).overhead == {}
    seconds = replace(with_overhead, model={"target": "x"}, spec={"costs": "profile"})
    assert plan_costs(seconds).overhead == H


def test_emulated_costs_use_the_measured_numbers():
    plan = compile_plan(num_ranks=2, num_microbatches=4, schedule="zb_h1", dp=2).plan
    costs = emulated_costs(plan, seconds_per_unit=0.01, latency_s=3e-4, collective_s=5e-4, overhead={"FWD": 1e-4},
                           oversleep_s=5e-5)
    assert set(costs.transfer.values()) == {3e-4}
    assert set(costs.allreduce.values()) == {5e-4} and costs.allreduce
    c = costs.stages[0]
    assert (c.fwd, c.bwd, c.optim) == (pytest.approx(0.01 + 5e-5), pytest.approx(0.02 + 5e-5), 0.0)
    assert costs.overhead == {"FWD": 1e-4} and costs.time_unit == "s"
    fast = simulate_costs(plan, emulated_costs(plan, seconds_per_unit=0.01, latency_s=0.0, collective_s=0.0,
                                               overhead={}))
    assert simulate_costs(plan, costs).step_time > fast.step_time


def test_the_report_predicts_the_resimulation_and_keeps_the_plan_beside_it():
    from pipec.runtime.accounting import build_report
    from pipec.runtime.executor import RankStep

    plan = _gpipe_2x1()
    resim = simulate_costs(plan, emulated_costs(plan, seconds_per_unit=0.01, latency_s=1e-3, collective_s=1e-3,
                                                overhead=H))
    steps = [[RankStep(global_rank=r, step_time=0.08, compute=0.03) for r in range(2)]]
    rep = build_report(plan, "plan.json", steps, tokens_per_step=None, flops_per_step=None, peak_flops=None,
                       predicted=resim, emulation={"latency_s": 1e-3})
    assert rep["predicted"]["step_time"] == pytest.approx(resim.step_time)
    assert rep["planned"]["step_time"] == plan.prediction.step_time
    assert rep["bubble_fraction"]["planned"] == plan.prediction.bubble_fraction
    assert rep["bubble_fraction"]["predicted"] == resim.bubble_fraction
    assert rep["emulation"] == {"latency_s": 1e-3}
    plain = build_report(plan, "plan.json", steps, tokens_per_step=None, flops_per_step=None, peak_flops=None)
    assert "planned" not in plain and plain["predicted"]["step_time"] == plan.prediction.step_time


@pytest.mark.timed  # asserts on what it times: runs before the launches' queue starts (tests/launches.py)
def test_host_overhead_times_the_real_executor_on_every_kind():
    """runtime/linkprobe.py's overhead: the executor's handlers timed over zero-compute steps (in-process)."""
    from pipec.runtime.executor import Executor
    from pipec.runtime.linkprobe import host_overhead
    from pipec.runtime.transport import FakeWorld

    plan = compile_plan(num_ranks=2, num_microbatches=4, schedule="1f1b").plan
    world = FakeWorld(2, timeout=30)
    got, errors = {}, []

    def rank(p):
        try:
            ex = Executor(plan, pp_rank=p, dp_rank=0, transport=world.transport(p), emulate=0.0)
            units = ex.units
            got[p] = host_overhead(ex, steps=2)
            assert ex.units is units  # put back
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(p,)) for p in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    kinds = {i.op.value for r in plan.program.ranks for i in r}
    assert set(got[0]) | set(got[1]) == kinds
    assert all(0 <= v < 0.05 for g in got.values() for v in g.values())


# ------------------------------------------------------------------------- the comm model does what the runtime does


def _hand(text: str, placement, costs: dict[str, float], model: str = BUFFERED, ties=(), grad_norm: bool = True):
    """Run a hand-written program: F=1, B=2 per stage, all-reduces priced by ``costs`` ((group, stage) text)."""
    from pipec.compiler.ir.program import parse_program
    from pipec.compiler.ir.plan import Edge

    program = parse_program(text)
    S = len(placement)
    cost = Cost(fwd=1.0, bwd=2.0, bwd_i=1.0, bwd_w=1.0, optim=0.0)
    allreduce = {(g, int(s)): v for k, v in costs.items() for g, s in [k.split(":")]}
    cm = CostModel(stages=(cost,) * S, transfer={}, allreduce=allreduce, grad_norm=grad_norm)
    edges = [Edge(src_stage=s, dst_stage=s + 1) for s in range(S - 1)]
    return execute(program, placement=placement, num_microbatches=1, edges=edges, costs=cm, model=model, ties=ties)


def _events(ex, rank: int) -> list[tuple[str, float, float]]:
    return [(e.text, e.start, e.end) for e in ex.events if e.rank == rank]


@pytest.mark.parametrize("model", ["buffered", "in_order"])
def test_a_dp_allreduce_is_posted_and_opt_waits_for_it(model):
    """The executor posts an all-reduce asynchronously and waits for it in OPT: stage 1's all-reduce overlaps
    stage 0's backward (before: the buffered model blocked the host on it, step 7)."""
    ex = _hand("0: F0.0 F1.0 B1.0 AR1:dp B0.0 AR0:dp OPT", (0, 0), {"dp:0": 0.5, "dp:1": 0.5}, model)
    assert ex.step_time == pytest.approx(6.5)
    assert ex.comm_wait == pytest.approx((0.5,))
    assert _events(ex, 0)[3:] == [("AR1:dp", 4.0, 4.0), ("B0.0", 4.0, 6.0), ("AR0:dp", 6.0, 6.0),
                                  ("~OPT", 6.0, 6.5), ("OPT", 6.5, 6.5)]


TIED = """
0: F0.0 SA0.0>1@1 RG0.0<1@1 B0.0 AR0:dp AR0:tie.wte OPT
1: RA1.0<0@0 F1.0 B1.0 SG1.0>0@0 AR1:dp AR1:tie.wte OPT
"""


def _tie():
    from pipec.compiler.ir.plan import Tie

    return (Tie(name="wte", stages=(0, 1), params=("wte.weight", "head.weight")),)


def test_a_tie_allreduce_waits_for_the_reductions_in_flight_under_buffered():
    """The executor sums a tie's dp-averaged copies: on the host (gloo) it waits for the all-reduces in flight
    first; under in_order the comm queue orders them and the host goes on."""
    costs = {"dp:0": 0.5, "dp:1": 0.5, "tie.wte:0": 0.25, "tie.wte:1": 0.25}
    ex = _hand(TIED, (0, 1), costs, BUFFERED, _tie())
    assert ex.step_time == pytest.approx(6.75)
    assert _events(ex, 1)[2:] == [("AR1:dp", 4.0, 4.0), ("~AR1:tie.wte", 4.0, 4.5), ("AR1:tie.wte", 4.5, 4.5),
                                  ("~OPT", 4.5, 6.75), ("OPT", 6.75, 6.75)]
    assert _events(ex, 0)[2:] == [("AR0:dp", 6.0, 6.0), ("~AR0:tie.wte", 6.0, 6.5), ("AR0:tie.wte", 6.5, 6.5),
                                  ("~OPT", 6.5, 6.75), ("OPT", 6.75, 6.75)]
    # rank 0: its gradient (3), the dp all-reduce, the tie; rank 1: its input (1), the dp all-reduce, the tie
    assert ex.comm_wait == pytest.approx((3.75, 3.75))
    queued = _hand(TIED, (0, 1), costs, "in_order", _tie())
    assert queued.step_time == pytest.approx(6.75)
    assert not [e for e in queued.events if e.wait and e.op is Op.ALLREDUCE]


def test_a_tie_member_that_never_posts_is_named_in_the_deadlock():
    from pipec.compiler.sim.engine import Deadlock

    text = TIED.replace(" AR1:tie.wte", "")
    with pytest.raises(Deadlock, match=r"rank 0: OPT \(instruction 6\) waits in collective tie.wte #0, which rank 1"):
        _hand(text, (0, 1), {}, BUFFERED, _tie())


@pytest.mark.parametrize("model", ["buffered", "in_order"])
def test_without_clipping_opt_waits_for_no_peer(model):
    """OPT's grad-norm collective exists only when the run clips: --emulate runs none, so a rank that finishes
    first ends its step there instead of waiting for the last."""
    plan = _gpipe_2x1()  # rank 1 ends B1.0 at 4 + its send; rank 0 ends B0.0 at 6
    text = "\n".join(f"{r}: " + " ".join(i.text() for i in instrs) for r, instrs in enumerate(plan.program.ranks))
    synced = _hand(text, (0, 1), {}, model)
    alone = _hand(text, (0, 1), {}, model, grad_norm=False)
    assert synced.step_time == alone.step_time == pytest.approx(6.0)
    assert ("~OPT", 4.0, 6.0) in _events(synced, 1)
    assert _events(alone, 1)[-1] == ("OPT", 4.0, 4.0) and alone.comm_wait[1] == synced.comm_wait[1] - 2.0
    em = emulated_costs(plan, seconds_per_unit=0.01, latency_s=0.0, collective_s=0.0, overhead={})
    assert not em.grad_norm


def test_opt_holds_the_grad_norm_collective_only_when_the_plan_clips():
    """The runtime runs OPT's grad-norm all-reduce only when grad_clip is set: plan_costs follows the plan's spec,
    and so does its prediction (rank 1 waits in OPT from 4 to 6 only when clipping)."""
    plain = _gpipe_2x1()
    clipped = compile_plan(num_ranks=2, num_microbatches=1, schedule="gpipe",
                           training=TrainingConfig(grad_clip=1.0)).plan
    assert not plan_costs(plain).grad_norm and plan_costs(clipped).grad_norm
    assert not plan_costs(compile_plan(num_ranks=2, num_microbatches=1, schedule="gpipe",
                                       training=TrainingConfig(grad_clip=None)).plan).grad_norm
    ends = {name: [(e.text, e.start, e.end) for e in p.prediction.events if e.rank == 1][-2:]
            for name, p in (("plain", plain), ("clipped", clipped))}
    assert ends["clipped"] == [("~OPT", 4.0, 6.0), ("OPT", 6.0, 6.0)]
    assert ends["plain"][-1] == ("OPT", 4.0, 4.0) and ends["plain"][0][0] != "~OPT"
    assert plain.prediction.step_time == clipped.prediction.step_time == 6.0


# ----------------------------------------------------------------------------- the link fit


def test_fit_recovers_latency_and_bandwidth_when_the_sizes_show_it():
    from pipec.runtime.linkprobe import _fit

    sizes = [4, 65536, 1048576]
    lat, bw = _fit(sizes, [2e-5 + 2 * s / 1e9 for s in sizes], 2.0)
    assert lat == pytest.approx(2e-5) and bw == pytest.approx(1e9)


@pytest.mark.parametrize("times", [[1e-4, 1.01e-4, 1.0e-4], [1.2e-4, 1.1e-4, 1.0e-4], [1e-4, 1e-4 + 1e-9, 1e-4]])
def test_fit_reports_the_least_bandwidth_the_times_allow_when_they_show_latency_only(times):
    """Sizes too small to show the bandwidth (flat or falling times, or a term under a tenth of the largest
    probe's time): the latency is the least time and the bandwidth a bound from the largest probe, never 1e15."""
    from pipec.runtime.linkprobe import RESOLVED, _fit

    sizes = [4, 1024, 65536]
    lat, bw = _fit(sizes, times, 1.0)
    assert lat == min(times)
    assert bw == pytest.approx(65536 / (RESOLVED * times[2]))
    assert bw < 1e10


def test_fit_of_one_size_is_latency_and_a_bound():
    from pipec.runtime.linkprobe import RESOLVED, _fit

    assert _fit([65536], [1e-4], 1.0) == (1e-4, pytest.approx(65536 / (RESOLVED * 1e-4)))
