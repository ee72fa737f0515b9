"""Memory benchmark (prints, not a test): predicted state bytes per rank for each shard mode, beside
the measured ones when a run's report is given, and the source note's 13B example.

Each plan is a small GPT at pp 2, dp 2 and 4 (float32 AdamW: 16 bytes per parameter unsharded), compiled
on the meta device with unit costs, so the predicted half runs anywhere in seconds. The measured half
is a run's report.json: ``pipec run`` writes ``state_bytes`` (one entry per global rank, ``{"rank",
"measured", "predicted", "params", "grads", "optimizer"}``); give the reports as ``MODE:DP=report.json``
and the table adds measured bytes and the error against the prediction (goal: within 5%)::

    .venv/bin/python bench/memory.py                       # predictions and the 13B lines
    .venv/bin/python bench/memory.py --write plans/        # also write each plan, to run with pipec run
    .venv/bin/python bench/memory.py full:2=run/report.json
    .venv/bin/python bench/memory.py --run run/           # the measured half: compile, run and compare

``--run DIR`` compiles every plan with ``costs profile`` (so the predicted step
time is in seconds), runs each under ``pipec run`` (gloo on CPU, ``--steps``,
default 3), and prints the table above with every rank's measured bytes, then
each mode's median step time against ``shard none``, the prediction beside it.
The prediction's links are the defaults (an accelerator's), not gloo's on
localhost, and the ranks share this machine's cores, so the measured times are
the ranks' contention as much as the collectives'.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MODES = ("none", "optimizer", "grads", "full")
DPS = (2, 4)
SMALL = dict(layers=4, dim=256, heads=4, vocab=1000, seq=64)
GPT_13B = dict(layers=40, dim=5120, heads=40, vocab=50304, seq=2048)


def compile_one(cfg: dict, *, pp: int, dp: int, shard: str, batch: int, microbatches: int, costs: str = "unit"):
    from pipec.compiler.driver import compile_request
    from pipec.compiler.ir.plan import Mesh
    from pipec.compiler.request import CompileRequest, ModelSpec, Partition, TensorSpec

    model = ModelSpec(target="pipec.examples.gpt:build", kwargs=cfg,
                      inputs=(TensorSpec("tokens", "int64", (batch, cfg["seq"])),),
                      partition=Partition("auto"), costs=costs, trace="auto")
    return compile_request(CompileRequest(schedule="1f1b", mesh=Mesh(pp=pp, dp=dp, shard=shard),
                                          num_microbatches=microbatches, model=model)).plan


def measured(reports: dict[tuple[str, int], str], mode: str, dp: int) -> list[dict] | None:
    """The report's per-global-rank ``state_bytes`` entries for (mode, dp), if one was given."""
    path = reports.get((mode, dp))
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)["state_bytes"]


def table(reports: dict[tuple[str, int], str], write: str | None) -> None:
    from pipec.compiler.passes.memory import breakdown
    from pipec.compiler.ir.plan_json import write_plan

    print(f"GPT {SMALL} at pp 2, float32 AdamW; predicted state per rank (MiB), measured where given")
    print(f"{'mode':>9} {'dp':>3} {'rank':>4} {'params':>8} {'grads':>8} {'optim':>8} {'state':>8} "
          f"{'unshard':>8} {'measured':>9} {'error':>7}")
    mib = 2.0**20
    for dp in DPS:
        for mode in MODES:
            plan = compile_one(SMALL, pp=2, dp=dp, shard=mode, batch=8, microbatches=4)
            if write:
                os.makedirs(write, exist_ok=True)
                write_plan(plan, os.path.join(write, f"gpt_{mode}_dp{dp}.json"))
            got = {e["rank"]: e for e in measured(reports, mode, dp) or ()}
            for m in breakdown(plan):
                for d in range(dp):  # each dp replica of a pp rank holds the same prediction
                    g = plan.mesh.global_rank(m.rank, d)
                    meas = got.get(g, {}).get("measured")
                    extra = "" if meas is None else f" {meas / mib:9.2f} {100 * (meas - m.state) / m.state:6.1f}%"
                    print(f"{mode:>9} {dp:>3} {g:>4} {m.params / mib:8.2f} {m.grads / mib:8.2f} "
                          f"{m.optimizer / mib:8.2f} {m.state / mib:8.2f} {m.unsharded / mib:8.2f}{extra}")


