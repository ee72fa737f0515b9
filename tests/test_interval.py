"""Predictions that say how sure they are: the step's interval from draws over the costs' measured spread, what
plan.json and report.json hold of it, and the run's check of its steps and of the host's load.

- A plan whose every stage cost carries a spread gets an interval (the same every time); unit or flops costs,
  or one stage never timed, get none (not a made-up one); no spread at all gives the point itself.
- Steps drawn the way the interval assumes (another seed) fall inside it about as often as it says.
- The profile's own uncertainty widens it: each stage's level (its median alone's standard error) drawn once per
  step, the crowd's slowdown (the scatter of its repeats) once per step for every stage at once, each
  instruction's host overhead from the probe's scatter.
- plan.json keeps a cost's spreads, the overhead's and the interval; a malformed interval is named.
- report.json marks each step in or out of the interval and sums it up, only for a run of the plan's own costs.
- The host's load before the first step against the profile's (read, no warning yet), and the warning the run's
  steps decide (recorded step series: never while the median step is inside; whenever most steps are outside).
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from types import SimpleNamespace

import pytest

from pipec.compiler.driver import compile_plan, prove_and_predict
from pipec.compiler.ir.plan import PlanError
from pipec.compiler.ir.plan_json import load_plan, plan_to_json, read_plan, write_plan
from pipec.compiler.ir.timeline import Interval
from pipec.compiler.sim.contention import load_factor
from pipec.compiler.sim.engine import execute
from pipec.compiler.sim.simulate import COVERAGE, interval_of, plan_costs
from pipec.runtime.accounting import build_report
from pipec.runtime.executor import RankStep
from pipec.schedules.timing import Cost

COST = Cost(fwd=0.01, bwd=0.02, bwd_i=0.01, bwd_w=0.01)


def _timed(spread: float | None = 0.1, host: float | None = 0.05, schedule: str = "1f1b", ranks: int = 4,
           load: float | None = None):
    """A plan in seconds whose stage costs carry ``spread`` (as costs profile times them) and whose profile
    recorded the host's spread and load."""
    plan = compile_plan(num_ranks=ranks, num_microbatches=2 * ranks, schedule=schedule).plan
    stages = tuple(replace(st, cost=replace(COST, spread=spread)) for st in plan.stages)
    profile = {"concurrent_ranks": ranks, "threads_per_rank": 1, "cores": 2,
               **({} if host is None else {"host_spread": host}), **({} if load is None else {"host_load": load})}
    plan = replace(plan, stages=stages, model={"target": "m:f", "profile": profile},
                   spec={**plan.spec, "costs": "profile"}, prediction=None)
    return prove_and_predict(plan)


def test_spread_costs_give_an_interval_the_same_every_time():
    plan = _timed()
    band = plan.prediction.interval
    assert band is not None and band.coverage == COVERAGE and band.draws == 20
    lo, hi = band.step_time
    assert 0 < lo < hi
    assert 0 <= band.bubble_fraction[0] < band.bubble_fraction[1] < 1
    assert lo < plan.prediction.step_time * 1.05 and hi > plan.prediction.step_time  # around the point, not off it
    assert _timed().prediction.interval == band
    wider = _timed(spread=0.3).prediction.interval
    assert wider.step_time[1] - wider.step_time[0] > hi - lo


def test_a_links_measured_spread_widens_the_interval_and_round_trips(tmp_path):
    """The pp link's spread (the probe's scatter of one message) draws each message's transfer: a plan whose
    messages take time gets a wider interval with it, the same every time, and plan.json keeps it."""
    from pipec.compiler.ir.plan import Link

    base = _timed(spread=0.05, host=None)
    slow = {**base.links, "pp": Link(latency_s=5e-3, bandwidth_Bps=1e9)}
    plain = prove_and_predict(replace(base, links=slow, prediction=None))
    spread = prove_and_predict(replace(base, links={**slow, "pp": replace(slow["pp"], spread=0.5)}, prediction=None))
    width = lambda p: p.prediction.interval.step_time[1] - p.prediction.interval.step_time[0]  # noqa: E731
    assert width(spread) > 1.5 * width(plain)
    assert spread.prediction.step_time == plain.prediction.step_time  # the point is the fixed costs'
    assert prove_and_predict(replace(spread, prediction=None)).prediction.interval == spread.prediction.interval
    write_plan(spread, str(tmp_path / "p.json"))
    again = read_plan(str(tmp_path / "p.json"))
    assert again.links["pp"].spread == 0.5 and plan_to_json(plain)["links"]["pp"].get("spread") is None


