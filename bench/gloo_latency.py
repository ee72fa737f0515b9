"""gloo's own cost per hop between two ranks: the floor under the emulated fidelity of bench/runtime.py.

Two ranks pass a one-element tensor back and forth with plain torch.distributed
(no pipec), receives posted before the matching send as pipec's plans post
them, first back to back, then with a sleep before every send, as an emulated
compute instruction does before it sends. Prints the mean time per hop beyond
the sleeps. Then a tp stage's collectives: all-reduces of ``--ar-kib`` KiB (the
example GPT's 256 KiB at pp 1 x tp 2) back to back, and each after ``--ar-matmuls``
matmuls of [2048, 256] x [256, 512] (as a tp stage's all-reduces sit between its Linears):
the time each all-reduce adds beyond the matmuls alone, which a ring model priced
from back-to-back probes leaves out. Figures, not a test.

    .venv/bin/python bench/gloo_latency.py [--hops 400] [--sleep-ms 5] [--ar-kib 256] [--ar-matmuls 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def worker(hops: int, sleep_s: float, ar_kib: int = 256, ar_matmuls: int = 2) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    peer = 1 - rank
    world = dist.group.WORLD
    out, into = torch.zeros(1), torch.empty(1)
    rows = []
    for label, pause in (("back to back", 0.0), (f"{sleep_s * 1e3:g} ms sleep before each send", sleep_s)):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(hops // 2):  # a round trip is two hops
            recv = world.recv([into], peer, 0)
            if rank == 0:
                time.sleep(pause)
                world.send([out], peer, 0).wait()
                recv.wait()
            else:
                recv.wait()
                time.sleep(pause)
                world.send([out], peer, 0).wait()
        per_hop = ((time.perf_counter() - t0) - (hops // 2) * 2 * pause) / ((hops // 2) * 2)
        rows.append((label, per_hop))
    a, w, x = torch.randn(2048, 256), torch.randn(256, 512), torch.randn(ar_kib * 256)
    n = 16

    def matmuls() -> None:
        for _ in range(ar_matmuls):
            (a @ w).sum()

    def timed(body) -> float:
        """The median over 15 repeats of ``n`` rounds of ``body``, after 3 untimed."""
        for _ in range(3):
            body()
        dist.barrier()
        ts = []
        for _ in range(15):
            t0 = time.perf_counter()
            body()
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[len(ts) // 2]

    compute = timed(lambda: [matmuls() for _ in range(n)])
    reduces = timed(lambda: [dist.all_reduce(x) for _ in range(n)])
    mixed = timed(lambda: [(matmuls(), dist.all_reduce(x)) for _ in range(n)])
    if rank == 0:
        print(f"gloo, 2 ranks, {hops} hops each (torch {torch.__version__}, load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())})")
        for label, per_hop in rows:
            print(f"  {label:32} {per_hop * 1e3:6.3f} ms per hop")
        print(f"  all-reduce of {ar_kib} KiB, back to back            {reduces / n * 1e3:6.3f} ms each")
        print(f"  {ar_matmuls} matmuls alone (each round)                {compute / n * 1e3:6.3f} ms")
        print(f"  all-reduce after the matmuls: adds             {(mixed - compute) / n * 1e3:6.3f} ms each")
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hops", type=int, default=400)
    p.add_argument("--sleep-ms", type=float, default=5.0)
    p.add_argument("--ar-kib", type=int, default=256, help="the all-reduces' size")
    p.add_argument("--ar-matmuls", type=int, default=2, help="matmuls before each all-reduce")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.hops, args.sleep_ms / 1e3, args.ar_kib, args.ar_matmuls)
        return 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
           "--worker", "--hops", str(args.hops), "--sleep-ms", str(args.sleep_ms), "--ar-kib", str(args.ar_kib),
           "--ar-matmuls", str(args.ar_matmuls)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run(cmd, env=env, timeout=600).returncode


if __name__ == "__main__":
    sys.exit(main())
