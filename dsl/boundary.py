"""The boundary between the language and the compiler, both ways.

Inward, :func:`request_of` resolves a Spec's keys into the compiler's
:class:`~pipec.compiler.request.CompileRequest`, each key with its
:class:`~pipec.compiler.request.KeyOrigin`. Outward, :func:`locate` turns a
complaint a later pass raised about a key (a :class:`~pipec.errors.PipecError`
with ``key=``/``index=``, or a :class:`~pipec.errors.Diagnostic`) into one that
prints where that key was written, ``file:line:col`` and a caret, once; for a
key left at its default, at the statement that made it matter (:data:`FALLBACK`),
saying so. Settings in a schedule's complaint are worded as the user wrote
them: ``--virtual 3`` for a flag, ``virtual 3`` for a file's key.
"""

from __future__ import annotations

import os
from dataclasses import fields
from typing import Any, Mapping

from pipec.compiler.config import TrainingConfig
from pipec.compiler.ir.plan import Mesh
from pipec.compiler.request import CompileRequest, KeyOrigin, Location, ModelSpec
from pipec.dsl.errors import DSLError, DSLWarning, Source
from pipec.dsl.keys import KEYS
from pipec.errors import Diagnostic, PipecError
from pipec.schedules.order import Worded

__all__ = ["FALLBACK", "request_of", "key_origin", "locate", "search_path"]

FALLBACK: Mapping[str, tuple[str, ...]] = {
    "microbatches": ("schedule", "pp"),
    "pp": ("schedule",),
    "virtual": ("schedule", "pp"),
    "stages": ("schedule", "pp"),
    "placement": ("schedule",),
    "partition": ("stages", "model"),
    "model_args": ("model",),
    "input": ("model",),
    "trace": ("model",),
    "init": ("model",),
    "costs": ("model",),
    "dtype": ("model",),
    "recompute": ("model",),
    "loss": ("model",),
    "targets": ("loss", "model"),
    "data": ("model",),
    "shard": ("dp",),
    "shard_size": ("shard", "dp"),
    "tensor_parallel": ("tp", "model"),
    "sequence_parallel": ("tp", "model"),
}
"""For a key left at its default, the keys whose statement made it matter, most telling first."""


def key_origin(origin) -> KeyOrigin:
    """The compiler's view of a :class:`~pipec.dsl.spec.Origin`: places, not syntax."""
    if not origin.given:
        return KeyOrigin(kind="default", note=origin.note)
    items = getattr(origin.node, "items", None) or getattr(origin.node, "args", None) or ()
    return KeyOrigin(kind=origin.kind, location=origin.source.locate(origin.span),
                     items=tuple(origin.source.locate(item.span) for item in items), flag=origin.flag)


def search_path(base_dir: str) -> tuple[str, ...]:
    """Where the model's module is looked for: the schedule file's folder, then the current folder."""
    folders = (os.path.abspath(base_dir), os.getcwd())
    return tuple(dict.fromkeys(folders))


def request_of(values: Mapping[str, Any], origins: Mapping[str, Any], *, policy, placement: tuple[int, ...],
               base_dir: str) -> CompileRequest:
    """The compile request of resolved keys (``policy``: the bound Policy of a policy schedule). The mesh
    and the training config take their keys by field name, so a key of either needs no line here."""
    model = None
    if values["model"]:
        model = ModelSpec(
            target=values["model"],
            kwargs=dict(values["model_args"] or {}),
            inputs=values["input"],
            partition=values["partition"],  # the compiler's Partition, as the language resolved it
            costs=values["costs"],
            trace=values["trace"],
            search_path=search_path(base_dir),
            targets=values["targets"] or (),
        )
    order = values["order"]
    return CompileRequest(
        schedule=values["schedule"],
        policy=policy,
        order=order.ranks if order is not None else None,
        # a Mesh field without a key keeps its default
        mesh=Mesh(**{f.name: values[f.name] for f in fields(Mesh) if f.name in KEYS}),
        tensor_parallel=values["tensor_parallel"],
        num_chunks=values["virtual"],
        placement=placement,
        num_microbatches=values["microbatches"],
        links=values["links"].as_dict(),
        model=model,
        device_memory=values["device_memory"],
        training=TrainingConfig(**{f.name: values[f.name] for f in fields(TrainingConfig)}),
        origins={key: key_origin(o) for key, o in origins.items()},
    )


def locate(complaint, spec):
    """``complaint`` (an error or a diagnostic about a key) located in ``spec``'s
    sources; one about no key, or already located, is returned as it is."""
    if isinstance(complaint, (DSLError, DSLWarning)) or complaint.key is None or (
            isinstance(complaint, PipecError) and complaint.located):
        return complaint
    req: CompileRequest = spec.request

    def name(key: str) -> str:
        return KEYS[key].flag if req.origin(key).kind == "flag" and key in KEYS else key

    message = complaint.worded(name) if isinstance(complaint, Worded) else (
        complaint.message if isinstance(complaint, Diagnostic) else str(complaint))
    location, note = _where(complaint, spec)
    if complaint.key == "order" and spec["order"] is not None:
        message = f"invalid order: {message}"
    if isinstance(complaint, Diagnostic):  # a warning's or note's key left at its default: only --verbose says so
        return DSLWarning(message, location, tuple(h for h in complaint.hints if h), level=complaint.level,
                          verbose_hints=(note,) if note else ())
    return DSLError(message, location, (*complaint.hints, note))


def _where(complaint, spec) -> tuple[Location, str]:
    """The location a complaint is printed at, and a note when its key was a default."""
    key, req = complaint.key, spec.request
    order = spec["order"]
    if key == "order" and order is not None and order.where is not None:
        source, span = order.where.place(getattr(complaint, "rank", None), complaint.index)
        return source.locate(span), ""
    if key == "policy" and spec.origins["policy"].given:
        return _policy_setting(spec, getattr(complaint, "rule", "").rpartition(".")[2]), ""
    origin = req.origin(key)
    if origin.given and origin.location is not None:
        return origin.at(complaint.index), ""
    note = f"{key} was not set; its default is used ({origin.note or 'default'})"
    for other in FALLBACK.get(key, ()):
        o = req.origin(other)
        if o.given and o.location is not None:
            return o.location, note
    anchor: Source = spec.anchor or Source("<defaults>", "")
    return anchor.start(), note


def _policy_setting(spec, setting: str) -> Location:
    """Where a policy's ``setting`` is written (``warmup=...``), else the policy."""
    origin = spec.origins["policy"]
    for kw in getattr(origin.node, "kwargs", ()):
        if kw.name.name == setting:
            return origin.source.locate(kw.value.span)
    return origin.source.locate(origin.span)
