"""Trace a model into one torch.fx graph, with no real memory, and annotate it.

The front end's first pass. A model named ``"pkg.module:factory"`` is built
on the meta device (or under ``FakeTensorMode`` when the plan runs in a
reduced-precision autocast, so that dtypes come out as the runtime will see
them), traced, and run once on example inputs of the microbatch shape:

- ``fx``: ``torch.fx`` symbolic tracing, with buffers proxied (``self.mask[:T]``
  traces) and :func:`pipe_split` markers recorded; torch.nn layers stay leaves.
- ``export``: ``torch.export.export(strict=False)``; its unlifted module's
  graph (aten ops, parameters as ``get_attr``) is used.
- ``auto``: fx, falling back to export where fx fails (data-dependent control
  flow, Hugging Face models) or where a leaf module hides repeated layers the
  partition needs (``nn.TransformerEncoder`` is one opaque node to fx).

:func:`propagate` records on every node ``meta["tensor_meta"]`` (ShapeProp),
``meta["pipec_flops"]`` (forward FLOPs, ``torch.utils.flop_counter``),
``meta["pipec_storage"]`` (a tensor result's storage: ``(key, bytes)``),
``meta["pipec_saved"]`` (storages autograd saved for backward while running
the node: ``(key, bytes)``, parameters excluded) and, for non-tensor values
such as ``B, T, C = x.shape``, ``meta["pipec_value"]``.

The fingerprint (DESIGN): sha256 over the trace path, torch major.minor, the
graph's nodes in order as ``(op, target)`` and the sorted ``(canonical
parameter name, shape, dtype)`` list; each part is also hashed on its own so a
mismatch can be named.

Why one module of ~670 lines: finding and building the model (search path,
model files, meta / fake / skeleton builds) and tracing it share the device
contexts and the error wording, and every later pass reads the one
:class:`Traced` it returns; the building half is the first to split out when
this grows.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import json
import operator
import os
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn
from torch.fx import Graph, GraphModule, Node, Tracer
from torch.fx.passes.shape_prop import ShapeProp
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count
from pipec.errors import PipecError, UserCodeError

__all__ = [
    "FrontendError",
    "InputSpec",
    "Traced",
    "TRACE_PATHS",
    "pipe_split",
    "is_pipe_split",
    "ModelSource",
    "locate_model",
    "load_factory",
    "instantiate",
    "example_inputs",
    "trace_model",
    "at_shapes",
    "propagate",
    "module_path",
    "compute_nodes",
    "storage_key",
    "torch_version",
    "dtype_name",
    "to_dtype",
]

TRACE_PATHS = ("auto", "fx", "export")


class FrontendError(PipecError):
    """A model, its inputs or a partition the front end cannot handle; the message says how to fix it."""


@dataclass(frozen=True, slots=True)
class InputSpec:
    """One model input: forward's argument ``name``, ``dtype`` (``"int64"``) and ``shape``."""

    name: str
    dtype: str
    shape: tuple[int, ...]


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


# ----------------------------------------------------------------------------- dtypes


def to_dtype(name: str, what: str = "dtype", key: str | None = None) -> torch.dtype:
    """The torch dtype ``name``; a :class:`FrontendError` about ``key`` if there is none."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise FrontendError(f"{what} must name a torch dtype such as float32, bfloat16 or int64, got {name!r}", key=key)
    return dt


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def torch_version() -> str:
    """torch major.minor, as the fingerprint records it."""
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


# ----------------------------------------------------------------------------- building the model


MODEL_FORMS = "'pkg.module:factory' or 'path/to/file.py:factory'"


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model factory was found: what plan.json's ``model`` records so every rank finds it again."""

    target: str
    """The factory, cwd-independent: ``"pkg.module:fn"``, or ``"/abs/path/file.py:fn"`` for the file form."""
    search_path: tuple[str, ...] = ()
    """Absolute folders searched before ``sys.path`` (the schedule file's folder, the current folder)."""
    file: str | None = None
    """The model file's absolute path (the file form only)."""

    @property
    def folders(self) -> tuple[str, ...]:
        """What goes in front of ``sys.path`` while the model is imported and built (a file's own folder too)."""
        return self.search_path + ((str(Path(self.file).parent),) if self.file else ())


def _split_target(target: str) -> tuple[str, str]:
    mod, sep, fn = target.rpartition(":")
    if not sep or not mod or not fn:
        raise FrontendError(f"model must be {MODEL_FORMS}, got {target!r}; e.g. \"pipec.examples.gpt:build\"",
                            key="model")
    return mod, fn


def _is_file(mod: str) -> bool:
    return mod.endswith(".py") or "/" in mod or os.sep in mod


