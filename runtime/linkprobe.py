"""Measured links and host overhead: what the simulator needs, measured the way the runtime pays it.

Three uses, one set of measurements:

- ``pipec compile`` with ``costs profile`` (and no ``links`` given) starts this
  module as a short job of two local ranks (compiler/frontend/links.py); it
  writes the links and the executor's overhead the plan then carries.
- A multi-node cluster: run it there under torchrun and copy the file's
  numbers into the schedule file's ``links`` key (``pp``, ``dp``)::

      torchrun --nnodes 2 --nproc-per-node 8 ... -m pipec.runtime.linkprobe \\
          --sizes 65536,4194304 -o links.json

- ``pipec run --emulate``: :func:`measure_emulation` at start-up, on every
  rank (a few ms), for the re-simulation report.json's ``predicted`` is.

What is measured: point-to-point between rank 0 and rank 1 (on a cluster, put
them on different nodes to measure the network) at each message size, fitted
to ``latency + bytes / bandwidth``; an all-reduce over every rank, fitted to
the ring's ``latency + 2 (n - 1) / n x bytes / bandwidth``; with ``--sharded``
an all-gather too (``(n - 1) / n``); and the executor's host seconds per
instruction kind, from a zero-compute step of a small plan (the real
executor's handlers, timed as they run, less the waits they do). When the
sizes probed do not show the bandwidth term (the largest one's time is all
latency), the fit reports the least bandwidth the measurements allow
(:func:`_fit`): probe larger sizes (``--sizes``) to measure it.

Under ``--emulate`` the overhead is timed on the plan itself, its computes
sleeping what they sleep in the run: a post after a long sleep costs the host
several times what it costs in a tight loop (caches and the CPU go cold), so
a zero-compute step would price it low on every instruction.
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
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

__all__ = ["Emulation", "measure_emulation", "host_overhead", "probe", "main"]

LAPS = 5
"""Laps of the token round the ranks in the hop measurement (the median lap counts)."""
PAUSE_S = (0.001, 0.02)
"""The bounds of the sleep before each send in the emulation's hop measurement: an emulated compute sleeps
before it sends, and how long a hop and a sleep take depends on how long the rank slept (the shortest
emulated compute of the plan, within these bounds)."""
ROUNDS = 5
"""Rounds of each start-up measurement."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Emulation:
    """What ``--emulate`` measured at start-up (medians over every rank)."""

    latency_s: float
    """One placeholder message, from its send's post (after a sleep, as an emulated compute posts it) to the
    receiver's wait returning; the post itself is the host's ``overhead``."""
    collective_s: float
    """A one-element all-reduce over every rank (an emulated all-reduce or shard collective)."""
    oversleep_s: float
    """How much longer than asked a sleep takes (the emulated computes' own sleeps)."""
    overhead: Mapping[str, float]
    """The executor's host seconds per instruction, by opcode name (timed on the plan, sleeping as it runs)."""
    backend: str

    def to_json(self) -> dict[str, Any]:
        return {"latency_s": self.latency_s, "collective_s": self.collective_s, "oversleep_s": self.oversleep_s,
                "overhead": dict(self.overhead), "backend": self.backend}


