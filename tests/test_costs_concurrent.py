"""costs profile timed the way the run runs: as many processes at once as the run has ranks here, each
round and repeat until its median is known (costs/profile.py)."""

from __future__ import annotations

import multiprocessing as mp
import random

import pytest
import torch

from pipec.compiler.frontend import Host, TensorSpec, build_stage_graph
from pipec.costs import costs
from pipec.costs import profile as prof
from pipec.model.tensors import FrontendError
from pipec.compiler.ir.plan import Cost
from model_requests import model_request

X = TensorSpec("x", "float32", (8, 16))


def _profiled(local_ranks: int, stages: int = 2, microbatches: int = 2):
    """The MLP in ``stages`` stages, timed as ``local_ranks`` ranks of one thread each run it on this machine."""
    req = model_request(target="pipec.examples.mlp:build", kwargs=dict(layers=4, dim=16), inputs=(X,),
                        num_microbatches=microbatches, num_stages=stages, costs="profile")
    return build_stage_graph(req, host=Host(threads_per_rank=1, profile_reps=2, local_ranks=local_ranks))


@pytest.mark.parametrize("num_ranks,num_stages", [(4, 8), (4, 5), (4, 4), (4, 2), (3, 1), (2, 3)])
def test_every_stage_is_timed_at_once_by_some_process(num_ranks, num_stages):
    prof = costs.Profiling(num_ranks=num_ranks)
    shares = [prof.share(r, num_stages) for r in range(num_ranks)]
    assert all(shares), "every process times a stage (it is one of the run's ranks computing)"
    assert sorted({s for share in shares for s in share}) == list(range(num_stages))
    if num_stages >= num_ranks:  # each stage once: the concurrent phase costs no more CPU than timing alone
        assert sorted(s for share in shares for s in share) == list(range(num_stages))


def test_slowdown_is_the_concurrent_time_over_the_same_samples_alone():
    alone = {0: (1.0, 0.0, 2.0, 0.5), 1: (3.0, 1.0, 6.0, 0.5)}
    at_once = [{0: [(2.0, 0.0, 4.0, 1.0), (4.0, 0.0, 8.0, 1.0)]}, {1: [(6.0, 3.0, 6.0, 0.5)]}]
    fwd, bwd_i, bwd, optim = prof._slowdown(alone, at_once)
    assert fwd == pytest.approx((2 + 4 + 6) / (1 + 1 + 3))
    assert bwd_i == pytest.approx(3 / 1)  # stage 0 has no input backward: only stage 1 counts
    assert bwd == pytest.approx((4 + 8 + 6) / (2 + 2 + 6))
    assert optim == pytest.approx(2.5 / 1.5)
    assert prof._slowdown({0: (0.0,) * 4}, [{0: [(0.0,) * 4]}]) == (1.0,) * 4


def test_a_part_the_first_cut_lacks_takes_the_backwards_slowdown():
    """One stage taking tokens (pp 1) has no input backward, and the slowdown measured on it prices every later
    cut's: its input backward was once priced at the timer's own microseconds' ratio, about 1.08x, where the
    crowd slowed the rest 2.1-2.4x (zb_h1's steps predicted 20% short)."""
    alone = {0: (1.0, 0.0, 2.0, 0.0)}
    fwd, bwd_i, bwd, optim = prof._slowdown(alone, [{0: [(2.2, 0.0, 4.6, 0.0)]}, {0: [(2.0, 0.0, 4.0, 0.0)]}])
    assert (fwd, bwd) == (pytest.approx(2.1), pytest.approx(2.15))
    assert bwd_i == optim == bwd
    assert prof._slowdown({0: (1.0, 0.0, 0.0, 0.0)}, [{0: [(3.0, 0.0, 0.0, 0.0)]}]) == (3.0,) * 4


class _Head(torch.nn.Module):
    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.emb, self.fc = torch.nn.Embedding(10, dim), torch.nn.Linear(dim, dim)

    def forward(self, tokens):
        return (self.fc(self.emb(tokens)),)


def _least(runner, n=3):
    runner()
    return prof._least_sample([runner() for _ in range(n)])


@pytest.mark.timed  # asserts on what it times: runs before the launches' queue starts (tests/launches.py)
def test_the_split_backward_is_timed_as_the_runs_zero_bubble_stages_run_it():
    # fc's weight grad waits in the stash for the weight half; the input half still finds its grads, so a
    # stage fed by tokens splits too
    tokens = TensorSpec("tokens", "int64", (64, 16))
    f, bwd_i, bwd, optim, bwd_w = _least(prof._stage_runner(_Head(), [tokens], [-1], None))
    assert min(f, bwd_i, bwd, optim, bwd_w) > 0
    mlp = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(4)))
    x = TensorSpec("x", "float32", (256, 512))
    _, bwd_i, bwd, _, bwd_w = _least(prof._stage_runner(mlp, [x], [0], None))
    assert 0.2 * bwd < bwd_w < bwd and 0.2 * bwd < bwd_i < bwd  # the matmuls split about evenly
    assert prof._cost((1.0, 0.5, 1.2, 0.1, 0.9)) == Cost(fwd=1.0, bwd=1.2, bwd_i=0.5, bwd_w=0.9, optim=0.1)
    _, _, _, optim, _ = _least(prof._stage_runner(torch.nn.ReLU(), [x], [0], None))
    assert optim == 0.0  # no parameters, no optimizer step


