"""``pipec tune --measure K``: run the top candidates as ``pipec run`` would, here, and re-rank them.

Each of the K fastest predicted candidates is written as a plan and run for a few steps on this
machine: its ranks started by the runtime's launcher in this process
(:func:`~pipec.runtime.launch.start_ranks`, as ``pipec run PLAN --nproc W --steps N --report R`` starts
them), their output in the workdir (``candidateI.logs``); its measured median step (report.json
``measured``) goes beside the prediction. A candidate needing more ranks than this machine can start
(:func:`max_ranks`) is skipped with a note, and so is one whose run fails or takes over ``timeout``
seconds (its ranks are stopped).
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import replace
from typing import Callable, Sequence

from pipec.compiler.ir.plan_json import write_plan
from pipec.runtime.launch import RunOptions, TimeLimitExceeded, start_ranks
from pipec.tune.search import Scored, TuneResult, banded

__all__ = ["max_ranks", "measure", "run_candidates"]


def max_ranks() -> int:
    """The most ranks a run here may start: 4 per core, 16 at most."""
    return min(16, 4 * (os.cpu_count() or 1))


def run_candidates(scored: Sequence[Scored], *, workdir: str, steps: int = 10, timeout: float = 600,
                   progress: Callable[[int, int], None] | None = None) -> tuple[list[Scored], list[str]]:
    """Each of ``scored`` run here in turn, with its ``measured_step`` where the run succeeded; the notes say
    what was skipped or failed."""
    os.makedirs(workdir, exist_ok=True)
    notes: list[str] = []
    limit = max_ranks()
    out: list[Scored] = []
    k = len(scored)
    for i, s in enumerate(scored):
        if progress:
            progress(i, k)
        world = s.candidate.pp * s.candidate.dp
        if world > limit:
            notes.append(f"{s.candidate.layout} {s.candidate.schedule}: not measured: it needs {world} ranks and "
                         f"this machine starts at most {limit}")
            out.append(s)
            continue
        plan_path = os.path.join(workdir, f"candidate{i}.json")
        report_path = os.path.join(workdir, f"candidate{i}.report.json")
        s = banded(s)
        write_plan(s.plan, plan_path)
        options = RunOptions(plan=plan_path, steps=steps, report=report_path)
        said = io.StringIO()            # what pipec run would print on its stderr: each rank's error, once
        try:
            code = start_ranks(s.plan.mesh.where, options, nproc=world, time_limit=timeout, errors=said,
                               log_dir=os.path.join(workdir, f"candidate{i}.logs"))
        except TimeLimitExceeded:
            notes.append(f"{s.candidate.layout} {s.candidate.schedule}: not measured: the run took over {timeout:.0f} s")
            out.append(s)
            continue
        except Exception as e:  # noqa: BLE001 - the launcher itself failed (a rendezvous, a port): this run's note
            code, said = 1, io.StringIO(f"{type(e).__name__}: {e}")
        if code != 0:
            last = (said.getvalue().strip().splitlines() or ["no output"])[-1]
            notes.append(f"{s.candidate.layout} {s.candidate.schedule}: the run failed ({last})")
            out.append(s)
            continue
        with open(report_path, encoding="utf-8") as f:
            report = json.load(f)
        out.append(replace(s, measured_step=float(report["measured"]["step_time"])))
    if progress:
        progress(k, k)
    return out, notes


def measure(result: TuneResult, k: int, *, workdir: str, steps: int = 10, timeout: float = 600,
            progress: Callable[[int, int], None] | None = None) -> tuple[TuneResult, list[str]]:
    """The result with the top ``k`` measured (``measured_step``) and re-ranked: measured ones by
    their measured step first, then the rest as predicted; the notes say what was skipped or failed."""
    out, notes = run_candidates(result.top[:k], workdir=workdir, steps=steps, timeout=timeout, progress=progress)
    measured = sorted((s for s in out if s.measured_step is not None),
                      key=lambda s: (s.measured_step, s.rank_key()))
    rest = [s for s in out if s.measured_step is None]
    top = (*measured, *rest, *result.top[k:])
    best = measured[0] if measured else result.best
    return replace(result, best=best, top=top), notes
