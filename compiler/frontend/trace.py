"""Trace a built model into one torch.fx graph, with no real memory.

The model (built by :mod:`.load` on the meta device, or under ``FakeTensorMode`` when the plan runs
in a reduced-precision autocast, so that dtypes come out as the runtime will see them) is traced by
one of three paths:

- ``fx``: ``torch.fx`` symbolic tracing, with buffers proxied (``self.mask[:T]``
  traces) and :func:`pipe_split` markers recorded; torch.nn layers stay leaves.
- ``export``: ``torch.export.export(strict=False)``; its unlifted module's
  graph (aten ops, parameters as ``get_attr``) is used.
- ``auto``: fx, falling back to export where fx fails (data-dependent control
  flow, Hugging Face models) or where a leaf module hides repeated layers the
  partition needs (``nn.TransformerEncoder`` is one opaque node to fx).

The :class:`Traced` it returns carries the :mod:`.fingerprint` and each parameter's canonical name;
:func:`~.annotate.propagate` then runs it once on example inputs of the microbatch shape.
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn
from torch.fx import GraphModule, Node, Tracer

from pipec.compiler.frontend.fingerprint import fingerprint
from pipec.compiler.frontend.tensors import FrontendError, TensorSpec

__all__ = ["TRACE_PATHS", "Traced", "pipe_split", "is_pipe_split", "trace_model", "module_path", "compute_nodes"]

TRACE_PATHS = ("auto", "fx", "export")


# ----------------------------------------------------------------------------- pipe_split marker

_lib = torch.library.Library("pipec", "DEF")
_lib.define("pipe_split() -> ()")
_lib.impl("pipe_split", lambda: None, "CompositeExplicitAutograd")
torch.fx.node._side_effectful_functions.add(torch.ops.pipec.pipe_split.default)

_ACTIVE_TRACER: list["_Tracer"] = []


def pipe_split() -> None:
    """Mark a stage boundary in a model's ``forward``: a no-op when run eagerly.

    With ``partition`` unset, a model with markers is split at them; fx and
    torch.export both record the marker. torch's own
    ``torch.distributed.pipelining.pipe_split`` is recognised in export graphs.
    """
    if _ACTIVE_TRACER:
        _ACTIVE_TRACER[-1].create_proxy("call_function", torch.ops.pipec.pipe_split.default, (), {})
        return
    torch.ops.pipec.pipe_split()


def is_pipe_split(node: Node) -> bool:
    if node.op != "call_function":
        return False
    return node.target is torch.ops.pipec.pipe_split.default or str(node.target).startswith("pippy._pipe_split")



# ----------------------------------------------------------------------------- tracing


class _Tracer(Tracer):
    """fx tracer that proxies buffers (``self.mask[:T, :T]``) and records :func:`pipe_split`."""

    proxy_buffer_attributes = True

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> torch.fx.Graph:
        _ACTIVE_TRACER.append(self)
        try:
            return super().trace(root, concrete_args)
        finally:
            _ACTIVE_TRACER.pop()


@dataclass(frozen=True, slots=True, kw_only=True)
class Traced:
    """A traced model: its graph module and what the rest of the front end needs."""

    gm: GraphModule
    """The graph; its attributes resolve to the model's parameters, buffers and modules."""
    model: nn.Module
    path: str
    """``"fx"`` or ``"export"``."""
    inputs: tuple[TensorSpec, ...]
    fingerprint: str
    fingerprint_parts: Mapping[str, str]
    canonical: Mapping[str, str]
    """Every parameter name (each alias of a tied weight) -> its canonical name."""
    fallback: str = ""
    """Why ``auto`` fell back to export ("" when it did not)."""
    param_of: Mapping[str, nn.Parameter] = field(default_factory=dict, repr=False)
    """Canonical name -> the model's parameter."""


