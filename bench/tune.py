"""pipec tune, measured (prints, not a test).

(a) Here, 4 ranks, the example GPT with costs profile: every feasible candidate of a small grid
    (layouts x schedules x microbatches) compiled and run under ``pipec run``; predicted beside
    measured per candidate, the prediction-only pick against the best measured (goal: within 5%),
    the Spearman rank correlation of predicted and measured (goal >= 0.8), tune's own pick over its
    whole space and its ``--measure 3`` pick.
(b) The note's 13B GPT on 64 devices of 80 GB (meta tracing, costs flops at 989 TFLOP/s): the whole
    search's time (goal <= 60 s) and why it picks what it picks.

    python bench/tune.py [--part a|b|both] [--steps 4] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import replace

from pipec.compiler.driver import compile_request
from pipec.compiler.tune import Candidate, TuneRequest, _score, candidate_request, candidates, tune
from pipec.compiler.tune_measure import measure
from pipec.compiler.tune_report import pipe_lines, why
from pipec.dsl import load_spec

SMALL = """model "pipec.examples.gpt:build" (layers=8, dim=256, heads=4, vocab=1000, seq=128)
input tokens: int64[16, 128]
schedule 1f1b
pp 4  dp 1  microbatches 8
costs profile
"""

BIG = """model "pipec.examples.gpt:build" (layers=40, dim=5120, heads=40, vocab=50304, seq=2048)
input tokens: int64[16, 2048]
schedule 1f1b
pp 8  dp 8  microbatches 16
dtype bfloat16
costs flops  peak_flops 989TFLOP/s
device_memory 80GB
"""

GRID_LAYOUTS = ((4, 1), (2, 2), (1, 4))
GRID_SCHEDULES = ("gpipe", "1f1b", "zb_h1", "interleaved_1f1b")
GRID_MICROBATCHES = (4, 8)


def _write(folder: str, name: str, text: str) -> str:
    path = os.path.join(folder, name)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def _ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = _ranks(a), _ranks(b)
    n = len(a)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else float("nan")


def _in_grid(c: Candidate) -> bool:
    return ((c.pp, c.dp) in GRID_LAYOUTS and c.schedule in GRID_SCHEDULES and c.shard == "none"
            and c.num_microbatches in GRID_MICROBATCHES and c.num_chunks in (1, 2) and c.partition_by == "flops")


def part_a(folder: str, steps: int) -> None:
    path = _write(folder, "gpt_small.pipe", SMALL)
    treq = TuneRequest(base=load_spec(path, {}).request, num_devices=4)
    grid = [c for c in candidates(treq) if _in_grid(c)]
    print(f"(a) {len(grid)} grid candidates on 4 ranks, global batch 16, costs profile, {steps} steps each")
    scored = []
    for c in grid:
        plan = compile_request(candidate_request(treq, c)).plan
        scored.append(_score(c, plan, 16 * 128, None, 4))
    t0 = time.perf_counter()
    full = tune(treq)
    search_s = time.perf_counter() - t0
    measured, notes = measure(replace(full, top=tuple(scored), best=scored[0]), len(scored),
                              workdir=os.path.join(folder, "grid"), steps=steps)
    for n in notes:
        print("  note:", n)
    rows = [s for s in measured.top if s.measured_step is not None]
    print(f"  {'layout':<8} {'schedule':<17} {'v':>2} {'M':>3} {'predicted':>10} {'measured':>10}")
    for s in sorted(rows, key=lambda s: s.step_time):
        c = s.candidate
        print(f"  {c.layout:<8} {c.schedule:<17} {c.num_chunks:>2} {c.num_microbatches:>3} "
              f"{s.step_time * 1e3:>8.2f}ms {s.measured_step * 1e3:>8.2f}ms")
    pick = min(rows, key=lambda s: s.rank_key())
    best = min(rows, key=lambda s: s.measured_step)
    rho = spearman([s.step_time for s in rows], [s.measured_step for s in rows])
    print(f"  prediction-only pick over the grid: {pick.candidate.layout} {pick.candidate.schedule} "
          f"M {pick.candidate.num_microbatches}: measured {pick.measured_step * 1e3:.2f} ms; best measured "
          f"{best.candidate.layout} {best.candidate.schedule} M {best.candidate.num_microbatches}: "
          f"{best.measured_step * 1e3:.2f} ms; pick within {(pick.measured_step / best.measured_step - 1):.1%} "
          "(goal <= 5%)")
    print(f"  Spearman rank correlation, predicted vs measured: {rho:.3f} (goal >= 0.8)")
    print(f"  tune over its whole space ({full.num_candidates} candidates, {search_s:.1f} s): "
          f"{full.best.candidate.layout} {full.best.candidate.schedule} v {full.best.candidate.num_chunks} "
          f"M {full.best.candidate.num_microbatches}, predicted {full.best.step_time * 1e3:.2f} ms")
    top3, notes3 = measure(full, 3, workdir=os.path.join(folder, "top3"), steps=steps)
    for s in top3.top[:3]:
        c = s.candidate
        m = f"{s.measured_step * 1e3:.2f} ms" if s.measured_step else "not measured"
        print(f"    --measure 3: {c.layout} {c.schedule} v {c.num_chunks} M {c.num_microbatches}: predicted "
              f"{s.step_time * 1e3:.2f} ms, measured {m}")
    for n in notes3:
        print("  note:", n)
    print(f"  --measure 3 pick: {top3.best.candidate.layout} {top3.best.candidate.schedule} "
          f"M {top3.best.candidate.num_microbatches}")


def part_b(folder: str) -> None:
    path = _write(folder, "gpt13b.pipe", BIG)
    treq = TuneRequest(base=load_spec(path, {}).request, num_devices=64)
    t0 = time.perf_counter()
    r = tune(treq)
    total = time.perf_counter() - t0
    print(f"(b) 13B GPT on 64 x 80 GB, costs flops at 989 TFLOP/s, global batch {r.global_batch}: search "
          f"{total:.1f} s (goal <= 60 s): {r.num_candidates} candidates, {r.num_compiled} compiled, {r.num_pruned} "
          f"pruned, {r.num_over_budget} over budget, {r.num_unbuildable} unbuildable, {r.num_traces} traces, "
          f"{r.num_cuts} cuts")
    for s in r.top[:5]:
        c = s.candidate
        print(f"  {c.layout:<14} {c.schedule:<17} v {c.num_chunks} M {c.num_microbatches:<3} recompute "
              f"{c.recompute_text:<12} step {s.step_time:.3f} s  MFU {s.mfu:.1%}  bubble {s.bubble:.1%}  "
              f"peak {s.peak_memory / 2**30:.1f} GiB")
    print("  why:")
    for line in why(r):
        print("   -", line)
    print("  as schedule-file lines:", " | ".join(pipe_lines(r.best.candidate, r.best.plan.spec)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("a", "b", "both"), default="both")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=None, help="folder for the plans and reports (default: a temporary one)")
    args = ap.parse_args()
    folder = args.out or tempfile.mkdtemp(prefix="pipec-bench-tune-")
    os.makedirs(folder, exist_ok=True)
    if args.part in ("b", "both"):
        part_b(folder)
    if args.part in ("a", "both"):
        part_a(folder, args.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
