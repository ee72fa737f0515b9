"""The host's load around a profile's timings: read before and while they run, waited out, and kept with them.

A timing is *under load* when other processes want the cores it needs: the runnable count beside this profile's
own work (:func:`~pipec.compiler.sim.contention.host_load`, which ``pipec run`` reads the same way) plus the cores
the timing keeps busy (one process's intra-op threads alone, every crowd process's at once) is more than the cores
this process may use. Before it times, the profile reads the load and, while others use the cores it needs, waits
(:func:`wait_for_cores`, at most :func:`wait_s`, a progress line saying what for); while it times, a
sampler thread (:class:`Watch`) reads the runnable count every :data:`EVERY_S`. The load an entry keeps is the
greater of the two (before, the median while), and ``loaded`` marks it as taken under load: plan.json's
``model.profile`` carries both per stage and for the crowd, ``pipec show`` and the compile's summary say so,
and a compile on a quiet host takes a marked entry again by itself (:mod:`.timings`).

``PIPEC_PROFILE_LOAD=record`` (the test suite's setting: a machine whose load is its own tests) keeps the readings
and the marks but neither waits nor takes a marked entry again; ``PIPEC_PROFILE_WAIT_S`` bounds the wait.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from typing import Callable

from pipec.compiler import progress

__all__ = ["EVERY_S", "WAIT_S", "acting", "crowded", "wait_s", "wait_for_cores", "Watch", "read_load", "timed_at"]

WAIT_S = 30.0
"""The longest a profile waits for the cores it needs, by default (``PIPEC_PROFILE_WAIT_S``)."""
EVERY_S = 0.05
"""How often :class:`Watch` reads the runnable count while a timing runs."""
POLL_S = 1.0
"""How often a waiting profile reads the load again."""


def read_load() -> float:
    """The processes wanting a core besides this one now (:func:`~pipec.compiler.sim.contention.host_load`)."""
    from pipec.compiler.sim.contention import host_load

    return round(host_load(), 2)


def acting() -> bool:
    """Whether the profile waits for the cores and takes marked entries again (not ``PIPEC_PROFILE_LOAD=record``)."""
    return os.environ.get("PIPEC_PROFILE_LOAD", "act").strip().lower() != "record"


def wait_s() -> float:
    """The longest wait for the cores: ``PIPEC_PROFILE_WAIT_S`` (seconds), else :data:`WAIT_S`; 0 under ``record``."""
    if not acting():
        return 0.0
    try:
        return max(0.0, float(os.environ.get("PIPEC_PROFILE_WAIT_S", WAIT_S)))
    except ValueError:
        return WAIT_S


def crowded(load: float | None, need: int, cores: int) -> bool:
    """Whether ``load`` other processes leave fewer than ``need`` of the ``cores`` free."""
    return load is not None and load + need > cores


def wait_for_cores(need: int, cores: int, what: str, *, read: Callable[[], float] = read_load,
                   sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> float:
    """Wait (at most :func:`wait_s`) until other processes leave ``need`` of the ``cores`` free, saying so on the
    progress line (``what``: the timing that waits); the load read last."""
    load = read()
    deadline = clock() + wait_s()
    while crowded(load, need, cores) and clock() < deadline:
        progress.report(f"{what}: waiting for the host ({load:g} other processes want its {cores} cores, "
                        f"{need} needed; at most {max(0.0, deadline - clock()):.0f} s more)")
        sleep(POLL_S)
        load = read()
    return load


class Watch:
    """The runnable count read every :data:`EVERY_S` on a thread while the block runs, less the reader and the
    ``need`` threads the timing itself keeps running; :attr:`load` is the median of the reads (0 where none)."""

    def __init__(self, need: int) -> None:
        self.need = need
        self.reads: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="pipec-load-watch", daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(EVERY_S):
            try:
                with open("/proc/loadavg", encoding="ascii") as f:
                    running = int(f.read().split()[3].split("/")[0])
            except (OSError, ValueError, IndexError):
                return
            self.reads.append(max(0, running - 1 - self.need))

    def __enter__(self) -> "Watch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def load(self) -> float:
        return float(statistics.median(self.reads)) if self.reads else 0.0


def timed_at(before: float, watch: Watch | None, need: int, cores: int) -> dict[str, float | bool]:
    """What an entry keeps of its load: the greater of ``before`` and the median while (``watch``), and whether
    that left fewer than ``need`` cores free (``loaded``)."""
    load = round(max(before, watch.load if watch is not None else 0.0), 2)
    return {"load": load, "loaded": crowded(load, need, cores)}