def locate_model(target: str, search_path: Sequence[str] = ()) -> ModelSource:
    """Resolve a file-form target to its absolute file; a module form is kept as it is.

    A relative ``file.py`` is looked up in each folder of ``search_path`` in
    order (the schedule file's folder first), or the current folder when
    ``search_path`` is empty.
    """
    mod, fn = _split_target(target)
    folders = tuple(str(Path(f).resolve()) for f in search_path)
    if not _is_file(mod):
        return ModelSource(target, folders)
    path = Path(mod).expanduser()
    tried = [path] if path.is_absolute() else [Path(f) / path for f in folders or (os.getcwd(),)]
    found = next((t.resolve() for t in tried if t.is_file()), None)
    if found is None:
        raise FrontendError(f"model {target!r}: no file {mod!r} in {', '.join(str(t.parent) for t in tried)}",
                            key="model", hints=("a relative model file is found from the schedule file's folder",))
    return ModelSource(f"{found}:{fn}", folders, str(found))


@contextlib.contextmanager
def _on_sys_path(folders: Sequence[str]) -> Iterator[None]:
    """``folders`` in front of ``sys.path`` while a model is imported and built, as Python puts a script's folder.

    Removed afterwards, so a rank's or a test's later imports are not changed;
    a module imported meanwhile stays in ``sys.modules`` (its package keeps
    its absolute ``__path__``), which is how the runtime finds it again.
    """
    added = [f for f in dict.fromkeys(folders) if f not in sys.path]
    sys.path[:0] = added
    if added:
        importlib.invalidate_caches()  # a file written a moment ago (a test's tmp_path) is seen
    try:
        yield
    finally:
        for f in added:
            with contextlib.suppress(ValueError):
                sys.path.remove(f)


def _import_file(path: str) -> ModuleType:
    """The module of a model file, under a name unique to its path (kept in ``sys.modules``, imported once)."""
    stem = re.sub(r"\W", "_", Path(path).stem)
    name = f"pipec_model_{stem}_{hashlib.sha256(path.encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses and pickling look a class's module up there
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod


def _import(src: ModelSource, mod_name: str) -> ModuleType:
    if src.file is not None:
        return _import_file(src.file)
    try:
        return importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name is None or not (mod_name == e.name or mod_name.startswith(e.name + ".")):
            raise  # the module itself imports something missing: the user's code
        where = ", ".join(src.search_path)
        raise FrontendError(
            f"model {src.target!r}: cannot find module {mod_name!r}; searched "
            + (f"{where}, then " if where else "") + "the installed packages (sys.path)",
            key="model",
            hints=(f"put {mod_name.replace('.', '/')}.py beside the schedule file, write the file form "
                   f"(model \"path/to/{mod_name.split('.')[-1]}.py:factory\"), or install its package",),
        ) from None


def _user_error(what: str, target: str, err: BaseException, *hints: str) -> UserCodeError:
    out = UserCodeError(what, target, err, *hints)
    out.key = "model"
    return out


def load_factory(target: str, search_path: Sequence[str] = ()) -> Callable[..., Any]:
    """Import the factory of ``"pkg.module:factory"`` or ``"path/to/file.py:factory"`` (see :func:`locate_model`)."""
    return _load(locate_model(target, search_path))


def _load(src: ModelSource) -> Callable[..., Any]:
    mod_name, fn_name = _split_target(src.target)
    with _on_sys_path(src.folders):
        try:
            mod = _import(src, mod_name)
        except PipecError:
            raise
        except Exception as e:  # the model's module raised while it was imported: the user's own code
            raise _user_error("importing the module of", src.target, e, "fix the module") from e
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise FrontendError(f"model {src.target!r}: module {mod_name!r} has no callable {fn_name!r}", key="model")
    return fn


def _call_factory(src: ModelSource, factory: Callable[..., Any], kwargs: Mapping[str, Any]) -> nn.Module:
    target = src.target
    kwargs = dict(kwargs)
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as e:
        raise FrontendError(f"model {target!r} rejected its arguments {kwargs!r}: {e}", key="model_args") from None
    except ValueError:  # no signature to check (a builtin): the call says
        pass
    with _on_sys_path(src.folders):
        try:
            model = factory(**kwargs)
        except PipecError:
            raise
        except Exception as e:  # the user's own code: name it, keep the cause for --verbose readers
            raise _user_error("the model factory", target, e, "fix the factory, or the model arguments given to it") from e
    if not isinstance(model, nn.Module):
        raise FrontendError(f"model {target!r} must return a torch.nn.Module, got {type(model).__name__}", key="model")
    return model


