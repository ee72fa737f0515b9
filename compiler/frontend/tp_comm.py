"""The collectives a tensor-parallel stage runs: Megatron's f and g, as autograd Functions and graph modules.

- ``f`` (:class:`CopyToTP`): identity forward, all-reduce of the gradient backward. It stands before the shared
  input of each colwise group, so the input's gradient (a partial sum on every rank) is summed.
- ``g`` (:class:`ReduceFromTP`): all-reduce forward (a rowwise output is a partial sum), identity backward.

Both call a *group*: any object with ``all_reduce(tensor) -> tensor`` (the sum over the tp ranks, a new tensor).
:class:`ProcessGroupTP` wraps a ``torch.distributed`` process group; :class:`ThreadGroupTP` runs the tp ranks as
threads of one process (tests, one-process checks). :class:`TPComm` is the ``call_module`` the sharding pass
inserts: with no group set it is the identity, so a stage's local shapes run (and profile) in one process.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch
from torch import nn

__all__ = ["TPGroup", "ProcessGroupTP", "ThreadGroupTP", "CopyToTP", "ReduceFromTP", "TPComm", "set_group"]


class TPGroup(Protocol):
    """What f and g call: the sum of ``tensor`` over the tp ranks, as a new tensor."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...


class ProcessGroupTP:
    """A ``torch.distributed`` process group (the stage's tp ranks) as a :class:`TPGroup`."""

    def __init__(self, group: Any = None) -> None:
        self.group = group

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        out = tensor.contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out


class ThreadGroupTP:
    """``size`` tp ranks as threads of one process: :meth:`rank` gives rank ``r``'s :class:`TPGroup`.

    Every rank must call the same collectives in the same order (as processes would); each gets the same sum,
    added in rank order, so the ranks' results are bitwise equal."""

    def __init__(self, size: int, *, timeout: float = 60.0) -> None:
        self.size = size
        self._slots: list[torch.Tensor | None] = [None] * size
        self._barrier = threading.Barrier(size, timeout=timeout)

    def rank(self, r: int) -> "_ThreadRank":
        assert 0 <= r < self.size, (r, self.size)
        return _ThreadRank(self, r)

    def _all_reduce(self, r: int, tensor: torch.Tensor) -> torch.Tensor:
        self._slots[r] = tensor.detach()
        self._barrier.wait()
        total = self._slots[0].clone()
        for t in self._slots[1:]:
            total = total + t
        self._barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return total


class _ThreadRank:
    def __init__(self, owner: ThreadGroupTP, r: int) -> None:
        self.owner, self.r = owner, r

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.owner._all_reduce(self.r, tensor)


class CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward; the gradient all-reduced backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.group.all_reduce(grad), None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's g: the partial sums all-reduced forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup) -> torch.Tensor:
        return group.all_reduce(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class TPComm(nn.Module):
    """One kind of collective in a sharded stage's graph: ``"copy"`` (f) or ``"reduce"`` (g).

    ``group`` is set when the stage is built for its rank (:func:`set_group`); while it is None the module is
    the identity (the local shapes of one rank, run in one process)."""

    KINDS = ("copy", "reduce")

    def __init__(self, kind: str) -> None:
        super().__init__()
        assert kind in self.KINDS, kind
        self.kind = kind
        self.group: TPGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return x
        return (CopyToTP if self.kind == "copy" else ReduceFromTP).apply(x, self.group)

    def extra_repr(self) -> str:
        return self.kind


def set_group(module: nn.Module, group: TPGroup | None) -> None:
    """Point every :class:`TPComm` in ``module`` at ``group`` (None: identities again)."""
    for sub in module.modules():
        if isinstance(sub, TPComm):
            sub.group = group