def test_no_spread_no_interval():
    unit = compile_plan(num_ranks=4, num_microbatches=8, schedule="1f1b").plan
    assert unit.prediction.interval is None  # unit costs: nothing was timed
    assert _timed(spread=None).prediction.interval is None  # flops-like costs in seconds: no spread
    some = _timed()
    stages = list(some.stages)
    stages[1] = replace(stages[1], cost=replace(stages[1].cost, spread=None))  # one stage never timed
    assert interval_of(replace(some, stages=tuple(stages))) is None
    assert "step_time_interval" not in plan_to_json(unit)["prediction"]


def test_a_spread_of_zero_is_the_point_prediction():
    plan = _timed(spread=0.0, host=None)
    assert plan.prediction.interval.step_time == (plan.prediction.step_time,) * 2


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1", "interleaved_1f1b"])
def test_steps_drawn_as_the_interval_assumes_fall_inside_about_as_often_as_it_says(schedule):
    """An interval is read from 20 draws; steps drawn the same way with other seeds (the run it stands for, when
    the spread is the one the run meets) fall inside it nine times in ten on average over intervals of other seeds
    (one interval's share scatters: it rests on 20 draws)."""
    plan = _timed(spread=0.15, host=0.1, schedule=schedule)
    costs = plan_costs(plan)
    kw = dict(placement=plan.placement, num_microbatches=plan.num_microbatches, edges=plan.edges, costs=costs,
              ties=plan.ties, record_events=False)
    steps = [execute(plan.program, **kw, rng=random.Random(1000 + i)).step_time for i in range(200)]
    shares = []
    for seed in range(12):
        band = interval_of(plan, costs, seed=seed)
        shares.append(sum(band.holds(t) for t in steps) / len(steps))
    assert 0.84 <= sum(shares) / len(shares) <= 0.95, shares


def test_plan_json_keeps_the_spread_and_the_interval(tmp_path):
    plan = _timed()
    write_plan(plan, str(tmp_path / "p.json"))
    back = read_plan(str(tmp_path / "p.json"))
    assert [st.cost.spread for st in back.stages] == [0.1] * 4
    assert back.prediction.interval == plan.prediction.interval
    raw = json.loads((tmp_path / "p.json").read_text())
    assert raw["prediction"]["coverage"] == 0.9 and len(raw["prediction"]["step_time_interval"]) == 2
    assert "spread" not in plan_to_json(compile_plan(num_ranks=2, num_microbatches=2, schedule="1f1b").plan)[
        "stages"][0]["cost"]
    lo, hi = raw["prediction"]["step_time_interval"]
    raw["prediction"]["step_time_interval"] = [hi, lo]
    with pytest.raises(PlanError, match=r"prediction\.step_time_interval: expected \[lo, hi\]"):
        load_plan(raw)
    del raw["prediction"]["coverage"]
    raw["prediction"]["step_time_interval"] = [lo, hi]
    with pytest.raises(PlanError, match=r"prediction\.coverage"):
        load_plan(raw)


def _steps(plan, times):
    """One RankStep per pp rank per step, the step taking ``times[i]``."""
    return [[RankStep(global_rank=r, step_time=t, compute=t / 2) for r in range(plan.mesh.pp)] for t in times]


def test_the_report_says_which_steps_fell_inside():
    plan = _timed()
    lo, hi = plan.prediction.interval.step_time
    mid = (lo + hi) / 2
    times = [3 * hi, mid, mid, hi * 1.5, lo * 0.5, mid]  # the first warms up
    kw = dict(tokens_per_step=None, flops_per_step=None, peak_flops=None)
    report = build_report(plan, "p.json", _steps(plan, times), **kw)
    assert [s["in_interval"] for s in report["steps"]] == [False, True, True, False, False, True]
    got = report["interval"]
    assert (got["steps_inside"], got["steps_counted"], got["after_first"]) == (3, 5, True)
    assert got["median_inside"] and got["step_time"] == [lo, hi] and got["coverage"] == 0.9
    # a re-simulated prediction (--emulate sleeps the costs): the plan's interval does not apply
    emulated = build_report(plan, "p.json", _steps(plan, times), predicted=plan.prediction, **kw)
    assert "interval" not in emulated and "in_interval" not in emulated["steps"][0]
    plain = compile_plan(num_ranks=4, num_microbatches=8, schedule="1f1b").plan
    assert "interval" not in build_report(plain, "p.json", _steps(plain, times), **kw)


