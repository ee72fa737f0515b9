"""The runtime: every schedule trains correctly, in-process (fake transport) and under real torchrun.

- In-process: every schedule's program runs on threads over the fake
  transport; loss and every gradient equal one unpartitioned step on the whole
  batch. Fast.
- In-process at pp=4 too (the fake transport), every schedule exact.
- torchrun (gloo, CPU), several plans per launch (tests/launches.py):
  every schedule at pp=2 passes --check, trains for K steps with the same
  losses as single-process training on the same data, and keeps tied weights
  identical across stages; with ``--slow``, every schedule at pp=4 and
  dp=2 x pp=2 too (the default run has one of each: interleaved_1f1b at pp=4
  here, 1f1b at dp=2 x pp=2 among tests/test_shard_run.py's).
- An injected rank failure ends the job non-zero, naming the rank.
- ``--emulate``: every kind of instruction runs through the emulated table, and
  the measured bubble of a unit-cost plan is the predicted one.
- Every rank's error reaches the user, under ``pipec run`` and plain torchrun:
  an error on one rank only, named by it; identical errors printed once with
  the ranks; root causes before the ranks that only lost a failed peer.
"""

from __future__ import annotations

import dataclasses
import re
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import LAUNCHES, PYTHON, compiled, on_threads, run_job

from pipec.compiler.config import TrainingConfig
from pipec.compiler.driver import compile_spec
from pipec.compiler.ir.plan_json import write_plan
from pipec.runtime.stages import build_reference, build_stages
from pipec.compiler.ir.plan import Mesh
from pipec.dsl import load_spec
from pipec.errors import PipecError
from pipec.runtime.accounting import measured_timeline
from pipec.runtime.executor import Executor
from pipec.runtime.failures import RankReport, summarise
from pipec.runtime.training import make_data, make_loss, split_microbatches
from pipec.runtime.transport import FakeWorld

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("looped_bfs", 2), ("zb_h1", 1), ("zbv", 2),
             ("interleaved_zb", 2)]


def tiny_gpt(schedule: str, virtual: int, pp: int, dp: int = 1, microbatches: int = 4, **extra):
    """A small GPT plan (8 blocks of dim 16) with unit costs, compiled once per run (conftest.py's compiled)."""
    return compiled({
        "model": "pipec.examples.gpt:build", "model_args": {"layers": 8, "dim": 16, "heads": 2, "vocab": 32, "seq": 8},
        "input": "tokens: int64[8, 8]", "schedule": schedule, "pp": pp, "dp": dp, "virtual": virtual,
        "microbatches": microbatches, "costs": "unit", "partition": "balanced(by=params)", **extra,
    })


def run_in_process(plan, step: int = 0, on_modules=None, emulate: float | None = None):
    """Every rank of the plan on a thread over the fake transport; returns per-rank results and modules.

    ``emulate``: seconds per cost unit, no modules and no data (as ``--emulate`` runs)."""
    P, D = plan.mesh.pp, plan.mesh.dp
    world = FakeWorld(P * D, timeout=60)
    modules = {(p, d): {} if emulate else build_stages(plan, [s for s, r in enumerate(plan.placement) if r == p],
                                                        seed=0)
               for p in range(P) for d in range(D)}
    for mods in modules.values():
        if on_modules is not None:
            on_modules(mods)
    if emulate is None:
        config = TrainingConfig.from_spec(plan.spec)
        data, loss_fn = make_data(config, plan), make_loss(config.loss)

    def rank(p: int, d: int):
        ex = Executor(plan, pp_rank=p, dp_rank=d, transport=world.transport(plan.mesh.global_rank(p, d)),
                      modules=modules[(p, d)], loss_fn=None if emulate else loss_fn, emulate=emulate)
        if emulate:
            return ex.run_step(None, None)
        x, y = data(step, d, D)
        return ex.run_step(split_microbatches(x, plan.num_microbatches, "x", ["tokens"]),
                           split_microbatches(y, plan.num_microbatches, "y"))

    results = on_threads(rank, [(p, d) for p in range(P) for d in range(D)])
    return results, modules


