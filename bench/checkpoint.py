"""Checkpoint benchmark: how long a step is blocked by a save, synchronous beside asynchronous.

Prints figures, asserts nothing (issue 6). The example GPT (8 blocks, dim 256,
4 heads, seq 128, vocab 1000: about 6.6 M parameters, so a checkpoint holds
about 80 MB of parameters and AdamW state), 1F1B on 2 ranks, batch 16, 8
microbatches, a checkpoint every 2 steps, run with ``--sync-checkpoints`` and
without (``dcp.async_save``), alternately. For each mode: the time the
training loop was blocked per save (mean, max), the median step time of steps
with and without a save in flight, and the goodput report of the run.

    .venv/bin/python bench/checkpoint.py               # 2 runs of each mode, 10 steps
    .venv/bin/python bench/checkpoint.py --runs 1 --steps 6 --layers 4

Timings on a shared 2-core machine are noisy (the background writer competes
with the ranks for the cores); the load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def compile_plan(folder: Path, layers: int, every: int) -> Path:
    from pipec.compiler.driver import compile_spec
    from pipec.compiler.ir.plan_json import write_plan
    from pipec.dsl import load_spec

    overrides = {
        "model": "pipec.examples.gpt:build",
        "model_args": {"layers": layers, "dim": 256, "heads": 4, "vocab": 1000, "seq": 128},
        "input": "tokens: int64[16, 128]", "schedule": "1f1b", "pp": 2, "microbatches": 8, "costs": "unit",
        "partition": "balanced(by=params)", "checkpoint_dir": str(folder / "ckpt"), "checkpoint_every": every,
    }
    path = folder / "plan.json"
    write_plan(compile_spec(load_spec(None, overrides)).plan, str(path))
    return path


def run(plan: Path, folder: Path, steps: int, sync: bool) -> dict:
    shutil.rmtree(folder / "ckpt", ignore_errors=True)
    report = folder / f"report-{'sync' if sync else 'async'}.json"
    cmd = [sys.executable, "-m", "pipec", "run", str(plan), "--nproc", "2", "--steps", str(steps), "--quiet",
           "--keep-checkpoints", "1", "--report", str(report), "--timeout", "300"]
    if sync:
        cmd.append("--sync-checkpoints")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if proc.returncode:
        raise SystemExit(f"run failed:\n{proc.stderr[-3000:]}")
    return json.loads(report.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        plan = compile_plan(folder, args.layers, args.every)
        results: dict[str, list[dict]] = {"sync": [], "async": []}
        for i in range(args.runs):
            for sync in ((True, False) if i % 2 == 0 else (False, True)):
                results["sync" if sync else "async"].append(run(plan, folder, args.steps, sync))
        size = sum(f.stat().st_size for f in (folder / "ckpt").glob("step_*/*"))
    print(f"checkpoint size {size / 1e6:.1f} MB; {args.steps} steps, a save every {args.every}; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'mode':6} {'saves':>5} {'blocked mean':>13} {'blocked max':>12} {'step (no save)':>15} "
          f"{'step (after a save)':>20} {'goodput':>8} {'checkpoint lost':>16}")
    for mode, reports in results.items():
        blocked = [r["goodput"]["checkpoints"]["blocked_s"] for r in reports]
        quiet, busy = [], []
        for r in reports:
            for s in r["steps"][1:]:  # the first is a warm-up
                # the step right after a save runs while an asynchronous save is still writing
                (busy if (s["step"] - 1) % args.every == 0 else quiet).append(s["step_time"])  # steps count from 1
        g = [r["goodput"] for r in reports]
        print(f"{mode:6} {reports[0]['goodput']['checkpoints']['saves']:>5} "
              f"{statistics.mean(b['mean'] for b in blocked):>12.3f}s {max(b['max'] for b in blocked):>11.3f}s "
              f"{statistics.median(quiet):>14.3f}s {statistics.median(busy) if busy else float('nan'):>19.3f}s "
              f"{statistics.mean(x['fraction'] for x in g):>8.1%} "
              f"{statistics.mean(x['lost_s']['checkpoint'] for x in g):>15.2f}s")


if __name__ == "__main__":
    main()
