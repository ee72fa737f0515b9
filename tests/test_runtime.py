"""The runtime: every schedule trains correctly, in-process (fake transport) and under real torchrun.

- In-process: every schedule's program runs on threads over the fake
  transport; loss and every gradient equal one unpartitioned step on the whole
  batch. Fast.
- torchrun (gloo, CPU): two launches, each running several plans: every
  schedule at pp=2, pp=4 and dp=2 x pp=2 passes --check, trains for K steps
  with the same losses as single-process training on the same data, and keeps
  tied weights identical across stages.
- An injected rank failure ends the job non-zero, naming the rank.
"""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path

import pytest
import torch

from conftest import PYTHON, run_in_session

from pipec.compiler.config import TrainingConfig
from pipec.compiler.driver import compile_spec
from pipec.compiler.plan import write_plan
from pipec.compiler.frontend.stages import build_reference, build_stages
from pipec.dsl import load_spec
from pipec.runtime.executor import Executor
from pipec.runtime.training import make_data, make_loss, split_microbatches
from pipec.runtime.transport import FakeWorld

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("looped_bfs", 2), ("zb_h1", 1), ("zbv", 2)]


def tiny_gpt(schedule: str, virtual: int, pp: int, dp: int = 1, microbatches: int = 4, **extra):
    """A small GPT plan (8 blocks of dim 16) with unit costs: compiles in about a second."""
    overrides = {
        "model": "pipec.examples.gpt:build", "model_args": {"layers": 8, "dim": 16, "heads": 2, "vocab": 32, "seq": 8},
        "input": "tokens: int64[8, 8]", "schedule": schedule, "pp": pp, "dp": dp, "virtual": virtual,
        "microbatches": microbatches, "costs": "unit", "partition": "balanced(by=params)", **extra,
    }
    return compile_spec(load_spec(None, overrides)).plan


def run_in_process(plan, step: int = 0, on_modules=None):
    """Every rank of the plan on a thread over the fake transport; returns per-rank results and modules."""
    P, D = plan.mesh.pp, plan.mesh.dp
    world = FakeWorld(P * D, timeout=60)
    modules = {(p, d): build_stages(plan, [s for s, r in enumerate(plan.placement) if r == p], seed=0)
               for p in range(P) for d in range(D)}
    for mods in modules.values():
        if on_modules is not None:
            on_modules(mods)
    config = TrainingConfig.from_spec(plan.spec)
    data, loss_fn = make_data(config, plan), make_loss(config.loss)
    results, errors = {}, []

    def rank(p: int, d: int) -> None:
        try:
            ex = Executor(plan, pp_rank=p, dp_rank=d, transport=world.transport(p * D + d), modules=modules[(p, d)],
                          loss_fn=loss_fn)
            x, y = data(step, d, D)
            results[(p, d)] = ex.run_step(split_microbatches(x, plan.num_microbatches, "x", ["tokens"]),
                                          split_microbatches(y, plan.num_microbatches, "y"))
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(p, d)) for p in range(P) for d in range(D)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
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


@pytest.mark.parametrize("schedule, virtual", SCHEDULES)
@pytest.mark.parametrize("pp, dp", [(2, 1), (2, 2)])
def test_fake_transport_runs_every_schedule_exactly(schedule, virtual, pp, dp):
    plan = tiny_gpt(schedule, virtual, pp, dp)
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
        kinds = {e.op[0] for e in r.events}
        assert {"F", "I", "W"} <= kinds and "B" not in kinds


# ----------------------------------------------------------------------------- torchrun


def torchrun(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return run_in_session([PYTHON, "-m", "torch.distributed.run", *args], timeout)


STEPS = 3


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plans")
    out = {}
    for schedule, virtual in SCHEDULES:
        for pp, dp in ((2, 1), (4, 1), (2, 2)):
            extra = {"grad_clip": 1.0, "lr_schedule": "cosine(warmup=1)"} if schedule == "1f1b" else {}
            plan = tiny_gpt(schedule, virtual, pp, dp, microbatches=4 if pp == 2 else 8, **extra)
            path = folder / f"{schedule}-pp{pp}-dp{dp}.json"
            write_plan(plan, str(path))
            out[(schedule, pp, dp)] = str(path)
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [2, 4])
def test_every_schedule_trains_correctly_under_torchrun(plans, tmp_path, world):
    chosen = [path for (schedule, pp, dp), path in plans.items() if pp * dp == world]
    result = tmp_path / "result.json"
    run = torchrun(["--standalone", "--nproc-per-node", str(world), "runtime_worker.py", str(result), str(STEPS),
                    *chosen], timeout=800)
    assert run.returncode == 0, run.stderr[-4000:]
    records = json.loads(result.read_text())
    assert len(records) == len(chosen)
    for rec in records:
        name = Path(rec["plan"]).stem
        assert rec["rc"] == 0 and rec["check"]["passed"], (name, rec["check"])
        assert rec["check"]["max_grad_diff"] < 1e-4, name
        # K steps of pipelined training equal K steps of single-process training on the same data
        assert rec["losses"] == pytest.approx(rec["reference_losses"], rel=1e-4, abs=1e-5), name
        assert rec["ties"] == 1 and rec["ties_equal"], name


@pytest.mark.timeout(300)
def test_injected_failure_ends_the_job_naming_the_rank(plans):
    plan = plans[("1f1b", 2, 1)]
    run = run_in_session([PYTHON, "-m", "pipec", "run", plan, "--nproc", "2", "--steps", "3", "--fail-at", "1:1",
                          "--timeout", "30"], timeout=240)
    err = run.stderr
    assert run.returncode != 0
    assert "injected failure: global rank 1 (pp 1, dp 0) killed at step 1" in err
    assert "the run failed: global rank 1 (pp 1, dp 0) ended with exit code 13" in err
    assert "Traceback" not in err.split("pipec: error:")[-1]


def test_schedule_only_plan_needs_emulate(cli):
    assert cli("compile", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2", "-o", "p.json").returncode == 0
    out = cli("run", "p.json", "--nproc", "2")
    assert out.returncode == 2 and "runs only with --emulate" in out.stderr
    out = cli("run", "p.json", "--nproc", "3", "--emulate")
    assert out.returncode == 2 and "use --nproc 2" in out.stderr


@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1), ("zb_h1", 1)])
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
