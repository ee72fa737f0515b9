"""The random streams: a recomputed forward's replay (runtime/executor.py: rng_snapshot, replaying), and the tp
ranks' own stream for the random ops of a sharded region (pipec/tp/rng.py, Megatron's two streams).

A recomputed stage runs its forward twice: once without a graph in the forward's slot, once in the backward's,
other microbatches' forwards drawing from the same generators in between. The replay must draw the masks the
first run drew, on the CPU's generator and on the device's own (CUDA dropout draws there), and leave the
generators as they were, so the run's later draws are the ones a run without recompute makes.

Under tp the tp ranks of one (pp, dp) draw the same shared stream, so that a replicated region computes the same
values on each; a dropout on a shard (the attention probabilities of this rank's heads, the MLP's hidden part,
under sequence parallelism this rank's positions) draws from the stage's tp stream on that rank instead, which
the replay and the checkpoint keep too. In-process, each tp rank's part run alone (its collectives identities,
as one process of a tp group would run with the shared stream seeded alike): tests/rng_models.py's GPT.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.fx import Interpreter

from pipec.compiler.frontend import Partition, TensorSpec, build_stage_graph
from pipec.runtime import executor
from pipec.runtime.executor import replaying, rng_snapshot
from pipec.runtime.stages import build_stages
from pipec.tp import plan_stages, shard_stage
from pipec.tp.rng import TPStream, stream_of
from model_requests import model_request
from test_frontend import plan_of


def _layer() -> nn.Module:
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True)  # dropout 0.1


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_recomputed_forward_with_dropout_gives_the_gradients_of_the_stored_one():
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    stored, again = _layer(), _layer()
    torch.manual_seed(7)
    stored(x).square().sum().backward()
    torch.manual_seed(7)
    snap = rng_snapshot(torch.device("cpu"))
    with torch.no_grad():
        again(x)                                     # the forward's slot: no graph kept
    torch.rand(100)                                  # other microbatches draw in between
    after = torch.get_rng_state()
    with replaying(torch.device("cpu"), snap):
        again(x).square().sum().backward()           # the backward's slot: the forward replayed
    assert torch.equal(torch.get_rng_state(), after)  # the generators are as they were before the replay
    for name, g in _grads(stored).items():
        assert torch.equal(g, _grads(again)[name]), name


def test_the_device_generator_is_kept_and_restored_as_well(monkeypatch):
    """On an accelerator the snapshot holds the device's generator too, and the replay sets it (a fake device
    module: this machine has no GPU)."""
    calls = []

    class Fake:
        state = torch.tensor([1, 2, 3], dtype=torch.uint8)

        @staticmethod
        def get_rng_state(device):
            calls.append(("get", str(device)))
            return Fake.state.clone()

        @staticmethod
        def set_rng_state(state, device):
            calls.append(("set", str(device), state.tolist()))

        @staticmethod
        def current_device():
            return 0

    forks = []
    monkeypatch.setattr(torch, "get_device_module", lambda kind: Fake)
    monkeypatch.setattr(torch.random, "fork_rng", lambda **kw: forks.append(kw) or contextlib.nullcontext())
    device = torch.device("cuda", 1)
    snap = rng_snapshot(device)
    assert snap[1].tolist() == [1, 2, 3] and calls == [("get", "cuda:1")] and snap[2] == ()
    Fake.state = torch.tensor([9], dtype=torch.uint8)  # the device drew on
    with replaying(device, snap):
        pass
    assert calls[-1] == ("set", "cuda:1", [1, 2, 3])
    assert forks == [{"devices": [1], "device_type": "cuda"}]  # the device's generator forked, so restored after
    assert executor.rng_snapshot(torch.device("cpu"))[1] is None



# ----------------------------------------------------------------------------- the tp stream

TOKENS = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(0))
SHARDED = ("attn_drop", "dropout")
"""tests/rng_models.py's dropouts on shards at tp 2: the attention probabilities (heads), the MLP's hidden units."""
REPLICATED = ("drop", "resid1", "resid2")
"""Its dropouts on replicated values; under sequence parallelism the residuals' act on this rank's positions (the
embeddings' stay whole: a vocabulary of 65 keeps the embedding replicated, and the region starts at a rowwise)."""
RESIDUALS = ("resid1", "resid2")


@pytest.fixture(scope="module")
def stage():
    req = model_request(target="rng_models:build", inputs=(TensorSpec("tokens", "int64", (2, 16)),),
                        num_stages=1, costs="unit", partition=Partition("auto"))
    return build_stages(plan_of(build_stage_graph(req)), [0], seed=3)[0]


class _Values(Interpreter):
    """Every node's value of one run, by node name."""

    def run_node(self, n):
        out = super().run_node(n)
        self.values[n.name] = out
        return out


def _tp_run(stage, sequence_parallel: bool) -> tuple[list[dict], list]:
    """Each tp rank's part of ``stage`` at tp 2, run alone from the same shared stream: its values by node name,
    and the parts."""
    plan = plan_stages([stage], 2, sequence_parallel=sequence_parallel)[0]
    parts, runs = [shard_stage(stage, plan, r, tp=2) for r in range(2)], []
    for part in parts:
        torch.manual_seed(5)  # the tp ranks' shared stream, seeded alike (runtime/checkpoint.py)
        it = _Values(part)
        it.values = {}
        it.run(TOKENS)
        runs.append(it.values)
    return runs, parts


def _dropped(runs: list[dict], part, name: str) -> list[torch.Tensor]:
    """Where dropout node ``name`` zeroed a nonzero input, on each tp rank."""
    node = next(n for n in part.graph.nodes if n.name == name)
    x = node.args[1] if node.target == "tp_rng" else node.args[0]
    return [(v[name] == 0) & (v[x.name] != 0) for v in runs]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_dropout_on_a_shard_draws_its_own_mask_on_each_tp_rank_a_replicated_one_the_shared_mask(
        stage, sequence_parallel):
    runs, parts = _tp_run(stage, sequence_parallel)
    # under sequence parallelism the dropouts after the rowwise outputs act on this rank's positions: t and
    # t + T/2 must not drop alike either
    on_shards = SHARDED + (RESIDUALS if sequence_parallel else ())
    for part in parts:
        assert {n.name for n in part.graph.nodes if n.target == "tp_rng"} == set(on_shards)
    for name in SHARDED + REPLICATED:
        a, b = _dropped(runs, parts[0], name)
        rate = (a.sum() / a.numel()).item()
        assert a.shape == b.shape and 0.2 < rate < 0.6, (name, rate)  # p = 0.5 of the nonzero inputs
        if name in on_shards:
            assert not torch.equal(a, b), f"{name}: tp ranks 0 and 1 dropped the same positions"
        else:  # the shared stream: the same mask on both ranks (after a rowwise output of a rank run alone,
            assert torch.equal(a, b), name  # whose g is an identity, the values differ)
    assert torch.equal(runs[0]["drop"], runs[1]["drop"])  # before any shard: the same values


def test_a_recomputed_tp_stage_with_dropout_gives_the_stored_forwards_gradients(stage):
    """The replay sets the tp stream back too: without it the sharded dropouts would draw new masks."""
    plan = plan_stages([stage], 2)[0]
    other = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(1))
    for r in range(2):
        stored, again = shard_stage(stage, plan, r, tp=2), shard_stage(stage, plan, r, tp=2)
        torch.manual_seed(7)
        stored(TOKENS)[0].square().sum().backward()
        torch.manual_seed(7)
        stream = stream_of(again)
        snap = rng_snapshot(torch.device("cpu"), [stream])
        with torch.no_grad():
            again(TOKENS)                        # the forward's slot: no graph kept
            again(other)                         # another microbatch draws from both streams in between
        after, after_tp = torch.get_rng_state(), stream.state()["cpu"]
        with replaying(torch.device("cpu"), snap):
            again(TOKENS)[0].square().sum().backward()  # the backward's slot: the forward replayed
        assert torch.equal(torch.get_rng_state(), after) and torch.equal(stream.state()["cpu"], after_tp)
        grads = {n: p.grad for n, p in again.named_parameters()}
        for name, p in stored.named_parameters():
            assert torch.equal(p.grad, grads[name]), (r, name)


def test_a_tp_stream_keeps_its_own_state_and_leaves_the_shared_one_alone():
    stream = TPStream(torch.device("cpu"), seed=11)
    stream.add(nn.Dropout(0.5))
    x = torch.ones(1000)
    torch.manual_seed(0)
    shared = torch.get_rng_state()
    first = stream(0, x)
    assert torch.equal(torch.get_rng_state(), shared)  # the shared stream did not move
    second = stream(0, x)
    assert not torch.equal(first, second)  # the tp stream did
    saved = stream.state()
    third = stream(0, x)
    stream.set_state(saved)
    assert torch.equal(stream(0, x), third)  # its state round trip
    stream.seed(11)
    assert torch.equal(stream(0, x), first)  # seeding it starts it afresh
    torch.manual_seed(11)
    assert torch.equal(nn.functional.dropout(x, 0.5), first)  # as torch.manual_seed(seed) would
    stream.eval()
    assert torch.equal(stream(0, x), x)  # its dropouts are its children: eval() reaches them
