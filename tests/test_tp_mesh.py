"""Tensor parallelism's mesh axis end to end, the sharding itself apart: the rank arithmetic (tp innermost), the
keys ``tp`` and ``tensor_parallel`` and the ``tp(...)`` link with their located refusals, plan.json with
``mesh.tp`` and a stage's ``tp`` record, the verifier's tp proof, the views, an in-process run on the fake
transport, and runs under torchrun on gloo with every stage replicated on its tp ranks (``pipec run --check``
against the unpartitioned model, a checkpoint written at tp 2 and resumed at tp 1)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import LAUNCHES, PYTHON, compiled, located_refusals, on_threads, run_cli_here, run_job

from pipec.compiler.driver import compile_plan, compile_spec
from pipec.compiler.ir.plan import Mesh, PlanError, Stage
from pipec.compiler.ir.plan_json import load_plan, plan_to_json, read_plan, write_plan
from pipec.compiler.ir.tensor_parallel import Collective, ShardedParam, StageTP
from pipec.compiler.ir.timeline import Timeline
from pipec.compiler.passes.verify import VerifyError, prove_tp, verify
from pipec.dsl import DSLError, parse_spec

V1 = Path(__file__).parent / "data" / "plan_v1"
STEPS = 3


# ----------------------------------------------------------------------------- rank arithmetic


def _old_group(mesh: Mesh, group: str, g: int) -> tuple[int, ...]:
    """The dp groups as they were before tp (global rank = pp x dp + dp rank)."""
    pp, d = divmod(g, mesh.dp)
    n = mesh.num_shards if mesh.hybrid else mesh.dp
    if group == "dp":
        return tuple(range(pp * mesh.dp, (pp + 1) * mesh.dp))
    if group == "dp.shard":
        first = d - d % n
        return tuple(pp * mesh.dp + x for x in range(first, first + n))
    return tuple(pp * mesh.dp + x for x in range(d % n, mesh.dp, n))


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_tp_1_is_todays_arithmetic(pp, dp):
    meshes = [Mesh(pp=pp, dp=dp)] + [Mesh(pp=pp, dp=dp, shard="full", shard_size=s) for s in (1, 2, dp)
                                      if dp >= 2 and dp % s == 0]
    for mesh in meshes:
        assert mesh.world_size == pp * dp
        for g in range(pp * dp):
            p, d = divmod(g, dp)
            assert mesh.coords(g) == (p, d) and mesh.tp_rank(g) == 0 and mesh.global_rank(p, d) == g
            assert mesh.where(g) == f"global rank {g} (pp {p}, dp {d})"
            assert mesh.tp_group(g) == (g,)
            assert mesh.pp_group(g) == tuple(q * dp + d for q in range(pp))
            assert tuple(mesh.replicas(p)) == tuple(range(p * dp, (p + 1) * dp))
            assert tuple(mesh.pp_ranks(p)) == tuple(range(p * dp, (p + 1) * dp))
            for group in ("dp", "dp.shard", "dp.replicate") if mesh.hybrid else ("dp",):
                assert mesh.group_ranks(group, g) == _old_group(mesh, group, g), (mesh, group, g)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("pp, dp, shard_size", [(1, 1, None), (2, 1, None), (2, 2, None), (3, 4, 2), (2, 4, 1)])
def test_tp_groups_are_consecutive_and_the_other_groups_keep_the_tp_rank(pp, dp, shard_size, tp):
    mesh = Mesh(pp=pp, dp=dp, tp=tp, shard="full" if shard_size else "none", shard_size=shard_size)
    world = pp * dp * tp
    assert mesh.world_size == world
    seen: set[int] = set()
    for g in range(world):
        p, d = mesh.coords(g)
        t = mesh.tp_rank(g)
        assert mesh.global_rank(p, d, t) == g and (p * dp + d) * tp + t == g
        assert mesh.where(g) == f"global rank {g} (pp {p}, dp {d}, tp {t})"
        group = mesh.tp_group(g)
        assert group == tuple(range(g - t, g - t + tp))  # tp consecutive ranks, one (pp, dp) coordinate
        assert all(mesh.coords(m) == (p, d) for m in group)
        if t == 0:
            assert not seen & set(group)
            seen |= set(group)
        assert mesh.pp_group(g) == tuple(mesh.global_rank(q, d, t) for q in range(pp))
        assert tuple(mesh.replicas(p, t)) == tuple(mesh.global_rank(p, x, t) for x in range(dp))
        assert g in mesh.pp_ranks(p) and len(mesh.pp_ranks(p)) == dp * tp
        for name in ("dp", "dp.shard", "dp.replicate") if mesh.hybrid else ("dp",):
            members = mesh.group_ranks(name, g)
            assert g in members and all(mesh.tp_rank(m) == t and mesh.coords(m)[0] == p for m in members)
    assert seen == set(range(world))


# ----------------------------------------------------------------------------- keys


def test_tp_key_and_flag_reach_the_request_and_the_plan(tmp_path):
    spec = parse_spec('pp 2  tp 2\ntensor_parallel "blocks.*.attn.qkv": colwise, "blocks.*.attn.proj": rowwise,'
                      ' lm_head: replicated\nlinks tp(latency=2us, bandwidth=100GB/s)\n', filename="a.pipe")
    req = spec.request
    assert (req.mesh.pp, req.mesh.dp, req.mesh.tp, req.mesh.world_size) == (2, 1, 2, 4)
    assert req.tensor_parallel == (("blocks.*.attn.qkv", "colwise"), ("blocks.*.attn.proj", "rowwise"),
                                   ("lm_head", "replicated"))
    plan = compile_spec(spec).plan
    assert plan.mesh.tp == 2 and plan.links["tp"].bandwidth_Bps == 100e9 and plan.links["tp"].latency_s == 2e-6
    assert plan.spec["tensor_parallel"][0] == {"module": "blocks.*.attn.qkv", "style": "colwise"}
    out = run_cli_here("compile", "--ranks", "2", "--tp", "2", "-o", "p.json", cwd=tmp_path)
    assert out.returncode == 0 and "2 pp x 1 dp x 2 tp ranks" in out.stdout, out.stderr
    flagged = read_plan(str(tmp_path / "p.json"))
    assert flagged.mesh.tp == 2 and flagged.spec["tensor_parallel"] == "auto"
    # at tp 1 neither the mesh nor the spec says anything new (plans as before)
    plain = plan_to_json(compile_plan(num_ranks=2, num_microbatches=4, schedule="1f1b").plan)
    assert "tp" not in plain["mesh"] and "tensor_parallel" not in plain["spec"]


def test_the_front_end_gets_tp_and_the_tensor_parallel_plan():
    spec = parse_spec('model "pipec.examples.gpt:build" (layers=2, dim=32, heads=4, vocab=64, seq=16)\n'
                      'input tokens: int64[8, 16]\npp 2  tp 2  costs unit\n'
                      'tensor_parallel "blocks.*.mlp.fc": colwise\n', filename="m.pipe")
    from pipec.compiler.frontend import FrontendError, Host, build_stage_graph

    req = spec.request
    assert req.mesh.tp == 2 and req.tensor_parallel == (("blocks.*.mlp.fc", "colwise"),)
    assert Host.of(req.mesh) == Host(local_ranks=4, threads_per_rank=1)  # four ranks share this machine
    # the front end reads tp off the mesh and applies the plan: fc colwise leaves proj's input sharded
    with pytest.raises(FrontendError, match=r"\(tp 2\) in stage 0 .* blocks\.0\.mlp\.proj is replicated") as err:
        build_stage_graph(req)
    assert err.value.key == "tensor_parallel"


test_refusals_are_located = located_refusals(
    ("pp 2\ntp 0\n", "a.pipe:2:4", "tp must be at least 1, got 0"),
    ("pp 2\ntp 5000\n", "a.pipe:2:4", "tp 5000 is beyond pipec's limit of 4096 tensor-parallel ranks"),
    ("pp 2\ntp 1.5\n", "a.pipe:2:4", "tp needs a whole number"),
    ("pp 2  tp 3\ndevices_per_node 4\n", "a.pipe:1:10", "tp 3 does not divide devices_per_node 4"),
    ("pp 2  tp 6\ndevices_per_node 4\n", "a.pipe:1:10", "tp 6 is larger than devices_per_node 4 and not a multiple"),
    ("pp 2  dp 3  tp 2\ndevices_per_node 8\n", "a.pipe:2:18", "devices_per_node 8 must divide the world size "
                                                               "pp x dp x tp = 2 x 3 x 2 = 12"),
    ("pp 2  tp 2\ndevices_per_node 3\n", "a.pipe:1:10", "tp 2 does not divide devices_per_node 3"),
    ('tp 2\ntensor_parallel "blocks.*.qkv": colwse\n', "a.pipe:2:33", "unknown tensor_parallel style 'colwse'"),
    ('tp 2\ntensor_parallel "blocks..qkv": colwise\n', "a.pipe:2:17", 'module pattern "blocks..qkv" has an empty'),
    ('tp 2\ntensor_parallel "blocks.%.qkv": colwise\n', "a.pipe:2:17", "module pattern \"blocks.%.qkv\": segment"),
    ('tp 2\ntensor_parallel "": colwise\n', "a.pipe:2:17", "a tensor_parallel module pattern is empty"),
    ('tp 2\ntensor_parallel "a.*": colwise, "a.*": rowwise\n', "a.pipe:2:33", 'module pattern "a.*" is given twice'),
    ('tp 2\ntensor_parallel colwise\n', "a.pipe:2:17", "tensor_parallel needs auto, or"),
    ('tp 2\ntensor_parallel "a.*": 3\n', "a.pipe:2:24", "unknown tensor_parallel style 3"),
    ("tp 2\nlinks tp(latency=2us, speed=1GB/s)\n", "a.pipe:2:23", "unknown tp link setting 'speed'"),
    ('input "tokens": int64[8, 16]\n', "a.pipe:1:7", "a tensor of input is named bare, not quoted"),
)


def test_a_tp_group_across_nodes_warns_naming_the_cost():
    compiled_ = compile_spec(parse_spec("pp 2  tp 4\ndevices_per_node 2\n", filename="a.pipe"))
    (warning,) = [str(d) for d in compiled_.diagnostics if "tp 4" in str(d)]
    assert warning.startswith("a.pipe:1:10: warning: tp 4 is larger than devices_per_node 2: each tp group spans "
                              "2 nodes") and "crosses the inter-node link" in warning


def test_tensor_parallel_without_tp_warns():
    spec = parse_spec('tensor_parallel "blocks.*": colwise\n', filename="a.pipe")
    assert any("tensor_parallel is used only with tp > 1" in str(w) for w in spec.warnings)


def test_a_refused_flag_exits_2_without_a_traceback(tmp_path):
    out = run_cli_here("compile", "--tp", "3", "--devices-per-node", "4", "-o", "p.json", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "error: tp 3 does not divide devices_per_node 4" in out.stderr
    (tmp_path / "a.pipe").write_text('tp 2\ntensor_parallel "x.*": sideways\n')
    out = run_cli_here("check", "a.pipe", cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.startswith("a.pipe:2:24: error: unknown tensor_parallel style")


def test_the_tensor_parallel_key_formats_back():
    from pipec.dsl import format_file

    text = 'tp 2\ntensor_parallel "blocks.*.attn.qkv": colwise, lm_head: replicated\n'
    assert parse_spec(format_file(text), filename="a.pipe").request.tensor_parallel == \
        parse_spec(text, filename="a.pipe").request.tensor_parallel


# ----------------------------------------------------------------------------- plan.json


def _with_stage_tp(plan):
    record = StageTP(modules=(("blocks.0.attn.qkv", "colwise"), ("blocks.0.attn.proj", "rowwise")),
                     params=(ShardedParam(name="blocks.0.attn.qkv.weight", dim=0, segments=3),
                             ShardedParam(name="blocks.0.attn.proj.weight", dim=1)),
                     collectives=(Collective(kind="all_reduce", phase="forward", num_bytes=4096, node="proj"),),
                     sharded_flops=0.75)
    return replace(plan, stages=(replace(plan.stages[0], tp=record), *plan.stages[1:])), record


def test_plan_json_round_trip_with_tp_and_a_stage_record(tmp_path):
    plan = compile_plan(num_ranks=2, num_microbatches=4, schedule="1f1b", dp=2, tp=2).plan
    plan, record = _with_stage_tp(plan)
    path = tmp_path / "p.json"
    write_plan(plan, str(path))
    raw = json.loads(path.read_text())
    assert raw["mesh"] == {"pp": 2, "dp": 2, "tp": 2} and raw["stages"][0]["tp"] == record.to_json()
    assert "tp" not in raw["stages"][0]["tp"] and "tp" not in raw["stages"][1]   # the degree is mesh.tp's alone
    assert StageTP.from_json({**record.to_json(), "tp": 2}) == record             # a record that repeated it
    back = read_plan(str(path))
    assert back.mesh == plan.mesh and back.stages[0].tp == record and back.stages[1].tp is None
    assert plan_to_json(back) == plan_to_json(plan)
    verify(back)


@pytest.mark.parametrize("name", sorted(p.name for p in V1.glob("*.json")))
def test_plans_without_tp_read_as_tp_1(name):
    plan = read_plan(str(V1 / name))
    assert plan.mesh.tp == 1 and all(st.tp is None for st in plan.stages)


@pytest.mark.parametrize("edit, message", [
    (lambda o: o["mesh"].update(tp=0), "mesh.tp: expected an integer >= 1"),
    (lambda o: o["mesh"].update(tp=5000), "mesh.tp: tp must be in 1..4096"),
    (lambda o: o["mesh"].update(tp=3, devices_per_node=4), "mesh.tp: tp 3 does not divide devices_per_node 4"),
    (lambda o: o["spec"].update(tp=2), "keeps tp in mesh.tp, not in spec"),
    (lambda o: o["stages"][0].update(tp={"modules": [{"module": "blocks.0.attn.qkv"}]}),
     "stages[0].tp: expected a stage's tensor-parallel record"),
])
def test_a_malformed_tp_is_refused(edit, message):
    obj = plan_to_json(compile_plan(num_ranks=2, num_microbatches=4, schedule="1f1b", tp=2).plan)
    edit(obj)
    with pytest.raises(PlanError, match=re.escape(message)):
        load_plan(obj)


# ----------------------------------------------------------------------------- the verifier


class _Crossed(Mesh):
    """A corrupt mesh: tp groups that pair ranks of two pp ranks."""

    def tp_group(self, global_rank: int) -> tuple[int, ...]:
        return tuple(sorted({global_rank, (global_rank + self.dp * self.tp) % self.world_size}))


class _Mixed(Mesh):
    """A corrupt mesh: pp peers of another tp rank."""

    def pp_group(self, global_rank: int) -> tuple[int, ...]:
        _, d = self.coords(global_rank)
        return tuple(self.global_rank(p, d, p % self.tp) for p in range(self.pp))


def test_the_verifier_proves_tp_groups_and_refuses_corrupt_ones():
    for dp, tp, shard in ((1, 2, "none"), (2, 4, "none"), (4, 2, "full")):
        plan = compile_plan(num_ranks=2, num_microbatches=4, schedule="1f1b", dp=dp, tp=tp, shard=shard).plan
        prove_tp(plan)
    plan = compile_plan(num_ranks=2, num_microbatches=4, schedule="1f1b", tp=2).plan
    with pytest.raises(VerifyError, match=r"tp group \[0, 2\] of global rank 0 \(pp 0, dp 0, tp 0\) holds global "
                                          r"rank 2 \(pp 1, dp 0, tp 0\)"):
        prove_tp(replace(plan, mesh=_Crossed(pp=2, tp=2)))
    with pytest.raises(VerifyError, match=r"the pp group of global rank 0 .* holds global rank 3 .*, of another tp"):
        prove_tp(replace(plan, mesh=_Mixed(pp=2, tp=2)))


class _LastRankAlone(Mesh):
    """A corrupt mesh: the last global rank's tp group holds only itself."""

    def tp_group(self, global_rank: int) -> tuple[int, ...]:
        return (global_rank,) if global_rank == self.world_size - 1 else super().tp_group(global_rank)


