"""Processor sharing (compiler/sim/contention.py): ranks that share a host's cores, priced in the event loop."""

import pytest

from pipec.compiler.sim.contention import Sharing, sharing_of
from pipec.compiler.ir.plan import Mesh

PROFILE = {"concurrent_ranks": 4, "threads_per_rank": 1, "cpu_count": 2,
           "slowdown": {"fwd": 2.0, "bwd_i": 2.0, "bwd": 2.0, "optim": 1.0}}


def test_no_sharing_without_a_crowd():
    mesh = Mesh(pp=4, dp=1)
    assert sharing_of(None, mesh) is None
    assert sharing_of({"concurrent_ranks": 4}, mesh) is None  # timed alone only
    assert sharing_of({**PROFILE, "concurrent_ranks": 1}, mesh) is None
    calm = {**PROFILE, "slowdown": {"fwd": 0.93, "bwd_i": 0.88, "bwd": 1.0, "optim": 1.01}}
    assert sharing_of(calm, mesh) is None  # a rank per core: nothing to share


@pytest.mark.parametrize("mesh, hosts", [
    (Mesh(pp=4, dp=1), ((1,), (1,), (1,), (1,))),
    (Mesh(pp=2, dp=2), ((2,), (2,))),  # a pp rank's replicas compute at once: they count twice
    (Mesh(pp=2, dp=2, devices_per_node=2), ((2, 0), (0, 2))),
    (Mesh(pp=4, dp=2, devices_per_node=4), ((2, 0), (2, 0), (0, 2), (0, 2))),
    (Mesh(pp=2, dp=1, tp=2), ((2,), (2,))),  # and their tp ranks
    (Mesh(pp=2, dp=2, tp=2, devices_per_node=4), ((4, 0), (0, 4))),
])
def test_hosts_hold_consecutive_global_ranks(mesh, hosts):
    assert sharing_of(PROFILE, mesh).hosts == hosts


def _sharing(ranks=2, at_once=2, s=2.0):
    return Sharing(hosts=((1,),) * ranks, at_once=at_once, slowdown={"FWD": s, "BWD": s, "BWD_I": s, "BWD_W": s})


def test_a_compute_alone_runs_at_its_rate_alone():
    # K = 2 at once on one core (s = 2): alone, a compute gets the whole core, twice its cost's rate
    sh = _sharing()
    scales = [1.0]
    for _ in range(40):
        scales = sh.scales([(0, "FWD", 0.0, scales[0])], scales)
    assert scales[0] == pytest.approx(0.5, rel=1e-6)


def test_two_computes_at_once_keep_their_cost():
    sh = _sharing()
    got = sh.scales([(0, "FWD", 0.0, 1.0), (1, "BWD", 0.0, 1.0)], [1.0, 1.0])
    assert got == [1.0, 1.0]  # the crowd the profile timed: nothing moves


def test_half_overlap_prices_each_part_at_its_crowd():
    # rank 0 computes over [0, 1], rank 1 over [0.5, 1.5]: rank 0 alone for 0.5 (rate 2), then shared (rate 1)
    sh = _sharing()
    got = sh.scales([(0, "FWD", 0.0, 1.0), (1, "FWD", 0.5, 1.5)], [1.0, 1.0])
    work = 0.5 * 2 + 0.5 * 1
    assert got == [pytest.approx(0.5 + 0.5 / work)] * 2


def test_ranks_share_the_cores_and_the_oversubscribed_hosts_excess_stays():
    # K = 4 at once on C = 2 cores timed at s = 2.5 (0.5 over 4 / 2: the oversubscribed host's switching)
    sh = Sharing(hosts=((1,),) * 4, at_once=4, slowdown={"FWD": 2.5}, slots=2)
    assert sh.rate(2.5, 1) == sh.rate(2.5, 2) == 2.0  # a core each: twice the crowd's share, not the rate alone
    assert sh.rate(2.5, 3) == pytest.approx(4 / 3)  # 2 cores 3 ways
    assert sh.rate(2.5, 4) == pytest.approx(1.0)  # the crowd the profile timed: its cost
    assert sh.rate(1.5, 1) == 1.5  # never faster than alone
    # a slot per process, or no cores recorded: the crowd's slowdown is spread over every rank that computes
    for many in (Sharing(hosts=((1,),) * 4, at_once=4, slowdown={"FWD": 2.5}),
                 Sharing(hosts=((1,),) * 4, at_once=4, slowdown={"FWD": 2.5}, slots=4)):
        assert [many.rate(2.5, k) for k in (1, 2, 3, 4)] == [2.5, 2.0, pytest.approx(4 / 3), 1.0]
    # two computes at once on two cores: each at twice the crowd's rate, half its cost
    got = sh.scales([(0, "FWD", 0.0, 1.0), (1, "FWD", 0.0, 1.0)], [1.0, 1.0])
    assert got == [pytest.approx(0.5 + 0.5 / 2.0)] * 2


@pytest.mark.parametrize("profile, slots", [
    ({**PROFILE, "cores": 2}, 2),
    ({**PROFILE, "cores": 8, "threads_per_rank": 4}, 2),
    ({**PROFILE, "cores": 1, "threads_per_rank": 2}, 1),
    (PROFILE, None),  # a plan from before the profile recorded its cores
])
def test_the_slots_are_the_cores_over_a_ranks_threads(profile, slots):
    assert sharing_of(profile, Mesh(pp=4, dp=1)).slots == slots


