"""Value kinds: what a key accepts, how its value is written and checked.

This module holds the scalar kinds (numbers, quantities with units, names,
strings, targets) and the helpers every kind uses; the structured ones
(optimizer, links, policy, order, ...) are in :mod:`pipec.dsl.structured`.
Each key of the table (:mod:`pipec.dsl.keys`) has one kind. A kind turns a
syntax-tree value into the key's typed value (raising a located error at the
offending part), prints a typed value back as schedule-file text
(``show``, used for defaults in the reference page and for flags given as
Python values). Cross-key rules live in :mod:`pipec.dsl.check`.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from pipec.dsl import ast
from pipec.dsl.errors import DSLError, Source, did_you_mean
from pipec.dsl.fmt import value_text
from pipec.dsl.values import literal_text

__all__ = [
    "Ctx", "Kind", "Int", "Real", "Unit", "Choice", "Maybe", "Text", "Target", "SIZE", "DURATION",
    "BANDWIDTH", "FLOP_RATE", "UNIT_KINDS", "literal", "settings_of", "unknown_setting", "number_of", "got",
]


@dataclass(frozen=True, slots=True)
class Ctx:
    """Where a value is being converted: its key, its source, the folder that
    relative paths are relative to."""

    key: str
    source: Source
    base_dir: str = "."

    def error(self, node: Any, message: str, *hints: str) -> DSLError:
        return self.source.error(node.span, message, *hints)


def got(node: ast.Node) -> str:
    if isinstance(node, ast.Word):
        return f"'{node.name}'"
    if isinstance(node, (ast.Number, ast.Quantity)):
        return node.text
    if isinstance(node, ast.String):
        return f'the string "{node.value}"'
    return ast.describe(node)


def number_of(node: ast.Node, ctx: Ctx) -> int | float | None:
    """A plain (possibly negative) number, or None if the node is not one."""
    sign = 1
    if isinstance(node, ast.Neg) and isinstance(node.operand, ast.Number):
        sign, node = -1, node.operand
    if not isinstance(node, ast.Number):
        return None
    if isinstance(node.value, float) and not math.isfinite(node.value):
        raise ctx.error(node, f"number {node.text} is out of range")
    return sign * node.value


class Kind:
    """Base kind. ``doc`` describes the accepted values for the reference page."""

    __slots__ = ()
    doc = "a value"

    def convert(self, node: ast.Node, ctx: Ctx) -> Any:
        raise NotImplementedError

    def show(self, value: Any) -> str:
        return "none" if value is None else str(value)

    def raw_flag(self, text: str) -> bool:
        """Whether a flag's text is taken verbatim as a string (a path, a target)."""
        return False

    def _wrong(self, node: ast.Node, ctx: Ctx, *hints: str) -> DSLError:
        return ctx.error(node, f"{ctx.key} needs {self.doc}, got {got(node)}", *hints)


@dataclass(frozen=True, slots=True)
class Int(Kind):
    lo: int = 0
    hi: int | None = None
    limit: str = ""
    """Names the DESIGN limit that ``hi`` is (``"pipeline ranks"``)."""

    @property
    def doc(self) -> str:
        return f"a whole number >= {self.lo}" + (f" and <= {self.hi}" if self.hi is not None else "")

    def convert(self, node: ast.Node, ctx: Ctx) -> int:
        value = number_of(node, ctx)
        if value is None:
            raise self._wrong(node, ctx)
        if isinstance(value, float):
            raise ctx.error(node, f"{ctx.key} needs a whole number, got {value:g}")
        if value < self.lo:
            raise ctx.error(node, f"{ctx.key} must be at least {self.lo}, got {value}")
        if self.hi is not None and value > self.hi:
            if self.limit:
                raise ctx.error(node, f"{ctx.key} {value} is beyond pipec's limit of {self.hi} {self.limit}")
            raise ctx.error(node, f"{ctx.key} must be at most {self.hi}, got {value}")
        return value


@dataclass(frozen=True, slots=True)
class Real(Kind):
    lo: float = 0.0
    lo_open: bool = False
    hi: float | None = None

    @property
    def bounds(self) -> str:
        bound = f"> {self.lo:g}" if self.lo_open else f">= {self.lo:g}"
        return bound + (f" and <= {self.hi:g}" if self.hi is not None else "")

    @property
    def doc(self) -> str:
        return f"a number {self.bounds}"

    def convert(self, node: ast.Node, ctx: Ctx) -> float:
        value = number_of(node, ctx)
        if value is None:
            raise self._wrong(node, ctx)
        if value < self.lo or (self.lo_open and value == self.lo) or (self.hi is not None and value > self.hi):
            raise ctx.error(node, f"{ctx.key} must be {self.bounds}, got {value:g}")
        return float(value)

    def show(self, value: Any) -> str:
        return "none" if value is None else f"{value:g}"


