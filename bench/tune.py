"""pipec tune, measured (prints, not a test).

(a) Here, 4 ranks, the example GPT with costs profile, timed anew (the profile cache's timings ignored): tune's
    whole-space search first, so its one crowd prices every cut after it, as its own search priced them; then every
    feasible candidate of a small grid (layouts x schedules x microbatches) compiled and run under ``pipec run`` (``--rounds`` times, in
    alternating order, the median of all their steps but each run's warm-up); predicted beside measured per candidate,
    beside what the stages timed alone predict (the profile before it timed the run's ranks at once) and
    what the crowd's costs predict without processor sharing (every compute at its cost with all ranks
    computing), the prediction-only pick against the best measured (goal: within 5%), the Spearman rank
    correlation of predicted and measured (goal >= 0.8), tune's own pick over its whole space and its
    ``--measure 3`` pick.
    ``--against DIR ...`` compiles the grid now and scores its predictions against the measured steps of
    earlier runs pooled (a change to the model, scored without running the grid again).
    ``--pool DIR ...`` runs nothing: it reads the grids of earlier ``--part a --out DIR`` runs (the same
    runtime) and compares each run's predictions with every run's measured steps pooled, a measurement
    with a third of one run's noise, beside how one run's measurement ranks against the others'.
(b) The note's 13B GPT on 64 devices of 80 GB (meta tracing, costs flops at 989 TFLOP/s) on the note's cluster
    (8 GPUs per node, NVLink 600 GB/s inside, InfiniBand 25 GB/s across): the whole search over tp x pp x dp
    (goal <= 60 s), why it picks what it picks against the best tp 1 plan, MFU and scaling efficiency.

(c) The grid of (a) priced from timed pieces, as ``pipec tune`` prices its cuts under ``costs profile``
    (costs/pieces.py), beside each cut timed on its own stages: per candidate both steps and their ratio,
    the Spearman rank correlation between them, and how far the summed pick's timed step is over the timed pick's.
    Runs nothing.

    ``--confirm DIR`` runs the tune's measured pick of an earlier ``--part a --out DIR`` run beside that grid's 3
    fastest measured again, in turn (``--rounds`` times): the pick against the best, measured in the same minutes.

    python bench/tune.py [--part a|b|c|both] [--steps 10] [--rounds 3] [--out DIR] | --pool DIR ... | --against DIR ...
                         | --confirm DIR
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

from pipec.costs import cache
from pipec.compiler.driver import compile_request
from pipec.compiler.ir.plan import Cost, Plan
from pipec.compiler.ir.plan_json import load_plan
from pipec.compiler.sim.simulate import plan_costs, simulate_costs
from pipec.tune.search import Scored, _Graphs, _score, tune
from pipec.tune.space import Candidate, TuneRequest, candidate_request, candidates
from pipec.tune.measure import measure, run_candidates
from pipec.tune.report import pipe_lines, why
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
devices_per_node 8
links intra(latency=5us, bandwidth=600GB/s), inter(latency=10us, bandwidth=25GB/s)
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


def _alone(plan: Plan) -> float:
    """The step predicted from the stages timed alone (and the links and overhead as the probe timed them, its
    two ranks alone): the profile before it timed the run's ranks at once, on the same program."""
    sd = ((plan.model or {}).get("profile") or {}).get("slowdown")
    if not sd:
        return plan.prediction.step_time
    f = (sd["fwd"] + sd["bwd"]) / 2

    def cost(c: Cost) -> Cost:
        return Cost(fwd=c.fwd / sd["fwd"], bwd=c.bwd / sd["bwd"], bwd_i=c.bwd_i / sd["bwd_i"],
                    bwd_w=c.bwd_w / sd["bwd"], optim=c.optim / sd["optim"])

    links = {k: replace(v, latency_s=v.latency_s / f, bandwidth_Bps=v.bandwidth_Bps * f)
             if v.measured and v.measured.backend == "gloo" else v for k, v in plan.links.items()}
    overhead = plan.overhead and replace(plan.overhead, seconds={k: t / f for k, t in plan.overhead.seconds.items()})
    stages = tuple(replace(st, cost=cost(st.cost)) for st in plan.stages)
    return _crowd(replace(plan, stages=stages, links=links, overhead=overhead))


def _crowd(plan: Plan) -> float:
    """The step predicted with every compute at its cost in the profile's crowd (no processor sharing: a rank
    alone in the bubble gets no more of the cores than with all of them computing)."""
    return simulate_costs(plan, replace(plan_costs(plan), sharing=None)).step_time


