"""The scaling efficiency `pipec run` reports beside MFU, and `--baseline`, its measured single device.

- report.json's ``scaling_efficiency`` from given numbers: T_1 / (N x step), T_1 the measured single device's
  step where the run has one, else the plan's predicted one; absent for a plan in units without a baseline.
- The baseline (runtime/baseline.py) times steps of the unpartitioned model and leaves the caller's random
  streams as they were, even where its loss draws from them.
- Under torchrun (one run in the tests' shared 2-rank launch): ``--check --baseline`` on a small GPT passes
  its check, trains as the unpartitioned model does, and its report.json holds a positive baseline step and
  the efficiency of the report's own numbers, said as the summary says it.
- ``--baseline --emulate`` is refused before any rank starts (exit 2).
"""

from __future__ import annotations

import statistics
from dataclasses import replace

import pytest
import torch

from conftest import LAUNCHES, compiled, run_job

from pipec.compiler.config import TrainingConfig
from pipec.compiler.driver import compile_plan, prove_and_predict
from pipec.compiler.ir.plan_json import write_plan
from pipec.compiler.sim.metrics import plan_single_device_step
from pipec.runtime.accounting import build_report, scaling_report
from pipec.runtime.baseline import measure_baseline, scaling_text
from pipec.runtime.executor import RankStep
from pipec.runtime.training import make_data, make_loss
from pipec.schedules.timing import Cost

COST = Cost(fwd=0.01, bwd=0.02, bwd_i=0.01, bwd_w=0.01, optim=0.005)
KW = dict(tokens_per_step=None, flops_per_step=None, peak_flops=None)


def small_gpt():
    """A 4-block GPT (dim 16) on pp 2 under 1f1b with 2 microbatches, costs by flops (so a predicted T_1 too)."""
    return compiled({
        "model": "pipec.examples.gpt:build", "model_args": {"layers": 4, "dim": 16, "heads": 2, "vocab": 32, "seq": 8},
        "input": "tokens: int64[4, 8]", "schedule": "1f1b", "pp": 2, "microbatches": 2, "costs": "flops",
        "peak_flops": 1e12,
    })


def _seconds_plan():
    """A 1f1b plan of 2 ranks and 4 microbatches whose stages cost :data:`COST` seconds."""
    plan = compile_plan(num_ranks=2, num_microbatches=4, schedule="1f1b").plan
    stages = tuple(replace(st, cost=COST) for st in plan.stages)
    return prove_and_predict(replace(plan, stages=stages, model={"target": "m:f"},
                                     spec={**plan.spec, "costs": "flops"}, prediction=None))


def _steps(plan, times):
    """One RankStep per pp rank per step, the step taking ``times[i]``."""
    return [[RankStep(global_rank=r, step_time=t, compute=t / 2) for r in range(plan.mesh.pp)] for t in times]


def test_the_scaling_efficiency_is_one_devices_step_over_n_steps():
    assert scaling_report(0.5, 4, measured_single=1.2, predicted_single=3.0) == {"value": pytest.approx(0.6),
                                                                              "against": "measured"}
    assert scaling_report(0.5, 4, measured_single=None, predicted_single=1.0) == {"value": pytest.approx(0.5),
                                                                               "against": "predicted"}
    assert scaling_report(0.5, 4, measured_single=None, predicted_single=None) is None


def test_the_report_is_against_the_single_device_it_has():
    plan = _seconds_plan()
    steps = _steps(plan, [0.9, 0.2, 0.3])  # the first warms up: the median step is 0.2 s
    predicted = build_report(plan, "p.json", steps, **KW)
    step = predicted["measured"]["step_time"]
    assert step == 0.2 and "baseline" not in predicted
    t1 = plan_single_device_step(plan)
    assert t1 == pytest.approx(4 * (2 * COST.fwd + 2 * COST.bwd) + 2 * COST.optim)
    assert predicted["scaling_efficiency"] == {"value": pytest.approx(t1 / (2 * step)), "against": "predicted"}
    assert scaling_text(predicted) == f"scaling efficiency {t1 / 0.4:.1%} against a predicted single device"
    baseline = {"step_time_s": 0.25, "repeats": 3, "warmup": 1, "step_times_s": [0.3, 0.25, 0.2]}
    measured = build_report(plan, "p.json", steps, baseline=baseline, **KW)
    assert measured["baseline"] == baseline
    assert measured["scaling_efficiency"] == {"value": pytest.approx(0.25 / 0.4), "against": "measured"}
    assert scaling_text(measured) == ("scaling efficiency 62.5% against a measured single device "
                                      "(0.250 s a step, median of 3)")
    # a plan in units predicts no single device: absent, not made up; a measured one still counts
    units = compile_plan(num_ranks=2, num_microbatches=4, schedule="1f1b").plan
    assert "scaling_efficiency" not in build_report(units, "p.json", steps, **KW)
    assert scaling_text(build_report(units, "p.json", steps, **KW)) is None
    assert build_report(units, "p.json", steps, baseline=baseline, **KW)["scaling_efficiency"]["against"] == "measured"


def test_the_baseline_times_the_unpartitioned_step_and_leaves_the_rng_as_it_was():
    plan = small_gpt()
    config = TrainingConfig.from_spec(plan.spec)
    loss = make_loss(config.loss)
    draws = []

    def drawing_loss(out, y):  # a loss that draws from the global RNG (dropout would): the fork must hide it
        draws.append(torch.rand(()))
        return loss(out, y)

    torch.manual_seed(1234)
    before = torch.get_rng_state()
    got = measure_baseline(plan, config, data=make_data(config, plan), loss_fn=drawing_loss, step=0,
                           device=torch.device("cpu"), repeats=2, warmup=1)
    assert len(draws) == 3 * plan.num_microbatches  # every microbatch of every step, warm-up included
    assert torch.equal(torch.get_rng_state(), before)
    assert got["repeats"] == 2 and got["warmup"] == 1 and len(got["step_times_s"]) == 2
    assert got["step_time_s"] == statistics.median(got["step_times_s"]) > 0


def _baseline_runs(folder):
    write_plan(small_gpt(), folder / "gpt.json")
    return {"check_baseline": run_job(folder / "gpt.json", "--steps", "2", "--check", "--baseline", reference=True)}


baseline_runs = LAUNCHES.runs("baseline_runs", world=2, make=_baseline_runs)


def test_a_run_with_baseline_reports_the_measured_scaling_efficiency(baseline_runs):
    rec = baseline_runs["check_baseline"]
    assert rec["rc"] == 0 and rec["check"]["passed"], rec["stderr"]
    # the training is the unpartitioned model's: the baseline ran after it, on a model of its own
    assert rec["losses"] == pytest.approx(rec["reference_losses"], rel=1e-5)
    report = rec["report"]
    base = report["baseline"]
    assert base["step_time_s"] > 0 and base["repeats"] == 3 and len(base["step_times_s"]) == 3
    step = report["measured"]["step_time"]
    assert report["scaling_efficiency"] == {"value": pytest.approx(base["step_time_s"] / (2 * step)),
                                            "against": "measured"}
    assert scaling_text(report).startswith(f"scaling efficiency {report['scaling_efficiency']['value']:.1%} "
                                           "against a measured single device (")


def test_baseline_is_refused_with_emulate(cli):
    assert cli("compile", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2", "-o", "p.json").returncode == 0
    out = cli("run", "p.json", "--nproc", "2", "--baseline", "--emulate")
    assert out.returncode == 2
    assert "pipec: error: --baseline times the model's real step on one device: it cannot be combined with --emulate" \
        in out.stderr
