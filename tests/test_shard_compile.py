"""Sharded data parallelism, compile side: keys, lowering, the verifier's proofs, text and plan.json round
trips, costs and the memory model (the note's 13B example included)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from conftest import located_refusals

from pipec.compiler.driver import compile_plan, compile_request, compile_spec
from pipec.compiler.sim.engine import MODELS, execute
from pipec.compiler.ir.program import SHARD_OPS, Instruction, Op, Program, parse_program
from pipec.compiler.passes.memory import breakdown, padded_params, state_bytes
from pipec.compiler.ir.plan import Mesh
from pipec.compiler.ir.plan_json import load_plan, plan_to_json, read_plan, write_plan
from pipec.compiler.request import CompileRequest, ModelSpec, Partition, TensorSpec
from pipec.compiler.sim.simulate import plan_costs
from pipec.compiler.passes.verify import VerifyError, verify
from pipec.dsl import DSLError, parse_spec
from pipec.errors import PipecError

MODES = ("none", "optimizer", "grads", "full")
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2))
MESHES = ((2, None), (4, 2))
"""(dp, shard_size): plain sharding over dp 2, HSDP over dp 4 in groups of 2."""


def _plan(schedule="1f1b", chunks=1, mode="full", dp=2, shard_size=None, M=4):
    return compile_plan(schedule=schedule, num_ranks=2, num_microbatches=M, num_chunks=chunks, dp=dp, shard=mode,
                        shard_size=shard_size if mode != "none" else None).plan


def _ops(instrs, stage=None):
    return [i for i in instrs if i.op in SHARD_OPS and (stage is None or i.stage == stage)]


# ----------------------------------------------------------------------------- keys


def test_keys_reach_the_mesh_and_plan_json():
    spec = parse_spec("pp 2\ndp 4\nshard full\nshard_size 2\n", filename="a.pipe")
    plan = compile_spec(spec).plan
    assert plan.mesh == Mesh(pp=2, dp=4, shard="full", shard_size=2)
    assert (plan.mesh.num_shards, plan.mesh.shard_group, plan.mesh.hybrid) == (2, "dp.shard", True)
    assert plan_to_json(plan)["mesh"] == {"pp": 2, "dp": 4, "shard": "full", "shard_size": 2}
    plain = compile_spec(parse_spec("pp 2\ndp 2\n", filename="b.pipe")).plan
    assert plan_to_json(plain)["mesh"] == {"pp": 2, "dp": 2}  # absent: none, all of dp
    assert Mesh(pp=1, dp=8, shard="grads").num_shards == 8 and Mesh(pp=1, dp=8).num_shards == 1


test_key_errors_are_located = located_refusals(
    ("pp 2\ndp 4\nshard full\nshard_size 3\n", "a.pipe:4:12", "shard_size 3 does not divide dp 4"),
    ("pp 2\nshard grads\n", "a.pipe:2:7", "shard grads needs dp >= 2"),
    ("pp 2\ndp 2\nshard_size 2\n", "a.pipe:3:12", "shard_size 2 is set but shard is none"),
)


def test_bad_shard_mode_is_refused_by_the_language():
    with pytest.raises(DSLError, match="shard"):
        parse_spec("pp 2\ndp 2\nshard zero3\n", filename="a.pipe")


def test_group_ranks_are_consecutive_shards_and_strided_replicas():
    mesh = Mesh(pp=2, dp=4, shard="full", shard_size=2)
    g = mesh.global_rank(1, 3)  # pp 1, dp 3
    assert mesh.group_ranks("dp", g) == (4, 5, 6, 7)
    assert mesh.group_ranks("dp.shard", g) == (6, 7)
    assert mesh.group_ranks("dp.replicate", g) == (5, 7)


# ----------------------------------------------------------------------------- lowering and proofs


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("schedule", "chunks"), SCHEDULES)
@pytest.mark.parametrize(("dp", "shard_size"), MESHES)
def test_every_mode_lowers_and_verifies_under_both_comm_models(mode, schedule, chunks, dp, shard_size):
    plan = _plan(schedule, chunks, mode, dp, shard_size)
    proof = verify(plan)
    assert set(proof.executions) == set(MODELS)
    group = plan.mesh.shard_group
    for r, instrs in enumerate(plan.program.ranks):
        stages = [s for s, p in enumerate(plan.placement) if p == r]
        if mode in ("none", "optimizer"):
            assert not _ops(instrs)
            assert [i.stage for i in instrs if i.op is Op.ALLREDUCE and i.group == "dp"] != [] or dp == 1
            continue
        assert not any(i.op is Op.ALLREDUCE and i.group == "dp" for i in instrs)  # RS replaces it
        for s in stages:
            ops = _ops(instrs, s)
            assert all(i.group == group for i in ops)
            rs = [k for k, i in enumerate(instrs) if i.op is Op.REDUCE_SCATTER and i.stage == s]
            last_bwd = max(k for k, i in enumerate(instrs) if i.stage == s and i.op in (Op.BWD, Op.BWD_W))
            assert len(rs) == 1 and rs[0] > last_bwd
            if plan.mesh.hybrid:
                assert instrs[rs[0] + 1] == Instruction(Op.ALLREDUCE, s, group="dp.replicate")
            opens = [i for i in ops if i.op is Op.UNSHARD]
            if mode == "grads":
                assert len(opens) == 1  # gathered once per step
            assert len(opens) == sum(1 for i in ops if i.op is Op.RESHARD)


def test_full_reshards_between_forward_and_backward_windows_and_merges_adjacent_ones():
    rank0 = _plan("interleaved_1f1b", 2, "full").program.ranks[0]
    windows = [i.text() for i in _ops(rank0, 0) if i.op is not Op.REDUCE_SCATTER]
    assert len(windows) > 2 and windows[0] == "UN0:dp" and windows[-1] == "RE0:dp"
    assert windows == ["UN0:dp", "RE0:dp"] * (len(windows) // 2)
    # one stage per rank: the stage's computes are one run, so full is one window, as grads
    assert [i.text() for i in _ops(_plan("1f1b", 1, "full").program.ranks[0])] == ["UN0:dp", "RS0:dp", "RE0:dp"]


def test_unshard_is_prefetched_one_compute_ahead():
    rank0 = _plan("interleaved_1f1b", 2, "grads").program.ranks[0]
    computes = [k for k, i in enumerate(rank0) if i.op in (Op.FWD, Op.BWD)]
    un2 = next(k for k, i in enumerate(rank0) if i.op is Op.UNSHARD and i.stage == 2)
    first2 = next(k for k in computes if rank0[k].stage == 2)
    assert [k for k in computes if un2 < k < first2] == [computes[computes.index(first2) - 1]]


def test_unshard_overlaps_compute_in_the_simulator():
    """With costs, the prefetched all-gather runs during the compute before it: the step is shorter than
    with the gather serialised in front of its window."""
    plan = _plan("interleaved_1f1b", 2, "grads")
    costs = replace(plan_costs(plan), shard={("UNSHARD", s): 0.5 for s in range(4)})
    kw = dict(placement=plan.placement, num_microbatches=plan.num_microbatches, edges=plan.edges, costs=costs)
    step = execute(plan.program, **kw).step_time
    base = execute(plan.program, **{**kw, "costs": plan_costs(plan)}).step_time
    assert base < step < base + 2 * 0.5  # the two gathers of each rank, partly hidden


def test_text_round_trip_of_sharded_programs():
    for mode, (dp, size) in (("full", (4, 2)), ("grads", (2, None))):
        program = _plan("zb_h1", 1, mode, dp, size).program
        assert parse_program(program.text()) == program
    for token in ("UN0:dp", "RE1:dp.shard", "RS2:dp.shard", "AR0:dp.replicate"):
        assert parse_program(f"0: {token}").ranks[0][0].text() == token


def test_plan_json_round_trip_and_old_plans_load(tmp_path):
    plan = _plan("interleaved_1f1b", 2, "full", 4, 2)
    path = tmp_path / "plan.json"
    write_plan(plan, str(path))
    back = read_plan(str(path))
    assert back.mesh == plan.mesh and back.program == plan.program
    obj = plan_to_json(_plan(mode="none"))
    assert "shard" not in obj["mesh"] and load_plan(obj).mesh.shard == "none"
    obj["mesh"]["shard_size"] = 3
    obj["mesh"]["shard"] = "grads"
    with pytest.raises(PipecError, match=r"mesh.shard_size: shard_size 3 does not divide dp 2"):
        load_plan(obj)


# ----------------------------------------------------------------------------- corruptions


def _with(plan, rank: int, instrs):
    return replace(plan, program=Program(tuple(tuple(instrs) if r == rank else x
                                               for r, x in enumerate(plan.program.ranks))), prediction=None)


def test_a_compute_outside_its_unshard_window_is_rejected():
    plan = _plan("interleaved_1f1b", 2, "full")
    instrs = list(plan.program.ranks[0])
    re0 = next(k for k, i in enumerate(instrs) if i.op is Op.RESHARD and i.stage == 0)
    del instrs[next(k for k, i in enumerate(instrs) if k > re0 and i.op is Op.UNSHARD and i.stage == 0)]
    with pytest.raises(VerifyError, match=r"rank 0, instruction \d+ \([FB]0\.\d\): runs outside an unshard window: "
                                          r"stage 0's parameters are sharded \(shard full\); post UN0:dp before it"):
        verify(_with(plan, 0, instrs))


def test_unshard_window_misuse_is_rejected():
    plan = _plan("1f1b", 1, "grads")
    instrs = list(plan.program.ranks[0])
    with pytest.raises(VerifyError, match=r"already unsharded"):
        verify(_with(plan, 0, [instrs[0], *instrs]))
    with pytest.raises(VerifyError, match=r"still unsharded at the step's end"):
        verify(_with(plan, 0, [i for i in instrs if i.op is not Op.RESHARD]))
    with pytest.raises(VerifyError, match=r"sharded over dp, not dp.shard"):
        verify(_with(plan, 0, [i._replace(group="dp.shard") if i.op in SHARD_OPS else i for i in instrs]))
    with pytest.raises(VerifyError, match=r"never reduce-scattered"):
        verify(_with(plan, 0, [i for i in instrs if i.op is not Op.REDUCE_SCATTER]))
    rs = next(k for k, i in enumerate(instrs) if i.op is Op.REDUCE_SCATTER)
    early = [*instrs[:2], instrs[rs], *(i for k, i in enumerate(instrs) if k >= 2 and k != rs)]
    with pytest.raises(VerifyError, match=r"comes before the last backward of stage 0"):
        verify(_with(plan, 0, early))
    unsharded = _plan("1f1b", 1, "none")
    with pytest.raises(VerifyError, match=r"does not shard parameters"):
        verify(_with(unsharded, 0, [Instruction(Op.UNSHARD, 0, group="dp"), *unsharded.program.ranks[0]]))


def test_shard_group_collectives_in_different_orders_are_rejected():
    """A tied weight's copies on two pp ranks, sharded: its all-reduce runs on the gradient shards, so each
    member issues it after its RS; a member that issues it before (on its full gradients) reduces another
    tensor than the others."""
    from pipec.compiler.passes.lower import lower
    from pipec.compiler.ir.plan import Tie
    from pipec.schedules import build_order

    base = _plan("1f1b", 1, "grads")
    ties = (Tie(name="wte", stages=(0, 1), params=("wte.weight", "lm_head.weight")),)
    program = lower(build_order("1f1b", num_ranks=2, num_microbatches=4), edges=base.edges,
                    costs=plan_costs(base), mesh=base.mesh, ties=ties)
    plan = replace(base, ties=ties, program=program, prediction=None)
    verify(plan)
    rank1 = list(program.ranks[1])
    tie = rank1.pop(next(k for k, i in enumerate(rank1) if i.op is Op.ALLREDUCE))
    rs = next(k for k, i in enumerate(rank1) if i.op is Op.REDUCE_SCATTER)
    rank1.insert(rs, tie)
    with pytest.raises(VerifyError, match=r"rank 1, instruction \d+ \(AR1:tie.wte\): runs on the gradient shards"):
        verify(_with(plan, 1, rank1))


# ----------------------------------------------------------------------------- memory


def _with_params(plan, shapes):
    """The plan's stages given parameters of these shapes (each stage the same)."""
    n = sum(_numel(s) for s in shapes)
    stages = tuple(replace(st, num_params=n, param_shapes=tuple(shapes)) for st in plan.stages)
    return replace(plan, stages=stages)


