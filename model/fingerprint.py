"""A trace's fingerprint (DESIGN): what a run checks its rebuilt trace against.

sha256 over the trace path, torch major.minor, the graph's nodes in order as ``(op, target)`` and
the sorted ``(canonical parameter name, shape, dtype)`` list; each part is also hashed on its own so a
mismatch can be named.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from pipec.model.tensors import dtype_name

__all__ = ["fingerprint", "torch_version"]


def torch_version() -> str:
    """torch major.minor, as the fingerprint records it."""
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def _target_str(target: Any) -> str:
    if isinstance(target, str):
        return target
    try:
        return torch.fx.node._get_qualified_name(target)
    except Exception:  # noqa: BLE001 - a callable fx cannot name
        return getattr(target, "__qualname__", repr(target))


def fingerprint(path: str, gm: GraphModule, model: nn.Module) -> tuple[str, dict[str, str]]:
    """The whole fingerprint and its parts by name (``trace``, ``torch``, ``graph``, ``params``)."""
    nodes = [[n.op, _target_str(n.target)] for n in gm.graph.nodes]
    params = sorted([name, list(p.shape), dtype_name(p.dtype)] for name, p in model.named_parameters())
    whole = json.dumps([path, torch_version(), nodes, params], separators=(",", ":"))
    parts = {
        "trace": path,
        "torch": torch_version(),
        "graph": hashlib.sha256(json.dumps(nodes).encode()).hexdigest(),
        "params": hashlib.sha256(json.dumps(params).encode()).hexdigest(),
    }
    return hashlib.sha256(whole.encode()).hexdigest(), parts