def test_a_profile_of_two_local_ranks_times_them_at_once_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing reused: everything timed here
    before = torch.get_num_threads()
    sg = _profiled(local_ranks=2)
    assert torch.get_num_threads() == before
    assert not mp.active_children(), "the forked profilers are joined"
    rec = sg.model["profile"]
    assert rec["concurrent_ranks"] == 2 and rec["threads_per_rank"] == 1 and rec["reps"] == 2
    assert rec["cores"] == prof.usable_cores() and prof.MIN_CROWD_REPEATS <= rec["crowd_repeats"] <= prof.CROWD_REPEATS
    assert not rec["crowd"]["reused"] and not any(st["reused"] for st in rec["stages"])
    assert rec["host_spread"] >= 0 and rec["crowd"]["spread"] >= 0
    assert set(rec["slowdown"]) == {"fwd", "bwd_i", "bwd", "optim"} and all(v > 0 for v in rec["slowdown"].values())
    for st in sg.stages:
        c = st.cost
        assert c.fwd > 0 and c.bwd > 0 and c.bwd_w >= 0
    assert sg.stages[0].cost.bwd_i == 0


def test_one_rank_is_profiled_alone_and_flops_costs_record_no_profile():
    alone = _profiled(local_ranks=1)
    assert alone.model["profile"]["concurrent_ranks"] == 1 and "slowdown" not in alone.model["profile"]
    flops = build_stage_graph(model_request(target="pipec.examples.mlp:build", kwargs=dict(layers=4, dim=16),
                                            inputs=(X,), num_microbatches=2, num_stages=2, costs="flops",
                                            peak_flops=1e12), host=Host(local_ranks=4))
    assert "profile" not in flops.model


def test_the_profile_takes_at_most_the_runs_ranks_and_a_cap():
    assert costs.profiling(local_ranks=64, threads=1, reps=3).num_ranks == costs.MAX_PROFILE_RANKS
    assert costs.profiling(local_ranks=0, threads=0, reps=0) == costs.Profiling(num_ranks=1, threads=1, reps=1)


def _failing(where: str):
    def work(rank: int, together) -> int:
        if rank == 1 and where == "before":
            raise ValueError("boom before the start")
        together.start()
        if rank == 1:
            raise ValueError("boom after the start")
        together.finish(lambda: None)
        return rank
    return work


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_failing_profiler_is_an_error_naming_costs_not_a_hang(where):
    with pytest.raises(FrontendError, match="boom") as err:
        prof._at_once(3, _failing(where))
    assert err.value.key == "costs"
    assert not mp.active_children()


def test_gloo_links_and_overhead_slow_down_as_the_profiled_ranks_did():
    from types import SimpleNamespace

    from pipec.costs.links import _under_load
    from pipec.compiler.ir.plan import Link, Measured, Overhead

    gloo, nccl = Measured(at="now", backend="gloo"), Measured(at="now", backend="nccl")
    links = {"pp": Link(latency_s=1e-4, bandwidth_Bps=1e9, measured=gloo),
             "dp": Link(latency_s=1e-3, bandwidth_Bps=2e9, measured=gloo),
             "tie": Link(latency_s=1e-3, bandwidth_Bps=2e9, measured=nccl), "shard": Link(latency_s=1, bandwidth_Bps=1)}
    overhead = Overhead(seconds={"FWD": 1e-5}, measured=gloo)
    plan = SimpleNamespace(model={"profile": {"slowdown": {"fwd": 2.0, "bwd": 3.0, "bwd_i": 9.0, "optim": 9.0}}})
    got, over, factor = _under_load(plan, links, overhead)
    assert factor == 2.5  # the mean of the forward's and the backward's
    assert got["pp"].latency_s == pytest.approx(2.5e-4) and got["pp"].bandwidth_Bps == pytest.approx(1e9 / 2.5)
    assert got["dp"].bandwidth_Bps == pytest.approx(2e9 / 2.5)
    assert got["tie"] == links["tie"] and got["shard"] == links["shard"]  # not gloo, or not measured
    assert over.seconds["FWD"] == pytest.approx(2.5e-5)
    for model in (None, {}, {"profile": {"concurrent_ranks": 1}}):
        assert _under_load(SimpleNamespace(model=model), links, overhead) == (links, overhead, 1.0)


