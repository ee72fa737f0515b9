"""Receives posted when the step starts (the executor over gloo, runtime/executor.py): the buffered model
moves a message once its send is posted (CostModel.early_receives), and plans measured on gloo say so."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipec.compiler.sim.cost import CostModel
from pipec.compiler.sim.engine import execute
from pipec.compiler.ir.program import parse_program
from pipec.compiler.ir.plan import Measured, chain_edges
from pipec.compiler.sim.simulate import on_gloo, plan_costs
from pipec.schedules.timing import Cost

# gpipe, 2 ranks, 2 microbatches: rank 1 posts its second receive only after F1.0 (3 long), while rank 0 sent
# the activation at 2; a message takes 0.5
GPIPE = """0: F0.0 SA0.0>1@1 F0.1 SA0.1>1@1 RG0.0<1@1 B0.0 RG0.1<1@1 B0.1 OPT
1: RA1.0<0@0 F1.0 RA1.1<0@0 F1.1 B1.0 SG1.0>0@0 B1.1 SG1.1>0@0 OPT"""


def _start(early: bool, model: str, op: str) -> float:
    costs = CostModel(stages=(Cost(fwd=1.0, bwd=2.0, bwd_i=1.0, bwd_w=1.0, optim=0.0),
                              Cost(fwd=3.0, bwd=2.0, bwd_i=1.0, bwd_w=1.0, optim=0.0)),
                      transfer={(0, 1): 0.5, (1, 0): 0.5}, allreduce={}, early_receives=early)
    ex = execute(parse_program(GPIPE), placement=(0, 1), num_microbatches=2, edges=chain_edges(2), costs=costs,
                 model=model)
    return next(e.start for e in ex.events if e.text == op)


def test_an_early_receive_lets_the_message_move_when_it_is_sent():
    # in place: RA1.1 posted at 4.5 (F1.0 1.5-4.5), the message done at 5.0; early: done at 2 + 0.5
    assert _start(False, "buffered", "F1.1") == pytest.approx(5.0)
    assert _start(True, "buffered", "F1.1") == pytest.approx(4.5)


def test_nccl_keeps_the_plans_positions():
    assert _start(True, "in_order", "F1.1") == _start(False, "in_order", "F1.1")


def test_plans_measured_on_gloo_post_their_receives_early(tmp_path):
    from pipec.compiler.driver import compile_spec
    from pipec.dsl import load_spec

    spec = load_spec(None, {"model": "pipec.examples.mlp:build", "model_args": {"layers": 4, "dim": 8},
                            "input": "x: float32[4, 8]", "schedule": "1f1b", "pp": 2, "microbatches": 2,
                            "costs": "unit"})
    plan = compile_spec(spec).plan
    assert not on_gloo(plan) and not plan_costs(plan).early_receives  # units: nothing is measured
    gloo = Measured(at="2026-12-01T00:00:00+00:00", backend="gloo")
    seconds = replace(plan, spec={**plan.spec, "costs": "flops"})
    measured = replace(seconds, links={k: replace(v, measured=gloo) for k, v in seconds.links.items()})
    assert not plan_costs(seconds).early_receives  # given links: the backend is not known
    assert on_gloo(measured) and plan_costs(measured).early_receives
    nccl = replace(seconds, links={k: replace(v, measured=replace(gloo, backend="nccl")) for k, v in seconds.links.items()})
    assert not plan_costs(nccl).early_receives
