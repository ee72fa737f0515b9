"""The model front end end to end: split stages reproduce the model, initialisation, costs, memory, views."""

from __future__ import annotations

import dataclasses
import shutil
import sys

import pytest
import torch
import torch.nn.functional as F

from pipec.compiler.frontend import FrontendError, Host, TensorSpec, build_stage_graph
from pipec.views.graph import render_graph
from pipec.compiler.ir.program import Program
from pipec.compiler.driver import compile_request
from pipec.compiler.request import CompileRequest, ModelSpec, Partition
from pipec.compiler.passes.memory import MemoryBudgetError, check_memory, state_bytes
from pipec.compiler.ir.plan import Mesh, Plan
from pipec.compiler.ir.plan_json import read_plan, write_plan
from pipec.model.weights import module_seed
from pipec.runtime.stages import build_reference, build_stages, run_stages
from pipec.model import weights
from pipec.errors import PipecError, UserCodeError
from model_requests import changed, model_request

GPT = "pipec.examples.gpt:build"
GPT_ARGS = dict(layers=4, dim=32, heads=2, vocab=64, seq=16)
TOKENS = TensorSpec("tokens", "int64", (4, 16))


def plan_of(sg, placement=None) -> Plan:
    """A plan around a stage graph (no program: the front end's tests do not run a schedule)."""
    num = sg.num_stages
    placement = tuple(placement or range(num))
    sg = sg.place(placement)
    return Plan(mesh=Mesh(pp=max(placement) + 1), num_stages=num, num_microbatches=2, placement=placement,
                program=Program(tuple(() for _ in range(max(placement) + 1))), stages=sg.stages, edges=sg.edges,
                ties=sg.ties, model=sg.model)


def request(target=GPT, kwargs=GPT_ARGS, inputs=(TOKENS,), stages=4, **kw) -> CompileRequest:
    return model_request(target=target, kwargs=kwargs, inputs=inputs, num_microbatches=2, num_stages=stages,
                         costs=kw.pop("costs", "unit"), **kw)