def test_one_crowd_per_microbatch_shape_is_shared_by_its_cuts_one_fork_for_all_its_repeats(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    real = prof._at_once

    def counting(num, work, repeats=0):
        got = real(num, work, repeats)
        calls.append((num, [len(out) for out, _, _ in got]))
        return got

    monkeypatch.setattr(prof, "_at_once", counting)
    two = _profiled(local_ranks=3, stages=2).model["profile"]
    four = _profiled(local_ranks=3, stages=4).model["profile"]
    assert len(calls) == 1 and calls[0][0] == 3  # the second cut, of the same shape, reuses the first's crowd
    assert len(set(calls[0][1])) == 1  # every process timed every repeat
    assert not two["crowd"]["reused"] and four["slowdown"] == two["slowdown"] and four["crowd"] == two["crowd"]
    assert set(two["slowdown"]) == set(four["slowdown"]) == {"fwd", "bwd_i", "bwd", "optim"}
    other = _profiled(local_ranks=3, stages=2, microbatches=4).model["profile"]
    assert len(calls) == 2 and not other["crowd"]["reused"]  # another microbatch shape: a crowd of its own
    assert not mp.active_children()


def test_a_process_done_first_keeps_the_crowd_at_every_repeat():
    import time as _time

    def work(rank, together):
        loads = []
        for _ in range(3):
            together.start()
            _time.sleep(0.05 * rank)  # rank 0 is done first in every round
            count = [0]
            together.finish(lambda: (count.__setitem__(0, count[0] + 1), _time.sleep(0.001)))
            loads.append(count[0])
        return loads

    got = prof._at_once(3, work)
    assert all(n > 0 for n in got[0]), got  # it ran its load until the others were done, every round


def test_every_sample_is_priced_at_the_hosts_reference_speed(monkeypatch):
    speed = iter([1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 1.0, 1.0, 4.0])  # the reference's time before each round
    monkeypatch.setattr(prof, "_reference", lambda threads: lambda: next(speed))
    p = prof.Profiling(reps=3, max_reps=3)
    first, refs = p.alone({0: lambda: (1.0, 0.5, 2.0, 0.1, 1.5)})
    assert refs == [1.0, 1.0, 1.0] and first == {0: [(1.0, 0.5, 2.0, 0.1, 1.5)] * 3}
    later, _ = p.alone({0: lambda: (2.0, 1.0, 4.0, 0.2, 3.0)}, baseline=1.0)  # the host at half its speed a whole cut
    assert later == first
    samples = iter([(9.0,) * 5, (1.2,) * 5, (1.1,) * 5, (6.0,) * 5])  # a warm-up, then rounds at speed 1, 1, 4
    got, _ = p.alone({0: lambda: next(samples)}, baseline=1.0)
    assert prof._least_sample(got[0]) == (1.1,) * 5  # the slow round is 1.5 at the first speed


def test_rounds_alone_stop_at_the_fewest_that_know_the_median(monkeypatch):
    monkeypatch.setattr(prof, "_reference", lambda threads: lambda: 1.0)
    p = prof.Profiling(reps=3, max_reps=6)
    steady, _ = p.alone({0: lambda: (1.0, 0.5, 2.0, 0.1, 1.5), 1: lambda: (2.0, 0.5, 2.0, 0.1, 1.5)})
    assert [len(x) for x in steady.values()] == [3, 3]  # every median known at the fewest rounds
    noisy = iter([1.0, 1.0, 2.0, 1.0, 3.0, 1.0, 2.5, 1.0, 1.5] * 2)  # a warm-up, then a stage scattering by 50%
    got, _ = p.alone({0: lambda: (next(noisy), 0.0, 1.0, 0.0, 1.0)})
    assert len(got[0]) == 6  # up to the cap
    assert prof.median_ci([1.0] * 3) == 0 and prof.median_ci([1.0]) == float("inf")
    assert 0.04 < prof.median_ci([1.0, 1.1, 0.9]) < 0.3


def test_the_crowd_repeats_until_its_median_slowdown_is_known(monkeypatch):
    monkeypatch.setattr(prof, "_reference", lambda threads: lambda: 1.0)
    alone = {0: (1.0, 0.0, 2.0, 0.0), 1: (1.0, 0.0, 2.0, 0.0)}
    p = prof.Profiling(num_ranks=2, reps=2, min_time_s=0.0, crowd_repeats=5)
    steady = prof.crowd(p, {0: lambda: (2.0, 0.0, 4.0, 0.0, 4.0), 1: lambda: (2.0, 0.0, 4.0, 0.0, 4.0)}, alone, 2, 1.0)
    assert len(steady.repeats) == prof.MIN_CROWD_REPEATS and steady.repeats[0] == (2.0, 2.0, 2.0, 2.0)
    assert steady.spread == 0 and not mp.active_children()
    draws = random.Random(0)

    def scattering():  # each sample 1-10 x its time alone (a repeat's median of four: about 25% apart)
        f = draws.uniform(1.0, 10.0)
        return (f, 0.0, 2.0 * f, 0.0, 1.0)

    noisy = prof.crowd(p, {0: scattering, 1: scattering}, alone, 2, 1.0)
    assert len(noisy.repeats) == 5 and noisy.spread > 0.1  # never known: up to the cap


