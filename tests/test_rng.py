"""The random streams a recomputed forward replays (runtime/executor.py: rng_snapshot, replaying).

A recomputed stage runs its forward twice: once without a graph in the forward's slot, once in the backward's,
other microbatches' forwards drawing from the same generators in between. The replay must draw the masks the
first run drew, on the CPU's generator and on the device's own (CUDA dropout draws there), and leave the
generators as they were, so the run's later draws are the ones a run without recompute makes.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from pipec.runtime import executor
from pipec.runtime.executor import replaying, rng_snapshot


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
    assert snap[1].tolist() == [1, 2, 3] and calls == [("get", "cuda:1")]
    Fake.state = torch.tensor([9], dtype=torch.uint8)  # the device drew on
    with replaying(device, snap):
        pass
    assert calls[-1] == ("set", "cuda:1", [1, 2, 3])
    assert forks == [{"devices": [1], "device_type": "cuda"}]  # the device's generator forked, so restored after
    assert executor.rng_snapshot(torch.device("cpu"))[1] is None