def batch_for(plan: Plan, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in plan.model["inputs"]:
        shape = tuple(i["shape"])
        if i["dtype"] == "int64":
            out[i["name"]] = torch.randint(0, 64, shape, generator=gen)
        else:
            out[i["name"]] = torch.randn(shape, generator=gen)
    return out


def assert_stages_match(plan: Plan, loss_fn, *, init="module", seed=3, atol=1e-5):
    """Stages run in order give the reference's outputs, loss and gradients (tied copies summed)."""
    stages = build_stages(plan, range(plan.num_stages), seed=seed, init=init)
    ref = build_reference(plan, seed=seed, init=init)
    inputs = batch_for(plan)
    want = ref(*inputs.values())
    got = run_stages(stages, inputs)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=atol, rtol=1e-5)
    loss_fn(got[0]).backward()
    loss_fn(want[0]).backward()
    summed: dict[str, torch.Tensor] = {}
    for mod in stages.values():
        for name, p in mod.canonical_params().items():
            summed[name] = summed.get(name, 0) + p.grad
    ref_params = ref.canonical_params()
    assert set(summed) == set(ref_params)
    for name, p in ref_params.items():
        torch.testing.assert_close(summed[name], p.grad, atol=atol, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    return stages, ref


def cross_entropy(logits: torch.Tensor) -> torch.Tensor:
    targets = torch.arange(logits.shape[0] * logits.shape[1]).remainder(logits.shape[-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets)


def mse(out: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, torch.ones_like(out))


# ----------------------------------------------------------------------------- correctness


def test_gpt_stages_reproduce_outputs_and_gradients(tmp_path):
    sg = build_stage_graph(request())
    assert [st.rank for st in sg.stages] == [-1] * 4
    write_plan(plan_of(sg), str(tmp_path / "plan.json"))
    plan = read_plan(str(tmp_path / "plan.json"))  # what every rank reads
    assert plan.stages == sg.place([0, 1, 2, 3]).stages and plan.model == sg.model
    stages, _ = assert_stages_match(plan, cross_entropy)
    # the tied LM head: one canonical name, held by the first and last stage, copies start equal
    (tie,) = plan.ties
    assert tie.name == "wte.weight" and tie.stages == (0, 3) and tie.params == ("wte.weight", "lm_head.weight")
    assert tie.num_bytes == 64 * 32 * 4
    assert torch.equal(stages[0].canonical_params()["wte.weight"], stages[3].canonical_params()["wte.weight"])
    for s, local in zip(tie.stages, tie.params):  # tie.params: each stage's own name for its copy
        assert dict(stages[s].named_parameters())[local] is stages[s].canonical_params()[tie.name]
    # the causal mask computed in __init__ survives meta tracing
    mask = stages[1].get_buffer("blocks.1.attn.mask")
    assert torch.equal(mask, torch.ones(16, 16, dtype=torch.bool).tril())


def test_mlp_stages_reproduce_outputs_and_gradients():
    x = TensorSpec("x", "float32", (8, 16))
    sg = build_stage_graph(request("pipec.examples.mlp:build", dict(layers=5, dim=16), (x,), stages=3))
    assert not sg.ties and [(e.src_stage, e.dst_stage) for e in sg.edges] == [(0, 1), (1, 2)]
    assert_stages_match(plan_of(sg), mse)


def test_skip_connection_is_a_direct_edge_and_stages_match():
    x = TensorSpec("x", "float32", (8, 16))
    sg = build_stage_graph(request("pipec.examples.skip:build", dict(layers=8, dim=16, skip_from=1, skip_to=6), (x,),
                                   partition=Partition("split", split_before=("blocks.2", "blocks.4", "blocks.6"))))
    pairs = [(e.src_stage, e.dst_stage) for e in sg.edges]
    assert pairs == [(0, 1), (0, 3), (1, 2), (2, 3)]
    skip = next(e for e in sg.edges if (e.src_stage, e.dst_stage) == (0, 3))
    assert [t.shape for t in skip.tensors] == [(4, 16)] and skip.num_bytes == 4 * 16 * 4
    assert sg.graph.edges[0, 3]["skip"] and not sg.graph.edges[0, 1]["skip"]
    # stage 3 receives both the chain value and the skip value, in its inputs' order
    assert set(sg.stages[3].inputs) == set(sg.edges[1].tensors + sg.edges[3].tensors)
    assert_stages_match(plan_of(sg), mse)


def test_bfloat16_signatures_follow_autocast():
    # cut inside the MLP: the GELU output crosses, and under bf16 autocast it is bf16
    sg = build_stage_graph(request(kwargs=dict(GPT_ARGS, layers=2), stages=2, dtype="bfloat16",
                                   partition=Partition("split", split_before=("blocks.0.mlp.proj",))))
    dtypes = {t.name: t.dtype for t in sg.edges[0].tensors}
    assert dtypes["gelu"] == "bfloat16" and dtypes["add_1"] == "float32"
    assert sg.model["traced_on"] == "fake"
    plan = plan_of(sg)
    stages = build_stages(plan, [0, 1], seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = stages[0](batch_for(plan)["tokens"])
    assert [(o.dtype, tuple(o.shape)) for o in outs] == [(getattr(torch, t.dtype), t.shape) for t in sg.stages[0].outputs]


# ----------------------------------------------------------------------------- initialisation


def test_init_module_weights_do_not_depend_on_the_partition():
    a = plan_of(build_stage_graph(request(stages=2)))
    b = plan_of(build_stage_graph(request(stages=3, partition=Partition("split", split_before=("blocks.1", "ln_f")))))
    ref = build_reference(a, seed=7, init="module").canonical_params()
    for plan in (a, b):
        for mod in build_stages(plan, range(plan.num_stages), seed=7, init="module").values():
            for name, p in mod.canonical_params().items():
                assert torch.equal(p, ref[name]), name
    # each module drew from its own generator: (seed, module name)
    torch.manual_seed(module_seed(7, "blocks.0.attn.qkv"))
    want = torch.nn.Linear(32, 96)
    assert torch.equal(ref["blocks.0.attn.qkv.weight"], want.weight)
    other = build_reference(a, seed=8, init="module").canonical_params()
    assert not torch.equal(other["blocks.0.attn.qkv.weight"], ref["blocks.0.attn.qkv.weight"])


def test_init_exact_is_the_factory_init_and_builds_only_requested_stages():
    plan = plan_of(build_stage_graph(request(stages=4)))
    only = build_stages(plan, [2], seed=5, init="exact")
    assert list(only) == [2]
    held = only[2].canonical_params()
    assert tuple(held) == plan.stages[2].params
    torch.manual_seed(5)
    from pipec.examples.gpt import build

    factory = dict(build(**GPT_ARGS).named_parameters())
    for name, p in held.items():
        assert torch.equal(p, factory[name])
    assert_stages_match(plan, cross_entropy, init="exact")


def test_build_stages_names_the_fingerprint_part_that_differs():
    plan = plan_of(build_stage_graph(request(stages=2)))
    other = dataclasses.replace(plan, model={**plan.model, "kwargs": dict(GPT_ARGS, layers=3)})
    with pytest.raises(FrontendError, match="traced graph.*parameters"):
        build_stages(other, [0], seed=0)
    wider = dataclasses.replace(plan, model={**plan.model, "kwargs": dict(GPT_ARGS, dim=48)})
    with pytest.raises(FrontendError, match="parameters") as err:
        build_stages(wider, [0], seed=0)
    assert "traced graph" not in str(err.value)
    parts = dict(plan.model["fingerprint_parts"], torch="1.0")
    old = dataclasses.replace(plan, model={**plan.model, "fingerprint": "0" * 64, "fingerprint_parts": parts})
    with pytest.raises(FrontendError, match="torch version"):
        build_stages(old, [0], seed=0)
    with pytest.raises(FrontendError, match="no model"):
        build_stages(dataclasses.replace(plan, model=None), [0], seed=0)
    with pytest.raises(FrontendError, match="init must be one of auto, module, exact"):
        build_stages(plan, [0], seed=0, init="random")


class HalfInit(torch.nn.Module):
    """Owns two parameters, but its reset_parameters sets only one."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(4))
        self.shift = torch.nn.Parameter(torch.zeros(4))

    def reset_parameters(self) -> None:
        torch.nn.init.ones_(self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.shift


def half_init() -> torch.nn.Module:
    return HalfInit()


def test_init_module_refuses_a_parameter_the_module_does_not_initialise():
    sg = build_stage_graph(request("test_frontend:half_init", {}, (TensorSpec("x", "float32", (2, 4)),), stages=1))
    assert sg.model["init"] == "exact"  # auto: the meta run of reset_parameters() leaves shift unset
    with pytest.raises(FrontendError, match="left 'shift' .* unset"):
        build_reference(plan_of(sg), seed=0, init="module")
    assert torch.equal(build_reference(plan_of(sg), seed=0, init="exact").model.shift, torch.zeros(4))
    with pytest.raises(FrontendError, match=r"init module: .*HalfInit\): its init leaves 'shift' unset") as err:
        build_stage_graph(request("test_frontend:half_init", {}, (TensorSpec("x", "float32", (2, 4)),), stages=1,
                                  init="module"))  # refused at compile time, not on the ranks
    assert err.value.key == "init"


class NanoGPT(torch.nn.Module):
    """nanoGPT's layout: a raw position-embedding parameter on the root, and its own _init_weights."""

    def __init__(self, vocab: int = 32, dim: int = 16, seq: int = 8) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, dim)
        self.wpe = torch.nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = torch.nn.Sequential(*(torch.nn.Linear(dim, dim) for _ in range(2)))
        self.head = torch.nn.Linear(dim, vocab)

    def _init_weights(self, module: torch.nn.Module) -> None:
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.wte(tokens) + self.wpe))


