"""The tp ranks' own random stream: the random ops of a stage's sharded region draw from it, the rest from the
shared one (Megatron's two streams, its ``CudaRNGStatesTracker.fork()``).

The tp ranks of one (pp, dp) coordinate draw the same shared stream (torch's default generators, seeded alike:
runtime/checkpoint.py), so a replicated region computes the same values on each. A dropout on a shard (the
attention probabilities of this rank's heads, an MLP's hidden part; under sequence parallelism this rank's
positions) must draw a mask of its own: with the shared stream, heads h and h + H/tp would drop alike. The
rewrite (:func:`wrap_random`) sends each random node whose input or output is sharded through the stage's
:class:`TPStream`, which runs it with this stage's and tp rank's generator states swapped into torch's
default generators (the CPU's and the stage's device's) and keeps what it leaves there for the next draw, so
the shared stream is untouched by it. The stream's states are read and set by the runtime: its seed
(runtime/checkpoint.py: from (seed, global rank, stage, step)), the checkpoint and a recompute's replay
(runtime/executor.py's ``rng_snapshot``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import threading
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import Graph, GraphModule, Node

__all__ = ["TPStream", "stream_of", "is_random", "wrap_random", "derived_seed"]

_aten = torch.ops.aten

_LOCK = threading.RLock()
"""Held while a stream's states are in the default generators: the fake transport runs the ranks as threads of
one process, which share those generators."""


def derived_seed(*parts: Any) -> int:
    """A 63-bit seed from ``parts`` (joined as text), the same in every process."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class TPStream(nn.Module):
    """One stage's random stream on one tp rank, and the random ops that draw from it: ``forward(i, *args)``
    runs op ``i`` (a function, or a child module: a Dropout, so ``train()``/``eval()`` reach it) with the
    stream's states in the default generators. The states are plain attributes, not buffers: they stay out
    of the stage's state dict (the checkpoint keeps them under ``rng``) and on the CPU when the stage moves."""

    def __init__(self, device: torch.device, seed: int) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.ops: list[Callable[..., Any]] = []
        self.cpu: torch.Tensor = torch.empty(0, dtype=torch.uint8)
        self.dev: torch.Tensor | None = None
        self.seed(seed)

    def add(self, op: Callable[..., Any]) -> int:
        """Register ``op`` (a module becomes a child ``op<i>``); its index for ``forward``."""
        if isinstance(op, nn.Module):
            self.add_module(f"op{len(self.ops)}", op)
        self.ops.append(op)
        return len(self.ops) - 1

    def seed(self, seed: int) -> None:
        """Start the stream afresh from ``seed`` (as ``torch.manual_seed`` would the default generators)."""
        self.cpu = torch.Generator().manual_seed(seed).get_state()
        self.dev = (None if self.device.type == "cpu"
                    else torch.Generator(device=self.device).manual_seed(seed).get_state())

    def state(self) -> dict[str, torch.Tensor]:
        """The stream's states (copies): ``cpu``, and ``device`` where the stage has one."""
        out = {"cpu": self.cpu.clone()}
        if self.dev is not None:
            out["device"] = self.dev.clone()
        return out

    def set_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Set the states :meth:`state` gave."""
        self.cpu = state["cpu"].clone()
        if self.dev is not None:
            self.dev = state["device"].clone()

    @contextlib.contextmanager
    def drawing(self) -> Iterator[None]:
        """Within the block the default generators hold this stream's states; afterwards the shared ones again,
        and the stream keeps how far the block advanced it."""
        module = None if self.dev is None else torch.get_device_module(self.device.type)
        with _LOCK:
            shared_cpu = torch.get_rng_state()
            shared_dev = None if module is None else module.get_rng_state(self.device)
            torch.set_rng_state(self.cpu)
            if module is not None:
                module.set_rng_state(self.dev, self.device)
            try:
                yield
            finally:
                self.cpu = torch.get_rng_state()
                torch.set_rng_state(shared_cpu)
                if module is not None:
                    self.dev = module.get_rng_state(self.device)
                    module.set_rng_state(shared_dev, self.device)

    def forward(self, i: int, *args: Any, **kwargs: Any) -> Any:
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if x is not None and (x.device.type == "meta" or isinstance(x, torch._subclasses.FakeTensor)):
            return self.ops[i](*args, **kwargs)  # shapes alone (the rewrite's proof): nothing is drawn
        with self.drawing():
            return self.ops[i](*args, **kwargs)


def stream_of(module: nn.Module) -> TPStream | None:
    """The stage's :class:`TPStream` (None: nothing of it draws on a shard)."""
    return next((m for m in module.modules() if isinstance(m, TPStream)), None)


