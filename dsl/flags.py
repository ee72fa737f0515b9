"""Flags as the language reads them: one line of text, each value converted once.

The flags a user gave become one "source" of their own, ``<command line>``
(``--schedule zbv --ranks 4 --virtual 3``), so that a flag's error is
located like a file's (``<command line>:1:36:`` and a caret). :func:`read_flags`
parses and converts each flag's value by its key's kind, once, into
:class:`Flags`: each key's typed value with its syntax node and span. The
semantic pass takes these values as they are; it never prints them back to
text to parse them again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from pipec.dsl import ast
from pipec.dsl.ast import NO_SPAN, Span
from pipec.dsl.errors import DSLError, Source, did_you_mean
from pipec.dsl.keys import KEYS
from pipec.dsl.kinds import Ctx
from pipec.dsl.parse import parse_value
from pipec.dsl.values import literal_text

__all__ = ["Flag", "Flags", "read_flags", "command_line", "flag_node"]


@dataclass(frozen=True, slots=True)
class Flag:
    """One key given as a flag: its converted value and its syntax node in the command line."""

    key: str
    value: Any
    node: ast.Node


class Flags(Mapping[str, Any]):
    """The keys given as flags (key -> converted value), and ``source``, the
    command line their nodes' spans point into."""

    __slots__ = ("source", "entries")

    def __init__(self, source: Source, entries: Mapping[str, Flag]) -> None:
        self.source = source
        self.entries = dict(entries)

    def __getitem__(self, key: str) -> Any:
        return self.entries[key].value

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)


def command_line(overrides: Mapping[str, Any]) -> tuple[Source, list[tuple[str, str, Span]]]:
    """The flags as one line of text (the "source" of flag errors), and each
    flag's (key, value text, span of the value). A value is text as typed, or
    (from Python callers) a typed value, written as its kind writes it."""
    parts: list[str] = []
    entries: list[tuple[str, str, Span]] = []
    col = 1
    for key, value in overrides.items():
        if key not in KEYS:
            raise DSLError(f"unknown key '{key}'", Source("<command line>", "").locate(NO_SPAN),
                           [did_you_mean(key, KEYS)])
        spec_key = KEYS[key]
        if key == "model_args" and isinstance(value, Mapping):
            texts = [f"{k}={literal_text(v)}" for k, v in value.items()]
        elif key == "model_args" and isinstance(value, (list, tuple)):
            texts = [str(v) for v in value]  # repeated --model-arg k=v
        elif isinstance(value, str):
            texts = [value]
        else:
            texts = [spec_key.kind.show(value)]
        for text in texts:
            text = text.replace("\n", " ").replace("\r", " ")
            start = col + len(spec_key.flag) + 1
            parts.append(f"{spec_key.flag} {text}")
            entries.append((key, text, Span(1, start, 1, start + max(1, len(text)))))
            col += len(parts[-1]) + 1
    return Source("<command line>", " ".join(parts)), entries


def flag_node(key: str, text: str, source: Source, span: Span) -> ast.Node:
    """Parse a flag's value text (written at ``span`` of ``source``) as ``key``'s value."""
    kind = KEYS[key].kind
    if kind.raw_flag(text):
        return ast.String(text, span)
    wrap = key == "model_args" or (
        key == "policy" and "=" in text and not re.match(r"\s*(\(|[A-Za-z_0-9]+\s*\()", text))
    if wrap:
        return parse_value(" " * (span.col - 2) + "(" + text + ")", source)
    return parse_value(" " * (span.col - 1) + text, source)


def read_flags(overrides: Mapping[str, Any]) -> Flags:
    """Parse and convert each flag's value once; a bad value raises a
    :class:`DSLError` in the command line that names the flag. Repeated
    ``--model-arg k=v`` merge into one mapping (a later one wins)."""
    if isinstance(overrides, Flags):
        return overrides
    source, texts = command_line(overrides)
    entries: dict[str, Flag] = {}
    for key, text, span in texts:
        try:
            node = flag_node(key, text, source, span)
            value = KEYS[key].kind.convert(node, Ctx(key, source))
        except DSLError as err:
            raise DSLError(f"{KEYS[key].flag}: {err.message}", err.location, err.hints) from None
        if key == "model_args" and key in entries:
            old = entries[key]
            node = ast.Group((), old.node.kwargs + node.kwargs, Span(1, old.node.span.col, 1, node.span.end_col))
            value = type(value)({**old.value, **value})
        entries[key] = Flag(key, value, node)
    return Flags(source, entries)