def nano_gpt(**kw) -> torch.nn.Module:
    return NanoGPT(**kw)


def test_init_auto_is_module_when_every_module_has_an_init_path_else_exact_else_refused(monkeypatch):
    gpt = build_stage_graph(request(stages=2))
    assert gpt.model["init"] == "module"  # every module of the example GPT has reset_parameters()
    explicit = build_stage_graph(request(stages=2, init="module"))
    assert explicit.model == gpt.model
    nano = request("test_frontend:nano_gpt", {}, (TensorSpec("tokens", "int64", (2, 8)),), stages=2)
    sg = build_stage_graph(nano)
    assert sg.model["init"] == "exact"  # the root's wpe: _init_weights(root) does not set it
    plan = plan_of(sg)
    ref = build_reference(plan, seed=4, init="exact").canonical_params()
    for p_ in (plan, plan_of(build_stage_graph(changed(nano, num_stages=3)))):
        for mod in build_stages(p_, range(p_.num_stages), seed=4, init="auto").values():  # the plan's resolution
            for name, p in mod.canonical_params().items():
                assert torch.equal(p, ref[name]), name
    older = dataclasses.replace(plan, model={k: v for k, v in plan.model.items() if k != "init"})
    assert torch.equal(build_reference(older, seed=4, init="auto").model.wpe, ref["wpe"])  # resolved at build
    monkeypatch.setattr(weights, "EXACT_MAX_PARAMS", 100)
    with pytest.raises(FrontendError, match=r"init auto: modules without an init path: \(the root module\) \(NanoGPT\)"
                       r": its init leaves 'wpe' unset.*above the 100") as err:
        build_stage_graph(nano)
    assert err.value.key == "model" and any("reset_parameters()" in h for h in err.value.hints)


