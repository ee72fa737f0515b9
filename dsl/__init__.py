"""The schedule-file language: ``.pipe`` files and ``pipec compile`` flags -> a Spec.

A schedule file sets keys (``pp 4``, ``schedule interleaved_1f1b``, ``model
"pipec.examples.gpt:build" (layers=8)``, ...); every key also has a flag,
and a flag overrides the file. :func:`parse_spec` / :func:`load_spec` parse,
check and resolve them into a :class:`Spec`: one typed value per key, each
with its source. Mistakes are :class:`DSLError` (a ``ValueError``) rendered
like a compiler's error, located at the offending text; wasteful settings are
:class:`DSLWarning`.

Pipeline: ``grammar.lark`` (lark, LALR) -> :mod:`.parse` (frozen AST with
spans); :mod:`.flags` (each flag's value converted once) -> :mod:`.check`
(the key table :mod:`.keys` drives names, types, ranges and cross-key
rules) -> :class:`Spec`, whose ``request`` is the compiler's
:class:`~pipec.compiler.request.CompileRequest` (:mod:`.boundary`). The
compiler's complaints about a key come back through :meth:`Spec.locate`
(:mod:`.boundary` again), printed at the key. :mod:`.fmt` prints the
canonical form, :mod:`.cli` adds the flags, :mod:`.reference` writes
``docs/reference.md``. Pure Python: no torch, no networkx.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from pipec.dsl.ast import NO_SPAN as _NOWHERE
from pipec.dsl.check import base_dir_of, check
from pipec.dsl.errors import DSLError, DSLWarning, Location, Source
from pipec.dsl.fmt import format_file
from pipec.dsl.keys import KEYS, Key
from pipec.dsl.parse import parse_source
from pipec.dsl.spec import Origin, Spec
from pipec.compiler.ir.plan import Link  # the compiler's: links resolve straight into it
from pipec.dsl.values import (
    Links,
    LRSchedule,
    Optimizer,
    OrderSpec,
    Partition,
    PolicySpec,
    TensorSpec,
)

__all__ = [
    "DSLError",
    "DSLWarning",
    "Location",
    "Spec",
    "Origin",
    "KEYS",
    "Key",
    "parse_spec",
    "load_spec",
    "format_file",
    "TensorSpec",
    "Partition",
    "Optimizer",
    "LRSchedule",
    "Link",
    "Links",
    "PolicySpec",
    "OrderSpec",
    "MAX_FILE_BYTES",
]

MAX_FILE_BYTES = 16 * 2**20
"""Larger schedule files are refused unread."""


def parse_spec(text: str, *, filename: str = "<string>", overrides: Mapping[str, Any] | None = None) -> Spec:
    """Parse and check schedule-file ``text``; ``overrides`` (key -> value, as
    :func:`pipec.dsl.cli.overrides_from_args` returns, or value text) win over
    the file. Relative paths in the file are relative to ``filename``'s folder.

    Raises :class:`DSLError` for any mistake in the text or the overrides.
    """
    parsed = parse_source(text, filename=filename)
    return check(parsed, overrides, base_dir=base_dir_of(filename))


def load_spec(path: str | None, overrides: Mapping[str, Any] | None = None) -> Spec:
    """Read and check the schedule file at ``path``, or, with ``path=None``, make
    a Spec from ``overrides`` (flags) and defaults alone."""
    if path is None:
        return check(None, overrides)
    where = Source(path, "").locate
    try:
        size = os.path.getsize(path)
        if size > MAX_FILE_BYTES:
            raise DSLError(f"the file is {size:,} bytes; pipec reads schedule files up to {MAX_FILE_BYTES:,}",
                           where(_NOWHERE))
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise DSLError(f"cannot read the schedule file: {err.strerror or err}", where(_NOWHERE)) from None
    except UnicodeDecodeError as err:
        raise DSLError(f"the file is not UTF-8 text ({err.reason} at byte {err.start})", where(_NOWHERE)) from None
    return parse_spec(text, filename=path, overrides=overrides)