@contextlib.contextmanager
def _params_on_meta() -> Iterator[None]:
    """Every parameter registered while active moves to the meta device; buffers stay real."""
    orig = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        orig(self, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = orig  # type: ignore[method-assign]


def instantiate(
    target: str, kwargs: Mapping[str, Any], *, mode: str, search_path: Sequence[str] = (), fake_mode: Any = None,
    seed: int | None = None,
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Build the model; returns it and, for ``mode="skeleton"``, its real buffers by name.

    ``meta``: everything on the meta device. ``fake``: under ``fake_mode``
    (fake CPU tensors). ``skeleton``: parameters on meta, buffers computed for
    real on CPU, then returned and replaced by meta copies so the model traces
    like a ``meta`` one. ``cpu``: a real model with the factory's own
    initialisation (after ``torch.manual_seed(seed)`` when given). The factory
    is found by :func:`locate_model` and imported before any of these apply,
    so tensors its module makes at import are ordinary ones.
    """
    src = locate_model(target, search_path)
    factory = _load(src)
    if mode == "meta":
        with torch.device("meta"):
            model = _call_factory(src, factory, kwargs)
    elif mode == "fake":
        with fake_mode:
            model = _call_factory(src, factory, kwargs)
    elif mode == "skeleton":
        with _params_on_meta(), torch.device("cpu"):
            model = _call_factory(src, factory, kwargs)
        buffers: dict[str, torch.Tensor] = {}
        for mod_name, mod in model.named_modules(remove_duplicate=False):
            for key, buf in list(mod._buffers.items()):
                if buf is None:
                    continue
                buffers[f"{mod_name}.{key}" if mod_name else key] = buf
                if buf.device.type != "meta":
                    mod._buffers[key] = buf.to("meta")
        return model, buffers
    elif mode == "cpu":
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            with torch.device("cpu"):
                model = _call_factory(src, factory, kwargs)
    else:
        raise AssertionError(mode)
    return model, {}


def example_inputs(inputs: tuple[InputSpec, ...], *, device: str = "meta") -> dict[str, torch.Tensor]:
    """Zero tensors of the given shapes (zeros are valid token ids)."""
    return {s.name: torch.zeros(s.shape, dtype=to_dtype(s.dtype, f"input {s.name}'s dtype", "input"), device=device)
            for s in inputs}


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
    inputs: tuple[InputSpec, ...]
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


def _target_str(target: Any) -> str:
    if isinstance(target, str):
        return target
    try:
        return torch.fx.node._get_qualified_name(target)
    except Exception:  # noqa: BLE001 - a callable fx cannot name
        return getattr(target, "__qualname__", repr(target))


def _fingerprint(path: str, gm: GraphModule, model: nn.Module) -> tuple[str, dict[str, str]]:
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
    inputs: tuple[InputSpec, ...],
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
    fp, parts = _fingerprint(path, gm, model)
    canonical, param_of = _canonical_names(model)
    return Traced(
        gm=gm, model=model, path=path, inputs=inputs, fingerprint=fp, fingerprint_parts=parts,
        canonical=canonical, fallback=fallback, param_of=param_of,
    )


def at_shapes(traced: Traced, inputs: tuple[InputSpec, ...]) -> Traced:
    """An fx trace for inputs of other shapes, ready for :func:`propagate`: its graph copied (the same
    nodes and names, on the same model) without the annotations :func:`propagate` made. fx traces without
    looking at shapes, so tracing again would give this graph; torch.export specialises on them (trace
    again)."""
    assert traced.path == "fx", traced.path
    graph = Graph()
    graph._codegen = traced.gm.graph._codegen
    graph.output(graph.graph_copy(traced.gm.graph, {}))
    for node in graph.nodes:
        for key in _PROPAGATED:
            node.meta.pop(key, None)
    return replace(traced, gm=GraphModule(traced.gm, graph, type(traced.model).__name__), inputs=inputs)


def _hidden_paths(gm: GraphModule, split_paths: tuple[str, ...]) -> list[str]:
    hidden = []
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        target = str(node.target)
        if any(p.startswith(target + ".") for p in split_paths) or _hides_layers(gm.get_submodule(target)):
            hidden.append(target)
    return hidden


# ----------------------------------------------------------------------------- propagation


_PROPAGATED = ("tensor_meta", "type", "unbacked_bindings", "pipec_flops", "pipec_saved", "pipec_storage", "pipec_value")
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


def storage_key(t: torch.Tensor) -> int:
    """Identifies a tensor's storage (shared by its views), meta and fake tensors included."""
    return t.untyped_storage()._cdata


class _Probe(ShapeProp):
    """ShapeProp that also records FLOPs, saved storages and non-tensor values per node."""

    def __init__(self, gm: GraphModule, counter: FlopCounterMode, param_keys: set[int]) -> None:
        super().__init__(gm)
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
        try:
            result = super().run_node(n)
        except Exception as e:  # noqa: BLE001
            cause = e.__cause__ or e
            raise FrontendError(
                f"running node {n.name!r} ({n.format_node()}) on meta tensors failed: "
                f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}; "
                "the model's forward must run on the declared input shapes", key="input",
            ) from None
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
    probe = _Probe(gm, counter, param_keys)
    args = [example[n.target] for n in gm.graph.nodes if n.op == "placeholder"]
    with contextlib.ExitStack() as stack:
        if fake_mode is not None:
            stack.enter_context(fake_mode)
        if autocast is not None:
            stack.enter_context(torch.autocast("cpu", dtype=to_dtype(autocast)))
        stack.enter_context(counter)
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(probe.pack, lambda t: t))
        stack.enter_context(torch.enable_grad())
        probe.run(*args)
