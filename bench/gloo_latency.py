"""gloo's own cost per hop between two ranks: the floor under the emulated fidelity of bench/runtime.py.

Two ranks pass a one-element tensor back and forth with plain torch.distributed
(no pipec), receives posted before the matching send as pipec's plans post
them, first back to back, then with a sleep before every send, as an emulated
compute instruction does before it sends. Prints the mean time per hop beyond
the sleeps; figures, not a test.

    .venv/bin/python bench/gloo_latency.py [--hops 400] [--sleep-ms 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def worker(hops: int, sleep_s: float) -> None:
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
    if rank == 0:
        print(f"gloo, 2 ranks, {hops} hops each (torch {torch.__version__}, load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())})")
        for label, per_hop in rows:
            print(f"  {label:32} {per_hop * 1e3:6.3f} ms per hop")
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hops", type=int, default=400)
    p.add_argument("--sleep-ms", type=float, default=5.0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.hops, args.sleep_ms / 1e3)
        return 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
           "--worker", "--hops", str(args.hops), "--sleep-ms", str(args.sleep_ms)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run(cmd, env=env, timeout=600).returncode


if __name__ == "__main__":
    sys.exit(main())
