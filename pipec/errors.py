"""One error model for all of pipec.

Every exception class pipec defines derives from :class:`PipecError`, a
``ValueError`` (torchtitan's policy: ``ValueError`` for whatever a user can
cause). Each class says which exit code it ends the command with:

====  ==========================================================
code  meaning
====  ==========================================================
2     a user's mistake: a flag, a schedule file, a plan, a model or
      data that cannot work; the message says where and how to fix it
1     a run that failed (a rank died or timed out, a collective broke)
3     ``pipec run --check``: the pipelined step differs from the
      unpartitioned reference
====  ==========================================================

The CLI and the rank entry point catch :class:`PipecError` (and nothing
broader): anything else is a bug in pipec and keeps its traceback.
Exceptions raised by a user's own code (a model factory, a data function)
are wrapped in a :class:`UserCodeError` that names the function.

This module imports nothing heavy: ``dsl`` and ``schedules`` use it too.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PipecError", "Diagnostic", "UserCodeError", "RunFailed", "CheckMismatch", "EXIT_USER", "EXIT_RUN", "EXIT_CHECK",
           "exit_code_of"]

EXIT_USER = 2
EXIT_RUN = 1
EXIT_CHECK = 3


class PipecError(ValueError):
    """The base of every error pipec raises on purpose.

    ``key`` (and ``index``, an item of a list value such as one split point)
    name the schedule-file key the complaint is about, for an error raised
    where the source is unknown (the front end, the driver); the language's
    boundary locates it there (``file:line:col`` and a caret) before it is
    printed. ``located`` is true once the message carries its location.
    """

    exit_code: int = EXIT_USER
    """What the command exits with when this error ends it."""
    key: str | None = None
    index: int | None = None
    hints: tuple[str, ...] = ()
    located: bool = False

    def __init__(self, *args: object, key: str | None = None, index: int | None = None,
                 hints: tuple[str, ...] = ()) -> None:
        super().__init__(*args)
        if key is not None:
            self.key = key
        if index is not None:
            self.index = index
        if hints:
            self.hints = tuple(hints)


@dataclass(frozen=True, slots=True)
class Diagnostic:
    """A warning or note a pass reports about a key (the boundary locates and prints it once)."""

    level: str
    """``"warning"`` or ``"note"``."""
    message: str
    key: str | None = None
    index: int | None = None
    hints: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.message


class UserCodeError(PipecError):
    """A user's own function (model factory, data function, loss) raised; the message names it."""

    def __init__(self, what: str, target: str, err: BaseException, *hints: str) -> None:
        kind = type(err).__name__
        lines = [f"{what} {target!r} raised {kind}: {err}", *hints]
        super().__init__("\n".join(lines))
        self.target = target
        self.original = err


class RunFailed(PipecError):
    """A run that started but did not finish: a rank died, hung or broke a collective."""

    exit_code = EXIT_RUN


class CheckMismatch(PipecError):
    """``--check``: the pipelined step's loss or gradients differ from the unpartitioned reference."""

    exit_code = EXIT_CHECK


def exit_code_of(err: BaseException) -> int:
    """The exit code for an error that ends a command (2 for a user's mistake)."""
    return getattr(err, "exit_code", EXIT_USER) if isinstance(err, PipecError) else EXIT_RUN