def test_a_big_mesh_is_proven_on_its_axes_ends():
    # compile_plan proved it; the proof of a 512,000-rank mesh reads the ends of its axes, so a fault at the
    # very last global rank is still found
    plan = compile_plan(num_ranks=64, num_microbatches=64, schedule="1f1b", dp=1000, tp=8).plan
    with pytest.raises(VerifyError, match=r"holds global rank 511999 \(pp 63, dp 999, tp 7\)"):
        prove_tp(replace(plan, mesh=_LastRankAlone(pp=64, dp=1000, tp=8)))


# ----------------------------------------------------------------------------- in process: the fake transport


def tiny_gpt(schedule: str, *, pp: int = 2, dp: int = 1, tp: int = 2, **extra):
    """The example GPT, small (2 layers, dim 32, 4 heads, vocab 64, seq 16), unit costs."""
    return compiled({
        "model": "pipec.examples.gpt:build", "model_args": {"layers": 2, "dim": 32, "heads": 4, "vocab": 64, "seq": 16},
        "input": "tokens: int64[8, 16]", "schedule": schedule, "pp": pp, "dp": dp, "tp": tp, "microbatches": 4,
        "costs": "unit", "partition": "balanced(by=params)", **extra,
    })


def fake_tp_world(plan):
    """Every rank of ``plan`` on the fake transport: the world, the data and loss, the ranks' (pp, dp, tp) keys,
    their transports, their stages (each its tp part, f and g over the fake's tp group) and the loss each rank's
    executor runs (vocab-parallel where the last stage is loss-parallel)."""
    from pipec.compiler.config import TrainingConfig
    from pipec.runtime.stages import build_stages
    from pipec.runtime.training import make_data, make_loss, stage_loss
    from pipec.runtime.transport import FakeWorld, TransportTP

    mesh = plan.mesh
    world = FakeWorld(mesh.world_size, timeout=60)
    config = TrainingConfig.from_spec(plan.spec)
    keys = [mesh.coords(g) + (mesh.tp_rank(g),) for g in range(mesh.world_size)]
    transports = {k: world.transport(mesh.global_rank(*k)) for k in keys}
    groups = {k: TransportTP(transports[k], mesh.tp_group(mesh.global_rank(*k)), k[2]) for k in keys}
    modules = {k: build_stages(plan, [s for s, r in enumerate(plan.placement) if r == k[0]], seed=0, tp_rank=k[2],
                               tp_group=groups[k]) for k in keys}
    losses = {k: stage_loss(plan, config.loss, tp_group=groups[k], tp_rank=k[2]) for k in keys}
    return world, make_data(config, plan), make_loss(config.loss), keys, transports, modules, losses


