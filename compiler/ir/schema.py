"""A typed reader over parsed JSON that names the exact field of a malformed file.

``Reader(obj, "plan").int("num_stages", lo=1)`` returns the value or raises
:class:`SchemaError` with a message such as ``plan.num_stages: expected an
integer >= 1, got "four"``.
"""

from __future__ import annotations

from typing import Any, Iterator
from pipec.errors import PipecError

__all__ = ["SchemaError", "Reader"]


class SchemaError(PipecError):
    """A field of a JSON document is missing or malformed."""


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class Reader:
    """Reads fields of one JSON object; ``where`` is its path for messages."""

    __slots__ = ("obj", "where")

    def __init__(self, obj: Any, where: str) -> None:
        if not isinstance(obj, dict):
            raise SchemaError(f"{where}: expected an object, got {_show(obj)}")
        self.obj = obj
        self.where = where

    def error(self, key: str, expected: str, got: Any) -> SchemaError:
        return SchemaError(f"{self.where}.{key}: {expected}, got {_show(got)}")

    def _get(self, key: str, required: bool) -> Any:
        if key not in self.obj or self.obj[key] is None:
            if required:
                raise SchemaError(f"{self.where}.{key}: required field is missing")
            return None
        return self.obj[key]

    def int(self, key: str, *, lo: int | None = None, hi: int | None = None, required: bool = True) -> Any:
        v = self._get(key, required)
        if v is None:
            return None
        if type(v) is not int:
            raise self.error(key, "expected an integer", v)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            rng = f"in {lo}..{hi}" if lo is not None and hi is not None else (f">= {lo}" if lo is not None else f"<= {hi}")
            raise self.error(key, f"expected an integer {rng}", v)
        return v

    def num(self, key: str, *, lo: float | None = None, hi: float | None = None, required: bool = True) -> Any:
        v = self._get(key, required)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
            raise self.error(key, "expected a number", v)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise self.error(key, f"expected a number in [{lo}, {hi}]", v)
        return float(v)

    def str(self, key: str, *, required: bool = True, choices: tuple[str, ...] | None = None) -> Any:
        v = self._get(key, required)
        if v is None:
            return None
        if not isinstance(v, str):
            raise self.error(key, "expected a string", v)
        if choices is not None and v not in choices:
            raise self.error(key, "expected one of " + ", ".join(repr(c) for c in choices), v)
        return v

    def bool(self, key: str, *, required: bool = True) -> Any:
        v = self._get(key, required)
        if v is not None and not isinstance(v, bool):
            raise self.error(key, "expected true or false", v)
        return v

    def list(self, key: str, *, required: bool = True) -> Any:
        return self._of(key, list, "a list", required)

    def dict(self, key: str, *, required: bool = True) -> Any:
        return self._of(key, dict, "an object", required)

    def _of(self, key: str, kind: type, what: str, required: bool) -> Any:
        v = self._get(key, required)
        if v is not None and not isinstance(v, kind):
            raise self.error(key, f"expected {what}", v)
        return v

    def ints(self, key: str, *, lo: int | None = None, hi: int | None = None, required: bool = True) -> Any:
        """A list of integers, each in the range."""
        items = self.list(key, required=required)
        if items is None:
            return None
        for i, v in enumerate(items):
            if type(v) is not int or (lo is not None and v < lo) or (hi is not None and v > hi):
                raise self.error(f"{key}[{i}]", f"expected an integer in {lo}..{hi}", v)
        return tuple(items)

    def strs(self, key: str, *, required: bool = True) -> Any:
        items = self.list(key, required=required)
        if items is None:
            return None
        for i, v in enumerate(items):
            if not isinstance(v, str):
                raise self.error(f"{key}[{i}]", "expected a string", v)
        return tuple(items)

    def items(self, key: str, *, required: bool = True) -> Iterator["Reader"]:
        """Readers over a list of objects, each named ``where.key[i]``."""
        for i, v in enumerate(self.list(key, required=required) or ()):
            yield Reader(v, f"{self.where}.{key}[{i}]")

    def sub(self, key: str, *, required: bool = True) -> "Reader | None":
        v = self.dict(key, required=required)
        return None if v is None else Reader(v, f"{self.where}.{key}")
