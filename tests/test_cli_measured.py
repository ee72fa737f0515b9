"""``pipec show --measured REPORT`` on an ``--emulate`` report draws the report's re-simulated prediction (under
the run's measured hop and overhead) beside the measured, not the plan's own unit-cost one (the report's
``planned``). The report comes from a tiny emulation run in-process (ranks on threads, the fake transport)."""

from __future__ import annotations

import json
import threading

import pytest

from pipec.compiler.driver import compile_plan
from pipec.compiler.ir.plan_json import write_plan
from pipec.compiler.sim.simulate import emulated_costs, simulate_costs

UNIT_TIME = 0.002


def _emulate(plan) -> list:
    """One emulated step of every rank (``--emulate``'s tables: compute sleeps, placeholders travel)."""
    from pipec.runtime.executor import Executor
    from pipec.runtime.transport import FakeWorld

    world = FakeWorld(plan.mesh.pp, timeout=30)
    steps, errors = {}, []

    def rank(p: int) -> None:
        try:
            ex = Executor(plan, pp_rank=p, dp_rank=0, transport=world.transport(p), emulate=UNIT_TIME)
            steps[p] = ex.run_step(None, None)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(p,)) for p in range(plan.mesh.pp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return [steps[p] for p in range(plan.mesh.pp)]


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """(plan path, report path, plain report path, the re-simulated prediction) of a 1f1b 2 x 4 emulation."""
    from pipec.runtime.accounting import build_report

    d = tmp_path_factory.mktemp("emulated")
    plan = compile_plan(num_ranks=2, num_microbatches=4, schedule="1f1b").plan
    write_plan(plan, d / "p.json")
    per_step = [_emulate(plan)]
    resim = simulate_costs(plan, emulated_costs(plan, seconds_per_unit=UNIT_TIME, latency_s=2e-4, collective_s=2e-4,
                                                overhead={"FWD": 1e-4, "BWD": 1e-4}))
    kw = dict(tokens_per_step=None, flops_per_step=None, peak_flops=None)
    report = build_report(plan, str(d / "p.json"), per_step, predicted=resim, emulation={"latency_s": 2e-4}, **kw)
    assert "planned" in report
    (d / "report.json").write_text(json.dumps(report))
    (d / "plain.json").write_text(json.dumps(build_report(plan, str(d / "p.json"), per_step, **kw)))
    return d / "p.json", d / "report.json", d / "plain.json", resim


def _shown(monkeypatch, capsys, *argv):
    """What `pipec show` drew: the predicted Timeline handed to the terminal view, and the trace it wrote."""
    import pipec.views.summary as summary
    from pipec.cli import main

    drawn = {}
    real = summary.show

    def spy(timeline, **kw):
        drawn["predicted"], drawn["measured"], drawn["mesh"] = timeline, kw.get("measured"), kw.get("mesh")
        real(timeline, **kw)

    monkeypatch.setattr(summary, "show", spy)
    assert main(["show", *map(str, argv)]) == 0
    return drawn, capsys.readouterr().out


def test_show_draws_the_reports_resimulation_beside_the_measured(emulated, monkeypatch, capsys, tmp_path):
    plan, report, _, resim = emulated
    trace = tmp_path / "t.json"
    drawn, out = _shown(monkeypatch, capsys, plan, "--measured", report, "--trace", trace)
    assert drawn["predicted"].time_unit == "s" and drawn["predicted"].step_time == pytest.approx(resim.step_time)
    assert [(e.text, e.start) for e in drawn["predicted"].events] == [(e.text, pytest.approx(e.start)) for e in resim.events]
    assert drawn["measured"] is not None and "re-simulated" in out
    # the trace's predicted process holds the re-simulation's events too (in microseconds), not the units'
    events = json.loads(trace.read_text())["traceEvents"]
    pid = next(e["pid"] for e in events if e.get("ph") == "M" and e.get("args", {}).get("name", "").startswith("predicted"))
    durs = sorted(round(e["dur"], 3) for e in events if e.get("ph") == "X" and e["pid"] == pid)
    assert durs == sorted(round((e.end - e.start) * 1e6, 3) for e in resim.events)


def test_a_report_without_a_resimulation_is_drawn_beside_the_plans_prediction(emulated, monkeypatch, capsys):
    from pipec.compiler.ir.plan_json import read_plan

    plan, _, plain, _ = emulated
    drawn, out = _shown(monkeypatch, capsys, plan, "--measured", plain)
    assert drawn["predicted"] == read_plan(plan).prediction and "re-simulated" not in out


def test_the_views_get_the_reports_mesh_read_once(emulated, monkeypatch, capsys, tmp_path):
    from pipec.cli import main
    from pipec.compiler.ir.plan import Mesh

    plan, _, plain, _ = emulated
    drawn, _ = _shown(monkeypatch, capsys, plan)                  # no report: the plan's own mesh
    assert drawn["mesh"] == Mesh(pp=2)
    drawn, _ = _shown(monkeypatch, capsys, plan, "--measured", plain)
    assert drawn["mesh"] == Mesh(pp=2, dp=1, tp=1)
    report = json.loads(plain.read_text())
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**report, "mesh": {"pp": 2, "dp": 3}}))   # 2 x 3 ranks, but the run measured 2
    assert main(["show", str(plan), "--measured", str(bad)]) != 0
    assert "expected pp x dp = 2 x 3 = 6" in capsys.readouterr().err
    bad.write_text(json.dumps({**report, "mesh": {"pp": 2, "dp": "two"}}))
    assert main(["show", str(plan), "--measured", str(bad)]) != 0
    assert "mesh: expected pp, dp and tp as integers" in capsys.readouterr().err