_DROPOUT_FUNCTIONS = {F.dropout: 1, F.dropout1d: 1, F.dropout2d: 1, F.dropout3d: 1, F.alpha_dropout: 1,
                      F.feature_alpha_dropout: 1, torch.dropout: 1, torch.alpha_dropout: 1, torch.feature_dropout: 1,
                      torch.feature_alpha_dropout: 1, F.scaled_dot_product_attention: 4,
                      _aten.scaled_dot_product_attention.default: 4,
                      _aten._scaled_dot_product_flash_attention_for_cpu.default: 3}
"""Random ops that draw only with a nonzero ``p`` / ``dropout_p``: the position of that argument."""
_P_NAMES = ("p", "dropout_p")
_RANDOM_FUNCTIONS = {torch.bernoulli, torch.rand_like, torch.randn_like, torch.randint_like, torch.rrelu, F.rrelu,
                     torch.normal, torch.poisson, torch.multinomial}
"""Python-level functions that draw (an aten op says so itself: its ``nondeterministic_seeded`` tag)."""
_RANDOM_METHODS = {"bernoulli", "bernoulli_", "uniform_", "normal_", "exponential_", "random_", "geometric_",
                   "cauchy_", "log_normal_", "multinomial", "rrelu"}
_RANDOM_MODULES = (nn.modules.dropout._DropoutNd, nn.RReLU)


def _p(n: Node) -> Any:
    at = _DROPOUT_FUNCTIONS[n.target]
    if len(n.args) > at:
        return n.args[at]
    return next((n.kwargs[k] for k in _P_NAMES if k in n.kwargs), 0.0 if at > 2 else 0.5)


def is_random(gm: GraphModule, n: Node) -> bool:
    """Whether node ``n`` of ``gm`` draws from the default generators (a dropout or attention whose ``p`` is a
    constant 0 does not)."""
    if n.op == "call_module":
        mod = gm.get_submodule(str(n.target))
        return isinstance(mod, _RANDOM_MODULES) and not (isinstance(mod, nn.modules.dropout._DropoutNd) and mod.p == 0)
    if n.op == "call_method":
        return str(n.target) in _RANDOM_METHODS
    if n.op != "call_function":
        return False
    if n.target in _DROPOUT_FUNCTIONS:
        p = _p(n)
        return isinstance(p, Node) or float(p) != 0
    if isinstance(n.target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in n.target.tags
    return n.target in _RANDOM_FUNCTIONS


def _method(name: str, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    return getattr(x, name)(*args, **kwargs)


def wrap_random(graph: Graph, nodes: list[Node], resolve: Callable[[str], nn.Module], stream: TPStream,
                target: str) -> None:
    """Make each of ``nodes`` (random nodes of ``graph``) draw from ``stream``, a call_module at ``target``:
    ``resolve`` gives a call_module's module (it becomes the stream's child)."""
    for n in nodes:
        if n.op == "call_module":
            op: Callable[..., Any] = resolve(str(n.target))
        elif n.op == "call_method":
            op = functools.partial(_method, str(n.target))
        else:
            op = n.target
        n.op, n.target, n.args = "call_module", target, (stream.add(op), *n.args)
