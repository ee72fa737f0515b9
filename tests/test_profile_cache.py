"""The profile cache (costs/cache.py; what decides each timing: costs/timings.py).

A timing is reused when nothing that decides it changed (the stage's own graph, the microbatch's shape and
dtype, threads per rank, the ranks sharing the host for the crowd, the host, torch's version) and measured
again when something did; entries are written whole under concurrent compiles; a damaged one is named and
measured again; ``--reprofile`` measures again; ``pipec cache`` shows and clears the folder.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import PYTHON, REPO
from pipec.compiler import progress
from pipec.costs import cache
from pipec.compiler.frontend import Host, Partition, TensorSpec, build_stage_graph
from pipec.compiler.request import CompileRequest
from pipec.costs import links
from pipec.costs import profile as prof
from pipec.costs import timings
from model_requests import model_request

X = TensorSpec("x", "float32", (8, 16))


HOST = Host(threads_per_rank=1, profile_reps=2, local_ranks=1)
"""One rank of one thread here, each stage timed twice."""


def _mlp(**kw) -> CompileRequest:
    base = dict(target="pipec.examples.mlp:build", kwargs=dict(layers=4, dim=16), inputs=(X,), num_microbatches=2,
                num_stages=2, costs="profile")
    return model_request(**{**base, **kw})


def _graph(req: CompileRequest, host: Host = HOST):
    return build_stage_graph(req, host=host)


@pytest.fixture(autouse=True)
def root(tmp_path, monkeypatch):
    """A cache of this test's own, empty, and a process that has measured nothing yet."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(cache, "_memory", {})
    monkeypatch.setattr(cache, "_not_before", 0.0)
    cache.take_notes()
    return tmp_path / "xdg" / "pipec"


def new_process() -> None:
    """What this process measured is forgotten, as by a compile in a new process (only the folder is left)."""
    cache._memory.clear()


@pytest.fixture()
def timed(monkeypatch):
    """The stages timed alone (one list per profile) and the number of crowds."""
    got = {"alone": [], "crowds": 0}
    real_alone, real_at_once = prof.Profiling.alone, prof._at_once

    def alone(self, runners, **kw):
        got["alone"].append(sorted(runners))
        return real_alone(self, runners, **kw)

    def at_once(*args, **kw):
        got["crowds"] += 1
        return real_at_once(*args, **kw)

    monkeypatch.setattr(prof.Profiling, "alone", alone)
    monkeypatch.setattr(prof, "_at_once", at_once)
    return got


def test_an_unchanged_model_is_timed_once(timed):
    first = _graph(_mlp())
    new_process()
    again = _graph(_mlp(num_microbatches=2, recompute=True))  # recompute: nothing more is timed
    assert timed["alone"] == [[0, 1]]  # the second compile timed nothing
    rec0, rec1 = first.model["profile"], again.model["profile"]
    assert [st["reused"] for st in rec0["stages"]] == [False, False]
    assert [st["reused"] for st in rec1["stages"]] == [True, True]
    assert [st["at"] for st in rec1["stages"]] == [st["at"] for st in rec0["stages"]]
    assert again.stages[1].cost.fwd == first.stages[1].cost.fwd and again.stages[1].cost.spread is not None
    assert again.stages[1].cost.bwd == pytest.approx(first.stages[1].cost.bwd + first.stages[1].cost.fwd)


@pytest.mark.parametrize("change", ["model", "shape", "dtype", "threads", "torch"])
def test_what_decides_a_timing_changed_times_it_again(change, timed, monkeypatch):
    _graph(_mlp())
    new_process()
    req, host = _mlp(), HOST
    if change == "model":
        req = _mlp(kwargs=dict(layers=4, dim=16, hidden=32))
    elif change == "shape":
        req = _mlp(inputs=(TensorSpec("x", "float32", (16, 16)),))
    elif change == "dtype":
        req = _mlp(dtype="bfloat16")
    elif change == "threads":
        host = dataclasses.replace(HOST, threads_per_rank=2)
    else:
        monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    got = _graph(req, host).model["profile"]
    assert timed["alone"] == [[0, 1], [0, 1]], change
    assert not any(st["reused"] for st in got["stages"])