def _measured(scored: list[Scored], folder: str, steps: int, rounds: int) -> dict[Candidate, list[list[float]]]:
    """Every candidate's measured steps (the warm-up step left out), per round; rounds alternate the order
    (forwards, backwards, ...) so a drift in the machine's load does not favour the candidates run first."""
    out: dict[Candidate, list[list[float]]] = {s.candidate: [] for s in scored}
    for r in range(rounds):
        order = scored if r % 2 == 0 else scored[::-1]
        print(f"  round {r + 1}/{rounds} ({'forwards' if r % 2 == 0 else 'backwards'}), load average "
              f"{os.getloadavg()[0]:.2f}", flush=True)
        workdir = os.path.join(folder, f"grid{r}")
        got, notes = run_candidates(order, workdir=workdir, steps=steps)
        for n in notes:
            print("  note:", n)
        for i, s in enumerate(got):
            if s.measured_step is not None:
                with open(os.path.join(workdir, f"candidate{i}.report.json"), encoding="utf-8") as f:
                    out[s.candidate].append([x["step_time"] for x in json.load(f)["steps"][1:]])
    print(f"  done, load average {os.getloadavg()[0]:.2f}")
    return out


def _repeatability(runs: dict[Candidate, list[list[float]]]) -> float:
    """The mean Spearman correlation between two rounds' median steps over the candidates: how well the
    measurement ranks the candidates against itself, the most any prediction can reach."""
    kept = [c for c, rs in runs.items() if len(rs) == max(map(len, runs.values()))]
    n = len(runs[kept[0]]) if kept else 0
    pairs = [(a, b) for a in range(n) for b in range(a + 1, n)]
    if not pairs:
        return float("nan")
    return statistics.fmean(spearman([statistics.median(runs[c][a]) for c in kept],
                                     [statistics.median(runs[c][b]) for c in kept]) for a, b in pairs)


def _small(folder: str) -> TuneRequest:
    """The small GPT's tune request for 4 devices (its schedule file written to ``folder``)."""
    return TuneRequest(base=load_spec(_write(folder, "gpt_small.pipe", SMALL), {}).request, num_devices=4)


def _grid(treq: TuneRequest) -> list[Scored]:
    """The grid's candidates compiled through tune's own front end (one trace per microbatch shape, one cut
    and one profile per distinct cut)."""
    grid = [c for c in candidates(treq) if _in_grid(c)]
    t0 = time.perf_counter()
    scored, graphs = [], _Graphs(treq, 16)
    for c in grid:
        plan = compile_request(candidate_request(treq, c, global_batch=16), graph=graphs.graph(c)).plan
        scored.append(_score(c, plan, 16 * 128, None, 4))
    slowdowns = sorted({s.plan.model["profile"]["slowdown"]["fwd"] for s in scored})
    print(f"  {len(grid)} grid candidates compiled in {time.perf_counter() - t0:.1f} s; the crowd's forward "
          f"slowdown per cut {', '.join(f'{x:.2f}' for x in slowdowns)}")
    return scored


