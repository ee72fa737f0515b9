"""pipec tune: the search against brute force over the same space, the budget, determinism, --keep,
the no-fit error, the written plan and schedule file, --json; --measure's runs (torchrun, last)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from dataclasses import replace

import pytest

from conftest import small_gpt_pipe, spec_file

from pipec.cli import main
from pipec.compiler.driver import compile_request, schedule_order
from pipec.compiler.frontend import build_stage_graph
from pipec.compiler.passes.memory import MemoryBudgetError
from pipec.compiler.ir.plan_json import read_plan
from pipec.tune.measure import measure, run_candidates
from pipec.tune.search import _pareto, _score, tune
from pipec.tune.space import TuneError, TuneRequest, candidate_request, candidates
from pipec.tune.bounds import bounds, candidate_frame
from pipec.compiler.passes.verify import verify
from pipec.dsl import load_spec
from model_requests import graph_key

SMALL = small_gpt_pipe()


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return spec_file(tmp_path_factory, SMALL)


def _request(path, **kw) -> TuneRequest:
    return TuneRequest(base=load_spec(path, {}).request, num_devices=kw.pop("num_devices", 2), **kw)


def _brute(treq: TuneRequest):
    """Every candidate compiled on its own (the front end run afresh per distinct request), with the
    least recompute of stages 0..k-1 that fits: the same space, no bounds, no shared cuts."""
    memo = {}
    out = []
    for c in candidates(treq):
        for k in range(c.num_stages + 1):
            cand = replace(c, recompute=frozenset(range(k)))
            req = candidate_request(treq, cand)
            key = graph_key(req)
            if key not in memo:
                memo[key] = build_stage_graph(req)
            try:
                plan = compile_request(req, graph=memo[key]).plan
            except MemoryBudgetError:
                continue
            step, mem, _ = bounds(cand, candidate_frame(req, memo[key], schedule_order(req)[0]))
            assert step <= plan.prediction.step_time * (1 + 1e-9), cand          # the bounds hold
            assert mem <= max(r.peak_memory_bytes for r in plan.prediction.per_rank), cand
            out.append(_score(cand, plan, 1, None, treq.num_devices))
            break
    return out


@pytest.fixture(scope="module")
def budget(small):
    """A budget some candidates exceed (so refusal and recompute are exercised)."""
    peaks = sorted(s.peak_memory for s in _brute(_request(small)))
    return peaks[len(peaks) // 3]


def test_search_matches_brute_force_and_keeps_the_budget(small, budget):
    treq = _request(small, device_memory=budget, num_top=4)
    got = tune(treq)
    want = sorted(_brute(treq), key=lambda s: s.rank_key())
    assert [(s.candidate, s.step_time) for s in got.top] == [(s.candidate, s.step_time) for s in want[:4]]
    kth = got.top[-1].step_time                    # the frontier: exact up to the table's last row
    assert [s.candidate for s in got.frontier if s.step_time < kth] == [
        s.candidate for s in _pareto(want) if s.step_time < kth]
    assert all(s.peak_memory <= budget for s in (*got.top, *got.frontier))
    assert got.num_over_budget > 0 and any(s.candidate.recompute for s in want)
    assert got.num_traces <= len({s.candidate.num_microbatches * s.candidate.dp for s in want})


def test_search_is_deterministic(small, budget):
    a, b = (tune(_request(small, device_memory=budget)) for _ in range(2))
    assert [s.candidate for s in a.top] == [s.candidate for s in b.top]
    assert a.best.plan.program == b.best.plan.program


def test_keep_pins_keys(small):
    got = tune(_request(small, num_devices=4, keep=frozenset({"pp", "schedule"})))
    assert {(s.candidate.pp, s.candidate.schedule) for s in got.top} == {(2, "1f1b")}
    assert {s.candidate.dp for s in got.top} == {2}
    with pytest.raises(TuneError, match="--keep names colour"):
        tune(_request(small, keep=frozenset({"colour"})))


def test_no_fit_says_what_would_fit(small, capsys):
    with pytest.raises(TuneError, match=r"use --devices \d+ or more") as err:
        tune(_request(small, device_memory=20_000))
    assert err.value.exit_code == 2
    assert main(["tune", small, "--devices", "2", "--device-memory", "20000", "-o", "x.json"]) == 2
    assert "no candidate fits device_memory" in capsys.readouterr().err


def test_cli_writes_a_verified_plan_and_a_schedule_file(small, tmp_path, capsys):
    plan_path, pipe_path = str(tmp_path / "plan.json"), str(tmp_path / "tuned.pipe")
    assert main(["tune", small, "--devices", "4", "-o", plan_path, "--pipe", pipe_path]) == 0
    out = capsys.readouterr().out
    assert "why this one:" in out and "time-memory frontier" in out and f"wrote {plan_path}" in out
    plan = read_plan(plan_path)
    verify(plan)
    assert plan.mesh.pp * plan.mesh.dp == 4
    assert main(["show", plan_path]) == 0
    again = compile_request(load_spec(pipe_path, {}).request).plan   # the written file compiles to the winner
    assert again.prediction.step_time == pytest.approx(plan.prediction.step_time)
    assert again.program == plan.program


def test_json_fields(small, tmp_path, capsys):
    plan_path = str(tmp_path / "plan.json")
    assert main(["tune", small, "--devices", "2", "--json", "-o", plan_path]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "pipec.tune/1" and doc["devices"] == 2 and doc["global_batch"] == 4
    assert set(doc["search"]) == {"candidates", "compiled", "pruned", "over_budget", "unbuildable", "traces", "cuts",
                                  "pieces", "timed", "level", "seconds"}
    assert doc["search"]["pieces"] is None and doc["search"]["timed"] == 0     # costs flops: nothing timed
    assert doc["search"]["level"] is None
    fields = {"pp", "dp", "tp", "shard", "shard_size", "schedule", "virtual", "microbatches", "partition",
              "recompute", "step_time", "tokens_per_s", "mfu", "scaling_efficiency", "bubble", "peak_memory_bytes"}
    assert set(doc["best"]) == fields and all(set(c) >= fields for c in doc["top"] + doc["frontier"])
    assert doc["best"] == doc["top"][0] and doc["plan"] == plan_path and doc["pipe"] and doc["why"]
    assert doc["best"]["step_time"] == pytest.approx(read_plan(plan_path).prediction.step_time)


NODES = SMALL + ("devices_per_node 2\n"
                 "links pp(latency=2us, bandwidth=5GB/s), dp(latency=3us, bandwidth=2GB/s), "
                 "intra(latency=1us, bandwidth=20GB/s), inter(latency=10us, bandwidth=1GB/s)\n")


@pytest.mark.slow  # every candidate of a 4-device space compiled and bounded (~20 s on 2 cores)
def test_the_bounds_hold_for_every_candidate_and_price_communication(tmp_path):
    """Layouts x shard modes x schedules x microbatches x recompute (none, all) on 4 devices in 2 nodes:
    the step bound (communication included) never exceeds the simulated step, the memory bound never the
    predicted peak; with one pp rank and parameters not sharded the step bound is the step."""
    path = tmp_path / "nodes.pipe"
    path.write_text(NODES)
    treq = _request(str(path), num_devices=4, global_batch=8)
    space = candidates(treq)
    assert {c.shard for c in space} == {"none", "optimizer", "grads", "full"}
    graphs = {}
    for c in space:
        for k in sorted({0, c.num_stages}):
            cand = replace(c, recompute=frozenset(range(k)))
            req = candidate_request(treq, cand)
            key = graph_key(req)
            if key not in graphs:
                graphs[key] = build_stage_graph(req)
            plan = compile_request(req, graph=graphs[key]).plan
            step, mem, state = bounds(cand, candidate_frame(req, graphs[key], schedule_order(req)[0]))
            assert step <= plan.prediction.step_time * (1 + 1e-9), cand
            assert state <= mem <= max(r.peak_memory_bytes for r in plan.prediction.per_rank), cand
            if cand.pp == 1 and cand.shard in ("none", "optimizer"):
                assert step == pytest.approx(plan.prediction.step_time, rel=1e-9), cand


def test_only_proven_plans_are_kept(small, budget, tmp_path, monkeypatch, capsys):
    """The search compiles without proofs and proves what it keeps: a plan that fails its proof is
    dropped and the next takes its place, in the table, the frontier and the written plan."""
    import pipec.tune.search as tune_module
    from pipec.compiler.passes.verify import VerifyError

    treq = _request(small, device_memory=budget, num_top=4)
    first = tune(treq)
    bad = first.best.plan.program
    real = tune_module.verify

    def failing(plan):
        if plan.program == bad:
            raise VerifyError("rank 0, instruction 0: made to fail by the test")
        return real(plan)

    monkeypatch.setattr(tune_module, "verify", failing)
    got = tune(treq)
    want = [s for s in sorted(_brute(treq), key=lambda s: s.rank_key()) if s.candidate != first.best.candidate]
    assert [(s.candidate, s.step_time) for s in got.top] == [(s.candidate, s.step_time) for s in want[:4]]
    assert got.num_unproven == 1 and all(s.plan.program != bad for s in (*got.top, *got.frontier))
    plan_path = str(tmp_path / "plan.json")
    assert main(["tune", small, "--devices", "2", "--device-memory", str(budget), "-o", plan_path]) == 0
    capsys.readouterr()
    assert read_plan(plan_path).program == got.best.plan.program != bad


def test_kept_plans_predict_what_a_full_compile_predicts(small, budget):
    """The search predicts its candidates without events and gives the plans it keeps (the table, the
    frontier, the file's own) the timeline of their proof: each the prediction, events and all, of
    compiling and proving the candidate alone."""
    treq = _request(small, device_memory=budget, num_top=4)
    got = tune(treq)
    kept = {s.candidate: s for s in (*got.top, *got.frontier, got.start_scored) if s is not None}
    assert got.best in got.top and len(kept) > 4
    for c, s in kept.items():
        req = candidate_request(treq, c)
        want = compile_request(req).plan
        assert s.plan.program == want.program, c
        assert s.plan.prediction == want.prediction and want.prediction.events, c
        bare = compile_request(req, verify=False, events=False).plan.prediction
        assert bare == replace(want.prediction, events=()) != want.prediction, c


def _ranks_left(folder) -> list[int]:
    """The processes still running whose command line names ``folder`` (a run's ranks), killed (Linux: /proc)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().rpartition(")")[2].split()[0] == "Z"
            with open(f"/proc/{pid}/cmdline") as f:
                cmd = f.read()
        except OSError:
            continue                    # ended meanwhile
        if not zombie and str(folder) in cmd and "pipec.runtime" in cmd:
            out.append(int(pid))
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    return out


@pytest.mark.slow  # three real runs under the runtime's launcher (~14 s on 2 cores)
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the ranks from /proc")
def test_measure_starts_the_ranks_here_and_notes_a_failed_or_overlong_run(small, tmp_path):
    """--measure starts each run's ranks from this process (the runtime's launcher, no pipec subprocess): the
    measured step re-ranks the table; a run that fails is noted with its ranks' error, one past its time limit is
    stopped, its ranks with it, and noted; the launcher leaves this process's signal handlers and environment as
    they were."""
    result = tune(_request(small, num_top=2))
    kept = ({sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)}, dict(os.environ))
    got, notes = measure(result, 1, workdir=str(tmp_path / "ok"), steps=3)
    assert notes == [] and got.best is got.top[0] and got.top[0].measured_step > 0
    assert [s.candidate for s in got.top] == [s.candidate for s in result.top]
    top = result.top[0]
    c = top.candidate
    lost = replace(top, plan=replace(top.plan, model={**top.plan.model, "target": "pipec_no_such_module:build"}))
    out, notes = run_candidates([lost], workdir=str(tmp_path / "failed"), steps=3)
    assert out == [lost] and len(notes) == 1, notes
    assert notes[0].startswith(f"{c.layout} {c.schedule}: the run failed (pipec: error: ") and \
        "cannot find module 'pipec_no_such_module'" in notes[0], notes
    out, notes = run_candidates([top], workdir=str(tmp_path / "slow"), steps=3, timeout=0.2)
    assert out == [top] and notes == [f"{c.layout} {c.schedule}: not measured: the run took over 0 s"]
    assert _ranks_left(tmp_path) == []
    assert ({sig: signal.getsignal(sig) for sig in kept[0]}, dict(os.environ)) == kept