def test_sharded_stages_on_the_fake_transport_match_the_reference():
    """pp 2 x dp 2 x tp 2 on threads: each rank talks to its tp peer on the other pp rank, f and g go over the
    tp group, and every gradient (the tp ranks' parts put together) equals the unpartitioned model's."""
    from pipec.runtime.executor import Executor
    from pipec.runtime.stages import build_reference
    from pipec.runtime.training import split_microbatches
    from pipec.tp import unshard

    plan = tiny_gpt("1f1b", dp=2)
    mesh = plan.mesh
    world, data, loss_fn, keys, transports, modules, losses = fake_tp_world(plan)
    assert all(st.tp is not None and st.tp.params for st in plan.stages)  # the blocks' pairs are sharded

    def rank(p: int, d: int, t: int):
        ex = Executor(plan, pp_rank=p, dp_rank=d, tp_rank=t, transport=transports[(p, d, t)],
                      modules=modules[(p, d, t)], loss_fn=losses[(p, d, t)])
        assert ex.global_rank == mesh.global_rank(p, d, t)
        x, y = data(0, d, mesh.dp)
        return ex.run_step(split_microbatches(x, plan.num_microbatches, "x", ["tokens"]),
                           split_microbatches(y, plan.num_microbatches, "y"))

    results = on_threads(rank, keys)
    # every message went between tp peers: same dp and tp rank on both ends
    for src, dst in world.channels:
        assert mesh.coords(src)[1] == mesh.coords(dst)[1] and mesh.tp_rank(src) == mesh.tp_rank(dst), (src, dst)
    ref = build_reference(plan, seed=0)
    batches = [data(0, d, mesh.dp) for d in range(mesh.dp)]
    out = ref(torch.cat([b[0]["tokens"] for b in batches]))
    loss = loss_fn(out[0] if isinstance(out, tuple) else out, torch.cat([b[1] for b in batches]))
    loss.backward()
    ref_grads = {n: p.grad for n, p in ref.canonical_params().items()}
    losses = [r.loss for r in results.values() if r.loss is not None]
    assert len(losses) == mesh.dp * mesh.tp  # each (dp, tp) replica's last stage
    assert sum(losses) / len(losses) == pytest.approx(loss.item(), rel=1e-5)
    for (p, d, t), mods in modules.items():
        for s, mod in mods.items():
            for name, param in mod.canonical_params().items():
                split = plan.stages[s].tp.sharded(name)
                grad = param.grad if split is None else \
                    unshard([modules[(p, d, u)][s].canonical_params()[name].grad for u in range(mesh.tp)], split)
                assert torch.allclose(grad, ref_grads[name], rtol=1e-4, atol=1e-6), name


