"""The flag side of the language: one ``pipec compile`` flag per key.

:func:`add_flags` adds a flag for every key of the table (DESIGN's fixed
names: ``pp`` is ``--ranks`` with the alias ``--pp``, ``model_args`` is the
repeatable ``--model-arg k=v``, every other key ``foo_bar`` is
``--foo-bar``); :func:`overrides_from_args` returns the flags the user gave,
checked by their keys' kinds, for :func:`pipec.dsl.parse_spec`'s
``overrides``. A flag's value is written as in a file (``--partition "split
before layers.2, layers.4"``, ``--input tokens:int64[16,128]``); paths and
``pkg.module:function`` targets need no quotes.
"""

from __future__ import annotations

import argparse
from types import MappingProxyType
from typing import Any

from pipec.dsl.check import command_line, flag_node
from pipec.dsl.errors import DSLError
from pipec.dsl.fmt import format_file
from pipec.dsl.keys import KEYS
from pipec.dsl.kinds import Ctx
from pipec.dsl.structured import Kwargs, OrderDraft

__all__ = ["add_flags", "overrides_from_args", "format_file", "dest_of"]


def dest_of(key: str) -> str:
    """The argparse destination of ``key``'s flag."""
    return f"dsl_{key}"


def _help(key) -> str:
    first = key.meaning.split(". ")[0].rstrip(".")
    return f"{first}. Default: {key.default_doc}.".replace("%", "%%")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add one flag per key (plus aliases) to ``parser``, in a group of its own."""
    group = parser.add_argument_group("schedule keys", "each overrides the schedule file's key of that name "
                                      "(see docs/reference.md)")
    for key in KEYS.values():
        group.add_argument(
            *key.flags,
            dest=dest_of(key.name),
            default=None,
            action="append" if key.repeatable else "store",
            metavar="K=V" if key.repeatable else key.name.upper(),
            help=_help(key),
        )


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The keys whose flags were given, with typed, checked values.

    A bad value raises :class:`DSLError` located in the command line, naming
    the flag. ``--model-arg`` values merge into one mapping (a later one wins).
    """
    raw: dict[str, Any] = {}
    for key in KEYS.values():
        value = getattr(args, dest_of(key.name), None)
        if value is None:
            continue
        if key.repeatable:
            raw[key.name] = [str(v) for v in value]
        else:
            raw[key.name] = str(value)
    if not raw:
        return {}
    source, entries = command_line(raw)
    out: dict[str, Any] = {}
    for key, text, span in entries:
        flag = KEYS[key].flag
        try:
            node = flag_node(key, text, source, span)
            kind = Kwargs() if key == "model_args" else KEYS[key].kind
            value = kind.convert(node, Ctx(key, source))
        except DSLError as err:
            raise DSLError(f"{flag}: {err.message}", err.location, err.hints) from None
        if key == "model_args":
            out.setdefault("model_args", {}).update(value)
        elif isinstance(value, OrderDraft):
            out[key] = text  # an order resolves only with the mesh: its text, checked for syntax
        else:
            out[key] = value
    if "model_args" in out:
        out["model_args"] = MappingProxyType(out["model_args"])
    return out
