"""The interval held to what earlier runs on this host measured (compiler/sim/history.py).

- A run of a plan with an interval keeps its steps (after the first) as ratios to the point, per host key; the
  latest KEEP_RUNS are kept, --reprofile keeps them (outcomes, not timings), a damaged entry is named and ignored.
- A compile with at least MIN_RUNS runs profiled (and run) at its host load widens its step range to hold the
  stated share of their ratios, the union with the simulator's; fewer runs, runs at another load, a run whose load
  had moved, another host key: the simulator's range alone.
- Steps drawn like the kept ones fall inside the widened range about as often as it says.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from pipec.costs import cache
from pipec.compiler.driver import compile_plan, prove_and_predict
from pipec.compiler.ir.plan_json import read_plan, write_plan
from pipec.compiler.sim import history
from pipec.compiler.sim.simulate import interval_of
from pipec.schedules.timing import Cost

HOST = {"threads": 1, "cores": 2, "cpu_count": 2, "device": "cpu", "torch": "2.13.0", "method": 3}


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cache._memory.clear()
    cache.take_notes()
    yield
    cache._memory.clear()


def _plan(load: float | None = 0.0, host=HOST, ranks: int = 2):
    """A 1F1B plan in seconds whose stage costs carry a spread and whose profile names its host and load."""
    plan = compile_plan(num_ranks=ranks, num_microbatches=4, schedule="1f1b").plan
    stages = tuple(replace(st, cost=Cost(fwd=0.01, bwd=0.02, bwd_i=0.01, bwd_w=0.01, spread=0.05))
                   for st in plan.stages)
    profile = {"concurrent_ranks": ranks, "threads_per_rank": 1, "cores": 2, "host_spread": 0.02,
               **({} if host is None else {"host": host}), **({} if load is None else {"host_load": load})}
    return prove_and_predict(replace(plan, stages=stages, model={"target": "m:f", "profile": profile},
                                     spec={**plan.spec, "costs": "profile"}, prediction=None))


def _run(plan, ratios, run_load=None):
    history.record(plan, [r * plan.prediction.step_time for r in ratios], run_load=run_load)


def _band(plan):
    return interval_of(plan, point=plan.prediction.step_time)


def test_runs_on_this_host_widen_the_interval_to_hold_their_steps():
    plan = _plan()
    point, alone = plan.prediction.step_time, interval_of(plan)
    assert alone.runs == 0 and alone.step_time[1] < 1.3 * point
    _run(plan, [1.4, 1.5, 1.45, 1.6, 1.5, 1.55, 1.5])
    _run(plan, [1.3, 1.35, 1.4, 1.5, 1.45, 1.5, 1.4])
    assert _band(plan) == alone  # two runs: too few
    _run(plan, [1.45, 1.5, 1.55, 1.4, 1.65, 1.5, 1.5])
    band = _band(plan)
    assert band.runs == 3 and band.draws == alone.draws and band.bubble_fraction == alone.bubble_fraction
    # 3 runs, the unit (their steps move together): fewer than 19, so the greatest and the least of their steps;
    # the least (1.3) is above the simulator's own low end, which stays
    assert band.step_time[1] == pytest.approx(1.65 * point)
    assert band.step_time[0] == alone.step_time[0]
    # the compile's own line says so, and plan.json keeps it
    from pipec.views.summary import interval_words

    assert interval_words(replace(plan.prediction, interval=band)).endswith(", widened to 3 earlier runs here")


def test_only_runs_like_the_next_one_count():
    plan = _plan(load=0.0)
    for _ in range(3):
        _run(plan, [2.0] * 7, run_load=1.0)  # the load moved between the compile and the run
    assert _band(plan).runs == 0
    loaded = _plan(load=1.0)
    for _ in range(3):
        _run(loaded, [2.0] * 7, run_load=1.0)
    assert _band(plan).runs == 0 and _band(loaded).runs == 3
    other_host = _plan(host={**HOST, "torch": "2.14.0"})
    four = _plan(ranks=4)
    assert _band(other_host).runs == 0 and _band(four).runs == 0
    no_host = _plan(host=None)
    _run(no_host, [2.0] * 7)
    assert history.history_key(no_host) is None and _band(no_host).runs == 0
    assert not (cache.cache_root() / "runs").exists() or len(list((cache.cache_root() / "runs").iterdir())) == 1


def test_the_latest_runs_are_kept_and_reprofile_keeps_them(tmp_path):
    plan = _plan()
    _run(plan, [2.0] * 10 + [1.0] * history.KEEP_STEPS)  # a long run: its last steps
    assert history._runs(history.history_key(plan))[0]["ratios"] == [pytest.approx(1.0)] * history.KEEP_STEPS
    for i in range(history.KEEP_RUNS + 5):
        _run(plan, [1.0 + i / 100])
    runs = history._runs(history.history_key(plan))
    assert len(runs) == history.KEEP_RUNS and runs[-1]["ratios"] == [pytest.approx(1.0 + (history.KEEP_RUNS + 4) / 100)]
    # 40 runs: the ceil(41 x 0.95) = 39th of 40 runs' steps, not the greatest (1.44)
    assert _band(plan).step_time[1] == pytest.approx(1.43 * plan.prediction.step_time)
    cache.reprofile()
    assert len(history._runs(history.history_key(plan))) == history.KEEP_RUNS
    assert cache.summary()["by_kind"]["runs"] == 1
    write_plan(replace(plan, prediction=replace(plan.prediction, interval=_band(plan))), str(tmp_path / "p.json"))
    assert json.loads((tmp_path / "p.json").read_text())["prediction"]["interval_runs"] == history.KEEP_RUNS
    assert read_plan(str(tmp_path / "p.json")).prediction.interval.runs == history.KEEP_RUNS


def test_a_damaged_runs_entry_is_named_and_ignored():
    plan = _plan()
    for _ in range(3):
        _run(plan, [1.5] * 7)
    path = next((cache.cache_root() / "runs").iterdir())
    obj = json.loads(path.read_text())
    obj["value"]["runs"][0]["ratios"] = [-1]
    path.write_text(json.dumps(obj))
    cache._memory.clear()
    assert _band(plan).runs == 0
    assert any("damaged" in n and "runs" in n for n in cache.take_notes())


def test_steps_like_the_kept_ones_fall_inside_as_often_as_it_says():
    plan = _plan()
    rng = random.Random(3)
    draw = lambda: [rng.lognormvariate(0.35, 0.15) for _ in range(7)]  # noqa: E731 - 1.4x the point, scattered
    for _ in range(6):
        _run(plan, draw())
    band = _band(plan)
    later = [x * plan.prediction.step_time for _ in range(200) for x in draw()]
    share = sum(band.holds(t) for t in later) / len(later)
    assert 0.85 <= share <= 0.99, share
    assert interval_of(plan).holds(plan.prediction.step_time * 1.4) is False  # the simulator's alone misses them


def test_how_slow_a_prediction_profiled_under_load_may_be_comes_from_runs_at_both_loads():
    from pipec.compiler.sim.history import _quiet_runs_ratio

    runs = [{"load": 2.0, "run_load": 0.0, "ratios": [0.6, 0.62, 0.61]},   # profiled loaded, run quiet
            {"load": 2.1, "run_load": 0.2, "ratios": [0.7, 0.7]},
            {"load": 2.0, "run_load": 2.0, "ratios": [1.0, 1.0]},          # run loaded too: not a quiet run
            {"load": 0.0, "run_load": 0.0, "ratios": [1.02, 0.98, 1.0]}]   # profiled and run quiet
    assert _quiet_runs_ratio(runs, 2.0) == pytest.approx(0.61 / 1.0)
    assert _quiet_runs_ratio(runs[:2], 2.0) == pytest.approx(0.61)  # no quiet profile kept: against 1
    assert _quiet_runs_ratio(runs, 4.0) is None