def test_a_stage_of_another_cut_is_reused_and_so_is_the_crowd_of_its_shape(timed):
    three = _mlp(num_stages=3, partition=Partition("split", split_before=("blocks.1", "blocks.2")))
    two = _mlp(num_stages=2, partition=Partition("split", split_before=("blocks.1",)))
    local = dataclasses.replace(HOST, local_ranks=2)
    _graph(three, local)
    new_process()
    got = _graph(two, local).model["profile"]
    assert timed["alone"] == [[0, 1, 2], [1]]  # stage 0 (blocks.0) is the same stage in both cuts
    assert timed["crowds"] == 1 and got["crowd"]["reused"]  # one microbatch shape, one crowd
    assert [st["reused"] for st in got["stages"]] == [True, False]
    _graph(two, dataclasses.replace(HOST, local_ranks=3))
    assert timed["crowds"] == 2  # another number of ranks sharing the host: a crowd of its own


def test_stages_of_layers_alike_are_timed_once_in_a_compile_and_across_cuts(timed):
    four = _mlp(num_stages=4, partition=Partition("split", split_before=("blocks.1", "blocks.2", "blocks.3")))
    got = _graph(four)
    assert timed["alone"] == [[0, 1, 3]]  # blocks.1 and blocks.2: one layer each, alike (blocks.0 takes x)
    assert got.stages[2].cost == got.stages[1].cost and got.stages[3].cost != got.stages[1].cost
    new_process()
    three = _graph(_mlp(num_stages=3, partition=Partition("split", split_before=("blocks.2", "blocks.3")),
                        kwargs=dict(layers=4, dim=16)))
    assert timed["alone"] == [[0, 1, 3], [0]]  # blocks.0-1 is new; blocks.2 reads as blocks.1 did
    assert three.stages[1].cost == got.stages[1].cost
    assert [st["reused"] for st in three.model["profile"]["stages"]] == [False, True, True]


def test_a_tensor_parallel_stage_is_timed_sharded_as_its_rank_runs_it(monkeypatch):
    """Under tp 2 each stage is timed as its tp rank 0 runs it (the MLP's fc and proj at half their hidden width),
    its cost that rank's (``costs_local``: the simulator adds the collectives and scales nothing); the timings
    are new entries (tp 1's do not price it), and the single device's step scales them back to whole."""
    from pipec.costs import timings
    from pipec.compiler.sim.metrics import _unsharded

    shapes = []
    real = timings._stage_runner

    def runner(mod, sigs, sources, autocast):
        shapes.append(sorted(tuple(p.shape) for p in mod.parameters() if p.dim() == 2))
        return real(mod, sigs, sources, autocast)

    monkeypatch.setattr(timings, "_stage_runner", runner)
    one = _graph(_mlp())
    assert shapes == [[(16, 64), (16, 64), (64, 16), (64, 16)]] * 2  # tp 1: whole (hidden 4 x 16)
    shapes.clear()
    two = _graph(_mlp(tp=2))
    assert shapes == [[(16, 32), (16, 32), (32, 16), (32, 16)]] * 2  # a miss, timed as tp rank 0 holds them
    for st in two.stages:
        assert st.tp is not None and st.tp.costs_local and st.tp.to_json()["costs_local"] is True
        whole = _unsharded(st.cost, st, 2)
        assert whole.fwd == pytest.approx(st.cost.fwd / st.tp.compute_share(2))
    assert all(st.tp is None for st in one.stages)


def test_a_damaged_entry_is_named_and_measured_again(timed, root):
    first = _graph(_mlp())
    files = sorted((root / "stage").glob("*.json"))
    assert len(files) == 2
    entries = {p: json.loads(p.read_text()) for p in files}
    bad = next(p for p, e in entries.items() if e["key"]["stage"] == _digest(first, 1))
    bad.write_text(bad.read_text()[:40])  # a write cut short (not ours: ours are atomic)
    new_process()
    again = _graph(_mlp())
    assert timed["alone"] == [[0, 1], [1]]
    assert any(str(bad) in note and "damaged" in note for note in again.notes)
    assert [st["reused"] for st in again.model["profile"]["stages"]] == [True, False]
    assert json.loads(bad.read_text())["value"]["rounds"] >= 2  # written whole again
    for damage in ('{"format": "pipec.cache/1"}', json.dumps({**entries[bad], "key": {"stage": "another"}}),
                   json.dumps({**entries[bad], "value": {**entries[bad]["value"], "least": [1.0]}})):
        bad.write_text(damage)
        new_process()
        assert any("damaged" in n for n in _graph(_mlp()).notes), damage
    assert timed["alone"][2:] == [[1]] * 3


def _digest(graph, s: int) -> str:
    """Stage ``s``'s key digest in ``graph``'s cut."""
    from pipec.compiler.frontend import trace_request
    from pipec.model.partition import split_graph
    from pipec.costs.timings import stage_digest

    stage_of = {n: st.stage for st in graph.stages for n in st.nodes}
    return stage_digest(split_graph(trace_request(_mlp()).traced, stage_of, len(graph.stages)), s)