# ----------------------------------------------------------------------------- costs and memory


def test_flops_costs_recompute_and_activation_bytes():
    x = TensorSpec("x", "float32", (8, 16))
    args = dict(layers=2, dim=16, hidden=32)
    base = request("pipec.examples.mlp:build", args, (x,), stages=2, costs="flops", peak_flops=1e9,
                   partition=Partition("split", split_before=("blocks.1",)))
    sg = build_stage_graph(base)
    mb = 4  # batch 8 over 2 microbatches
    block = 2 * mb * 16 * 32 * 2  # two linears: 2*M*K*N each
    st0 = sg.stages[0]
    assert sg.flops[0] == (block, block, block)
    assert st0.cost.fwd == pytest.approx(block / 1e9) and st0.cost.bwd == pytest.approx(2 * block / 1e9)
    assert st0.cost.bwd_i == 0 and st0.cost.bwd_w == st0.cost.bwd  # stage 0 sends no gradient
    st1 = sg.stages[1]
    assert st1.cost.bwd_i == pytest.approx(sg.flops[1][1] / 1e9) and st1.cost.bwd_w == pytest.approx(sg.flops[1][2] / 1e9)
    assert st0.num_params == 16 * 32 + 32 + 32 * 16 + 16
    assert st0.param_bytes == 4 * st0.num_params
    # saved: x (fc's input), fc out (gelu's input), gelu out (proj's input), plus the output it keeps
    assert st0.activation_bytes == mb * (16 + 32 + 32 + 16) * 4
    rc = build_stage_graph(changed(base, recompute=frozenset({0})))
    assert rc.stages[0].activation_bytes == mb * 16 * 4  # its input only
    assert rc.full_activation_bytes[0] == st0.activation_bytes
    assert rc.stages[0].cost.bwd == pytest.approx(st0.cost.bwd + st0.cost.fwd)
    assert rc.stages[1].cost == sg.stages[1].cost
    rc1 = build_stage_graph(changed(base, recompute=True))
    assert rc1.stages[1].cost.bwd_i == pytest.approx(st1.cost.bwd_i + st1.cost.fwd)
    assert rc1.stages[1].cost.bwd_w == st1.cost.bwd_w
    with pytest.raises(FrontendError, match="peak_flops"):
        build_stage_graph(changed(base, peak_flops=None))


def test_profile_costs_are_measured_with_the_rank_thread_count():
    x = TensorSpec("x", "float32", (8, 16))
    before = torch.get_num_threads()
    sg = build_stage_graph(request("pipec.examples.mlp:build", dict(layers=4, dim=16), (x,), stages=2,
                                   costs="profile"), host=Host(threads_per_rank=1, profile_reps=2))
    assert torch.get_num_threads() == before
    for st in sg.stages:
        c = st.cost
        assert c.fwd > 0 and c.bwd > 0 and c.bwd_w > 0  # the split halves timed as the run does them
    assert sg.stages[0].cost.bwd_i == 0  # stage 0's input needs no gradient
    assert sg.stages[1].cost.bwd_i > 0


