"""Timelines that tell the truth (issue 13, item 5): the simulator's waits inside a collective are events of their
own, drawn as waiting by every view (terminal, Perfetto); a prediction without them is split as the terminal
splits it."""

from __future__ import annotations

from pipec.compiler.config import TrainingConfig
from pipec.compiler.driver import compile_plan
from pipec.compiler.sim.simulate import simulate
from pipec.compiler.ir.timeline import Event, Timeline
from pipec.compiler.ir.program import Op
from pipec.views.common import lanes
from pipec.views.perfetto import trace_events
from pipec.views.timeline import render_terminal
from rich.console import Console


def _rows(renderable, width: int) -> list[str]:
    console = Console(width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text().splitlines()


def test_the_simulator_records_opt_waiting_for_its_peers():
    """gpipe over 2 ranks, 1 microbatch: rank 1's backward ends at 4 units, rank 0's at 6; rank 1 waits in OPT's
    grad-norm collective (the plan clips) from 4 to 6, and that is a wait event, not optimizer work."""
    plan = compile_plan(num_ranks=2, num_microbatches=1, schedule="gpipe", training=TrainingConfig(grad_clip=1.0)).plan
    tl = simulate(plan)
    ev = [(e.op, e.wait, e.start, e.end) for e in tl.events if e.rank == 1]
    assert ev[-2:] == [(Op.OPTIM_STEP, True, 4.0, 6.0), (Op.OPTIM_STEP, False, 6.0, 6.0)]
    (lane0, lane1), _ = lanes(tl)
    assert [e.text for e in lane1.events][-2:] == ["~OPT", "OPT"]
    row = next(r for r in _rows(render_terminal(tl, width=7 + 24), 31) if r.startswith("rank 1"))
    assert row[7:].rstrip().endswith("~" * 8)  # units 4..6 of 6 over 24 columns: all waiting


def test_perfetto_draws_a_collective_wait_as_comm():
    """A prediction without wait events (an older plan's): rank 0 reaches OPT at 2, rank 1 at 6."""
    tl = Timeline.build(step_time=8, busy={0: (3, 4), 1: (7, 0)},
                        events=[Event.parse(0, "F0.0", 0, 2), Event.parse(0, "OPT", 2, 8),
                                Event.parse(1, "F1.0", 0, 6), Event.parse(1, "OPT", 6, 8)], time_unit="unit")
    got = [(e["tid"], e["name"], e["cat"], e["ts"], e["dur"]) for e in trace_events(tl)["traceEvents"]
           if e["ph"] == "X"]
    assert (0, "~OPT", "comm", 2000.0, 4000.0) in got and (0, "OPT", "OPT", 6000.0, 2000.0) in got
    assert (1, "OPT", "OPT", 6000.0, 2000.0) in got


def test_a_simulated_plan_keeps_its_waits_in_every_view():
    plan = compile_plan(num_ranks=4, num_microbatches=8, schedule="1f1b", training=TrainingConfig(grad_clip=1.0)).plan
    tl = simulate(plan)
    waits = [e for e in tl.events if e.wait]
    assert waits and all(e.op is Op.OPTIM_STEP for e in waits)
    x = [e for e in trace_events(tl)["traceEvents"] if e["ph"] == "X"]
    assert len(x) == len(tl.events)  # nothing split twice
    assert sum(e["dur"] for e in x if e["name"] == "~OPT") == sum((e.end - e.start) * 1e3 for e in waits)


def test_a_rounded_zero_wait_is_zero_and_the_plan_reads_back(tmp_path):
    # the simulator's waits are sums of differences; under processor sharing one came out -1e-20, and every
    # rank refused the plan the compiler had written (a Hugging Face Llama, 2 ranks, costs profile)
    from dataclasses import replace

    from pipec.compiler.ir.plan_json import read_plan, write_plan

    t = Timeline.build(step_time=1.0, busy={0: (0.9, -1.0164395367051604e-20), 1: (0.5, 0.25)})
    assert [r.comm_wait for r in t.per_rank] == [0.0, 0.25] and abs(t.per_rank[0].idle - 0.1) < 1e-12
    path = str(tmp_path / "plan.json")
    plan = compile_plan(num_ranks=2, num_microbatches=4, schedule="1f1b").plan
    write_plan(replace(plan, prediction=t), path)
    assert read_plan(path).prediction.per_rank[0].comm_wait == 0.0