# ----------------------------------------------------------------------------- the views


def test_views_draw_one_row_per_replica_and_say_tp_ranks_per_row():
    from pipec.views.common import RenderError, lanes, run_mesh
    from pipec.views.summary import render_summary

    plan = compile_plan(num_ranks=2, num_microbatches=4, schedule="1f1b", tp=2).plan
    pred = plan.prediction
    # a measured timeline of the 4 global ranks: each tp rank's row is its pp rank's prediction
    per_rank = [replace(pred.per_rank[r // 2], rank=r) for r in range(4)]
    events = tuple(e._replace(rank=e.rank * 2 + t) for e in pred.events for t in range(2))
    measured = replace(pred, per_rank=tuple(per_rank), events=events)
    assert run_mesh(pred, measured, plan.mesh) == plan.mesh
    with pytest.raises(RenderError, match=r"expected pp x dp x tp = 2 x 2 x 2 = 8"):
        run_mesh(pred, measured, replace(plan.mesh, dp=2))
    rows, _ = lanes(pred, measured=measured, mesh=plan.mesh)
    assert [(lane.source, lane.rank) for lane in rows] == [("predicted", 0), ("measured", 0), ("predicted", 1),
                                                           ("measured", 2)]
    assert rows[0].title == "pp 0 predicted (tp 2 ranks per row)"
    assert rows[3].title == "pp 1 dp 0 measured (global rank 2, tp rank 0 of 2)"
    assert "tp 2 ranks per row" in str(render_summary(pred, measured=measured, mesh=plan.mesh).caption)


def test_stragglers_name_their_tp_rank():
    from pipec.compiler.ir.timeline import RankTime
    from pipec.runtime.accounting import stragglers

    mesh = Mesh(pp=1, dp=2, tp=2)
    per_rank = tuple(RankTime(rank=r, compute=5.0 if r == 3 else 1.0, comm_wait=0.0, idle=0.0, bubble_fraction=0.0)
                     for r in range(4))
    (slow,) = stragglers(Timeline(step_time=5.0, bubble_fraction=0.0, per_rank=per_rank), mesh)
    assert (slow["rank"], slow["pp"], slow["dp"], slow["tp"]) == (3, 0, 1, 1)


# ----------------------------------------------------------------------------- under torchrun


def _tp_runs(folder: Path) -> dict[str, dict]:
    """pp 2 x tp 2 (4 ranks) of the small GPT: 1f1b (writing a checkpoint every step) and zb_h1, with --check."""
    from test_checkpoint import with_checkpoints

    emulated = folder / "emulated.json"  # a schedule-only plan: the emulation's probe on every tp rank
    write_plan(compile_plan(num_ranks=2, num_microbatches=4, schedule="1f1b", tp=2).plan, str(emulated))
    jobs = {"emulated": run_job(emulated, "--steps", "2", "--emulate", "--unit-time", "0.002")}
    for schedule in ("1f1b", "zb_h1"):
        path = folder / f"{schedule}.json"
        write_plan(tiny_gpt(schedule), str(path))
        if schedule == "1f1b":
            path = Path(with_checkpoints(path, folder / "1f1b_ckpt.json", folder / "ckpt", every=1))
        jobs[schedule] = run_job(path, "--steps", str(STEPS), "--check", reference=True)
    return jobs


def _resumed_at_tp_1(folder: Path) -> dict[str, dict]:
    """The tp 2 run's checkpoint of step 2, resumed under pp 2 x tp 1 (2 ranks) to step 3."""
    path = folder / "tp1.json"
    write_plan(tiny_gpt("1f1b", tp=1), str(path))
    ckpt = LAUNCHES.folder("tp_runs") / "ckpt" / "step_00000002"
    return {"tp1": run_job(path, "--steps", str(STEPS), "--resume", str(ckpt))}


def _resumed_at_tp_4(folder: Path) -> dict[str, dict]:
    """The tp 2 run's checkpoint of step 2, resumed under pp 1 x tp 4 (4 ranks) to step 3."""
    path = folder / "tp4.json"
    write_plan(tiny_gpt("1f1b", pp=1, tp=4), str(path))
    ckpt = LAUNCHES.folder("tp_runs") / "ckpt" / "step_00000002"
    return {"tp4": run_job(path, "--steps", str(STEPS), "--resume", str(ckpt))}


def _tp_8_ranks(folder: Path) -> dict[str, dict]:
    """pp 2 x dp 2 x tp 2 (8 ranks) under shard full, with --check."""
    path = folder / "full.json"
    write_plan(tiny_gpt("1f1b", dp=2, shard="full"), str(path))
    return {"full": run_job(path, "--steps", str(STEPS), "--check", reference=True)}


def _pipec_run(folder: Path) -> list[str]:
    path = folder / "zb.json"
    write_plan(tiny_gpt("zb_h1"), str(path))
    return [PYTHON, "-m", "pipec", "run", str(path), "--nproc", "4", "--check", "--steps", "2", "--timeout", "120",
            "--report", str(folder / "report.json")]


tp_runs = LAUNCHES.runs("tp_runs", world=4, make=_tp_runs)
tp_resumed = LAUNCHES.runs("tp_resumed", world=2, round=2, after=("tp_runs",), make=_resumed_at_tp_1)
tp_resumed_4 = LAUNCHES.runs("tp_resumed_4", world=4, round=2, after=("tp_runs",), make=_resumed_at_tp_4)
tp_pipec_run = LAUNCHES.command("tp_pipec_run", make=_pipec_run, timeout=240)
tp_8_ranks = LAUNCHES.runs("tp_8_ranks", world=8, make=_tp_8_ranks)


@pytest.mark.timeout(600)
def test_pp2_tp2_runs_check_against_the_unpartitioned_model(tp_runs):
    emulated = tp_runs["emulated"]
    assert emulated["rc"] == 0, emulated["stderr"][-4000:]
    assert emulated["report"]["mesh"] == {"pp": 2, "dp": 1, "tp": 2} and "emulation" in emulated["report"]
    for name, rec in ((n, r) for n, r in tp_runs.items() if n != "emulated"):
        assert rec["rc"] == 0, rec["stderr"][-4000:]
        check = rec["check"]
        assert check["passed"] and check["max_grad_diff"] < 1e-4 and check["loss_diff"] < 1e-5, (name, check)
        assert rec["losses"] == pytest.approx(rec["reference_losses"], rel=1e-4, abs=1e-5), name
        report = rec["report"]
        assert report["mesh"] == {"pp": 2, "dp": 1, "tp": 2}
        assert sorted(r["rank"] for r in report["measured"]["per_rank"]) == [0, 1, 2, 3]
        assert rec["ties"] == 1 and rec["ties_equal"] is True, name  # the GPT's embedding and head, equal
        print(f"tp 2 {name}: loss diff {check['loss_diff']:.2e}, max grad diff {check['max_grad_diff']:.2e}")


@pytest.mark.slow  # two more launches after the first (~40 s on 2 cores)
@pytest.mark.timeout(600)
def test_a_tp_2_checkpoint_is_written_whole_by_tp_rank_0_and_resumes_at_tp_1_and_tp_4(tp_runs, tp_resumed,
                                                                                       tp_resumed_4):
    ckpt = LAUNCHES.folder("tp_runs") / "ckpt" / "step_00000002"
    manifest = json.loads((ckpt / "pipec.json").read_text())
    assert manifest["mesh"] == {"pp": 2, "dp": 1, "tp": 2}
    sizes = {p.name: p.stat().st_size for p in ckpt.glob("*.distcp")}
    # ranks 1 and 3 (tp rank 1) send their parts to tp rank 0, which writes each tensor whole: they write RNG alone
    assert sizes["__1_0.distcp"] < 32 * 1024 and sizes["__3_0.distcp"] < 32 * 1024, sizes
    assert sizes["__0_0.distcp"] > 4 * sizes["__1_0.distcp"], sizes
    first = {s["step"]: s["loss"] for s in tp_runs["1f1b"]["report"]["steps"]}
    for rec in (tp_resumed["tp1"], tp_resumed_4["tp4"]):
        assert rec["rc"] == 0, rec["stderr"][-4000:]
        assert "resharded" in rec["stderr"] and "x tp 2" in rec["stderr"]
        again = {s["step"]: s["loss"] for s in rec["report"]["steps"]}
        assert list(again) == [3] and again[3] == pytest.approx(first[3], rel=1e-5)


@pytest.mark.slow  # pipec run's own torchrun launch (~20 s on 2 cores)
@pytest.mark.timeout(600)
def test_pipec_run_check_at_tp_2_and_pipec_show_of_its_report(tp_pipec_run, tmp_path):
    assert tp_pipec_run.returncode == 0, tp_pipec_run.stderr[-4000:]
    said = " ".join(tp_pipec_run.stderr.split())  # rich wraps the header line
    assert "--check passed" in said and "2 pp x 1 dp x 2 tp" in said
    folder = LAUNCHES.folder("tp_pipec_run")
    report = json.loads((folder / "report.json").read_text())
    assert report["check"]["passed"] and report["mesh"]["tp"] == 2
    print(f"pipec run --check, zb_h1 tp 2: loss diff {report['check']['loss_diff']:.2e}, "
          f"max grad diff {report['check']['max_grad_diff']:.2e}")
    out = run_cli_here("show", str(folder / "zb.json"), "--measured", str(folder / "report.json"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "tp 2 ranks per row" in out.stdout and "tp 2" in out.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pp2_dp2_tp2_shard_full_on_8_ranks(tp_8_ranks):
    rec = tp_8_ranks["full"]
    assert rec["rc"] == 0, rec["stderr"][-4000:]
    assert rec["check"]["passed"] and rec["check"]["max_grad_diff"] < 1e-4, rec["check"]
    assert rec["losses"] == pytest.approx(rec["reference_losses"], rel=1e-4, abs=1e-5)
    assert rec["report"]["mesh"] == {"pp": 2, "dp": 2, "tp": 2, "shard": "full", "shard_size": 2}
    print(f"pp 2 x dp 2 x tp 2 shard full: loss diff {rec['check']['loss_diff']:.2e}, max grad diff "
          f"{rec['check']['max_grad_diff']:.2e}")


def test_pipec_show_says_what_tensor_parallelism_chose_per_stage():
    from pipec.views.stage_table import tp_lines

    plan = tiny_gpt("1f1b")
    text = " ".join(" ".join(tp_lines(plan)).split())
    assert text.startswith("stage 0 (tp 2): colwise blocks.*.attn.qkv, blocks.*.mlp.fc; rowwise blocks.*.attn.proj, "
                           "blocks.*.mlp.proj; vocab wte; replicated wpe; tp collectives per microbatch: 3 in "
                           "forward"), text
    assert "stage 1 (tp 2): colwise blocks.*.attn.qkv, blocks.*.mlp.fc, lm_head;" in text
    assert "loss parallel (cross_entropy on the logits' vocabulary parts)" in text
    assert all(len(line) <= 80 for line in tp_lines(plan))
    assert tp_lines(tiny_gpt("1f1b", tp=1)) == []
