"""The saved activations a rank holds, measured: what the prediction's ``peak_activation_bytes`` counts.

The compiler counts, per stage and microbatch, the storages autograd saves for
the backward while the stage's forward runs (parameters left out) and the
stage's outputs (model/annotate.py, ``stage_activation_bytes``),
held from the microbatch's ``FWD`` to its last backward part (``BWD``, or the
``BWD_W`` of a split one). :class:`SavedBytes` counts the same storages as
the executor runs a step's forwards (a ``saved_tensors_hooks`` pack hook that
records each storage once and keeps the tensor as it is), adds and releases
them at the same instructions, and keeps the most held at once. The model's
inputs are the one exception: a microbatch of them is a slice of the step's
batch (one storage for all microbatches), and counts as the slice, as the
trace's microbatch-sized input does. The executor counts one step (its first:
the sizes are the same in every step), so the steps after it run without the
hook.

A stage under ``recompute`` saves nothing in its forward (it runs without a
graph); it holds its inputs for the replay, and those and its outputs are
what it counts. The loss the last stage computes is outside the stage, on
both sides.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Mapping

import torch

from pipec.model.tensors import storage_key

__all__ = ["SavedBytes"]


class SavedBytes:
    """Bytes of the activations saved per (stage, microbatch), the running total held, and its peak."""

    def __init__(self, params: Iterable[torch.Tensor], inputs: Iterable[torch.Tensor] = ()) -> None:
        self.param_keys = {storage_key(p) for p in params}
        self.input_keys = {storage_key(t) for t in inputs}
        """The storages of the step's batch: a microbatch's slice of one counts its own bytes."""
        self.held_by: dict[tuple[int, int], int] = {}
        """(stage, microbatch) -> the bytes it holds, from its forward to its last backward part."""
        self.held = 0
        self.peak = 0
        self._storages: dict = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._note(t)
        return t

    def _note(self, t: torch.Tensor) -> None:
        if isinstance(t, torch.nn.Parameter):
            return
        key = storage_key(t)
        if key in self.input_keys:
            self._storages[(key, t.storage_offset(), t.numel())] = t.numel() * t.element_size()
        elif key not in self.param_keys:
            self._storages[key] = t.untyped_storage().nbytes()

    @contextlib.contextmanager
    def forward(self, stage: int, microbatch: int) -> Iterator[None]:
        """Count what autograd saves inside the block (the stage's forward on one microbatch)."""
        self._storages = {}
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    def hold(self, stage: int, microbatch: int, kept: Mapping[str, torch.Tensor] | Iterable[torch.Tensor] = ()) -> None:
        """The forward of (stage, microbatch) is done: what it saved, and ``kept`` (its outputs; a recomputed
        stage's inputs too), are held from now on."""
        for t in kept.values() if isinstance(kept, Mapping) else kept:
            if isinstance(t, torch.Tensor):
                self._note(t)
        n = sum(self._storages.values())
        self._storages = {}
        self.held_by[(stage, microbatch)] = n
        self.held += n
        self.peak = max(self.peak, self.held)

    def release(self, stage: int, microbatch: int) -> None:
        """(stage, microbatch)'s last backward part ran: what it held is free."""
        self.held -= self.held_by.pop((stage, microbatch), 0)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
