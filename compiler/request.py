"""The compile request: everything the compiler is asked to build, and where each part came from.

The language (``pipec.dsl``) resolves a schedule file and its flags into one
:class:`CompileRequest`; :func:`pipec.compiler.driver.compile_request` turns
it into a verified plan. The request is owned by the compiler, frozen, and
free of torch and of the language: a schedule is chosen by name, by a
:class:`~pipec.schedules.policy.Policy`, or by an explicit per-rank order of
actions; the mesh is numbers; the model is named by its target, not built.

Every field comes from a schedule-file key, and :attr:`CompileRequest.origins`
says, per key, where its value was written (:class:`KeyOrigin`: a file
position, a flag, or a default). A later pass that rejects a value raises a
:class:`~pipec.errors.PipecError` with ``key=`` (and ``index=`` for one item
of a list, such as one split point); the language's boundary reads the origin
and prints the complaint at that key, ``file:line:col`` with a caret, once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from pipec.compiler.config import TrainingConfig
from pipec.compiler.ir.plan import DEFAULT_LINKS, Link
from pipec.schedules.order import Action
from pipec.schedules.policy import Policy

__all__ = ["Location", "KeyOrigin", "DEFAULT_ORIGIN", "InputTensor", "PartitionRequest", "ModelSpec",
           "CompileRequest"]


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


@dataclass(frozen=True, slots=True, kw_only=True)
class InputTensor:
    """One example input (key ``input``) or target (key ``targets``): one dp replica's batch, dim 0 split
    into microbatches."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionRequest:
    """How the model is cut (key ``partition``)."""

    method: str
    """``"auto"``, ``"markers"``, ``"balanced"`` or ``"split"``."""
    by: str | None = None
    """For ``balanced``: ``"params"``, ``"flops"``, ``"time"`` or ``"memory"``."""
    split_before: tuple[str, ...] = ()
    """For ``split``: the module paths a new stage starts at (``index`` of a complaint counts these)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """The model to trace, partition and cost (keys ``model`` and the keys that shape its trace)."""

    target: str
    """``"pkg.module:factory"`` or ``"file.py:factory"`` (key ``model``)."""
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Factory arguments (key ``model_args``)."""
    inputs: tuple[InputTensor, ...]
    partition: PartitionRequest
    costs: str
    """``"unit"``, ``"flops"`` or ``"profile"``."""
    trace: str
    """``"auto"``, ``"fx"`` or ``"export"``."""
    recompute: frozenset[int] = frozenset()
    dtype: str = "float32"
    peak_flops: float | None = None
    search_path: tuple[str, ...] = ()
    """Absolute folders searched for the model's module, in order: the schedule
    file's folder, then the current folder (no repeats)."""
    init: str = "auto"
    """How the initial weights are made (key ``init``): ``auto``, ``module`` or ``exact``."""
    targets: tuple[InputTensor, ...] = ()
    """What the loss takes, one dp replica's batch (key ``targets``); empty: derived from the traced output
    and the loss (the loss and the data are the training config's)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CompileRequest:
    """What to compile: a schedule on a mesh, optionally for a model (see the module docstring)."""

    schedule: str
    """A named schedule (``"1f1b"``), ``"policy"`` or ``"order"``."""
    policy: Policy | None = None
    """For ``schedule == "policy"``: the policy, its counts bound."""
    order: tuple[tuple[Action, ...], ...] | None = None
    """For ``schedule == "order"``: each pp rank's actions, in order."""
    pp: int
    dp: int = 1
    shard: str = "none"
    """How the dp replicas share each stage's state (key ``shard``; :data:`~pipec.compiler.ir.plan.SHARD_MODES`)."""
    shard_size: int | None = None
    """Replicas per shard group (key ``shard_size``); None: all of dp."""
    devices_per_node: int | None = None
    """Devices per node (key ``devices_per_node``): nodes hold that many consecutive global ranks, and with
    ``intra`` / ``inter`` links each hop is priced by where its ranks sit; None: not said."""
    num_chunks: int = 1
    """Stages per pp rank (key ``virtual``)."""
    placement: tuple[int, ...] | None = None
    """The pp rank of every stage (key ``placement``); None: the named schedule's own."""
    num_microbatches: int
    links: Mapping[str, Link] = field(default_factory=lambda: dict(DEFAULT_LINKS))
    model: ModelSpec | None = None
    device_memory: int | None = None
    """Bytes one device holds: a plan needing more on some rank is refused (key ``device_memory``)."""
    training: TrainingConfig | None = None
    """The training settings, typed; plan.json's ``spec`` records them (``init`` as the front end resolved
    it). None: the plan's ``spec`` is ``spec`` as given (an imported schedule)."""
    spec: Mapping[str, Any] = field(default_factory=dict)
    """plan.json's ``spec``: every key's resolved value, JSON-ready."""
    origins: Mapping[str, KeyOrigin] = field(default_factory=dict)
    """Per key, where its value came from."""

    @property
    def num_stages(self) -> int:
        return len(self.placement) if self.placement is not None else self.pp * self.num_chunks

    def origin(self, key: str) -> KeyOrigin:
        """Where ``key``'s value came from (a default when the request does not say)."""
        return self.origins.get(key, DEFAULT_ORIGIN)
