"""runtime/linkprobe.py's emulation probe: the hops of the plan's own messages from the posts' and waits' times,
each figure a mean over every rank's samples, the median over the probe's steps; the links probe job stopped with
its ranks when it runs past its time (costs/links.py)."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from pipec.compiler.driver import compile_plan
from pipec.runtime.linkprobe import (STALLED, Emulation, _handler_times, _hops, _medians, _pooled, _step_figures,
                                     _step_samples, _Timings)


def _msg(i: int) -> tuple:
    return (0, 0, "A", 0, 1, i)


def _timings(host, oversleeps, hop) -> _Timings:
    """One rank's probe step: its host samples, oversleeps, and one message waited for ``hop`` past its posts."""
    t = _Timings(host=host, oversleeps=oversleeps)
    t.posted[(True, _msg(0))] = t.posted[(False, _msg(0))] = 1.0
    t.waits.append((_msg(0), 0.5, 1.0 + hop))
    return t


def test_a_hop_is_what_a_waiting_receiver_waits_past_both_posts():
    posted = {}
    for i, (send, recv) in enumerate([(1.0, 0.5), (2.0, 2.0), (3.0, 3.0), (4.0, 4.0)]):
        posted[(True, _msg(i))], posted[(False, _msg(i))] = send, recv
    waits = [
        (_msg(0), 0.9, 1.2),  # waiting before the send was posted: the hop is 0.2 past it
        (_msg(1), 2.000005, 2.1),  # waits at once after its own receive's post (within the typical hop): 0.1
        (_msg(2), 3.5, 3.50001),  # came long after: the message was there, no hop shows
        (_msg(3), 4.3, 4.4),  # came after a typical message would have arrived: no hop shows
        (_msg(9), 0.0, 1.0),  # never posted here (another host's half): left out
    ]
    assert _hops(posted, waits) == pytest.approx([0.2, 0.1])
    assert _hops(posted, []) == []


def test_step_figures_are_means_over_every_rank_and_their_median_over_steps():
    quiet = [_timings({"FWD": [1.0, 3.0]}, [0.1], 0.2), _timings({"FWD": [2.0], "OPT": [5.0]}, [0.3], 0.2)]
    figures = _step_figures(quiet, one_host=True)
    assert figures == pytest.approx({"FWD": 2.0, "OPT": 5.0, "oversleep_s": 0.2, "latency_s": 0.2, "hops": 2})
    assert "latency_s" not in _step_figures(quiet, one_host=False)  # clocks of two hosts do not compare
    stalled = [_timings({"FWD": [900.0]}, [90.0], 50.0), _timings({"FWD": [2.0]}, [0.1], 0.2)]
    again = [_timings({"FWD": [2.5]}, [0.2], 0.3), _timings({"FWD": [2.5]}, [0.2], 0.3)]
    steps = [_step_figures(s, one_host=True) for s in (quiet, stalled, again)]
    median = _medians(steps)
    assert median["FWD"] == pytest.approx(2.5) and median["oversleep_s"] == pytest.approx(0.2)
    assert median["latency_s"] == pytest.approx(0.3)  # the stalled step's 25 s hop moves nothing


def test_the_probe_times_every_post_and_every_receive_of_the_plan():
    """In-process ranks: each probe step keeps each post's return and each receive's wait by message, so the
    hops pair up across ranks; every one is non-negative and at most one per message."""
    from pipec.runtime.executor import Executor
    from pipec.runtime.transport import FakeWorld

    plan = compile_plan(num_ranks=2, num_microbatches=4, schedule="1f1b").plan
    world = FakeWorld(2, timeout=30)

    def rank(p):
        return _handler_times(Executor(plan, pp_rank=p, dp_rank=0, transport=world.transport(p), emulate=0.001),
                              steps=2)

    with ThreadPoolExecutor(2) as pool:  # a rank's exception is raised here
        got = list(pool.map(rank, range(2)))
    num_messages = sum(i.op.value.startswith("SEND") for r in plan.program.ranks for i in r)
    for step in range(2):
        ts = [got[p][step] for p in range(2)]
        posted = {k: v for t in ts for k, v in t.posted.items()}
        assert len(posted) == 2 * num_messages and {k[1][0] for k in posted} == {step}
        waits = [w for t in ts for w in t.waits]
        assert len(waits) == num_messages  # every receive is waited for once, by the compute that uses it
        hops = _hops(posted, waits)
        assert 0 < len(hops) <= num_messages and all(h >= 0 for h in hops)
        assert all(len(t.oversleeps) == sum(i.op.value in ("FWD", "BWD") for i in plan.program.ranks[p])
                   for p, t in enumerate(ts))