def test_the_run_prints_where_its_steps_fell():
    from pipec.runtime.trainer import interval_line

    plan = _timed()
    lo, hi = plan.prediction.interval.step_time
    report = build_report(plan, "p.json", _steps(plan, [hi * 2, hi * 2, hi * 2]), tokens_per_step=None,
                          flops_per_step=None, peak_flops=None)
    line = interval_line(report)
    assert line.startswith(f"median step {hi * 2:.3f} s: above the predicted 90% interval {lo:.3f}-{hi:.3f} s")
    assert line.endswith("0 of 2 steps after the first inside")
    assert interval_line({"measured": {"step_time": 1.0}}) is None


def test_the_load_factor_is_the_share_of_the_cores():
    profile = {"concurrent_ranks": 4, "threads_per_rank": 1, "cores": 2, "host_load": 0.0}
    assert load_factor(profile, 0.0) == 1.0
    assert load_factor(profile, 2.0) == pytest.approx(6 / 4)
    assert load_factor({**profile, "concurrent_ranks": 1}, 1.0) == 1.0  # one rank and one busy process: a core each
    assert load_factor({**profile, "host_load": 4.0}, 0.0) == pytest.approx(4 / 8)
    assert load_factor({k: v for k, v in profile.items() if k != "host_load"}, 3.0) is None
    assert load_factor(None, 3.0) is None


@pytest.mark.parametrize("runnable, load", [([1, 3, 1, 1, 3], 0.0), ([3, 3, 1, 3, 2], 2.0)])
def test_the_host_load_is_the_median_of_its_reads(runnable, load, monkeypatch):
    """A process runnable in fewer than half of the reads (a launcher's blip, a waiting peer) is no load; one in
    most of them is (the reader itself is taken out of each count)."""
    import io

    from pipec.compiler.sim import contention

    reads = iter(runnable)
    monkeypatch.setattr(contention, "open", lambda *a, **k: io.StringIO(f"0.50 0.40 0.30 {next(reads)}/200 42"),
                        raising=False)
    monkeypatch.setattr(contention.time, "sleep", lambda s: None)
    assert contention.host_load() == load


def _check_load(plan, load_now, monkeypatch, capsys, *, emulate=False, device="cpu"):
    """Run Trainer.check_load on ``plan`` as rank 0 of a run whose host reads ``load_now``."""
    import pipec.compiler.sim.contention as contention
    from pipec.runtime.trainer import Trainer

    monkeypatch.setattr(contention, "host_load", lambda *a, **k: load_now)
    barriers = []
    me = SimpleNamespace(plan=plan, options=SimpleNamespace(emulate=emulate), device=SimpleNamespace(type=device),
                         transport=SimpleNamespace(barrier=lambda: barriers.append(1)), env=SimpleNamespace(rank=0),
                         host_load=None)
    Trainer.check_load(me)
    return me.host_load, capsys.readouterr().err, len(barriers)


def test_the_load_before_the_first_step_is_read_and_nothing_is_said_yet(monkeypatch, capsys):
    plan = _timed(load=0.0)
    got, err, barriers = _check_load(plan, 3.0, monkeypatch, capsys)
    assert got == {"profile": 0.0, "run": 3.0, "factor": pytest.approx(7 / 4)} and barriers == 2 and err == ""
    # nothing to compare with: an emulated run, a GPU run, a profile without its load
    for kw, p in (({"emulate": True}, plan), ({"device": "cuda"}, plan), ({}, _timed())):
        assert _check_load(p, 3.0, monkeypatch, capsys, **kw) == (None, "", 0)


_BAND = (0.09, 0.12)


