"""Tensor parallelism's costs, memory and tune (in-process, hand-built plans): tp 1 predicts what it always did;
a tp stage computes at its compute share plus its collectives, each a ring on the tp link (or intra / inter by
node, or dp); the dp all-reduce and the state divide the sharded parameters by tp (then by the shard size);
activations follow Megatron's count; a tp candidate priced by tune as its compile prices it; scaling efficiency;
and tune weighs tp against tp 1 for the source note's 13B GPT on its 64-GPU cluster (tp 2 with zbv kept), its bounds
holding."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipec.compiler.config import DEFAULTS
from pipec.compiler.driver import compile_request, schedule_order
from pipec.compiler.ir.plan import DEFAULT_LINKS, Edge, Link, Mesh, Plan, Stage, TensorSpec
from pipec.compiler.ir.program import Program
from pipec.compiler.ir.tensor_parallel import Collective, ShardedParam, StageTP
from pipec.compiler.passes.lower import lower
from pipec.compiler.passes.memory import (breakdown, local_param_bytes, local_params, megatron_block_activation_bytes,
                                          padded_params, tp_activation_bytes)
from pipec.compiler.request import CompileRequest, ModelSpec, Partition
from pipec.compiler.sim.metrics import plan_single_device_step, scaling_efficiency, single_device_step
from pipec.compiler.sim.simulate import link_sides, plan_costs, simulate
from pipec.schedules import SCHEDULES
from pipec.schedules.timing import Cost
from pipec.tune.bounds import bounds, candidate_frame
from pipec.tune.report import why
from pipec.tune.search import _Graphs, tune
from pipec.tune.space import TuneRequest, candidate_request, candidates

INTRA = Link(latency_s=2e-6, bandwidth_Bps=600e9)
INTER = Link(latency_s=1e-5, bandwidth_Bps=25e9)
DP = Link(latency_s=1e-5, bandwidth_Bps=20e9)
TP = Link(latency_s=1e-6, bandwidth_Bps=300e9)
COST = Cost(fwd=1e-3, bwd=2e-3, bwd_i=1e-3, bwd_w=1e-3, optim=4e-4)
H = 64                              # one block's width
SHAPES = ((3 * H, H), (3 * H,), (H, H), (H,), (4 * H, H), (4 * H,), (H, 4 * H), (H,), (H,))
NAMES = ("b.attn.qkv.weight", "b.attn.qkv.bias", "b.attn.proj.weight", "b.attn.proj.bias", "b.mlp.fc.weight",
         "b.mlp.fc.bias", "b.mlp.proj.weight", "b.mlp.proj.bias", "b.ln.weight")
SHARDED = {"b.attn.qkv.weight": 0, "b.attn.qkv.bias": 0, "b.attn.proj.weight": 1, "b.mlp.fc.weight": 0,
           "b.mlp.fc.bias": 0, "b.mlp.proj.weight": 1}
PAYLOAD = 4096 * 2                  # one all-reduce: 4096 activations (b s h) in bfloat16


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


NUM = sum(_numel(s) for s in SHAPES)
NUM_SHARDED = sum(_numel(s) for n, s in zip(NAMES, SHAPES) if n in SHARDED)


def _stage_tp(share: float = 0.9) -> StageTP:
    return StageTP(params=tuple(ShardedParam(name=n, dim=d, segments=3 if "qkv" in n else 1)
                                for n, d in SHARDED.items()),
                   collectives=(Collective(kind="all_reduce", phase="forward", num_bytes=PAYLOAD, node="a"),
                                Collective(kind="all_reduce", phase="forward", num_bytes=PAYLOAD, node="b"),
                                Collective(kind="all_reduce", phase="backward", num_bytes=PAYLOAD, node="c"),
                                Collective(kind="all_reduce", phase="backward", num_bytes=PAYLOAD, node="d")),
                   sharded_flops=share)


def _plan(pp: int = 2, dp: int = 2, tp: int = 1, *, stage_tp: bool = True, links=None, nodes=None, shard="none",
          activation_bytes=10**6, spec=None) -> Plan:
    stages = tuple(Stage(stage=s, rank=s, params=NAMES, param_shapes=SHAPES, num_params=NUM, param_bytes=4 * NUM,
                         activation_bytes=activation_bytes, cost=COST,
                         tp=_stage_tp() if stage_tp and tp > 1 else None) for s in range(pp))
    edges = tuple(Edge(src_stage=s, dst_stage=s + 1, tensors=(TensorSpec("x", "bfloat16", (4096,)),))
                  for s in range(pp - 1))
    return Plan(mesh=Mesh(pp=pp, dp=dp, tp=tp, devices_per_node=nodes, shard=shard), num_stages=pp,
                num_microbatches=4, placement=tuple(range(pp)), program=Program(()), stages=stages, edges=edges,
                links=links or {"pp": DP, "dp": DP}, model={"target": "m:f"}, spec=spec or {})


def _ring(link: Link, n: int, num_bytes: float, factor: float = 2.0) -> float:
    return link.latency_s + factor * (n - 1) / n * num_bytes / link.bandwidth_Bps


def _with_program(plan: Plan) -> Plan:
    order = SCHEDULES["1f1b"].build(num_ranks=plan.mesh.pp, num_microbatches=plan.num_microbatches, num_chunks=1)
    return replace(plan, program=lower(order, edges=plan.edges, costs=plan_costs(plan), mesh=plan.mesh, ties=()))


# ----------------------------------------------------------------------------- tp 1 is today's


def test_tp_1_or_no_stage_tp_prices_as_before():
    base = _plan(tp=1)
    costs = plan_costs(base)
    assert costs.stages == (COST, COST)
    assert costs.activation_bytes == (10**6, 10**6)
    assert costs.allreduce[("dp", 0)] == _ring(DP, 2, 4 * NUM)
    # a StageTP in a plan of tp 1 changes nothing either
    one = replace(base, stages=tuple(replace(st, tp=_stage_tp()) for st in base.stages))
    assert plan_costs(one) == costs
    assert breakdown(one) == breakdown(base)
    assert simulate(_with_program(one)) == simulate(_with_program(base))


def test_a_tp_mesh_without_stage_tp_replicates_the_stage():
    """tp 2 but no sharding decided: every tp rank runs the whole stage (no share, no collectives)."""
    costs = plan_costs(_plan(tp=2, stage_tp=False))
    assert costs.stages == (COST, COST)


# ----------------------------------------------------------------------------- compute and collectives


@pytest.mark.parametrize("tp", [2, 4])
def test_compute_scales_by_the_share_and_collectives_ride_the_tp_link(tp):
    plan = _plan(tp=tp, links={"pp": DP, "dp": DP, "tp": TP})
    k = _stage_tp().compute_share(tp)
    assert k == pytest.approx(0.9 / tp + 0.1)
    ar = _ring(TP, tp, PAYLOAD)
    c = plan_costs(plan).stages[0]
    assert c.fwd == pytest.approx(COST.fwd * k + 2 * ar)
    assert c.bwd_i == pytest.approx(COST.bwd_i * k + 2 * ar)       # the input-grad half carries the backward's
    assert c.bwd_w == pytest.approx(COST.bwd_w * k)
    assert c.bwd == pytest.approx(COST.bwd * k + 2 * ar)
    assert c.optim == pytest.approx(COST.optim * local_params(plan.stages[0], tp) / NUM)


def test_a_recomputed_stage_runs_its_forward_collectives_again():
    plan = _plan(tp=2, links={"pp": DP, "dp": DP, "tp": TP}, spec={"recompute": [1]})
    ar = _ring(TP, 2, PAYLOAD)
    c0, c1 = plan_costs(plan).stages
    assert c1.bwd_i == pytest.approx(c0.bwd_i + 2 * ar) and c1.fwd == c0.fwd


def test_without_a_tp_link_intra_prices_a_group_inside_a_node_and_dp_otherwise():
    inside = _plan(tp=2, nodes=4, links={"pp": DP, "dp": DP, "intra": INTRA, "inter": INTER})
    k = _stage_tp().compute_share(2)
    assert plan_costs(inside).stages[0].fwd == pytest.approx(COST.fwd * k + 2 * _ring(INTRA, 2, PAYLOAD))
    assert link_sides(inside)["tp"] == {"intra": 2, "inter": 0}
    # a tp group across 2 nodes of 1 device: the hierarchical ring's inter part only
    across = _plan(pp=1, dp=1, tp=2, nodes=1, links={"pp": DP, "dp": DP, "intra": INTRA, "inter": INTER})
    assert plan_costs(across).stages[0].fwd == pytest.approx(COST.fwd * k + 2 * _ring(INTER, 2, PAYLOAD))
    assert link_sides(across)["tp"] == {"intra": 0, "inter": 1}
    # no nodes said: the dp link
    flat = _plan(tp=2)
    assert plan_costs(flat).stages[0].fwd == pytest.approx(COST.fwd * k + 2 * _ring(DP, 2, PAYLOAD))


def _priced_stage(collectives, *, backend=None, profiled=False, dtype="float32") -> Cost:
    """Stage 0's cost at tp 2 on the tp link, its record holding ``collectives``; its links measured on
    ``backend`` (None: given), its stages profiled or priced from FLOPs, its run in ``dtype``."""
    from pipec.compiler.ir.plan import Measured

    tp = TP if backend is None else replace(TP, measured=Measured(at="2026-12-07T00:00:00Z", backend=backend))
    plan = _plan(tp=2, links={"pp": DP, "dp": DP, "tp": tp}, spec={"dtype": dtype})
    stp = StageTP(collectives=tuple(collectives), sharded_flops=0.9)
    plan = replace(plan, stages=tuple(replace(st, tp=stp) for st in plan.stages),
                   model={"target": "m:f", **({"profile": {"host_load": 0.0}} if profiled else {})})
    return plan_costs(plan).stages[0]


def test_sequence_parallel_collectives_are_priced_as_the_backend_runs_them():
    """NCCL's reduce-scatter and all-gather are rings (factor 1); gloo's all-gather too, but its reduce-scatter
    is an all-reduce and its part (factor 2); a backend without them all-reduces the padded whole (factor 2).
    The backend: the one the links were measured on; else gloo for profiled stages (timed on this host's CPU),
    NCCL for a plan priced from FLOPs."""
    from pipec.compiler.sim.tensor_parallel import backend_of

    sp = (Collective(kind="reduce_scatter", phase="forward", num_bytes=PAYLOAD, node="rs", dtype="bfloat16"),
          Collective(kind="all_gather", phase="backward", num_bytes=PAYLOAD, node="ag", dtype="bfloat16"))
    k = StageTP(sharded_flops=0.9).compute_share(2)
    gloo, nccl, mpi = (_priced_stage(sp, backend=b) for b in ("gloo", "nccl", "mpi"))
    assert gloo.fwd == pytest.approx(COST.fwd * k + _ring(TP, 2, PAYLOAD, 2.0))
    assert nccl.fwd == pytest.approx(COST.fwd * k + _ring(TP, 2, PAYLOAD, 1.0))
    assert gloo.bwd_i == pytest.approx(COST.bwd_i * k + _ring(TP, 2, PAYLOAD, 1.0)) == nccl.bwd_i
    assert mpi.fwd == pytest.approx(COST.fwd * k + _ring(TP, 2, PAYLOAD, 2.0))
    assert mpi.bwd_i == pytest.approx(COST.bwd_i * k + _ring(TP, 2, PAYLOAD, 2.0))
    assert _priced_stage(sp, profiled=True) == gloo                # profiled on CPU: gloo
    assert _priced_stage(sp) == nccl                               # from FLOPs, links given: NCCL
    assert backend_of(_plan(tp=2)) == "nccl"


def test_tp_collectives_are_priced_in_the_dtype_the_run_moves():
    """Under ``dtype bfloat16`` a payload traced float32 under autocast (a norm's output, the gradient f sums into
    it) moves in bfloat16, as one traced bfloat16 (a rowwise output) does; the loss's per-token values stay
    float32. Under float32 each moves as traced."""
    from pipec.compiler.ir.tensor_parallel import loss_collectives

    f = Collective(kind="all_reduce", phase="backward", num_bytes=2 * PAYLOAD, node="ln", dtype="float32")
    g = Collective(kind="all_reduce", phase="forward", num_bytes=PAYLOAD, node="proj", dtype="bfloat16")
    loss = loss_collectives(4096, 2)[1:]                            # two all-reduces of 4096 float32 values
    assert loss[0].dtype == "float32" and loss[0].num_bytes == 4 * 4096
    k = StageTP(sharded_flops=0.9).compute_share(2)
    bf16 = _priced_stage((f, g, *loss), dtype="bfloat16")
    assert bf16.fwd == pytest.approx(COST.fwd * k + _ring(TP, 2, PAYLOAD) + 2 * _ring(TP, 2, 4 * 4096))
    assert bf16.bwd_i == pytest.approx(COST.bwd_i * k + _ring(TP, 2, PAYLOAD))
    f32 = _priced_stage((f, g, *loss))
    assert f32.fwd == bf16.fwd
    assert f32.bwd_i == pytest.approx(COST.bwd_i * k + _ring(TP, 2, 2 * PAYLOAD))


def test_the_dp_all_reduce_moves_each_tp_ranks_part():
    plan = _plan(tp=4)
    part = 4 * (NUM - NUM_SHARDED + NUM_SHARDED // 4)
    assert local_param_bytes(plan.stages[0], 4) == part
    assert local_param_bytes(plan.stages[0], 1) == 4 * NUM        # the same record at tp 1: all of it
    assert plan_costs(plan).allreduce[("dp", 0)] == pytest.approx(_ring(DP, 2, part))
    # by node: tp 4 innermost, so dp 2's replicas of one tp rank are 4 ranks apart: 2 nodes of 4 -> inter
    nodes = _plan(tp=4, nodes=4, links={"pp": DP, "dp": DP, "intra": INTRA, "inter": INTER})
    assert link_sides(nodes)["dp"] == {"intra": 0, "inter": 2}
    assert link_sides(nodes)["tp"] == {"intra": 2, "inter": 0}


def test_a_tp_plan_simulates_faster_compute_with_its_collectives():
    fast = _with_program(_plan(tp=4, links={"pp": DP, "dp": DP, "tp": TP}))
    base = _with_program(_plan(tp=1))
    assert simulate(fast).step_time < simulate(base).step_time


# ----------------------------------------------------------------------------- memory


def test_state_divides_the_sharded_parameters_by_tp_then_by_the_shard():
    base, tp2 = breakdown(_plan(tp=1)), breakdown(_plan(tp=2))
    local = NUM - NUM_SHARDED + NUM_SHARDED // 2
    assert local_params(_plan(tp=2).stages[0], 2) == local
    assert [m.state for m in tp2] == [16 * local] * 2 and [m.state for m in base] == [16 * NUM] * 2
    assert tp2[0].num_params == local
    # FSDP2 over the tp shards: local shapes first, then dim 0 padded to the shard size and divided
    full = _plan(tp=2, shard="full")
    st = full.stages[0]
    assert padded_params(st, 2, 2) == local        # every local dim 0 is even: no padding
    assert breakdown(full)[0].state == 16 * local // 2
    assert padded_params(replace(st, tp=None), 2, 2) == NUM


def test_activations_follow_megatrons_count():
    """A stage of L blocks whose saved bytes are Megatron's ``L s b h (34 + 5 a s / h)`` holds Megatron's
    ``L s b h (10 + 24 / t + 5 a s / (h t))`` per tp rank; with sequence parallelism all of it over t."""
    s, b, h, a, L, t = 2048, 1, 5120, 40, 5, 8
    full = L * megatron_block_activation_bytes(seq=s, batch=b, hidden=h, heads=a)
    assert full == pytest.approx(L * s * b * h * (34 + 5 * a * s / h))
    payload = s * b * h * 2                          # one all-reduce of b s h bf16 values, 2 forward per block
    stp = StageTP(collectives=tuple(Collective(kind="all_reduce", phase="forward", num_bytes=payload,
                                                     node=str(i)) for i in range(2 * L)), sharded_flops=1.0)
    st = Stage(stage=0, rank=0, activation_bytes=round(full), tp=stp)
    want = L * megatron_block_activation_bytes(seq=s, batch=b, hidden=h, heads=a, tp=t)
    assert want == pytest.approx(L * s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    assert tp_activation_bytes(st, t) == pytest.approx(want, rel=1e-6)
    assert tp_activation_bytes(st, t, sequence_parallel=True) == pytest.approx(full / t, rel=1e-6)
    assert tp_activation_bytes(replace(st, tp=None), t) == round(full)
    assert tp_activation_bytes(st, 1) == round(full)
    assert plan_costs(_plan(tp=2)).activation_bytes[0] == tp_activation_bytes(_plan(tp=2).stages[0], 2)


# ----------------------------------------------------------------------------- tune's layout is the compile's


SMALL = dict(layers=4, dim=32, heads=2, vocab=64, seq=8)


def _request(pp=2, dp=1, tp=1, *, nodes=None, model_args=SMALL, batch=4, costs="flops", links=None,
             memory=None, microbatches=2) -> CompileRequest:
    seq = model_args["seq"]
    model = ModelSpec(target="pipec.examples.gpt:build", kwargs=model_args,
                      inputs=(TensorSpec("tokens", "int64", (batch, seq)),),
                      partition=Partition("balanced", "flops"), costs=costs, trace="auto")
    return CompileRequest(schedule="1f1b", mesh=Mesh(pp=pp, dp=dp, tp=tp, devices_per_node=nodes),
                          num_microbatches=microbatches, model=model, links=links or dict(DEFAULT_LINKS),
                          device_memory=memory, training=replace(DEFAULTS, dtype="bfloat16", peak_flops=1e12))


def test_tune_prices_a_tp_candidate_as_its_compile_does():
    """A tp 2 candidate priced on tune's graph (the cost-only cut given the compile's own analysis of its stages,
    tune/tp_layout.py) predicts what compiling the candidate predicts: the same step, events and peaks."""
    treq = TuneRequest(base=_request(nodes=2), num_devices=4, global_batch=4)
    graphs, seen = _Graphs(treq, 4), set()
    for c in candidates(treq):
        if c.tp == 1 or c.shard != "none" or (c.num_stages, c.num_microbatches) in seen:
            continue
        seen.add((c.num_stages, c.num_microbatches))
        req = candidate_request(treq, c)
        tuned = compile_request(req, graph=graphs.graph(c)).plan
        assert tuned.prediction == compile_request(req).plan.prediction, c
        assert all(st.tp is not None for st in tuned.stages)
    assert len(seen) >= 2


# ----------------------------------------------------------------------------- metrics


def test_scaling_efficiency_is_one_devices_step_over_n_steps():
    whole = [Cost(fwd=1.0, bwd=2.0, bwd_i=1.0, bwd_w=1.0, optim=0.5)]
    one = single_device_step(whole, 8)
    assert one == 8 * 3 + 0.5
    assert scaling_efficiency(one / 4, 4, one) == pytest.approx(1.0)
    assert scaling_efficiency(one / 2, 4, one) == pytest.approx(0.5)
    assert scaling_efficiency(1.0, 4, None) is None
    plan = _plan(pp=2, dp=2, spec={"recompute": [1]})
    plan = replace(plan, stages=(plan.stages[0], replace(plan.stages[1], cost=replace(COST, bwd=COST.bwd + COST.fwd))))
    assert plan_single_device_step(plan) == pytest.approx(4 * 2 * 2 * (COST.fwd + COST.bwd) + 2 * COST.optim)


# ----------------------------------------------------------------------------- tune


def test_tune_searches_tp_over_the_node_and_its_bounds_hold():
    """Every candidate of a small space on 4 devices in nodes of 2 (tp 1 and 2): the step bound never exceeds
    the simulated step, the memory bound never the predicted peak."""
    links = {**DEFAULT_LINKS, "intra": Link(latency_s=1e-6, bandwidth_Bps=100e9),
             "inter": Link(latency_s=1e-5, bandwidth_Bps=1e9)}
    treq = TuneRequest(base=_request(nodes=2, links=links), num_devices=4, global_batch=4)
    space = candidates(treq)
    assert {c.tp for c in space} == {1, 2}
    assert {c.tp for c in candidates(replace(treq, base=_request(links=links)))} == {1}   # no nodes: tp 1
    tp_seen = 0
    cut = _Graphs(treq, 4)
    for c in space:
        if c.shard not in ("none", "full"):
            continue
        req = candidate_request(treq, c)
        graph = cut.graph(c)
        if graph is None:
            continue
        plan = compile_request(req, graph=graph).plan
        tp_seen += c.tp > 1 and all(st.tp is not None for st in plan.stages)
        step, mem, state = bounds(c, candidate_frame(req, graph, schedule_order(req)[0]))
        assert step <= plan.prediction.step_time * (1 + 1e-9), c
        assert state <= mem <= max(r.peak_memory_bytes for r in plan.prediction.per_rank), c
    assert tp_seen > 0


def test_tune_with_tp_matches_brute_force():
    """The search's table over tp x pp x dp equals every candidate compiled (with the least recompute of stages
    0..k-1 that fits) and ranked: the first bound's 1 / tp and the rest prune nothing that belongs."""
    from pipec.compiler.passes.memory import MemoryBudgetError
    from pipec.tune.search import _score

    links = {**DEFAULT_LINKS, "intra": Link(latency_s=1e-6, bandwidth_Bps=100e9),
             "inter": Link(latency_s=1e-5, bandwidth_Bps=1e9)}
    treq = TuneRequest(base=_request(nodes=2, links=links), num_devices=4, global_batch=4, num_top=4,
                       keep=frozenset({"partition"}))
    got = tune(treq)
    cut, want = _Graphs(treq, 4), []
    for c in candidates(treq):
        for k in range(c.num_stages + 1):
            cand = replace(c, recompute=frozenset(range(k)))
            graph = cut.graph(cand)
            if graph is None:
                break
            try:
                plan = compile_request(candidate_request(treq, cand), graph=graph).plan
            except MemoryBudgetError:
                continue
            want.append(_score(cand, plan, 1, None, 4))
            break
    want.sort(key=lambda s: s.rank_key())
    assert [(s.candidate, s.step_time) for s in got.top] == [(s.candidate, s.step_time) for s in want[:4]]
    assert any(s.candidate.tp == 2 for s in want)


