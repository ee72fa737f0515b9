"""Located errors and warnings that read like a compiler's.

Every problem in a schedule file (or a flag) is reported at the text that
caused it::

    examples/gpt.pipe:3:1: error: unknown key 'microbatchs'
        microbatchs 8
        ^~~~~~~~~~~
    did you mean 'microbatches'?

:class:`DSLError` is a ``ValueError`` (a user can cause it); :class:`DSLWarning`
carries the same location for settings that are legal but wasteful. Flags are
located in a one-line "source" of their own, ``<command line>``, that shows
the flags the user gave.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Iterable

from pipec.compiler.request import Location  # one place type: the compile request's origins use it too
from pipec.dsl.ast import NO_SPAN, Span
from pipec.errors import PipecError

__all__ = ["Location", "Source", "DSLError", "DSLWarning", "did_you_mean", "suggest"]


class Source:
    """A named text that spans point into: a schedule file, a CSV file, or the
    command line."""

    __slots__ = ("name", "text", "_lines")

    def __init__(self, name: str, text: str) -> None:
        self.name = name
        self.text = text
        self._lines = text.split("\n")

    def line(self, number: int) -> str:
        if 1 <= number <= len(self._lines):
            return self._lines[number - 1].rstrip("\r")
        return ""

    def locate(self, span: Span) -> Location:
        """The location of a span; a span without a position points at 1:1."""
        if span is NO_SPAN or span.line < 1:
            return Location(self.name, 1, 1, 2, self.line(1))
        text = self.line(span.line)
        end = span.end_col if span.end_line == span.line else len(text) + 1
        end = max(end, span.col + 1)
        return Location(self.name, span.line, span.col, end, text)

    def error(self, span: Span, message: str, *hints: str) -> "DSLError":
        return DSLError(message, self.locate(span), hints)

    def warning(self, span: Span, message: str, *hints: str) -> "DSLWarning":
        return DSLWarning(message, self.locate(span), tuple(h for h in hints if h))

    def start(self) -> Location:
        """The source's first line: where a complaint about a default points when nothing else fits."""
        return self.locate(NO_SPAN)


def _render(kind: str, message: str, loc: Location, hints: Iterable[str]) -> str:
    out = [f"{loc}: {kind}: {message}"]
    if loc.source_line:
        # Tabs become one space in both lines so the caret stays under its column.
        line = loc.source_line.replace("\t", " ")
        width = max(1, min(loc.end_col, len(line) + 1) - loc.col)
        out.append("    " + line)
        out.append("    " + " " * (loc.col - 1) + "^" + "~" * (width - 1))
    out.extend(h for h in hints if h)
    return "\n".join(out)


class _Located:
    """``file``, ``line`` and ``col`` of a diagnostic's :class:`Location`."""

    __slots__ = ()
    location: Location

    @property
    def file(self) -> str:
        return self.location.file

    @property
    def line(self) -> int:
        return self.location.line

    @property
    def col(self) -> int:
        return self.location.col


class DSLError(_Located, PipecError):
    """A schedule file or flag the language refuses, with its location.

    ``str()`` renders it like a compiler: ``file:line:col: error: message``,
    the source line, a caret under the offending text, then hints.
    """

    located = True

    def __init__(self, message: str, location: Location, hints: Iterable[str] = ()) -> None:
        self.message = message
        self.location = location
        self.hints = tuple(h for h in hints if h)
        super().__init__(_render("error", message, location, self.hints))

    @property
    def source_line(self) -> str:
        return self.location.source_line

    def __str__(self) -> str:
        return self.args[0]

    def __reduce__(self):  # picklable despite the keyword-only location
        return (type(self), (self.message, self.location, self.hints))


@dataclass(frozen=True, slots=True)
class DSLWarning(_Located):
    """A legal but wasteful setting (1f1b with fewer microbatches than ranks),
    or a note (``level="note"``: the trace fell back to torch.export), located
    like a :class:`DSLError`; ``str()`` renders ``... warning: ...``."""

    message: str
    location: Location
    hints: tuple[str, ...] = ()
    level: str = "warning"
    verbose_hints: tuple[str, ...] = ()
    """Lines shown only when asked (``--verbose``): a note's word that its key was left at its default."""

    def __str__(self) -> str:
        return _render(self.level, self.message, self.location, self.hints)

    def render(self, verbose: bool = False) -> str:
        """``str()``, with :attr:`verbose_hints` when ``verbose``."""
        return _render(self.level, self.message, self.location, (*self.hints, *(self.verbose_hints if verbose else ())))


def suggest(word: str, candidates: Iterable[str]) -> str | None:
    """The candidate closest to ``word`` (difflib), or None if none is close."""
    cands = list(candidates)
    lowered = {c.lower(): c for c in cands}
    if word.lower() in lowered and lowered[word.lower()] != word:
        return lowered[word.lower()]
    match = difflib.get_close_matches(word, cands, n=1, cutoff=0.6)
    if not match:
        match = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.6)
        match = [lowered[m] for m in match]
    return match[0] if match else None


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """``"did you mean 'x'?"`` for the closest candidate, or ``""``."""
    best = suggest(word, candidates)
    return f"did you mean '{best}'?" if best else ""