def _compiled(device_memory=None) -> Plan:
    """The test GPT compiled by the driver: zbv on 2 ranks, placement 0 1 1 0 (rank 0 holds both tied copies)."""
    model = ModelSpec(target=GPT, kwargs=GPT_ARGS, inputs=(TensorSpec("tokens", "int64", (4, 16)),),
                      partition=Partition("split", split_before=("blocks.1", "blocks.2", "blocks.3")),
                      costs="unit", trace="auto")
    return compile_request(CompileRequest(schedule="zbv", mesh=Mesh(pp=2), num_chunks=2, num_microbatches=2,
                                          model=model, device_memory=device_memory)).plan


def test_memory_model_counts_each_held_copy_and_refuses_what_does_not_fit():
    plan = _compiled()
    assert plan.placement == (0, 1, 1, 0)
    st = plan.stages
    held = [st[0].num_params + st[3].num_params, st[1].num_params + st[2].num_params]
    assert state_bytes(plan) == [16 * n for n in held]
    assert sum(held) == sum(p.numel() for p in _gpt_params()) + 64 * 32  # every parameter, the tied one twice
    peaks = [r.peak_memory_bytes for r in plan.prediction.per_rank]
    assert all(peak > state for peak, state in zip(peaks, state_bytes(plan)))  # saved activations on top
    check_memory(plan, max(peaks))
    with pytest.raises(MemoryBudgetError, match=r"pp rank 0 needs .* at its peak but device_memory is") as err:
        check_memory(plan, peaks[0] - 1)
    assert isinstance(err.value, PipecError) and err.value.key == "device_memory"
    assert f"{held[0]:,} parameters x 16 bytes" in str(err.value) and "recompute" in str(err.value)
    assert state_bytes(dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, num_params=None)
                                                             for s in st))) is None
    with pytest.raises(MemoryBudgetError) as through_driver:  # the compile path refuses with the same model
        _compiled(device_memory=peaks[0] - 1)
    assert str(through_driver.value) == str(err.value) and through_driver.value.key == "device_memory"
    assert _compiled(device_memory=max(peaks)).prediction == plan.prediction


def _gpt_params():
    from pipec.examples.gpt import build

    with torch.device("meta"):
        return list(build(**GPT_ARGS).parameters())


# ----------------------------------------------------------------------------- errors


def _refused(req: CompileRequest, key: str, match: str, kind=FrontendError) -> PipecError:
    with pytest.raises(kind, match=match) as err:
        build_stage_graph(req)
    assert err.value.key == key, err.value
    return err.value


def not_a_module():
    return 42


def raises_value_error(**kw):
    raise ValueError("bad config")


def test_request_errors_say_what_to_do_and_name_their_key():
    _refused(changed(request(), num_microbatches=3), "microbatches",
             "microbatches 3 does not divide the input's batch of 4", kind=PipecError)
    _refused(request(inputs=(TensorSpec("ids", "int64", (4, 16)),)), "input", "not an argument of GPT.forward")
    _refused(request(inputs=(TensorSpec("tokens", "int65", (4, 16)),)), "input", "int65")
    _refused(request(target="pipec.examples.gpt"), "model", "pkg.module:factory")
    _refused(request(target="pipec.examples.gpt:nope"), "model", "no callable 'nope'")
    _refused(request(target="no_such_module_h1b:build", search_path=("/nonexistent",)), "model",
             r"cannot find module 'no_such_module_h1b'; searched /nonexistent, then the installed packages")
    _refused(request(kwargs=dict(GPT_ARGS, depth=3)), "model_args", r"rejected its arguments .*depth")
    _refused(request(target="test_frontend:not_a_module", kwargs={}), "model", "must return a torch.nn.Module, got int")
    err = _refused(request(target="test_frontend:raises_value_error"), "model", "raised ValueError: bad config",
                   kind=UserCodeError)
    assert isinstance(err.original, ValueError)
    _refused(request(recompute=frozenset({9})), "recompute", "recompute names stage 9")
    _refused(request(partition=Partition("balanced", "speed")), "partition", "balanced")
    _refused(request(costs="flops"), "costs", "peak_flops")


