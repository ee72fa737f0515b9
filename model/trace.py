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

import contextlib
import inspect
import logging
import operator
import os
import re
import sysconfig
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import nn
from torch.fx import GraphModule, Node, Tracer

from pipec.model.fingerprint import fingerprint
from pipec.model.tensors import FrontendError, TensorSpec

__all__ = ["TRACE_PATHS", "Traced", "pipe_split", "is_pipe_split", "trace_model", "module_path", "compute_nodes",
           "quiet_torch", "forward_failed", "STACK_FRAME", "user_frame", "frame_text", "node_frame"]

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
    stacks: dict[str, str] | None = field(default=None, repr=False, compare=False)
    """Node name -> the stack trace that made it, from one fx trace made again recording them (see
    :func:`node_frame`); None until a message first asks."""


def _hides_layers(mod: nn.Module) -> bool:
    """A leaf module holding a list of parameterised layers (nn.TransformerEncoder's ``layers``)."""
    for sub in mod.modules():
        if sub is not mod and isinstance(sub, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            if sum(1 for c in sub.children() if any(True for _ in c.parameters())) >= 2:
                return True
    return False


def _fx_trace(model: nn.Module, names: list[str], *, stack_traces: bool = False) -> GraphModule:
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
    tracer = _Tracer()
    tracer.record_stack_traces = stack_traces  # only to say where a node failed: it slows the trace
    graph = tracer.trace(model, concrete_args=concrete or None)
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
    with quiet_torch():
        gm, path, fallback = _trace(model, names, example, mode, split_paths)
    fp, parts = fingerprint(path, gm, model)
    canonical, param_of = _canonical_names(model)
    return Traced(
        gm=gm, model=model, path=path, inputs=inputs, fingerprint=fp, fingerprint_parts=parts,
        canonical=canonical, fallback=fallback, param_of=param_of,
    )


def _trace(model: nn.Module, names: list[str], example: Mapping[str, torch.Tensor], mode: str,
           split_paths: tuple[str, ...]) -> tuple[GraphModule, str, str]:
    """The graph, its path (fx or export) and why auto fell back ("" when it did not)."""
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
            shapes = _positions_problem(model, example)
            if shapes:
                raise FrontendError(shapes, key="input", hints=_POSITIONS_HINTS) from None
            at = frame_text(user_frame(traceback.extract_tb(e.__traceback__)))
            if type(e).__module__ == "builtins" and at:  # the user's code raised, or a kernel it called: shapes
                raise FrontendError(f"the model's forward fails on the declared inputs{at}: {type(e).__name__}: "
                                    f"{_first_line(e)}", key="input", hints=_SHAPES_HINTS) from None
            how = f" ({fallback})" if fallback else ""
            raise FrontendError(
                f"torch.export cannot capture {type(model).__name__}{how}{at}: {type(e).__name__}: "
                f"{_first_line(e)}; make forward traceable (no data-dependent "
                "control flow, tensor or tuple outputs; for Hugging Face models set use_cache=False)",
                key="trace" if mode == "export" else "model",
            ) from None
    return gm, path, fallback



def _hidden_paths(gm: GraphModule, split_paths: tuple[str, ...]) -> list[str]:
    hidden = []
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        target = str(node.target)
        if any(p.startswith(target + ".") for p in split_paths) or _hides_layers(gm.get_submodule(target)):
            hidden.append(target)
    return hidden


# ----------------------------------------------------------------------------- failures, said as the user wrote them


@contextlib.contextmanager
def quiet_torch() -> Iterator[None]:
    """torch's own log lines (``E1202 ... fake_tensor.py:3090] failed while attempting to run meta``, with its
    traceback) are dropped while pipec traces and annotates: a failure comes back as pipec's one message.
    ``TORCH_LOGS`` set in the environment (torch's own switch) keeps them."""
    if os.environ.get("TORCH_LOGS"):
        yield
        return
    drop = _DropTorchRecords()
    handlers = {h for name, lg in list(logging.Logger.manager.loggerDict.items())
                if (name == "torch" or name.startswith("torch.")) and isinstance(lg, logging.Logger)
                for h in lg.handlers}
    handlers.update(logging.getLogger().handlers)
    for h in handlers:
        h.addFilter(drop)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(drop)


class _DropTorchRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == "torch" or record.name.startswith("torch."))


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else ""


