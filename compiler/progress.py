"""Progress of the compile's slow parts (``costs profile``, the links probe): ``profiling stage 3/8 ...``.

One line on stderr, written over in place and cleared when the part is done, and only when stderr is a
terminal (piped or captured output, ``--json`` included, gets none). A caller with a display of its own
(``pipec tune``'s progress bar) takes the lines instead with :func:`routed`.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
from typing import Callable, Iterator

__all__ = ["report", "done", "routed"]

_route: list[Callable[[str], None]] = []
_shown = [False]


def report(message: str) -> None:
    """Show ``message`` as the current step (replacing the last one)."""
    if _route:
        _route[-1](message)
        return
    stream = sys.stderr
    if not _is_terminal(stream):
        return
    width = max(20, shutil.get_terminal_size((80, 24)).columns - 1)
    stream.write("\r\x1b[K" + message[:width])
    stream.flush()
    _shown[0] = True


def done() -> None:
    """The slow part is over: its line is cleared."""
    if _route:
        _route[-1]("")
        return
    if _shown[0]:
        sys.stderr.write("\r\x1b[K")
        sys.stderr.flush()
        _shown[0] = False


@contextlib.contextmanager
def routed(to: Callable[[str], None]) -> Iterator[None]:
    """Within the block, every step goes to ``to`` (``""``: a part is done) instead of the terminal."""
    _route.append(to)
    try:
        yield
    finally:
        _route.pop()


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
