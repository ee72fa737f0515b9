"""``pipec demo``: the main job, end to end on this machine.

1. Compile three schedules for one 4-rank pipeline (unit costs) and show
   their timelines and bubbles side by side.
2. Compile the example GPT from its schedule files (1f1b and
   interleaved_1f1b, 2 ranks, costs profiled here), show the predicted
   timelines, run each plan under torchrun (gloo on CPU), and report the
   measured bubble and step time beside the predicted ones, with a picture of
   both timelines.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from importlib import resources

from rich.console import Console
from rich.table import Table

__all__ = ["run_demo", "SCHEDULES", "GPT_RUNS"]

SCHEDULES = (("1f1b", None), ("interleaved_1f1b", 2), ("zb_h1", None))
"""Part 1: the schedules compared on one pipeline."""

GPT_RUNS = (
    ("gpt_1f1b.pipe", {"pp": 2, "partition": "split before blocks.4"}),
    ("gpt_interleaved.pipe", {"pp": 2}),
)
"""Part 2: the example GPT's schedule files, with the flags that fit them to 2 ranks."""


def compare_schedules(console: Console, ranks: int, microbatches: int) -> None:
    from pipec.compiler.driver import compile_plan
    from pipec.views.timeline import render_terminal

    console.rule(f"[bold]1. schedules[/]: {ranks} pp ranks, {microbatches} microbatches, unit costs (F=1, B=2, I=W=1)")
    rows = []
    for name, v in SCHEDULES:
        plan = compile_plan(schedule=name, num_ranks=ranks, num_microbatches=microbatches, num_chunks=v).plan
        pred = plan.prediction
        title = name + (f" (virtual {v})" if v else "")
        console.print(render_terminal(pred, title=title))
        console.print()
        rows.append((title, plan.program.num_instructions, pred.step_time, pred.bubble_fraction,
                     max(r.peak_activations for r in pred.per_rank)))
    table = Table(title="verified plans, predicted side by side")
    for col in ("schedule", "instructions", "step (units)", "bubble", "peak in flight (stage x microbatch)"):
        table.add_column(col, justify="left" if col == "schedule" else "right")
    for title, n, step, bubble, peak in rows:
        table.add_row(title, str(n), f"{step:g}", f"{bubble:.1%}", str(peak))
    console.print(table)


def _run(cmd: list[str], timeout: float) -> int:
    """Run a command in its own session; on timeout, kill the whole group (no orphaned ranks)."""
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return -1


def run_gpt(console: Console, out: str, steps: int, timeout: float) -> list[tuple]:
    from pipec.compiler.driver import compile_spec
    from pipec.compiler.ir.plan_json import write_plan
    from pipec.views.picture import render_image
    from pipec.views.timeline import render_terminal
    from pipec.compiler.ir.timeline import Timeline
    from pipec.dsl import load_spec

    rows = []
    for name, overrides in GPT_RUNS:
        path = str(resources.files("pipec.examples") / name)
        spec = load_spec(path, overrides)
        console.rule(f"[bold]2. the example GPT[/]: examples/{name} on {spec['pp']} ranks ({spec['schedule']})")
        console.print(f"compiling: tracing the model, partitioning it ({spec['partition'].text()}), profiling stage "
                      "costs on this machine ...")
        plan = compile_spec(spec).plan
        stem = os.path.join(out, name.removesuffix(".pipe"))
        write_plan(plan, stem + ".plan.json")
        pred = plan.prediction
        console.print(render_terminal(pred, title=f"predicted: {stem}.plan.json"))
        console.print(f"running under torchrun: {spec['pp']} ranks, gloo, {steps} steps ...")
        report_path = stem + ".report.json"
        rc = _run([sys.executable, "-m", "pipec", "run", stem + ".plan.json", "--nproc", str(plan.mesh.world_size),
                   "--steps", str(steps), "--report", report_path, "--timeout", "120"], timeout)
        if rc != 0:
            console.print(f"[red]the run failed (exit {rc})[/]")
            rows.append((name, spec["schedule"], pred, None, None))
            continue
        with open(report_path, encoding="utf-8") as f:
            report = json.load(f)
        measured = Timeline.from_json(report["measured"])
        picture = stem + ".timeline.png"
        render_image(pred, picture, measured=measured, mesh=plan.mesh, title=f"{name}: predicted and measured")
        console.print(f"wrote {picture} (predicted and measured timelines)")
        rows.append((name, spec["schedule"], pred, measured, report))
    return rows


def run_demo(*, ranks: int = 4, microbatches: int = 8, run: bool = True, out: str = "pipec-demo", steps: int = 4,
             timeout: float = 600.0) -> int:
    console = Console()
    compare_schedules(console, ranks, microbatches)
    if not run:
        return 0
    os.makedirs(out, exist_ok=True)
    rows = run_gpt(console, out, steps, timeout)
    table = Table(title="the example GPT on 2 ranks: measured (median step) beside predicted")
    for col in ("schedule file", "schedule", "step predicted", "step measured", "bubble predicted",
                "bubble measured", "tokens/s"):
        table.add_column(col, justify="left" if col.startswith("schedule") else "right")
    failed = False
    for name, schedule, pred, measured, report in rows:
        if measured is None:
            failed = True
            table.add_row(name, schedule, f"{pred.step_time:.3f} s", "failed", f"{pred.bubble_fraction:.1%}", "-", "-")
            continue
        table.add_row(name, schedule, f"{pred.step_time:.3f} s", f"{measured.step_time:.3f} s",
                      f"{pred.bubble_fraction:.1%}", f"{measured.bubble_fraction:.1%}",
                      f"{report['tokens_per_s']:,.0f}" if "tokens_per_s" in report else "-")
    console.print(table)
    console.print(f"plans, reports and pictures are in {out}/")
    return 1 if failed else 0
