"""Partitioning: the balancer against brute force, split points, markers, impossible cuts, routing."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from pipec.costs.costs import node_weights
from pipec.compiler.frontend import FrontendError, Partition, TensorSpec, build_stage_graph
from pipec.model.partition import analyse_cuts, assign_stages, balance, split_graph
from pipec.runtime.stages import build_reference, build_stages, run_stages
from pipec.model.annotate import propagate
from pipec.model.load import instantiate
from pipec.model.tensors import example_inputs
from pipec.model.trace import pipe_split, trace_model
from test_frontend import plan_of
from model_requests import model_request

GPT = "pipec.examples.gpt:build"


def traced_model(target, kwargs, inputs, mode="auto"):
    model, _ = instantiate(target, kwargs, mode="meta")
    example = example_inputs(inputs)
    traced = trace_model(model, inputs, example, mode=mode)
    propagate(traced, example)
    return traced


def brute_force(weights, valid, num_stages):
    """The smallest possible slowest stage over every choice of valid cuts."""
    positions = [i for i, ok in enumerate(valid) if ok]
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    best = float("inf")
    for cuts in itertools.combinations(positions, num_stages - 1):
        bounds = (0, *cuts, len(weights))
        best = min(best, max(prefix[b] - prefix[a] for a, b in zip(bounds, bounds[1:])))
    return best


# ----------------------------------------------------------------------------- the balancer


def test_balance_is_exact_on_random_weights():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        weights = [rng.choice([0.0, rng.random() * 10, float(rng.randint(0, 5))]) for _ in range(n)]
        stages = rng.randint(1, n)
        starts, worst = balance(weights, stages)
        assert len(starts) == stages - 1 and all(a < b for a, b in zip([0, *starts], [*starts, n]))
        bounds = [0, *starts, n]
        assert max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])) == pytest.approx(worst)
        assert worst == pytest.approx(brute_force(weights, [i > 0 for i in range(n)], stages))


@pytest.mark.parametrize(
    ("target", "kwargs", "inputs", "by", "stages"),
    [
        (GPT, dict(layers=3, dim=16, heads=2, vocab=32, seq=8), (TensorSpec("tokens", "int64", (2, 8)),), "flops", 3),
        (GPT, dict(layers=3, dim=16, heads=2, vocab=32, seq=8), (TensorSpec("tokens", "int64", (2, 8)),), "params", 2),
        (GPT, dict(layers=2, dim=16, heads=2, vocab=32, seq=8), (TensorSpec("tokens", "int64", (2, 8)),), "memory", 3),
        ("pipec.examples.mlp:build", dict(layers=5, dim=8), (TensorSpec("x", "float32", (4, 8)),), "flops", 4),
        ("pipec.examples.skip:build", dict(layers=6, dim=8, skip_from=0, skip_to=4), (TensorSpec("x", "float32", (4, 8)),), "params", 3),
    ],
)
def test_balancer_is_within_10_percent_of_brute_force(target, kwargs, inputs, by, stages):
    traced = traced_model(target, kwargs, inputs)
    cuts = analyse_cuts(traced)
    weights = node_weights(traced, cuts, by)
    stage_of = assign_stages(traced, cuts, Partition("balanced", by), stages, weights)
    assert sorted(set(stage_of.values())) == list(range(stages))
    order = [stage_of[n.name] for n in cuts.nodes]
    assert order == sorted(order)  # contiguous
    slowest = max(sum(w for n, w in zip(cuts.nodes, weights) if stage_of[n.name] == s) for s in range(stages))
    assert slowest <= 1.10 * brute_force(weights, cuts.valid, stages)


def test_balancer_prefers_cuts_between_layers():
    sg = build_stage_graph(model_request(
        target=GPT, kwargs=dict(layers=4, dim=32, heads=2, vocab=64, seq=16), inputs=(TensorSpec("tokens", "int64", (4, 16)),),
        num_microbatches=2, num_stages=2, costs="unit", partition=Partition("balanced", "params")))
    # one tensor, the residual stream, crosses between two blocks
    assert [t.shape for t in sg.edges[0].tensors] == [(2, 16, 32)]


# ----------------------------------------------------------------------------- split points and markers


def test_split_before_module_paths():
    traced = traced_model(GPT, dict(layers=4, dim=16, heads=2, vocab=32, seq=8), (TensorSpec("tokens", "int64", (2, 8)),))
    cuts = analyse_cuts(traced)
    stage_of = assign_stages(traced, cuts, Partition("split", split_before=("blocks.2",)), 2)
    first_of_1 = next(n for n in cuts.nodes if stage_of[n.name] == 1)
    assert first_of_1.name == "blocks_2_ln1"
    assert all(stage_of[n] == 0 for n in ("wte", "blocks_1_mlp_proj")) and stage_of["lm_head"] == 1
    split = split_graph(traced, stage_of, 2)
    assert split.parts[0].params[:2] == ("wte.weight", "wpe.weight")
    assert "blocks.2.attn.qkv.weight" in split.parts[1].params
    assert [s.name for s in split.parts[1].outputs] == ["lm_head"]


def test_split_point_errors_name_the_problem():
    traced = traced_model(GPT, dict(layers=2, dim=16, heads=2, vocab=32, seq=8), (TensorSpec("tokens", "int64", (2, 8)),))
    cuts = analyse_cuts(traced)
    with pytest.raises(FrontendError, match=r"'block.1'.*did you mean blocks.1"):
        assign_stages(traced, cuts, Partition("split", split_before=("block.1",)), 2)
    with pytest.raises(FrontendError, match=r"'layers.1'.*did you mean blocks.1\? \(the model's layers are "
                                            r"blocks.0 .. blocks.1\)") as err:
        assign_stages(traced, cuts, Partition("split", split_before=("blocks.1", "layers.1")), 3)
    assert (err.value.key, err.value.index) == ("partition", 1)  # the second split point
    with pytest.raises(FrontendError, match="gives 2 stages but stages is 4; list 3 split points or set stages 2"):
        assign_stages(traced, cuts, Partition("split", split_before=("blocks.1",)), 4)
    with pytest.raises(FrontendError, match="gives 3 stages but stages is 2; list 1 split point or set stages 3"):
        assign_stages(traced, cuts, Partition("split", split_before=("blocks.0", "blocks.1")), 2)
    mlp = traced_model("pipec.examples.mlp:build", dict(layers=2, dim=8), X)
    with pytest.raises(FrontendError, match="leaves stage 0 empty"):
        assign_stages(mlp, analyse_cuts(mlp), Partition("split", split_before=("blocks.0",)), 2)
    with pytest.raises(FrontendError, match="in model order"):
        assign_stages(traced, cuts, Partition("split", split_before=("blocks.1", "blocks.0")), 3)


class _Linears(nn.Module):
    """A model of square Linear layers, ``LAYERS`` (name, features) in that order; each says what it computes."""

    LAYERS: tuple[tuple[str, int], ...] = ()

    def __init__(self) -> None:
        super().__init__()
        for name, features in self.LAYERS:
            self.add_module(name, nn.Linear(features, features))


class Chunked(_Linears):
    """``chunk`` returns a tuple; its second half is read after ``post`` runs."""

    LAYERS = (("pre", 8), ("post", 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.pre(x).chunk(2, dim=-1)
        return self.post(parts[0]) + parts[1]


class Shapes(_Linears):
    """``B, D = x.shape`` is read in the first stage and used in the second."""

    LAYERS = (("a", 8), ("b", 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, D = x.shape
        h = self.a(x)
        h = self.b(h)
        return h.reshape(B, 2, D // 2) + x.reshape(B, 2, D // 2)


class Marked(_Linears):
    """Three layers with a ``pipe_split()`` marker after each of the first two."""

    LAYERS = (("a", 8), ("b", 8), ("c", 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        pipe_split()
        x = self.b(x)
        pipe_split()
        return self.c(x)


X = (TensorSpec("x", "float32", (4, 8)),)


def test_a_tuple_crossing_a_cut_is_refused_naming_the_node():
    traced = traced_model("test_partition:Chunked", {}, X)
    cuts = analyse_cuts(traced)
    with pytest.raises(FrontendError, match=r"cannot split before 'post': node 'chunk' \(tuple of tensors\)"):
        assign_stages(traced, cuts, Partition("split", split_before=("post",)), 2)
    # the balancer avoids it
    stage_of = assign_stages(traced, cuts, Partition("balanced", "flops"), 2, node_weights(traced, cuts, "flops"))
    assert stage_of["chunk"] == stage_of["getitem_1"]


def test_python_values_crossing_a_cut_are_folded_and_inputs_routed_through_stage_0():
    sg = build_stage_graph(model_request(target="test_partition:Shapes", inputs=(TensorSpec("x", "float32", (8, 8)),),
                                         num_microbatches=2, num_stages=2, costs="unit",
                                         partition=Partition("split", split_before=("b",))))
    # B and D are constants in stage 1; x reaches stage 1 from stage 0
    names = [t.name for t in sg.edges[0].tensors]
    assert names == ["a", "x_to_stages"]
    assert all(st.inputs for st in sg.stages)
    plan = plan_of(sg)
    stages = build_stages(plan, [0, 1], seed=0)
    x = torch.randn(4, 8)
    torch.testing.assert_close(run_stages(stages, {"x": x})[0], build_reference(plan, seed=0)(x)[0])


def test_pipe_split_markers_partition_the_model():
    for mode in ("fx", "export"):
        sg = build_stage_graph(model_request(target="test_partition:Marked", inputs=X, num_microbatches=1, num_stages=3,
                                             costs="unit", trace=mode))
        assert sg.model["trace"] == mode
        assert [st.params for st in sg.stages] == [("a.weight", "a.bias"), ("b.weight", "b.bias"), ("c.weight", "c.bias")]
    with pytest.raises(FrontendError, match="2 pipe_split markers gives 3 stages but stages is 2"):
        build_stage_graph(model_request(target="test_partition:Marked", inputs=X, num_microbatches=1, num_stages=2,
                                        costs="unit", partition=Partition("markers")))
    with pytest.raises(FrontendError, match="has none"):
        build_stage_graph(model_request(target="test_partition:Shapes", inputs=X, num_microbatches=1, num_stages=2,
                                        costs="unit", partition=Partition("markers")))


def test_too_many_stages_is_refused():
    with pytest.raises(FrontendError, match="at most"):
        build_stage_graph(model_request(target="test_partition:Marked", inputs=X, num_microbatches=1, num_stages=40,
                                        costs="unit", partition=Partition("balanced", "flops")))


def test_balance_by_measured_time():
    sg = build_stage_graph(model_request(
        target="pipec.examples.mlp:build", kwargs=dict(layers=6, dim=32), inputs=(TensorSpec("x", "float32", (8, 32)),),
        num_microbatches=1, num_stages=3, costs="unit", partition=Partition("balanced", "time")))
    assert [len(st.nodes) for st in sg.stages] and all(st.params for st in sg.stages)
    held = [p for st in sg.stages for p in st.params]
    assert held == sorted(set(held), key=held.index) and len(held) == 6 * 4 + 2  # each parameter in one stage


def test_one_split_point_is_worded_in_the_singular():
    from pipec.dsl import DSLError, load_spec

    flags = {"model": GPT, "input": "tokens: int64[8, 8]", "pp": "3", "partition": "split before blocks.1"}
    with pytest.raises(DSLError, match=r"error: 1 split point makes 2 stages, but there are 3") as err:
        load_spec(None, flags)
    assert "give 2 split points" in str(err.value)
    with pytest.raises(DSLError, match=r"error: 2 split points make 3 stages, but there are 2") as err:
        load_spec(None, {**flags, "pp": "2", "partition": "split before blocks.1, blocks.2"})
    assert "give 1 split point\n" in str(err.value) + "\n"
