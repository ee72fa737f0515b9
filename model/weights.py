"""Initial weights: each module's init path, ``init auto`` resolved at compile time, and the values a rank starts from.

Initial weights do not depend on the partition and equal the unpartitioned
reference's for the same seed (DESIGN, *Runtime*). Three modes:

- ``module``: each module that owns a parameter (by its canonical name) is
  materialised alone and initialised by its *init path* under the CPU
  generator seeded from ``(seed, canonical module name)``, every other
  module left on the meta device. The init path (:func:`init_path`) is the
  module's own ``reset_parameters()`` (or ``_reset_parameters()``), then the
  ``_init_weights`` of the nearest module that has one (a Hugging Face
  ``PreTrainedModel``, wrapped in a user module or not; a nanoGPT-style
  root) applied to the module and to each module enclosing it: what Hugging
  Face's own initialisation (children first, each sub-model dispatching its
  own) does to the module's parameters, so the weights follow the model's
  own scheme (GPT-2's std 0.02 embeddings, not ``nn.Embedding``'s N(0, 1)).
- ``exact``: the whole model is built on CPU by its factory after
  ``torch.manual_seed(seed)``; each stage keeps its part (every rank holds
  the whole model for a moment, so it must fit in host memory).
- ``auto`` (the default), resolved by :func:`resolve_init` on the meta
  device when the plan is compiled: ``module`` when every module that owns
  parameters has an init path that sets all of them, else ``exact`` when the
  model has at most :data:`EXACT_MAX_PARAMS` parameters, else an error at
  the ``model`` key naming the modules without one and the fixes.

Whether an init path sets every parameter is found by running it on the meta
device and recording which storages it writes: no memory, no values.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pipec.model.load import instantiate
from pipec.model.tensors import FrontendError, storage_key

__all__ = ["INIT_MODES", "EXACT_MAX_PARAMS", "InitProblem", "init_path", "init_problems", "resolve_init",
           "module_seed", "initial_values"]

INIT_MODES = ("auto", "module", "exact")

EXACT_MAX_PARAMS = 1_000_000_000
"""The most parameters ``init auto`` falls back to ``exact`` for.

``exact`` builds the whole model in float32 on the CPU of every rank before
each keeps its stages: 4 bytes a parameter, 4 GB per rank at this limit (32
GB at a moment on a host running 8 ranks). Larger models need an init path
for every module (``init module``), or ``init exact`` set explicitly.
"""


def module_seed(seed: int, module_name: str) -> int:
    """The generator seed of one module under ``init module``."""
    digest = hashlib.sha256(f"{seed}:{module_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


# ----------------------------------------------------------------------------- init paths


def _init_weights_for(model: nn.Module, parts: Sequence[str]) -> Callable[[nn.Module], Any] | None:
    """The ``_init_weights`` of the module at ``parts`` or of the nearest module enclosing it."""
    for k in range(len(parts), -1, -1):
        init_weights = getattr(model.get_submodule(".".join(parts[:k])), "_init_weights", None)
        if callable(init_weights):
            return init_weights
    return None


def init_path(model: nn.Module, name: str) -> Callable[[], Any] | None:
    """The init path of module ``name`` of ``model`` (see the module doc); None when it has none.

    Its own ``reset_parameters()`` (what constructing it runs), then, as
    ``model.apply(_init_weights)`` does (Hugging Face's initialisation, and
    nanoGPT's), ``_init_weights`` applied to the module and then to each
    enclosing module out to the root, each call the ``_init_weights`` nearest
    to what it is applied to: an enclosing module's may set the module's
    parameters too (GPT-2 rescales ``c_proj.weight`` from its attention and
    MLP blocks).
    """
    mod = model.get_submodule(name)
    reset = getattr(mod, "reset_parameters", None) or getattr(mod, "_reset_parameters", None)
    steps: list[Callable[[], Any]] = [reset] if callable(reset) else []
    parts = name.split(".") if name else []
    for k in range(len(parts), -1, -1):  # the module itself, then each enclosing one out to the root
        init_weights = _init_weights_for(model, parts[:k])
        if init_weights is not None:
            steps.append(lambda fn=init_weights, target=model.get_submodule(".".join(parts[:k])): fn(target))
    if not steps:
        return None

    def run() -> None:
        for step in steps:
            step()

    return run


def _owners(model: nn.Module) -> dict[str, list[str]]:
    """Module name -> the parameter attributes it owns, for each canonical parameter (tied aliases left out)."""
    out: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        mod, _, attr = name.rpartition(".")
        out.setdefault(mod, []).append(attr)
    return out


class _Writes(TorchDispatchMode):
    """Records the storages that ops write in place (arguments their schema marks as written)."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        kwargs = kwargs or {}
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, torch.Tensor):
                    self.keys.add(storage_key(t))
        return func(*args, **kwargs)


@dataclass(frozen=True, slots=True, kw_only=True)
class InitProblem:
    """A module that owns parameters whose initialisation ``init module`` cannot do."""

    module: str
    """Its name in the model (``""``: the root)."""
    kind: str
    """Its class name."""
    why: str
    definite: bool = True
    """False when its init path raised on the meta device: it may still work on real tensors."""

    def __str__(self) -> str:
        return f"{self.module or '(the root module)'} ({self.kind}): {self.why}"


