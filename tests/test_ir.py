"""The instruction IR: text form and its parser, plan.json round trips and schema errors."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from pipec.compiler.ir.program import Instruction, IRError, Op, Program, parse_instruction, parse_program
from pipec.compiler.ir.plan import Cost, Edge, Link, Mesh, Plan, PlanError, TensorSpec, Stage, Tie
from pipec.compiler.ir.plan_json import ELSEWHERE, FORMAT, load_plan, plan_to_json, read_plan, write_plan
from pipec.compiler.limits import LIMITS
from pipec.compiler.ir.timeline import Event, Timeline

TEXT = """0: F0.0 [SA0.0>1@1 RG0.0<1@1] B0.0 AR0:dp AR0:tie.wte OPT
1: RA1.0<0@0 F1.0 I1.0 [SG1.0>0@0] W1.0 AR1:tie.wte OPT"""


def test_text_round_trip():
    prog = parse_program(TEXT)
    assert prog.text() == TEXT
    assert parse_program(prog.text()) == prog
    assert prog.ranks[0][1] == Instruction(Op.SEND_ACT, 0, 0, to_stage=1, peer=1, batch=0)
    assert prog.ranks[1][3].batch == 0  # batch ids restart on each rank


@pytest.mark.parametrize(
    "token, ins",
    [
        ("F0.3", Instruction(Op.FWD, 0, 3)),
        ("B12.0", Instruction(Op.BWD, 12, 0)),
        ("I0.1", Instruction(Op.BWD_I, 0, 1)),
        ("W0.1", Instruction(Op.BWD_W, 0, 1)),
        ("SA0.3>1@1", Instruction(Op.SEND_ACT, 0, 3, to_stage=1, peer=1)),
        ("RA1.3<0@0", Instruction(Op.RECV_ACT, 1, 3, from_stage=0, peer=0)),
        ("SG1.3>0@0", Instruction(Op.SEND_GRAD, 1, 3, to_stage=0, peer=0)),
        ("RG0.3<1@1", Instruction(Op.RECV_GRAD, 0, 3, from_stage=1, peer=1)),
        ("AR0:dp", Instruction(Op.ALLREDUCE, 0, group="dp")),
        ("AR3:tie.wte.weight", Instruction(Op.ALLREDUCE, 3, group="tie.wte.weight")),
        ("OPT", Instruction(Op.OPTIM_STEP)),
    ],
)
def test_every_opcode_parses_and_prints(token, ins):
    assert parse_instruction(token) == ins
    assert ins.text() == token


@pytest.mark.parametrize(
    "text, where",
    [
        ("0: F0", "not an instruction: 'F0'"),
        ("0: SA0.1<1@1", "SA takes '>'"),
        ("1: F0.0", "expected rank 0"),
        ("0: [F0.0 SA0.0>1@1]", "only sends and receives can be batched"),
        ("0: [SA0.0>1@1", "'[' not closed"),
        ("0: SA0.0>1@1]", "']' without '['"),
        ("", "empty program"),
        ("0 F0.0", "expected '<rank>: instructions'"),
    ],
)
def test_text_errors_say_where(text, where):
    with pytest.raises(IRError, match=None) as e:
        parse_program(text)
    assert where in str(e.value)


def _plan() -> Plan:
    sig = TensorSpec("h", "float32", (2, 8))
    return Plan(
        mesh=Mesh(pp=2, dp=1),
        num_stages=2,
        num_microbatches=1,
        placement=(0, 1),
        program=parse_program("0: F0.0 SA0.0>1@1 RG0.0<1@1 B0.0 AR0:tie.w OPT\n1: RA1.0<0@0 F1.0 B1.0 SG1.0>0@0 AR1:tie.w OPT"),
        stages=(
            Stage(stage=0, rank=0, nodes=("a",), params=("w",), inputs=(TensorSpec("x", "float32", (2, 8)),),
                  outputs=(sig,), cost=Cost(fwd=0.5, bwd=1.0, bwd_i=0.5, bwd_w=0.5), activation_bytes=64,
                  param_bytes=256, num_params=64),
            Stage(stage=1, rank=1, params=("head.w",), inputs=(sig,), outputs=(TensorSpec("y", "float32", (2, 8)),)),
        ),
        edges=(Edge(src_stage=0, dst_stage=1, tensors=(sig,)),),
        ties=(Tie(name="w", stages=(0, 1), params=("w", "head.w"), num_bytes=256),),
        links={"pp": Link(latency_s=1e-5, bandwidth_Bps=1e9), "dp": Link(latency_s=2e-5, bandwidth_Bps=2e9)},
        spec={"schedule": "1f1b", "costs": "unit"},
        model={"target": "m:f", "kwargs": {}, "trace": "fx", "fingerprint": "abc"},
        prediction=Timeline.build(step_time=4.0, busy={0: (3.0, 0.5), 1: (2.0, 1.0)},
                                  events=[Event.parse(0, "F0.0", 0.0, 1.0)], peak_activations={0: 1, 1: 1}),
        pipec_version="0.1.0",
    )


def test_plan_json_round_trip(tmp_path):
    plan = _plan()
    path = tmp_path / "plan.json"
    write_plan(plan, str(path))
    back = read_plan(str(path))
    assert back == plan
    assert plan_to_json(back) == json.loads(path.read_text())


def _corrupt(path, mutate):
    obj = plan_to_json(_plan())
    mutate(obj)
    path.write_text(json.dumps(obj))
    return path


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda o: o.update(format="pipec.plan/9"),
         "plan.format: 'pipec.plan/9' is newer than this pipec reads (pipec.plan/1, pipec.plan/2, pipec.plan/3)"),
        (lambda o: o["mesh"].update(pp="two"), "plan.mesh.pp: expected an integer"),
        (lambda o: o.pop("num_stages"), "plan.num_stages: required field is missing"),
        (lambda o: o["ranks"][1]["instructions"][0].update(peer=7), "plan.ranks[1].instructions[0].peer: expected an integer in 0..1"),
        (lambda o: o["ranks"][0]["instructions"][2].update(op="JUMP"), "plan.ranks[0].instructions[2].op: unknown opcode 'JUMP'"),
        (lambda o: o["ranks"][0]["instructions"][0].update(microbatch=-1), "plan.ranks[0].instructions[0].microbatch"),
        (lambda o: o["ranks"][0]["instructions"][0].update(group="dp"), "FWD takes no field 'group'"),
        (lambda o: o["ranks"][0]["instructions"][4].update(group="world"), ".group: expected 'dp' or 'tie.<name>'"),
        (lambda o: o["stages"][1].update(rank=0), "plan.stages[1].rank: expected 1 (placement[1])"),
        (lambda o: o["stages"][0]["cost"].update(fwd=-1), "plan.stages[0].cost.fwd"),
        (lambda o: o["edges"][0]["tensors"][0].update(shape=[2, "x"]), "plan.edges[0].tensors[0].shape[1]"),
        (lambda o: o.update(placement=[0]), "plan.placement: expected one pp rank per stage"),
        (lambda o: o["ranks"].pop(), "plan.ranks: expected 2 ranks"),
        (lambda o: o["prediction"].update(step_time="x"), "plan.prediction.step_time: expected a number"),
        (lambda o: o["mesh"].update(pp=LIMITS["pp"] + 1), "beyond pipec's limit of 4096"),
        (lambda o: o.update(num_microbatches=70000), "70000 microbatches is beyond pipec's limit of 65536"),
    ],
)
def test_schema_errors_name_the_field(tmp_path, mutate, message):
    path = _corrupt(tmp_path / "bad.json", mutate)
    with pytest.raises(PlanError) as e:
        read_plan(str(path))
    assert message in str(e.value)
    assert str(path) in str(e.value)


def test_unreadable_files(tmp_path):
    with pytest.raises(PlanError, match="cannot read plan"):
        read_plan(str(tmp_path / "missing.json"))
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(PlanError, match="not a JSON file"):
        read_plan(str(tmp_path / "x.json"))
    with pytest.raises(PlanError, match="expected an object"):
        load_plan([1, 2])


def test_program_counts():
    prog = parse_program(TEXT)
    assert isinstance(prog, Program)
    assert prog.num_ranks == 2
    # counted by hand: rank 0 F, SA, RG, B, AR, AR, OPT; rank 1 RA, F, I, SG, W, AR, OPT (batch brackets are no instructions)
    assert prog.num_instructions == 14
    assert parse_program("0: OPT\n1: F0.0 OPT").num_instructions == 3


def _bare_plan(**kw) -> Plan:
    return Plan(mesh=Mesh(pp=2), num_stages=4, num_microbatches=2, placement=(0, 1, 1, 0), program=Program(()), **kw)


def test_a_plan_always_carries_its_edges():
    chain = [(0, 1), (1, 2), (2, 3)]
    assert [(e.src_stage, e.dst_stage) for e in _bare_plan().edges] == chain
    skip = (Edge(src_stage=0, dst_stage=2), Edge(src_stage=2, dst_stage=3), Edge(src_stage=0, dst_stage=1))
    assert _bare_plan(edges=skip).edges == skip  # given edges are kept as they are
    obj = plan_to_json(_bare_plan())
    del obj["edges"]  # an old or hand-written plan without edges
    obj["ranks"] = [{"rank": 0, "instructions": []}, {"rank": 1, "instructions": []}]
    assert [(e.src_stage, e.dst_stage) for e in load_plan(obj).edges] == chain


def test_tie_ranks():
    plan = _bare_plan(ties=(Tie(name="wte", stages=(0, 3), params=("a", "b")),
                            Tie(name="x", stages=(3, 1, 2), params=("a", "b", "c"))))
    assert plan.tie_ranks("wte") == (0,)     # stages 0 and 3 are both on rank 0: no all-reduce needed
    assert plan.tie_ranks("x") == (0, 1)     # sorted, each rank once
    assert plan.tie("x").ranks((1, 1, 1, 1)) == (1,)
    with pytest.raises(KeyError, match="no tied weight 'nope'"):
        plan.tie_ranks("nope")


def test_one_cost_type_from_plan_to_the_event_loop():
    from pipec.compiler.sim.simulate import plan_costs
    from pipec.schedules import timing

    assert Cost is timing.Cost
    costs = (Cost(fwd=0.5, bwd=1.5, bwd_i=1.0, bwd_w=0.5, optim=0.25),) * 4
    stages = tuple(Stage(stage=s, rank=r, cost=c) for (s, r), c in zip(enumerate((0, 1, 1, 0)), costs))
    model = plan_costs(_bare_plan(stages=stages, model={"target": "m:f"}))
    assert model.stages == costs and model.stages[0] is costs[0]  # handed on, not converted


# ----------------------------------------------------------------------------- pipec.plan/1, and one home per value

V1 = os.path.join(os.path.dirname(__file__), "data", "plan_v1")
"""Plans written by ``pipec compile`` before the format was ``pipec.plan/2`` (the commands: data/plan_v1/README)."""

GPT_SMALL = ('model "pipec.examples.gpt:build" (layers=2, dim=32, heads=2, vocab=64, seq=8)\n'
             "input tokens: int64[4, 8]\npp 2 microbatches 2 costs flops peak_flops 100TFLOP/s\n")


def _compiled_today(name: str) -> Plan:
    """What today's compiler makes of the request each v1 plan was compiled from."""
    from pipec.compiler.driver import compile_plan, compile_spec
    from pipec.dsl import parse_spec

    if name == "schedule_only":
        return compile_plan(schedule="1f1b", num_ranks=2, num_microbatches=3).plan
    if name == "sharded":
        return compile_plan(schedule="gpipe", num_ranks=2, dp=2, shard="full", num_microbatches=2).plan
    return compile_spec(parse_spec(GPT_SMALL)).plan


