"""The compile request: everything the compiler is asked to build, and where each part came from.

The language (``pipec.dsl``) resolves a schedule file and its flags into one
:class:`CompileRequest`; :func:`pipec.compiler.driver.compile_request` turns
it into a verified plan. The request is owned by the compiler, frozen, and
free of torch and of the language: a schedule is chosen by name, by a
:class:`~pipec.schedules.policy.Policy`, or by an explicit per-rank order of
actions; the mesh is the plan's own :class:`~pipec.compiler.ir.plan.Mesh`; the
model is named by its target, not built; a tensor is a :class:`TensorSpec`
(the one type from the schedule file's ``input`` to the front end's trace).

The request is the one source of every value: plan.json is written from its
typed fields (:meth:`CompileRequest.spec_json` writes the ``spec``), and a
key of the training config or of the mesh reaches it by field name, so such
a key needs the key table, its field and its consumer, nothing more.

Every field comes from a schedule-file key, and :attr:`CompileRequest.origins`
says, per key, where its value was written (:class:`KeyOrigin`: a file
position, a flag, or a default). A later pass that rejects a value raises a
:class:`~pipec.errors.PipecError` with ``key=`` (and ``index=`` for one item
of a list, such as one split point); the language's boundary reads the origin
and prints the complaint at that key, ``file:line:col`` with a caret, once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Sequence, Union

from pipec.compiler.config import DEFAULTS, TrainingConfig
from pipec.compiler.ir.plan import DEFAULT_LINKS, Link, Mesh, TensorSpec
from pipec.compiler.ir.tensor_parallel import STYLES as TP_STYLES
from pipec.errors import PipecError
from pipec.schedules.order import Action
from pipec.schedules.policy import Policy

__all__ = ["Location", "KeyOrigin", "DEFAULT_ORIGIN", "TensorSpec", "check_batch", "BALANCE_BY", "Partition",
           "ModelSpec", "CompileRequest", "TP_STYLES", "TensorParallelPlan", "tensor_parallel_json"]

TensorParallelPlan = Union[str, tuple[tuple[str, str], ...]]
"""Key ``tensor_parallel``: ``"auto"``, or (module-path glob, style) pairs."""


@dataclass(frozen=True, slots=True)
class Location:
    """A place in a source (a schedule file, a CSV file, or the command line):
    1-based line and column, the end column of the caret (exclusive; on the
    same line), and the text of the line."""

    file: str
    line: int
    col: int
    end_col: int
    source_line: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyOrigin:
    """Where a key's value came from: written in a file or given as a flag
    (``location``; ``items``: each item of a list value), or a default
    (``note`` says which)."""

    kind: str
    """``"file"``, ``"flag"`` or ``"default"``."""
    location: Location | None = None
    items: tuple[Location, ...] = ()
    flag: str = ""
    """The flag, for ``kind == "flag"`` (``--ranks``)."""
    note: str = ""
    """For a default: why it has that value (``2 x pp``)."""

    @property
    def given(self) -> bool:
        return self.kind != "default"

    def at(self, index: int | None) -> Location | None:
        """The ``index``-th item's location, else the whole value's."""
        if index is not None and 0 <= index < len(self.items):
            return self.items[index]
        return self.location

    def __str__(self) -> str:
        if self.kind == "file" and self.location is not None:
            return str(self.location)
        if self.kind == "flag":
            return f"flag {self.flag}"
        return f"default ({self.note})" if self.note else "default"


DEFAULT_ORIGIN = KeyOrigin(kind="default")


def check_batch(inputs: Sequence[TensorSpec], num_microbatches: int) -> None:
    """Refuse a microbatch count that does not divide the inputs' batch (their dim 0), naming counts that do
    (key ``microbatches``): the one check of this rule, for the language and the front end."""
    for t in inputs:
        batch = t.shape[0]
        if batch % num_microbatches:
            raise PipecError(f"microbatches {num_microbatches} does not divide the input's batch of {batch}",
                             key="microbatches", hints=("use one of " + ", ".join(map(str, _divisors(batch))),))


def _divisors(n: int, most: int = 12) -> list[int]:
    """The smallest divisors of n (at most ``most``), in O(sqrt n)."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))[:most]


BALANCE_BY = ("params", "flops", "time", "memory")
"""The measures ``balanced(by=...)`` evens out across the stages."""


