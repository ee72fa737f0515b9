"""Ranks that share a host's cores: processor sharing in the simulation.

``costs profile`` times each stage alone and then with as many processes at once as the run has ranks on
the machine (``model["profile"]``: ``concurrent_ranks`` K, a ``slowdown`` s per part); every stage's cost is
its time alone times s. That is right while all K ranks compute, and wrong in the fill and the drain of a
pipeline, or wherever a rank waits: with more ranks than cores (4 ranks on 2 cores) the ranks that do
compute then get more of the CPU than the profile's crowd gave them. This module prices that: a compute
at a moment when k of its host's ranks compute (itself among them) runs at ``s / s(k)`` times the rate its
cost assumes, ``s(k)`` being the slowdown of k processes at once on the host's cores. Where the profile
recorded the cores (``cores`` over ``threads_per_rank``: C slots, fewer than K), the crowd shared them K ways
and k processes share them max(k, C) ways, so ``s(k) = s max(k, C) / K`` and the rate is ``K / max(k, C)``,
never above s (a process does not run faster than alone). The crowd's excess over K / C (the switching and
the caches of an oversubscribed host) stays with every k: in the run a rank is never alone the way the profile's is (the
others' work has just left the caches, its inputs just arrived). Measured in 60 runs of 20 layouts of the
example GPT, 4 ranks on 2 cores, each compute's time over the profile's time alone against the ranks
computing over it: 1.47 at k = 1, 1.52 at 2, 2.10 at 3, 2.75 at 4 (the rates 1.81, 1.31, 1 of k = 4's, where
this model says 2, 1.33, 1; an earlier one, ``s(k) = 1`` up to C, said 2.55, 1.44, 1 and put pipelines
25% under their measured steps). With s <= 1 (the crowd cost nothing: a rank per core, a device per rank)
the rate is its cost's, always. With a slot per process, or without the cores (an older plan), the crowd's
slowdown is all contention that k of K share: ``min(s, K / k)``.

The event loop (compiler/sim/engine.py) is a dataflow over times, not a clock, so the sharing is a fixed point:
run the loop, read which computes overlapped on each host, stretch or shrink every compute so that the work
it does over its interval at the shared rate equals its cost (:meth:`Sharing.scales`), run again, until the
durations settle (:data:`TOLERANCE`, at most :data:`ITERATIONS` runs; each step moves halfway, so it does
not oscillate between two crowds). Deterministic; only plans whose profile measured a crowd pay for it.
"""

from __future__ import annotations

import bisect
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from pipec.compiler.ir.plan import Mesh

__all__ = ["Sharing", "sharing_of", "ITERATIONS", "TOLERANCE", "host_load", "load_factor", "LOAD_SAMPLES"]

ITERATIONS = 24
"""The most runs of the event loop the fixed point takes."""
TOLERANCE = 1e-3
"""The fixed point stops once no compute's duration moves by more than this share of it."""

