"""The tests' processes (torchrun launches, whole ``pipec run`` commands), queued and run in the background.

A test module declares what it needs at import, each as a session fixture of its own name:

- :meth:`Launches.runs`: a set of runs of tests/runtime_worker.py (``make(folder)`` returns them by key,
  each a :func:`run_job` or :func:`call_job`). Every needed set of one world size and round goes into one
  torchrun launch: the fixture's value is the set's records by key.
- :meth:`Launches.command`: one command in its own process group (``make(folder)`` returns its argv, or
  ``{"argv": [...], "cwd": FOLDER, "env": {NAME: VALUE}}``), for a test that must see a whole process end (a
  rank killed, an error on some ranks), or that only needs its output: the fixture's value is its
  ``subprocess.CompletedProcess``.

Only what the selected tests use is queued (``-k``, ``--slow``). The queue runs one process at a time, in
round order, from the first test on: conftest.py advances it between tests and runs the tests that use it
last, so the launches run while the in-process tests do; a test that needs one not yet done waits for it.
A test marked ``timed`` (it asserts on what it times) runs first, beside none of them.
Runs that read the checkpoints of other runs come in a later round (so from another process), naming
those in ``after``; their ``make`` reads :meth:`Launches.folder` of them. ``make`` is called on the main
thread, between tests, just before its process starts (tracing a model is not thread-safe).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

TESTS = Path(__file__).resolve().parent
PYTHON = sys.executable

PER_RUN_S = 60
"""A launch's time limit: a minute per run, and two to start."""

NICE = 10
"""How much lower the queue's processes run than the tests' own (nice)."""


def _lower_priority() -> None:
    os.nice(NICE)


def run_job(plan: str | os.PathLike, *flags: str, reference: bool = False) -> dict[str, Any]:
    """A worker job: ``plan`` run with ``flags`` (``reference``: also the unpartitioned model's losses)."""
    return {"plan": str(plan), "flags": list(flags), "reference": reference}


def call_job(function: str) -> dict[str, Any]:
    """A worker job: ``module:name`` called on every rank, the world process group up."""
    return {"function": function}


@dataclass(eq=False)
class _Need:
    """A set of runs (``world`` ranks) or a command (``world`` None)."""

    name: str
    world: int | None
    round: int
    make: Callable[[Path], Any]
    after: tuple[str, ...]
    timeout: float = 0.0
    """A command's time limit (a launch's is PER_RUN_S per run)."""


@dataclass(eq=False)
class _Unit:
    """One process of the queue: a launch of every needed set of one world size and round, or a command."""

    needs: list[_Need]
    proc: subprocess.Popen | None = None
    folder: Path | None = None
    deadline: float = 0.0
    jobs: list[tuple[str, str]] = field(default_factory=list)
    """(set, key) of each run of a launch, in order."""
    argv: list[str] = field(default_factory=list)
    cwd: Path = TESTS
    env: dict[str, str] = field(default_factory=dict)