@dataclass(frozen=True, slots=True)
class Unit(Kind):
    """A quantity with a unit (``80GB``, ``10us``); a plain number is in ``base``."""

    what: str
    base: str
    units: Mapping[str, float]
    example: str
    integer: bool = False
    positive: bool = True

    @property
    def doc(self) -> str:
        return f"{self.what} such as {self.example}"

    def convert(self, node: ast.Node, ctx: Ctx) -> float | int:
        value = number_of(node, ctx)
        if value is None:
            if not isinstance(node, ast.Quantity):
                raise self._wrong(node, ctx)
            scale = self.units.get(node.unit)
            if scale is None:
                other = next((u for u in UNIT_KINDS if node.unit in u.units), None)
                if other is not None:
                    raise ctx.error(node, f"{ctx.key} needs {self.doc}, got {node.text}, {other.what}")
                raise ctx.error(node, f"unknown unit '{node.unit}' for {self.what}",
                                did_you_mean(node.unit, self.units) or "units: " + ", ".join(self.units))
            # decimal arithmetic: 10us is exactly 1e-05 s, as a user means it
            number_text = node.text[: len(node.text) - len(node.unit)]
            try:
                value = float(Decimal(number_text) * Decimal(repr(float(scale))))
            except ArithmeticError:  # a decimal overflow: an absurd exponent
                value = math.inf
            if not math.isfinite(value):
                raise ctx.error(node, f"{node.text} is out of range")
        if value < 0 or (self.positive and value == 0):
            raise ctx.error(node, f"{ctx.key} must be {'positive' if self.positive else '>= 0'}, got {value:g}")
        return int(round(value)) if self.integer else float(value)

    def show(self, value: Any) -> str:
        """The value in the largest decimal unit that writes it exactly (else the base unit)."""
        if value is None:
            return "none"
        for unit, scale in sorted(self.units.items(), key=lambda u: -u[1]):
            if "i" in unit or scale > value:
                continue
            text = f"{value / scale:g}"
            if float(text) * scale == value:
                return text + unit
        return str(value) if self.integer else repr(float(value))


SIZE = Unit("a size", "B", {
    "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
    "KiB": 2.0**10, "MiB": 2.0**20, "GiB": 2.0**30, "TiB": 2.0**40,
}, "80GB", integer=True)
DURATION = Unit("a time", "s", {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "ms": 1e-3, "s": 1.0},
                "10us", positive=False)
BANDWIDTH = Unit("a bandwidth", "B/s", {
    "B/s": 1, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12,
    "KiB/s": 2.0**10, "MiB/s": 2.0**20, "GiB/s": 2.0**30, "Gbit/s": 1.25e8,
}, "25GB/s")
FLOP_RATE = Unit("a FLOP rate", "FLOP/s", {
    "FLOP/s": 1, "GFLOP/s": 1e9, "TFLOP/s": 1e12, "PFLOP/s": 1e15, "GFLOPS": 1e9, "TFLOPS": 1e12,
    "PFLOPS": 1e15,
}, "312TFLOP/s")
UNIT_KINDS = (SIZE, DURATION, BANDWIDTH, FLOP_RATE)


@dataclass(frozen=True, slots=True)
class Choice(Kind):
    options: tuple[str, ...]
    elsewhere: Callable[[str], tuple[str, str] | None] | None = None
    """A name known outside pipec -> (message, hint) said instead of a did-you-mean (torch's schedule names)."""

    @property
    def doc(self) -> str:
        return "one of " + ", ".join(self.options)

    def convert(self, node: ast.Node, ctx: Ctx) -> str:
        if isinstance(node, ast.Word) and node.name in self.options:
            return node.name
        if isinstance(node, ast.String) and node.value in self.options:
            raise ctx.error(node, f"{ctx.key} takes a bare name, not a string",
                            f"write it without quotes: {ctx.key} {node.value}")
        if isinstance(node, (ast.Word, ast.String, ast.Number)):
            text = node.name if isinstance(node, ast.Word) else getattr(node, "value", None)
            text = node.text if isinstance(node, ast.Number) else text
            known = self.elsewhere(str(text)) if self.elsewhere is not None else None
            if known is not None:
                raise ctx.error(node, *known)
            raise ctx.error(node, f"unknown {ctx.key} '{text}'",
                            did_you_mean(str(text), self.options) or f"{ctx.key} is one of: "
                            + ", ".join(self.options))
        raise self._wrong(node, ctx)


@dataclass(frozen=True, slots=True)
class Switch(Kind):
    """``on`` or ``off``, as a bool."""

    doc = "on or off"

    def convert(self, node: ast.Node, ctx: Ctx) -> bool:
        if isinstance(node, ast.Word) and node.name in ("on", "off"):
            return node.name == "on"
        if isinstance(node, ast.String) and node.value in ("on", "off"):
            raise ctx.error(node, f"{ctx.key} takes a bare name, not a string",
                            f"write it without quotes: {ctx.key} {node.value}")
        raise self._wrong(node, ctx, f"write {ctx.key} on, or {ctx.key} off")

    def show(self, value: Any) -> str:
        return "on" if value else "off"