def reference_step(plan, step: int = 0):
    ref = build_reference(plan, seed=0)
    config = TrainingConfig.from_spec(plan.spec)
    data, loss_fn = make_data(config, plan), make_loss(config.loss)
    batches = [data(step, d, plan.mesh.dp) for d in range(plan.mesh.dp)]
    x = torch.cat([b[0]["tokens"] for b in batches])
    y = torch.cat([b[1] for b in batches])
    out = ref(x)
    loss = loss_fn(out[0] if isinstance(out, tuple) else out, y)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in ref.canonical_params().items()}


# Every schedule at pp 2 (dp 1 and 2) and interleaved_1f1b at pp 4 in the default run; the other schedules at
# pp 4 (8 microbatches: 4-10 s each) in the long tail.
@pytest.mark.parametrize("schedule, virtual, pp, dp", [
    *((s, v, 2, d) for d in (1, 2) for s, v in SCHEDULES),
    *(pytest.param(s, v, 4, 1, marks=() if s == "interleaved_1f1b" else pytest.mark.slow) for s, v in SCHEDULES)])
def test_fake_transport_runs_every_schedule_exactly(schedule, virtual, pp, dp):
    plan = tiny_gpt(schedule, virtual, pp, dp, microbatches=4 if pp == 2 else 8)
    results, modules = run_in_process(plan)
    ref_loss, ref_grads = reference_step(plan)
    losses = [r.loss for r in results.values() if r.loss is not None]  # each replica's last stage
    assert len(losses) == dp
    assert sum(losses) / dp == pytest.approx(ref_loss, rel=1e-5)
    worst = 0.0
    for (p, d), mods in modules.items():
        for s, mod in mods.items():
            for name, param in mod.canonical_params().items():
                g = param.grad
                assert g is not None, (schedule, s, name)
                worst = max(worst, (g - ref_grads[name]).abs().max().item() / (ref_grads[name].abs().max().item() + 1e-12))
    assert worst < 1e-4, (schedule, worst)
    # the measured accounting is consistent: compute + waits never exceed the step
    for r in results.values():
        assert 0 < r.compute and r.compute + r.comm_wait <= r.step_time + 1e-6


def test_zero_bubble_split_defers_weight_grads():
    """zb_h1's I computes no linear weight grad; its W does, without redoing the input-grad work."""
    plan = tiny_gpt("zb_h1", 1, 2)
    assert any(ins.op.value == "BWD_W" for ins in plan.program.ranks[0])
    results, _ = run_in_process(plan)
    for r in results.values():
        kinds = {e.text[0] for e in r.events}
        assert {"F", "I", "W"} <= kinds and "B" not in kinds


def test_the_first_stage_runs_its_whole_backward_at_w_as_its_cost_says(monkeypatch):
    """Stage 0 sends no gradient: its I does nothing and its W is its whole backward, unsplit (the plan prices
    it so under flops and profile costs: bwd_i 0, bwd_w the full backward); the other stages split."""
    plan = tiny_gpt("zb_h1", 1, 2)
    made = []
    real = Executor.__init__

    def init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(Executor, "__init__", init)
    results, _ = run_in_process(plan)
    assert sorted(tuple(sorted(ex.split)) for ex in made) == [(), (1,)]
    assert all(not ex.state.stashes for ex in made)  # every deferred weight grad was run