_PART = {"FWD": "fwd", "BWD": "bwd", "BWD_I": "bwd_i", "BWD_W": "bwd"}
"""Which part of the profile's slowdown prices a compute instruction (a weight backward is a backward's)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Sharing:
    """Which pp ranks' computes share which host's cores, and the crowd the stage costs were timed in."""

    hosts: tuple[tuple[int, ...], ...]
    """Per pp rank: how many of its dp replicas sit on each host (all run the same program at once)."""
    at_once: int
    """K: the processes the profile timed at once (the run's ranks on one host)."""
    slowdown: Mapping[str, float]
    """Per opcode name of a compute (``FWD``, ``BWD``, ``BWD_I``, ``BWD_W``): the slowdown s measured with K at once."""
    slots: int | None = None
    """C: processes the host runs at once without sharing a core (its cores over a rank's threads); None where
    the profile did not record its cores."""

    def rate_cap(self, op: str) -> float:
        """The most a compute of ``op`` speeds up over its cost, alone on its host: the slowdown the crowd
        measured (at least 1: a crowd that cost nothing gives nothing back)."""
        return max(1.0, self.slowdown.get(op, 1.0))

    def rate(self, cap: float, k: int) -> float:
        """The rate over its cost of a compute whose slowdown in the crowd is ``cap`` (s), while k of its host's
        ranks compute: ``s / s(k)``."""
        if self.slots is None or self.slots >= self.at_once:
            return min(cap, self.at_once / k)
        return min(cap, self.at_once / max(k, self.slots))

    def scales(self, computes: Sequence[tuple[int, str, float, float]], previous: Sequence[float]) -> list[float]:
        """Each compute's duration over its cost, next (halfway from ``previous`` to the fixed point's
        estimate). ``computes``: (pp rank, opcode name, start, end) as the last run placed them."""
        crowd = _Crowds(self.hosts, computes)
        out = []
        caps: dict[str, float] = {}
        rates: dict[str, Callable[[int], float]] = {}
        for (rank, op, start, end), prev in zip(computes, previous):
            if op not in caps:
                caps[op] = cap = self.rate_cap(op)
                table: dict[int, float] = {}   # the rate with k computing, once per k (the search runs this often)
                rates[op] = lambda k, cap=cap, table=table: table[k] if k in table else \
                    table.setdefault(k, self.rate(cap, k))
            if end <= start or caps[op] <= 1.0:
                out.append(prev)
                continue
            # the work done over [start, end] at the shared rate, per second of the cost's rate
            work = crowd.work(rank, start, end, rates[op])
            # the duration whose shared work equals the cost, over the cost: (end - start) / work at a steady crowd
            out.append(0.5 * prev + 0.5 * (end - start) / work)
        return out


class _Crowds:
    """Per host, how many ranks compute at each moment (a step function over the run's computes)."""

    def __init__(self, hosts: Sequence[Sequence[int]], computes: Sequence[tuple[int, str, float, float]]) -> None:
        self.hosts = hosts
        num_hosts = len(hosts[0]) if hosts else 0
        self.times: list[list[float]] = []
        self.counts: list[list[int]] = []
        for h in range(num_hosts):
            deltas: dict[float, int] = {}
            for rank, _, start, end in computes:
                n = hosts[rank][h]
                if n and end > start:
                    deltas[start] = deltas.get(start, 0) + n
                    deltas[end] = deltas.get(end, 0) - n
            times, counts, k = [], [], 0
            for t in sorted(deltas):
                k += deltas[t]
                times.append(t)
                counts.append(k)
            self.times.append(times)
            self.counts.append(counts)

    def work(self, rank: int, start: float, end: float, rate: Callable[[int], float]) -> float:
        """Seconds of the cost's rate a compute of ``rank`` gets over [start, end] (``rate(k)`` with k computing),
        on its most crowded host."""
        on = [h for h, n in enumerate(self.hosts[rank]) if n]
        if len(on) == 1:
            return self._work(on[0], start, end, rate)
        return min(self._work(h, start, end, rate) for h in on)

    def _work(self, h: int, start: float, end: float, rate: Callable[[int], float]) -> float:
        times, counts = self.times[h], self.counts[h]
        i = max(bisect.bisect_right(times, start) - 1, 0)
        total, t = 0.0, start
        while t < end:
            nxt = times[i + 1] if i + 1 < len(times) else end
            upto = min(nxt, end)
            total += (upto - t) * rate(max(counts[i], 1))
            t = upto
            i += 1
        return total


def sharing_of(profile: Mapping[str, Any] | None, mesh: Mesh) -> Sharing | None:
    """The sharing a plan's ``model["profile"]`` measured, or None when its costs carry no crowd (no profile, one
    rank at once, every part's slowdown at most 1). Hosts hold ``mesh.devices_per_node`` consecutive global
    ranks, else the K the profile timed at once (torchrun's local ranks are consecutive)."""
    if not profile or not profile.get("slowdown"):
        return None
    at_once = int(profile.get("concurrent_ranks", 1))
    slowdown = {op: float(profile["slowdown"].get(part, 1.0)) for op, part in _PART.items()}
    if at_once <= 1 or max(slowdown.values()) <= 1.0:
        return None
    per_host = mesh.devices_per_node or at_once
    num_hosts = -(-mesh.world_size // per_host)
    hosts = []
    for p in range(mesh.pp):
        row = [0] * num_hosts
        for d in range(mesh.dp):
            for t in range(mesh.tp):  # a pp rank's replicas and their tp ranks all compute at once
                row[mesh.global_rank(p, d, t) // per_host] += 1
        hosts.append(tuple(row))
    cores = profile.get("cores")
    slots = max(1, int(cores) // max(1, int(profile.get("threads_per_rank", 1)))) if cores else None
    return Sharing(hosts=tuple(hosts), at_once=at_once, slowdown=slowdown, slots=slots)


LOAD_SAMPLES = 5
"""How many times :func:`host_load` reads the runnable count (every 10 ms)."""


def host_load(samples: int = LOAD_SAMPLES, every_s: float = 0.01) -> float:
    """How many other processes want a core now: the runnable count the kernel reports (``/proc/loadavg``'s fourth
    field, the reader itself among them) less this one, the median of ``samples`` reads ``every_s`` apart (a process
    seen in fewer than half of them, a launcher's or a waiting peer's blip, is not a load). Where
    there is no ``/proc/loadavg``, the 1-minute load average (``os.getloadavg``), which lags by a minute and counts
    the caller's own recent work."""
    counts = []
    for i in range(samples):
        try:
            with open("/proc/loadavg", encoding="ascii") as f:
                running = int(f.read().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            try:
                return float(os.getloadavg()[0])
            except (AttributeError, OSError):
                return 0.0
        counts.append(max(0, running - 1))
        if i + 1 < samples:
            time.sleep(every_s)
    return float(statistics.median(counts))


def load_factor(profile: Mapping[str, Any] | None, load: float) -> float | None:
    """How many times longer each compute takes at host load ``load`` (:func:`host_load`) than the profile's costs
    say, the profile having recorded the load it was timed at (``model["profile"]["host_load"]``): the K ranks on this
    host share its C slots (cores over threads per rank) ``max(C, K + load)`` ways, against ``max(C, K + load
    then)`` when profiled. None where the profile recorded no load (or there is no profile)."""
    if not profile or profile.get("host_load") is None:
        return None
    at_once = max(1, int(profile.get("concurrent_ranks", 1)))
    cores = profile.get("cores") or profile.get("cpu_count") or 1
    slots = max(1, int(cores) // max(1, int(profile.get("threads_per_rank", 1))))
    return max(slots, at_once + load) / max(slots, at_once + float(profile["host_load"]))
