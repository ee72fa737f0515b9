"""Cost-only cuts and re-annotated traces equal the full front end field by field.

A cost-only cut (:mod:`pipec.costs.cutcost`) reads a cut's stages, edges, ties and costs off
the trace's nodes instead of building the stages with torch.fx ``split_module``; a trace for another
microbatch shape re-annotates a copy of an fx graph instead of tracing again. ``pipec tune`` relies on
both giving exactly what the full path gives, so these compare them on every kind of node the example
models have (tied weights read by module and by attribute, skip edges, constants folded across cuts,
model inputs read by later stages, outputs made before the last stage, markers, torch.export graphs).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipec.compiler.frontend as frontend
from pipec.compiler.frontend import FrontendError, Host, Partition, TensorSpec, cut_stage_graph, trace_request
from pipec.compiler.request import CompileRequest
from pipec.costs.costs import stage_costs
from pipec.costs.cutcost import cost_split, cut_costs
from pipec.model.partition import split_graph
from pipec.model.trace import pipe_split
from model_requests import changed, model_request

GPT = ("pipec.examples.gpt:build", dict(layers=3, dim=16, heads=2, vocab=32, seq=8), (TensorSpec("tokens", "int64", (4, 8)),))
MLP = ("pipec.examples.mlp:build", dict(layers=4, dim=8), (TensorSpec("x", "float32", (4, 8)),))
SKIP = ("pipec.examples.skip:build", dict(layers=6, dim=8, skip_from=0, skip_to=4), (TensorSpec("x", "float32", (4, 8)),))
TWO = (TensorSpec("x", "float32", (4, 8)), TensorSpec("y", "float32", (4, 8)))


class Odd(nn.Module):
    """What the example models lack: two inputs read by later stages, a raw parameter read by attribute
    in a later stage and by a module in the first (a tie), a constant crossing cuts, a buffer, an output
    made in the first stage, a tuple of tensors, a marker."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))
        self.register_buffer("shift", torch.zeros(8))
        self.c.weight = self.a.weight

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, D = x.shape
        h = self.a(x) * self.scale
        early = h.sum()
        lo, hi = self.b(h + y).chunk(2, dim=-1)
        h = F.gelu(torch.cat([lo, hi], dim=-1))
        h = h.reshape(B, 2, D // 2).reshape(B, D) + x
        pipe_split()
        h = self.c(h) * self.scale + self.shift + y
        return F.linear(h, self.a.weight).relu(), early


def odd() -> nn.Module:
    return Odd()


def both(outputs, target):  # noqa: ANN001 - Odd's loss: it returns two tensors
    return outputs[0].mean() + outputs[1]


ODD = ("test_cutcost:odd", {}, TWO)


def _req(model, *, stages, costs="flops", partition=Partition("auto"), microbatches=2, **kw) -> CompileRequest:
    target, kwargs, inputs = model
    loss = "test_cutcost:both" if model is ODD else "cross_entropy"
    targets = (TensorSpec("target", "float32", (inputs[0].shape[0],)),) if model is ODD else ()  # a custom loss's
    return model_request(target=target, kwargs=kwargs, inputs=inputs, num_microbatches=microbatches, num_stages=stages,
                         costs=costs, peak_flops=1e12, partition=partition, loss=loss, targets=targets, **kw)


def _fast(tm, req, monkeypatch) -> frontend.StageGraph:
    """The cost-only cut, with the full split made impossible (so a declined cut fails the test)."""
    with monkeypatch.context() as m:
        m.setattr(frontend, "split_graph", lambda *a, **k: pytest.fail("the cost-only cut declined"))
        return cut_stage_graph(tm, req, runnable=False)


AUTO = Partition("auto")
CASES = [
    (GPT, 2, AUTO, {}), (GPT, 4, Partition("balanced", "params"), {}),
    (GPT, 5, Partition("balanced", "memory"), {"recompute": frozenset({0, 3})}),
    (GPT, 3, Partition("split", split_before=("blocks.1", "ln_f")), {}), (GPT, 3, AUTO, {"trace": "export"}),
    (GPT, 4, AUTO, {"dtype": "bfloat16"}), (GPT, 1, AUTO, {}), (GPT, 2, AUTO, {"costs": "unit"}),
    (MLP, 3, AUTO, {}), (MLP, 6, Partition("balanced", "params"), {"recompute": True}),
    (SKIP, 3, AUTO, {}), (SKIP, 5, Partition("balanced", "params"), {}), (SKIP, 4, AUTO, {"trace": "export"}),
    (ODD, 2, AUTO, {}), (ODD, 2, Partition("markers"), {"trace": "export"}), (ODD, 3, Partition("balanced", "params"), {}),
]


@pytest.mark.parametrize(("model", "stages", "partition", "kw"), CASES)
def test_a_cost_only_cut_equals_the_full_cut(model, stages, partition, kw, monkeypatch):
    req = _req(model, stages=stages, partition=partition, **kw)
    tm = trace_request(req)
    full = cut_stage_graph(tm, req, placement=list(range(stages)))
    fast = _fast(tm, req, monkeypatch).place(list(range(stages)))
    for field in dataclasses.fields(full):
        if field.compare:
            assert getattr(fast, field.name) == getattr(full, field.name), field.name
    assert fast == full


def test_a_stage_taking_tokens_is_priced_as_the_cost_only_cut_prices_it_to_the_bit():
    from pipec.costs import costs
    from pipec.compiler.ir.plan import Cost

    flops = Cost(fwd=1.0, bwd=0.3, bwd_i=0.1, bwd_w=0.2)  # 0.1 + 0.2 is not 0.3 in floating point
    assert costs._no_input_grad(flops).bwd_w == 0.3  # the 13B tune's winner failed its cut's confirmation
    timed = Cost(fwd=1.0, bwd=0.3, bwd_i=0.125, bwd_w=0.25)  # costs profile timed the split: the run does not split it
    assert costs._no_input_grad(timed) == Cost(fwd=1.0, bwd=0.3, bwd_i=0.0, bwd_w=0.3)


def test_every_kind_of_crossing_on_random_cuts():
    """Random valid cuts of each model, compared part by part and cost by cost."""
    rng = random.Random(0)
    for model in (GPT, SKIP, ODD):
        req = _req(model, stages=2)
        tm = trace_request(req)
        valid = [i for i, ok in enumerate(tm.cuts.valid) if ok]
        for _ in range(12):
            positions = set(rng.sample(valid, rng.randint(1, min(4, len(valid)))))
            stage_of, s = {}, 0
            for i, n in enumerate(tm.cuts.nodes):
                s += i in positions
                stage_of[n.name] = s
            num = s + 1
            full = split_graph(tm.traced, stage_of, num)
            fast = cost_split(tm.table, stage_of, num)
            assert fast is not None and (fast.parts, fast.edges, fast.ties) == (full.parts, full.edges, full.ties)
            for recompute in (frozenset(), frozenset({0})):
                for source in ("unit", "flops"):
                    assert cut_costs(tm.table, fast, source, recompute=recompute, peak_flops=1e12) == stage_costs(
                        full, source, recompute=recompute, peak_flops=1e12)


def test_a_cut_the_full_path_refuses_is_declined():
    req = _req(ODD, stages=2)
    tm = trace_request(req)
    names = [n.name for n in tm.cuts.nodes]
    # everything in stage 0: stage 1 holds only the passthroughs of the model's outputs, on both paths
    alone = {n: 0 for n in names}
    assert cost_split(tm.table, alone, 2).parts == split_graph(tm.traced, alone, 2).parts
    refused = [
        ({n: 0 if i < 3 else 2 for i, n in enumerate(names)}, 3, "stage 1 is empty"),
            ({n: int(i > names.index("chunk")) for i, n in enumerate(names)}, 2, "crosses"),  # a tuple crosses
        (dict(list(alone.items())[1:]), 1, "in no stage"),
    ]
    for stage_of, num, match in refused:
        assert cost_split(tm.table, stage_of, num) is None
        with pytest.raises(FrontendError, match=match):
            split_graph(tm.traced, stage_of, num)


def test_profile_costs_take_the_full_cut(monkeypatch):
    req = _req(MLP, stages=2, costs="profile")
    tm = trace_request(req)
    called = []
    real = frontend.split_graph
    monkeypatch.setattr(frontend, "split_graph", lambda *a, **k: called.append(1) or real(*a, **k))
    cut_stage_graph(tm, req, host=Host(), runnable=False)
    assert called


@pytest.mark.parametrize("model", [GPT, SKIP, ODD])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_trace_annotated_again_at_another_shape_equals_a_new_trace(model, dtype):
    first = trace_request(_req(model, stages=2, microbatches=4, dtype=dtype))
    for mb in (1, 2):
        req = _req(model, stages=3, microbatches=mb, dtype=dtype)
        again, fresh = trace_request(req, like=first), trace_request(req)
        assert again.traced.gm is not first.traced.gm and again.traced.model is first.traced.model
        assert _annotations(again) == _annotations(fresh)
        assert (again.cuts.crossing_bytes, again.cuts.valid, again.cuts.unit_start) == (
            fresh.cuts.crossing_bytes, fresh.cuts.valid, fresh.cuts.unit_start)
        assert again.table is not None
        for stages, by in ((1, "flops"), (2, "memory"), (3, "flops"), (4, "params")):
            r = changed(req, num_stages=stages, partition=Partition("balanced", by))
            assert cut_stage_graph(again, r, runnable=False) == cut_stage_graph(fresh, r)
        assert _annotations(first) == _annotations(trace_request(_req(model, stages=2, microbatches=4, dtype=dtype)))


def test_an_export_trace_is_traced_again():
    first = trace_request(_req(GPT, stages=2, trace="export"))
    again = trace_request(_req(GPT, stages=2, microbatches=4, trace="export"), like=first)
    assert again.traced.model is not first.traced.model
    assert again.traced.gm.graph.find_nodes(op="placeholder")[0].meta["tensor_meta"].shape[0] == 1


def test_another_model_is_traced_again():
    first = trace_request(_req(MLP, stages=2))
    other = (MLP[0], dict(layers=3, dim=8), MLP[2])
    again = trace_request(_req(other, stages=2), like=first)
    assert again.traced.model is not first.traced.model and len(again.traced.param_of) != len(first.traced.param_of)


def _annotations(tm) -> list:
    """Every node's annotations; storages by their bytes (their keys are addresses, which the allocator
    reuses once a storage is freed: a stage's keys are all alive at its end, so only which of them are
    one storage matters, and the stage graphs compared above hold that)."""
    out = []
    for n in tm.traced.gm.graph.nodes:
        meta = {k: v for k, v in n.meta.items() if k not in ("pipec_saved", "pipec_storage", "stack_trace")}
        storage = n.meta.get("pipec_storage")
        out.append((n.op, n.name, str(n.target), repr(n.args), repr(n.kwargs), repr(sorted(meta.items())),
                    [b for _, b in n.meta.get("pipec_saved", ())], storage and storage[1]))
    return out


SMALL_TUNE = '''model "pipec.examples.gpt:build" (layers=4, dim=32, heads=2, vocab=64, seq=8)
input tokens: int64[8, 8]
schedule 1f1b
pp 2  dp 1  microbatches 2
dtype bfloat16
costs flops  peak_flops 1TFLOP/s
device_memory 1MB
'''


@pytest.mark.slow  # two whole tunes (~5 s)
def test_tune_gives_the_same_result_with_cost_only_cuts_and_without(tmp_path, monkeypatch):
    from pipec.tune import search as tune_mod
    from pipec.tune.space import TuneRequest
    from pipec.compiler.ir.plan_json import plan_to_json
    from pipec.dsl import load_spec

    path = tmp_path / "small.pipe"
    path.write_text(SMALL_TUNE)

    real = frontend.trace_request

    def run(fast: bool):
        """tune with cost-only cuts and traces annotated again, or with full cuts and a new trace per shape."""
        monkeypatch.setattr(tune_mod._Graphs, "cost_only", fast)
        calls = []

        def trace(req, like=None):
            calls.append(like)
            return real(req, like=like if fast else None)

        monkeypatch.setattr(frontend, "trace_request", trace)
        r = tune_mod.tune(TuneRequest(base=load_spec(str(path), {}).request, num_devices=4, num_top=6))
        rows = [(s.candidate, s.step_time, s.peak_memory, s.bubble, plan_to_json(s.plan))
                for s in (*r.top, *r.frontier, *([r.start_scored] if r.start_scored else []))]
        counts = (r.num_candidates, r.num_compiled, r.num_pruned, r.num_over_budget, r.num_unbuildable, r.num_traces,
                  r.num_cuts)
        return rows, counts, calls

    fast, fast_counts, fast_calls = run(True)
    full, full_counts, _ = run(False)
    assert fast_counts == full_counts and fast_counts[-2] > 1 and fast_counts[-1] > 2
    assert fast == full
    assert any(like is not None for like in fast_calls[1:])  # later shapes re-annotate the first trace


def _balance_one_j_at_a_time(weights, num_stages):
    """The balancer's recurrence one j at a time (what :func:`balance` vectorises), for comparison."""
    k = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    dp = [prefix[j] if j >= 1 else inf for j in range(k + 1)]
    choice = []
    for s in range(2, num_stages + 1):
        new, arg = [inf] * (k + 1), [0] * (k + 1)
        for j in range(s, k - (num_stages - s) + 1):
            lo, hi = s - 1, j - 1
            a, b = lo, hi
            while a < b:
                mid = (a + b) // 2
                if dp[mid] >= prefix[j] - prefix[mid]:
                    b = mid
                else:
                    a = mid + 1
            best, best_i = inf, lo
            for i in (a - 1, a):
                if lo <= i <= hi:
                    val = max(dp[i], prefix[j] - prefix[i])
                    if val < best:
                        best, best_i = val, i
            new[j], arg[j] = best, best_i
        dp = new
        choice.append(arg)
    starts, j = [], k
    for arg in reversed(choice):
        j = arg[j]
        starts.append(j)
    return sorted(starts), dp[k]


def test_the_vectorised_balancer_gives_the_same_cuts_bit_for_bit():
    from pipec.model.partition import balance

    rng = random.Random(1)
    for _ in range(300):
        n = rng.randint(1, 60)
        kind = rng.choice(("ties", "large", "small"))
        weights = [float(rng.choice([0, 1, 2, 4])) if kind == "ties" else
                   float(rng.randint(0, 10**17)) if kind == "large" else rng.random() for _ in range(n)]
        stages = rng.randint(1, n)
        assert balance(weights, stages) == _balance_one_j_at_a_time(weights, stages)


@pytest.mark.slow  # tune's whole space under costs profile: every cut timed in a crowd (~50 s on 2 cores)
@pytest.mark.timeout(600)
def test_tune_with_profile_costs_confirms_no_cut_it_made_the_full_way(tmp_path, monkeypatch):
    """A profile cut is timed, so cutting it again would not repeat its costs: tune's winner is confirmed only
    where its cut was cost-only, and a search with ``costs profile`` runs to its end."""
    from pipec.tune.search import tune
    from pipec.tune.space import TuneRequest
    from pipec.dsl import load_spec

    req = _req(MLP, stages=2, costs="profile")
    tm = trace_request(req)
    graph = cut_stage_graph(tm, req, host=Host(), runnable=False)
    recut = []
    real = frontend.cut_stage_graph
    monkeypatch.setattr(frontend, "cut_stage_graph", lambda *a, **k: recut.append(1) or real(*a, **k))
    frontend.confirm_cut(tm, req, graph)
    assert not recut
    path = tmp_path / "mlp.pipe"
    path.write_text('model "pipec.examples.mlp:build" (layers=4, dim=8)\ninput x: float32[4, 8]\n'
                    "schedule 1f1b\npp 2  dp 1  microbatches 2\ncosts profile\n")
    got = tune(TuneRequest(base=load_spec(str(path), {}).request, num_devices=2, num_top=2))
    assert got.best.plan.model["profile"]["concurrent_ranks"] == 2
