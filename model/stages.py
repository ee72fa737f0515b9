"""A pipeline stage as a runnable module, built from the split graph (:func:`materialize`).

The stage gets a copy of each module tree it calls, refilled with fresh tensors on its device: the traced
model (on meta or fake tensors) is not modified. ``costs profile`` times the stages it materialises
(:mod:`pipec.costs.costs`); a run rebuilds its plan's stages with it (:mod:`pipec.runtime.stages`).
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import GraphModule

from pipec.model.partition import Split
from pipec.model.tensors import FrontendError

__all__ = ["StageModule", "materialize", "clone_tree", "resolve"]


class StageModule(GraphModule):
    """One pipeline stage: ``forward(*inputs)`` returns a tuple of its outputs.

    Inputs and outputs follow the plan's ``stages[s].inputs`` / ``.outputs``
    order; the last stage returns the model's outputs (flattened). Parameters
    keep the model's attribute paths (``blocks.4.attn.qkv.weight``);
    :meth:`canonical_params` maps canonical names (a tied weight's first name
    in module order) to this stage's parameters.
    """

    def __init__(self, root: nn.Module, graph: torch.fx.Graph, *, stage: int, input_names: tuple[str, ...],
                 output_names: tuple[str, ...], canonical: Mapping[str, str], param_order: tuple[str, ...]) -> None:
        super().__init__(root, graph, f"Stage{stage}")
        self.param_order = param_order
        self.stage = stage
        self.input_names = input_names
        self.output_names = output_names
        self.canonical = dict(canonical)
        """Local parameter name -> canonical name."""

    def canonical_params(self) -> dict[str, nn.Parameter]:
        """Canonical name -> parameter, in the model's parameter order."""
        out: dict[str, nn.Parameter] = {}
        for name, p in self.named_parameters(remove_duplicate=False):
            out.setdefault(self.canonical[name], p)
        return {c: out[c] for c in self.param_order}


# ----------------------------------------------------------------------------- materialising


def _retarget(gm: GraphModule, device: torch.device, traced_on: str) -> None:
    """Devices baked into the graph at trace time (meta, or cpu under fake tensors) become ``device``."""

    def fix(a: Any) -> Any:
        if isinstance(a, torch.device) and a.type == traced_on:
            return device
        if isinstance(a, (tuple, list)):
            return type(a)(fix(x) for x in a)
        return a

    for node in gm.graph.nodes:
        node.args = tuple(fix(a) for a in node.args)
        node.kwargs = {k: fix(v) for k, v in node.kwargs.items()}


def clone_tree(mod: nn.Module, memo: dict[int, nn.Module]) -> nn.Module:
    """A copy of ``mod``'s module tree whose parameter and buffer slots can be refilled
    without touching the original (tensors are not copied)."""
    if id(mod) in memo:
        return memo[id(mod)]
    new = copy.copy(mod)
    memo[id(mod)] = new
    new._parameters = dict(mod._parameters)
    new._buffers = dict(mod._buffers)
    new._modules = {k: None if v is None else clone_tree(v, memo) for k, v in mod._modules.items()}
    return new


def resolve(root: nn.Module, target: str) -> Any:
    """The submodule, parameter or buffer at a dotted ``target`` of ``root``."""
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def materialize(split: Split, s: int, values: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
                device: str | torch.device = "cpu", *, traced_on: str = "meta") -> StageModule:
    """Stage ``s`` of ``split`` with real parameters (``values`` by canonical name) and buffers (by name).

    The traced model's modules are not modified: the stage gets a copy of each
    module tree it calls, refilled with fresh tensors on ``device``.
    """
    device = torch.device(device)
    part = split.parts[s]
    graph = split.stage_graph(s)
    canon_by_id = {id(p): c for c, p in split.traced.param_of.items()}
    fresh: dict[str, nn.Parameter] = {}
    canonical: dict[str, str] = {}

    def param(p: nn.Parameter, local: str) -> nn.Parameter:
        canon = canon_by_id[id(p)]
        canonical[local] = canon
        if canon not in fresh:
            fresh[canon] = nn.Parameter(values[canon].to(device, copy=True), requires_grad=p.requires_grad)
        return fresh[canon]

    def buffer(name: str) -> torch.Tensor:
        if name not in buffers:
            raise FrontendError(f"stage {s}: buffer {name!r} has no value; register the model's buffers in __init__")
        return buffers[name].to(device, copy=True)

    memo: dict[int, nn.Module] = {}
    attrs: dict[str, Any] = {}
    for node in graph.nodes:
        if node.op not in ("call_module", "get_attr") or node.target in attrs:
            continue
        target = str(node.target)
        obj = resolve(split.traced.gm, target)
        if isinstance(obj, nn.Module):
            root = clone_tree(obj, memo)
            for mod_name, mod in root.named_modules(prefix=target, remove_duplicate=False):
                for key, p in list(mod._parameters.items()):
                    if p is not None:
                        mod._parameters[key] = param(p, f"{mod_name}.{key}")
                for key, b in list(mod._buffers.items()):
                    if b is not None:
                        mod._buffers[key] = buffer(f"{mod_name}.{key}")
                for key, v in list(vars(mod).items()):
                    if isinstance(v, torch.Tensor) and (v.device.type == "meta" or isinstance(v, FakeTensor)):
                        raise FrontendError(
                            f"stage {s}: {type(mod).__name__} attribute {mod_name}.{key} is a tensor that is neither a "
                            "parameter nor a buffer, so it has no value here; register it as a buffer"
                        )
            attrs[target] = root
        elif isinstance(obj, nn.Parameter):
            attrs[target] = param(obj, target)
        elif isinstance(obj, torch.Tensor):
            attrs[target] = buffer(target)
        else:
            attrs[target] = obj
    assert set(fresh) == set(part.params), (sorted(fresh), part.params)
    mod = StageModule(
        attrs, graph, stage=s, input_names=tuple(x.name for x in part.inputs),
        output_names=tuple(x.name for x in part.outputs), canonical=canonical, param_order=part.params,
    )
    _retarget(mod, device, traced_on)
    mod.recompile()
    return mod