@pytest.mark.parametrize("steps", [
    [0.10] * 7,                                    # all inside
    [0.10, 0.10, 0.10, 0.10, 0.30, 0.30, 0.30],    # 3 of 7 outside: the median inside
    [0.13, 0.13, 0.13, 0.10, 0.10, 0.11, 0.10],    # 3 of 7 above
    [0.142, 0.30, 0.31, 0.11, 0.10, 0.12, 0.115],  # the case: 1.75x warned while the median sat inside
])
def test_no_load_warning_while_the_median_step_is_inside(steps):
    from pipec.compiler.sim.history import load_warning

    for loads in (None, {"profile": 0.0, "run": 3.0, "factor": 1.75}, {"profile": 2.0, "run": 0.0, "factor": 0.6}):
        assert load_warning(steps, _BAND, 0.1, loads) is None


def test_the_load_warning_says_which_way_the_step_moved_and_whether_the_load_did():
    from pipec.compiler.sim.history import load_warning

    slow = [0.20, 0.21, 0.19, 0.22, 0.20, 0.10, 0.21]
    text = load_warning(slow, _BAND, 0.1, {"profile": 0.0, "run": 2.0, "factor": 1.5})
    assert text.startswith("the steps ran slower than predicted: median 0.200 s, 2.00x the predicted 0.100 s; "
                           "6 of 7 steps above the interval 0.090-0.120 s")
    assert "the host's load is 2, 0 when the plan was profiled: the load moved the way the step did, which the " \
           "contention model puts at 1.50x" in text
    fast = [0.05, 0.05, 0.06, 0.05, 0.05, 0.05]   # profiled under load, run on a quiet host: the other direction
    text = load_warning(fast, _BAND, 0.1, {"profile": 2.0, "run": 0.0, "factor": 0.6})
    assert text.startswith("the steps ran faster than predicted: median 0.050 s, 0.50x") and "6 of 6 steps below" in text
    assert "the load moved the way the step did" in text
    other = load_warning(fast, _BAND, 0.1, {"profile": 0.0, "run": 2.0, "factor": 1.5})
    assert "the load moved the other way, so it is not the cause; recompile with --reprofile" in other
    same = load_warning(slow, _BAND, 0.1, {"profile": 1.0, "run": 1.2, "factor": 1.05})
    assert "is the one the plan was profiled at (1): not the load's doing" in same
    assert "--reprofile" in load_warning(slow, _BAND, 0.1, None)
    assert load_warning(slow, None, 0.1, None) is None  # no interval: nothing to hold the steps to


def _levels(plan, level=None, crowd=None):
    """``plan`` with every stage's level and crowd spreads set, its prediction made again."""
    stages = tuple(replace(st, cost=replace(st.cost, level_spread=level, crowd_spread=crowd)) for st in plan.stages)
    return prove_and_predict(replace(plan, stages=stages, prediction=None))


def _width(plan) -> float:
    lo, hi = plan.prediction.interval.step_time
    return (hi - lo) / plan.prediction.step_time


def test_the_profiles_level_widens_the_interval_the_crowds_most():
    """A stage's level drawn on its own and the crowd's drawn once for every stage: at the same spread the shared
    draw moves the whole step, the stages' own draws partly cancel over the pipeline; neither moves the point."""
    base = _timed(spread=0.02, host=None, ranks=4)
    own, shared = _levels(base, level=0.1), _levels(base, crowd=0.1)
    assert _width(own) > 1.5 * _width(base)
    assert _width(shared) > 1.3 * _width(own)
    assert own.prediction.step_time == shared.prediction.step_time == base.prediction.step_time
    assert _levels(base, level=0.1).prediction.interval == own.prediction.interval  # seeded: the same every time
    assert _levels(_timed(spread=None), level=0.1, crowd=0.1).prediction.interval is None  # no spread: none


def test_scattered_crowd_repeats_give_a_wider_crowd_spread_and_a_wider_interval():
    from pipec.costs.profile import crowd_spread, level_spread

    steady = [(2.0, 2.1, 2.2, 1.0), (2.03, 2.1, 2.21, 1.0), (1.98, 2.1, 2.19, 1.0)]
    scattered = [(2.0, 2.1, 2.2, 1.0), (2.6, 2.1, 2.9, 1.0), (1.5, 2.1, 1.7, 1.0)]
    assert 0 < crowd_spread(steady) < 0.02 < 0.2 < crowd_spread(scattered)
    assert crowd_spread(steady[:1]) == 0.0  # one repeat: no scatter measured
    assert level_spread({"spread": 0.1, "rounds": 4}) == pytest.approx(1.2533 * 0.1 / 2)
    base = _timed(spread=0.02, host=None)
    assert _width(_levels(base, crowd=crowd_spread(scattered))) > 2 * _width(_levels(base, crowd=crowd_spread(steady)))


