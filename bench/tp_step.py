"""Tensor parallelism's step on CPU: the example GPT measured beside its prediction, pp 2 x tp 1, 2 x 2, 1 x 2.

Prints figures, asserts nothing. The README's example GPT (layers 8, dim 256, heads 4, vocab 1000, seq 128; a
batch of 16 sequences in 8 microbatches, 1F1B) is compiled with ``costs profile`` at each layout (``tensor_parallel
auto`` where tp > 1: Megatron's colwise/rowwise pairs, the f/g all-reduces over the tp group), then run with ``pipec
run`` under gloo on CPU, one thread per rank, for ``--steps`` steps. The compiles share a profile cache of the
benchmark's own (``--work``'s ``cache``): a crowd timed by an earlier compile at another load would price the plan
at that load. One table: per layout the ranks, the predicted step and its interval (from plan.json), the measured
median step (report.json: the first step, a warm-up, left out), measured / predicted, whether the median fell inside
the interval, and the load average around the run; then the profile's crowd slowdown and the load it was timed at.

    .venv/bin/python bench/tp_step.py                   # every layout, 6 steps each
    .venv/bin/python bench/tp_step.py --layouts 2x1,2x2 --steps 4 --work /tmp/tp

On a shared 2-core machine a layout of 4 ranks time-shares the cores: its step says what tp costs there, not what it
would gain on as many devices; the load average is printed beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL_ARGS = "layers=8, dim=256, heads=4, vocab=1000, seq=128"
INPUT = "tokens: int64[16, 128]"
MICROBATCHES = 8
LAYOUTS = {"2x1": (2, 1), "2x2": (2, 2), "1x2": (1, 2)}
"""pp x tp."""


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def sh(cmd: list[str], cache: Path, timeout: float = 1800) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "XDG_CACHE_HOME": str(cache)}
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)
    if r.returncode != 0:
        raise SystemExit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")


def pipec(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipec", *args]


def one(name: str, pp: int, tp: int, steps: int, work: Path) -> dict:
    plan, report = work / f"plan_{name}.json", work / f"report_{name}.json"
    flags = ["compile", "--model", "pipec.examples.gpt:build", "--model-arg", MODEL_ARGS, "--input", INPUT,
             "--schedule", "1f1b", "--ranks", str(pp), "--microbatches", str(MICROBATCHES), "--costs", "profile",
             "-o", str(plan)]
    if tp > 1:
        flags += ["--tp", str(tp)]
    t0 = time.perf_counter()
    sh(pipec(*flags), work / "cache")
    compile_s = time.perf_counter() - t0
    before = load()
    sh(pipec("run", str(plan), "--nproc", str(pp * tp), "--steps", str(steps), "--report", str(report), "--quiet"),
       work / "cache")
    after = load()
    pred = json.loads(plan.read_text())["prediction"]
    rep = json.loads(report.read_text())
    row = {"layout": f"pp {pp} x tp {tp}", "ranks": pp * tp, "predicted": pred["step_time"],
           "interval": pred.get("step_time_interval"), "coverage": pred.get("coverage"),
           "measured": rep["measured"]["step_time"], "steps": [s["step_time"] for s in rep["steps"]],
           "inside": (rep.get("interval") or {}).get("median_inside"), "load": f"{before} -> {after}",
           "host_load": rep.get("host_load"), "compile_s": compile_s,
           "slowdown": (json.loads(plan.read_text())["model"]["profile"].get("slowdown") or {}).get("fwd")}
    print(f"  {row['layout']}: compiled in {compile_s:.1f} s, steps {', '.join(f'{s:.3f}' for s in row['steps'])} s "
          f"(load {row['load']})", file=sys.stderr, flush=True)
    return row


def print_table(rows: list[dict]) -> None:
    print(f"\n{'layout':14} {'ranks':>5} {'predicted (s)':>13} {'interval (s)':>15} {'measured (s)':>12} "
          f"{'meas/pred':>9} {'inside':>6}  load average (1, 5, 15 min) before -> after the run")
    for r in rows:
        band = f"{r['interval'][0]:.3f}-{r['interval'][1]:.3f}" if r["interval"] else "-"
        inside = "-" if r["inside"] is None else "yes" if r["inside"] else "no"
        print(f"{r['layout']:14} {r['ranks']:5d} {r['predicted']:13.3f} {band:>15} {r['measured']:12.3f} "
              f"{r['measured'] / r['predicted']:9.2f} {inside:>6}  {r['load']}")
    cov = next((r["coverage"] for r in rows if r["coverage"]), None)
    if cov:
        print(f"(interval: the plan's {cov:.0%} interval; measured: the median step, the first left out)")
    for r in rows:
        if r["host_load"]:
            h = r["host_load"]
            crowd = f"a crowd of {r['ranks']} slowed a forward {r['slowdown']:.2f}x, " if r["slowdown"] else ""
            print(f"{r['layout']}: {crowd}profiled at host load {h['profile']:.2f} (other processes wanting a core), "
                  f"run at {h['run']:.2f} (the run's load factor {h['factor']:.2f}x)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"pp x tp, of {', '.join(LAYOUTS)}")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--work", type=Path, default=None, help="keep plans and reports here (default: a temporary folder)")
    args = p.parse_args(argv)
    names = args.layouts.split(",")
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        p.error(f"--layouts: {', '.join(unknown)} not one of {', '.join(LAYOUTS)}")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        print(f"bench/tp_step.py: the example GPT ({MODEL_ARGS}), {INPUT}, 1f1b, {MICROBATCHES} microbatches, "
              f"costs profile, {args.steps} steps per layout; load average {load()}", file=sys.stderr, flush=True)
        rows = [one(n, *LAYOUTS[n], args.steps, work) for n in names]
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
