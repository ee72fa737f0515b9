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
from typing import Any

from pipec.dsl.fmt import format_file
from pipec.dsl.flags import Flags, read_flags
from pipec.dsl.keys import KEYS

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


def overrides_from_args(args: argparse.Namespace) -> Flags:
    """The keys whose flags were given, with typed, checked values (converted once).

    A bad value raises :class:`DSLError` located in the command line, naming
    the flag. ``--model-arg`` values merge into one mapping (a later one wins).
    """
    raw: dict[str, Any] = {}
    for key in KEYS.values():
        value = getattr(args, dest_of(key.name), None)
        if value is None:
            continue
        raw[key.name] = [str(v) for v in value] if key.repeatable else str(value)
    return read_flags(raw)