GPT_13B = dict(layers=40, dim=5120, heads=40, vocab=50304, seq=2048)
CLUSTER = {**DEFAULT_LINKS, "intra": Link(latency_s=5e-6, bandwidth_Bps=600e9),
           "inter": Link(latency_s=1e-5, bandwidth_Bps=25e9)}


def _thirteen_b(**kw) -> TuneRequest:
    """The source note's cluster: 64 GPUs of 80 GB in nodes of 8 (NVLink 600 GB/s inside, InfiniBand 25 GB/s
    across), a 13B GPT priced from FLOPs at 989 TFLOP/s, global batch 128."""
    base = _request(pp=8, dp=8, nodes=8, model_args=GPT_13B, batch=16, links=CLUSTER, memory=80 * 10**9,
                    microbatches=16)
    base = replace(base, schedule="zbv", num_chunks=2, training=replace(base.training, peak_flops=989e12))
    return TuneRequest(base=base, num_devices=64, **kw)


@pytest.fixture(scope="module")
def thirteen_b():
    """The search with the schedule, its chunks and the microbatches kept (zbv, 2, 16: a few seconds); the whole
    space is the slow test below and ``bench/tune.py --part b``."""
    treq = _thirteen_b(num_top=3, keep=frozenset({"schedule", "virtual", "microbatches", "partition"}))
    return treq, tune(treq)


