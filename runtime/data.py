"""Training data on disk: a flat, memory-mapped token file (the nanoGPT layout).

``data tokens("train.bin", dtype=uint16)`` names a file of token ids written
back to back (``numpy.array(ids, dtype=numpy.uint16).tofile("train.bin")``).
Each row of a replica's batch is one window of ``seq + 1`` tokens: the first
``seq`` are the input, the last ``seq`` (shifted by one) the next-token
targets.

Which window a row reads is a pure function of (seed, step, dp rank, row), so
a resumed run continues the exact token stream and every rank can compute
its own rows without talking to the others:

- the file is cut into ``W = len // (seq + 1)`` non-overlapping windows;
- the rows of one step are numbered globally, ``i = (step x dp + dp rank) x
  batch + row``, so the replicas of a step read distinct ``i``;
- ``i`` falls in epoch ``i // W`` and is mapped to a window by an affine
  bijection of ``0..W-1`` whose multiplier and offset are drawn from
  (seed, epoch): each epoch visits every window once, in a shuffled order,
  and the stream wraps into the next epoch at the end of the file.

Nothing here reads more than the rows asked for: the file is memory-mapped,
so a file far larger than host memory is fine.

The default data is synthetic, made by :func:`synthetic_batch` from the
plan's ``model["data"]`` (what the compiler derived from the traced model
and the loss: each input's range, the targets' shape, dtype and kind), so it
always fits the model. It is a learnable task, so the loss falls: token
sequences ``(start + t) mod vocab`` with next-token targets, class targets
that are a function of the input, regression targets a fixed smooth map of
the input.

A user's data function (``data "pkg.module:fn"``) is wrapped by
:func:`user_data`: its own exceptions become a
:class:`~pipec.errors.UserCodeError` naming it, and what it returns is
checked on every call against what the plan expects (:data:`CONTRACT`).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from pipec.compiler.config import TOKEN_DTYPES
from pipec.model.data import DataError, map_tokens
from pipec.errors import PipecError, UserCodeError

__all__ = ["DataError", "TOKEN_DTYPES", "TokenFile", "window_index", "open_tokens", "synthetic_batch", "CONTRACT",
           "user_data", "check_batch", "shown"]


@lru_cache(maxsize=64)
def _epoch_map(seed: int, epoch: int, num_windows: int) -> tuple[int, int]:
    """The (multiplier, offset) of epoch ``epoch``'s bijection of ``0..num_windows-1``."""
    rng = random.Random(f"pipec.tokens/{seed}/{epoch}")
    if num_windows == 1:
        return 1, 0
    while True:
        a = rng.randrange(1, num_windows)
        if math.gcd(a, num_windows) == 1:
            return a, rng.randrange(num_windows)


