"""Runtime benchmark: pipec's executor beside torch.distributed.pipelining, and the accounting's fidelity.

Prints figures, asserts nothing (issue 5, "Benchmarks"). Three tables:

1. **Speed.** The shared model (bench/shared_gpt.py: a GPT with untied
   embeddings, a raw position-embedding parameter, 8 pre-LN blocks of causal
   SDPA attention and a 4x GELU MLP), gloo, one thread per rank, at 2 and 4
   ranks, with GPipe, 1F1B and Interleaved1F1B (virtual 2), in two cases:
   host-bound (dim 32, seq 16, batch 64, 32 microbatches: per-instruction
   overhead dominates; goal pipec/torch <= 0.8) and compute-bound (dim 256,
   seq 128, batch 16, 8 microbatches; goal <= 0.95). Run by pipec (``pipec
   run``) and by torch.distributed.pipelining
   (``bench/torch_pipelining_worker.py --model shared`` under torchrun) with
   the same stage boundaries (block splits spaced evenly, the embeddings on
   the first stage, the norm and head on the last), mean cross-entropy and a
   foreach AdamW step (pipec's default kernel) every iteration. Runs alternate
   (pipec, torch, then torch, pipec, ...). A run's first step is a warm-up and
   is left out; the table gives the median over every other step of every
   run, the ratio pipec / torch, and each runtime's host microseconds per
   instruction (torch: per action), measured the same way: (step - compute -
   comm wait) / instructions.
2. **Emulated fidelity.** Schedule-only plans run with ``--emulate`` (every
   compute sleeps its unit cost) of every schedule at 4 and 8 ranks, M = 2P,
   3 steps: predicted (the re-simulation under what the run measured at
   start-up) and measured bubble of the median step, the median of each
   run's diff (goal: |diff| <= 0.02). With more ranks than cores the ranks
   time-share the CPU while they sleep, so idle time there is still the
   schedule's.
3. **Profiled fidelity.** The 2-rank runs of table 1 (compiled with
   ``--costs profile``): the plan's predicted step time beside the measured
   median (goal: within 10%).
4. **The demo's plans** (examples/gpt_1f1b.pipe, gpt_interleaved.pipe):
   predicted beside measured bubble and step (goal: 3 points, 5%).

    .venv/bin/python bench/runtime.py                  # everything, 3 runs of each (about 30 minutes)
    .venv/bin/python bench/runtime.py --ranks 2 --runs 5
    .venv/bin/python bench/runtime.py --quick          # 1 run of 6 steps, 2 ranks, 1F1B; a short emulation
    .venv/bin/python bench/runtime.py --only speed --schedules 1f1b,gpipe
    .venv/bin/python bench/runtime.py --only emulate
    .venv/bin/python bench/runtime.py --only emulate --emulate-schedules looped_bfs --emulate-ranks 8 --work /tmp/emu
    .venv/bin/python bench/runtime.py --only speed --cases host --runs 3
    .venv/bin/python bench/runtime.py --only demo

Timings on a shared 2-core machine are noisy: the load average is printed
with the figures; run it when the machine is quiet and compare medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "bench" / "torch_pipelining_worker.py"
MODEL = "bench.shared_gpt:build"
CASES = {  # name -> (model kwargs, batch, microbatches)
    "host": (dict(layers=8, dim=32, heads=4, vocab=1000, seq=16), 64, 32),
    "compute": (dict(layers=8, dim=256, heads=4, vocab=1000, seq=128), 16, 8),
}
"""The shared model (bench/shared_gpt.py) host-bound (per-instruction overhead dominates, as on a GPU with small
microbatches) and compute-bound."""
DEMO = ("examples/gpt_1f1b.pipe", "examples/gpt_interleaved.pipe")
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2}  # name -> chunks per rank
EMULATED_CHUNKS = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "looped_bfs": 2, "zb_h1": 1, "zbv": 2,
                   "interleaved_zb": 2}
"""Every schedule the emulated fidelity runs, with its chunks per rank."""
EMULATED = [(schedule, ranks, 2 * ranks, v, 0.01) for ranks in (4, 8) for schedule, v in EMULATED_CHUNKS.items()]
"""(schedule, ranks, microbatches, virtual, unit time in seconds): the issue's goal, M = 2P at the default
``--unit-time`` (10 ms), over :data:`EMULATED_STEPS` steps."""
EMULATED_STEPS = 3
EMULATED_GOAL = 0.02
"""|measured - predicted| bubble of the median step."""


@dataclass
class Config:
    schedule: str
    ranks: int
    case: str = "compute"

    @property
    def virtual(self) -> int:
        return SCHEDULES[self.schedule]

    @property
    def splits(self) -> list[int]:
        """Block indices a stage starts before: the blocks spread evenly over ranks x virtual stages."""
        layers, num_stages = CASES[self.case][0]["layers"], self.ranks * self.virtual
        return [layers * i // num_stages for i in range(1, num_stages)]

    @property
    def name(self) -> str:
        return f"{self.case}: {self.schedule}, {self.ranks} ranks" + (f", v={self.virtual}" if self.virtual > 1 else "")


@dataclass
class Result:
    pipec: list[list[float]] = field(default_factory=list)  # per run: step times after the warm-up step
    torch: list[list[float]] = field(default_factory=list)
    predicted_step: float | None = None
    bubble: list[tuple[float, float]] = field(default_factory=list)  # per pipec run: (predicted, measured)
    compute: list[tuple[float, float]] = field(default_factory=list)  # per pipec run: busiest rank's (predicted, measured)
    resimulated: list[float] = field(default_factory=list)  # per pipec run: the plan simulated with its measured costs
    loss: dict[str, float] = field(default_factory=dict)
    host_us: dict[str, list[float]] = field(default_factory=lambda: {"pipec": [], "torch": []})
    """Per run: the runtime's host microseconds per instruction (pipec) or action (torch), measured the same
    way: (step - compute - comm wait) / instructions, the mean over ranks of the median step."""


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def sh(cmd: list[str], *, env: dict | None = None, timeout: float = 900) -> str:
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)
    if r.returncode != 0:
        raise SystemExit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r.stdout


def pipec(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipec", *args]


def torchrun(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


def quiet_env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun sets it too; one thread per rank on both sides
    env["PYTHONWARNINGS"] = "ignore"
    return env


def compile_model_plan(cfg: Config, out: Path) -> None:
    kwargs, batch, mbs = CASES[cfg.case]
    flags = ["compile", "--model", MODEL, *[a for k, v in kwargs.items() for a in ("--model-arg", f"{k}={v}")],
             "--input", f"tokens:int64[{batch},{kwargs['seq']}]", "--schedule", cfg.schedule,
             "--ranks", str(cfg.ranks), "--microbatches", str(mbs), "--costs", "profile",
             "--partition", "split before " + ", ".join(f"blocks.{i}" for i in cfg.splits), "-o", str(out)]
    if cfg.virtual > 1:
        flags += ["--virtual", str(cfg.virtual)]
    sh(pipec(*flags))


def run_pipec(cfg: Config, plan: Path, steps: int, work: Path, res: Result) -> None:
    report = work / f"report_{cfg.case}_{cfg.schedule}_{cfg.ranks}.json"
    sh(pipec("run", str(plan), "--nproc", str(cfg.ranks), "--steps", str(steps), "--report", str(report),
             "--quiet"), env=quiet_env())
    r = json.loads(report.read_text())
    res.pipec.append([s["step_time"] for s in r["steps"][1:]])
    res.predicted_step = r["predicted"]["step_time"]
    res.bubble.append((r["bubble_fraction"]["predicted"], r["bubble_fraction"]["measured"]))
    res.compute.append((max(x["compute"] for x in r["predicted"]["per_rank"]),
                        max(x["compute"] for x in r["measured"]["per_rank"])))
    res.resimulated.append(resimulate(plan, r["measured"]["events"]))
    res.loss["pipec"] = r["steps"][-1].get("loss", float("nan"))
    counts = [len(rk["instructions"]) for rk in json.loads(plan.read_text())["ranks"]]
    step = r["measured"]["step_time"]
    res.host_us["pipec"].append(statistics.mean((step - x["compute"] - x["comm_wait"]) / counts[x["rank"]] * 1e6
                                                for x in r["measured"]["per_rank"]))


def resimulate(plan_path: Path, events: list) -> float:
    """The plan's predicted step with each stage's forward and backward cost replaced by its median measured time.

    What is left between this and the measured step is what the simulator does not model (message latency, the
    optimizer step, host overhead), apart from how fast the machine computes at the moment.
    """
    from dataclasses import replace

    from pipec.compiler.ir.plan_json import read_plan
    from pipec.compiler.sim.simulate import simulate

    plan = read_plan(str(plan_path))
    times: dict[tuple[str, int], list[float]] = {}
    for _rank, op, start, end in events:
        if op[:1] in "FBIW" and "." in op:
            times.setdefault((op[0], int(op[1:].split(".")[0])), []).append(end - start)
    stages = []
    for st in plan.stages:
        c = st.cost
        med = {k: statistics.median(times[(k, st.stage)]) for k in "FBIW" if (k, st.stage) in times}
        bwd = med.get("B", med.get("I", 0.0) + med.get("W", 0.0)) or c.bwd
        share = c.bwd_i / c.bwd if c.bwd else 0.5
        cost = replace(c, fwd=med.get("F", c.fwd), bwd=bwd, bwd_i=med.get("I", bwd * share),
                       bwd_w=med.get("W", bwd * (1 - share)))
        stages.append(replace(st, cost=cost))
    return simulate(replace(plan, stages=tuple(stages))).step_time


def run_torch(cfg: Config, steps: int, work: Path, res: Result) -> None:
    out = work / f"torch_{cfg.case}_{cfg.schedule}_{cfg.ranks}.json"
    kwargs, batch, mbs = CASES[cfg.case]
    sh(torchrun(cfg.ranks, str(WORKER), "--schedule", cfg.schedule, "--chunks", str(cfg.virtual),
                "--splits", ",".join(map(str, cfg.splits)), "--microbatches", str(mbs), "--model", "shared",
                "--model-args", ",".join(f"{k}={v}" for k, v in kwargs.items()), "--foreach",
                "--batch", str(batch), "--steps", str(steps), "--out", str(out)), env=quiet_env())
    r = json.loads(out.read_text())
    rows = r["steps"][1:]
    res.torch.append([s["step_time"] for s in rows])
    res.loss["torch"] = r["steps"][-1]["loss"]
    median = sorted(rows, key=lambda s: s["step_time"])[len(rows) // 2]
    res.host_us["torch"].append(statistics.mean((x["wall"] - x["compute"] - x["wait"]) / x["actions"] * 1e6
                                                for x in median["ranks"]))


def median_of(runs: list[list[float]]) -> float:
    return statistics.median(t for run in runs for t in run)


def spread(runs: list[list[float]]) -> str:
    """The lowest and highest of the per-run medians."""
    meds = [statistics.median(run) for run in runs]
    return f"{min(meds):.2f}-{max(meds):.2f}"


def speed(configs: list[Config], runs: int, steps: int, work: Path) -> dict[str, Result]:
    results = {cfg.name: Result() for cfg in configs}
    plans = {}
    for cfg in configs:
        plans[cfg.name] = work / f"plan_{cfg.schedule}_{cfg.ranks}.json"
        compile_model_plan(cfg, plans[cfg.name])
    for i in range(runs):
        for cfg in configs:
            res = results[cfg.name]
            order = [run_pipec, run_torch] if i % 2 == 0 else [run_torch, run_pipec]
            for fn in order:
                if fn is run_pipec:
                    run_pipec(cfg, plans[cfg.name], steps, work, res)
                else:
                    run_torch(cfg, steps, work, res)
            print(f"  run {i + 1}/{runs} {cfg.name}: pipec {statistics.median(res.pipec[-1]):.3f} s, "
                  f"torch {statistics.median(res.torch[-1]):.3f} s ({load()})", file=sys.stderr, flush=True)
    return results


def emulate(cases, runs: int, steps: int, work: Path) -> list[tuple[str, list[float], list[float]]]:
    rows = []
    for schedule, ranks, mbs, virtual, unit in cases:
        plan = work / f"emu_{schedule}_{ranks}_{mbs}.json"
        flags = ["compile", "--schedule", schedule, "--ranks", str(ranks), "--microbatches", str(mbs), "-o", str(plan)]
        if virtual > 1:
            flags += ["--virtual", str(virtual)]
        sh(pipec(*flags))
        measured, predicted = [], []
        for i in range(runs):
            report = work / f"emu_{schedule}_{ranks}_{mbs}_run{i}.json"  # kept under --work for pipec show
            sh(pipec("run", str(plan), "--nproc", str(ranks), "--emulate", "--unit-time", str(unit), "--steps",
                     str(steps), "--report", str(report), "--quiet"), env=quiet_env())
            r = json.loads(report.read_text())
            predicted.append(r["bubble_fraction"]["predicted"])  # each run re-simulates under what it measured
            measured.append(r["bubble_fraction"]["measured"])
        name = f"{schedule}, {ranks} ranks, M={mbs}" + (f", v={virtual}" if virtual > 1 else "") + f", {unit * 1e3:g} ms/unit"
        rows.append((name, predicted, measured))
        print(f"  {name}: predicted {', '.join(f'{p:.3f}' for p in predicted)}, "
              f"measured {', '.join(f'{m:.3f}' for m in measured)} "
              f"({load()})", file=sys.stderr, flush=True)
    return rows


def print_speed(results: dict[str, Result], runs: int) -> None:
    print(f"\nSpeed: median step time over every step but each run's first ({runs} runs of each, alternating)")
    print(f"{'config':42} {'pipec (s)':>10} {'torch (s)':>10} {'ratio':>7}  {'goal':>5}  "
          f"{'pipec runs':>10} {'torch runs':>10}  {'host us/ins pipec':>17} {'torch':>6}  last loss (pipec / torch)")
    for name, r in results.items():
        p, t = median_of(r.pipec), median_of(r.torch)
        goal = GOALS[name.split(":")[0]]
        ok = "ok" if p <= goal * t else "MISS"
        print(f"{name:42} {p:10.3f} {t:10.3f} {p / t:7.3f}  {ok:>5}  {spread(r.pipec):>10} {spread(r.torch):>10}  "
              f"{statistics.median(r.host_us['pipec']):17.0f} {statistics.median(r.host_us['torch']):6.0f}  "
              f"{r.loss.get('pipec', float('nan')):.3f} / {r.loss.get('torch', float('nan')):.3f}")
    print("(runs: the lowest and highest per-run median; goal: pipec/torch <= 0.8 host-bound, <= 0.95 compute-bound;"
          "\n host us/ins: (step - compute - comm wait) / instructions (torch: compute, p2p and optimizer actions), "
          "the mean over ranks of the median step; the data differ, so do the losses)")


def print_profile_fidelity(results: dict[str, Result]) -> None:
    rows = [(n, r) for n, r in results.items() if ", 2 ranks" in n]
    if not rows:
        return
    print("\nProfiled fidelity at 2 ranks (--costs profile): the plan's predicted step beside the measured median")
    print(f"{'config':34} {'predicted (s)':>13} {'measured (s)':>12} {'diff':>7}  {'goal':>5}  "
          f"{'bubble pred':>11} {'bubble meas':>11}  {'compute meas/pred':>17}  {'resimulated (s)':>15} {'diff':>7}")
    for name, r in rows:
        m = median_of(r.pipec)
        d = (m - r.predicted_step) / r.predicted_step
        bp = statistics.median(b[0] for b in r.bubble)
        bm = statistics.median(b[1] for b in r.bubble)
        cr = statistics.median(c[1] / c[0] for c in r.compute)
        rs = statistics.median(r.resimulated)
        print(f"{name:34} {r.predicted_step:13.3f} {m:12.3f} {d:+7.1%}  {'ok' if abs(d) <= 0.10 else 'MISS':>5}  "
              f"{bp:11.3f} {bm:11.3f}  {cr:17.2f}  {rs:15.3f} {(m - rs) / rs:+7.1%}")
    print("(compute meas/pred: the busiest rank's measured compute in the median step over its profiled compute; "
          "above 1 when the machine is slower now than when the plan was profiled, e.g. under load;\n"
          " resimulated: the plan simulated with each stage's median measured forward and backward times, so the diff "
          "is what the simulator leaves out: latency, the optimizer step, host overhead)")


GOALS = {"host": 0.8, "compute": 0.95}


def demo(runs: int, steps: int, work: Path) -> list[tuple[str, dict, list[dict]]]:
    """The demo's two plans (examples/gpt_1f1b.pipe, gpt_interleaved.pipe): compiled, run ``runs`` times."""
    rows = []
    for path in DEMO:
        plan = work / f"demo_{Path(path).stem}.json"
        sh(pipec("compile", path, "-o", str(plan)))
        reports = []
        for _ in range(runs):
            report = work / "demo_report.json"
            world = json.loads(plan.read_text())["mesh"]
            sh(pipec("run", str(plan), "--nproc", str(world["pp"] * world["dp"]), "--steps", str(steps), "--report",
                     str(report), "--quiet"), env=quiet_env())
            reports.append(json.loads(report.read_text()))
        rows.append((path, reports[0]["predicted"], reports))
        print(f"  {path}: ({load()})", file=sys.stderr, flush=True)
    return rows


