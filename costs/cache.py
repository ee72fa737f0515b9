"""The profile cache: what ``costs profile`` and the links probe measured, kept between compiles.

A timing is kept under a key of what decides it (:mod:`pipec.costs.profile` and
:mod:`pipec.costs.links` say what their keys hold), one JSON file per entry::

    $XDG_CACHE_HOME/pipec/<kind>/<sha256 of the key>.json     (else ~/.cache/pipec/...)
    {"format": "pipec.cache/1", "kind": ..., "key": {...}, "value": {...}, "at": ISO 8601 UTC, "epoch": seconds}

An entry is written whole or not at all: to a temporary file in the same folder, then ``os.replace``
(atomic on one file system), so two compiles writing at once leave one of their entries, never a mix, and
a reader never sees half a file. An entry that cannot be read back as written (not JSON, another format,
another key, a value its reader refuses) is damaged: it is ignored, named in a note, measured again and
written over. A folder that cannot be written leaves the entries in this process only (one note).

:func:`reprofile` makes this process measure again: entries written before it was called are ignored (and
replaced), the ones written since (by this process or another) are used, so one ``--reprofile`` search
measures each timing once. Everything here is plain Python (``pipec cache`` imports no torch).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

__all__ = ["FORMAT", "KINDS", "Entry", "cache_root", "lookup", "store", "reprofile", "note", "take_notes", "summary", "clear"]

FORMAT = "pipec.cache/1"
KINDS = ("host", "stage", "crowd", "links", "runs")
"""What an entry holds: the host-speed reference, a stage timed alone, the processes' slowdown at once, links; and
the steps earlier runs measured against their predictions (:mod:`pipec.compiler.sim.history`), which
:func:`reprofile` keeps: they are outcomes, not timings to take again."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One timing read from (or just written to) the cache."""

    value: Mapping[str, Any]
    at: str
    """When it was measured: an ISO 8601 UTC timestamp."""
    reused: bool
    """True: measured by an earlier compile (or another process); False: measured now, in this process."""


_memory: dict[Path, dict[str, Any]] = {}
"""Entries this process wrote, by path: a folder that cannot be written still shares them within a process."""
_not_before = 0.0
"""Entries measured (epoch seconds) before this are ignored (:func:`reprofile`)."""
_notes: list[str] = []
_unwritable: set[Path] = set()


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/pipec``, else ``~/.cache/pipec``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pipec"


def _path(kind: str, key: Mapping[str, Any]) -> Path:
    assert kind in KINDS, kind
    digest = hashlib.sha256(_canonical(key).encode()).hexdigest()
    return cache_root() / kind / f"{digest}.json"


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def reprofile() -> None:
    """Measure again: from now on this process ignores (and replaces) every entry measured before this call."""
    global _not_before
    _not_before = time.time()
    _memory.clear()


def lookup(kind: str, key: Mapping[str, Any], check: Callable[[Mapping[str, Any]], None] | None = None) -> Entry | None:
    """The entry of ``key``, or None: none, measured before :func:`reprofile`, or damaged (a note says so).
    ``check`` raises (KeyError, TypeError, ValueError) on a value its reader cannot use: the entry is damaged."""
    path = _path(kind, key)
    obj = _memory.get(path)
    if obj is None:
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except OSError as e:
            _notes.append(f"profile cache: cannot read {path} ({e.strerror}); measured again")
            return None
        try:
            obj = json.loads(text)
            if not isinstance(obj, dict) or obj.get("format") != FORMAT or obj.get("kind") != kind:
                raise ValueError("not a pipec cache entry")
            if _canonical(obj.get("key")) != _canonical(key):
                raise ValueError("its key differs from its name")
            if not isinstance(obj.get("value"), dict) or not isinstance(obj.get("at"), str):
                raise ValueError("no value")
            float(obj["epoch"])
            if check is not None:
                check(obj["value"])
        except (ValueError, KeyError, TypeError, IndexError) as e:
            _notes.append(f"profile cache: the entry {path} is damaged ({e}); measured again")
            return None
    if float(obj["epoch"]) < _not_before and kind != "runs":
        return None
    return Entry(value=obj["value"], at=obj["at"], reused=path not in _memory)


def store(kind: str, key: Mapping[str, Any], value: Mapping[str, Any]) -> Entry:
    """Keep ``value`` under ``key`` (measured now), written atomically; the entry as :func:`lookup` gives it."""
    path = _path(kind, key)
    now = time.time()
    at = datetime.datetime.fromtimestamp(now, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    obj = {"format": FORMAT, "kind": kind, "key": dict(key), "value": dict(value), "at": at, "epoch": now}
    _memory[path] = obj
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps(obj, indent=1))
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        root = cache_root()
        if root not in _unwritable:
            _unwritable.add(root)
            _notes.append(f"profile cache: cannot write {root} ({e.strerror or e}); the timings are kept in this "
                          "process only")
    return Entry(value=obj["value"], at=at, reused=False)


def note(message: str) -> None:
    """A note for the next :func:`take_notes` (plan.json's ``model.profile.notes``)."""
    _notes.append(message)


def take_notes() -> list[str]:
    """The notes since the last call (damaged entries, an unwritable folder), once each."""
    out = list(dict.fromkeys(_notes))
    _notes.clear()
    return out


def _files(root: Path) -> list[Path]:
    return [p for kind in KINDS for p in sorted((root / kind).glob("*.json")) if not p.name.startswith(".tmp-")] \
        if root.is_dir() else []


def summary() -> dict[str, Any]:
    """What ``pipec cache`` shows: where the cache is, its entries (in all and per kind) and their bytes."""
    root = cache_root()
    files = _files(root)
    by_kind = {kind: sum(1 for p in files if p.parent.name == kind) for kind in KINDS}
    return {"path": str(root), "entries": len(files), "bytes": sum(_size(p) for p in files), "by_kind": by_kind}


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def clear() -> dict[str, Any]:
    """Remove every entry (and any temporary file a killed compile left); what was there, as :func:`summary`."""
    before = summary()
    root = cache_root()
    for kind in KINDS:
        folder = root / kind
        if not folder.is_dir():
            continue
        for p in folder.iterdir():
            if p.suffix == ".json":
                try:
                    p.unlink()
                except FileNotFoundError:
                    pass
        try:
            folder.rmdir()
        except OSError:
            pass
    try:
        root.rmdir()
    except OSError:
        pass  # something else is there: not ours to remove
    _memory.clear()
    return before
