"""Like with like: the bytes the prediction counts, measured as the run holds them.

- The saved activations at a rank's peak, counted by the executor in its first step (runtime/saved.py), equal the
  prediction's exactly for the example MLP on every schedule, and with replicas; within 5% for the example GPT
  (its attention saves other tensors on CPU than on the meta tensors the compiler traces with).
- Only the first step counts (the later ones run without the hook).
- The state at rest after an optimizer step equals the prediction's, but for AdamW's step counter (a float32
  scalar per parameter tensor, which the prediction does not count).
- report.json's measured timeline carries both per rank; on CPU no allocator peak is claimed (the process's
  resident size is report.json's ``resident_bytes``, apart), and ``pipec show --measured`` draws the counted
  bytes beside the predicted ones, saying what each figure is.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import compiled, on_threads

from pipec.compiler.config import TrainingConfig
from pipec.compiler.ir.plan_json import write_plan
from pipec.runtime.accounting import build_report
from pipec.runtime.executor import Executor
from pipec.runtime.sharding import state_bytes
from pipec.runtime.stages import build_stages
from pipec.runtime.training import make_data, make_loss, make_optimizer, split_microbatches
from pipec.runtime.transport import FakeWorld

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2), ("zbv", 2)]


def _mlp(schedule: str, virtual: int, dp: int = 1, **extra):
    return compiled({"model": "pipec.examples.mlp:build", "model_args": {"layers": 4, "dim": 16},
                     "input": "x: float32[8, 16]", "schedule": schedule, "pp": 2, "dp": dp, "virtual": virtual,
                     "microbatches": 4, "costs": "unit", **extra})


def _gpt(schedule: str, virtual: int):
    return compiled({"model": "pipec.examples.gpt:build",
                     "model_args": {"layers": 4, "dim": 16, "heads": 2, "vocab": 32, "seq": 8},
                     "input": "tokens: int64[8, 8]", "schedule": schedule, "pp": 2, "virtual": virtual,
                     "microbatches": 4, "costs": "unit"})


def _run(plan, steps: int = 1):
    """Every rank on a thread over the fake transport, ``steps`` steps on the same executors: per (pp, dp) the
    step results, the executor and its modules."""
    P, D = plan.mesh.pp, plan.mesh.dp
    world = FakeWorld(P * D, timeout=60)
    config = TrainingConfig.from_spec(plan.spec)
    data, loss_fn = make_data(config, plan), make_loss(config.loss)
    names = [sig.name for sig in plan.stages[0].inputs]
    built = {(p, d): build_stages(plan, [s for s, r in enumerate(plan.placement) if r == p], seed=0)
             for p in range(P) for d in range(D)}  # not on the threads: building a stage is not thread-safe

    def rank(p: int, d: int):
        mods = built[(p, d)]
        ex = Executor(plan, pp_rank=p, dp_rank=d, transport=world.transport(plan.mesh.global_rank(p, d)),
                      modules=mods, loss_fn=loss_fn)
        out = []
        for step in range(steps):
            x, y = data(step, d, D)
            out.append(ex.run_step(split_microbatches(x, plan.num_microbatches, "x", names),
                                   split_microbatches(y, plan.num_microbatches, "y")))
        return out, ex, mods

    return on_threads(rank, [(p, d) for p in range(P) for d in range(D)])


def _predicted(plan, field: str) -> dict[int, int]:
    return {r.rank: getattr(r, field) for r in plan.prediction.per_rank}


@pytest.mark.parametrize("schedule, virtual", SCHEDULES)
def test_measured_activations_equal_the_prediction_exactly(schedule, virtual):
    plan = _mlp(schedule, virtual)
    want = _predicted(plan, "peak_activation_bytes")
    got = {p: steps[0].peak_activation_bytes for (p, _), (steps, _, _) in _run(plan).items()}
    assert got == want and all(want.values())


def test_every_replica_measures_what_its_pp_rank_predicts():
    plan = _mlp("1f1b", 1, dp=2)
    want = _predicted(plan, "peak_activation_bytes")
    for (p, _), (steps, _, _) in _run(plan).items():
        assert steps[0].peak_activation_bytes == want[p]


@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1), ("zbv", 2)])
def test_the_gpt_measures_within_five_percent(schedule, virtual):
    """The compiler counts the attention's saved tensors on meta tensors, where scaled_dot_product_attention
    saves q, k, v and its output apart; on CPU its flash kernel saves the fused qkv storage and a logsumexp:
    a few percent less, on the rank holding the most blocks."""
    plan = _gpt(schedule, virtual)
    want = _predicted(plan, "peak_activation_bytes")
    for (p, _), (steps, _, _) in _run(plan).items():
        got = steps[0].peak_activation_bytes
        assert abs(got - want[p]) <= 0.05 * want[p], (p, got, want[p])


def test_only_the_first_step_counts():
    plan = _mlp("1f1b", 1)
    for steps, ex, _ in _run(plan, steps=2).values():
        assert steps[0].peak_activation_bytes and steps[1].peak_activation_bytes is None
        assert ex.saved is None  # the second step ran without the hook


@pytest.mark.parametrize("schedule, virtual", [("zb_h1", 1), ("zbv", 2)])
def test_a_counted_step_computes_the_same_gradients(schedule, virtual, monkeypatch):
    """The count's hook leaves the step as it is: a split backward's deferred weight grads reach the parameters
    (under saved_tensors_hooks autograd hands a saved weight back as an alias; the stash keeps the parameter)."""
    plan = _gpt(schedule, virtual)
    counted = _run(plan)
    monkeypatch.setattr(Executor, "run_step", _uncounted(Executor.run_step))
    plain = _run(plan)
    for key, (_, _, mods) in counted.items():
        for s, mod in mods.items():
            other = plain[key][2][s].canonical_params()
            for name, p in mod.canonical_params().items():
                assert p.grad is not None and torch.equal(p.grad, other[name].grad), (s, name)
    assert all(steps[0].peak_activation_bytes for steps, _, _ in counted.values())
    assert all(steps[0].peak_activation_bytes is None for steps, _, _ in plain.values())


def _uncounted(run_step):
    def run(self, *args):
        self.steps_run = max(self.steps_run, 1)  # as if its first step were done: nothing counted
        return run_step(self, *args)

    return run


def test_the_state_after_an_optimizer_step_equals_the_prediction():
    plan = _mlp("1f1b", 1)
    want = _predicted(plan, "state_bytes")
    config = TrainingConfig.from_spec(plan.spec)
    for (p, _), (_, _, mods) in _run(plan).items():
        params = [q for m in mods.values() for q in m.parameters()]
        opt = make_optimizer(params, config)
        opt.step()
        got = sum(state_bytes(params, opt).values())
        assert 0 <= got - want[p] <= 4 * len(params), (p, got, want[p])  # AdamW's per-tensor step counter


@pytest.fixture(scope="module")
def measured_report(tmp_path_factory):
    """A plan and the report of its in-process step, each rank's step carrying what the trainer measures on CPU:
    the state after its optimizer step and the process's resident size (not the tensors)."""
    d = tmp_path_factory.mktemp("memory")
    plan = _mlp("1f1b", 1)
    config = TrainingConfig.from_spec(plan.spec)
    ranks = []
    for (_, _), (steps, _, mods) in sorted(_run(plan).items()):
        params = [q for m in mods.values() for q in m.parameters()]
        opt = make_optimizer(params, config)
        opt.step()
        steps[0].state_bytes = state_bytes(params, opt)
        steps[0].resident_bytes = 300 << 20
        ranks.append(steps[0])
    report = build_report(plan, str(d / "p.json"), [ranks], tokens_per_step=None, flops_per_step=None,
                          peak_flops=None)
    write_plan(plan, str(d / "p.json"))
    (d / "report.json").write_text(json.dumps(report))
    return plan, report, d