def test_emulate_runs_every_kind_of_instruction_and_measures_the_predicted_bubble():
    """--emulate's own table entries: compute sleeps its cost, one-element placeholders travel, collectives and
    the optimizer step run; at unit cost the measured bubble is the predicted one."""
    model_plan = tiny_gpt("zb_h1", 1, 2, dp=2)  # F, I, W, comm, AR:dp, AR:tie (the tied embedding), OPT
    schedule_plan = compile_spec(load_spec(None, {"schedule": "1f1b", "pp": 2, "microbatches": 4})).plan  # F, B
    ran: set[str] = set()
    for plan in (model_plan, schedule_plan):
        results, _ = run_in_process(plan, emulate=0.01)
        ran |= {re.match("[A-Z]+", e.text).group() + (":tie" if ":tie." in e.text else "")
                for r in results.values() for e in r.events if not e.wait}
        # a wait inside a collective is its own event, before the work: never overlapping it
        for r in results.values():
            for wait in (e for e in r.events if e.wait):
                work = next(e for e in r.events if e.ins == wait.ins and not e.wait and e.start >= wait.end - 1e-12)
                assert wait.start <= wait.end <= work.start + 1e-12
    assert ran == {"F", "B", "I", "W", "AR", "AR:tie", "OPT"}
    measured = measured_timeline(list(results.values()))
    assert measured.bubble_fraction == pytest.approx(schedule_plan.prediction.bubble_fraction, abs=0.05)


# ----------------------------------------------------------------------------- torchrun


STEPS = 3


def schedule_runs(layouts: list[tuple[int, int]], only: set[tuple[str, int, int]] | None = None,
                  but: set[tuple[str, int, int]] = frozenset()):
    """A set of runs for tests/launches.py: every schedule at each (pp, dp) of ``layouts`` (those in
    ``only``, not those in ``but``: (schedule, pp, dp)), STEPS steps with --check (1f1b with clipping and a
    warm-up cosine lr schedule)."""

    def make(folder: Path) -> dict[str, dict]:
        jobs = {}
        for schedule, virtual in SCHEDULES:
            for pp, dp in layouts:
                if (only is not None and (schedule, pp, dp) not in only) or (schedule, pp, dp) in but:
                    continue
                extra = {"grad_clip": 1.0, "lr_schedule": "cosine(warmup=1)"} if schedule == "1f1b" else {}
                plan = tiny_gpt(schedule, virtual, pp, dp, microbatches=4 if pp == 2 else 8, **extra)
                path = folder / f"{schedule}-pp{pp}-dp{dp}.json"
                write_plan(plan, str(path))
                jobs[path.stem] = run_job(path, "--steps", str(STEPS), "--check", reference=True)
        return jobs

    return make


PP4 = {("interleaved_1f1b", 4, 1)}
"""The 4-rank run of the default suite (the others are --slow's)."""
every_schedule_2_ranks = LAUNCHES.runs("every_schedule_2_ranks", world=2, make=schedule_runs([(2, 1)]))
# 4-rank sets join round 2, the launch of tests/test_checkpoint.py's 4-rank resume
pp4_4_ranks = LAUNCHES.runs("pp4_4_ranks", world=4, round=2, make=schedule_runs([(4, 1)], only=PP4))
every_schedule_4_ranks = LAUNCHES.runs("every_schedule_4_ranks", world=4, round=2,
                                      make=schedule_runs([(4, 1), (2, 2)], but=PP4))


def assert_trained_as_one_process(records: dict[str, dict]) -> None:
    assert records
    for name, rec in records.items():
        assert rec["rc"] == 0 and rec["check"]["passed"], (name, rec["check"])
        assert rec["check"]["max_grad_diff"] < 1e-4, name
        # K steps of pipelined training equal K steps of single-process training on the same data
        assert len(rec["losses"]) == STEPS, name
        assert rec["losses"] == pytest.approx(rec["reference_losses"], rel=1e-4, abs=1e-5), name
        assert rec["ties"] == 1 and rec["ties_equal"], name


@pytest.mark.timeout(900)
def test_every_schedule_trains_correctly_under_torchrun(every_schedule_2_ranks, pp4_4_ranks):
    assert len(every_schedule_2_ranks) == len(SCHEDULES)
    assert_trained_as_one_process(every_schedule_2_ranks | pp4_4_ranks)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_every_schedule_trains_correctly_on_4_ranks(every_schedule_4_ranks):
    assert len(every_schedule_4_ranks) == 2 * len(SCHEDULES) - len(PP4)
    assert_trained_as_one_process(every_schedule_4_ranks)


