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
executor's handlers, timed as they run).
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

LAPS = 3
"""Laps of the token round the ranks in the hop measurement."""
PAUSE_S = (0.001, 0.005)
"""The bounds of the sleep before each send in the emulation's hop measurement: an emulated compute sleeps
before it sends, and how long a hop and a sleep take depends on how long the rank slept (the shortest
emulated compute of the plan, within these bounds)."""
ROUNDS = 5
"""Rounds of each start-up measurement."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Emulation:
    """What ``--emulate`` measured at start-up (medians over every rank)."""

    latency_s: float
    """One placeholder message, posted after a sleep as an emulated compute posts it."""
    collective_s: float
    """A one-element all-reduce over every rank (an emulated all-reduce or shard collective)."""
    oversleep_s: float
    """How much longer than asked a sleep takes."""
    overhead: Mapping[str, float]
    """The executor's host seconds per instruction, by opcode name."""
    backend: str

    def to_json(self) -> dict[str, Any]:
        return {"latency_s": self.latency_s, "collective_s": self.collective_s, "oversleep_s": self.oversleep_s,
                "overhead": dict(self.overhead), "backend": self.backend}


def _now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _token_hop(laps: int, pause: float) -> tuple[float, float]:
    """(seconds per hop beyond the pause, oversleep): one element passed round the ranks ``laps`` times, each
    rank sleeping ``pause`` before it sends it on, as an emulated compute sleeps before its send (one rank
    busy at a time, as on a pipeline's critical path). The hop is the same on every rank, the oversleep
    this rank's."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        return 0.0, _oversleep(pause)
    buf = torch.zeros(1)
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    slept = []

    def pass_on():
        a = time.perf_counter()
        time.sleep(pause)
        slept.append(time.perf_counter() - a)
        dist.send(buf, nxt)

    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(laps):
        if rank == 0:
            pass_on()
            dist.recv(buf, prev)
        else:
            dist.recv(buf, prev)
            pass_on()
    total = time.perf_counter() - t0
    # rank 0's time round the laps, less every rank's sleeps, over the hops
    got = torch.tensor([sum(slept), total if rank == 0 else 0.0], dtype=torch.float64)
    dist.all_reduce(got)
    return max(0.0, float(got[1] - got[0]) / (laps * world)), max(0.0, statistics.median(slept) - pause)


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


def host_overhead(executor, steps: int = 2) -> dict[str, float]:
    """The executor's host seconds per instruction kind: its handlers timed as they run ``steps`` zero-compute
    steps (``executor`` built with ``emulate=0.0``). A handler's time includes the waits it does, so each kind
    keeps a low decile of its times (the calls that did not wait); a batch of posts is shared by its posts."""
    units = executor.units
    ops = [executor.instructions[i].op.value for i, _, _ in units]
    counts = [b - a for (a, _, _), (b, _, _) in zip(units, [*units[1:], (len(executor.instructions), None, None)])]
    samples: dict[str, list[float]] = {}
    clock = time.perf_counter

    def timed(handler, out: list[float], n: int):
        def run(arg):
            t0 = clock()
            handler(arg)
            out.append((clock() - t0) / n)
        return run

    executor.units = [(i, timed(h, samples.setdefault(op, []), n), arg)
                      for (i, h, arg), op, n in zip(units, ops, counts)]
    try:
        for _ in range(steps):
            executor.run_step(None, None)
    finally:
        executor.units = units
    return {op: sorted(xs)[len(xs) // 10] for op, xs in samples.items()}


def _medians(values: Sequence[Mapping[str, float]]) -> dict[str, float]:
    keys = sorted({k for v in values for k in v})
    return {k: statistics.median(v[k] for v in values if k in v) for k in keys}


def measure_emulation(zero_compute_executor, backend: str, sleep_s: float) -> Emulation:
    """Every rank: the placeholder hop and the one-element all-reduce after a sleep of ``sleep_s`` (the plan's
    shortest emulated compute, within :data:`PAUSE_S`), the oversleep and the executor's host overhead (two
    zero-compute steps of the plan itself); the medians over every rank, on every rank."""
    pause = min(max(sleep_s, PAUSE_S[0]), PAUSE_S[1])
    hop, oversleep = _token_hop(LAPS, pause)
    one = torch.zeros(1)
    coll = _timed(ROUNDS, lambda: dist.all_reduce(one), pause) if dist.get_world_size() > 1 else 0.0
    overhead = host_overhead(zero_compute_executor)
    mine = {"latency_s": hop, "collective_s": coll, "oversleep_s": oversleep}
    got: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(got, (mine, overhead))
    scalars = _medians([g[0] for g in got])
    return Emulation(latency_s=scalars["latency_s"], collective_s=scalars["collective_s"],
                     oversleep_s=scalars["oversleep_s"], overhead=_medians([g[1] for g in got]), backend=backend)


# ----------------------------------------------------------------------------- links (compile, torchrun)


def _fit(sizes: Sequence[int], times: Sequence[float], factor: float) -> tuple[float, float]:
    """(latency, bandwidth) of ``t = latency + factor x bytes / bandwidth`` by least squares over the sizes."""
    xs = [factor * s for s in sizes]
    if len(xs) < 2 or max(xs) == min(xs):
        return max(times[0], 0.0), 1e12
    mx, mt = statistics.fmean(xs), statistics.fmean(times)
    slope = sum((x - mx) * (t - mt) for x, t in zip(xs, times)) / sum((x - mx) ** 2 for x in xs)
    slope = max(slope, 1e-15)
    return max(mt - slope * mx, 0.0), 1.0 / slope


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