def test_the_overheads_scatter_widens_the_interval_and_round_trips(tmp_path):
    from pipec.compiler.ir.plan import Overhead

    base = _timed(spread=0.01, host=None)
    host = {"SEND_ACT": 2e-3, "SEND_GRAD": 2e-3, "RECV_ACT": 1e-3, "RECV_GRAD": 1e-3}
    plain = prove_and_predict(replace(base, overhead=Overhead(seconds=host), prediction=None))
    spread = prove_and_predict(replace(base, overhead=Overhead(seconds=host, spread=dict.fromkeys(host, 0.5)),
                                       prediction=None))
    assert _width(spread) > 1.5 * _width(plain)
    assert spread.prediction.step_time == plain.prediction.step_time
    write_plan(_levels(spread, level=0.03, crowd=0.07), str(tmp_path / "p.json"))
    back = read_plan(str(tmp_path / "p.json"))
    assert back.overhead.spread == dict.fromkeys(host, 0.5)
    assert [(st.cost.level_spread, st.cost.crowd_spread) for st in back.stages] == [(0.03, 0.07)] * 4
    assert back.prediction.interval == _levels(spread, level=0.03, crowd=0.07).prediction.interval
    raw = plan_to_json(plain)
    assert "spread" not in raw["overhead"] and "level_spread" not in raw["stages"][0]["cost"]
    raw["overhead"]["spread"] = {"SEND": 0.1}
    with pytest.raises(PlanError, match=r"overhead\.spread\.SEND: expected an opcode name"):
        load_plan(raw)


def _tailed(fast: float, slow: float, n: int = 20) -> tuple[float, ...]:
    """A probe's samples: ``fast`` in most rounds, ``slow`` in 1 of 10 (the stall tail a MAD spread does not see)."""
    return tuple(slow if i % 10 == 9 else fast for i in range(n))


def test_a_links_samples_draw_each_message_with_its_tail_and_round_trip(tmp_path):
    """The pp link's samples (the probe's rounds of its smallest message) draw each message's transfer as the
    transfer x a sample over their mean: a tail of stalls in 1 of 10 rounds, which a MAD spread reads as none,
    lifts the interval's top; the point (the fixed costs', the link's mean) does not move; plan.json keeps them."""
    from pipec.compiler.ir.plan import Link

    base = _timed(spread=0.01, host=None)
    samples = _tailed(1e-3, 10e-3)
    slow = {**base.links, "pp": Link(latency_s=sum(samples) / len(samples), bandwidth_Bps=1e9, spread=0.0)}
    plain = prove_and_predict(replace(base, links=slow, prediction=None))
    drawn = prove_and_predict(replace(base, links={**slow, "pp": replace(slow["pp"], samples=samples)},
                                      prediction=None))
    assert plan_costs(drawn).hop_draws == pytest.approx([x / 1.9e-3 for x in samples])
    assert drawn.prediction.step_time == plain.prediction.step_time
    assert drawn.prediction.interval.step_time[1] > plain.prediction.interval.step_time[1] + 5e-3
    assert prove_and_predict(replace(drawn, prediction=None)).prediction.interval == drawn.prediction.interval
    write_plan(drawn, str(tmp_path / "p.json"))
    back = read_plan(str(tmp_path / "p.json"))
    assert back.links["pp"].samples == samples and back.prediction.interval == drawn.prediction.interval
    assert "samples" not in plan_to_json(plain)["links"]["pp"]
    raw = plan_to_json(drawn)
    raw["links"]["pp"]["samples"][3] = -1.0
    with pytest.raises(PlanError, match=r"links\.pp\.samples\[3\]: expected a number >= 0"):
        load_plan(raw)
    raw["links"]["pp"]["samples"] = []
    with pytest.raises(PlanError, match=r"links\.pp\.samples: expected a non-empty list"):
        load_plan(raw)