def _numel(shape):
    out = 1
    for d in shape:
        out *= d
    return out


@pytest.mark.parametrize(("mode", "state", "unsharded"), [
    ("none", 35 * 16, 0),
    ("optimizer", 35 * 4 + 35 * 4 + 11 * 8, 0),   # ZeRO-1: the moments' 44 padded values / 4 ranks
    ("grads", 11 * 16, 44 * 4 * 2),               # the gathered params and the unsharded grads, float32
    ("full", 11 * 16, 44 * 4 * 2),
])
def test_memory_per_mode_by_hand(mode, state, unsharded):
    """35 parameters, shapes (10, 3) and (5,), over 4 ranks: dim 0 padded to 12 and 8, so 36 + 8 = 44."""
    plan = _with_params(_plan("1f1b", 1, mode, dp=4), [(10, 3), (5,)])
    assert padded_params(plan.stages[0], 4, plan.mesh.tp) == 44
    rows = breakdown(plan)
    assert state_bytes(plan) == [state, state]
    assert [m.unsharded for m in rows] == [unsharded, unsharded]
    assert rows[0].params + rows[0].grads + rows[0].optimizer == state


def test_memory_follows_the_optimizer_and_the_compute_dtype():
    plan = _with_params(_plan("1f1b", 1, "grads", dp=4), [(10, 3), (5,)])
    sgd = replace(plan, spec={"optimizer": {"name": "sgd", "momentum": 0.0}, "dtype": "bfloat16"})
    assert state_bytes(sgd) == [11 * 8] * 2
    assert [m.unsharded for m in breakdown(sgd)] == [44 * 2 * 2] * 2  # gathered in bfloat16 (FSDP2's param_dtype)
    momentum = replace(plan, spec={"optimizer": {"name": "sgd", "momentum": 0.9}})
    assert state_bytes(momentum) == [11 * 12] * 2