def _simulated_load(monkeypatch, load: float) -> None:
    """The host reads ``load`` other runnable processes, before and while the profile times (costs/load.py)."""
    from pipec.costs import load as host

    monkeypatch.setattr(host, "read_load", lambda: load)
    monkeypatch.setattr(timings, "read_load", lambda: load)
    monkeypatch.setattr(timings, "wait_for_cores", lambda need, cores, what: host.wait_for_cores(
        need, cores, what, read=lambda: load, sleep=lambda s: None))
    monkeypatch.setattr(host.Watch, "load", property(lambda self: load))


def test_a_profile_under_load_is_marked_and_timed_again_on_a_quiet_host(timed, monkeypatch):
    from types import SimpleNamespace

    from pipec.compiler.sim.history import profiled_under_load

    monkeypatch.setenv("PIPEC_PROFILE_LOAD", "act")
    monkeypatch.setenv("PIPEC_PROFILE_WAIT_S", "0")
    monkeypatch.setattr(prof, "usable_cores", lambda: 2)
    monkeypatch.setattr(timings, "usable_cores", lambda: 2)
    local = dataclasses.replace(HOST, local_ranks=2)  # 2 processes at once on 2 cores: any other load crowds them
    _simulated_load(monkeypatch, 1.0)
    busy = _graph(_mlp(), local).model["profile"]
    assert [(st["load"], st["loaded"]) for st in busy["stages"]] == [(1.0, False)] * 2  # 1 + 1 thread of 2 cores
    assert (busy["crowd"]["load"], busy["crowd"]["loaded"]) == (1.0, True)            # 1 + 2 processes of 2
    line = profiled_under_load(SimpleNamespace(model={"profile": busy}, links={}))
    assert line.startswith("profiled under load 1 (the crowd): predictions may be slow by up to 33% (the "
                           "contention model's figure"), line
    new_process()
    _graph(_mlp(), local)
    assert timed["crowds"] == 1  # still loaded: the marked crowd is kept
    _simulated_load(monkeypatch, 0.0)
    new_process()
    quiet = _graph(_mlp(), local).model["profile"]
    assert timed["crowds"] == 2 and timed["alone"] == [[0, 1]]  # the crowd timed again, the stages kept
    assert (quiet["crowd"]["loaded"], quiet["crowd"]["reused"]) == (False, False)
    assert any("1 timing taken under load up to 1 timed again on a quieter host (load 0 now)" in n
               for n in quiet["notes"])
    monkeypatch.setenv("PIPEC_PROFILE_LOAD", "record")  # the suite's setting: kept and marked, never timed again
    _simulated_load(monkeypatch, 3.0)
    new_process()
    cache.reprofile()
    marked = _graph(_mlp(), local).model["profile"]
    assert all(st["loaded"] for st in marked["stages"]) and marked["crowd"]["loaded"]
    _simulated_load(monkeypatch, 0.0)
    new_process()
    assert _graph(_mlp(), local).model["profile"]["crowd"]["reused"] and timed["crowds"] == 3


def test_a_busy_host_is_waited_for_at_most_the_bound(monkeypatch):
    from pipec.costs import load as host

    monkeypatch.setenv("PIPEC_PROFILE_LOAD", "act")
    monkeypatch.setenv("PIPEC_PROFILE_WAIT_S", "3")
    reads, now = iter([2.0, 2.0, 0.0]), [0.0]
    lines = []
    with progress.routed(lines.append):
        got = host.wait_for_cores(2, 2, "profiling", read=lambda: next(reads),
                                  sleep=lambda s: now.__setitem__(0, now[0] + s), clock=lambda: now[0])
    assert got == 0.0 and len(lines) == 2 and "waiting for the host (2 other processes want its 2 cores" in lines[0]
    stuck = host.wait_for_cores(2, 2, "profiling", read=lambda: 5.0,
                                sleep=lambda s: now.__setitem__(0, now[0] + s), clock=lambda: now[0])
    assert stuck == 5.0 and now[0] == pytest.approx(1 + 1 + 3)  # gave up after the bound: timed and marked
    monkeypatch.setenv("PIPEC_PROFILE_LOAD", "record")
    assert host.wait_s() == 0.0


def test_reprofile_measures_again_once(timed):
    _graph(_mlp())
    new_process()
    cache.reprofile()
    got = _graph(_mlp()).model["profile"]
    again = _graph(_mlp()).model["profile"]  # measured since --reprofile: used (tune's other cuts)
    assert timed["alone"] == [[0, 1], [0, 1]]
    assert not any(st["reused"] for st in got["stages"]) and again["stages"] == got["stages"]