def _now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _token_hop(laps: int, pause: float) -> tuple[float, float]:
    """(seconds per hop beyond the pause and the send's post, oversleep): one element passed round the ranks
    ``laps`` times, each rank sleeping ``pause`` before it posts it on, as an emulated compute sleeps before
    its send (one rank busy at a time, as on a pipeline's critical path). The post is the host's overhead
    (:func:`host_overhead` times it), so it is left out of the hop. Each lap gives rank 0's time round it,
    less every rank's sleep and post, over the hops; the hop is the median lap's (a lap the scheduler
    stalled does not count), the same on every rank, the oversleep this rank's."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        return 0.0, _oversleep(pause)
    buf = torch.zeros(1)
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    clock = time.perf_counter
    # per lap: [rank 0's time round it, then this rank's sleep + post]
    got = torch.zeros(2, laps, dtype=torch.float64)
    slept, works = [], []

    def pass_on(lap: int):
        a = clock()
        time.sleep(pause)
        b = clock()
        works.append(dist.isend(buf, nxt))
        got[1, lap] = clock() - a
        slept.append(b - a)

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
    hop = statistics.median(float(t - busy) / world for t, busy in zip(got[0], got[1]))
    return max(0.0, hop), max(0.0, statistics.median(slept) - pause)


def _oversleep(pause: float) -> float:
    got = []
    for _ in range(ROUNDS):
        a = time.perf_counter()
        time.sleep(pause)
        got.append(time.perf_counter() - a - pause)
    return max(0.0, statistics.median(got))


def _timed(rounds: int, fn: Callable[[], None], pause: float = 0.0) -> float:
    """Median seconds of ``fn`` over ``rounds`` (after one warm-up), each after a barrier and a pause."""
    times = []
    for i in range(rounds + 1):
        dist.barrier()
        if pause:
            time.sleep(pause)
        t0 = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def host_overhead(executor, steps: int = 1) -> dict[str, float]:
    """The executor's host seconds per instruction kind (see :func:`_handler_times`)."""
    return _handler_times(executor, steps)[0]


def _handler_times(executor, steps: int = 1) -> tuple[dict[str, float], float | None]:
    """(the executor's host seconds per instruction kind, the mean oversleep or None): its handlers timed as
    they run one zero-compute warm-up step and then ``steps`` steps in which each emulated compute sleeps what
    it sleeps in the run (none with ``emulate=0.0``), each call less the waits it does (the executor's
    ``wait``), so the median per kind is the host's own time, what follows a sleep included; a batch of posts
    is shared by its posts. A compute's sleep is taken after its handler, timed apart: the oversleep, whose
    mean is what a chain of sleeps adds up to (a loaded machine overruns a few sleeps by milliseconds)."""
    units = executor.units
    ops = [executor.instructions[i].op.value for i, _, _ in units]
    counts = [b - a for (a, _, _), (b, _, _) in zip(units, [*units[1:], (len(executor.instructions), None, None)])]
    samples: dict[str, list[float]] = {}
    oversleeps: list[float] = []
    clock = time.perf_counter
    waited = [0.0]
    inner_wait = executor.wait

    def wait(works) -> None:
        t0 = clock()
        inner_wait(works)
        waited[0] += clock() - t0

    def timed(handler, arg, out: list[float], n: int, sleep: float):
        def run(_arg):
            waited[0] = 0.0
            t0 = clock()
            handler(arg)
            t1 = clock()
            out.append((t1 - t0 - waited[0]) / n)
            if sleep > 0:
                time.sleep(sleep)
                oversleeps.append(clock() - t1 - sleep)
        return run

    def wrapped(sampled: bool) -> list:
        out = []
        for (i, h, arg), op, n in zip(units, ops, counts):
            sleep = getattr(arg, "seconds", 0.0) if sampled else 0.0
            if hasattr(arg, "seconds"):  # an emulated compute: its handler sleeps nothing, the wrapper sleeps
                arg = arg._replace(seconds=0.0)
            out.append((i, timed(h, arg, samples.setdefault(op, []) if sampled else [], n, sleep), arg))
        return out

    executor.wait = wait
    try:
        executor.units = wrapped(False)
        executor.run_step(None, None)
        executor.units = wrapped(True)
        for _ in range(steps):
            executor.run_step(None, None)
    finally:
        executor.units = units
        del executor.wait
    return ({op: statistics.median(xs) for op, xs in samples.items() if xs},
            statistics.fmean(oversleeps) if oversleeps else None)


def _medians(values: Sequence[Mapping[str, float]]) -> dict[str, float]:
    keys = sorted({k for v in values for k in v})
    return {k: statistics.median(v[k] for v in values if k in v) for k in keys}