def _hides_layers(mod: nn.Module) -> bool:
    """A leaf module holding a list of parameterised layers (nn.TransformerEncoder's ``layers``)."""
    for sub in mod.modules():
        if sub is not mod and isinstance(sub, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            if sum(1 for c in sub.children() if any(True for _ in c.parameters())) >= 2:
                return True
    return False


def _fx_trace(model: nn.Module, names: list[str]) -> GraphModule:
    sig = inspect.signature(model.forward)
    concrete: dict[str, Any] = {}
    for pname, p in sig.parameters.items():
        if pname in names or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.default is inspect.Parameter.empty:
            raise FrontendError(
                f"{type(model).__name__}.forward needs argument {pname!r}, which no input names; "
                f"declare it as an input (input {pname}: dtype[shape])", key="input",
            )
        concrete[pname] = p.default
    graph = _Tracer().trace(model, concrete_args=concrete or None)
    gm = GraphModule(model, graph, type(model).__name__)
    # concrete args leave placeholders behind, guarded by asserts that they keep their value: drop both
    checks = {torch.fx._symbolic_trace._assert_is_none, operator.eq, torch._assert}
    for node in list(gm.graph.nodes):
        if node.op != "placeholder" or node.target in names:
            continue
        chain, todo = [], list(node.users)
        while todo:
            u = todo.pop()
            if u.op != "call_function" or u.target not in checks:
                raise FrontendError(f"{type(model).__name__}.forward's argument {node.target!r} is used but is no input; declare it as an input",
                                    key="input")
            chain.append(u)
            todo.extend(u.users)
        for u in reversed(list(dict.fromkeys(chain))):
            gm.graph.erase_node(u)
        gm.graph.erase_node(node)
    gm.recompile()
    return gm


def _export_trace(model: nn.Module, example: Mapping[str, torch.Tensor]) -> GraphModule:
    ep = torch.export.export(model, (), dict(example), strict=False)
    return ep.module(check_guards=False)



def _canonical_names(model: nn.Module) -> tuple[dict[str, str], dict[str, nn.Parameter]]:
    first: dict[int, str] = {}
    canonical: dict[str, str] = {}
    params: dict[str, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canon = first.setdefault(id(p), name)
        canonical[name] = canon
        params[canon] = p
    return canonical, params


def module_path(node: Node) -> str:
    """The module a node belongs to: a call_module's target, else the innermost module of its stack."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    return str(list(stack.values())[-1][0])


def compute_nodes(gm: GraphModule) -> list[Node]:
    """Nodes that compute (not placeholders, attributes or the output), in graph order."""
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]


def trace_model(
    model: nn.Module,
    inputs: tuple[TensorSpec, ...],
    example: Mapping[str, torch.Tensor],
    *,
    mode: str = "auto",
    split_paths: tuple[str, ...] = (),
) -> Traced:
    """Trace ``model`` (on meta or fake tensors) by ``mode``: ``auto``, ``fx`` or ``export``.

    ``split_paths`` are module paths the partition will cut before: in
    ``auto`` mode, one inside an fx leaf module selects export.
    """
    if mode not in TRACE_PATHS:
        raise FrontendError(f"trace must be one of {', '.join(TRACE_PATHS)}, got {mode!r}", key="trace")
    names = [s.name for s in inputs]
    params = inspect.signature(model.forward).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        for n in names:
            if n not in params:
                raise FrontendError(
                    f"input {n!r} is not an argument of {type(model).__name__}.forward "
                    f"({', '.join(params)}); name inputs after forward's arguments", key="input",
                )
    fallback = ""
    gm: GraphModule | None = None
    path = mode
    if mode in ("auto", "fx"):
        try:
            gm = _fx_trace(model, names)
        except FrontendError:
            raise
        except Exception as e:  # noqa: BLE001 - fx raises many kinds; auto falls back, fx reports
            if mode == "fx":
                raise FrontendError(
                    f"torch.fx cannot trace {type(model).__name__}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; "
                    "use trace export (or auto)", key="trace",
                ) from None
            fallback = f"fx failed ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
        if gm is not None:
            hidden = _hidden_paths(gm, split_paths)
            if hidden:
                if mode == "fx":
                    raise FrontendError(
                        f"torch.fx keeps module {hidden[0]!r} as one leaf node, so the partition cannot cut inside it; "
                        "use trace export (or auto)", key="trace",
                    )
                fallback = f"fx keeps {hidden[0]!r} as one leaf node with layers inside"
                gm = None
        path = "fx" if gm is not None else "export"
    if gm is None:
        try:
            gm = _export_trace(model, example)
        except Exception as e:  # noqa: BLE001
            how = f" ({fallback})" if fallback else ""
            raise FrontendError(
                f"torch.export cannot capture {type(model).__name__}{how}: {type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}; make forward traceable (no data-dependent "
                "control flow, tensor or tuple outputs; for Hugging Face models set use_cache=False)",
                key="trace" if mode == "export" else "model",
            ) from None
    fp, parts = fingerprint(path, gm, model)
    canonical, param_of = _canonical_names(model)
    return Traced(
        gm=gm, model=model, path=path, inputs=inputs, fingerprint=fp, fingerprint_parts=parts,
        canonical=canonical, fallback=fallback, param_of=param_of,
    )



def _hidden_paths(gm: GraphModule, split_paths: tuple[str, ...]) -> list[str]:
    hidden = []
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        target = str(node.target)
        if any(p.startswith(target + ".") for p in split_paths) or _hides_layers(gm.get_submodule(target)):
            hidden.append(target)
    return hidden