_PIPEC = Path(__file__).resolve().parents[1]
_NOT_USER = tuple(str(Path(p).resolve()) + os.sep for p in (
    os.path.dirname(torch.__file__), sysconfig.get_paths()["stdlib"],
    *(_PIPEC / d for d in ("pipec", "compiler", "model", "tp", "costs", "runtime", "tune"))))
"""Folders whose frames are not the user's: torch, Python's own library, pipec's own packages (the example
models, ``pipec.examples``, count as a user's; the folders sit side by side in a checkout and in a wheel)."""

STACK_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>\S+)\n(?P<code>[^\n]*)')


def user_frame(frames: Sequence[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The innermost frame of the user's code (neither torch's, pipec's nor Python's)."""
    for frame in reversed(frames):
        if frame.filename.startswith("<"):
            continue
        if not str(Path(frame.filename).resolve()).startswith(_NOT_USER):
            return frame
    return None


def frame_text(frame: traceback.FrameSummary | None) -> str:
    """`` at examples/gpt.py:42 (in forward: y = F.scaled_dot_product_attention(...))``, or ``""``."""
    if frame is None:
        return ""
    path = frame.filename
    with contextlib.suppress(ValueError):
        rel = os.path.relpath(path)
        path = path if rel.startswith("..") else rel
    code = (frame.line or "").strip()
    return f" at {path}:{frame.lineno} (in {frame.name}" + (f": {code}" if code else "") + ")"


def node_frame(traced: Traced, node_name: str) -> traceback.FrameSummary | None:
    """Where in the user's code the node ``node_name`` was made: its stack trace (export records it; an fx
    trace is made again, recording them, which only a failure pays for)."""
    stack = next((n.meta.get("stack_trace") for n in traced.gm.graph.nodes if n.name == node_name), None)
    if not stack and traced.path == "fx":
        if traced.stacks is None:   # one trace again per model, however many messages ask
            stacks: dict[str, str] = {}
            with contextlib.suppress(Exception):
                gm = _fx_trace(traced.model, [s.name for s in traced.inputs], stack_traces=True)
                stacks = {n.name: n.meta["stack_trace"] for n in gm.graph.nodes if n.meta.get("stack_trace")}
            object.__setattr__(traced, "stacks", stacks)
        stack = traced.stacks.get(node_name)
    if not stack:
        return None
    frames = [traceback.FrameSummary(m["file"], int(m["line"]), m["name"], line=m["code"].strip())
              for m in STACK_FRAME.finditer(stack)]
    return user_frame(frames)


_POSITION_NAME = re.compile(r"(^|[._])(wpe|pos|pos_emb\w*|position\w*|positional\w*)$")
_POSITION_LIMITS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length")
_SHAPES_HINTS = ("the model's forward must run on the declared input shapes (input NAME: DTYPE[SHAPE], one dp "
                 "replica's batch)",)
_POSITIONS_HINTS = ("declare an input no longer than the model's positions, or build the model with more "
                    "(model_args)",)


def _positions_problem(model: nn.Module, example: Mapping[str, Any]) -> str:
    """An integer input longer (dim 1) than the model's positions, said so; "" when none is."""
    limits: list[tuple[str, int]] = []
    config = getattr(model, "config", None)
    for attr in _POSITION_LIMITS:
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            limits.append((f"its config's {attr} is {value}", value))
            break
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Embedding) and _POSITION_NAME.search(name.lower()):
            limits.append((f"its position embedding {name} is nn.Embedding({mod.num_embeddings}, "
                           f"{mod.embedding_dim})", mod.num_embeddings))
    for name, x in example.items():
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.dtype.is_floating_point:
            continue
        for what, limit in limits:
            if x.shape[1] > limit:
                return f"input {name} has {x.shape[1]} positions (dim 1), more than the model's {limit}: {what}"
    return ""


def forward_failed(traced: Traced, node_name: str, error: BaseException,
                   example: Mapping[str, Any]) -> FrontendError:
    """The error for a forward that fails on the declared inputs at node ``node_name`` (while annotating): an
    input longer than the model's positions said as that, else the error where the user's code made the node."""
    shapes = _positions_problem(traced.model, example)
    if shapes:
        return FrontendError(shapes, key="input", hints=_POSITIONS_HINTS)
    cause = error.__cause__ or error
    at = frame_text(node_frame(traced, node_name)) or f" at node {node_name!r}"
    return FrontendError(f"the model's forward fails on the declared inputs{at}: {type(cause).__name__}: "
                         f"{_first_line(cause)}", key="input", hints=_SHAPES_HINTS)
