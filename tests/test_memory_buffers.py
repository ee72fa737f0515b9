"""The memory model counts the collective buffers where the runtime holds them (runtime/executor.py, sharding.py):
a dp all-reduce's flat float32 buffer (the stage's gradients, concatenated) and a REDUCE_SCATTER's flat float32
input (the unsharded gradients, padded) stay alive until they are waited for: in OPT, or first by HSDP's
AR<s>:dp.replicate (its own stage's reduce-scatter) or a tie all-reduce (every reduction in flight). By hand:
35 parameters per stage, shapes (10, 3) and (5,); padded over 4 ranks to 44, over 2 to 36."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipec.compiler.driver import compile_plan
from pipec.compiler.ir.program import parse_program
from pipec.compiler.passes.memory import breakdown, transient_bytes
from pipec.compiler.ir.plan import Tie

SHAPES = ((10, 3), (5,))


def _plan(mode: str, dp: int, shard_size=None, chunks: int = 1, schedule: str = "1f1b"):
    plan = compile_plan(schedule=schedule, num_ranks=2, num_microbatches=4, num_chunks=chunks, dp=dp, shard=mode,
                        shard_size=shard_size).plan
    return replace(plan, stages=tuple(replace(st, num_params=35, param_shapes=SHAPES) for st in plan.stages))


@pytest.mark.parametrize(("mode", "shard_size", "unsharded", "buffers"), [
    ("none", None, 0, 35 * 4),              # AR0:dp's flat buffer, posted after the last backward, until OPT
    ("optimizer", None, 0, 35 * 4),         # ZeRO-1 all-reduces the full gradients the same way
    ("grads", None, 2 * 44 * 4, 44 * 4),    # at the RS: gathered params + unsharded grads + the RS's input
    ("full", None, 2 * 44 * 4, 44 * 4),
    ("grads", 2, 2 * 36 * 4, 36 * 4),       # HSDP: the RS's input; the replicate all-reduce's (36 / 2) comes after
])
def test_the_buffer_of_each_mode_at_its_peak_by_hand(mode, shard_size, unsharded, buffers):
    rows = breakdown(_plan(mode, 4, shard_size))
    assert [(m.unsharded, m.buffers) for m in rows] == [(unsharded, buffers)] * 2
    assert all(m.transient == unsharded + buffers for m in rows)


def _walk(plan, text: str) -> tuple[int, int]:
    """(unsharded, buffers) at the peak of a hand-written program for pp rank 0 of ``plan``."""
    program = parse_program(text + "\n1: OPT")
    return transient_bytes(replace(plan, program=program, prediction=None))[0]


def test_hsdp_replicate_allreduce_frees_its_stages_reduce_scatter_input():
    """Stages 0 and 2 on one rank, shard grads, shard_size 2: a stage gathered or its grads unsharded is
    36 x 4 = 144 bytes, a RS input 144, a replicate all-reduce's buffer 72. At RS0 both stages are gathered,
    stage 0's grads unsharded (432) and RS0's input is in; RS2's input went at AR2 (its 72 stays): 216."""
    plan = _plan("grads", 4, 2, chunks=2, schedule="interleaved_1f1b")
    text = ("0: UN0:dp.shard UN2:dp.shard F0.0 F2.0 B2.0 RS2:dp.shard AR2:dp.replicate B0.0 RS0:dp.shard "
            "AR0:dp.replicate RE0:dp.shard RE2:dp.shard OPT")
    assert _walk(plan, text) == (3 * 144, 144 + 72)
    # had AR2 not waited for RS2, its input would still be held at RS0: 144 + 72 + 144
    held = _walk(plan, text.replace(" AR2:dp.replicate", "").replace("AR0:dp.replicate", "AR0:dp.replicate "
                                                                                         "AR2:dp.replicate"))
    assert held == (3 * 144, 144 + 144)


def test_a_tie_allreduce_frees_every_reduction_in_flight_and_holds_its_own():
    """shard grads over 4: a stage gathered or unsharded 44 x 4 = 176, a RS input 176; the tied weight is 40
    bytes (10 as a shard). AR2:tie.wte waits for RS2 (its input goes) and holds 10; at RS0: 3 x 176 + 176 + 10."""
    plan = replace(_plan("grads", 4, chunks=2, schedule="interleaved_1f1b"),
                   ties=(Tie(name="wte", stages=(1, 2), params=("wte.weight", "head.weight"), num_bytes=40),))
    text = "0: UN0:dp UN2:dp F0.0 F2.0 B2.0 RS2:dp AR2:tie.wte B0.0 RS0:dp RE0:dp RE2:dp OPT"
    assert _walk(plan, text) == (3 * 176, 176 + 10)
    none = replace(_plan("none", 4, chunks=2, schedule="interleaved_1f1b"), ties=plan.ties)
    # shard none: AR2:dp's 140 goes at the tie (which then holds 40), AR0:dp's 140 comes after it
    assert _walk(none, "0: F0.0 F2.0 B2.0 AR2:dp AR2:tie.wte B0.0 AR0:dp OPT") == (0, 40 + 140)


def test_the_prediction_adds_the_buffers_to_the_peak():
    """The driver's predicted peak is state + gathered/unsharded + buffers + saved activations."""
    from pipec.compiler.driver import prove_and_predict

    plan = _plan("grads", 4)
    plan = replace(plan, stages=tuple(replace(st, activation_bytes=1000) for st in plan.stages))
    rows = breakdown(plan)
    per_rank = prove_and_predict(plan, prove=False).prediction.per_rank
    peaks = [rt.peak_memory_bytes for rt in per_rank]
    acts = [rt.peak_activations * 1000 for rt in per_rank]
    assert all(m.buffers for m in rows)
    assert peaks == [m.state + m.unsharded + m.buffers + a for m, a in zip(rows, acts)]
