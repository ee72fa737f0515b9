"""The drawn re-simulation of an emulated run: each instruction's host time, each compute's oversleep and each
message's hop drawn from the probe's samples (CostModel.jitter), the median of a fixed number of seeded draws."""

from __future__ import annotations

import random

import pytest

from pipec.compiler.driver import compile_plan
from pipec.compiler.sim.cost import COMPUTE_JITTER, TRANSFER_JITTER, CostModel
from pipec.compiler.sim.engine import decode, drawn, execute
from pipec.compiler.ir.program import parse_program
from pipec.compiler.sim.simulate import HOP, OVERSLEEP, emulated_costs, execute_draws, simulate_costs, simulate_draws
from pipec.schedules.timing import Cost

UNIT = 0.01
FIXED = {"latency_s": 3e-4, "collective_s": 5e-4, "oversleep_s": 1e-3, "overhead": {"FWD": 1e-4, "SEND_ACT": 2e-5}}


def _plan(schedule: str = "1f1b", ranks: int = 4):
    return compile_plan(num_ranks=ranks, num_microbatches=2 * ranks, schedule=schedule).plan


def _costs(plan, jitter=None):
    return emulated_costs(plan, seconds_per_unit=UNIT, jitter=jitter, **FIXED)


SPREAD = {"FWD": (0.0, 1e-4, 5e-3), "SEND_ACT": (1e-5, 3e-3), OVERSLEEP: (0.0, 2e-3, 7e-3), HOP: (1e-4, 4e-3)}


def test_samples_become_deviations_from_the_fixed_figures():
    costs = _costs(_plan(), {**SPREAD, "BWD": ()})  # a kind without samples is fixed
    assert set(costs.jitter) == {"FWD", "SEND_ACT", COMPUTE_JITTER, TRANSFER_JITTER}
    assert costs.jitter[COMPUTE_JITTER] == pytest.approx((-1e-3, 1e-3, 6e-3))
    assert costs.jitter[TRANSFER_JITTER] == pytest.approx((1e-4 - 3e-4, 4e-3 - 3e-4))
    fixed = _costs(_plan())
    assert fixed.jitter == {} and (costs.stages, costs.transfer, costs.overhead) == (
        fixed.stages, fixed.transfer, fixed.overhead)


def test_draws_are_deterministic_with_a_seed_and_fixed_without_one():
    plan = _plan("interleaved_1f1b")
    costs = _costs(plan, SPREAD)
    one, two = simulate_draws(plan, costs), simulate_draws(plan, costs)
    assert one.step_time == two.step_time and one.events == two.events
    other = simulate_draws(plan, costs, seed=1)
    assert other.step_time != one.step_time
    # without an rng, the samples are ignored: the fixed figures' simulation
    assert simulate_costs(plan, costs).step_time == simulate_costs(plan, _costs(plan)).step_time
    assert one.step_time > simulate_costs(plan, costs).step_time  # the tails lengthen the step


def test_samples_all_at_the_figure_give_the_fixed_simulation_exactly():
    plan = _plan("zbv")
    flat = {"FWD": (1e-4,) * 4, "SEND_ACT": (2e-5,) * 3, OVERSLEEP: (1e-3,) * 5, HOP: (3e-4,) * 2}
    drawn_tl = simulate_draws(plan, _costs(plan, flat))
    fixed = simulate_costs(plan, _costs(plan))
    assert drawn_tl.step_time == fixed.step_time
    assert drawn_tl.events == fixed.events


def test_one_draw_per_message_on_both_its_ends():
    plan = _plan()
    costs = _costs(plan, {HOP: tuple(i * 1e-4 for i in range(50))})
    dec = decode(plan.program, placement=plan.placement, num_microbatches=plan.num_microbatches,
                 edges=plan.edges, costs=costs)
    got = drawn(dec, plan.program, costs.jitter, random.Random(0))
    hops: dict[int, set[float]] = {}
    for rank in got.ranks:
        for d in rank:
            if len(d) == 5 and isinstance(d[1], int):  # a send or a receive: (code, key, transfer, batch, host)
                hops.setdefault(d[1], set()).add(d[2])
    assert hops and all(len(v) == 1 for v in hops.values())
    assert len({v for s in hops.values() for v in s}) > 1  # messages draw apart


def test_two_parallel_computes_lengthen_the_median_step():
    """Two ranks, one forward each, joined by OPT's grad-norm collective: each forward's oversleep is 0 or 2
    (mean 1). At the mean the step is 1 + 1; drawn, it is the longer of two forwards, 3 three times in four, so
    the median of the draws is 3."""
    program = parse_program("0: F0.0 OPT\n1: F1.0 OPT")
    stage = Cost(fwd=2.0, bwd=0.0, bwd_i=0.0, bwd_w=0.0, optim=0.0)  # 1 unit + the mean oversleep 1
    costs = CostModel(stages=(stage, stage), transfer={}, allreduce={}, jitter={COMPUTE_JITTER: (-1.0, 1.0)})
    kw = dict(placement=(0, 1), num_microbatches=1, edges=(), costs=costs)
    assert execute(program, **kw).step_time == 2.0
    assert execute(program, **kw, rng=random.Random(5)).step_time in (1.0, 3.0)
    assert execute_draws(program, **kw).step_time == 3.0
    ones = [execute(program, **kw, rng=random.Random(s)).step_time for s in range(200)]
    assert set(ones) == {1.0, 3.0} and 0.65 < ones.count(3.0) / len(ones) < 0.85
