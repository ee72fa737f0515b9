"""What the front end's passes share: their error, and tensors described by name.

:class:`~pipec.compiler.request.TensorSpec` (the language's type) is one model input; :func:`to_dtype` and
:func:`dtype_name` map dtype names to torch and back; :func:`example_inputs` makes the tensors a trace
runs on; :func:`storage_key` tells storages apart (meta and fake ones included).
"""

from __future__ import annotations

import torch

from pipec.compiler.request import TensorSpec
from pipec.errors import PipecError

__all__ = ["FrontendError", "TensorSpec", "to_dtype", "dtype_name", "example_inputs", "storage_key"]


class FrontendError(PipecError):
    """A model, its inputs or a partition the front end cannot handle; the message says how to fix it."""


def to_dtype(name: str, what: str = "dtype", key: str | None = None) -> torch.dtype:
    """The torch dtype ``name``; a :class:`FrontendError` about ``key`` if there is none."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise FrontendError(f"{what} must name a torch dtype such as float32, bfloat16 or int64, got {name!r}", key=key)
    return dt


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def example_inputs(inputs: tuple[TensorSpec, ...], *, device: str = "meta") -> dict[str, torch.Tensor]:
    """Zero tensors of the given shapes (zeros are valid token ids)."""
    return {s.name: torch.zeros(s.shape, dtype=to_dtype(s.dtype, f"input {s.name}'s dtype", "input"), device=device)
            for s in inputs}


def storage_key(t: torch.Tensor) -> int:
    """Identifies a tensor's storage (shared by its views), meta and fake tensors included."""
    return t.untyped_storage()._cdata

