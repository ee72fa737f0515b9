"""The compiler core end to end: every schedule its rules allow compiles to a verified plan.

Sweeps P in 1..8, M in 1..4P, v in 1..3: lowering, both proofs, the
simulator's formulas, JSON and text round trips, golden programs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipec.compiler.driver import compile_plan
from pipec.compiler.sim.engine import execute
from pipec.compiler.ir.program import parse_program
from pipec.compiler.ir.plan_json import read_plan, write_plan
from pipec.compiler.sim.simulate import chain_edges, plan_costs
from pipec.schedules import SCHEDULES, ScheduleError, check_rules

GOLDEN = Path(__file__).parent / "golden"


def configs():
    for P in range(1, 9):
        for M in range(1, 4 * P + 1):
            for name, info in SCHEDULES.items():
                for v in (1, 2, 3):
                    if not info.chunks_allowed(v):
                        continue
                    try:
                        check_rules(name, num_ranks=P, num_microbatches=M, num_chunks=v)
                    except ScheduleError:
                        continue
                    yield name, P, M, v


CONFIGS = list(configs())


def test_sweep_is_broad():
    names = {c[0] for c in CONFIGS}
    assert names == set(SCHEDULES) and len(CONFIGS) > 1000


# P 1..5 in the default run; the long tail (P 6..8, about 40 s on 2 cores) in ./dev test --slow
@pytest.mark.parametrize("P", [*range(1, 6), *(pytest.param(P, marks=pytest.mark.slow) for P in range(6, 9))])
def test_every_allowed_schedule_compiles_and_verifies(P):
    for name, p, M, v in CONFIGS:
        if p != P:
            continue
        plan = compile_plan(schedule=name, num_ranks=P, num_microbatches=M, num_chunks=v).plan
        pred = plan.prediction
        where = f"{name} P={P} M={M} v={v}"
        # both comm models finish, with the same compute per rank (the verifier ran them; run in-order again here)
        ex = execute(plan.program, placement=plan.placement, num_microbatches=M, edges=plan.edges,
                     costs=plan_costs(plan), model="in_order")
        assert ex.step_time >= max(r.compute for r in pred.per_rank), where
        for r in pred.per_rank:
            assert abs(r.compute + r.comm_wait + r.idle - pred.step_time) < 1e-9, where
        S = plan.num_stages
        # unit-cost work per rank: every (stage, microbatch) once forward (1) and once backward (2)
        assert sum(r.compute for r in pred.per_rank) == pytest.approx(3 * S * M), where
        if name in ("gpipe", "1f1b"):
            assert pred.bubble_fraction == pytest.approx((P - 1) / (M + P - 1)), where
        if name == "interleaved_1f1b" and M % P == 0:
            assert pred.bubble_fraction == pytest.approx((P - 1) / (v * M + P - 1)), where
        if name == "1f1b":
            assert [r.peak_activations for r in pred.per_rank] == [min(P - r, M) for r in range(P)], where
        if name == "gpipe":
            assert all(r.peak_activations == M for r in pred.per_rank), where


@pytest.mark.parametrize("P", [2, 4, 8])
def test_zero_bubble_schedules_beat_1f1b(P):
    for M in (P, 2 * P, 4 * P):
        one = compile_plan(schedule="1f1b", num_ranks=P, num_microbatches=M).plan.prediction
        zb = compile_plan(schedule="zb_h1", num_ranks=P, num_microbatches=M).plan.prediction
        assert zb.bubble_fraction < one.bubble_fraction
        # the Zero Bubble paper: ZB-H1's idle time is about a third of 1F1B's, at 1F1B's peak activations
        idle = lambda tl: sum(r.comm_wait + r.idle for r in tl.per_rank)  # noqa: E731
        assert idle(zb) == pytest.approx(idle(one) / 3)
        assert max(r.peak_activations for r in zb.per_rank) == max(r.peak_activations for r in one.per_rank)


def test_zbv_bubble_is_small_and_falls_with_microbatches():
    bubbles = [compile_plan(schedule="zbv", num_ranks=4, num_microbatches=M, num_chunks=2).plan.prediction.bubble_fraction
               for M in (8, 16, 32)]
    assert bubbles[0] == pytest.approx(0.059, abs=0.001)
    assert bubbles[0] > bubbles[1] > bubbles[2]


@pytest.mark.parametrize("name, P, M, v, dp", [
    ("1f1b", 4, 8, 1, 2), ("interleaved_1f1b", 4, 8, 2, 1), ("zbv", 4, 8, 2, 2), ("zb_h1", 3, 5, 1, 1),
    ("gpipe", 2, 3, 1, 4), ("looped_bfs", 2, 4, 3, 1),
])
def test_json_and_text_round_trips(tmp_path, name, P, M, v, dp):
    plan = compile_plan(schedule=name, num_ranks=P, num_microbatches=M, num_chunks=v, dp=dp).plan
    path = tmp_path / "plan.json"
    write_plan(plan, str(path))
    assert read_plan(str(path)) == plan
    assert parse_program(plan.program.text()) == plan.program


def test_dp_adds_one_allreduce_per_stage_after_its_last_backward():
    plan = compile_plan(schedule="interleaved_1f1b", num_ranks=2, num_microbatches=4, num_chunks=2, dp=2).plan
    for r, instrs in enumerate(plan.program.ranks):
        ars = [i for i, ins in enumerate(instrs) if ins.op.value == "ALLREDUCE"]
        assert sorted(instrs[i].stage for i in ars) == [s for s in range(4) if plan.placement[s] == r]
        for i in ars:
            s = instrs[i].stage
            last = max(j for j, ins in enumerate(instrs) if ins.stage == s and ins.op.value in ("BWD", "BWD_W"))
            assert last < i
        assert instrs[-1].op.value == "OPTIM_STEP"


GOLDEN_CONFIGS = [("1f1b", 2, 3, 1, 1), ("gpipe", 3, 2, 1, 2), ("interleaved_1f1b", 2, 4, 2, 1), ("zbv", 2, 3, 2, 1),
                  ("zb_h1", 2, 3, 1, 1)]


@pytest.mark.parametrize("name, P, M, v, dp", GOLDEN_CONFIGS)
def test_golden_programs(name, P, M, v, dp):
    """Hand-checked programs; regenerate with PIPEC_REGEN_GOLDEN=1 only after checking the diff by hand."""
    import os

    plan = compile_plan(schedule=name, num_ranks=P, num_microbatches=M, num_chunks=v, dp=dp).plan
    path = GOLDEN / f"{name}_P{P}_M{M}_v{v}_dp{dp}.txt"
    if os.environ.get("PIPEC_REGEN_GOLDEN"):
        path.write_text(plan.program.text() + "\n")
    assert plan.program.text() + "\n" == path.read_text()


def test_chain_edges():
    assert [(e.src_stage, e.dst_stage) for e in chain_edges(3)] == [(0, 1), (1, 2)]


# ----------------------------------------------------------------------------- located errors through `pipec compile`

MLP = 'model "pipec.examples.mlp:build" (layers=4, dim=8)\ninput x: float32[8, 8]\npp 2\nloss mse\ncosts flops\npeak_flops 1e12\n'


def _compile_file(tmp_path, capsys, text: str) -> tuple[int, str]:
    from pipec.cli import main

    path = tmp_path / "f.pipe"
    path.write_text(text)
    code = main(["compile", str(path), "-o", str(tmp_path / "plan.json")])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("text, line, col, width, message", [
    (MLP + "partition split before blocks.9\n", 7, 24, 8, "no node of the traced graph belongs to module 'blocks.9'"),
    (MLP.replace("pipec.examples.mlp:build", "pipec_no_such_module:build"), 1, 7, 28,
     "cannot find module 'pipec_no_such_module'"),
    (MLP.replace("dim=8)", "dim=8, width=3)"), 1, 35, 25, "rejected its arguments"),
    (MLP + "device_memory 1KB\n", 7, 15, 3, "pp rank 0 needs"),
], ids=["split point", "import", "factory arguments", "device_memory"])
def test_post_trace_errors_are_located_at_their_key(tmp_path, capsys, text, line, col, width, message):
    code, err = _compile_file(tmp_path, capsys, text)
    assert code == 2, err
    assert "Traceback" not in err
    first, source_line, marker = err.splitlines()[:3]
    assert f"f.pipe:{line}:{col}: error: " in first and message in first, err
    assert source_line == "    " + text.splitlines()[line - 1]
    assert marker == "    " + " " * (col - 1) + "^" + "~" * (width - 1), err
    assert err.count(message) == 1


def test_the_1f1b_warning_is_printed_once_at_the_value(tmp_path, capsys):
    code, err = _compile_file(tmp_path, capsys, "schedule 1f1b\npp 4\nmicrobatches 2\n")
    assert code == 0
    assert err.count("1f1b with fewer microbatches (2) than ranks (4)") == 1, err
    assert f"{tmp_path / 'f.pipe'}:3:14: warning: 1f1b with fewer microbatches" in err
    assert "use microbatches >= 4" in err


def test_the_trace_fallback_is_a_note_at_the_model(tmp_path, capsys):
    text = ('model "test_trace:Encoder"\ninput x: float32[2, 4, 16]\npp 3\nloss mse\ncosts flops\npeak_flops 1e12\n')
    code, err = _compile_file(tmp_path, capsys, text)
    assert code == 0, err
    assert f"{tmp_path / 'f.pipe'}:1:7: note: trace: auto fell back to torch.export" in err, err
    assert "trace was not set" not in err and err.count("fell back") == 1  # a note's default: only --verbose
    assert "fell back to torch.export" in read_plan(str(tmp_path / "plan.json")).model["notes"][0]
    from pipec.cli import main

    assert main(["compile", str(tmp_path / "f.pipe"), "-o", str(tmp_path / "plan.json"), "--verbose"]) == 0
    assert "trace was not set; its default is used" in capsys.readouterr().err
