"""Synthetic data that fits the model, and the loss checked against the targets, at compile time.

The front end has traced the model, so it knows what the runtime's default
(synthetic) data must look like; nothing is left for the first step to find:

- each integer input's range: the size of the embedding it feeds (found by
  following the input's node through shape-only ops to an ``nn.Embedding``,
  ``F.embedding`` or ``aten.embedding``), else 0/1 for an attention-mask
  style input, else ``[0, 2)``;
- the targets, from the traced output and the loss: for ``cross_entropy``,
  class indices ``[0, C)`` over the output's last dimension, shaped like the
  output without it (next-token targets when an integer input of that shape
  feeds an embedding no larger than C: an LM's own task); for ``mse``, the
  output's shape and dtype; a ``targets`` key declares them instead;
- ``loss(output, target)`` is then run on the meta device, so a target the
  loss cannot take is refused at compile time, naming the fix.

:func:`describe_data` returns plan.json's ``model["data"]`` (shapes are one
dp replica's batch); the runtime's synthetic data reads it. :func:`data_of`
does so for the data the run trains on: synthetic, a token file (the model's
one int64 ``[B, T]`` input, next-token targets, and the file itself checked
by :func:`map_tokens`, which the runtime opens it with too), or a user's data
function (found like the model; its targets are known only when ``targets``
declares them). User functions (data, loss) are found by :func:`load_function`.

:func:`check_data_source` runs before the model is built: every check of the
data, the loss and the targets that needs no trace (a token file's dtype, size
and windows, a data function or a loss found, a custom loss given its targets),
so such a mistake is reported in the time it takes to import torch. Targets are
derived only for the built-in :data:`LOSSES`, whose contract pipec knows; a
custom loss with neither ``targets`` nor a data function is refused at ``loss``.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import Node

from pipec.compiler.config import TOKEN_DTYPES, TokenData
from pipec.model.load import load_factory
from pipec.model.tensors import FrontendError, TensorSpec, dtype_name, to_dtype
from pipec.model.trace import Traced
from pipec.errors import PipecError, UserCodeError

__all__ = ["LOSSES", "DataError", "load_function", "load_loss", "check_data_source", "describe_data", "data_of",
           "map_tokens"]


class DataError(PipecError):
    """The training data (or the targets the loss is given) cannot be used as the plan says; the message names
    the key to fix."""


def _cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if output.dim() > 2:
        return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), target.reshape(-1))
    return F.cross_entropy(output.float(), target)


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if output.shape != target.shape:  # torch would broadcast them (with only a warning)
        raise DataError(f"mse needs the target's shape {list(target.shape)} to equal the output's "
                        f"{list(output.shape)}", key="targets")
    return F.mse_loss(output.float(), target.float())


LOSSES: Mapping[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "cross_entropy": _cross_entropy,
    "mse": _mse,
}
"""The built-in losses of the last stage (mean over the microbatch)."""


def load_function(target: str, key: str, search_path: Sequence[str] = ()) -> Callable[..., Any]:
    """A user's ``pkg.module:fn`` (key ``data`` or ``loss``), found like the model: ``search_path`` (the
    schedule file's folder, the current folder), then the installed packages; a failure names ``key``."""
    try:
        return load_factory(target, search_path)
    except UserCodeError as e:  # its module raised while it was imported
        e.key = key
        raise
    except FrontendError as e:
        mod = target.rpartition(":")[0].split(".")[0]
        raise FrontendError(str(e).replace("model", key, 1), key=key,
                            hints=(f"put {mod}.py beside the schedule file, or install its package",)) from None


def load_loss(name: str, search_path: Sequence[str] = ()) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """``cross_entropy``, ``mse`` or a user's ``pkg.module:fn(output, target)``."""
    if name in LOSSES:
        return LOSSES[name]
    return load_function(name, "loss", search_path)


# ----------------------------------------------------------------------------- integer inputs

_PASS_THROUGH = frozenset({"view", "reshape", "to", "long", "int", "contiguous", "flatten", "unsqueeze", "expand",
                           "clone", "_unsafe_view", "_to_copy", "alias", "getitem"})
"""Ops that carry token ids through unchanged (shape and dtype only)."""


