"""Compile speed: the whole `pipec compile` command beside torch's own schedule generation and lowering.

For interleaved_1f1b at P=32, v=2, M=256 (~100K instructions) and at P=64,
v=2, M=1024 (~780K), alternating runs of:

- pipec: the whole command in a fresh process (start-up, generation, lowering,
  both proofs, simulation, writing plan.json), wall time;
- torch: `ScheduleInterleaved1F1B(stages, M)` in this process, whose
  constructor builds `pipeline_order` and lowers it with
  `_PipelineScheduleRuntime._prepare_schedule_with_comms` (duck-typed stages,
  no process group), wall time.

Goals: pipec no slower than torch at P=32; pipec's P=64 time within 10x of its
P=32 time (linear in instructions: the instruction ratio is ~8x).

    .venv/bin/python bench/compile_speed.py [--repeats N] [--skip-64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


class _FakeStage:
    """Stands in for PipelineStage: torch's multi-stage schedules only read these fields to build their order."""

    submod = None

    def __init__(self, num_stages: int, group_size: int) -> None:
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = 0
        self.stage_index_to_group_rank: dict[int, int] = {}


def torch_time(P: int, v: int, M: int) -> tuple[float, int]:
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    t = time.perf_counter()
    sched = ScheduleInterleaved1F1B([_FakeStage(v * P, P) for _ in range(v)], M)
    elapsed = time.perf_counter() - t
    return elapsed, sum(len(a) for a in sched.pipeline_order_with_comms.values())


def pipec_time(P: int, v: int, M: int, out: str) -> tuple[float, str]:
    pipec = os.path.join(os.path.dirname(sys.executable), "pipec")
    cmd = [pipec, "compile", "--schedule", "interleaved_1f1b", "--ranks", str(P), "--virtual", str(v),
           "--microbatches", str(M), "-o", out]
    t = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return time.perf_counter() - t, done.stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs per config at P=32 (P=64: 1)")
    ap.add_argument("--skip-64", action="store_true", help="only the P=32 config")
    args = ap.parse_args()
    configs = [(32, 2, 256, args.repeats)] + ([] if args.skip_64 else [(64, 2, 1024, 1)])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for P, v, M, reps in configs:
            ours, theirs = [], []
            for _ in range(reps):
                t, line = pipec_time(P, v, M, os.path.join(tmp, "plan.json"))
                ours.append(t)
                t, n_torch = torch_time(P, v, M)
                theirs.append(t)
            size = os.path.getsize(os.path.join(tmp, "plan.json"))
            rows.append((P, v, M, statistics.median(ours), statistics.median(theirs), line, n_torch, size))
    print(f"{'config':<26}{'pipec compile (whole command)':>31}{'torch gen+lower (in process)':>31}{'pipec/torch':>13}")
    for P, v, M, ours, theirs, line, n_torch, size in rows:
        print(f"P={P:<3} v={v} M={M:<5}        {ours:>24.2f} s {theirs:>29.2f} s {ours / theirs:>12.2f}x")
    for P, v, M, ours, theirs, line, n_torch, size in rows:
        print(f"  P={P}: pipec: {line} ({size / 1e6:.1f} MB plan); torch: {n_torch} actions")
    if len(rows) == 2:
        print(f"pipec P=64 / P=32: {rows[1][3] / rows[0][3]:.1f}x (goal: at most 10x); "
              f"torch P=64 / P=32: {rows[1][4] / rows[0][4]:.1f}x")
    print(f"goal at P=32: pipec <= torch -> {'met' if rows[0][3] <= rows[0][4] else 'NOT met'}")


if __name__ == "__main__":
    main()
