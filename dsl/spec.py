"""The Spec: one resolved, typed value per key, each with where it came from.

A :class:`Spec` is what the language hands the compiler. ``spec["pp"]`` and
``spec.pp`` read a value; ``spec.source("pp")`` says where it came from
(``examples/gpt.pipe:4:4``, ``flag --ranks`` or ``default``); ``to_json()``
is plan.json's ``spec``. Later passes locate their own complaints about a
key with :meth:`Spec.error_at` and :meth:`Spec.warn_at` (a split point the
model lacks, a predicted bubble above 50%).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from pipec.dsl import ast
from pipec.dsl.ast import NO_SPAN, Span
from pipec.dsl.errors import DSLError, DSLWarning, Source
from pipec.schedules.order import ComputeOrder, ScheduleError, loop_placement, v_placement

__all__ = ["Origin", "Spec"]


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
    _cache: dict = field(default_factory=dict, repr=False)

    # --- reading

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("values", "origins", "warnings", "anchor"):
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
        placement, pp, stages = self.values["placement"], self.values["pp"], self.values["stages"]
        if placement == "loop":
            return loop_placement(pp, stages)
        if placement == "v":
            return v_placement(pp, stages)
        return tuple(placement)

    def to_json(self) -> dict[str, Any]:
        """plan.json's ``spec``: every key's resolved value, JSON-ready."""
        from pipec.dsl.kinds import to_json

        return {key: to_json(value) for key, value in self.values.items()}

    # --- custom schedules

    def compute_order(self) -> ComputeOrder | None:
        """The order a ``policy`` or ``order`` defines; None for a named schedule.

        A policy that cannot run for these counts raises a :class:`DSLError`
        located at the policy.
        """
        if self.custom == "order":
            return self.values["order"].order
        if self.custom != "policy":
            return None
        if "order" not in self._cache:
            from pipec.schedules.policy import policy_order

            policy = self.values["policy"].policy(
                placement=self.values["placement"], num_ranks=self.values["pp"],
                num_microbatches=self.values["microbatches"], num_chunks=self.values["virtual"])
            try:
                self._cache["order"] = policy_order(
                    policy, num_ranks=self.values["pp"], num_microbatches=self.values["microbatches"],
                    num_chunks=self.values["virtual"])
            except ScheduleError as err:
                raise self.error_at("policy", str(err)) from None
        return self._cache["order"]

    # --- locating later complaints

    def _where(self, key: str, index: int | None, fallback: tuple[str, ...]) -> tuple[Source, Span, str]:
        origin = self.origins[key]
        if origin.kind == "default" or origin.source is None:
            note = f"{key} was not set; its default is used ({origin.note or 'default'})"
            for other in fallback:
                o = self.origins.get(other)
                if o is not None and o.given and o.source is not None:
                    return o.source, o.span, note
            return self.anchor or Source("<defaults>", ""), NO_SPAN, note
        span = origin.span
        node = origin.node
        if index is not None and node is not None:
            items = getattr(node, "items", None) or getattr(node, "args", None)
            if items and 0 <= index < len(items):
                span = items[index].span
        return origin.source, span, ""

    def error_at(self, key: str, message: str, *hints: str, index: int | None = None,
                 fallback: tuple[str, ...] = ()) -> DSLError:
        """A :class:`DSLError` located at ``key``'s value (its ``index``-th item
        when the value is a list, e.g. one split point); raise it. When ``key``
        was left at its default, it points at the first given key of ``fallback``
        (else the file's start) and says so."""
        source, span, note = self._where(key, index, fallback)
        return source.error(span, message, *hints, note)

    def warn_at(self, key: str, message: str, *hints: str, fallback: tuple[str, ...] = ()) -> DSLWarning:
        """A :class:`DSLWarning` located like :meth:`error_at` (for example the
        driver's "a predicted bubble above 50%": ``warn_at("microbatches", ...,
        fallback=("schedule", "pp"))``)."""
        source, span, note = self._where(key, None, fallback)
        return source.warning(span, message, *hints, note)
