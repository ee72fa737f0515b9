"""Runnable stage modules for a run, rebuilt from its plan.

:func:`build_stages` re-traces the model a plan names (on the meta device),
checks the fingerprint and names the part that differs, splits the graph
exactly as the plan's stages record it (their node names), and materialises
only the requested stages (:func:`~pipec.model.stages.materialize`):
no process ever holds another stage's parameters.

Initial weights (``init module``/``exact``, and ``auto`` resolved when a plan
still says it) are :mod:`pipec.model.weights`'s; they do not
depend on the partition and equal :func:`build_reference`'s for the same seed.
The model is found as the compiler found it: plan.json's ``model.target``
(absolute for a model file) and ``model.search_path``, whatever the current
folder.

Tied copies start equal (one canonical name, one value). Buffers come from a
real CPU construction with parameters on meta, so a causal mask computed in
``__init__`` is right.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves

from pipec.model.annotate import propagate
from pipec.model.load import instantiate
from pipec.model.partition import Split, split_graph
from pipec.model.stages import StageModule, materialize
from pipec.model.tensors import FrontendError, TensorSpec, example_inputs
from pipec.model.trace import Traced, trace_model
from pipec.model.weights import INIT_MODES, initial_values, resolve_init
from pipec.compiler.ir.plan import Plan
from pipec.compiler.ir.tensor_parallel import in_effect

__all__ = ["ReferenceModule", "build_stages", "build_reference", "run_stages"]


class ReferenceModule(nn.Module):
    """The unpartitioned model: ``forward(*inputs)`` returns its outputs as the last stage does."""

    def __init__(self, model: nn.Module, input_names: tuple[str, ...]) -> None:
        super().__init__()
        self.model = model
        self.input_names = input_names

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.model(**dict(zip(self.input_names, inputs)))
        return tuple(t for t in tree_leaves(out) if isinstance(t, torch.Tensor))

    def canonical_params(self) -> dict[str, nn.Parameter]:
        return dict(self.model.named_parameters())


@dataclass(frozen=True, slots=True, kw_only=True)
class _PlanModel:
    """plan.json's ``model``, as this module reads it."""

    target: str
    kwargs: Mapping[str, Any]
    search_path: tuple[str, ...]
    inputs: tuple[TensorSpec, ...]
    init: str | None
    """The ``init`` the compiler resolved (absent in older plans)."""

    def build(self, mode: str, **kw: Any) -> tuple[nn.Module, dict[str, torch.Tensor]]:
        return instantiate(self.target, self.kwargs, mode=mode, search_path=self.search_path, **kw)

    def resolve(self, init: str) -> str:
        """``module`` or ``exact``: ``auto`` is the compiler's resolution, or resolved here for an older plan."""
        if init not in INIT_MODES:
            raise FrontendError(f"init must be one of {', '.join(INIT_MODES)}, got {init!r}", key="init")
        if init != "auto":
            return init
        if self.init in ("module", "exact"):
            return self.init
        return resolve_init(init, self.target, self.kwargs, search_path=self.search_path)


def _plan_model(plan: Plan) -> _PlanModel:
    model = plan.model
    if not model:
        raise FrontendError("this plan names no model (a schedule-only plan); run it with --emulate, or compile it with a model")
    raw = model.get("inputs")
    if not raw:
        raise FrontendError("the plan's model has no inputs; re-compile it with this pipec")
    return _PlanModel(
        target=str(model["target"]), kwargs=dict(model.get("kwargs") or {}),
        search_path=tuple(str(f) for f in model.get("search_path") or ()),
        inputs=tuple(TensorSpec(str(i["name"]), str(i["dtype"]), tuple(int(d) for d in i["shape"])) for i in raw),
        init=model.get("init"),
    )


def _retrace(plan: Plan, m: _PlanModel) -> tuple[Traced, dict[str, torch.Tensor], str]:
    """Trace the plan's model as the compiler did; returns it, real buffers, and the device traced on."""
    skeleton, buffers = m.build("skeleton")
    if (plan.model or {}).get("traced_on") == "fake":
        fake_mode = FakeTensorMode()
        model, _ = m.build("fake", fake_mode=fake_mode)
        with fake_mode:
            example = example_inputs(m.inputs, device="cpu")
        traced_on = "cpu"
    else:
        fake_mode, model, traced_on = None, skeleton, "meta"
        example = example_inputs(m.inputs)
    traced = trace_model(model, m.inputs, example, mode=str((plan.model or {}).get("trace", "auto")))
    _check_fingerprint(plan, traced)
    propagate(traced, example, fake_mode=fake_mode)
    return traced, buffers, traced_on


