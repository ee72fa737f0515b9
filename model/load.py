"""Find a model's factory and build the model: the front end's first step.

A model is named ``"pkg.module:factory"`` or ``"path/to/file.py:factory"``. :func:`locate_model`
resolves a model file against the search path (the schedule file's folder first) into the
:class:`ModelSource` plan.json records, so every rank finds it again; :func:`load_factory` imports the
factory with those folders in front of ``sys.path``; :func:`instantiate` calls it on the meta device,
under a ``FakeTensorMode``, as a skeleton (parameters on meta, buffers real) or for real on CPU. An
exception in the user's module or factory becomes a :class:`~pipec.errors.UserCodeError` about key
``model``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from pipec.model.tensors import FrontendError
from pipec.errors import PipecError, UserCodeError

__all__ = ["MODEL_FORMS", "ModelSource", "locate_model", "load_factory", "instantiate"]


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