def _check_pick(r, treq):
    best = r.best
    assert best.candidate.tp > 1 and 8 % best.candidate.tp == 0
    assert best.plan.mesh.tp == best.candidate.tp and best.plan.mesh.world_size == 64
    assert all(st.tp is not None for st in best.plan.stages)
    assert link_sides(best.plan)["tp"]["inter"] == 0              # every tp group inside a node (NVLink)
    assert r.best_tp1 is not None and r.best_tp1.candidate.tp == 1
    assert r.best_tp1.step_time > best.step_time
    assert 0 < best.mfu < 1 and 0 < best.scaling_efficiency < 1
    assert all(s.peak_memory <= 80 * 10**9 for s in (*r.top, r.best_tp1))
    graphs = _Graphs(treq, r.global_batch)
    for s in (*r.top, r.best_tp1):                               # the bounds hold on what it kept
        req = candidate_request(treq, s.candidate, global_batch=r.global_batch)
        graph = graphs.graph(s.candidate)
        step, mem, _ = bounds(s.candidate, candidate_frame(req, graph, schedule_order(req)[0]))
        assert step <= s.step_time * (1 + 1e-9) and mem <= s.peak_memory, s.candidate


def test_tune_picks_tp_inside_the_node_for_the_notes_13b(thirteen_b):
    treq, r = thirteen_b
    _check_pick(r, treq)
    assert any("faster than the best plan without it" in line for line in why(r))


