"""Node-aware links: key `devices_per_node` and the `intra` / `inter` link axes, their located errors,
each hop and collective priced by where its ranks sit (hand-computed seconds), plan.json, `pipec show`'s
line, and `pipec tune --devices-per-node`."""

from __future__ import annotations

import pytest

from conftest import located_refusals, small_gpt_pipe

from pipec.cli import main
from pipec.compiler.driver import compile_spec
from pipec.compiler.ir.program import Program
from pipec.compiler.ir.plan import Edge, Link, Mesh, Plan, TensorSpec, Stage, Tie
from pipec.compiler.ir.plan_json import load_plan, plan_to_json, read_plan
from pipec.compiler.sim.simulate import link_sides, plan_costs
from pipec.tune.search import tune
from pipec.tune.space import TuneRequest
from pipec.tune.report import pipe_lines
from pipec.dsl import DSLError, load_spec, parse_spec
from pipec.errors import PipecError

INTRA = Link(latency_s=1e-6, bandwidth_Bps=100e9)
INTER = Link(latency_s=1e-5, bandwidth_Bps=1e9)
AXIS = Link(latency_s=1e-5, bandwidth_Bps=25e9)  # pp and dp: the defaults
LINKS_TEXT = "links intra(latency=1us, bandwidth=100GB/s), inter(latency=10us, bandwidth=1GB/s)\n"
EDGE_BYTES = 4000      # one float32[1000] per edge
PARAM_BYTES = 10**6    # per stage


