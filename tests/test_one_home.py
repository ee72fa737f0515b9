"""Each mesh value in one home (issue 33): what a shard mode shards is one table (:data:`SHARDING`) that the memory
model, tune's bound, the simulator, the lowering and the runtime read; the dp groups are one function
(:meth:`Mesh.dp_groups`); the tp degree lives on ``mesh.tp`` alone (a stage's record says what tp did, not at what
degree); tp's range is checked once on compile and once on load, with one message."""

from __future__ import annotations

import pytest

from pipec.compiler.driver import compile_plan
from pipec.compiler.ir.plan import SHARD_MODES, SHARDING, Mesh, Plan, Stage, TensorSpec, local_specs
from pipec.compiler.ir.plan_json import load_plan, plan_to_json
from pipec.compiler.ir.program import Op, Program
from pipec.compiler.ir.tensor_parallel import ShardedParam, StageTP, in_effect
from pipec.compiler.passes.memory import stage_state
from pipec.compiler.sim import simulate
from pipec.errors import PipecError

SHAPES = ((8, 4), (8,), (4, 8))
NUM = 8 * 4 + 8 + 4 * 8


def _plan(mesh: Mesh, record: StageTP | None = None) -> Plan:
    stage = Stage(stage=0, rank=0, params=("a", "b", "c"), param_shapes=SHAPES, num_params=NUM, param_bytes=4 * NUM,
                  tp=record)
    return Plan(mesh=mesh, num_stages=1, num_microbatches=1, placement=(0,), program=Program(((),)),
                stages=(stage,), model={"target": "m:f"})


# ----------------------------------------------------------------------------- shard modes


def test_the_table_says_what_each_mode_shards():
    assert SHARD_MODES == ("none", "optimizer", "grads", "full")
    got = {m: (SHARDING[m].params, SHARDING[m].grads, SHARDING[m].optimizer, SHARDING[m].unshard) for m in SHARD_MODES}
    assert got == {"none": (False, False, False, None), "optimizer": (False, False, True, None),
                   "grads": (True, True, True, "step"), "full": (True, True, True, "runs")}


