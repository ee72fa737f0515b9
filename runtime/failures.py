"""Every rank's error reaches the user: what a failing rank reports, and how ``pipec run`` prints them all.

A rank that ends with an error makes one :class:`RankReport`: its global rank
and (pp, dp) coordinates, the message, its exit code, and whether it merely
lost a peer that had failed (gloo's "Connection closed by peer", NCCL's
"remote process exited"), which is a consequence, not a cause. An error that
names its rank (:class:`RunError`, :class:`RankFailed`) keeps the rank apart
from the message, as data, so a report joins them and never reads one out of
the other.

- Under torchelastic (``torchrun``, and ``pipec run``, which runs torch's own
  launcher in its process) the report goes to the rank's
  ``TORCHELASTIC_ERROR_FILE``, in the shape torch's ``ProcessFailure`` reads
  (so torchrun's own failure summary shows pipec's message), with pipec's
  fields beside it. The launcher's ``ChildFailedError.failures[rank]`` then
  carries every local rank's report back, including ranks the launcher
  stopped after they had reported.
- ``pipec run`` sets :data:`COLLECT_ENV` for its ranks: they print nothing and
  :func:`summarise` prints each distinct message once with the ranks that
  reported it, root causes first, then one line for the ranks that only lost
  a failed peer or were stopped by the launcher (never dropped silently).
- Under plain ``torchrun`` each rank prints its own message, named by its rank.

torchrun's own log lines (its OMP_NUM_THREADS banner, ``failed (exitcode: 2)``)
are hidden under ``pipec run`` by :func:`quiet_launcher` unless ``--verbose``.
This module imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Mapping, TextIO

from pipec.errors import EXIT_CHECK, EXIT_RUN, EXIT_USER, PipecError, RunFailed

__all__ = ["COLLECT_ENV", "RankReport", "RankFailed", "RunError", "deliver", "summarise", "quiet_launcher", "ranks_text", "linger_when_stopped"]

COLLECT_ENV = "PIPEC_RUN_COLLECTS_ERRORS"
"""Set by ``pipec run`` for its ranks: report to the launcher only; it prints every rank's error once."""

LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited",
             "NCCL communicator was aborted")
"""What torch.distributed says on a rank whose peer died: the failure is the peer's."""

STOPPED = (-signal.SIGTERM, -signal.SIGALRM)
"""Exit codes of a rank the launcher stopped after another rank failed (SIGALRM: :func:`linger_when_stopped`)."""

LAUNCHER_LOGGERS = ("torch.distributed.run", "torch.distributed.elastic", "torch.distributed.launcher")
"""torchrun's own loggers (its banner, its per-failure error lines)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankReport:
    """One rank's error, as it reaches the launcher."""

    rank: int
    """The global rank."""
    where: str
    """``global rank G (pp P, dp D)``, or ``global rank G`` before the plan's mesh is known."""
    message: str
    """What went wrong, without the rank."""
    exit_code: int
    lost_peer: bool
    """The rank only lost a peer that had failed (a secondary failure)."""

    @classmethod
    def of(cls, err: BaseException, *, rank: int, where: str) -> "RankReport":
        inner = err.detail if isinstance(err, RankFailed) else err
        # an executor's error names this rank already: the message is the rest of it
        text = inner.what if isinstance(inner, RunError) and inner.where == where else str(inner)
        if not isinstance(inner, PipecError):
            text = f"{type(inner).__name__}: {text}"
        code = inner.exit_code if isinstance(inner, PipecError) else EXIT_RUN
        return cls(rank=rank, where=where, message=text, exit_code=code,
                   lost_peer=any(s in text for s in LOST_PEER))

    def line(self) -> str:
        if self.lost_peer:
            return f"{self.where} lost a peer that failed (its own error says why): {self.message}"
        return f"{self.where}: {self.message}"


class RunError(RunFailed):
    """A failure during execution. One a rank's executor raises is named by the rank, kept apart: ``where``
    (``global rank G (pp P, dp D)``, as :meth:`Mesh.where` says it) and ``rank``, the global rank; ``what`` is the
    rest (``instruction 7 (B0.3): ...``), and the message is the two joined."""

    def __init__(self, what: str, *, rank: int | None = None, where: str | None = None) -> None:
        super().__init__(what if where is None else f"{where}, {what}")
        self.what = what
        self.rank = rank
        self.where = where


class RankFailed(PipecError):
    """An error raised on one rank once its (pp, dp) coordinates are known; keeps the error's exit code."""

    def __init__(self, where: str, err: BaseException) -> None:
        super().__init__(f"{where}: {err}")
        self.where = where
        self.detail = err
        self.exit_code = err.exit_code if isinstance(err, PipecError) else EXIT_RUN