def _injected_failure(folder: Path) -> list[str]:
    plan = str(folder / "plan.json")
    write_plan(tiny_gpt("1f1b", 1, 2), plan)
    return [PYTHON, "-m", "pipec", "run", plan, "--nproc", "2", "--steps", "3", "--fail-at", "2:1", "--timeout", "30"]


injected_failure = LAUNCHES.command("injected_failure", make=_injected_failure, timeout=240)


@pytest.mark.timeout(900)
def test_injected_failure_ends_the_job_naming_the_rank(injected_failure):
    run = injected_failure
    err = run.stderr
    assert run.returncode != 0
    assert "injected failure: global rank 1 (pp 1, dp 0) killed at step 2" in err
    assert "the run failed: global rank 1 (pp 1, dp 0) ended with exit code 13" in err
    assert "Traceback" not in err.split("pipec: error:")[-1]


def test_schedule_only_plan_needs_emulate(cli_process):
    assert cli_process("compile", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2", "-o", "p.json").returncode == 0
    out = cli_process("run", "p.json", "--nproc", "2")
    assert out.returncode == 2 and "runs only with --emulate" in out.stderr
    out = cli_process("run", "p.json", "--nproc", "3", "--emulate")
    assert out.returncode == 2 and "use --nproc 2" in out.stderr


@pytest.mark.parametrize("schedule, virtual", [pytest.param("1f1b", 1, marks=pytest.mark.slow), ("zb_h1", 1)])
def test_recompute_runs_the_forward_again_and_keeps_gradients_exact(schedule, virtual):
    """Stage 0 recomputes: its forward runs twice per microbatch, stage 1's once; gradients stay exact."""
    plan = tiny_gpt(schedule, virtual, 2, recompute="stages 0")
    assert list(plan.spec["recompute"]) == [0]
    calls = {0: 0, 1: 0}

    def count(mods):
        for s, mod in mods.items():
            mod.register_forward_pre_hook(lambda *_a, _s=s: calls.__setitem__(_s, calls[_s] + 1))

    results, modules = run_in_process(plan, on_modules=count)
    M = plan.num_microbatches
    assert calls == {0: 2 * M, 1: M}
    _, ref_grads = reference_step(plan)
    for mods in modules.values():
        for mod in mods.values():
            for name, p in mod.canonical_params().items():
                assert torch.allclose(p.grad, ref_grads[name], rtol=1e-4, atol=1e-6), name


# ----------------------------------------------------------------------------- every rank's error


def _failure(exitcode: int, report: RankReport | None = None):
    """What torchelastic's ChildFailedError.failures holds for a rank (its error file's data, if it wrote one)."""
    data = {"pipec": dataclasses.asdict(report)} if report else {}
    return SimpleNamespace(exitcode=exitcode, error_file_data=data)


def test_summary_puts_the_root_cause_first_and_summarises_lost_peers(capsys):
    mesh = Mesh(pp=2, dp=2)

    def report(rank: int, message: str, code: int) -> RankReport:
        return RankReport.of(RuntimeError(message) if code == 1 else _Mistake(message), rank=rank,
                             where=mesh.where(rank))

    lost = "[gloo/pair.cc:534] Connection closed by peer [127.0.0.1]:4242"
    failures = {0: _failure(1, report(0, lost, 1)), 1: _failure(2, report(1, "bad data", 2)),
                2: _failure(2, report(2, "bad data", 2)), 3: _failure(-signal.SIGTERM)}
    assert summarise(failures, mesh.where) == 2  # a user's mistake on any rank
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "pipec: error: global ranks 1, 2: bad data"  # identical messages once, with the ranks
    assert lines[1] == ("pipec: note: global rank 0 (pp 0, dp 0) then stopped: it lost a failed peer (RuntimeError: "
                        f"{lost})")
    assert lines[2] == "pipec: note: global rank 3 (pp 1, dp 1) stopped by the launcher after the failure"
    assert len(lines) == 3
    # a rank that ended without a report is named with its exit code; lost peers alone are errors
    assert summarise({1: _failure(13), 0: _failure(1, report(0, lost, 1))}, mesh.where) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "pipec: error: the run failed: global rank 1 (pp 0, dp 1) ended with exit code 13"
    assert summarise({0: _failure(1, report(0, lost, 1))}, mesh.where) == 1
    assert "lost a peer that failed" in capsys.readouterr().err
    assert summarise({0: _failure(3), 1: _failure(3)}, mesh.where) == 3  # --check: rank 0 told the verdict
    assert capsys.readouterr().err == ""


class _Mistake(PipecError):
    """A user's mistake (exit code 2)."""


def launch(launcher: str, data: str, *flags: str):
    """A command for the launches' queue: two ranks of a dp=2 plan whose data function (tests/runtime_worker.py)
    fails on dp rank 1 only (``uneven_batches``) or on every rank (``short_batches``), under ``pipec run`` or
    plain torchrun."""

    def make(folder: Path) -> list[str]:
        plan = str(folder / f"{data}.json")
        write_plan(tiny_gpt("1f1b", 1, 1, dp=2, data=f"runtime_worker:{data}"), plan)
        if launcher == "pipec run":
            cmd = [PYTHON, "-m", "pipec", "run", plan, "--nproc", "2"]
        else:
            cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                   "pipec.runtime", plan]
        return [*cmd, "--steps", "1", "--timeout", "30", *flags]

    return make