def test_full_holds_no_more_unsharded_than_grads_under_interleaving():
    """Same state at rest; full's windows are shorter, but the unsharded gradients (accumulated until the
    RS) and the prefetch keep both stages of a rank gathered at the backward's peak, so the peak is equal
    here (2 stages' params + 2 stages' grads)."""
    shapes = [(64, 64)]
    grads = breakdown(_with_params(_plan("interleaved_1f1b", 2, "grads"), shapes))
    full = breakdown(_with_params(_plan("interleaved_1f1b", 2, "full"), shapes))
    assert all(f.state == g.state for f, g in zip(full, grads))
    assert all(f.unsharded <= g.unsharded == 2 * 2 * 64 * 64 * 4 for f, g in zip(full, grads))


GPT_13B = dict(layers=40, dim=5120, heads=40, vocab=50304, seq=2048)


def thirteen_b(shard: str):
    """The note's example: a 13B GPT on the meta device, pp 1 x dp 8, unit costs (compiles in seconds)."""
    model = ModelSpec(target="pipec.examples.gpt:build", kwargs=GPT_13B,
                      inputs=(TensorSpec("tokens", "int64", (8, 2048)),),
                      partition=Partition("auto"), costs="unit", trace="auto")
    return compile_request(CompileRequest(schedule="1f1b", mesh=Mesh(pp=1, dp=8, shard=shard), num_microbatches=8,
                                          model=model)).plan


def test_the_notes_13b_example():
    """16 bytes per parameter (float32 AdamW) of 12.85B parameters: about 206 GB per rank unsharded,
    about 26 GB with shard full over 8 replicas (FSDP2's padding included)."""
    none, full = thirteen_b("none"), thirteen_b("full")
    n = none.stages[0].num_params
    assert 12.85e9 < n < 12.86e9
    assert state_bytes(none) == [16 * n] and 205e9 < state_bytes(none)[0] < 207e9
    (full_state,) = state_bytes(full)
    assert 25.5e9 < full_state < 26e9 and full_state >= 16 * n / 8
    assert full.prediction.per_rank[0].state_bytes == full_state
    assert json.loads(json.dumps(plan_to_json(full)))["prediction"]["per_rank"][0]["state_bytes"] == full_state
