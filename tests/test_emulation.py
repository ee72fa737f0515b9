"""The emulated re-simulation's tail: each kind's probe samples capped at their TAIL quantile before they are drawn
(compiler/sim/simulate.py ``_deviations``), so a rare stall of the whole host is not paid on every drawn path."""

from __future__ import annotations

import pytest

from pipec.compiler.driver import compile_plan
from pipec.compiler.sim.cost import COMPUTE_JITTER, TRANSFER_JITTER
from pipec.compiler.sim import simulate
from pipec.compiler.sim.simulate import HOP, OVERSLEEP, emulated_costs, simulate_draws

UNIT = 0.01
FIXED = {"latency_s": 3e-4, "collective_s": 5e-4, "oversleep_s": 1e-3, "overhead": {"FWD": 1e-4}}


def _costs(plan, jitter):
    return emulated_costs(plan, seconds_per_unit=UNIT, jitter=jitter, **FIXED)


def _plan(schedule: str = "looped_bfs"):
    return compile_plan(num_ranks=4, num_microbatches=8, schedule=schedule, num_chunks=8).plan


def test_each_kind_is_capped_at_its_tail_quantile():
    # by hand, at simulate.TAIL = 0.97 (another TAIL moves these caps):
    # 100 oversleeps 0, 1e-4, ..., 99e-4: sorted, the 97th (int(0.97 x 100)) is 97e-4, so 98e-4 and 99e-4 fall to it
    oversleeps = tuple(i * 1e-4 for i in range(100))
    # 100 hops, the first three far out: sorted, the 97th is 6.0, so 7.0 and 9.0 fall to it
    hops = (9.0, 7.0, 6.0, *(2e-4,) * 97)
    costs = _costs(_plan(), {OVERSLEEP: oversleeps, HOP: hops, "FWD": (1e-4, 2e-4, 5.0)})
    want = [min(i, 97) * 1e-4 - 1e-3 for i in range(100)]
    assert costs.jitter[COMPUTE_JITTER] == pytest.approx(want)
    assert costs.jitter[TRANSFER_JITTER] == pytest.approx((6.0 - 3e-4,) * 3 + (2e-4 - 3e-4,) * 97)
    # three samples: int(0.97 x 3) is the largest, so nothing is capped
    assert costs.jitter["FWD"] == pytest.approx((0.0, 1e-4, 5.0 - 1e-4))


def test_a_stall_past_the_tail_moves_no_drawn_step(monkeypatch):
    """Samples whose top two of 100 are stalls of a whole second draw the same steps as those with the two at the
    cap (the sorted 97th sample); uncapped, nearly every drawn step (128 computes, each a 2% chance) pays one."""
    plan = _plan()
    body = tuple(1e-4 * (i % 10) for i in range(98))
    stalled = {OVERSLEEP: body + (1.0, 1.0), HOP: body}
    one = simulate_draws(plan, _costs(plan, stalled))
    two = simulate_draws(plan, _costs(plan, {OVERSLEEP: body + (9e-4,) * 2, HOP: body}))
    assert one.step_time == two.step_time and one.events == two.events
    monkeypatch.setattr(simulate, "TAIL", 1.0)
    assert simulate_draws(plan, _costs(plan, stalled)).step_time > one.step_time + 0.9
