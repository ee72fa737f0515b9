"""Annotate a traced graph: run it once on meta or fake tensors and record what later passes read.

:func:`propagate` records on every node ``meta["tensor_meta"]`` (ShapeProp),
``meta["pipec_flops"]`` (forward FLOPs, ``torch.utils.flop_counter``, CPU flash attention counted
too), ``meta["pipec_storage"]`` (a tensor result's storage: ``(key, bytes)``), ``meta["pipec_saved"]``
(storages autograd saved for backward while running the node: ``(key, bytes)``, parameters excluded)
and, for non-tensor values such as ``B, T, C = x.shape``, ``meta["pipec_value"]``. :func:`at_shapes`
copies an fx trace without them, to be annotated again at other input shapes.
"""

from __future__ import annotations

import contextlib
import io
import sys
from dataclasses import replace
from typing import Any, Mapping

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.shape_prop import ShapeProp
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from pipec.model.tensors import TensorSpec, storage_key, to_dtype
from pipec.model.trace import Traced, forward_failed, quiet_torch

__all__ = ["PROPAGATED", "propagate", "at_shapes"]


PROPAGATED = ("tensor_meta", "type", "unbacked_bindings", "pipec_flops", "pipec_saved", "pipec_storage", "pipec_value")
"""What :func:`propagate` writes on a node (ShapeProp's keys and pipec's)."""


def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args, **kwargs) -> int:  # noqa: ANN001
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_sdpa_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args, **kwargs) -> int:  # noqa: ANN001
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _flop_counter() -> FlopCounterMode:
    """FlopCounterMode that also counts CPU flash attention (what fake CPU tensors dispatch to)."""
    aten = torch.ops.aten
    mapping: dict[Any, Any] = {}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        mapping[aten._scaled_dot_product_flash_attention_for_cpu] = _cpu_sdpa_flop
        mapping[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _cpu_sdpa_backward_flop
    return FlopCounterMode(display=False, custom_mapping=mapping)



class _Probe(ShapeProp):
    """ShapeProp that also records FLOPs, saved storages and non-tensor values per node."""

    def __init__(self, traced: Traced, example: Mapping[str, torch.Tensor], counter: FlopCounterMode,
                 param_keys: set[int]) -> None:
        super().__init__(traced.gm)
        self.extra_traceback = False  # torch's "While executing ..." text on the error: pipec says where instead
        self.traced, self.example = traced, example
        self.counter = counter
        self.param_keys = param_keys
        self.current: Node | None = None
        self.saved: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in self.param_keys and self.current is not None:
            self.saved[key] = t.untyped_storage().nbytes()
        return t

    def run_node(self, n: Node) -> Any:
        self.current, self.saved = n, {}
        before = self.counter.get_total_flops()
        printed, sys.stderr = sys.stderr, io.StringIO()  # ShapeProp prints a failure's traceback: kept back
        try:
            result = super().run_node(n)
        except Exception as e:  # noqa: BLE001
            raise forward_failed(self.traced, n.name, e, self.example) from None
        finally:
            held, sys.stderr = sys.stderr.getvalue(), printed
        if held:  # what the node printed when it did not fail
            sys.stderr.write(held)
        n.meta["pipec_flops"] = self.counter.get_total_flops() - before
        n.meta["pipec_saved"] = tuple(self.saved.items())
        if isinstance(result, torch.Tensor):
            n.meta["pipec_storage"] = (storage_key(result), result.untyped_storage().nbytes())
        elif not _holds_tensor(result):
            n.meta["pipec_value"] = result
        self.current = None
        return result


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(_holds_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    return False


def propagate(traced: Traced, example: Mapping[str, torch.Tensor], *, fake_mode: Any = None, autocast: str | None = None) -> None:
    """Run the graph once on ``example`` (meta or fake tensors) and annotate every node (see module doc)."""
    gm = traced.gm
    param_keys = {storage_key(p) for p in gm.parameters()}
    counter = _flop_counter()
    probe = _Probe(traced, example, counter, param_keys)
    args = [example[n.target] for n in gm.graph.nodes if n.op == "placeholder"]
    with contextlib.ExitStack() as stack:
        stack.enter_context(quiet_torch())
        if fake_mode is not None:
            stack.enter_context(fake_mode)
        if autocast is not None:
            stack.enter_context(torch.autocast("cpu", dtype=to_dtype(autocast)))
        stack.enter_context(counter)
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(probe.pack, lambda t: t))
        stack.enter_context(torch.enable_grad())
        probe.run(*args)


def at_shapes(traced: Traced, inputs: tuple[TensorSpec, ...]) -> Traced:
    """An fx trace for inputs of other shapes, ready for :func:`propagate`: its graph copied (the same
    nodes and names, on the same model) without the annotations :func:`propagate` made. fx traces without
    looking at shapes, so tracing again would give this graph; torch.export specialises on them (trace
    again)."""
    assert traced.path == "fx", traced.path
    graph = Graph()
    graph._codegen = traced.gm.graph._codegen
    graph.output(graph.graph_copy(traced.gm.graph, {}))
    for node in graph.nodes:
        for key in PROPAGATED:
            node.meta.pop(key, None)
    return replace(traced, gm=GraphModule(traced.gm, graph, type(traced.model).__name__), inputs=inputs)

