"""The simulator waits for a posted REDUCE_SCATTER where the executor does (runtime/executor.py,
``finish_scatters``): in ``OPT``, or first in HSDP's ``AR<s>:dp.replicate`` (its own stage's) and in a tie
all-reduce (every one in flight on its rank), the wait a ``~`` event, under both comm models. Times by hand:
F=1, B=2, each REDUCE_SCATTER 1 on its rank's dp lane, UNSHARD and RESHARD free, no transfer time."""

from __future__ import annotations

import pytest

from pipec.compiler.sim.cost import CostModel
from pipec.compiler.sim.engine import execute
from pipec.compiler.ir.program import parse_program
from pipec.compiler.ir.plan import Edge, Tie
from pipec.schedules.timing import Cost

MODELS = ("buffered", "in_order")


def _run(text: str, placement, allreduce: dict, model: str, ties=()):
    program = parse_program(text)
    S = len(placement)
    cost = Cost(fwd=1.0, bwd=2.0, bwd_i=1.0, bwd_w=1.0, optim=0.0)
    costs = CostModel(stages=(cost,) * S, transfer={}, allreduce=allreduce,
                      shard={("REDUCE_SCATTER", s): 1.0 for s in range(S)})
    edges = [Edge(src_stage=s, dst_stage=s + 1) for s in range(S - 1)]
    return execute(program, placement=placement, num_microbatches=1, edges=edges, costs=costs, model=model,
                   ties=ties)


def _events(ex, rank: int) -> list[tuple[str, float, float]]:
    return [(e.text, e.start, e.end) for e in ex.events if e.rank == rank]


HSDP = ("0: UN0:dp.shard UN1:dp.shard F0.0 F1.0 B1.0 RS1:dp.shard B0.0 RS0:dp.shard AR1:dp.replicate "
        "AR0:dp.replicate RE0:dp.shard RE1:dp.shard OPT")


@pytest.mark.parametrize("model", MODELS)
def test_hsdp_replicate_allreduce_waits_for_its_own_stages_reduce_scatter(model):
    """pp 1, dp 4, shard_size 2, two stages on the rank. RS1 runs 4-5 on the lane, RS0 6-7 (posted after
    B0.0 4-6). AR1 at 6 finds its RS done and is posted (0.5: done 6.5); AR0 waits for RS0 (it does not
    wait for RS1's successor, nor RS1 for it): ~AR0 6-7, posted at 7, done 7.5; OPT waits for it, 7-7.5.
    Before, the all-reduces did not wait and the step ended at the lane's last RS, 7."""
    ex = _run(HSDP, (0, 0), {("dp.replicate", 0): 0.5, ("dp.replicate", 1): 0.5}, model)
    assert ex.step_time == pytest.approx(7.5)
    assert _events(ex, 0)[8:] == [("AR1:dp.replicate", 6.0, 6.0), ("~AR0:dp.replicate", 6.0, 7.0),
                                  ("AR0:dp.replicate", 7.0, 7.0), ("RE0:dp.shard", 7.0, 7.0),
                                  ("RE1:dp.shard", 7.0, 7.0), ("~OPT", 7.0, 7.5), ("OPT", 7.5, 7.5)]
    assert ex.comm_wait == pytest.approx((1.5,))


TIED = """
0: UN0:dp F0.0 SA0.0>1@1 RG0.0<1@1 B0.0 RS0:dp AR0:tie.wte RE0:dp OPT
1: UN1:dp UN2:dp RA1.0<0@0 F1.0 F2.0 B2.0 RS2:dp B1.0 RS1:dp SG1.0>0@0 AR2:tie.wte RE1:dp RE2:dp OPT
"""


@pytest.mark.parametrize("model", MODELS)
def test_a_tie_allreduce_waits_for_every_reduce_scatter_in_flight(model):
    """shard grads over dp; stages 0 and 2 share a tied weight, stages 1 and 2 sit on rank 1. Rank 1: B2.0
    3-5, RS2 5-6, B1.0 5-7, RS1 7-8; AR2:tie.wte at 7 waits for RS1 too (not its stage's): ~ 7-8. Rank 0:
    B0.0 7-9, RS0 9-10, ~AR0:tie.wte 9-10; the tie (0.25) completes at 10.25, and both OPTs wait for it."""
    ties = (Tie(name="wte", stages=(0, 2), params=("wte.weight", "head.weight")),)
    ex = _run(TIED, (0, 1, 1), {("tie.wte", 0): 0.25, ("tie.wte", 2): 0.25}, model, ties)
    assert ex.step_time == pytest.approx(10.25)
    one = _events(ex, 1)
    assert ("~AR2:tie.wte", 7.0, 8.0) in one and ("AR2:tie.wte", 8.0, 8.0) in one
    assert one[-2:] == [("~OPT", 8.0, 10.25), ("OPT", 10.25, 10.25)]
    assert _events(ex, 0)[4:] == [("~AR0:tie.wte", 9.0, 10.0), ("AR0:tie.wte", 10.0, 10.0),
                                  ("RE0:dp", 10.0, 10.0), ("~OPT", 10.0, 10.25), ("OPT", 10.25, 10.25)]


def test_opt_still_waits_for_a_reduce_scatter_no_reduction_waited_for():
    """shard grads without HSDP or ties: no all-reduce, so only OPT waits for the RS (posted at 3, done 4)."""
    ex = _run("0: UN0:dp F0.0 B0.0 RS0:dp RE0:dp OPT", (0,), {}, "buffered")
    assert _events(ex, 0)[3:] == [("RS0:dp", 3.0, 3.0), ("RE0:dp", 3.0, 3.0), ("~OPT", 3.0, 4.0),
                                  ("OPT", 4.0, 4.0)]