def run_all(folder: str, steps: int) -> tuple[dict[tuple[str, int], str], dict[tuple[str, int], float]]:
    """Compile (``costs profile``) and run every (mode, dp) plan; their reports, and each predicted step time."""
    from pipec.compiler.ir.plan_json import write_plan

    os.makedirs(folder, exist_ok=True)
    reports, predicted = {}, {}
    for dp in DPS:
        for mode in MODES:
            plan = compile_one(SMALL, pp=2, dp=dp, shard=mode, batch=8, microbatches=4, costs="profile")
            path = os.path.join(folder, f"gpt_{mode}_dp{dp}.json")
            write_plan(plan, path)
            report = os.path.join(folder, f"report_{mode}_dp{dp}.json")
            cmd = [sys.executable, "-m", "pipec", "run", path, "--nproc", str(2 * dp), "--steps", str(steps),
                   "--report", report, "--quiet", "--timeout", "300"]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
            reports[(mode, dp)] = report
            predicted[(mode, dp)] = plan.prediction.step_time
    return reports, predicted


def step_times(reports: dict[tuple[str, int], str], predicted: dict[tuple[str, int], float]) -> None:
    """Each mode's median step time, measured and predicted, and each against shard none at the same dp."""
    print("\nstep time (median step), each mode against shard none at its dp")
    print(f"{'mode':>9} {'dp':>3} {'measured':>9} {'x none':>7} {'predicted':>10} {'x none':>7}")
    for dp in DPS:
        for mode in MODES:
            with open(reports[(mode, dp)], encoding="utf-8") as f:
                t = json.load(f)["measured"]["step_time"]
            with open(reports[("none", dp)], encoding="utf-8") as f:
                base = json.load(f)["measured"]["step_time"]
            p, pb = predicted[(mode, dp)], predicted[("none", dp)]
            print(f"{mode:>9} {dp:>3} {t:8.3f}s {t / base:6.2f}x {p:9.4f}s {p / pb:6.2f}x")


def thirteen_b() -> None:
    """The note's worked example: 16 bytes x 12.85B parameters, then sharded over N_d = 8."""
    from pipec.compiler.passes.memory import state_bytes

    for mode in ("none", "full"):
        plan = compile_one(GPT_13B, pp=1, dp=8, shard=mode, batch=8, microbatches=8)
        (state,) = state_bytes(plan)
        print(f"13B GPT ({plan.stages[0].num_params / 1e9:.2f}B parameters), pp 1 x dp 8, shard {mode}: "
              f"{state / 1e9:.1f} GB of parameters, gradients and optimizer state per rank")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="*", help="MODE:DP=report.json, a run's report for that plan")
    ap.add_argument("--write", help="write each plan to this folder (to run it with pipec run)")
    ap.add_argument("--run", metavar="DIR", help="compile, run and measure every plan here (the measured half)")
    ap.add_argument("--steps", type=int, default=3, help="steps of each run with --run (default 3)")
    args = ap.parse_args(argv)
    reports = {}
    for item in args.reports:
        key, _, path = item.partition("=")
        mode, _, dp = key.partition(":")
        if mode not in MODES or not dp.isdigit() or not path:
            ap.error(f"expected MODE:DP=report.json with MODE one of {', '.join(MODES)}, got {item!r}")
        reports[(mode, int(dp))] = path
    predicted = None
    if args.run:
        reports, predicted = run_all(args.run, args.steps)
    table(reports, args.write)
    if predicted is not None:
        step_times(reports, predicted)
    thirteen_b()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