def test_a_part_that_timed_no_slowdown_is_left_alone():
    sh = Sharing(hosts=((1,), (1,)), at_once=2, slowdown={"FWD": 2.0, "BWD": 1.0})
    assert sh.scales([(0, "BWD", 0.0, 1.0)], [1.0]) == [1.0]


def test_other_hosts_do_not_crowd():
    sh = Sharing(hosts=((1, 0), (0, 1)), at_once=1 + 1, slowdown={"FWD": 2.0})
    got = sh.scales([(0, "FWD", 0.0, 1.0), (1, "FWD", 0.0, 1.0)], [1.0, 1.0])
    assert got == [pytest.approx(0.75)] * 2  # each alone on its host: rate 2, halfway from 1 to 0.5


# ----------------------------------------------------------------------------- in the event loop


from pipec.compiler.sim.cost import CostModel  # noqa: E402
from pipec.compiler.sim.engine import execute  # noqa: E402
from pipec.compiler.passes.lower import lower  # noqa: E402
from pipec.compiler.ir.plan import chain_edges  # noqa: E402
from pipec.schedules import build_order  # noqa: E402
from pipec.schedules.timing import Cost  # noqa: E402


def _step(schedule: str, ranks: int, microbatches: int, sharing: Sharing | None) -> tuple[float, object]:
    order = build_order(schedule, num_ranks=ranks, num_microbatches=microbatches)
    edges = chain_edges(order.num_stages)
    costs = CostModel(stages=(Cost(fwd=1.0, bwd=2.0, bwd_i=1.0, bwd_w=1.0, optim=0.0),) * order.num_stages,
                      transfer={}, allreduce={}, sharing=sharing)
    program = lower(order, edges=edges, costs=costs)
    ex = execute(program, placement=order.placement, num_microbatches=microbatches, edges=edges, costs=costs)
    return ex.step_time, ex


def test_one_microbatch_through_a_pipeline_on_one_core_runs_each_compute_alone():
    # 2 ranks timed at once on one core (s = 2): with M = 1 no two computes overlap, so each takes half its cost
    plain, _ = _step("gpipe", 2, 1, None)
    shared, ex = _step("gpipe", 2, 1, _sharing())
    assert plain == pytest.approx(6.0)
    assert shared == pytest.approx(3.0, rel=2e-3)
    assert {e.text for e in ex.events} >= {"F0.0", "F1.0", "B1.0", "B0.0"}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_one_core_does_the_work_of_every_rank_one_after_another_at_most(schedule):
    # 4 ranks on one effective core: the step is at least every compute's cost alone back to back, and no
    # more than the crowd the profile timed (every compute at its cost)
    plain, _ = _step(schedule, 4, 8, None)
    shared, _ = _step(schedule, 4, 8, _sharing(ranks=4, at_once=4, s=4.0))
    work_alone = 4 * 8 * (1.0 + 2.0) / 4.0
    assert work_alone * (1 - 2e-3) <= shared < plain


def test_the_fixed_point_is_deterministic():
    a = _step("1f1b", 4, 8, _sharing(ranks=4, at_once=4, s=2.0))[1]
    b = _step("1f1b", 4, 8, _sharing(ranks=4, at_once=4, s=2.0))[1]
    assert a == b


@pytest.mark.slow  # a whole tune with a crowd's sharing (~5 s)
def test_tunes_bounds_hold_when_the_host_is_shared(tmp_path, monkeypatch):
    """Every candidate on 4 devices of one crowded host (K = 4, each part 2x slower in the crowd): the step bound
    never exceeds the simulated step, which sharing makes shorter than the crowd's costs say."""
    from dataclasses import replace as _replace

    import pipec.compiler.sim.simulate as simulate
    from pipec.compiler.driver import compile_request, schedule_order
    from pipec.compiler.frontend import build_stage_graph
    from pipec.tune.space import TuneRequest, candidate_request, candidates
    from pipec.tune.bounds import bounds, candidate_frame
    from pipec.dsl import load_spec
    from model_requests import graph_key
    from test_tune import SMALL

    crowd = {**PROFILE, "slowdown": {"fwd": 2.0, "bwd_i": 2.0, "bwd": 2.0, "optim": 1.0}}
    monkeypatch.setattr(simulate, "sharing_of", lambda profile, mesh: real(crowd, mesh))
    real = sharing_of
    path = tmp_path / "small.pipe"
    path.write_text(SMALL)
    treq = TuneRequest(base=load_spec(str(path), {}).request, num_devices=4)
    graphs, shorter = {}, 0
    for cand in candidates(treq):
        req = candidate_request(treq, cand)
        key = graph_key(req)
        if key not in graphs:
            graphs[key] = build_stage_graph(req)
        plan = compile_request(req, graph=graphs[key], verify=False).plan
        step, _, _ = bounds(cand, candidate_frame(req, graphs[key], schedule_order(req)[0]))
        assert step <= plan.prediction.step_time * (1 + 1e-9), cand
        crowded = simulate.simulate_costs(plan, _replace(simulate.plan_costs(plan), sharing=None)).step_time
        shorter += plan.prediction.step_time < crowded * (1 - 1e-6)
    assert shorter > 0