def measure_emulation(executor, backend: str, sleep_s: float) -> Emulation:
    """Every rank: the placeholder hop and the one-element all-reduce after a sleep of ``sleep_s`` (the plan's
    shortest emulated compute, within :data:`PAUSE_S`), then the executor's host overhead and the oversleep
    over one step of the plan itself, each compute sleeping what it sleeps in the run (``executor`` built with
    the run's ``emulate``; with ``emulate=0.0`` nothing sleeps and the oversleep is the hop's); the medians
    over every rank, on every rank."""
    pause = min(max(sleep_s, PAUSE_S[0]), PAUSE_S[1])
    overhead, slept = _handler_times(executor)  # first: the plan's step warms up what the run uses
    hop, oversleep = _token_hop(LAPS, pause)
    one = torch.zeros(1)
    coll = _timed(ROUNDS, lambda: dist.all_reduce(one), pause) if dist.get_world_size() > 1 else 0.0
    mine = {"latency_s": hop, "collective_s": coll, "oversleep_s": oversleep if slept is None else max(0.0, slept)}
    got: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(got, (mine, overhead))
    scalars = _medians([g[0] for g in got])
    return Emulation(latency_s=scalars["latency_s"], collective_s=scalars["collective_s"],
                     oversleep_s=scalars["oversleep_s"], overhead=_medians([g[1] for g in got]), backend=backend)


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


def _p2p(nbytes: int, device, rounds: int) -> float:
    """Seconds per hop between rank 0 and rank 1 (half a round trip); other ranks only join the barriers."""
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

    return _timed(rounds, ping) / 2


def _collective(kind: str, nbytes: int, device, rounds: int) -> float:
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

    return _timed(rounds, run)


def _tiny_overhead(backend: str, device) -> dict[str, float]:
    """The executor's host overhead on a small zero-compute plan over every rank (1f1b, 4 microbatches per rank)."""
    from pipec.compiler.driver import compile_plan
    from pipec.runtime.executor import Executor
    from pipec.runtime.launch import Env, plan_transport

    world = dist.get_world_size()
    plan = compile_plan(num_ranks=world, num_microbatches=2 * world, schedule="1f1b").plan
    env = Env(dist.get_rank(), world, 0, 0)
    transport = plan_transport(plan, env, 60.0, backend, device)
    ex = Executor(plan, pp_rank=env.rank, dp_rank=0, transport=transport, emulate=0.0, device=device)
    return host_overhead(ex, steps=3)


def probe(sizes: Sequence[int], *, sharded: bool = False, rounds: int = 5) -> dict[str, Any]:
    """Every rank runs it; rank 0's result: plan.json's ``links`` (each marked measured) and ``overhead``."""
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    world = dist.get_world_size()
    sizes = sorted({4, *sizes})
    p2p = [_p2p(s, device, rounds) for s in sizes]
    ar = [_collective("all_reduce", s, device, rounds) for s in sizes]
    measured = {"at": _now_iso(), "backend": backend, "ranks": world, "host": socket.gethostname()}
    lat, bw = _fit(sizes, p2p, 1.0)
    links = {"pp": {"latency_s": lat, "bandwidth_Bps": bw, "measured": measured}}
    lat, bw = _fit(sizes, ar, 2 * (world - 1) / world)
    links["dp"] = links["tie"] = {"latency_s": lat, "bandwidth_Bps": bw, "measured": measured}
    if sharded:
        ag = [_collective("all_gather", s, device, rounds) for s in sizes]
        lat, bw = _fit(sizes, ag, (world - 1) / world)
        links["shard"] = {"latency_s": lat, "bandwidth_Bps": bw, "measured": measured}
    overhead = _tiny_overhead(backend, device)
    got: list[Any] = [None] * world
    dist.all_gather_object(got, overhead)
    return {"links": links, "overhead": {"seconds": _medians(got), "measured": measured}}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pipec.runtime.linkprobe", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="65536,1048576", help="message sizes in bytes, comma-separated (a plan's edges)")
    p.add_argument("--sharded", action="store_true", help="measure the all-gather too (a sharded plan)")
    p.add_argument("--rounds", type=int, default=5)
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
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