def test_the_auto_trace_fallback_note_is_kept_in_the_model_record():
    sg = build_stage_graph(request("test_trace:Encoder", {}, (TensorSpec("x", "float32", (2, 4, 16)),), stages=3))
    assert sg.notes and sg.model["notes"] == list(sg.notes) and "fell back to torch.export" in sg.notes[0]
    assert "notes" not in build_stage_graph(request(stages=2)).model  # fx traced: nothing to say


# ----------------------------------------------------------------------------- where the model is found

MODEL_FILE = """
import torch
from torch import nn

from helper_h1b import width  # a sibling module, as a user's model file would import it


class Net(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Linear(dim, width(dim)) for _ in range(3)))

    def forward(self, x):
        return self.blocks(x)


def build(dim=8):
    return Net(dim)
"""


def test_a_model_beside_the_schedule_file_is_found_by_compile_and_by_ranks_from_any_folder(tmp_path, monkeypatch):
    proj, elsewhere = tmp_path / "proj", tmp_path / "elsewhere"
    (proj / "models").mkdir(parents=True)
    elsewhere.mkdir()
    (proj / "my.pipe").write_text('model "beside_h1b:build"\n')
    (proj / "beside_h1b.py").write_text(MODEL_FILE)
    (proj / "models" / "net_h1b.py").write_text(MODEL_FILE)
    for folder in (proj, proj / "models"):
        (folder / "helper_h1b.py").write_text("def width(dim):\n    return dim\n")
    monkeypatch.chdir(elsewhere)
    path_before = list(sys.path)
    x = (TensorSpec("x", "float32", (4, 8)),)
    for target in ("beside_h1b:build", "models/net_h1b.py:build"):
        with pytest.raises(FrontendError, match="cannot find module 'beside_h1b'|no file 'models/net_h1b.py'") as err:
            build_stage_graph(request(target, {}, x, stages=2))  # not on sys.path, not in the current folder
        assert err.value.key == "model"
        sg = build_stage_graph(request(target, {}, x, stages=2, search_path=(str(proj), str(elsewhere))))
        assert sys.path == path_before  # searched, not added for good
        assert sg.model["search_path"] == [str(proj), str(elsewhere)]
        if target.startswith("models/"):  # the file form is recorded absolute
            assert sg.model["target"] == f"{proj / 'models' / 'net_h1b.py'}:build"
        write_plan(plan_of(sg), str(tmp_path / "plan.json"))
        monkeypatch.chdir(tmp_path)  # a rank started somewhere else finds it the same way
        assert_stages_match(read_plan(str(tmp_path / "plan.json")), mse)
        monkeypatch.chdir(elsewhere)


# ----------------------------------------------------------------------------- the graph view


def test_render_writes_dot_source_and_says_how_to_render_without_dot(tmp_path, monkeypatch):
    sg = build_stage_graph(request(stages=3, partition=Partition("split", split_before=("blocks.1", "blocks.3")))).place([0, 1, 2])
    assert render_graph(sg, tmp_path / "g.dot") == f"wrote {tmp_path / 'g.dot'}"
    src = (tmp_path / "g.dot").read_text()
    assert "stage 0 · rank 0" in src and "tie wte.weight" in src
    (sig,) = sg.edges[0].tensors
    assert f"{sig.name} [2, 16, 32] float32" + chr(10) + "4.0 KiB" in src
    monkeypatch.setattr(shutil, "which", lambda name: None)
    msg = render_graph(sg, tmp_path / "g.svg")
    assert not (tmp_path / "g.svg").exists() and (tmp_path / "g.dot").exists()
    assert "dot -Tsvg" in msg and "apt-get install graphviz" in msg


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz's dot program is not installed (apt-get install graphviz)")
def test_render_draws_svg_and_png(tmp_path):
    sg = build_stage_graph(request(stages=2))
    assert render_graph(plan_of(sg, [0, 1]), tmp_path / "g.svg") == f"wrote {tmp_path / 'g.svg'}"
    svg = (tmp_path / "g.svg").read_text()
    assert svg.lstrip().startswith("<?xml") and "tie wte.weight" in svg
    render_graph(sg.place([0, 1]), tmp_path / "g.png")
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"
