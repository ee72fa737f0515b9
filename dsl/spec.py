"""The Spec: one resolved, typed value per key, each with where it came from.

``spec["pp"]`` and ``spec.pp`` read a value; ``spec.source("pp")`` says where
it came from (``examples/gpt.pipe:4:4``, ``flag --ranks`` or ``default``);
``to_json()`` is plan.json's ``spec``. What the language hands the compiler
is ``spec.request``, a :class:`~pipec.compiler.request.CompileRequest`; a
later pass's complaint about a key (a split point the model lacks, a
predicted bubble above 50%) comes back through :meth:`Spec.locate`, which
prints it at that key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from pipec.compiler.request import CompileRequest
from pipec.dsl import ast
from pipec.dsl.ast import NO_SPAN, Span
from pipec.dsl.errors import DSLWarning, Source
from pipec.schedules.order import loop_placement, v_placement

__all__ = ["Origin", "Spec", "placement_ranks"]


def placement_ranks(placement: str | tuple[int, ...], num_ranks: int, num_stages: int) -> tuple[int, ...]:
    """The pp rank of every stage of a ``placement`` value (``loop``, ``v`` or a list)."""
    if placement == "loop":
        return loop_placement(num_ranks, num_stages)
    if placement == "v":
        return v_placement(num_ranks, num_stages)
    return tuple(placement)


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a key's value came from: the file (a span in ``source``), a flag
    (a span in the command line), or a default (``note`` says which)."""

    kind: str
    """``"file"``, ``"flag"`` or ``"default"``."""
    source: Source | None = None
    span: Span = NO_SPAN
    flag: str = ""
    note: str = ""
    node: ast.Node | None = field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        if self.kind == "file":
            return f"{self.source.name}:{self.span.line}:{self.span.col}"
        if self.kind == "flag":
            return f"flag {self.flag}"
        return f"default ({self.note})" if self.note else "default"

    @property
    def given(self) -> bool:
        return self.kind != "default"


@dataclass(frozen=True, slots=True, eq=False)
class Spec:
    """Every key's resolved value (defaults filled in) and its origin.

    Values are plain Python values or the small frozen dataclasses of
    :mod:`pipec.dsl.values`; see ``docs/reference.md`` for each key's type.
    """

    values: Mapping[str, Any]
    origins: Mapping[str, Origin]
    warnings: tuple[DSLWarning, ...] = ()
    anchor: Source | None = None
    """Where errors about defaults point (the file, else the command line)."""
    request: CompileRequest | None = field(default=None, repr=False)
    """The keys resolved into the compiler's request."""

    # --- reading

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("values", "origins", "warnings", "anchor", "request"):
            raise AttributeError(name)
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(f"Spec has no key {name!r}") from None

    def __contains__(self, key: object) -> bool:
        return key in self.values

    def __iter__(self) -> Iterator[str]:
        return iter(self.values)

    def source(self, key: str) -> str:
        """Where ``key``'s value came from: ``file:line:col``, ``flag --x`` or ``default``."""
        return str(self.origins[key])

    @property
    def custom(self) -> str | None:
        """``"policy"`` or ``"order"`` for a custom schedule, None for a named one."""
        return self.values["schedule"] if self.values["schedule"] in ("policy", "order") else None

    def placement_ranks(self) -> tuple[int, ...]:
        """The pp rank of every stage (``placement`` resolved to a list)."""
        return placement_ranks(self.values["placement"], self.values["pp"], self.values["stages"])

    def to_json(self) -> dict[str, Any]:
        """plan.json's ``spec``, JSON-ready: the request's keys that the plan's other fields do not hold
        (:meth:`~pipec.compiler.request.CompileRequest.spec_json`)."""
        return self.request.spec_json()

    # --- the compiler's side

    def locate(self, complaint):
        """A later pass's error or diagnostic about a key, located where the key
        was written (see :func:`pipec.dsl.boundary.locate`)."""
        from pipec.dsl.boundary import locate

        return locate(complaint, self)