def _check_fingerprint(plan: Plan, traced: Traced) -> None:
    model_d = plan.model or {}
    if model_d.get("fingerprint") == traced.fingerprint:
        return
    parts = model_d.get("fingerprint_parts") or {}
    names = {"trace": "trace path", "torch": "torch version (major.minor)", "graph": "traced graph", "params": "parameters (names, shapes, dtypes)"}
    differ = [k for k in ("trace", "torch", "graph", "params") if parts.get(k) != traced.fingerprint_parts[k]]
    detail = "; ".join(
        f"{names[k]}: plan {parts.get(k)!s:.16} here {traced.fingerprint_parts[k]:.16}" for k in differ
    ) or "the plan records no parts"
    raise FrontendError(
        f"the model {model_d.get('target')!r} re-traced here does not match the plan's fingerprint ({detail}); "
        "re-compile the plan with this model, its arguments and this torch"
    )


def _split_from_plan(plan: Plan, traced: Traced) -> Split:
    stage_of: dict[str, int] = {}
    for st in plan.stages:
        for name in st.nodes:
            stage_of[name] = st.stage
    split = split_graph(traced, stage_of, plan.num_stages)
    for st, part in zip(plan.stages, split.parts):
        got = [(x.name, x.shape) for x in part.inputs], [(x.name, x.shape) for x in part.outputs]
        want = [(x.name, x.shape) for x in st.inputs], [(x.name, x.shape) for x in st.outputs]
        if got != want:
            raise FrontendError(
                f"stage {st.stage}: the re-traced model's stage inputs/outputs {got} differ from the plan's {want}; re-compile the plan"
            )
    return split


def build_stages(plan: Plan, stage_ids: Iterable[int], *, seed: int, init: str = "module",
                 device: str | torch.device = "cpu", tp_rank: int = 0, tp_group=None) -> dict[int, StageModule]:
    """The requested stages of ``plan`` as runnable modules (see module doc). A stage the plan shards across tp
    (``plan.stages[s].tp``) is tp rank ``tp_rank``'s part of it (:func:`~pipec.tp.rewrite.
    shard_stage`: local sizes, its parameters sliced, Megatron's f and g over ``tp_group``, a
    :class:`~pipec.tp.comm.TPGroup`; None: one rank's shapes alone)."""
    ids = sorted(set(stage_ids))
    m = _plan_model(plan)
    init = m.resolve(init)
    for s in ids:
        if not 0 <= s < plan.num_stages:
            raise FrontendError(f"stage {s} is not in the plan (stages 0..{plan.num_stages - 1})")
    traced, buffers, traced_on = _retrace(plan, m)
    split = _split_from_plan(plan, traced)
    needed = {c for s in ids for c in split.parts[s].params}
    values, exact_buffers = initial_values(m.target, m.kwargs, needed, seed=seed, init=init, search_path=m.search_path)
    out = {}
    for s in ids:
        stage = materialize(split, s, values, exact_buffers or buffers, device, traced_on=traced_on)
        record = in_effect(plan.stages[s].tp if plan.stages else None, plan.mesh.tp)
        if record is not None:
            from pipec.tp.rewrite import shard_stage

            stage = shard_stage(stage, record, tp_rank, tp=plan.mesh.tp, group=tp_group, traced=traced,
                                where=f" in stage {s}")
        out[s] = stage
    return out


def build_reference(plan: Plan, *, seed: int, init: str = "module", device: str | torch.device = "cpu") -> ReferenceModule:
    """The unpartitioned model, initialised as :func:`build_stages` initialises the stages."""
    m = _plan_model(plan)
    init = m.resolve(init)
    if init == "exact":
        model, _ = m.build("cpu", seed=seed)
    else:
        model, buffers = m.build("skeleton")
        names = dict(model.named_parameters())
        values, _ = initial_values(m.target, m.kwargs, names, seed=seed, init=init, search_path=m.search_path)
        fresh = {id(p): nn.Parameter(values[n], requires_grad=p.requires_grad) for n, p in names.items()}
        for mod_name, mod in model.named_modules(remove_duplicate=False):
            prefix = f"{mod_name}." if mod_name else ""
            for key, p in list(mod._parameters.items()):
                if p is not None:
                    mod._parameters[key] = fresh[id(p)]
            for key, b in list(mod._buffers.items()):
                if b is not None:
                    mod._buffers[key] = buffers[prefix + key]
    return ReferenceModule(model.to(device), tuple(i.name for i in m.inputs))


def run_stages(stages: Mapping[int, StageModule], inputs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Run every stage in order in this process, routing values by name; the last stage's outputs.

    ``inputs`` are the model inputs by name (one microbatch or a whole batch).
    For tests and single-process checks.
    """
    values = dict(inputs)
    out: tuple[torch.Tensor, ...] = ()
    for s in sorted(stages):
        mod = stages[s]
        out = mod(*[values[n] for n in mod.input_names])
        values.update(zip(mod.output_names, out))
    return out