def part_a(folder: str, steps: int, rounds: int) -> None:
    print(f"(a) the grid on 4 ranks, global batch 16, costs profile, {steps} steps each, {rounds} rounds; "
          f"{os.cpu_count()} cores")
    cache.reprofile()   # the grid and the tune price from timings taken now, not from an earlier run's cache
    t0 = time.perf_counter()
    treq = _small(folder)
    full = tune(treq)       # first: its one crowd is the one the grid's cuts then read (every shape at it)
    search_s = time.perf_counter() - t0
    scored = _grid(treq)
    runs = _measured(scored, folder, steps, rounds)
    rows = [(s, _alone(s.plan), statistics.median(x for r in runs[s.candidate] for x in r), _crowd(s.plan))
            for s in scored if runs[s.candidate]]
    print(f"  {'layout':<7} {'schedule':<17} {'v':>2} {'M':>3} {'alone':>9} {'crowd':>9} {'predicted':>10} "
          f"{'measured':>9} {'pred/meas':>9}  rounds")
    for s, alone, meas, crowd in sorted(rows, key=lambda r: r[0].rank_key()):
        c = s.candidate
        each = " ".join(f"{statistics.median(r) * 1e3:.0f}" for r in runs[c])
        print(f"  {c.layout:<7} {c.schedule:<17} {c.num_chunks:>2} {c.num_microbatches:>3} {alone * 1e3:>7.1f}ms "
              f"{crowd * 1e3:>7.1f}ms {s.step_time * 1e3:>8.1f}ms {meas * 1e3:>7.1f}ms {s.step_time / meas:>9.2f}  "
              f"{each}")
    best = min(rows, key=lambda r: r[2])
    print(f"  the measurement against itself: Spearman between rounds {_repeatability(runs):.3f} (the most a "
          f"prediction can reach)")
    for name, at in (("predicted", lambda r: r[0].step_time), ("crowd", lambda r: r[3]), ("alone", lambda r: r[1])):
        pick = min(rows, key=lambda r: (at(r), r[0].rank_key()))
        rho = spearman([at(r) for r in rows], [r[2] for r in rows])
        err = statistics.fmean(abs(at(r) / r[2] - 1) for r in rows)
        print(f"  {name:>9}: pick {_name(pick[0].candidate)} measured {pick[2] * 1e3:.1f} ms, "
              f"{pick[2] / best[2] - 1:.1%} over the best measured {_name(best[0].candidate)} {best[2] * 1e3:.1f} ms "
              f"(goal <= 5%); Spearman {rho:.3f} (goal >= 0.8); mean |pred/meas - 1| {err:.0%}")
    print(f"  tune over its whole space ({full.num_candidates} candidates, {search_s:.1f} s): "
          f"{_name(full.best.candidate)}, predicted {full.best.step_time * 1e3:.2f} ms; run first, with --reprofile, so "
          f"its crowd prices every grid cut")
    top3, notes3 = measure(full, 3, workdir=os.path.join(folder, "top3"), steps=steps)
    for s in top3.top[:3]:
        m = f"{s.measured_step * 1e3:.2f} ms" if s.measured_step else "not measured"
        print(f"    --measure 3: {_name(s.candidate)}: predicted {s.step_time * 1e3:.2f} ms, measured {m}")
    for n in notes3:
        print("  note:", n)
    print(f"  --measure 3 pick: {_name(top3.best.candidate)}")


