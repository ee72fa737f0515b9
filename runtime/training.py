"""What a training step needs besides the schedule, built from the plan's training config.

The torch side of :class:`~pipec.compiler.config.TrainingConfig`: the
optimizer (AdamW, Adam, SGD), the loss, the autocast dtype, the data callable
and microbatch slicing (the learning-rate schedule is plain arithmetic:
:meth:`TrainingConfig.lr_at`). Everything a user can get wrong raises
:class:`TrainingError` with the key to fix.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F

from pipec.compiler.config import TrainingConfig
from pipec.compiler.plan import Plan
from pipec.errors import PipecError

__all__ = [
    "TrainingError",
    "make_optimizer",
    "make_loss",
    "autocast_dtype",
    "replica_inputs",
    "make_data",
    "synthetic_batch",
    "split_microbatches",
    "load_target",
]


class TrainingError(PipecError):
    """A training setting cannot be used; the message names the key."""


def load_target(target: str, key: str) -> Any:
    """Import ``pkg.module:name``; a bad target is a clear error naming the key."""
    mod_name, _, attr = target.partition(":")
    if not mod_name or not attr:
        raise TrainingError(f"{key} {target!r}: expected 'pkg.module:name'")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise TrainingError(f"{key} {target!r}: cannot import {mod_name}: {e}") from None
    try:
        return getattr(mod, attr)
    except AttributeError:
        raise TrainingError(f"{key} {target!r}: module {mod_name} has no {attr!r}") from None


_OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}


def make_optimizer(params: Iterable[torch.nn.Parameter], config: TrainingConfig) -> torch.optim.Optimizer:
    """The config's optimizer over ``params``, at its peak lr (the trainer sets each step's lr)."""
    opt = config.optimizer
    try:
        return _OPTIMIZERS[opt.name](list(params), lr=config.lr, **opt.kwargs)
    except (TypeError, ValueError) as e:
        raise TrainingError(f"optimizer {opt.name}: {e}") from None


def _cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if output.dim() > 2:
        return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), target.reshape(-1))
    return F.cross_entropy(output.float(), target)


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.float(), target.float())


def make_loss(name: str) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """The loss of the last stage: cross_entropy, mse or ``pkg.module:fn(output, target)``."""
    if name == "cross_entropy":
        return _cross_entropy
    if name == "mse":
        return _mse
    fn = load_target(name, "loss")
    if not callable(fn):
        raise TrainingError(f"loss {name!r} is not callable")
    return fn


def autocast_dtype(name: str | None) -> torch.dtype | None:
    """``dtype`` runs the stages under autocast (params stay float32 masters); float32 means none."""
    return {None: None, "float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def synthetic_batch(step: int, dp_rank: int, dp_size: int, *, inputs: Sequence[Mapping[str, Any]], seed: int,
                    vocab: int | None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Deterministic data from (seed, step, dp rank): the data position is the step.

    Token inputs are sequences ``(start + t) mod vocab`` with random starts, and
    the targets are the next tokens: a task a model can learn, so the loss
    falls. Float inputs get a regression target (a fixed linear map of the input).
    """
    g = torch.Generator().manual_seed(hash((seed, step, dp_rank)) & 0x7FFFFFFFFFFF)
    out: dict[str, torch.Tensor] = {}
    target: torch.Tensor | None = None
    for inp in inputs:
        shape, dtype = tuple(inp["shape"]), inp["dtype"]
        if dtype.startswith("int"):
            v = vocab or 2
            start = torch.randint(0, v, (shape[0],) + (1,) * (len(shape) - 1), generator=g)
            pos = torch.arange(shape[-1]).reshape((1,) * (len(shape) - 1) + (shape[-1],))
            tokens = (start + pos) % v
            out[inp["name"]] = tokens
            if target is None:
                target = (tokens + 1) % v
        else:
            x = torch.randn(shape, generator=g, dtype=getattr(torch, dtype))
            out[inp["name"]] = x
            if target is None:
                w = torch.randn(shape[-1], shape[-1], generator=torch.Generator().manual_seed(seed)) / shape[-1] ** 0.5
                target = torch.tanh(x @ w)
    assert target is not None
    return out, target


def replica_inputs(plan: Plan) -> tuple[dict[str, Any], ...]:
    """Name, dtype and shape of each model input over one dp replica's whole batch (the ``input`` key):
    the traced microbatch signatures with the batch times the microbatches; empty without a model."""
    inputs = (plan.model or {}).get("inputs") or ()
    return tuple({"name": i["name"], "dtype": i["dtype"],
                  "shape": [i["shape"][0] * plan.num_microbatches, *i["shape"][1:]]} for i in inputs)


def make_data(config: TrainingConfig, plan: Plan) -> Callable[[int, int, int], tuple[Any, Any]]:
    """``fn(step, dp_rank, dp_size) -> (inputs, targets)`` for one replica's whole batch."""
    data = config.data
    if data == "synthetic":
        inputs = replica_inputs(plan)
        vocab = ((plan.model or {}).get("kwargs") or {}).get("vocab")
        seed = config.seed

        def synthetic(step: int, dp_rank: int, dp_size: int):
            return synthetic_batch(step, dp_rank, dp_size, inputs=inputs, seed=seed, vocab=vocab)

        return synthetic
    fn = load_target(data, "data")
    if not callable(fn):
        raise TrainingError(f"data {data!r} is not callable")
    return fn


def split_microbatches(batch: Any, num_microbatches: int, what: str, names: Sequence[str] = ()) -> list:
    """Slice a batch (a tensor, a tuple of tensors, or a name -> tensor dict) into equal microbatches on dim 0."""
    if isinstance(batch, torch.Tensor):
        if names:
            batch = {names[0]: batch}
        else:
            return _split_tensor(batch, num_microbatches, what)
    if isinstance(batch, (tuple, list)):
        batch = dict(zip(names, batch)) if names else {str(i): t for i, t in enumerate(batch)}
    if not isinstance(batch, Mapping):
        raise TrainingError(f"{what}: expected a tensor, a tuple of tensors or a dict of them, got {type(batch).__name__}")
    parts = {k: _split_tensor(v, num_microbatches, f"{what} {k!r}") for k, v in batch.items()}
    return [{k: parts[k][m] for k in parts} for m in range(num_microbatches)]


def _split_tensor(t: torch.Tensor, num_microbatches: int, what: str) -> list[torch.Tensor]:
    if not isinstance(t, torch.Tensor):
        raise TrainingError(f"{what}: expected a tensor, got {type(t).__name__}")
    if t.shape[0] % num_microbatches:
        raise TrainingError(
            f"{what}: a batch of {t.shape[0]} does not split into {num_microbatches} equal microbatches; "
            f"use a batch that {num_microbatches} divides, or another microbatch count")
    return list(t.chunk(num_microbatches))
