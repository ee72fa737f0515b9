"""Compile requests for the tests that run the front end on its own: a model, one stage per pp rank, and the
keys a schedule file would set, each given by name (:func:`model_request`, :func:`changed`)."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from pipec.compiler.config import DEFAULTS, TrainingConfig
from pipec.compiler.ir.plan import Mesh
from pipec.compiler.request import CompileRequest, ModelSpec, Partition

_MODEL = frozenset(f.name for f in fields(ModelSpec))
_TRAINING = frozenset(f.name for f in fields(TrainingConfig))
_MESH = frozenset(f.name for f in fields(Mesh))
_REQUEST = frozenset(f.name for f in fields(CompileRequest))


def model_request(target: str, *, inputs, num_stages: int, num_microbatches: int = 1, **keys: Any) -> CompileRequest:
    """A gpipe request for ``target`` on ``num_stages`` pp ranks (costs flops, partition auto, trace auto, the
    training defaults), the other ``keys`` as :func:`changed` takes them."""
    model = ModelSpec(target=target, inputs=tuple(inputs), partition=Partition("auto"), costs="flops", trace="auto")
    base = CompileRequest(schedule="gpipe", mesh=Mesh(pp=num_stages), num_microbatches=num_microbatches,
                          model=model, training=DEFAULTS)
    return changed(base, **keys)


def changed(req: CompileRequest, **keys: Any) -> CompileRequest:
    """``req`` with each key set where it lives: ``num_stages`` (the mesh's pp), the model's fields, the training
    config's (``recompute``: True for every stage, or a set of stages), the mesh's, or the request's own."""
    model, training, mesh, own = {}, {}, {}, {}
    for name, value in keys.items():
        if name == "num_stages":
            mesh["pp"] = value
        elif name == "recompute":
            training[name] = value if value is True else tuple(sorted(value or ()))
        elif name in _MODEL:
            model[name] = value
        elif name in _TRAINING:
            training[name] = value
        elif name in _MESH:
            mesh[name] = value
        elif name in _REQUEST:
            own[name] = value
        else:
            raise TypeError(f"no key {name!r} in a compile request")
    out = replace(req, mesh=replace(req.mesh, **mesh), model=replace(req.model, **model), **own)
    if training.get("recompute") is True:   # every stage, counted on the mesh as changed
        training["recompute"] = tuple(range(out.num_stages))
    return replace(out, training=replace(out.training, **training))


def graph_key(req: CompileRequest) -> str:
    """What the front end reads of ``req`` (the model, the training config, the counts, dp and tp, and the host a
    compile of it times on): requests with equal keys get one stage graph (tests that compile many candidates)."""
    from pipec.compiler.frontend import Host

    mesh = req.mesh
    return repr((req.model, req.training, req.num_stages, req.num_microbatches, mesh.dp, mesh.tp,
                 mesh.sequence_parallel, req.tensor_parallel, Host.of(mesh)))