def deliver(report: RankReport) -> None:
    """Hand this rank's report to the launcher (its error file) and, unless ``pipec run`` collects, print it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    handed = False
    if path:
        data = {"message": {"message": f"pipec: error: {report.line()}",
                            "extraInfo": {"timestamp": str(int(time.time()))}},
                "pipec": asdict(report)}
        try:
            with open(path, "w", encoding="utf-8") as f:
                json.dump(data, f)
            handed = True
        except OSError:  # then it is printed here: never dropped
            pass
    if not (handed and os.environ.get(COLLECT_ENV)):
        print(f"pipec: error: {report.line()}", file=sys.stderr, flush=True)


def linger_when_stopped(seconds: float) -> None:
    """On the launcher's SIGTERM (another rank failed), go on for up to ``seconds`` (then SIGALRM ends the rank),
    so that an error this rank is about to meet, its own or a lost peer, is reported too, not cut off."""

    def stopped(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.setitimer(signal.ITIMER_REAL, seconds)

    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        signal.signal(signal.SIGTERM, stopped)


# ----------------------------------------------------------------------------- the launcher's side


def ranks_text(ranks: list[int], where: Callable[[int], str]) -> str:
    """``global rank 1 (pp 0, dp 1)`` for one rank, ``global ranks 0-3, 6`` for several."""
    if len(ranks) == 1:
        return where(ranks[0])
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return "global ranks " + ", ".join(f"{g[0]}-{g[-1]}" if len(g) > 2 else ", ".join(map(str, g)) for g in runs)


def _how(exitcode: int) -> str:
    if exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        return f"signal {-exitcode} ({signal.Signals(-exitcode).name})"
    except ValueError:
        return f"signal {-exitcode}"


def summarise(failures: Mapping[int, Any], where: Callable[[int], str], file: TextIO | None = None) -> int:
    """Print a failed run's outcome from torchelastic's per-rank failures (on ``file``, else stderr); return
    ``pipec run``'s exit code.

    Root causes first: each distinct message once, with the ranks that reported
    it (user mistakes, then the rest); then ranks that ended without a report
    (a crash, a kill); then one line for the ranks that only lost a failed peer
    or were stopped by the launcher. ``--check`` mismatches (exit code 3) were
    already told by rank 0.
    """
    def say(message: str) -> None:
        print(f"pipec: error: {message}", file=file or sys.stderr, flush=True)

    def note(message: str) -> None:
        print(f"pipec: note: {message}", file=file or sys.stderr, flush=True)

    reports: dict[int, RankReport] = {}
    bare: dict[int, int] = {}
    for rank, failure in failures.items():
        data = (getattr(failure, "error_file_data", None) or {}).get("pipec")
        if isinstance(data, dict):
            reports[rank] = RankReport(**data)
        else:
            bare[rank] = failure.exitcode
    causes: dict[tuple[str, int], list[int]] = {}
    for r in sorted(reports):
        if not reports[r].lost_peer:
            causes.setdefault((reports[r].message, reports[r].exit_code), []).append(r)
    printed = 0
    for (message, code), ranks in sorted(causes.items(), key=lambda kv: (kv[0][1] != EXIT_USER, kv[1][0])):
        say(f"{ranks_text(ranks, where)}: {message}")
        printed += 1
    stopped = [r for r, code in bare.items() if code in STOPPED]
    for rank in sorted(set(bare) - set(stopped)):
        if bare[rank] != EXIT_CHECK:
            say(f"the run failed: {where(rank)} ended with {_how(bare[rank])}")
            printed += 1
    lost = sorted(r for r in reports if reports[r].lost_peer)
    if lost and not printed:  # nothing else explains it: these are the errors there are
        for r in lost:
            say(reports[r].line())
    elif lost:
        first = reports[lost[0]]
        said = first.message.split(". ")[0]  # gloo's explanation and advice follow the first sentence
        note(f"{first.where} then stopped: it lost a failed peer ({said})" if len(lost) == 1 else
             f"{ranks_text(lost, where)} then stopped: they lost a failed peer (first {first.where}: {said})")
    if stopped and printed:
        note(f"{ranks_text(stopped, where)} stopped by the launcher after the failure")
    codes = {rep.exit_code for rep in reports.values() if not rep.lost_peer} | set(bare.values())
    return next((c for c in (EXIT_USER, EXIT_CHECK) if c in codes), EXIT_RUN)


@contextlib.contextmanager
def quiet_launcher(verbose: bool) -> Iterator[None]:
    """torchrun's own log lines hidden (unless ``verbose``), and the ranks told that the launcher collects errors."""
    saved = {name: logging.getLogger(name).propagate for name in LAUNCHER_LOGGERS}
    sink = logging.NullHandler()
    old_collect = os.environ.get(COLLECT_ENV)
    os.environ[COLLECT_ENV] = "1"
    if not verbose:
        for name in LAUNCHER_LOGGERS:
            logger = logging.getLogger(name)
            logger.addHandler(sink)
            logger.propagate = False
    try:
        yield
    finally:
        for name, propagate in saved.items():
            logging.getLogger(name).removeHandler(sink)
            logging.getLogger(name).propagate = propagate
        if old_collect is None:
            os.environ.pop(COLLECT_ENV, None)
        else:
            os.environ[COLLECT_ENV] = old_collect
