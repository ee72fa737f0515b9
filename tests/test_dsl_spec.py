"""The semantic pass: defaults, sources, every key's value, cross-key rules,
custom schedules (policy and order) and located warnings."""

from __future__ import annotations

import json
import math

import pytest

from pipec.dsl import (
    KEYS,
    DSLError,
    Link,
    LRSchedule,
    Optimizer,
    Partition,
    TensorSpec,
    load_spec,
    parse_spec,
)
from pipec.compiler.driver import compile_spec, schedule_order
from pipec.compiler.ir.plan_json import ELSEWHERE
from pipec.errors import Diagnostic, PipecError
from pipec.schedules import build_order
from pipec.schedules.order import Action, Kind


def order_of(spec):
    """The compute order the compiler's driver builds for a spec."""
    return schedule_order(spec.request)[0]


def test_empty_file_is_all_defaults() -> None:
    spec = parse_spec("")
    assert set(spec) == set(KEYS)
    assert (spec.schedule, spec.pp, spec.dp, spec.virtual, spec.stages, spec.placement) == ("1f1b", 2, 1, 1, 2, "loop")
    assert spec.microbatches == 4 and spec.costs == "unit" and spec.model is None
    assert all(spec.source(k).startswith("default") for k in KEYS)
    assert (spec.request.schedule, spec.request.policy, spec.request.order) == ("1f1b", None, None)
    assert spec.warnings == ()


def test_sources_name_file_line_and_column() -> None:
    spec = parse_spec("# mesh\npp 4  dp 2\nschedule gpipe\n", filename="a.pipe")
    assert spec.source("pp") == "a.pipe:2:4"
    assert spec.source("dp") == "a.pipe:2:10"
    assert spec.source("schedule") == "a.pipe:3:10"
    assert spec.source("microbatches") == "default (2 x pp)"
    assert spec["pp"] == spec.pp == 4


KITCHEN_SINK = """\
model            "pipec.examples.gpt:build" (layers=8, dim=256, act=gelu, bias=off, name="x", scale=(1, 2.5))
input            tokens: int64[16, 128], mask: bool[16, 128]
schedule         interleaved_1f1b
pp 4  dp 2  virtual 2  stages 8  placement loop
microbatches     8
partition        split before blocks.1, blocks.2, blocks.3, blocks.4, blocks.5, blocks.6, blocks.7
trace            export
init             exact
costs            profile
peak_flops       312TFLOP/s
device_memory    80GiB
links            dp(latency=2ms, bandwidth=100Gbit/s)
steps            100
seed             7
optimizer        sgd(momentum=0.9, nesterov=on)
lr               1e-2
lr_schedule      cosine(warmup=10, min_lr=1e-4)
grad_clip        1.0
dtype            bfloat16
recompute        all
data             "mypkg.data:batches"
loss             mse
checkpoint_dir   "ckpt/run1"
checkpoint_every 50
"""


def test_every_key_is_writable() -> None:
    spec = parse_spec(KITCHEN_SINK, filename="sink.pipe")
    assert spec.model == "pipec.examples.gpt:build"
    assert dict(spec.model_args) == {"layers": 8, "dim": 256, "act": "gelu", "bias": False, "name": "x",
                                     "scale": (1, 2.5)}
    assert spec.input == (TensorSpec("tokens", "int64", (16, 128)), TensorSpec("mask", "bool", (16, 128)))
    assert (spec.schedule, spec.pp, spec.dp, spec.virtual, spec.stages) == ("interleaved_1f1b", 4, 2, 2, 8)
    assert spec.partition == Partition("split", None, tuple(f"blocks.{i}" for i in range(1, 8)))
    assert (spec.trace, spec.init, spec.costs) == ("export", "exact", "profile")
    assert spec.peak_flops == 312e12 and spec.device_memory == 80 * 2**30
    assert spec.links.dp == Link(latency_s=2e-3, bandwidth_Bps=12.5e9)
    assert spec.links.pp == Link(latency_s=1e-5, bandwidth_Bps=25e9)  # untouched axis keeps its default
    assert (spec.steps, spec.seed, spec.lr, spec.grad_clip, spec.dtype) == (100, 7, 1e-2, 1.0, "bfloat16")
    assert spec.optimizer == Optimizer("sgd", (("momentum", 0.9), ("dampening", 0.0), ("weight_decay", 0.0),
                                               ("nesterov", True)))
    assert spec.optimizer.kwargs["momentum"] == 0.9
    assert spec.lr_schedule == LRSchedule("cosine", 10, 1e-4)
    assert spec.recompute == tuple(range(8))
    assert (spec.data, spec.loss, spec.checkpoint_dir, spec.checkpoint_every) == (
        "mypkg.data:batches", "mse", "ckpt/run1", 50)
    assert spec.source("model_args") == "sink.pipe:1:46"  # its arguments, written with the model
    as_json = spec.to_json()
    # each key has one home in plan.json: spec, or the plan field ELSEWHERE names (a named schedule has no
    # policy and no order; targets not given are derived from the model; tensor_parallel applies only at tp > 1)
    assert set(as_json) == set(KEYS) - set(ELSEWHERE) - {"policy", "order", "targets", "tensor_parallel"}
    assert json.loads(json.dumps(as_json)) == as_json
    assert as_json["optimizer"] == {"name": "sgd", "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0,
                                    "nesterov": True}
    assert spec.request.links["dp"] == Link(latency_s=2e-3, bandwidth_Bps=12.5e9)
    assert (spec.request.mesh.pp, spec.request.mesh.dp, spec.request.num_stages) == (4, 2, 8)