@pytest.mark.slow  # the whole space: ~45 s on 2 cores
@pytest.mark.timeout(600)
def test_tune_over_the_whole_space_of_the_notes_13b_weighs_tp_against_tp_1():
    """Priced on the records a compile writes (tune/tp_layout.py) as a run moves them on NCCL (every tp
    collective in bfloat16: the records' float32 payloads, the layer norms' outputs and the input gradients f sums
    into them, are cast), the whole space's best plan is tp 2 (pp 2 x dp 16, shard grads over 2, zbv M 8: ~0.438 s;
    0.450 s when those went in float32), ahead of the best at tp 1 (4 x 16, shard grads, zbv: 0.441 s)."""
    from pipec.tune.space import candidates

    treq = _thirteen_b(num_top=5)
    assert {c.tp for c in candidates(treq)} == {1, 2, 4, 8}  # tp over the divisors of the node
    r = tune(treq)
    b = r.best.candidate
    assert (b.pp, b.dp, b.tp, b.shard, b.shard_size, b.schedule, b.num_microbatches) == (2, 16, 2, "grads", 2, "zbv", 8)
    assert r.best.step_time == pytest.approx(0.438, abs=0.005)
    assert r.best_tp1 is not None and r.best_tp1.step_time == pytest.approx(0.441, abs=0.005)
    assert r.best.step_time < r.best_tp1.step_time and all(s.peak_memory <= 80 * 10**9 for s in r.top)
    graph = _Graphs(treq, r.global_batch).graph(b)
    pairs = [x for st in graph.stages for x in st.tp.collectives if not x.of]   # the blocks' column / row pairs
    forward = {(x.num_bytes, x.dtype) for x in pairs if x.phase == "forward"}
    backward = {(x.num_bytes, x.dtype) for x in pairs if x.phase == "backward"}
    assert backward == {(2 * n, "float32") for n, d in forward} and {d for _, d in forward} == {"bfloat16"}
    tp2 = compile_request(candidate_request(treq, b, global_batch=r.global_batch), graph=graph).plan
    assert tp2.prediction.step_time == pytest.approx(r.best.step_time)