@pytest.mark.parametrize("mode, want", [
    ("optimizer", (4 * NUM, 4 * NUM, 8 * NUM // 2)),      # ZeRO-1: the moments alone over the 2 replicas
    ("grads", (4 * NUM // 2, 4 * NUM // 2, 8 * NUM // 2)),
    ("full", (4 * NUM // 2, 4 * NUM // 2, 8 * NUM // 2)),
])
def test_memory_tune_and_the_runtime_read_the_table(mode, want):
    from pipec.runtime.sharding import ShardLayout
    from pipec.tune.search import _per_param
    from pipec.tune.space import Candidate

    mesh = Mesh(pp=1, dp=2, shard=mode)
    plan = _plan(mesh)
    assert stage_state(plan.stages[0], plan) == want             # every dim 0 is even: no padding
    c = Candidate(pp=1, dp=2, shard=mode, schedule="1f1b", num_chunks=1, num_microbatches=1, partition_by=None)
    assert _per_param(c, plan.spec) == pytest.approx(sum(want) / NUM)   # tune's bound is exact when unpadded
    layout = ShardLayout.of(mesh, 1)
    assert layout.params_sharded == mesh.params_sharded == SHARDING[mode].params and layout.ranks == (0, 1)


def test_the_simulator_and_the_lowering_follow_the_table():
    """``optimizer``: whole parameters, so OPT gathers the updated ones and no UNSHARD is lowered; ``grads``:
    one unshard window per stage and step; ``full``: one per run of the stage's computes (more of them)."""
    unshards = {}
    for mode in ("optimizer", "grads", "full"):
        one = _plan(Mesh(pp=1, dp=2, shard=mode))
        priced = simulate._shard_costs(one, {}, simulate.Pricing(one))
        assert (("OPTIM_STEP", 0) in priced) == (not SHARDING[mode].params) == (("UNSHARD", 0) not in priced)
        plan = compile_plan(num_ranks=2, num_microbatches=4, schedule="looped_bfs", num_chunks=2, dp=2,
                            shard=mode).plan
        unshards[mode] = sum(i.op is Op.UNSHARD for i in plan.program.ranks[0])
    assert unshards["optimizer"] == 0 and unshards["grads"] == 2 and unshards["full"] > 2   # 2 stages a rank


# ----------------------------------------------------------------------------- dp groups


@pytest.mark.parametrize("mesh", [
    Mesh(pp=2, dp=4, tp=2, shard="full", shard_size=2),                       # tp groups inside a node: aligned
    Mesh(pp=2, dp=4, tp=2, shard="full", shard_size=2, devices_per_node=1),   # tp across nodes: every tp rank
    Mesh(pp=1, dp=6, shard="optimizer", shard_size=3),
])
def test_one_dp_group_function(mesh):
    groups = ["dp", "dp.shard", "dp.replicate"] if mesh.hybrid else ["dp"]
    for group in groups:
        blocks = mesh.dp_groups(group)
        assert sorted(d for ds in blocks for d in ds) == list(range(mesh.dp))      # a partition of the replicas
        for g in range(mesh.world_size):
            members = mesh.group_ranks(group, g)
            assert g in members and {mesh.coords(x)[0] for x in members} == {mesh.coords(g)[0]}
            assert {mesh.tp_rank(x) for x in members} == {mesh.tp_rank(g)}
        for p in range(mesh.pp):
            tps = range(1) if simulate._aligned(mesh) else range(mesh.tp)
            want = tuple(dict.fromkeys(mesh.group_ranks(group, g) for t in tps for g in mesh.replicas(p, t)))
            assert simulate._dp_groups(mesh, group, p) == want
    with pytest.raises(KeyError, match="not a dp group"):
        mesh.dp_groups("tp")


# ----------------------------------------------------------------------------- the tp degree


def test_a_stage_record_holds_no_degree_and_means_the_meshs_tp():
    record = StageTP(params=(ShardedParam(name="a", dim=0),), sharded_flops=0.5, sequence_parallel=True, seq_len=8,
                     seq_outputs=(("x", 1),))
    assert "tp" not in record.to_json() and StageTP.from_json(record.to_json()) == record
    assert record.compute_share(2) == pytest.approx(0.75) and record.compute_share(4) == pytest.approx(0.625)
    assert in_effect(record, 1) is None and in_effect(record, 2) is record and in_effect(None, 2) is None
    for tp, held in ((1, NUM), (2, NUM - 32 + 16), (4, NUM - 32 + 8)):
        plan = _plan(Mesh(pp=1, dp=1, tp=tp), record)
        assert stage_state(plan.stages[0], plan)[0] == 4 * held    # param "a" over the mesh's tp, the rest whole
    x = (TensorSpec("x", "float32", (2, 8, 4)),)
    assert local_specs(_plan(Mesh(pp=1, tp=2), record), 0, x)[0].shape == (2, 4, 4)
    assert local_specs(_plan(Mesh(pp=1, tp=4), record), 0, x)[0].shape == (2, 2, 4)
    assert local_specs(_plan(Mesh(pp=1, tp=1), record), 0, x) == x


def test_tps_range_is_refused_once_on_compile_and_once_on_load_with_one_message():
    with pytest.raises(PipecError) as compiled:
        compile_plan(num_ranks=2, num_microbatches=4, schedule="1f1b", tp=5000)
    assert str(compiled.value) == "tp must be in 1..4096 (pipec's limit), got 5000" and compiled.value.key == "tp"
    obj = plan_to_json(compile_plan(num_ranks=2, num_microbatches=4, schedule="1f1b", tp=2).plan)
    obj["mesh"]["tp"] = 5000                                   # a hand-edited plan
    with pytest.raises(PipecError) as loaded:
        load_plan(obj)
    assert str(loaded.value) == f"plan.mesh.tp: {compiled.value}"