def test_an_overheads_samples_replace_its_spread_and_round_trip(tmp_path):
    """An opcode with samples draws each instruction's overhead as its seconds x a sample over their median (its
    spread is not drawn as well): samples all alike scale by 1 whatever the spread says; a tail widens."""
    from pipec.compiler.ir.plan import Overhead

    base = _timed(spread=0.01, host=None)
    host = {"SEND_ACT": 2e-3, "SEND_GRAD": 2e-3, "RECV_ACT": 1e-3, "RECV_GRAD": 1e-3}

    def with_overhead(**kw):
        return prove_and_predict(replace(base, overhead=Overhead(seconds=host, **kw), prediction=None))

    plain = with_overhead()
    alike = with_overhead(samples=dict.fromkeys(host, (1e-3,) * 5))
    also_spread = with_overhead(spread=dict.fromkeys(host, 0.5), samples=dict.fromkeys(host, (1e-3,) * 5))
    tailed = with_overhead(samples=dict.fromkeys(host, _tailed(1e-3, 8e-3)))
    assert also_spread.prediction.interval == alike.prediction.interval
    assert _width(alike) < 0.02 and _width(tailed) > 5 * _width(alike)
    assert tailed.prediction.interval.step_time[1] > 1.1 * plain.prediction.interval.step_time[1]
    assert tailed.prediction.step_time == plain.prediction.step_time
    write_plan(tailed, str(tmp_path / "p.json"))
    back = read_plan(str(tmp_path / "p.json"))
    assert back.overhead.samples == dict.fromkeys(host, _tailed(1e-3, 8e-3))
    assert back.prediction.interval == tailed.prediction.interval
    raw = plan_to_json(tailed)
    raw["overhead"]["samples"] = {"SEND": [1e-3]}
    with pytest.raises(PlanError, match=r"overhead\.samples\.SEND: expected an opcode name"):
        load_plan(raw)


def test_an_all_reduces_samples_draw_its_duration():
    """The dp link's samples (the probe's rounds of its smallest all-reduce) draw each dp ``ALLREDUCE``'s duration
    as the duration x a sample over their median: a tail lifts the interval's top, the point stays."""
    from pipec.compiler.ir.plan import Link

    plan = compile_plan(num_ranks=2, num_microbatches=4, schedule="1f1b", dp=2).plan
    stages = tuple(replace(st, cost=replace(COST, spread=0.01), param_bytes=1 << 20) for st in plan.stages)
    links = {**plan.links, "dp": Link(latency_s=5e-3, bandwidth_Bps=1e9)}
    plan = replace(plan, stages=stages, links=links, model={"target": "m:f", "profile": {}},
                   spec={**plan.spec, "costs": "profile"}, prediction=None)
    plain = prove_and_predict(plan)
    tail = _tailed(1e-3, 10e-3)
    drawn = prove_and_predict(replace(plan, links={**links, "dp": replace(links["dp"], samples=tail)}))
    assert plan_costs(drawn).collective_draws["dp"] == pytest.approx([x / 1e-3 for x in tail])
    assert drawn.prediction.step_time == plain.prediction.step_time
    assert drawn.prediction.interval.step_time[1] > plain.prediction.interval.step_time[1] + 5e-3


def test_the_links_probe_keeps_its_samples_for_the_draws(tmp_path, monkeypatch):
    """A real probe (two gloo ranks here) writes the samples the draws take: the pp link's and the all-reduce's
    rounds of their smallest size (SAMPLE_ROUNDS of each) and each overhead kind's instructions; the plan's cost
    model scales by them over their figure (the mean hop, the median all-reduce and overhead)."""
    from pipec.costs import links
    from pipec.runtime.linkprobe import SAMPLE_ROUNDS

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    plan, notes = links.measure_links(compile_plan(num_ranks=2, num_microbatches=4, schedule="1f1b").plan)
    assert plan.links["pp"].measured is not None, notes
    assert len(plan.links["pp"].samples) == len(plan.links["dp"].samples) == SAMPLE_ROUNDS
    assert set(plan.overhead.samples) == set(plan.overhead.seconds)
    costs = plan_costs(replace(_timed(ranks=2), links=plan.links, overhead=plan.overhead))
    assert sum(costs.hop_draws) / len(costs.hop_draws) == pytest.approx(1.0)
    assert sorted(costs.collective_draws) == ["dp", "tie"]
    assert costs.overhead_draws.keys() == plan.overhead.samples.keys()