def _check_module(model: nn.Module, name: str, attrs: Sequence[str]) -> InitProblem | None:
    """Run module ``name``'s init path on the meta device; a problem if it has none or leaves a parameter unset."""
    mod = model.get_submodule(name)
    kind = type(mod).__name__
    fn = init_path(model, name)
    if fn is None:
        return InitProblem(module=name, kind=kind,
                           why="no reset_parameters() and no enclosing _init_weights (a Hugging Face PreTrainedModel's)")
    floating = [a for a in attrs if mod._parameters[a].is_floating_point()]
    before = {a: (mod._parameters[a], storage_key(mod._parameters[a])) for a in floating}
    writes = _Writes()
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad(), writes:
            fn()
    except Exception as e:  # noqa: BLE001 - the user's init on meta tensors: may work on real ones
        first = str(e).splitlines()[0][:100] if str(e) else ""
        return InitProblem(module=name, kind=kind, why=f"its init raised on the meta device ({type(e).__name__}: {first})",
                           definite=False)

    def untouched(attr: str) -> bool:  # neither written in place nor replaced (a new Parameter, or new .data)
        p, key = mod._parameters.get(attr), before[attr][1]
        return p is before[attr][0] and storage_key(p) == key and key not in writes.keys

    unset = [a for a in floating if untouched(a)]
    if unset:
        return InitProblem(module=name, kind=kind, why=f"its init leaves {', '.join(map(repr, unset))} unset")
    return None


def init_problems(model: nn.Module) -> tuple[InitProblem, ...]:
    """The modules of ``model`` (built on the meta device) that ``init module`` cannot initialise."""
    return tuple(p for name, attrs in _owners(model).items() if (p := _check_module(model, name, attrs)) is not None)


def resolve_init(init: str, target: str, kwargs: Mapping[str, Any], *, search_path: Sequence[str] = ()) -> str:
    """``module`` or ``exact`` for ``init`` (``auto`` resolved, see the module doc); refuses what would fail on the ranks.

    ``init module`` with a module that has no init path, or one that leaves a
    parameter unset, is refused here (key ``init``) rather than on every rank.
    """
    if init not in INIT_MODES:
        raise FrontendError(f"init must be one of {', '.join(INIT_MODES)}, got {init!r}", key="init")
    if init == "exact":
        return init
    scratch, _ = instantiate(target, kwargs, mode="meta", search_path=search_path)
    problems = init_problems(scratch)
    definite = [p for p in problems if p.definite]
    if init == "module":
        if definite:
            raise FrontendError(
                "init module: " + _listing(definite) + "; give each a reset_parameters() that sets all its "
                "parameters, or use init exact (or auto)", key="init")
        return init
    if not problems:
        return "module"
    num_params = sum(p.numel() for p in scratch.parameters())
    if num_params <= EXACT_MAX_PARAMS:
        return "exact"
    raise FrontendError(
        f"init auto: {_listing(problems)}, and with {num_params:,} parameters the model is above the "
        f"{EXACT_MAX_PARAMS:,} that init exact builds whole on every rank", key="model",
        hints=("give each of these modules a reset_parameters() that sets all its parameters",
               "or set init exact if every rank's host memory holds the whole model in float32"))


def _listing(problems: Sequence[InitProblem], shown: int = 5) -> str:
    more = f" and {len(problems) - shown} more" if len(problems) > shown else ""
    return "modules without an init path: " + "; ".join(map(str, problems[:shown])) + more


# ----------------------------------------------------------------------------- values


def _module_init(target: str, kwargs: Mapping[str, Any], needed: Iterable[str], seed: int,
                 search_path: Sequence[str]) -> dict[str, torch.Tensor]:
    scratch, _ = instantiate(target, kwargs, mode="meta", search_path=search_path)
    needed = set(needed)
    owners = {n.rpartition(".")[0] for n in needed}
    values: dict[str, torch.Tensor] = {}
    for mod_name, mod in scratch.named_modules():
        if mod_name not in owners:
            continue
        fn = init_path(scratch, mod_name)
        if fn is None:
            raise FrontendError(
                f"init module: module {mod_name!r} ({type(mod).__name__}) owns parameters but has no "
                "reset_parameters() and no enclosing _init_weights; give it one, or use init exact", key="init")
        mod.to_empty(device="cpu", recurse=False)
        for p in mod._parameters.values():
            if p is not None and p.is_floating_point():
                p.data.fill_(float("nan"))  # to catch a reset that leaves a parameter out
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(module_seed(seed, mod_name))
            fn()
        for key, p in mod._parameters.items():
            name = f"{mod_name}.{key}" if mod_name else key
            if p is not None and name in needed:
                if p.is_floating_point() and bool(torch.isnan(p).any()):
                    raise FrontendError(
                        f"init module: {type(mod).__name__}'s initialisation left {name!r} (partly) unset; "
                        "initialise every parameter the module owns, or use init exact", key="init")
                values[name] = p.detach().clone()
        mod.to_empty(device="meta", recurse=False)  # an enclosing module's init run later never draws for it
    missing = needed - set(values)
    assert not missing, sorted(missing)[:3]
    return values


def initial_values(
    target: str, kwargs: Mapping[str, Any], needed: Iterable[str], *, seed: int, init: str,
    search_path: Sequence[str] = (),
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """Initial values of the ``needed`` canonical parameters, and (``exact``) all buffers.

    ``init`` is ``module`` or ``exact`` (``auto`` resolved first, by :func:`resolve_init`).
    """
    if init == "module":
        return _module_init(target, kwargs, needed, seed, search_path), None
    if init == "exact":
        model, _ = instantiate(target, kwargs, mode="cpu", seed=seed, search_path=search_path)
        params = dict(model.named_parameters())
        return {n: params[n].detach() for n in needed}, {n: b for n, b in model.named_buffers(remove_duplicate=False)}
    raise FrontendError(f"init must be one of {', '.join(INIT_MODES)}, got {init!r}", key="init")