uneven_under_pipec_run = LAUNCHES.command("uneven_under_pipec_run", make=launch("pipec run", "uneven_batches"),
                                          timeout=120)
uneven_under_torchrun = LAUNCHES.command("uneven_under_torchrun", make=launch("torchrun", "uneven_batches"),
                                         timeout=120)
short_under_pipec_run = LAUNCHES.command("short_under_pipec_run",
                                         make=launch("pipec run", "short_batches", "--verbose"), timeout=120)


@pytest.fixture(params=["pipec run", "torchrun"])
def uneven(request, uneven_under_pipec_run, uneven_under_torchrun):
    """The run whose data fails on dp rank 1 only, under each launcher."""
    return request.param, uneven_under_pipec_run if request.param == "pipec run" else uneven_under_torchrun


@pytest.mark.timeout(900)
def test_an_error_on_one_rank_only_reaches_the_user_named_by_its_rank(uneven):
    launcher, run = uneven
    err = run.stderr
    cause = next((line for line in err.splitlines() if line.startswith("pipec: error: global rank 1 (pp 0, dp 1): ")),
                 None)
    assert cause is not None and "returned int64[6, 8] for input 'tokens'" in cause, err[-3000:]
    if launcher == "pipec run":
        assert run.returncode == 2, err[-3000:]  # a user's mistake, on rank 1
        assert err.count("pipec: error:") == 1  # rank 0 only lost its peer: a note, after the cause
        assert "Traceback" not in err
        assert "OMP_NUM_THREADS" not in err and "failed (exitcode" not in err  # torchrun's lines hidden
    else:
        assert run.returncode != 0  # torchrun's own; the rank's exit code shows in its summary
        assert "exitcode  : 2" in err


@pytest.mark.timeout(900)
def test_identical_errors_from_every_rank_are_printed_once_with_the_ranks(short_under_pipec_run):
    run = short_under_pipec_run
    err = run.stderr
    assert run.returncode == 2, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("pipec: error:")]
    assert len(errors) == 1 and errors[0].startswith("pipec: error: global ranks 0, 1: "), err[-3000:]
    assert "returned int64[6, 8] for input 'tokens'" in errors[0]
    assert "failed (exitcode: 2)" in err  # --verbose: torchrun's own lines shown