def window_index(i: int, *, num_windows: int, seed: int) -> int:
    """The window the ``i``-th row of the stream reads (a bijection within each epoch)."""
    epoch, k = divmod(i, num_windows)
    a, b = _epoch_map(seed, epoch, num_windows)
    return (a * k + b) % num_windows


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenFile:
    """A memory-mapped token file cut into windows of ``seq + 1`` tokens."""

    path: str
    tokens: np.ndarray
    """The memory map (1-D)."""
    seq: int
    """Tokens per input row; a window holds ``seq + 1``."""
    seed: int

    @property
    def num_windows(self) -> int:
        return len(self.tokens) // (self.seq + 1)

    def batch(self, step: int, dp_rank: int, dp_size: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One replica's (inputs, targets), int64 ``[batch, seq]`` each."""
        w, n = self.num_windows, self.seq + 1
        first = (step * dp_size + dp_rank) * batch
        rows = np.empty((batch, n), dtype=np.int64)
        for r in range(batch):
            start = window_index(first + r, num_windows=w, seed=self.seed) * n
            rows[r] = self.tokens[start:start + n]
        t = torch.from_numpy(rows)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def open_tokens(path: str, *, dtype: str, seq: int, batch: int, dp_size: int, seed: int,
                vocab: int | None = None) -> TokenFile:
    """Open ``path`` for batches of ``batch`` rows of ``seq`` tokens on ``dp_size`` replicas.

    Refuses, naming the fix, what ``pipec compile`` refuses too
    (:func:`~pipec.model.data.map_tokens`: a dtype pipec does not
    read, a missing file, a size that is not whole tokens, a file too short
    for one step's windows, ids outside ``vocab``), in case the file changed since.
    """
    tokens = map_tokens(path, dtype=dtype, seq=seq, batch=batch, dp_size=dp_size, vocab=vocab)
    return TokenFile(path=path, tokens=tokens, seq=seq, seed=seed)


def _generator(seed: int, *parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash((seed, *parts)) & 0x7FFFFFFFFFFF)


def _input(spec: dict, g: torch.Generator) -> torch.Tensor:
    shape, fill = tuple(spec["shape"]), spec["fill"]
    if fill == "normal":
        return torch.randn(shape, generator=g, dtype=getattr(torch, spec["dtype"]))
    dtype = getattr(torch, spec["dtype"])
    if fill == "ones":
        return torch.ones(shape, dtype=dtype)
    high = int(spec["high"])
    if fill == "tokens" and len(shape) >= 2:
        start = torch.randint(0, high, (shape[0],) + (1,) * (len(shape) - 1), generator=g)
        pos = torch.arange(shape[-1]).reshape((1,) * (len(shape) - 1) + (shape[-1],))
        return ((start + pos) % high).to(dtype)
    return torch.randint(0, high, shape, generator=g, dtype=dtype)


def _features(inputs: dict[str, torch.Tensor], rows: int) -> torch.Tensor:
    """One float feature row per batch row, from the inputs (what targets are a function of)."""
    parts = [t.reshape(rows, -1).float() for t in inputs.values()]
    return torch.cat(parts, dim=1)


def _target(spec: dict, inputs: dict[str, torch.Tensor], seed: int) -> torch.Tensor:
    shape, fill = tuple(spec["shape"]), spec["fill"]
    dtype = getattr(torch, spec["dtype"])
    if fill == "next_token":
        return ((inputs[spec["of"]] + 1) % int(spec["high"])).to(dtype)
    rows = shape[0]
    x = _features(inputs, rows)
    x = (x - x.mean()) / (x.std() + 1e-6)
    per_row = max(1, math.prod(shape[1:]))
    if fill == "classes":
        high = int(spec["high"])
        w = torch.randn(x.shape[1], per_row * high, generator=_generator(seed, -1))
        scores = (x @ w).reshape(*shape, high)
        return scores.argmax(-1).to(dtype)
    if fill == "regression":
        w = torch.randn(x.shape[1], per_row, generator=_generator(seed, -2)) / x.shape[1] ** 0.5
        return torch.tanh(x @ w).reshape(shape).to(dtype)
    return torch.zeros(shape, dtype=dtype)


def synthetic_batch(desc: dict, *, step: int, dp_rank: int, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One replica's (inputs by name, targets) at ``step``, from plan.json's ``model["data"]``."""
    g = _generator(seed, step, dp_rank)
    inputs = {spec["name"]: _input(spec, g) for spec in desc["inputs"]}
    return inputs, _target(desc["target"], inputs, seed)


# ----------------------------------------------------------------------------- a user's data function

CONTRACT = ("fn(step, dp_rank, dp_size) returns (inputs, targets) for that replica's whole batch: inputs a tensor "
            "(a model with one input), a tuple in input order, or a dict by input name, each shaped as `input` "
            "says; targets one tensor (as `targets` says, when set)")
"""What a data function must return (the README and the reference page say the same)."""


def shown(value: Any) -> str:
    """A returned value as a message shows it: ``int64[8, 16]``, ``(int64[8, 16], str)``, ``{tokens: ...}``."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(shown(v) for v in value)
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {shown(v)}" for k, v in value.items()) + "}"
    return type(value).__name__


def _expected(spec: Mapping[str, Any]) -> str:
    return f"{spec['dtype']}{list(spec['shape'])}"


def _by_name(x: Any, names: Sequence[str], wrong: Callable[[str], DataError]) -> dict[str, Any]:
    if isinstance(x, torch.Tensor):
        if len(names) != 1:
            raise wrong(f"one tensor for the model's {len(names)} inputs ({', '.join(names)})")
        return {names[0]: x}
    if isinstance(x, (tuple, list)):
        if len(x) != len(names):
            raise wrong(f"{len(x)} inputs for the model's {len(names)} ({', '.join(names)})")
        return dict(zip(names, x))
    if isinstance(x, Mapping):
        if set(x) != set(names):
            raise wrong(f"inputs named {', '.join(map(str, x))}; the model's are {', '.join(names)}")
        return {n: x[n] for n in names}
    raise wrong(f"inputs of type {type(x).__name__}")


def check_batch(out: Any, target: str, *, inputs: Sequence[Mapping[str, Any]],
                target_spec: Mapping[str, Any] | None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A data function's ``(inputs, targets)`` checked against the plan: inputs by name, as each of ``inputs``
    (name, dtype, shape of one replica's batch) says; targets as ``target_spec`` says, else of the inputs' batch."""
    what = f"data function {target!r}"

    def wrong(got: str) -> DataError:
        return DataError(f"the {what} returned {got}", key="data", hints=(f"a data function's contract: {CONTRACT}",))

    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise wrong(f"{shown(out)}, not a pair (inputs, targets)")
    x, y = _by_name(out[0], [i["name"] for i in inputs], wrong), out[1]
    for spec in inputs:
        t = x[spec["name"]]
        if not isinstance(t, torch.Tensor) or str(t.dtype) != f"torch.{spec['dtype']}" \
                or list(t.shape) != list(spec["shape"]):
            raise wrong(f"{shown(t)} for input {spec['name']!r}, which the plan expects as {_expected(spec)} "
                        "(one dp replica's batch)")
    if not isinstance(y, torch.Tensor):
        raise wrong(f"targets {shown(y)}, not a tensor")
    if target_spec is not None and (str(y.dtype) != f"torch.{target_spec['dtype']}"
                                    or list(y.shape) != list(target_spec["shape"])):
        raise wrong(f"targets {shown(y)}, which the plan expects as {_expected(target_spec)} (key targets)")
    batch = inputs[0]["shape"][0] if inputs else None
    if target_spec is None and (y.dim() == 0 or y.shape[0] != batch):
        raise wrong(f"targets {shown(y)}, whose batch (dim 0) is not the inputs' {batch}")
    return x, y


def user_data(fn: Callable[..., Any], target: str, *, inputs: Sequence[Mapping[str, Any]],
              target_spec: Mapping[str, Any] | None) -> Callable[[int, int, int], tuple[dict, torch.Tensor]]:
    """``fn`` as the trainer calls it: its exceptions named, what it returns checked (:func:`check_batch`)."""

    def data(step: int, dp_rank: int, dp_size: int) -> tuple[dict, torch.Tensor]:
        try:
            out = fn(step, dp_rank, dp_size)
        except PipecError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's own code: name it, without pipec's traceback
            err = UserCodeError("the data function", target, e,
                                f"it was called as fn(step={step}, dp_rank={dp_rank}, dp_size={dp_size})")
            err.key = "data"
            raise err from None
        return check_batch(out, target, inputs=inputs, target_spec=target_spec)

    return data