@pytest.mark.parametrize(("text", "key", "value"), [
    ("device_memory 80GB", "device_memory", 80 * 10**9),
    ("device_memory 1.5TiB", "device_memory", int(1.5 * 2**40)),
    ("device_memory 1024", "device_memory", 1024),
    ("device_memory none", "device_memory", None),
    ("links pp(latency=500ns)", "links", None),
    ("peak_flops 1.2PFLOP/s", "peak_flops", 1.2e15),
    ("peak_flops 9e13", "peak_flops", 9e13),
    ("lr 3e-4", "lr", 3e-4),
    ("grad_clip none", "grad_clip", None),
    ("recompute none", "recompute", ()),
    ("recompute stages 1", "recompute", (1,)),
    ("partition balanced", "partition", Partition("balanced", "flops")),
    ("partition balanced(by=time)", "partition", Partition("balanced", "time")),
    ("partition markers", "partition", Partition("markers")),
    ("partition auto", "partition", Partition("auto")),
    ("lr_schedule linear", "lr_schedule", LRSchedule("linear")),
    ("data synthetic", "data", "synthetic"),
    ("loss \"my.losses:smooth_l1\"", "loss", "my.losses:smooth_l1"),
    ("checkpoint_dir ckpt", "checkpoint_dir", "ckpt"),
])
def test_values(text: str, key: str, value) -> None:
    spec = parse_spec(text)
    if key == "links":
        assert math.isclose(spec.links.pp.latency_s, 5e-7)
    else:
        assert spec[key] == value


def test_model_call_sets_model_args_and_model_args_alone_too() -> None:
    a = parse_spec('model "m.n:f" (layers=2)\ninput x: float32[4, 3]\n')
    b = parse_spec('model "m.n:f"\nmodel_args (layers=2)\ninput x: float32[4, 3]\n')
    assert dict(a.model_args) == dict(b.model_args) == {"layers": 2}
    assert a.costs == b.costs == "profile"  # the default with a model and no peak_flops
    for text in ('model "m.n:f" (layers=2)\nmodel_args (dim=2)\ninput x: float32[4, 3]\n',
                 'model_args (dim=2)\nmodel "m.n:f" (layers=2)\ninput x: float32[4, 3]\n'):
        with pytest.raises(DSLError, match="model_args is set twice"):
            parse_spec(text)


def test_costs_default_and_flops_needs_a_peak() -> None:
    model = 'model "m:f"\ninput x: float32[4, 3]\n'
    assert parse_spec("").costs == "unit"
    assert parse_spec(model).costs == "profile"
    assert parse_spec(model + "peak_flops 1PFLOP/s").costs == "flops"
    with pytest.raises(DSLError, match="costs flops converts FLOPs to seconds"):
        parse_spec(model + "costs flops")


@pytest.mark.parametrize(("pp", "batch", "expected"), [(4, 16, 8), (3, 16, 4), (4, 6, 6), (2, 7, 1), (8, 12, 12)])
def test_default_microbatches_divide_the_batch(pp: int, batch: int, expected: int) -> None:
    spec = parse_spec(f'model "m:f"\ninput x: float32[{batch}, 3]\npp {pp}\n')
    assert spec.microbatches == expected
    assert batch % spec.microbatches == 0