@dataclass(frozen=True, slots=True)
class Partition:
    """How the model is cut into stages (key ``partition``), one type from the schedule file to the model
    layer's :func:`~pipec.model.partition.assign_stages`: ``auto`` (the model's ``pipe_split()`` markers if it
    has any, else balanced by flops), ``markers``, ``balanced`` by a measure, or ``split`` before the named
    modules (in model order). Torch-free, so that the language, the compiler and the model layer share it."""

    method: str
    """``"auto"``, ``"markers"``, ``"balanced"`` or ``"split"``."""
    by: str | None = None
    """For ``balanced``: one of :data:`BALANCE_BY`."""
    split_before: tuple[str, ...] = ()
    """For ``split``: the module paths a new stage starts at, such as ``layers.4``; S - 1 of them (``index``
    of a complaint counts these)."""

    def text(self) -> str:
        """The schedule-file syntax that writes it."""
        if self.method == "split":
            return "split before " + ", ".join(self.split_before)
        if self.method == "balanced":
            return f"balanced(by={self.by})"
        return self.method

    def to_json(self) -> dict[str, Any]:
        """plan.json's ``spec.partition``."""
        out: dict[str, Any] = {"method": self.method}
        if self.by is not None:
            out["by"] = self.by
        if self.split_before:
            out["split_before"] = list(self.split_before)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """The model to trace, partition and cost (keys ``model`` and the keys that shape its trace; the ones
    a run reads too, such as ``dtype``, ``recompute`` and ``peak_flops``, are the training config's)."""

    target: str
    """``"pkg.module:factory"`` or ``"file.py:factory"`` (key ``model``)."""
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Factory arguments (key ``model_args``)."""
    inputs: tuple[TensorSpec, ...]
    """One dp replica's batch (key ``input``)."""
    partition: Partition
    costs: str
    """``"unit"``, ``"flops"`` or ``"profile"``."""
    trace: str
    """``"auto"``, ``"fx"`` or ``"export"``."""
    search_path: tuple[str, ...] = ()
    """Absolute folders searched for the model's module, in order: the schedule
    file's folder, then the current folder (no repeats)."""
    targets: tuple[TensorSpec, ...] = ()
    """What the loss takes, one dp replica's batch (key ``targets``); empty: derived from the traced output
    and the loss (the loss and the data are the training config's)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CompileRequest:
    """What to compile: a schedule on a mesh, optionally for a model (see the module docstring).

    Each value has one home here, and plan.json is written from these fields: the mesh becomes the
    plan's ``mesh``, the counts and placement its ``num_stages``, ``num_microbatches`` and ``placement``,
    the links its ``links``, and the rest its ``spec`` (:meth:`spec_json`)."""

    schedule: str
    """A named schedule (``"1f1b"``), ``"policy"`` or ``"order"``."""
    policy: Policy | None = None
    """For ``schedule == "policy"``: the policy, its counts bound."""
    order: tuple[tuple[Action, ...], ...] | None = None
    """For ``schedule == "order"``: each pp rank's actions, in order."""
    mesh: Mesh
    """pp x dp x tp, the sharding and the nodes (keys ``pp``, ``dp``, ``tp``, ``shard``, ``shard_size``,
    ``devices_per_node``)."""
    tensor_parallel: TensorParallelPlan = "auto"
    """How each stage's modules are split across its tp ranks (key ``tensor_parallel``): ``"auto"`` (the
    sharding pass decides), or (glob pattern over module paths, style) pairs, in the order written, style one
    of :data:`TP_STYLES`. Only read with ``mesh.tp`` > 1; whether a pattern matches a module is the pass's check."""
    num_chunks: int = 1
    """Stages per pp rank (key ``virtual``)."""
    placement: tuple[int, ...] | None = None
    """The pp rank of every stage (key ``placement``); None: the named schedule's own."""
    num_microbatches: int
    links: Mapping[str, Link] = field(default_factory=lambda: dict(DEFAULT_LINKS))
    model: ModelSpec | None = None
    device_memory: int | None = None
    """Bytes one device holds: a plan needing more on some rank is refused (key ``device_memory``)."""
    training: TrainingConfig = DEFAULTS
    """The training settings, typed (``init`` as given: the front end resolves ``auto``)."""
    origins: Mapping[str, KeyOrigin] = field(default_factory=dict)
    """Per key, where its value came from."""

    @property
    def pp(self) -> int:
        return self.mesh.pp

    @property
    def dp(self) -> int:
        return self.mesh.dp

    @property
    def tp(self) -> int:
        return self.mesh.tp

    @property
    def num_stages(self) -> int:
        return len(self.placement) if self.placement is not None else self.pp * self.num_chunks

    def origin(self, key: str) -> KeyOrigin:
        """Where ``key``'s value came from (a default when the request does not say)."""
        return self.origins.get(key, DEFAULT_ORIGIN)

    def spec_json(self) -> dict[str, Any]:
        """plan.json's ``spec``: every resolved key that the plan's other fields do not hold, JSON-ready.
        A field that does not apply is absent (``policy`` but for a policy schedule, ``input`` without a
        model); a schedule-only plan's costs are ``unit``."""
        out: dict[str, Any] = {"schedule": self.schedule}
        if self.policy is not None:
            out["policy"] = _policy_json(self.policy, self.pp)
        if self.order is not None:
            out["order"] = {"ranks": [" ".join(map(str, actions)) for actions in self.order]}
        m = self.model
        if m is not None:
            out["input"] = [t.to_json() for t in m.inputs]
            if m.targets:
                out["targets"] = [t.to_json() for t in m.targets]
            out["partition"] = m.partition.to_json()
            out["trace"] = m.trace
        out["costs"] = m.costs if m is not None else "unit"
        if self.mesh.tp > 1:
            out["tensor_parallel"] = tensor_parallel_json(self.tensor_parallel)
        out["device_memory"] = self.device_memory
        return out | self.training.to_json()


def tensor_parallel_json(plan: TensorParallelPlan) -> Any:
    """plan.json's ``spec.tensor_parallel``: ``"auto"``, or ``[{"module": pattern, "style": style}, ...]``."""
    return plan if isinstance(plan, str) else [{"module": m, "style": st} for m, st in plan]


def _policy_json(policy: Policy, num_ranks: int) -> dict[str, Any]:
    """A bound policy's settings; one that is a function of the rank as its value on each pp rank."""
    return {f.name: [value(r) for r in range(num_ranks)] if callable(value := getattr(policy, f.name)) else value
            for f in fields(policy)}