def test_the_report_carries_the_counted_bytes_and_no_allocator_peak_on_cpu(measured_report):
    plan, report, _ = measured_report
    for r, p in zip(report["measured"]["per_rank"], plan.prediction.per_rank):
        assert r["peak_activation_bytes"] == p.peak_activation_bytes
        assert 0 <= r["state_bytes"] - p.state_bytes <= 1024
        assert "peak_memory_bytes" not in r
    assert "peak_memory_bytes" not in report and report["resident_bytes"] == 300 << 20


def test_the_run_prints_the_activations_beside_the_prediction(measured_report):
    from pipec.runtime.trainer import activations_line

    plan, report, _ = measured_report
    line = activations_line(plan.mesh, report)
    acts = [r.peak_activation_bytes / 1024 for r in plan.prediction.per_rank]
    assert line == ("saved activations at their peak (first step), beside the prediction: "
                    f"rank 0 {acts[0]:.1f} KiB (+0.0% of {acts[0]:.1f} KiB), rank 1 {acts[1]:.1f} KiB (+0.0% of "
                    f"{acts[1]:.1f} KiB)")
    emulated = {**report, "measured": {**report["measured"], "per_rank": [
        {k: v for k, v in r.items() if k != "peak_activation_bytes"} for r in report["measured"]["per_rank"]]}}
    assert activations_line(plan.mesh, emulated) is None


def test_show_measured_puts_the_counted_bytes_beside_the_predicted(measured_report, capsys):
    from pipec.cli import main

    plan, report, d = measured_report
    assert main(["show", str(d / "p.json"), "--measured", str(d / "report.json")]) == 0
    out = capsys.readouterr().out
    table = out[out.index("memory: what the prediction counts"):]
    rows = [line for line in table.splitlines() if " pred " in line or " meas " in line]
    assert len(rows) == 4
    act = plan.prediction.per_rank[0].peak_activation_bytes
    assert f"{act / 1024:.1f} KiB (+0.0%)" in rows[1]  # the activations measured, as predicted
    assert "300" not in table  # the resident size is not set beside what the prediction counts
    words = " ".join(table.split())
    assert "allocator's peak (torch.cuda.max_memory_allocated; none on CPU)" in words
    assert "blank: not measured" in words
    assert "saved for the backward, at the peak (measured in the first step)" in words


def test_no_memory_table_without_measured_bytes():
    from pipec.compiler.ir.timeline import Timeline
    from pipec.views.summary import memory_table

    plan = _mlp("1f1b", 1)
    bare = Timeline.build(step_time=1.0, busy={0: (0.5, 0.0), 1: (0.5, 0.0)})
    assert memory_table(plan.prediction, bare) is None
