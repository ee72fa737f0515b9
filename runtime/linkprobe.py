"""Measured links and host overhead: what the simulator needs, measured the way the runtime pays it.

Three uses, one set of measurements:

- ``pipec compile`` with ``costs profile`` (and no ``links`` given) starts this
  module as a short job of two local ranks (costs/links.py); it
  writes the links and the executor's overhead the plan then carries.
- A multi-node cluster: run it there under torchrun and copy the file's
  numbers into the schedule file's ``links`` key (``pp``, ``dp``)::

      torchrun --nnodes 2 --nproc-per-node 8 ... -m pipec.runtime.linkprobe \\
          --sizes 65536,4194304 -o links.json

- ``pipec run --emulate``: :func:`measure_emulation` at start-up, on every
  rank (a few ms), for the re-simulation report.json's ``predicted`` is.

What is measured: point-to-point between rank 0 and rank 1 (on a cluster, put
them on different nodes to measure the network) at each message size (the mean
of its rounds: a step pays every stall its messages meet), fitted to ``latency +
bytes / bandwidth``, with the scatter of the smallest size's rounds as the link's
``spread``; an all-reduce over every rank, fitted to
the ring's ``latency + 2 (n - 1) / n x bytes / bandwidth``, back to back (``dp``; the
``tp`` link has its bandwidth and the latency of one after a compute, at the smallest
size: a tensor-parallel stage's all-reduces sit between its Linears, and each waits
there for its peer); with ``--sharded``
an all-gather too (``(n - 1) / n``); and the executor's host seconds per
instruction kind and their scatter, from a zero-compute step of a small plan
(the real executor's handlers, timed as they run, less the waits they do). When the
sizes probed do not show the bandwidth term (the largest one's time is all
latency), the fit reports the least bandwidth the measurements allow
(:func:`_fit`): probe larger sizes (``--sizes``) to measure it.

Under ``--emulate`` everything is timed on steps of the plan itself, every
rank at once and its computes sleeping what they sleep in the run: a post
after a long sleep costs the host several times what it costs in a tight loop
(caches and the CPU go cold), and a message's hop when many ranks wake
together on few cores is longer than a token's passed one rank at a time. The
hop is read off the plan's own messages (ranks on one host share one
monotonic clock), and every figure is a mean (the step pays each stall its
critical path meets), the median over the probe's steps.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from pipec.compiler.sim.simulate import DRAWS, HOP, OVERSLEEP

__all__ = ["Emulation", "measure_emulation", "host_overhead", "probe", "main"]

LINK_ROUNDS = 15
"""Timed repetitions of each point-to-point and collective size (their median is kept; a third as many of the tp
link's latency, each of which is 8 matmuls and 8 all-reduces). On machine A five put one probe's hop at 0.94 ms where
others read 0.09-0.14 ms."""
SAMPLE_ROUNDS = 60
"""Timed repetitions of the smallest size (4 bytes: the latency alone), point-to-point and all-reduce: their samples
are what the step's interval draws each message's and each all-reduce's time from (``samples``), so they are many
enough to hold the tail the run meets (on machine A a hop of 1-2 ms in about 1 of 10, against a median of 0.1 ms:
15 rounds miss it in 1 probe of 5). About 40 ms of probe each."""
OVERHEAD_STEPS = 3
"""Zero-compute steps the executor's host overhead is timed over."""

LAPS = 5
"""Laps of the token round the ranks in the fallback hop measurement (ranks on more than one host)."""
PAUSE_S = (0.001, 0.02)
"""The bounds of the sleep before each send in the token round: an emulated compute sleeps before it sends, and
how long a hop takes depends on how long the rank slept (the plan's shortest emulated compute, within these)."""
ROUNDS = 5
"""Rounds of each start-up measurement."""
PROBE_STEPS = 3
"""Steps of the plan itself the emulation's probe times (after a zero-compute warm-up step), computes sleeping
as in the run; each figure is the median of its steps' (a stall of the whole host, hundreds of ms, in one step
moves none)."""

STALLED = 2.0
"""A probe step whose samples sum to more than this times the median step's is left out of the pooled samples
(:func:`_pooled`): the whole host stalled in it."""

Key = tuple
"""A message of one step: (step, dp rank, "A" | "G", src stage, dst stage, microbatch), as both ends name it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Emulation:
    """What ``--emulate`` measured at start-up on steps of the plan (:func:`measure_emulation`): each figure a
    step's mean over every rank's samples, the median over the probe's steps."""

    latency_s: float
    """One placeholder message, from the later of its send's and its receive's posts to the receiver's wait
    returning (the posts themselves are the host's ``overhead``), over the messages a receiver waited for."""
    collective_s: float
    """A one-element all-reduce over every rank (an emulated all-reduce or shard collective)."""
    oversleep_s: float
    """How much longer than asked an emulated compute's sleep takes."""
    overhead: Mapping[str, float]
    """The executor's host seconds per instruction, by opcode name (less the waits it does)."""
    backend: str
    hops: int = 0
    """How many of a probe step's messages ``latency_s`` is the mean of (the median over steps); 0: the ranks span
    hosts (their clocks do not compare) or no receiver waited, so it is a token's median lap (:func:`_token_hop`)."""

    samples: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    """The probe steps' raw samples over every rank, pooled (:func:`_pooled`): per opcode name the host
    seconds of each instruction, ``"oversleep"`` each compute's, ``"hop"`` each message's (absent when
    ``hops`` is 0); the re-simulation draws from them (compiler/sim/simulate.py ``simulate_draws``)."""

    @property
    def draws(self) -> int:
        """How many drawn steps the re-simulation's median is of (0: one simulation at the fixed figures)."""
        return DRAWS if self.samples else 0

    def to_json(self) -> dict[str, Any]:
        """report.json's ``emulation``: the figures, and of the samples only their counts and summary."""
        return {"latency_s": self.latency_s, "collective_s": self.collective_s, "oversleep_s": self.oversleep_s,
                "overhead": dict(self.overhead), "backend": self.backend, "hops": self.hops, "draws": self.draws,
                "samples": {k: {"count": len(xs), "mean": statistics.fmean(xs), "median": statistics.median(xs),
                                "max": max(xs)} for k, xs in self.samples.items() if xs}}


def _now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _token_hop(laps: int, pause: float) -> float:
    """Seconds per hop beyond the pause and the send's post: one element passed round the ranks ``laps`` times,
    each rank sleeping ``pause`` before it posts it on, as an emulated compute sleeps before its send (one rank
    busy at a time). The post is the host's overhead, so it is left out. Each lap gives rank 0's time round it,
    less every rank's sleep and post, over the hops; the hop is the median lap's, the same on every rank."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        return 0.0
    buf = torch.zeros(1)
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    clock = time.perf_counter
    # per lap: [rank 0's time round it, then this rank's sleep + post]
    got = torch.zeros(2, laps, dtype=torch.float64)
    works = []

    def pass_on(lap: int):
        a = clock()
        time.sleep(pause)
        works.append(dist.isend(buf, nxt))
        got[1, lap] = clock() - a

    dist.barrier()
    for lap in range(laps):
        t0 = clock()
        if rank == 0:
            pass_on(lap)
            dist.recv(buf, prev)
            got[0, lap] = clock() - t0
        else:
            dist.recv(buf, prev)
            pass_on(lap)
    for w in works:
        w.wait()
    dist.all_reduce(got)
    return max(0.0, statistics.median(float(t - busy) / world for t, busy in zip(got[0], got[1])))


def _timed(rounds: int, fn: Callable[[], None], pause: float = 0.0) -> float:
    """Median seconds of ``fn`` over ``rounds`` (after one warm-up), each after a barrier and a pause."""
    return statistics.median(_samples(rounds, fn, pause))


def _samples(rounds: int, fn: Callable[[], None], pause: float = 0.0) -> list[float]:
    """Seconds of each of ``rounds`` runs of ``fn`` (after one warm-up), each after a barrier and a pause."""
    times = []
    for i in range(rounds + 1):
        dist.barrier()
        if pause:
            time.sleep(pause)
        t0 = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - t0)
    return times


def _spread(times: Sequence[float]) -> float:
    """The relative scatter of ``times`` as a standard deviation robust to their outliers: 1.4826 x their median
    absolute deviation over their median (a normal sample's standard deviation; one stall in 15 rounds, 10x
    the others, would otherwise read as a spread of 4-7), at most 1."""
    med = statistics.median(times)
    if med <= 0 or len(times) < 2:
        return 0.0
    return min(1.0, 1.4826 * statistics.median(abs(t - med) for t in times) / med)


@dataclass(slots=True)
class _Timings:
    """One rank's timings of one step of its executor (:func:`_handler_times`); times on ``time.perf_counter``,
    which on one host is one clock for every process (CLOCK_MONOTONIC), so two ranks' timestamps compare."""

    host: dict[str, list[float]] = field(default_factory=dict)
    """Opcode name -> the host seconds of each of its instructions (a batch's time shared by its posts)."""
    oversleeps: list[float] = field(default_factory=list)
    """Each emulated compute's sleep less what it asked."""
    posted: dict[tuple[bool, Key], float] = field(default_factory=dict)
    """(is a send, message) -> when the post of it returned."""
    waits: list[tuple[Key, float, float]] = field(default_factory=list)
    """(message, when the receiver began waiting for it, when the wait returned)."""


def host_overhead(executor, steps: int = 1) -> dict[str, float]:
    """The executor's host seconds per instruction kind: the median per kind over ``steps`` zero-compute steps
    (see :func:`_handler_times`)."""
    return {op: statistics.median(xs) for op, xs in _host_samples(_handler_times(executor, steps)).items()}


def _host_samples(timings: Sequence[_Timings]) -> dict[str, list[float]]:
    """Per instruction kind, the host seconds of each of its instructions over the steps."""
    return {op: [x for t in timings for x in t.host.get(op, ())]
            for op in dict.fromkeys(op for t in timings for op, xs in t.host.items() if xs)}


def _handler_times(executor, steps: int = 1) -> list[_Timings]:
    """The executor's handlers timed as they run one zero-compute warm-up step and then ``steps`` steps in which
    each emulated compute sleeps what it sleeps in the run (none with ``emulate=0.0``), one :class:`_Timings` per
    step: each call less the waits it does (the executor's ``wait``) is the host's own time, what follows a sleep
    included; a batch of posts is shared by its posts. A compute's sleep is taken after its handler, timed apart
    (the oversleep). Each post's return and each receive's wait are kept with the message's key (:func:`_hops`)."""
    from pipec.compiler.ir.program import message_edge

    units = executor.units
    ops = [executor.instructions[i].op.value for i, _, _ in units]
    counts = [b - a for (a, _, _), (b, _, _) in zip(units, [*units[1:], (len(executor.instructions), None, None)])]
    dp = (executor.dp_rank, executor.tp_rank)  # the message's replica of the pipeline: one per (dp, tp) rank
    clock = time.perf_counter
    out: list[_Timings] = []
    spans: list[tuple[float, float]] = []  # the waits of the handler running
    inner_wait = executor.wait

    def wait(works) -> None:
        t0 = clock()
        inner_wait(works)
        spans.append((t0, clock()))

    def message_key(msg) -> tuple:
        if not msg.send:
            return (dp, *msg.key)
        is_act, src, dst = message_edge(msg.ins)
        return dp, "A" if is_act else "G", src, dst, msg.ins.microbatch

    def timed(handler, arg, op: str, n: int, sleep: float):
        receives = tuple((dp, *k) for k in getattr(arg, "receives", ()))
        posts = tuple((m.send, message_key(m)) for m in arg) if isinstance(arg, tuple) and arg \
            and hasattr(arg[0], "send") else ()

        def run(_arg):
            spans.clear()
            t0 = clock()
            handler(arg)
            t1 = clock()
            if not out:
                return  # the warm-up step
            step, at = len(out) - 1, out[-1]
            at.host.setdefault(op, []).append((t1 - t0 - sum(b - a for a, b in spans)) / n)
            for send, key in posts:
                at.posted[(send, (step, *key))] = t1
            at.waits.extend(((step, *key), a, b) for key, (a, b) in zip(receives, spans))
            if sleep > 0:
                time.sleep(sleep)
                at.oversleeps.append(clock() - t1 - sleep)
        return run

    def wrapped(sampled: bool) -> list:
        units_out = []
        for (i, h, arg), op, n in zip(units, ops, counts):
            sleep = getattr(arg, "seconds", 0.0) if sampled else 0.0
            if hasattr(arg, "seconds"):  # an emulated compute: its handler sleeps nothing, the wrapper sleeps
                arg = arg._replace(seconds=0.0)
            units_out.append((i, timed(h, arg, op, n, sleep), arg))
        return units_out

    executor.wait = wait
    try:
        executor.units = wrapped(False)
        executor.run_step(None, None)
        executor.units = wrapped(True)
        for _ in range(steps):
            out.append(_Timings())
            executor.run_step(None, None)
    finally:
        executor.units = units
        del executor.wait
    return out


def _hops(posted: Mapping[tuple[bool, Key], float], waits: Sequence[tuple[Key, float, float]]) -> list[float]:
    """The hop of each of the plan's messages a receiver waited for: (its wait's return) - (the later of its send's
    and its receive's posts), what the simulator charges a message (``latency_s``, after both posts). A receiver
    waited for its message when its wait began before a typical message would have arrived: before both posts had
    returned, or within the median hop of those after (a receive that waits at once after its own post); a wait
    that began later ends at once on a message already there (or, rarely, one held up), and shows no hop."""
    timed = [(max(posted[(True, k)], posted[(False, k)]), a, b) for k, a, b in waits
             if (True, k) in posted and (False, k) in posted]
    early = [b - ready for ready, a, b in timed if a < ready]
    typical = statistics.median(early) if early else 0.0
    return [b - ready for ready, a, b in timed if a < ready + typical]


def _step_samples(step: Sequence[_Timings], one_host: bool) -> dict[str, list[float]]:
    """One probe step's samples over every rank: per opcode name its instructions' host seconds,
    :data:`OVERSLEEP` each compute's, :data:`HOP` each hop of the plan's messages (:func:`_hops`; none when the
    ranks span hosts)."""
    out: dict[str, list[float]] = {}
    for t in step:
        for op, xs in t.host.items():
            out.setdefault(op, []).extend(xs)
    out[OVERSLEEP] = [x for t in step for x in t.oversleeps]
    out[HOP] = _hops({k: v for t in step for k, v in t.posted.items()}, [w for t in step for w in t.waits]) \
        if one_host else []
    return {k: xs for k, xs in out.items() if xs}


def _step_figures(step: Sequence[_Timings], one_host: bool) -> dict[str, float]:
    """One probe step's figures over every rank (each a mean over its samples, :func:`_step_samples`):
    ``latency_s`` (absent when no hop shows, or the ranks span hosts), ``oversleep_s``, and each opcode's host
    seconds."""
    samples = _step_samples(step, one_host)
    hops, oversleeps = samples.pop(HOP, []), samples.pop(OVERSLEEP, [])
    out = {k: statistics.fmean(xs) for k, xs in sorted(samples.items())}
    if hops:
        out["latency_s"], out["hops"] = statistics.fmean(hops), len(hops)
    out["oversleep_s"] = max(0.0, statistics.fmean(oversleeps)) if oversleeps else 0.0
    return out


def _pooled(steps: Sequence[Mapping[str, Sequence[float]]]) -> dict[str, tuple[float, ...]]:
    """The probe steps' samples (:func:`_step_samples`) pooled, each not below 0 (a sleep or a hop takes no less
    than nothing), but for a step whose stalls in all (the sum of its samples) pass :data:`STALLED` times the
    median step's: a stall of the whole host (hundreds of ms) the run would not pay in its median step. Pooled,
    the draws see each kind's tail at the rate the steps saw it, not one step's luck."""
    totals = [sum(x for xs in s.values() for x in xs) for s in steps]
    if not totals:
        return {}
    bound = STALLED * statistics.median(totals)
    out: dict[str, list[float]] = {}
    for step, total in zip(steps, totals):
        if total <= bound:
            for k, xs in step.items():
                out.setdefault(k, []).extend(max(0.0, x) for x in xs)
    return {k: tuple(xs) for k, xs in out.items()}


def measure_emulation(executor, backend: str, sleep_s: float) -> Emulation:
    """Every rank: :data:`PROBE_STEPS` steps of the plan itself, each compute sleeping what it sleeps in the run
    (``executor`` built with the run's ``emulate``), every rank at once as in the run. Of each step, over every
    rank's samples: the mean host overhead per instruction kind, the mean oversleep and the mean hop of the
    plan's own messages (:func:`_hops`; the ranks' clocks compare on one host; across hosts, a token's lap
    after a sleep of ``sleep_s``, the plan's shortest emulated compute within :data:`PAUSE_S`); each figure the
    median of its steps' (a stall of the whole host in one step moves none), the same on every rank; then a
    one-element all-reduce. A step's length is the sum of what its critical path pays, so a figure is a mean,
    not a median: a stall the run pays now and then (a post or a hop held up for milliseconds on a loaded
    host) is in it as often as it happens. The probe steps' raw samples are kept too, pooled (``samples``): a
    step is the longest of many near-critical paths, so the re-simulation draws each cost from them."""
    timings = _handler_times(executor, PROBE_STEPS)  # the plan's steps first: they warm up what the run uses
    pause = min(max(sleep_s, PAUSE_S[0]), PAUSE_S[1])
    world = dist.get_world_size()
    got = _gathered((socket.gethostname(), timings))
    one_host = len({host for host, _ in got}) == 1
    steps = [[ts[i] for _, ts in got] for i in range(len(timings))]
    figures = _medians([_step_figures(step, one_host) for step in steps])
    samples = _pooled([_step_samples(step, one_host) for step in steps])
    if "latency_s" not in figures:
        samples.pop(HOP, None)  # no hop showed in some step: the hop is a token's, fixed
        figures["latency_s"] = _token_hop(LAPS, pause)
    one = torch.zeros(1)
    coll = _timed(ROUNDS, lambda: dist.all_reduce(one), pause) if world > 1 else 0.0
    scalars = ("latency_s", "oversleep_s", "hops")
    return Emulation(latency_s=max(0.0, figures["latency_s"]), collective_s=statistics.median(_gathered(coll)),
                     oversleep_s=figures["oversleep_s"], overhead={k: v for k, v in figures.items() if k not in scalars},
                     backend=backend, hops=int(figures.get("hops", 0)), samples=samples)


def _gathered(value: Any) -> list[Any]:
    got: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(got, value)
    return got


def _medians(values: Sequence[Mapping[str, float]]) -> dict[str, float]:
    keys = sorted({k for v in values for k in v})
    return {k: statistics.median(v[k] for v in values if k in v) for k in keys}


# ----------------------------------------------------------------------------- links (compile, torchrun)


RESOLVED = 0.1
"""The least share of the largest probe's time its bandwidth term must take for the fit to measure the bandwidth;
below it, the sizes show latency only and :func:`_fit` reports the least bandwidth the times allow."""


def _fit(sizes: Sequence[int], times: Sequence[float], factor: float) -> tuple[float, float]:
    """(latency, bandwidth) of ``t = latency + factor x bytes / bandwidth`` by least squares over the sizes.

    When the sizes do not show the bandwidth term (one size, times that do not grow with it, or a term under
    :data:`RESOLVED` of the largest probe's time), the latency is the smallest time and the bandwidth the
    least one consistent with what was measured: the largest probe's term at :data:`RESOLVED` of its time.
    That bound is pessimistic (it prices a larger message at most that slow), never an unbounded number."""
    xs = [factor * s for s in sizes]
    i = max(range(len(xs)), key=lambda j: (xs[j], times[j]))
    x_max, t_max = xs[i], max(times[i], 1e-9)
    floor = x_max / (RESOLVED * t_max) if x_max > 0 else 1e12
    if len(xs) >= 2 and max(xs) > min(xs):
        mx, mt = statistics.fmean(xs), statistics.fmean(times)
        slope = sum((x - mx) * (t - mt) for x, t in zip(xs, times)) / sum((x - mx) ** 2 for x in xs)
        if slope * x_max >= RESOLVED * t_max:
            return max(mt - slope * mx, 0.0), 1.0 / slope
    return max(min(times), 0.0), floor


def _p2p(nbytes: int, device, rounds: int) -> list[float]:
    """Seconds per hop between rank 0 and rank 1 (half a round trip) in each round; other ranks only join the
    barriers."""
    rank = dist.get_rank()
    buf = torch.zeros(max(1, nbytes // 4), device=device)

    def ping():
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return [t / 2 for t in _samples(rounds, ping)]


def _collective(kind: str, nbytes: int, device, rounds: int) -> list[float]:
    """Seconds of each of ``rounds`` collectives of ``kind`` over every rank, ``nbytes`` in all."""
    world = dist.get_world_size()
    n = max(1, nbytes // 4)
    if kind == "all_reduce":
        buf = torch.zeros(n, device=device)
        fn = lambda: dist.all_reduce(buf)  # noqa: E731
    else:  # all-gather of n elements in all (each rank gives n / world)
        part = torch.zeros(max(1, n // world), device=device)
        out = torch.zeros(part.numel() * world, device=device)
        fn = lambda: dist.all_gather_into_tensor(out, part)  # noqa: E731

    def run():
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return _samples(rounds, run)


def _between_computes(nbytes: int, device, rounds: int) -> float:
    """Seconds one all-reduce adds after a compute, as a tensor-parallel stage runs its collectives between its
    Linears: ``rounds`` of (a matmul, the all-reduce) less ``rounds`` of the matmul alone. Back to back the ranks
    arrive together; after a compute each waits for its peer's and for its own wake-up, which costs more."""
    buf = torch.zeros(max(1, nbytes // 4), device=device)
    a, w = torch.randn(256, 256, device=device), torch.randn(256, 256, device=device)

    def compute():
        (a @ w).sum()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def alone():
        for _ in range(8):
            compute()
        sync()

    def mixed():
        for _ in range(8):
            compute()
            dist.all_reduce(buf)
        sync()

    return max(0.0, (_timed(rounds, mixed) - _timed(rounds, alone)) / 8)


def _tiny_overhead(backend: str, device) -> tuple[dict[str, float], dict[str, float], dict[str, list[float]]]:
    """The executor's host overhead on a small zero-compute plan over every rank (1f1b, 4 microbatches per rank):
    per instruction kind its median, its scatter (:func:`_spread`) and its samples."""
    from pipec.compiler.driver import compile_plan
    from pipec.runtime.executor import Executor
    from pipec.runtime.launch import Env, plan_transport

    world = dist.get_world_size()
    plan = compile_plan(num_ranks=world, num_microbatches=2 * world, schedule="1f1b").plan
    env = Env(dist.get_rank(), world, 0, 0)
    transport = plan_transport(plan, env, 60.0, backend, device)
    ex = Executor(plan, pp_rank=env.rank, dp_rank=0, transport=transport, emulate=0.0, device=device)
    samples = _host_samples(_handler_times(ex, OVERHEAD_STEPS))
    return ({op: statistics.median(xs) for op, xs in samples.items()},
            {op: _spread(xs) for op, xs in samples.items()}, samples)


def probe(sizes: Sequence[int], *, sharded: bool = False, rounds: int = LINK_ROUNDS) -> dict[str, Any]:
    """Every rank runs it; rank 0's result: plan.json's ``links`` (each marked measured) and ``overhead``."""
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    world = dist.get_world_size()
    sizes = sorted({4, *sizes})
    many = [max(rounds, SAMPLE_ROUNDS)] + [rounds] * (len(sizes) - 1)  # the smallest size's rounds: the samples
    hops = [_p2p(s, device, n) for s, n in zip(sizes, many)]
    p2p = [statistics.fmean(h) for h in hops]  # the mean: a step pays every stall its critical path meets
    ars = [_collective("all_reduce", s, device, n) for s, n in zip(sizes, many)]
    ar = [statistics.median(xs) for xs in ars]
    measured = {"at": _now_iso(), "backend": backend, "ranks": world, "host": socket.gethostname()}
    lat, bw = _fit(sizes, p2p, 1.0)
    links = {"pp": {"latency_s": lat, "bandwidth_Bps": bw, "measured": measured, "spread": _spread(hops[0]),
                    "samples": [max(0.0, t) for t in hops[0]]}}
    factor = 2 * (world - 1) / world  # the ring all-reduce's
    lat, bw = _fit(sizes, ar, factor)
    links["dp"] = links["tie"] = {"latency_s": lat, "bandwidth_Bps": bw, "measured": measured,
                                  "samples": [max(0.0, t) for t in ars[0]]}
    # the tp link: the all-reduce's bandwidth, its latency as one costs between computes (a plan's smallest size)
    small = sizes[1] if len(sizes) > 1 else sizes[0]
    between = _between_computes(small, device, max(3, rounds // 3)) - factor * small / bw
    links["tp"] = {"latency_s": max(lat, between), "bandwidth_Bps": bw, "measured": measured}
    if sharded:
        ag = [statistics.median(_collective("all_gather", s, device, rounds)) for s in sizes]
        lat, bw = _fit(sizes, ag, (world - 1) / world)
        links["shard"] = {"latency_s": lat, "bandwidth_Bps": bw, "measured": measured}
    seconds, spread, samples = _tiny_overhead(backend, device)
    pooled: dict[str, list[float]] = {}  # every rank's samples of each kind
    for got in _gathered(samples):
        for op, xs in got.items():
            pooled.setdefault(op, []).extend(max(0.0, x) for x in xs)
    overhead = {"seconds": _medians(_gathered(seconds)), "spread": _medians(_gathered(spread)), "samples": pooled,
                "measured": measured}
    return {"links": links, "overhead": overhead}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pipec.runtime.linkprobe", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="65536,1048576", help="message sizes in bytes, comma-separated (a plan's edges)")
    p.add_argument("--sharded", action="store_true", help="measure the all-gather too (a sharded plan)")
    p.add_argument("--rounds", type=int, default=LINK_ROUNDS)
    p.add_argument("--backend", choices=["gloo", "nccl"], help="default: nccl when CUDA is here, else gloo")
    p.add_argument("-o", "--output", required=True, help="the links file to write (JSON: links, overhead)")
    args = p.parse_args(argv)
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    try:
        if dist.get_world_size() < 2:
            print("pipec.runtime.linkprobe: needs 2 or more ranks (torchrun --nproc-per-node 2 ...)", file=sys.stderr)
            return 2
        out = probe([int(s) for s in args.sizes.split(",") if s], sharded=args.sharded, rounds=args.rounds)
        if dist.get_rank() == 0:
            with open(args.output, "w", encoding="utf-8") as f:
                json.dump(out, f, indent=1)
        dist.barrier()  # every rank done before any tears the group down
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