def _op_name(node: Node) -> str:
    """``view`` for ``x.view(...)``, ``torch.reshape``, ``aten.view.default`` alike."""
    if node.op == "call_method":
        return str(node.target)
    packet = getattr(node.target, "_overloadpacket", None)
    return getattr(packet or node.target, "__name__", str(node.target))


def _embedding_size(traced: Traced, node: Node, depth: int = 0) -> int | None:
    """The size of the first embedding ``node``'s value indexes, following shape-only ops."""
    for user in node.users:
        if user.op == "call_module":
            mod = traced.gm.get_submodule(str(user.target))
            if isinstance(mod, nn.Embedding) and user.args and user.args[0] is node:
                return mod.num_embeddings
        elif user.op == "call_function" and _op_name(user) == "embedding":
            index, weight = (user.args[0], user.args[1]) if user.target is F.embedding else (user.args[1], user.args[0])
            if index is node and isinstance(weight, Node):
                meta = weight.meta.get("tensor_meta")
                if meta is None and weight.op == "get_attr":
                    meta = traced.gm.get_parameter(str(weight.target))
                if meta is not None:
                    return int(meta.shape[0])
        elif user.op in ("call_method", "call_function") and _op_name(user) in _PASS_THROUGH and depth < 8:
            found = _embedding_size(traced, user, depth + 1)
            if found is not None:
                return found
    return None


def _int_input(traced: Traced, spec: TensorSpec) -> dict[str, Any]:
    placeholder = next((n for n in traced.gm.graph.nodes if n.op == "placeholder" and n.name == spec.name), None)
    high = _embedding_size(traced, placeholder) if placeholder is not None else None
    if high is not None:
        return {"fill": "tokens", "high": high}
    if "mask" in spec.name:
        return {"fill": "ones"}
    return {"fill": "integers", "high": 2}


# ----------------------------------------------------------------------------- targets


def _output_meta(traced: Traced, loss: str) -> torch.Tensor | None:
    """The model's output on meta; None for several outputs that a user's loss takes together."""
    out = next(n for n in reversed(traced.gm.graph.nodes) if n.op == "output")
    value = out.args[0]
    while isinstance(value, (tuple, list)) and len(value) == 1:
        value = value[0]
    if loss not in LOSSES and isinstance(value, (tuple, list)) and all(isinstance(v, Node) for v in value):
        return None
    if isinstance(value, Mapping) or not isinstance(value, Node):
        raise FrontendError("the model's forward must return one tensor (the last stage's output, the loss's "
                            f"input); it returns {type(value).__name__}", key="model",
                            hints=("wrap the model in a module whose forward returns the logits",))
    meta = value.meta.get("tensor_meta")
    if meta is None:
        raise FrontendError("the model's output is not a tensor; forward must return the tensor the loss takes",
                            key="model")
    return torch.empty(tuple(meta.shape), dtype=meta.dtype, device="meta")


def _derived_target(output: torch.Tensor, loss: str, inputs: Sequence[dict[str, Any]], mb: int) -> dict[str, Any]:
    shape = [output.shape[0] * mb, *output.shape[1:]]
    if loss == "cross_entropy":
        if output.dim() < 2:
            raise FrontendError(f"cross_entropy needs the model's output to end in a class dimension, but it is "
                                f"{dtype_name(output.dtype)}{list(output.shape)}", key="loss",
                                hints=("use loss mse for a regression output, or return class logits",))
        classes = int(output.shape[-1])
        for spec in inputs:
            if spec.get("fill") == "tokens" and list(spec["shape"]) == shape[:-1] and spec["high"] <= classes:
                return {"name": "target", "dtype": "int64", "shape": shape[:-1], "fill": "next_token",
                        "of": spec["name"], "high": spec["high"]}
        return {"name": "target", "dtype": "int64", "shape": shape[:-1], "fill": "classes", "high": classes}
    fill = "regression" if output.dtype.is_floating_point else "integers"
    return {"name": "target", "dtype": dtype_name(output.dtype), "shape": shape, "fill": fill,
            **({"high": 2} if fill == "integers" else {})}


_DECLARED = {
    "targets": ("the declared", "make `targets` match what the loss takes"),
    "data": ("data tokens(...)'s next-token", "use a loss that takes next-token ids, such as cross_entropy"),
}
"""Who declared the targets (the key a complaint is about) -> how the message names them, and the fix."""