def test_virtual_stages_and_placement_follow_each_other() -> None:
    assert parse_spec("schedule interleaved_1f1b pp 4").virtual == 2
    assert parse_spec("schedule interleaved_1f1b pp 4 stages 12").virtual == 3
    assert parse_spec("schedule looped_bfs pp 2 virtual 3").stages == 6
    zbv = parse_spec("schedule zbv pp 4")
    assert (zbv.virtual, zbv.placement, zbv.placement_ranks()) == (2, "v", (0, 1, 2, 3, 3, 2, 1, 0))
    explicit = parse_spec("schedule zbv pp 2 placement 0, 1, 1, 0")
    assert explicit.placement_ranks() == (0, 1, 1, 0)


def test_one_f_one_b_with_few_microbatches_warns_at_the_value() -> None:
    spec = parse_spec("schedule 1f1b\npp 4\nmicrobatches 2\n", filename="w.pipe")
    assert spec.warnings == ()  # the schedule's rules are the compiler driver's
    warning, bubble = compile_spec(spec).diagnostics
    assert "predicted bubble is 60%" in str(bubble) and bubble.line == 3
    assert (warning.file, warning.line, warning.col) == ("w.pipe", 3, 14)
    assert str(warning).startswith("w.pipe:3:14: warning: 1f1b with fewer microbatches (2) than ranks (4)")
    assert "use microbatches >= 4" in warning.message  # the file's key, not the flag


def test_other_warnings() -> None:
    spec = parse_spec('checkpoint_dir "c"\nsteps 5 lr_schedule cosine(warmup=5)\ninput x: int64[2]\n')
    messages = [w.message for w in spec.warnings]
    assert any("no checkpoint is written" in m for m in messages)
    assert any("never reaches lr" in m for m in messages)
    assert any("input is used only with a model" in m for m in messages)


def test_later_complaints_about_a_key_are_located_there() -> None:
    spec = parse_spec("pp 4\npartition split before blocks.2, blocks.4, blocks.6\n", filename="p.pipe")
    err = spec.locate(PipecError("the model has no module 'blocks.4'", key="partition", index=1))
    assert (err.line, err.col) == (2, 34)
    assert str(err).splitlines()[2] == "    " + " " * 33 + "^~~~~~~~"
    err = spec.locate(PipecError("too few ranks", key="pp"))
    assert str(err).startswith("p.pipe:1:4: error: too few ranks")
    warning = spec.locate(Diagnostic("warning", "a predicted bubble above 50%", key="microbatches"))
    assert (warning.line, warning.col) == (1, 4)  # a default: at the statement that made it matter (pp)
    assert ": warning: " in str(warning) and "microbatches was not set" not in str(warning)  # only --verbose
    assert "microbatches was not set; its default is used" in warning.render(verbose=True)
    err = spec.locate(PipecError("too few microbatches", key="microbatches"))
    assert "microbatches was not set; its default is used" in str(err)  # an error says why it is anchored there
    note = spec.locate(Diagnostic("note", "fell back to torch.export", key="trace"))
    assert (note.line, note.col) == (1, 1) and ": note: " in str(note)  # nothing given it falls back to
    plain = PipecError("not about a key")
    assert spec.locate(plain) is plain


# ----------------------------------------------------------------------------- custom schedules