_WRITER = textwrap.dedent("""
    import sys
    from pipec.costs import cache
    for i in range(int(sys.argv[1])):
        cache.store("stage", {"k": 1}, {"writer": sys.argv[2], "i": i, "pad": "x" * 60000})
""")


def test_concurrent_writers_never_leave_a_partial_entry(root):
    writers = [subprocess.Popen([PYTHON, "-c", _WRITER, "300", name], cwd=REPO) for name in ("a", "b")]
    seen = set()
    while any(w.poll() is None for w in writers):
        new_process()
        got = cache.lookup("stage", {"k": 1})
        if got is not None:
            seen.add(got.value["writer"])
            assert len(got.value["pad"]) == 60000
    assert [w.returncode for w in writers] == [0, 0]
    assert cache.take_notes() == []  # not one read found half a file
    assert seen and not list((root / "stage").glob(".tmp-*"))


@pytest.mark.slow  # two cold profiles at once, then a third (~14 s on 2 cores)
def test_two_compiles_at_once_then_one_that_reuses_every_timing(tmp_path, root):
    pipe = tmp_path / "mlp.pipe"
    pipe.write_text('model "pipec.examples.mlp:build" (layers=4, dim=16)\ninput x: float32[8, 16]\nloss mse\n'
                    "schedule 1f1b\npp 2  microbatches 2\ncosts profile\n"
                    "links pp(latency=10us, bandwidth=10GB/s), dp(latency=10us, bandwidth=10GB/s)\n")
    env = {**os.environ, "XDG_CACHE_HOME": str(root.parent)}
    jobs = [subprocess.Popen([PYTHON, "-m", "pipec", "compile", str(pipe), "-o", str(tmp_path / f"p{i}.json")],
                             cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i in range(2)]
    outs = [job.communicate(timeout=600) for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], outs
    files = sorted(root.rglob("*.json"))
    assert {p.parent.name for p in files} == {"host", "stage", "crowd"}
    for p in files:
        assert json.loads(p.read_text())["format"] == cache.FORMAT
    from pipec.cli import main

    assert main(["compile", str(pipe), "-o", str(tmp_path / "p2.json")]) == 0
    rec = json.loads((tmp_path / "p2.json").read_text())["model"]["profile"]
    assert all(st["reused"] for st in rec["stages"]) and rec["crowd"]["reused"]
    assert main(["compile", str(pipe), "--reprofile", "-o", str(tmp_path / "p3.json")]) == 0
    rec = json.loads((tmp_path / "p3.json").read_text())["model"]["profile"]
    assert not any(st["reused"] for st in rec["stages"]) and not rec["crowd"]["reused"]


_PROBED = {"links": {axis: {"latency_s": 1e-4, "bandwidth_Bps": 1e9,
                            "measured": {"at": "2026-01-01T00:00:00Z", "backend": "gloo", "ranks": 2}}
                     for axis in ("pp", "dp", "tie", "shard", "tp")},
           "overhead": {"seconds": {"FWD": 1e-5}, "measured": {"at": "2026-01-01T00:00:00Z", "backend": "gloo"}}}


def test_links_are_probed_once_per_host_and_backend_for_every_layout(monkeypatch, root):
    from pipec.compiler.driver import compile_plan

    probes = []
    monkeypatch.setattr(links, "_backend", lambda: "gloo")
    monkeypatch.setattr(links, "_probe", lambda plan, backend: probes.append(plan.mesh.sharded) or json.loads(
        json.dumps(_PROBED)))  # its links: pp, dp, tie, the all-gather's shard, tp
    plan = compile_plan(num_ranks=2, num_microbatches=2, schedule="1f1b").plan
    first, _ = links.measure_links(plan)
    new_process()
    again, notes = links.measure_links(plan)
    assert probes == [False] and again.links["pp"].latency_s == first.links["pp"].latency_s
    assert again.links["pp"].measured.reused and not first.links["pp"].measured.reused
    assert again.links["pp"].measured.at == "2026-01-01T00:00:00Z" and "kept in the profile cache" in notes[-1]
    assert again.overhead.measured.reused
    assert "shard" not in again.links or not again.links["shard"].measured  # an unsharded plan keeps no all-gather
    assert "tp" not in again.links  # nor a tp 1 plan the all-reduce between computes
    sharded = compile_plan(num_ranks=2, num_microbatches=2, schedule="1f1b", dp=2, shard="full").plan
    got, _ = links.measure_links(sharded)
    assert probes == [False] and got.links["shard"].measured.reused  # one probe for every layout
    with_tp = compile_plan(num_ranks=2, num_microbatches=2, schedule="1f1b", tp=2).plan
    got, _ = links.measure_links(with_tp)
    assert probes == [False] and got.links["tp"].measured.reused
    (path,) = (root / "links").glob("*.json")
    path.write_text("[]")
    new_process()
    _, notes = links.measure_links(plan)
    assert probes == [False, False] and any(str(path) in n and "damaged" in n for n in notes)
    cache.reprofile()
    links.measure_links(plan)
    assert probes == [False, False, False]


def test_pipec_cache_shows_and_clears_without_torch(root):
    cache.store("stage", {"k": 1}, {"v": 1})
    cache.store("crowd", {"k": 2}, {"v": 2})
    code = ("import sys; from pipec.cli import main; main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'pipec cache imported torch'")
    env = {**os.environ, "XDG_CACHE_HOME": str(root.parent)}

    def cli(*args):
        done = subprocess.run([PYTHON, "-c", code, *args], cwd=REPO, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    shown = cli("cache")
    assert shown.startswith(f"profile cache at {root}: 2 entries (1 stage, 1 crowd), ") and "bytes" in shown
    assert cli("cache", "--clear").startswith(f"cleared the profile cache at {root}: 2 entries")
    assert cli("cache") == f"profile cache at {root}: 0 entries, 0 bytes" and not root.exists()


def test_a_cache_folder_that_cannot_be_written_keeps_the_timings_in_the_process(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # a file where the folder should be
    cache.store("stage", {"k": 1}, {"v": 1})
    cache.store("stage", {"k": 2}, {"v": 2})
    notes = cache.take_notes()
    assert len(notes) == 1 and "cannot write" in notes[0]
    assert cache.lookup("stage", {"k": 1}).value == {"v": 1}


def test_progress_is_shown_on_a_terminal_only(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    tty, pipe = Terminal(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", pipe)
    progress.report("profiling stage 1/2 alone")
    progress.done()
    assert pipe.getvalue() == ""
    monkeypatch.setattr(sys, "stderr", tty)
    progress.report("profiling stage 1/2 alone")
    progress.done()
    assert tty.getvalue() == "\r\x1b[Kprofiling stage 1/2 alone\r\x1b[K"
    got = []
    with progress.routed(got.append):
        progress.report("measuring the links")
        progress.done()
    assert got == ["measuring the links", ""] and tty.getvalue().count("profiling") == 1


def test_a_crowds_repeat_takes_samples_from_one_up_until_its_minimum_time(monkeypatch):
    clock = iter(x * 0.01 for x in range(10_000))
    monkeypatch.setattr(prof.time, "perf_counter", lambda: next(clock))
    calls = []
    once = lambda: calls.append(1) or (0.0,) * 5  # noqa: E731 - each sample: one clock tick
    p = prof.Profiling(reps=3)
    assert len(p.samples(once, warm=True)) == 3  # alone: reps samples
    assert len(p.samples(once, warm=True, reps=1)) == 1  # one that outlasts no minimum
    assert len(p.samples(once, 0.05, warm=True, reps=1)) == 6  # short ones: until they took 0.05 s


def test_a_plan_profiled_under_load_says_so_at_compile_and_in_show(tmp_path, monkeypatch, capsys):
    from pipec.cli import main
    from pipec.compiler.ir.plan_json import read_plan

    monkeypatch.setenv("PIPEC_PROFILE_LOAD", "act")
    monkeypatch.setenv("PIPEC_PROFILE_WAIT_S", "0")
    _simulated_load(monkeypatch, 4.0)  # more than the cores any host has free for one thread here
    monkeypatch.setattr(timings, "usable_cores", lambda: 2)
    (tmp_path / "f.pipe").write_text('model "pipec.examples.mlp:build" (layers=4, dim=16)\ninput x: float32[8, 16]\n'
                                     'pp 2\nmicrobatches 2\nloss mse\ncosts profile\n')
    assert main(["compile", str(tmp_path / "f.pipe"), "-o", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "profiled under load 4 (2 of 2 stages and the crowd): predictions may be slow by up to 67% (the " \
           "contention model" in out, out
    stages = read_plan(str(tmp_path / "plan.json")).model["profile"]["stages"]
    assert [(st["load"], st["loaded"]) for st in stages] == [(4.0, True), (4.0, True)]  # plan.json keeps them
    assert main(["show", str(tmp_path / "plan.json")]) == 0
    assert "profiled under load 4 (2 of 2 stages and the crowd)" in capsys.readouterr().out