def _same(got, want):
    assert set(got) == set(want) and all(list(got[k]) == pytest.approx(list(v)) for k, v in want.items())


def test_the_probe_steps_raw_samples_are_pooled_and_reported_in_summary():
    step = [_timings({"FWD": [1.0, 3.0]}, [0.1], 0.2), _timings({"FWD": [2.0], "OPT": [5.0]}, [-0.3], 0.4)]
    samples = _step_samples(step, one_host=True)
    _same(samples, {"FWD": [1.0, 3.0, 2.0], "OPT": [5.0], "oversleep": [0.1, -0.3], "hop": [0.2, 0.4]})
    assert "hop" not in _step_samples(step, one_host=False)
    stalled = {"FWD": [900.0]}
    quiet = {"FWD": [1.0], "oversleep": [0.5]}
    # a step is left out once its total passes STALLED x the median step's: one at the bound is kept
    at_bound, past = {"FWD": [STALLED * 1.0]}, {"FWD": [STALLED * 1.0 + 0.01]}
    assert _pooled([{"FWD": [1.0]}] * 3 + [at_bound, past]) == {"FWD": (1.0, 1.0, 1.0, STALLED)}
    # totals 11.4, 1.5 and 900: the median 11.4, so the stalled step is left out; the rest pooled in step
    # order, a negative sample (a clock's noise) as none
    _same(_pooled([samples, stalled, quiet]),
          {"FWD": (1.0, 3.0, 2.0, 1.0), "OPT": (5.0,), "oversleep": (0.1, 0.0, 0.5), "hop": (0.2, 0.4)})
    _same(_pooled([quiet, quiet]), {"FWD": (1.0, 1.0), "oversleep": (0.5, 0.5)})  # none stalled: all kept
    assert _pooled([]) == {}
    emu = Emulation(latency_s=0.3, collective_s=0.0, oversleep_s=0.0, overhead={"FWD": 2.0}, backend="gloo",
                    samples={"FWD": (1.0, 3.0, 2.0), "hop": (0.2, 0.4)})
    got = emu.to_json()
    assert got["draws"] == 15 and got["samples"]["FWD"] == {"count": 3, "mean": 2.0, "median": 2.0, "max": 3.0}
    assert Emulation(latency_s=0.3, collective_s=0.0, oversleep_s=0.0, overhead={}, backend="gloo").to_json()[
        "draws"] == 0


def _running(pid: int) -> bool:
    """Whether process ``pid`` is alive (not ended, nor a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the ranks from /proc")
def test_a_probe_job_past_its_time_is_stopped_with_its_ranks(tmp_path, monkeypatch):
    """A links probe job past its time leaves the default links and says why, and leaves no rank behind."""
    from pipec.costs import links

    monkeypatch.setattr(links, "PROBE_TIMEOUT_S", 0.01)  # a forked probe takes about a second, a fresh one several
    plan = compile_plan(num_ranks=2, num_microbatches=2, schedule="1f1b").plan
    assert links._probe(plan, "gloo") == "the probe job took more than 0.01 s"
    (tmp_path / "hanging_rank.py").write_text(  # a rank that says it started, then hangs
        "import os, sys, time\nopen(os.path.join(sys.argv[1], str(os.getpid())), 'w').close()\ntime.sleep(600)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(links, "PROBE_TIMEOUT_S", 3.0)
    for fork in (True, False):  # forked from here (gloo), or a fresh interpreter (NCCL)
        folder = tmp_path / f"fork{fork}"
        folder.mkdir()
        got = links._run_ranks("hanging_rank", [str(folder)], str(folder / "out.json"), str(folder), fork=fork)
        assert got == "the probe job took more than 3 s", fork
        pids = [int(f.name) for f in folder.iterdir() if f.name.isdigit()]
        assert len(pids) == 2, fork
        left = [pid for pid in pids if _running(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert left == [], fork


def test_a_probe_rank_that_fails_is_reported_by_its_last_line(tmp_path, monkeypatch):
    from pipec.costs import links

    (tmp_path / "failing_rank.py").write_text("import os, sys\nif os.environ['RANK'] == '1':\n"
                                             "    sys.exit('rank 1: cannot reach rank 0')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    for fork in (True, False):
        got = links._run_ranks("failing_rank", [], str(tmp_path / "out.json"), str(tmp_path), fork=fork)
        assert got == "the probe job failed: rank 1: cannot reach rank 0", fork