def _grid_key(plan: Plan) -> tuple:
    """(pp, dp, schedule, virtual, microbatches) of a plan (one read from an earlier run's plan.json too)."""
    return (plan.mesh.pp, plan.mesh.dp, plan.spec["schedule"], plan.num_stages // plan.mesh.pp, plan.num_microbatches)


def _steps_of(report_path: str) -> list[float]:
    with open(report_path, encoding="utf-8") as f:
        return [x["step_time"] for x in json.load(f)["steps"][1:]]


def _grid_reports(folder: str):
    """Per measured grid run of an earlier ``--part a --out`` folder: its key, its plan.json (parsed), that file's
    path and its steps but the warm-up."""
    for report in glob.glob(os.path.join(folder, "grid*", "candidate*.report.json")):
        path = report.replace(".report.json", ".json")
        with open(path, encoding="utf-8") as f:
            plan = json.load(f)
        yield _grid_key(load_plan(plan)), plan, path, _steps_of(report)


def pooled(folders: list[str]) -> None:
    """Each earlier run's predictions against every run's measured steps pooled (see the module's text)."""
    steps: dict[str, dict[tuple, list[float]]] = {}
    pred: dict[str, dict[tuple, float]] = {}
    for d in folders:
        for key, plan, _, xs in _grid_reports(d):
            steps.setdefault(d, {}).setdefault(key, []).extend(xs)
            pred.setdefault(d, {})[key] = plan["prediction"]["step_time"]
    keys = sorted(set.intersection(*(set(v) for v in steps.values())))
    truth = {k: statistics.median(x for d in folders for x in steps[d][k]) for k in keys}
    best = min(keys, key=truth.get)
    print(f"pooled: {len(folders)} runs, {len(keys)} candidates, best measured {' '.join(map(str, best))} "
          f"{truth[best] * 1e3:.1f} ms")
    for d in folders:
        pick = min(keys, key=lambda k: pred[d][k])
        others = [statistics.median(x for e in folders if e != d for x in steps[e][k]) for k in keys]
        own = [statistics.median(steps[d][k]) for k in keys]
        print(f"  {d}: its predictions against the pooled: pick {' '.join(map(str, pick))} "
              f"{truth[pick] / truth[best] - 1:.1%} over the best, Spearman "
              f"{spearman([pred[d][k] for k in keys], [truth[k] for k in keys]):.3f}; its measurement against "
              f"the others' pooled: Spearman {spearman(own, others):.3f}")


def against(folders: list[str]) -> None:
    """The grid's predictions made now (this checkout's model, a fresh profile) against earlier runs' measured
    steps pooled: a change to the model scored without running the grid again."""
    scored = _grid(_small(tempfile.mkdtemp(prefix="pipec-bench-tune-")))
    steps: dict[tuple, list[float]] = {}
    for d in folders:
        for key, _, _, xs in _grid_reports(d):
            steps.setdefault(key, []).extend(xs)
    rows = [(s, statistics.median(steps[k])) for s in scored if (k := _grid_key(s.plan)) in steps]
    for s, meas in sorted(rows, key=lambda r: r[1]):
        print(f"  {_name(s.candidate):<32} predicted {s.step_time * 1e3:7.1f} ms  measured {meas * 1e3:7.1f} ms  "
              f"{s.step_time / meas:5.2f}")
    best = min(m for _, m in rows)
    pick = min(rows, key=lambda r: (r[0].step_time, r[0].rank_key()))
    err = statistics.fmean(abs(s.step_time / m - 1) for s, m in rows)
    print(f"  {len(rows)} candidates against {len(folders)} runs' steps: pick {_name(pick[0].candidate)} "
          f"{pick[1] / best - 1:.1%} over the best measured (goal <= 5%); Spearman "
          f"{spearman([s.step_time for s, _ in rows], [m for _, m in rows]):.3f} (goal >= 0.8); "
          f"mean |pred/meas - 1| {err:.0%}")


def confirm(folder: str, steps: int, rounds: int, best: int = 3) -> None:
    """Tune's measured pick of an earlier ``--part a --out DIR`` run beside the grid's ``best`` fastest measured,
    run again in turn (``rounds`` times, alternating the order, so a drift in the machine's load favours none):
    whether the pick stays within 5% of the best, measured in the same minutes."""
    picks = [(statistics.median(_steps_of(r)), r.replace(".report.json", ".json"))
             for r in glob.glob(os.path.join(folder, "top3", "candidate*.report.json"))]
    grid: dict[tuple, tuple[list[float], str]] = {}
    for key, _, plan_path, xs in _grid_reports(folder):
        grid.setdefault(key, ([], plan_path))[0].extend(xs)
    fastest = sorted(grid.items(), key=lambda kv: statistics.median(kv[1][0]))[:best]
    runs = [("tune's pick", min(picks)[1])] + [(" ".join(map(str, k)), path) for k, (_, path) in fastest]
    got: dict[str, list[float]] = {name: [] for name, _ in runs}
    work = os.path.join(folder, "confirm")
    os.makedirs(work, exist_ok=True)
    for r in range(rounds):
        for i, (name, path) in enumerate(runs if r % 2 == 0 else runs[::-1]):
            with open(path, encoding="utf-8") as f:
                mesh = json.load(f)["mesh"]
            report = os.path.join(work, f"round{r}_{i}.report.json")
            subprocess.run([sys.executable, "-m", "pipec", "run", path, "--nproc", str(mesh["pp"] * mesh["dp"]),
                            "--steps", str(steps), "--report", report, "--quiet"], check=True,
                           stdout=subprocess.DEVNULL, timeout=600)
            got[name].extend(_steps_of(report))
        print(f"  round {r + 1}/{rounds}, load average {os.getloadavg()[0]:.2f}", flush=True)
    meds = {name: statistics.median(xs) for name, xs in got.items()}
    top = min(meds.values())
    for name, path in runs:
        print(f"  {name:<32} {meds[name] * 1e3:7.1f} ms  {meds[name] / top - 1:+6.1%}  ({path})")
    print(f"  tune's pick {meds[runs[0][0]] / top - 1:.1%} over the best of these (goal <= 5%)")


def _name(c: Candidate) -> str:
    return f"{c.layout} {c.schedule} v {c.num_chunks} M {c.num_microbatches}"


def part_b(folder: str) -> None:
    path = _write(folder, "gpt13b.pipe", BIG)
    treq = TuneRequest(base=load_spec(path, {}).request, num_devices=64)
    t0 = time.perf_counter()
    r = tune(treq)
    total = time.perf_counter() - t0
    print(f"(b) 13B GPT on 64 x 80 GB in nodes of 8 (NVLink 600 GB/s, IB 25 GB/s), costs flops at 989 TFLOP/s, "
          f"load {os.getloadavg()[0]:.2f}, global batch {r.global_batch}: search "
          f"{total:.1f} s (goal <= 60 s): {r.num_candidates} candidates, {r.num_compiled} compiled, {r.num_pruned} "
          f"pruned, {r.num_over_budget} over budget, {r.num_unbuildable} unbuildable, {r.num_traces} traces, "
          f"{r.num_cuts} cuts")
    rows = [("", s) for s in r.top[:5]] + ([("best tp 1: ", r.best_tp1)] if r.best_tp1 else [])
    for label, s in rows:
        c = s.candidate
        print(f"  {label}{c.layout:<14} {c.schedule:<17} v {c.num_chunks} M {c.num_microbatches:<3} recompute "
              f"{c.recompute_text:<12} step {s.step_time:.3f} s  MFU {s.mfu:.1%}  scaling "
              f"{s.scaling_efficiency:.1%}  bubble {s.bubble:.1%}  peak {s.peak_memory / 2**30:.1f} GiB")
    print("  why:")
    for line in why(r):
        print("   -", line)
    print("  as schedule-file lines:", " | ".join(pipe_lines(r.best.candidate, r.best.plan)))


def part_c(folder: str) -> None:
    """The grid priced from timed pieces (tune's way under costs profile) beside each cut timed on its own stages,
    both in one cache, so the stages' own timings are those the pieces were priced against."""
    treq = _small(folder)
    space = candidates(treq)
    grid = [c for c in space if _in_grid(c)]
    t0 = time.perf_counter()
    summed = _Graphs(treq, 16, space)
    rows = []
    for c in grid:
        req = candidate_request(treq, c, global_batch=16)
        a = compile_request(req, graph=summed.graph(c), verify=False, events=False).plan.prediction.step_time
        rows.append((c, a))
    priced_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    rows = [(c, a, compile_request(candidate_request(treq, c, global_batch=16), graph=summed.timed(c), verify=False,
                                   events=False).plan.prediction.step_time) for c, a in rows]
    timed_s = time.perf_counter() - t0
    print(f"(c) the grid ({len(grid)} candidates, 4 ranks, costs profile): priced from "
          f"{summed.pieces.num_timed} timed pieces in {priced_s:.1f} s, each cut then timed on its own stages in "
          f"{timed_s:.1f} s")
    print(f"  {'layout':<7} {'schedule':<17} {'v':>2} {'M':>3} {'summed':>9} {'timed':>9} {'summed/timed':>12}")
    for c, a, b in sorted(rows, key=lambda r: r[2]):
        print(f"  {c.layout:<7} {c.schedule:<17} {c.num_chunks:>2} {c.num_microbatches:>3} {a * 1e3:>7.1f}ms "
              f"{b * 1e3:>7.1f}ms {a / b:>12.3f}")
    err = statistics.fmean(abs(a / b - 1) for _, a, b in rows)
    pick_a, pick_b = min(rows, key=lambda r: r[1]), min(rows, key=lambda r: r[2])
    print(f"  Spearman summed vs timed {spearman([r[1] for r in rows], [r[2] for r in rows]):.3f}; mean "
          f"|summed/timed - 1| {err:.1%}; summed pick {_name(pick_a[0])} at {pick_a[2] * 1e3:.1f} ms timed, "
          f"{pick_a[2] / pick_b[2] - 1:.1%} over the timed pick {_name(pick_b[0])}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("a", "b", "c", "both"), default="both")
    ap.add_argument("--steps", type=int, default=10, help="steps of every run (the first, a warm-up, left out)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of every grid candidate, in alternating order")
    ap.add_argument("--out", default=None, help="folder for the plans and reports (default: a temporary one)")
    ap.add_argument("--pool", nargs="+", metavar="DIR", help="compare earlier --part a runs' folders; runs nothing")
    ap.add_argument("--confirm", metavar="DIR", help="run an earlier --part a run's tune pick beside its grid's 3 "
                    "best measured again, in turn, --rounds times")
    ap.add_argument("--against", nargs="+", metavar="DIR",
                    help="predict the grid now and score it against earlier --part a runs' measured steps")
    args = ap.parse_args()
    if args.pool:
        pooled(args.pool)
        return 0
    if args.against:
        against(args.against)
        return 0
    if args.confirm:
        confirm(args.confirm, args.steps, args.rounds)
        return 0
    folder = args.out or tempfile.mkdtemp(prefix="pipec-bench-tune-")
    os.makedirs(folder, exist_ok=True)
    if args.part in ("b", "both"):
        part_b(folder)
    if args.part in ("a", "both"):
        part_a(folder, args.steps, args.rounds)
    if args.part == "c":
        part_c(folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