def print_demo(rows) -> None:
    print("\nThe demo's plans: predicted beside measured (median step of each run, median over runs)")
    print(f"{'plan':34} {'bubble pred':>11} {'bubble meas':>11} {'step pred (s)':>13} {'step meas (s)':>13} {'diff':>7}")
    for path, pred, reports in rows:
        bp = statistics.median(r["bubble_fraction"]["predicted"] for r in reports)
        bm = statistics.median(r["bubble_fraction"]["measured"] for r in reports)
        sm = statistics.median(r["measured"]["step_time"] for r in reports)
        print(f"{path:34} {bp:11.3f} {bm:11.3f} {pred['step_time']:13.3f} {sm:13.3f} "
              f"{(sm - pred['step_time']) / pred['step_time']:+7.1%}")
    print("(goal: within 3 points of bubble and 5% of step time)")


def print_emulated(rows, runs: int) -> None:
    print(f"\nEmulated fidelity (--emulate): bubble of the median step, median over {runs} runs")
    print(f"{'config':46} {'predicted':>9} {'measured':>9} {'diff':>7}  goal (|diff| <= {EMULATED_GOAL})")
    for name, pred, meas in rows:
        diff = statistics.median(m - p for p, m in zip(pred, meas))
        ok = abs(diff) <= EMULATED_GOAL
        print(f"{name:46} {statistics.median(pred):9.3f} {statistics.median(meas):9.3f} {diff:+7.3f}  "
              f"{'ok' if ok else 'MISS'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2,4", help="comma-separated rank counts for the speed table (default 2,4)")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated, of " + ", ".join(SCHEDULES))
    p.add_argument("--runs", type=int, default=3, help="runs of each config and side (default 3)")
    p.add_argument("--steps", type=int, default=10, help="steps per run, the first left out (default 10)")
    p.add_argument("--only", choices=["speed", "emulate", "demo"], help="one part only")
    p.add_argument("--cases", default="host,compute", help="comma-separated, of " + ", ".join(CASES))
    p.add_argument("--emulate-ranks", default="4,8", help="rank counts for the emulated fidelity (default 4,8)")
    p.add_argument("--emulate-schedules", default=",".join(EMULATED_CHUNKS),
                   help="comma-separated schedules for the emulated fidelity, of " + ", ".join(EMULATED_CHUNKS))
    p.add_argument("--quick", action="store_true", help="one run of 6 steps, 2 ranks, 1F1B; emulation at 4 ranks")
    p.add_argument("--work", help="folder for plans and reports (default: a temporary one)")
    args = p.parse_args(argv)
    if args.quick:
        args.ranks, args.schedules, args.runs, args.steps, args.emulate_ranks = "2", "1f1b", 1, 6, "4"
    configs = [Config(s, int(r), c) for c in args.cases.split(",") for r in args.ranks.split(",")
               for s in args.schedules.split(",")]
    for s in args.schedules.split(","):
        if s not in SCHEDULES:
            p.error(f"--schedules: {s!r} is not one of {', '.join(SCHEDULES)}")
    import torch

    print(f"pipec runtime benchmark: torch {torch.__version__}, {os.cpu_count()} CPUs, {load()} at start")
    with tempfile.TemporaryDirectory(prefix="pipec-bench-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        results = rows = demo_rows = None
        if args.only in (None, "speed"):
            results = speed(configs, args.runs, args.steps, work)
        if args.only in (None, "emulate"):
            ranks = {int(r) for r in args.emulate_ranks.split(",")}
            schedules = args.emulate_schedules.split(",")
            for s in schedules:
                if s not in EMULATED_CHUNKS:
                    p.error(f"--emulate-schedules: {s!r} is not one of {', '.join(EMULATED_CHUNKS)}")
            cases = [c for c in EMULATED if c[1] in ranks and c[0] in schedules]
            if args.quick:
                cases = cases[:1]
            rows = emulate(cases, args.runs, EMULATED_STEPS, work)
        if args.only in (None, "demo"):
            demo_rows = demo(args.runs, max(args.steps, 4), work)
        if results:
            print_speed(results, args.runs)
            print_profile_fidelity(results)
        if rows:
            print_emulated(rows, args.runs)
        if demo_rows:
            print_demo(demo_rows)
        print(f"\n{time.time() - t0:.0f} s; {load()} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
