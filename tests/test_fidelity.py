"""Predictions that hold: the simulator charges the executor's host overhead exactly as specified, measured
links and overhead travel through plan.json (old plans load), --emulate re-simulates under what it measured."""

from __future__ import annotations

import json
import threading

import pytest

from pipec.compiler.driver import compile_plan
from pipec.compiler.engine import BUFFERED, CostModel, execute
from pipec.compiler.plan import Link, Measured, Overhead, load_plan, plan_to_json, read_plan, write_plan
from pipec.compiler.simulate import emulated_costs, plan_costs, simulate, simulate_costs
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
    starts = {e.op: (round(e.start, 9), round(e.end, 9)) for e in ex.events if e.op[0] in "FB"}
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
    with pytest.raises(Exception, match="overhead.seconds.FORWARD.*opcode"):
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