@pytest.mark.parametrize("preset", ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1"])
@pytest.mark.parametrize(("pp", "mb"), [(2, 4), (4, 8), (3, 6)])
def test_policy_presets_equal_their_named_schedules(preset: str, pp: int, mb: int) -> None:
    spec = parse_spec(f"pp {pp} microbatches {mb} policy {preset}")
    assert spec.schedule == "policy" and spec.custom == "policy"
    named = build_order(preset, num_ranks=pp, num_microbatches=mb, num_chunks=spec.virtual)
    assert order_of(spec) == named


def test_policy_expression_is_torch_interleaved_warmup() -> None:
    spec = parse_spec("pp 4 virtual 2 microbatches 8\n"
                      "policy (warmup=min((chunks - 1) * (M // max(1, M // P)) + 2 * (P - 1 - rank), chunks * M), "
                      "priority=forward)\n")
    assert order_of(spec) == build_order("interleaved_1f1b", num_ranks=4, num_microbatches=8, num_chunks=2)
    assert spec.to_json()["policy"]["warmup"] == [10, 8, 6, 4]  # the expression's value on each rank
    assert spec.to_json()["policy"]["priority"] == "forward"


def test_policy_that_cannot_run_is_located_at_the_policy() -> None:
    # rank 0 warms up 0 forwards, rank 1 all 4: rank 0 waits in B0.0 for rank 1's backward, rank 1 in F1.1 for
    # rank 0's next forward; the driver finds the order cannot complete and the boundary points at the policy
    spec = parse_spec("pp 2 microbatches 4\npolicy (warmup=4 * rank, priority=forward)\n", filename="p.pipe")
    with pytest.raises(DSLError, match=r"policy cannot make progress with P=2, M=4, v=1") as info:
        compile_spec(spec)
    assert (info.value.line, info.value.col) == (2, 8)
    assert "rank 0: action 1 (B0.0) waits for backward" in info.value.message


def test_policy_warmup_is_checked_on_every_rank() -> None:
    spec = parse_spec("pp 4 microbatches 8 policy (warmup=rank * 3)")
    with pytest.raises(DSLError, match=r"policy warm-up on rank 3 must be in 0..8 .*got 9") as info:
        compile_spec(spec)  # the bound is the driver's; the boundary points at the setting
    assert info.value.col == 36
    with pytest.raises(DSLError, match="division by zero"):
        parse_spec("pp 4 policy (warmup=M // rank)")


ONE_F_ONE_B = """\
pp {P}  microbatches {M}
order
  rank r in 0..P-1: F(r).0..P-1-r (B(r).m F(r).m+P-r for m in 0..M-P+r-1) B(r).M-P+r..M-1
"""


@pytest.mark.parametrize(("pp", "mb"), [(1, 1), (2, 2), (4, 8), (3, 7), (8, 16)])
def test_order_template_is_one_f_one_b(pp: int, mb: int) -> None:
    spec = parse_spec(ONE_F_ONE_B.format(P=pp, M=mb))
    assert order_of(spec) == build_order("1f1b", num_ranks=pp, num_microbatches=mb)
    assert spec.to_json()["order"]["ranks"][0].startswith("F0.0")


def test_order_infers_the_mesh() -> None:
    spec = parse_spec("order\n  rank 0: F0.0 F0.1 F3.0 F3.1 B3.0 B3.1 B0.0 B0.1\n"
                      "  rank 1: F1.0 F1.1 F2.0 F2.1 B2.0 B2.1 B1.0 B1.1\n")
    assert (spec.pp, spec.microbatches, spec.stages, spec.virtual, spec.placement) == (2, 2, 4, 2, "v")
    assert spec.source("pp") == "default (from the order)"
    explicit = parse_spec("order rank 0: F0.0 F3.0 B3.0 B0.0 rank 1: F1.0 F2.0 B2.0 B1.0 rank 2: F4.0 B4.0 F5.0 "
                          "B5.0")
    assert explicit.placement == (0, 1, 1, 0, 2, 2)
    with pytest.raises(DSLError, match="the order runs stage 2 on rank 1, but placement loop puts it on rank 0"):
        parse_spec("placement loop order rank 0: F0.0 F3.0 B3.0 B0.0 rank 1: F1.0 F2.0 B2.0 B1.0")


def test_order_with_split_backward() -> None:
    spec = parse_spec("order rank 0: F0.0 F0.1 I0.0 I0.1 W0.0 W0.1")
    assert order_of(spec).ranks[0][2] == Action(Kind.I, 0, 0)
    with pytest.raises(DSLError, match=r"rank 0, action 1 \(W0.0\): weight-grad W needs its input-grad I0.0") as info:
        compile_spec(parse_spec("order rank 0: F0.0 W0.0 I0.0"))
    assert info.value.col == 20  # at the action


def test_csv_order(tmp_path) -> None:
    (tmp_path / "o.csv").write_text("0F0,,0F1,0B0,0B1\n1F0,1B0,,1F1,1B1\n")
    (tmp_path / "s.pipe").write_text('order "o.csv"\n')
    spec = load_spec(str(tmp_path / "s.pipe"))
    assert order_of(spec).text() == "0: F0.0 F0.1 B0.0 B0.1\n1: F1.0 B1.0 F1.1 B1.1"
    assert spec.to_json()["order"] == {"ranks": ["F0.0 F0.1 B0.0 B0.1", "F1.0 B1.0 F1.1 B1.1"]}
    (tmp_path / "o.csv").write_text("0F0,0SEND_F0,0B0\n1F0,1B0\n")
    with pytest.raises(DSLError) as info:
        load_spec(str(tmp_path / "s.pipe"))
    assert str(info.value).startswith("o.csv:1:5: error: '0SEND_F0' is a communication action")


def test_custom_and_named_schedules_exclude_each_other() -> None:
    with pytest.raises(DSLError, match="schedule and order both choose the schedule"):
        parse_spec("schedule gpipe\norder rank 0: F0.0 B0.0\n")