def _check_loss(loss: str, output: torch.Tensor, target: dict[str, Any], mb: int, declared_by: str | None,
                search_path: Sequence[str]) -> None:
    fn = load_loss(loss, search_path)
    t = torch.empty((target["shape"][0] // mb, *target["shape"][1:]), dtype=to_dtype(target["dtype"]), device="meta")
    what, fix = _DECLARED.get(declared_by, ("synthetic", "set `targets NAME: DTYPE[SHAPE]` to what the loss takes, "
                                                         "or `data` to your own data function"))
    try:
        value = fn(output, t)
    except Exception as e:  # noqa: BLE001 - the loss is (possibly) the user's code; say what it was given
        raise FrontendError(
            f"loss {loss} cannot take the model's output {dtype_name(output.dtype)}{list(output.shape)} with "
            f"{what} targets {target['dtype']}{list(t.shape)} (one microbatch): "
            f"{'' if isinstance(e, PipecError) else type(e).__name__ + ': '}{str(e).splitlines()[0] if str(e) else ''}",
            key=declared_by or "loss", hints=(fix,)) from None
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        err = UserCodeError("the loss", loss, ValueError(f"it must return a scalar tensor, got {shape}"),
                            "reduce the loss to a scalar (mean over the microbatch)")
        err.key = "loss"
        raise err


def _check_derivable(loss: str) -> None:
    """Refuse to derive targets for a loss whose contract pipec does not know (a user's function)."""
    if loss not in LOSSES:
        raise DataError(f"loss {loss} is your own function, so pipec cannot tell what targets it takes and does not "
                        "make them up", key="loss",
                        hints=("declare them: `targets NAME: DTYPE[SHAPE]` (one dp replica's batch, e.g. targets y: "
                               "int64[16]), or set `data` to your own data function",))


def _declared_target(t: TensorSpec, output: torch.Tensor, loss: str, batch: int, key: str) -> dict[str, Any]:
    target = {"name": t.name, "dtype": t.dtype, "shape": list(t.shape),
              "fill": "classes" if not to_dtype(t.dtype, f"targets {t.name!r}'s dtype", key).is_floating_point
              else "regression"}
    if target["fill"] == "classes":
        target["high"] = int(output.shape[-1]) if loss == "cross_entropy" and output.dim() >= 2 else 2
    if t.shape[0] != batch:
        raise FrontendError(f"targets {t.name} has batch {t.shape[0]} (dim 0), but the input's batch is {batch}",
                            key=key, hints=("targets, like input, describe one dp replica's batch",))
    return target


def describe_data(traced: Traced, *, loss: str, num_microbatches: int, targets: Sequence[TensorSpec] = (),
                  search_path: Sequence[str] = (), derive: bool = True, declared_by: str = "targets") -> dict[str, Any]:
    """plan.json's ``model["data"]``: what synthetic inputs and targets look like, for one dp replica's batch.

    ``traced`` was propagated on one microbatch's inputs. Refuses a loss that
    cannot take the output with these targets (declared ``targets`` win; a
    complaint about them names ``declared_by``). ``derive=False`` with no
    ``targets`` (a data function's are unknown) describes the inputs alone.
    """
    mb = num_microbatches
    inputs = []
    for spec in traced.inputs:
        entry: dict[str, Any] = {"name": spec.name, "dtype": spec.dtype, "shape": [spec.shape[0] * mb, *spec.shape[1:]]}
        if to_dtype(spec.dtype).is_floating_point:
            entry["fill"] = "normal"
        else:
            entry.update(_int_input(traced, spec))
        inputs.append(entry)
    if derive and not targets:
        _check_derivable(loss)
    output = _output_meta(traced, loss) if targets or derive else None
    if output is None:  # nothing to check the loss against: the inputs alone
        return {"inputs": inputs}
    if targets:
        if len(targets) != 1:
            raise FrontendError(f"the loss takes one target tensor; targets declares {len(targets)}", key=declared_by)
        target = _declared_target(targets[0], output, loss, inputs[0]["shape"][0], declared_by)
    else:
        target = _derived_target(output, loss, inputs, mb)
    _check_loss(loss, output, target, mb, declared_by if targets else None, search_path)
    return {"inputs": inputs, "target": target}


# ----------------------------------------------------------------------------- the data a run trains on


def check_data_source(data: str | TokenData, *, inputs: Sequence[TensorSpec], loss: str, dp: int,
                      targets: Sequence[TensorSpec] = (), search_path: Sequence[str] = ()) -> None:
    """The checks of the run's data that need no model, run before it is built (see the module docstring):
    ``inputs`` are one dp replica's batch (key ``input``). :func:`data_of` checks the rest on the trace."""
    if loss not in LOSSES:
        load_loss(loss, search_path)
        if data == "synthetic" and not targets:
            _check_derivable(loss)
    for t in targets:
        to_dtype(t.dtype, f"targets {t.name!r}'s dtype", "targets")
    if isinstance(data, TokenData):
        tokens = _token_input(inputs, data)
        map_tokens(data.path, dtype=data.dtype, seq=tokens.shape[1], batch=tokens.shape[0], dp_size=dp)
    elif data != "synthetic":
        load_function(data, "data", search_path)


def data_of(traced: Traced, *, data: str | TokenData, loss: str, num_microbatches: int, dp: int,
            targets: Sequence[TensorSpec] = (), search_path: Sequence[str] = ()) -> dict[str, Any]:
    """plan.json's ``model["data"]`` for the run's data (see the module docstring); refuses, naming the key,
    a token file the model cannot read or that cannot be read, and a data function that cannot be found."""
    common = dict(loss=loss, num_microbatches=num_microbatches, search_path=search_path)
    if isinstance(data, TokenData):
        tokens = _token_input([TensorSpec(i.name, i.dtype, (i.shape[0] * num_microbatches, *i.shape[1:]))
                               for i in traced.inputs], data)
        implied = TensorSpec("target", "int64", tokens.shape)  # each row's next tokens
        desc = describe_data(traced, targets=(implied,), declared_by="data", **common)
        high = desc["inputs"][0].get("high") if desc["inputs"][0]["fill"] == "tokens" else None
        map_tokens(data.path, dtype=data.dtype, seq=tokens.shape[1], batch=tokens.shape[0], dp_size=dp, vocab=high)
        return desc
    if data != "synthetic":
        load_function(data, "data", search_path)
        return describe_data(traced, targets=targets, derive=False, **common)
    return describe_data(traced, targets=targets, **common)


def _token_input(inputs: Sequence[TensorSpec], data: TokenData) -> TensorSpec:
    """The model's one int64 ``[B, T]`` input (``inputs``: one replica's batch), which a token file feeds."""
    if len(inputs) != 1 or inputs[0].dtype != "int64" or len(inputs[0].shape) != 2:
        got = ", ".join(f"{i.name}: {i.dtype}{list(i.shape)}" for i in inputs)
        raise FrontendError(f"data {data.text()} feeds a model with one int64 input [batch, seq]; this model's "
                            f"inputs are {got}", key="data",
                            hints=("use a data function for other inputs, or write input tokens: int64[B, T]",))
    return inputs[0]


def map_tokens(path: str, *, dtype: str, seq: int, batch: int, dp_size: int, vocab: int | None = None) -> np.ndarray:
    """The token file ``path`` memory-mapped (1-D), for batches of ``batch`` rows of ``seq`` tokens on
    ``dp_size`` replicas.

    Refuses, naming the fix, a dtype pipec does not read, a missing file, a
    size that is not whole tokens, a file too short for one step's windows,
    and (when ``vocab`` is known) an id outside it in the file's first 2**20 tokens.
    """
    if dtype not in TOKEN_DTYPES:
        raise DataError(f"data tokens: dtype {dtype!r} is not a token type; use one of {', '.join(TOKEN_DTYPES)}",
                        key="data")
    try:
        size = os.path.getsize(path)
        with open(path, "rb"):
            pass
    except OSError as e:
        raise DataError(f"data tokens: cannot read {path!r}: {e.strerror or e}", key="data", hints=(
            "a path in a schedule file is relative to its folder; a flag's, to the current folder",)) from None
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
    if vocab is not None:
        head = tokens[: min(len(tokens), 1 << 20)]
        top = int(head.max()) if int(head.min()) >= 0 else int(head.min())
        if not 0 <= top < vocab:
            raise DataError(f"data tokens: {path!r} holds token id {top}, outside the model's vocabulary of {vocab} "
                            "(the embedding's size); was the file written for another tokenizer?", key="data")
    return tokens
