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
dp replica's batch); the runtime's synthetic data reads it.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import Node

from pipec.compiler.frontend.trace import FrontendError, InputSpec, Traced, dtype_name, load_factory, to_dtype
from pipec.errors import UserCodeError

__all__ = ["LOSSES", "load_loss", "describe_data"]


def _cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if output.dim() > 2:
        return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), target.reshape(-1))
    return F.cross_entropy(output.float(), target)


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if output.shape != target.shape:  # torch would broadcast them (with only a warning)
        raise ValueError(f"mse needs the target's shape {list(target.shape)} to equal the output's {list(output.shape)}")
    return F.mse_loss(output.float(), target.float())


LOSSES: Mapping[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "cross_entropy": _cross_entropy,
    "mse": _mse,
}
"""The built-in losses of the last stage (mean over the microbatch)."""


def load_loss(name: str) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """``cross_entropy``, ``mse`` or a user's ``pkg.module:fn(output, target)``."""
    if name in LOSSES:
        return LOSSES[name]
    try:
        return load_factory(name)
    except FrontendError as e:
        raise FrontendError(str(e).replace("model", "loss", 1), key="loss",
                            hints=("a loss is cross_entropy, mse or 'pkg.module:fn' taking (output, target)",)) from None


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


def _int_input(traced: Traced, spec: InputSpec) -> dict[str, Any]:
    placeholder = next((n for n in traced.gm.graph.nodes if n.op == "placeholder" and n.name == spec.name), None)
    high = _embedding_size(traced, placeholder) if placeholder is not None else None
    if high is not None:
        return {"fill": "tokens", "high": high}
    if "mask" in spec.name:
        return {"fill": "ones"}
    return {"fill": "integers", "high": 2}


# ----------------------------------------------------------------------------- targets


def _output_meta(traced: Traced) -> torch.Tensor:
    out = next(n for n in reversed(traced.gm.graph.nodes) if n.op == "output")
    value = out.args[0]
    while isinstance(value, (tuple, list)) and len(value) == 1:
        value = value[0]
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


def _check_loss(loss: str, output: torch.Tensor, target: dict[str, Any], mb: int, declared: bool) -> None:
    fn = load_loss(loss)
    t = torch.empty((target["shape"][0] // mb, *target["shape"][1:]), dtype=to_dtype(target["dtype"]), device="meta")
    fix = ("set `targets NAME: DTYPE[SHAPE]` to what the loss takes, or `data` to your own data function"
           if not declared else "make `targets` match what the loss takes")
    try:
        value = fn(output, t)
    except Exception as e:  # noqa: BLE001 - the loss is (possibly) the user's code; say what it was given
        raise FrontendError(
            f"loss {loss} cannot take the model's output {dtype_name(output.dtype)}{list(output.shape)} with "
            f"{'the declared' if declared else 'synthetic'} targets {target['dtype']}{list(t.shape)} (one "
            f"microbatch): {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
            key="targets" if declared else "loss", hints=(fix,)) from None
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise UserCodeError("the loss", loss, ValueError(f"it must return a scalar tensor, got {shape}"),
                            "reduce the loss to a scalar (mean over the microbatch)")


def describe_data(traced: Traced, *, loss: str, num_microbatches: int,
                  targets: Sequence[InputSpec] = ()) -> dict[str, Any]:
    """plan.json's ``model["data"]``: what synthetic inputs and targets look like, for one dp replica's batch.

    ``traced`` was propagated on one microbatch's inputs. Refuses a loss that
    cannot take the output with these targets (declared ``targets`` win).
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
    output = _output_meta(traced)
    if targets:
        if len(targets) != 1:
            raise FrontendError(f"the loss takes one target tensor; targets declares {len(targets)}", key="targets")
        t = targets[0]
        target = {"name": t.name, "dtype": t.dtype, "shape": list(t.shape),
                  "fill": "classes" if not to_dtype(t.dtype).is_floating_point else "regression"}
        if target["fill"] == "classes":
            target["high"] = int(output.shape[-1]) if loss == "cross_entropy" and output.dim() >= 2 else 2
        if t.shape[0] != inputs[0]["shape"][0]:
            raise FrontendError(f"targets {t.name} has batch {t.shape[0]} (dim 0), but the input's batch is "
                                f"{inputs[0]['shape'][0]}", key="targets",
                                hints=("targets, like input, describe one dp replica's batch",))
    else:
        target = _derived_target(output, loss, inputs, mb)
    _check_loss(loss, output, target, mb, declared=bool(targets))
    return {"inputs": inputs, "target": target}