@dataclass(frozen=True, slots=True)
class Maybe(Kind):
    """``none``, or a value of ``inner``."""

    inner: Kind

    @property
    def doc(self) -> str:
        return f"{self.inner.doc}, or none"

    def convert(self, node: ast.Node, ctx: Ctx) -> Any:
        if isinstance(node, ast.Word) and node.name == "none":
            return None
        return self.inner.convert(node, ctx)

    def show(self, value: Any) -> str:
        return "none" if value is None else self.inner.show(value)

    def raw_flag(self, text: str) -> bool:
        return text != "none" and self.inner.raw_flag(text)


@dataclass(frozen=True, slots=True)
class Text(Kind):
    """A string such as a folder: quoted, or a bare name."""

    doc = 'a string such as "ckpt/run1"'

    def convert(self, node: ast.Node, ctx: Ctx) -> str:
        if isinstance(node, ast.String):
            if not node.value:
                raise ctx.error(node, f"{ctx.key} must not be empty")
            return node.value
        if isinstance(node, (ast.Word, ast.Path)):
            return node.name if isinstance(node, ast.Word) else node.text
        raise self._wrong(node, ctx, f'quote it: {ctx.key} "..."')

    def show(self, value: Any) -> str:
        return "none" if value is None else literal_text(value)

    def raw_flag(self, text: str) -> bool:
        return not text.startswith('"')


_TARGET = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


@dataclass(frozen=True, slots=True)
class Target(Kind):
    """``"pkg.module:function"``, or one of a few built-in names."""

    builtins: tuple[str, ...] = ()

    @property
    def doc(self) -> str:
        names = " or ".join(self.builtins)
        return (names + ", or " if names else "") + 'a "pkg.module:function" string'

    def convert(self, node: ast.Node, ctx: Ctx) -> str:
        if isinstance(node, ast.Word) and self.builtins:
            if node.name in self.builtins:
                return node.name
            raise ctx.error(node, f"unknown {ctx.key} '{node.name}'",
                            did_you_mean(node.name, self.builtins)
                            or f'{ctx.key} is one of {", ".join(self.builtins)}, or "pkg.module:function"')
        if not isinstance(node, ast.String):
            raise self._wrong(node, ctx)
        if not _TARGET.fullmatch(node.value):
            raise ctx.error(node, f"{ctx.key} must be \"pkg.module:function\", got \"{node.value}\"",
                            "a dotted module path, a colon, then the function's name")
        return node.value

    def show(self, value: Any) -> str:
        if value is None:
            return "none"
        return value if value in self.builtins else literal_text(value)

    def raw_flag(self, text: str) -> bool:
        return ":" in text and not text.startswith('"')


def literal(node: ast.Node, ctx: Ctx, what: str = "a literal") -> Any:
    """A literal: number, string, true/false/on/off, none, a bare word, or a tuple of them."""
    number = number_of(node, ctx)
    if number is not None:
        return number
    if isinstance(node, ast.String):
        return node.value
    if isinstance(node, ast.Path):
        return node.text
    if isinstance(node, ast.Word):
        return {"true": True, "on": True, "false": False, "off": False, "none": None}.get(node.name, node.name)
    if isinstance(node, (ast.Group, ast.List)) and not getattr(node, "kwargs", ()):
        items = node.args if isinstance(node, ast.Group) else node.items
        return tuple(literal(i, ctx, what) for i in items)
    raise ctx.error(node, f"expected {what} (a number, string, name, or a tuple of them), got {ast.describe(node)}")


def settings_of(node: ast.Node, ctx: Ctx, what: str) -> list[ast.Kwarg]:
    """The ``name=value`` settings of a group or call; positional or repeated ones are refused."""
    args = node.args if isinstance(node, (ast.Group, ast.Call)) else ()
    kwargs = node.kwargs if isinstance(node, (ast.Group, ast.Call)) else ()
    if args:
        first = args[0]
        if isinstance(first, ast.Typed):
            raise ctx.error(first, f"write {what} settings as name=value, not name: value",
                            f"for example {value_text(first.name)}={value_text(first.type)}")
        raise ctx.error(first, f"{what} settings are written name=value")
    seen: dict[str, ast.Kwarg] = {}
    for kw in kwargs:
        if kw.name.name in seen:
            raise ctx.error(kw.name, f"'{kw.name.name}' is set twice in {what}")
        seen[kw.name.name] = kw
    return list(kwargs)


def unknown_setting(kw: ast.Kwarg, ctx: Ctx, what: str, known) -> DSLError:
    return ctx.error(kw.name, f"unknown {what} setting '{kw.name.name}'",
                     did_you_mean(kw.name.name, known) or f"{what} settings: " + ", ".join(known))
