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
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from pipec.errors import PipecError

__all__ = ["DataError", "TOKEN_DTYPES", "TokenFile", "window_index", "open_tokens", "synthetic_batch"]

TOKEN_DTYPES = ("uint8", "uint16", "int16", "uint32", "int32", "int64")
"""The element types a token file may hold (uint16 holds a vocabulary up to 65,536)."""


class DataError(PipecError):
    """The training data cannot be used as the plan says; the message names the key to fix."""


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

    Refuses, naming the fix, a dtype pipec does not read, a missing file, a
    size that is not whole tokens, a file too short for one step's windows,
    and (when ``vocab`` is known) a first window holding an id outside it.
    """
    if dtype not in TOKEN_DTYPES:
        raise DataError(f"data tokens: dtype {dtype!r} is not a token type; use one of {', '.join(TOKEN_DTYPES)}",
                        key="data")
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise DataError(f"data tokens: cannot read {path!r}: {e.strerror or e}", key="data",
                        hints=("paths are relative to the schedule file",)) from None
    item = np.dtype(dtype).itemsize
    if size % item:
        raise DataError(f"data tokens: {path!r} is {size:,} bytes, not a whole number of {dtype} tokens "
                        f"({item} bytes each); was it written with another dtype?", key="data")
    tokens = np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype=dtype)
    need = dp_size * batch
    if len(tokens) // (seq + 1) < need:
        raise DataError(f"data tokens: {path!r} holds {len(tokens):,} tokens, {len(tokens) // (seq + 1):,} windows "
                        f"of seq + 1 = {seq + 1}; one step reads {need} distinct windows (batch {batch} x dp "
                        f"{dp_size}); use a larger file or a smaller batch", key="data")
    tf = TokenFile(path=path, tokens=tokens, seq=seq, seed=seed)
    if vocab is not None:
        head = tokens[: min(len(tokens), 1 << 20)]
        top = int(head.max()) if int(head.min()) >= 0 else int(head.min())
        if not 0 <= top < vocab:
            raise DataError(f"data tokens: {path!r} holds token id {top}, outside the model's vocabulary of {vocab} "
                            "(the embedding's size); was the file written for another tokenizer?", key="data")
    return tf


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