class Launches:
    def __init__(self) -> None:
        self.needs: dict[str, _Need] = {}
        self.needed: set[str] | None = None
        """The fixture names the selected tests use (None: every one)."""
        self.root: Path | None = None
        self.done: dict[str, Any] = {}
        """A set's records by key, a command's CompletedProcess, or (a str) why it failed."""
        self.queue: list[_Unit] | None = None
        self.running: _Unit | None = None
        self.started = 0

    # ------------------------------------------------------------------ declaring

    def runs(self, name: str, *, world: int, make: Callable[[Path], dict[str, dict]], round: int = 0,
             after: tuple[str, ...] = ()):
        """Declare a set of runs on ``world`` ranks; returns its fixture (assign it to a module attribute of the
        same name)."""
        return self._declare(_Need(name, world, round, make, after))

    def command(self, name: str, *, make: Callable[[Path], list[str] | dict[str, Any]], timeout: float,
                round: int = 0, after: tuple[str, ...] = ()):
        """Declare a command (run in tests/ unless it says, its process group killed past ``timeout`` seconds);
        returns its fixture (assign it to a module attribute of the same name)."""
        return self._declare(_Need(name, None, round, make, after, timeout))

    def _declare(self, need: _Need):
        assert all(self.needs[a].round < need.round for a in need.after), f"{need.name}: what it reads comes first"
        self.needs[need.name] = need

        def value(launches: Launches):
            return launches.get(need.name)

        value.__doc__ = f"What {need.name} left (tests/launches.py)."
        return pytest.fixture(scope="session", name=need.name)(value)

    def folder(self, name: str) -> Path:
        assert self.root is not None, "the launches fixture sets the folder"
        path = self.root / name
        path.mkdir(exist_ok=True)
        return path

    # ------------------------------------------------------------------ the queue

    def _wanted(self) -> set[str]:
        """What the selected tests use, and what those read."""
        wanted, todo = set(), [n for n in self.needs if self.needed is None or n in self.needed]
        while todo:
            n = todo.pop()
            if n not in wanted:
                wanted.add(n)
                todo += self.needs[n].after
        return wanted

    def _plan_queue(self, names: set[str]) -> list[_Unit]:
        groups: dict[tuple, _Unit] = {}
        for n in self.needs:  # in the order of declaration
            if n in names and n not in self.done:
                need = self.needs[n]
                key = (need.round, 0, need.world) if need.world is not None else (need.round, 1, n)
                groups.setdefault(key, _Unit([])).needs.append(need)
        return [groups[k] for k in sorted(groups)]

    def poll(self) -> None:
        """Collect the running process if it ended; start the next one if none runs (between tests)."""
        if self.root is None:
            return
        if self.queue is None:
            self.queue = self._plan_queue(self._wanted())
        if self.running is not None and self.running.proc.poll() is not None:
            self._collect(self.running)
        elif self.running is not None and time.monotonic() > self.running.deadline:
            self._stop(self.running, "did not finish in time")
        if self.running is None:
            self._start_next()

    def hold(self) -> None:
        """Wait for the running process to end, and start none (until the next :meth:`poll`)."""
        if self.running is not None:
            self._wait_running()

    def get(self, name: str):
        """What ``name`` left, waiting for it (and for what runs before it) if need be."""
        if self.queue is None:
            self.poll()
        pending = {need.name for unit in self._pending() for need in unit.needs}
        if name not in self.done and name not in pending:  # not foreseen (not a fixture of a selected test)
            self.queue += self._plan_queue(({name} | self._wanted_by(name)) - pending)
        while name not in self.done:
            if self.running is None:
                self._start_next()
                if self.running is None and name not in self.done:  # the queue ran dry without it: a bug here
                    self.done[name] = f"{name} was never run (tests/launches.py lost it)"
                continue
            self._wait_running()
        result = self.done[name]
        if isinstance(result, str):
            pytest.fail(result)
        return result

    def _wait_running(self) -> None:
        """Wait for the running process to end (collected) or pass its deadline (stopped)."""
        try:
            self.running.proc.wait(timeout=max(0.0, self.running.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._stop(self.running, "did not finish in time")
            return
        self._collect(self.running)

    def _wanted_by(self, name: str) -> set[str]:
        out, todo = set(), list(self.needs[name].after)
        while todo:
            n = todo.pop()
            if n not in out and n not in self.done:
                out.add(n)
                todo += self.needs[n].after
        return out

    def _pending(self) -> list[_Unit]:
        return ([self.running] if self.running is not None else []) + list(self.queue or ())

    def stop_all(self) -> None:
        """The session ends: no process of the queue outlives it."""
        if self.running is not None and self.running.proc.poll() is None:
            self._stop(self.running, "the test session ended first")

    # ------------------------------------------------------------------ one process

    def _start_next(self) -> None:
        while self.queue and self.running is None:
            unit = self.queue.pop(0)
            if self._prepare(unit):
                self.running = unit

    def _prepare(self, unit: _Unit) -> bool:
        """Make the unit's runs or command and start its process; False if there is nothing to start."""
        for need in list(unit.needs):
            failed = [a for a in need.after if isinstance(self.done.get(a), str)]
            if failed:
                self.done[need.name] = f"{need.name} did not run: {', '.join(failed)}, which it reads, failed"
                unit.needs.remove(need)
        jobs: list[tuple[str, str, dict]] = []
        for need in list(unit.needs):
            try:
                made = need.make(self.folder(need.name))
            except (Exception, pytest.fail.Exception):  # noqa: BLE001 - its tests fail with it; the others run
                self.done[need.name] = f"making {need.name} failed:\n{traceback.format_exc()}"
                unit.needs.remove(need)
                continue
            if need.world is None:
                made = made if isinstance(made, dict) else {"argv": made}
                unit.argv = [str(a) for a in made["argv"]]
                unit.cwd, unit.env = Path(made.get("cwd", TESTS)), dict(made.get("env", {}))
            else:
                jobs += [(need.name, key, job) for key, job in made.items()]
        if not unit.needs:
            return False
        world = unit.needs[0].world
        label = unit.needs[0].name if world is None else f"launch-{world}-{unit.needs[0].round}"
        self.started += 1
        unit.folder = self.folder(f"queue-{self.started}-{label}")
        if world is not None:
            if not jobs:
                self.done |= {need.name: {} for need in unit.needs}
                return False
            (unit.folder / "jobs.json").write_text(json.dumps([job for _, _, job in jobs], indent=1))
            unit.jobs = [(n, key) for n, key, _ in jobs]
            unit.argv = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
                         "runtime_worker.py", str(unit.folder / "jobs.json"), str(unit.folder / "records.json")]
            timeout = 120 + PER_RUN_S * len(jobs)
        else:
            timeout = unit.needs[0].timeout
        # output to files: a pipe nobody reads while the process runs would fill and stop it. At a lower
        # priority: the in-process tests are the run's critical path, the queue takes what CPU they leave
        with open(unit.folder / "stdout", "w") as out, open(unit.folder / "stderr", "w") as err:
            unit.proc = subprocess.Popen(unit.argv, stdout=out, stderr=err, text=True, start_new_session=True,
                                         cwd=unit.cwd, env={**os.environ, **unit.env}, stdin=subprocess.DEVNULL,
                                         preexec_fn=_lower_priority)
        unit.deadline = time.monotonic() + timeout
        return True

    def _stop(self, unit: _Unit, why: str) -> None:
        try:
            os.killpg(unit.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        unit.proc.wait()
        err = (unit.folder / "stderr").read_text(errors="replace")
        for need in unit.needs:
            self.done[need.name] = f"{' '.join(unit.argv[:6])} ... {why}:\n{err[-3000:]}"
        self.running = None

    def _collect(self, unit: _Unit) -> None:
        self.running = None
        out = (unit.folder / "stdout").read_text(errors="replace")
        err = (unit.folder / "stderr").read_text(errors="replace")
        if unit.needs[0].world is None:
            self.done[unit.needs[0].name] = subprocess.CompletedProcess(unit.argv, unit.proc.returncode, out, err)
            return
        records = unit.folder / "records.json"
        if unit.proc.returncode != 0 or not records.exists():
            first = err.find("Traceback (most recent call last)")  # a rank's, before the launcher's summary
            said = (err[first:first + 3000] + "\n...\n" if first >= 0 else "") + err[-1500:]
            names = ", ".join(need.name for need in unit.needs)
            for need in unit.needs:
                self.done[need.name] = (f"the launch of {names} ({len(unit.jobs)} runs on {unit.needs[0].world} "
                                        f"ranks) failed with exit code {unit.proc.returncode} (its stderr: "
                                        f"{unit.folder / 'stderr'}):\n{said}")
            return
        by_need: dict[str, dict[str, dict]] = {need.name: {} for need in unit.needs}
        for (n, key), rec in zip(unit.jobs, json.loads(records.read_text())):
            by_need[n][key] = rec
        self.done |= by_need


LAUNCHES = Launches()