def _plan(pp: int, dp: int, nodes: int | None, links=("intra", "inter"), ties=()) -> Plan:
    """A plan in seconds (a model's, no program needed to price it): a chain of pp stages."""
    stages = tuple(Stage(stage=s, rank=s, param_bytes=PARAM_BYTES, num_params=PARAM_BYTES // 4) for s in range(pp))
    edges = tuple(Edge(src_stage=s, dst_stage=s + 1, tensors=(TensorSpec("x", "float32", (1000,)),))
                  for s in range(pp - 1))
    sides = {"intra": INTRA, "inter": INTER}
    return Plan(mesh=Mesh(pp=pp, dp=dp, devices_per_node=nodes), num_stages=pp, num_microbatches=1,
                placement=tuple(range(pp)), program=Program(()), stages=stages, edges=edges, ties=ties,
                links={"pp": AXIS, "dp": AXIS, **{k: sides[k] for k in links}}, model={"target": "m:f"})


def _msg(link: Link, num_bytes: float = EDGE_BYTES) -> float:
    return link.latency_s + num_bytes / link.bandwidth_Bps


# ----------------------------------------------------------------------------- the language


def test_keys_reach_the_request_mesh_and_plan():
    spec = parse_spec("pp 2\ndp 4\ndevices_per_node 4\n" + LINKS_TEXT, filename="a.pipe")
    assert spec["devices_per_node"] == 4 and spec.request.mesh.devices_per_node == 4
    assert spec["links"].intra == INTRA and spec["links"].inter == INTER
    plan = compile_spec(spec).plan
    assert plan.mesh == Mesh(pp=2, dp=4, devices_per_node=4) and plan.mesh.num_nodes == 2
    assert [plan.mesh.node_of(g) for g in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert plan.links["intra"] == INTRA and plan.links["inter"] == INTER
    assert set(plan.links) == {"pp", "dp", "intra", "inter"}
    assert "devices_per_node" not in plan.spec and "links" not in plan.spec  # each value once: in mesh, links
    # text round trip of the links value; left out, intra and inter are absent
    again = parse_spec("", overrides={"links": spec["links"].text()})
    assert again["links"] == spec["links"]
    plain = parse_spec("pp 2\n", filename="b.pipe")
    assert plain["devices_per_node"] is None and set(plain["links"].as_dict()) == {"pp", "dp"}
    assert Mesh(pp=2, dp=2).node_of(3) == 0 and Mesh(pp=2, dp=2).num_nodes == 1


test_errors_are_located = located_refusals(
    ("pp 2\ndp 3\ndevices_per_node 4\n", "a.pipe:3:18",
     "devices_per_node 4 must divide the world size pp x dp = 2 x 3 = 6 or be at least it"),
    ("pp 2\ndevices_per_node 0\n", "a.pipe:2:18", "devices_per_node"),
    ("pp 2\nlinks intre(latency=1us)\n", "a.pipe:2:7", "unknown link axis 'intre'"),
    ("pp 2\nlinks inter(latency=1us), inter(latency=2us)\n", "a.pipe:2:27", "links for inter are given twice"),
    ("pp 2\nlinks intra(speed=1GB/s)\n", "a.pipe:2:13", "unknown intra link setting 'speed'"),
)


def test_the_node_size_error_says_how_to_fix_it():
    with pytest.raises(DSLError) as err:
        compile_spec(parse_spec("pp 2\ndp 3\ndevices_per_node 4\n", filename="a.pipe"))
    assert "use a divisor of 6 (1, 2, 3, 6), or 6 or more" in str(err.value)
    for nodes in (1, 2, 3, 6, 7):  # a divisor, or one node holding all
        assert compile_spec(parse_spec(f"pp 2\ndp 3\ndevices_per_node {nodes}\n")).plan.mesh.devices_per_node == nodes


# ----------------------------------------------------------------------------- pricing


def test_a_pp_edge_inside_a_node_costs_intra_and_across_costs_inter():
    plan = _plan(pp=4, dp=1, nodes=2)                # nodes {0, 1}, {2, 3}
    t = plan_costs(plan).transfer
    assert t[(0, 1)] == pytest.approx(1.04e-6) == pytest.approx(_msg(INTRA))   # 1 us + 4000 B / 100 GB/s
    assert t[(1, 2)] == pytest.approx(1.4e-5) == pytest.approx(_msg(INTER))    # 10 us + 4000 B / 1 GB/s
    assert t[(2, 3)] == pytest.approx(_msg(INTRA))
    assert link_sides(plan) == {"pp": {"intra": 2, "inter": 1}}


def test_an_edge_crosses_when_any_replica_crosses():
    # pp 3 x dp 2 on nodes of 3: global ranks (p, d) = 2p + d; node 0 holds 0, 1, 2, node 1 holds 3, 4, 5.
    plan = _plan(pp=3, dp=2, nodes=3)
    c = plan_costs(plan)
    assert c.transfer[(0, 1)] == pytest.approx(_msg(INTER))   # replica 0: ranks 0 -> 2 stay, replica 1: 1 -> 3 cross
    assert c.transfer[(1, 2)] == pytest.approx(_msg(INTER))
    # pp rank 0's dp group {0, 1} is inside node 0: a ring on intra, 1 us + 2 (1/2) 1 MB / 100 GB/s
    assert c.allreduce[("dp", 0)] == pytest.approx(1.1e-5)
    # pp rank 1's {2, 3} spans both nodes, one member on each: only the inter part, 10 us + 2 (1/2) 1 MB / 1 GB/s
    assert c.allreduce[("dp", 1)] == pytest.approx(1.01e-3)
    assert c.allreduce[("dp", 2)] == pytest.approx(1.1e-5)
    assert link_sides(plan) == {"pp": {"intra": 0, "inter": 2}, "dp": {"intra": 2, "inter": 1}}


def test_a_dp_group_spanning_nodes_is_a_hierarchical_ring_bottlenecked_by_inter():
    plan = _plan(pp=1, dp=4, nodes=2)                 # 2 members on each of 2 nodes
    intra = 1e-6 + 2 * (1 / 2) * PARAM_BYTES / 100e9  # the ring over a node's 2
    inter = 1e-5 + 2 * (1 / 2) * (PARAM_BYTES / 2) / 1e9  # each node's half over the 2 nodes
    assert plan_costs(plan).allreduce[("dp", 0)] == pytest.approx(intra + inter) == pytest.approx(5.21e-4)
    one_node = _plan(pp=1, dp=4, nodes=4)
    assert plan_costs(one_node).allreduce[("dp", 0)] == pytest.approx(1e-6 + 2 * 3 / 4 * PARAM_BYTES / 100e9)


def test_without_nodes_or_node_links_the_axes_price_as_before():
    flat = 1e-5 + 2 * 3 / 4 * PARAM_BYTES / 25e9      # the dp link's ring over 4
    for plan in (_plan(pp=1, dp=4, nodes=None), _plan(pp=1, dp=4, nodes=2, links=())):
        assert plan_costs(plan).allreduce[("dp", 0)] == pytest.approx(flat)
        assert link_sides(plan) == {}
    assert plan_costs(_plan(pp=2, dp=1, nodes=None)).transfer[(0, 1)] == pytest.approx(_msg(AXIS))


def test_a_side_left_out_falls_back_to_the_axis_link():
    plan = _plan(pp=2, dp=2, nodes=2, links=("inter",))  # nodes {(0,0), (0,1)}, {(1,0), (1,1)}
    c = plan_costs(plan)
    assert c.transfer[(0, 1)] == pytest.approx(_msg(INTER))                       # crosses: inter
    assert c.allreduce[("dp", 0)] == pytest.approx(1e-5 + 2 * (1 / 2) * PARAM_BYTES / 25e9)  # inside: dp's link
    plan = _plan(pp=2, dp=2, nodes=4, links=("intra",))
    assert plan_costs(plan).transfer[(0, 1)] == pytest.approx(_msg(INTRA))


def test_tie_and_shard_groups_are_priced_by_node():
    tie = Tie(name="wte", stages=(0, 3), params=("a", "b"), num_bytes=PARAM_BYTES)
    plan = _plan(pp=4, dp=1, nodes=2, ties=(tie,))    # stages 0 and 3: one member on each node
    assert plan_costs(plan).allreduce[("tie.wte", 0)] == pytest.approx(1e-5 + 2 * (1 / 2) * PARAM_BYTES / 1e9)
    assert link_sides(plan)["tie"] == {"intra": 0, "inter": 1}
    from dataclasses import replace

    sharded = _plan(pp=1, dp=4, nodes=2)
    sharded = replace(sharded, mesh=replace(sharded.mesh, shard="full"))
    b = (PARAM_BYTES // 4) * 4                        # float32 parameters, the count divisible by 4
    want = (1e-6 + (1 / 2) * b / 100e9) + (1e-5 + (1 / 2) * (b / 2) / 1e9)  # all-gather: factor 1
    assert plan_costs(sharded).shard[("UNSHARD", 0)] == pytest.approx(want)


def test_the_compiled_prediction_pays_the_inter_link():
    base = "pp 2\ndp 2\nschedule gpipe\nmicrobatches 2\nmodel \"pipec.examples.gpt:build\" (layers=2, dim=32, " \
           "heads=2, vocab=64, seq=8)\ninput tokens: int64[4, 8]\ncosts flops\npeak_flops 1TFLOP/s\n" + LINKS_TEXT
    near = compile_spec(parse_spec(base + "devices_per_node 4\n")).plan    # one node: every hop intra
    far = compile_spec(parse_spec(base + "devices_per_node 2\n")).plan     # the pp hop crosses
    assert link_sides(near)["pp"] == {"intra": 1, "inter": 0} and link_sides(far)["pp"] == {"intra": 0, "inter": 1}
    assert far.prediction.step_time > near.prediction.step_time


# ----------------------------------------------------------------------------- plan.json and pipec show


def test_plan_json_round_trip_and_old_plans_load(tmp_path):
    plan = compile_spec(parse_spec("pp 2\ndp 2\ndevices_per_node 2\n" + LINKS_TEXT)).plan
    obj = plan_to_json(plan)
    assert obj["mesh"] == {"pp": 2, "dp": 2, "devices_per_node": 2}
    assert obj["links"]["inter"] == {"latency_s": 1e-5, "bandwidth_Bps": 1e9}
    path = tmp_path / "plan.json"
    from pipec.compiler.ir.plan_json import write_plan

    write_plan(plan, str(path))
    back = read_plan(str(path))
    assert back.mesh == plan.mesh and back.links == plan.links and back.program == plan.program
    old = plan_to_json(compile_spec(parse_spec("pp 2\ndp 2\n")).plan)
    assert "devices_per_node" not in old["mesh"] and set(old["links"]) == {"pp", "dp"}
    assert load_plan(old).mesh.devices_per_node is None
    obj["mesh"]["devices_per_node"] = 3
    with pytest.raises(PipecError, match=r"mesh.devices_per_node: devices_per_node 3 must divide the world size"):
        load_plan(obj)


def test_show_names_the_link_each_axis_used(tmp_path, capsys):
    base = "pp 4\nschedule gpipe\nmicrobatches 2\nmodel \"pipec.examples.gpt:build\" (layers=4, dim=32, heads=2, " \
           "vocab=64, seq=8)\ninput tokens: int64[4, 8]\ncosts flops\npeak_flops 1TFLOP/s\ndevices_per_node 2\n"
    pipe = tmp_path / "a.pipe"
    pipe.write_text(base + LINKS_TEXT)
    out = tmp_path / "plan.json"
    assert main(["compile", str(pipe), "-o", str(out)]) == 0
    assert main(["show", str(out)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("links (")]
    assert lines == ["links (2 devices per node, 2 nodes): pp hops 2 intra, 1 inter; tie groups 1 inter"] * 2
    pipe.write_text(base)                               # no intra / inter: no line
    assert main(["compile", str(pipe), "-o", str(out)]) == 0
    assert "links (" not in capsys.readouterr().out


# ----------------------------------------------------------------------------- pipec tune


SLOW_INTER = small_gpt_pipe(
    extra="links intra(latency=1us, bandwidth=100GB/s), inter(latency=1ms, bandwidth=10MB/s)\n")
KEEP = frozenset({"tp", "shard", "shard_size", "schedule", "partition"})  # tp 1: about where dp groups sit


def test_tune_keeps_dp_inside_nodes_when_inter_is_slow(tmp_path):
    path = tmp_path / "slow.pipe"
    path.write_text(SLOW_INTER)
    base = load_spec(str(path), {}).request
    flat = tune(TuneRequest(base=base, num_devices=4, keep=KEEP, num_top=3))
    assert flat.best.candidate.layout == "1x4"       # no nodes said: replicas scale best (no bubble)
    nodes = tune(TuneRequest(base=base, num_devices=4, keep=KEEP, num_top=3, devices_per_node=2))
    best = nodes.best.plan
    # 1x4's all-reduce would cross the nodes (~0.1 s of inter at 10 MB/s); 2x2 keeps each dp group in a node
    assert nodes.best.candidate.layout == "2x2" and best.mesh.devices_per_node == 2
    assert link_sides(best)["dp"] == {"intra": 2, "inter": 0} and link_sides(best)["pp"] == {"intra": 0, "inter": 1}
    assert "devices_per_node 2" in pipe_lines(nodes.best.candidate, best)   # --pipe and --json's pipe
    assert not any(line.startswith("devices_per_node") for line in pipe_lines(flat.best.candidate, flat.best.plan))


def test_tune_refuses_a_node_size_that_does_not_fit_the_devices(tmp_path, capsys):
    path = tmp_path / "slow.pipe"
    path.write_text(SLOW_INTER)
    assert main(["tune", str(path), "--devices", "4", "--devices-per-node", "3", "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "--devices-per-node: devices_per_node 3 must divide --devices 4 or be at least it" in err
    assert "use a divisor of 4 (1, 2, 4), or 4 or more" in err