@pytest.mark.parametrize("name", ["schedule_only", "sharded", "gpt_small"])
def test_a_v1_plan_reads_into_the_plan_compiled_today(name, tmp_path):
    from pipec.compiler.passes.verify import verify

    with open(os.path.join(V1, f"{name}.json"), encoding="utf-8") as f:
        assert json.load(f)["format"] == "pipec.plan/1"
    old = read_plan(os.path.join(V1, f"{name}.json"))
    verify(old)
    now = _compiled_today(name)
    model = lambda p: p.model and {k: v for k, v in p.model.items()  # noqa: E731
                                   if k not in ("search_path", "fingerprint", "fingerprint_parts")}
    assert replace(old, model=model(old), prediction=None) == replace(now, model=model(now), prediction=None)
    assert old.prediction.step_time == pytest.approx(now.prediction.step_time)
    assert old.mesh.shard == ("full" if name == "sharded" else "none")
    path = tmp_path / "again.json"
    write_plan(old, str(path))  # written again, it is a plan of today's format that reads back the same
    again = json.loads(path.read_text())
    assert again["format"] == FORMAT and not set(again["spec"]) & set(ELSEWHERE)
    assert read_plan(str(path)) == old


def test_each_value_appears_once_in_a_plan():
    from pipec.compiler.driver import compile_plan

    obj = plan_to_json(compile_plan(schedule="gpipe", num_ranks=2, dp=2, shard="full", num_microbatches=2).plan)
    assert obj["mesh"] == {"pp": 2, "dp": 2, "shard": "full"} and obj["num_microbatches"] == 2
    assert not set(obj["spec"]) & set(ELSEWHERE)
    obj["spec"]["shard"] = "optimizer"  # a second home for shard, as a hand edit might add
    with pytest.raises(PlanError, match=r"plan.spec.shard: plan.json keeps shard in mesh.shard, not in spec, "
                                        r"got 'optimizer'"):
        load_plan(obj)
    obj["spec"].pop("shard")
    obj["mesh"]["shard"] = "half"  # the one home, checked once (the mesh's check)
    with pytest.raises(PlanError, match=r"plan.mesh.shard: shard must be one of none, optimizer, grads, full, "
                                        r"got 'half'"):
        load_plan(obj)
