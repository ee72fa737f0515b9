"""Coverage benchmark: how often measured steps fall inside the predicted interval, beside the point's error.

Prints figures, asserts nothing. Each round compiles a small GPT with ``costs profile --reprofile`` (every round
times the stages and probes the links again) and runs it with ``pipec run --report``; from the report it takes
every step after the first (the first warms up) and the median step, and checks them against the plan's interval
(``step_time_interval``, stated coverage 90%) and against the point prediction. The rounds share one profile
cache, as a user's compiles do: each run keeps its steps there, and a compile with 3 earlier runs at its host
load widens its interval to hold them (compiler/sim/history.py); the ``widened`` column counts those rounds and
the last column gives their steps inside alone. Three settings:

- ``quiet``: the machine as it is;
- ``loaded``: a busy loop of this script's own (one process, killed at the end of the round, and stopping
  itself after ``--load-limit`` seconds) runs through the compile and the run: profiled and run under the
  same load;
- ``shifted``: the busy loop runs only through the run: the profile's load is not the run's, and ``pipec run``
  should say so (the ``warned`` column counts the rounds whose run warned);
- ``P:R`` (``--settings pairs`` gives all nine of 0-2): P busy loops through the compile, R through the run.
  The ``right`` column counts the warnings that were right: the steps moved the way it said (above or below the
  interval, as the median measured) and, where P and R differ, it said the load moved with them.
  ``PIPEC_PROFILE_WAIT_S`` (default here ``--wait``, 5 s) bounds the profile's wait for the cores, which a
  busy loop of this script's never gives back.

Per setting: the share of steps inside the interval (goal: the stated coverage, 9 in 10), the share of rounds
whose median step was inside, the median of the point prediction's relative error per step and per round
(|measured - predicted| / measured), and the interval's median width over its prediction.

    .venv/bin/python bench/coverage.py --rounds 20            # the full benchmark (about 15 minutes on 2 cores:
                                                              # a round is 9-15 s, a loaded one the longest)
    .venv/bin/python bench/coverage.py --rounds 2 --settings quiet,loaded
    .venv/bin/python bench/coverage.py --rounds 1 --steps 6 --out /tmp/coverage.json

The machine is shared: the load average is printed with the figures.
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
from pathlib import Path

SETTINGS = ("quiet", "loaded", "shifted")
PAIRS = tuple(f"{p}:{r}" for p in range(3) for r in range(3))
"""Busy loops through the compile : through the run (``--settings pairs``)."""


def loops(setting: str) -> tuple[int, int]:
    """The busy loops through the compile and through the run of ``setting``."""
    if ":" in setting:
        p, r = setting.split(":")
        return int(p), int(r)
    return {"quiet": (0, 0), "loaded": (1, 1), "shifted": (0, 1)}[setting]

MODEL = """\
model        "pipec.examples.gpt:build" (layers=4, dim=64, heads=2, vocab=256, seq=32)
input        tokens: int64[8, 32]
schedule     {schedule}
pp 2
microbatches 4
costs        profile
steps        {steps}
"""


def _pipec(*args: str, env: dict, timeout: float = 900) -> subprocess.CompletedProcess:
    exe = os.path.join(os.path.dirname(sys.executable), "pipec")
    return subprocess.run([exe, *args], capture_output=True, text=True, env=env, timeout=timeout, check=True)


class BusyLoop:
    """``n`` processes spinning on a core each, bounded: stopped when the block ends, and by themselves after
    ``limit_s``."""

    def __init__(self, n: int, limit_s: float) -> None:
        self.n, self.limit_s, self.procs = int(n), limit_s, []

    def __enter__(self) -> "BusyLoop":
        code = f"import time\nend = time.monotonic() + {self.limit_s}\nwhile time.monotonic() < end: pass\n"
        self.procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(self.n)]
        if self.procs:
            time.sleep(0.5)  # running before what it loads starts
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def one_round(work: Path, setting: str, *, schedule: str, steps: int, load_limit: float, wait: float) -> dict:
    """Compile and run once under ``setting``; what the report says of the interval and the point."""
    work.mkdir(parents=True, exist_ok=True)
    pipe, plan, report = work / "model.pipe", work / "plan.json", work / "report.json"
    pipe.write_text(MODEL.format(schedule=schedule, steps=steps))
    env = {**os.environ, "XDG_CACHE_HOME": str(work.parent / "cache"),  # the rounds' cache: the runs kept
           "PIPEC_PROFILE_WAIT_S": str(wait)}
    at_compile, at_run = loops(setting)
    t0 = time.perf_counter()
    with BusyLoop(at_compile, load_limit):
        _pipec("compile", str(pipe), "-o", str(plan), "--reprofile", env=env)  # the round times anew
    compile_s = time.perf_counter() - t0
    with BusyLoop(at_run, load_limit):
        _pipec("run", str(plan), "--nproc", "2", "--report", str(report), "--quiet", env=env)
    rep = json.loads(report.read_text())
    pred = json.loads(plan.read_text())["prediction"]
    band = rep.get("interval")
    steps_after = [s["step_time"] for s in rep["steps"][1:]] or [s["step_time"] for s in rep["steps"]]
    median = rep["measured"]["step_time"]
    return {
        "setting": setting, "compile_s": compile_s, "predicted": pred["step_time"],
        "interval": pred.get("step_time_interval"), "runs": pred.get("interval_runs", 0), "steps": steps_after,
        "median": median,
        "inside": None if band is None else band["steps_inside"],
        "counted": None if band is None else band["steps_counted"],
        "median_inside": None if band is None else band["median_inside"],
        "host_load": rep.get("host_load"), "warned": _said(rep) is not None, "warning": rep.get("load_warning"),
        "right": _right(_said(rep), median, band, at_compile != at_run),
        "load_avg": os.getloadavg()[0],
    }


def _said(rep: dict) -> tuple[str, bool] | None:
    """What a run's load warning said: the way the step moved (``slower``/``faster``) and whether it put that down
    to the load; None where it gave none. report.json's ``load_warning`` (the run's steps decide it), or, from a
    pipec before it (``host_load.warned``, given before the first step), the way its factor pointed, always
    put down to the load."""
    if (text := rep.get("load_warning")) is not None:
        return ("slower" if "ran slower" in text else "faster"), "the load moved the way the step did" in text
    load = rep.get("host_load") or {}
    if load.get("warned"):
        return ("slower" if (load.get("factor") or 1) > 1 else "faster"), True
    return None


def _right(said: tuple[str, bool] | None, median: float, band: dict | None, moved: bool) -> bool | None:
    """Whether a warning was right: the median outside the interval on the side it said and, where the loads
    differed, putting it down to the load; None where no warning was given."""
    if said is None or band is None:
        return None
    lo, hi = band["step_time"]
    way = "slower" if median > hi else "faster" if median < lo else None
    return way == said[0] and (not moved or said[1])


def summary(rounds: list[dict], setting: str) -> list[str] | None:
    mine = [r for r in rounds if r["setting"] == setting]
    if not mine:
        return None
    banded = [r for r in mine if r["interval"] is not None]
    inside = sum(r["inside"] for r in banded)
    counted = sum(r["counted"] for r in banded)
    step_err = [abs(t - r["predicted"]) / t for r in mine for t in r["steps"]]
    round_err = [abs(r["median"] - r["predicted"]) / r["median"] for r in mine]
    widths = [(r["interval"][1] - r["interval"][0]) / r["predicted"] for r in banded]
    held = [r for r in banded if r["runs"]]
    held_in, held_n = sum(r["inside"] for r in held), sum(r["counted"] for r in held)
    return [setting, str(len(mine)),
            f"{inside}/{counted} ({inside / counted:.0%})" if counted else "-",
            f"{sum(r['median_inside'] for r in banded)}/{len(banded)}" if banded else "-",
            f"{statistics.median(step_err):.1%}", f"{statistics.median(round_err):.1%}",
            f"{statistics.median(widths):.1%}" if widths else "-",
            f"{sum(r['warned'] for r in mine)}/{len(mine)}",
            f"{sum(bool(r['right']) for r in mine)}/{sum(r['warned'] for r in mine)}", f"{len(held)}/{len(mine)}",
            f"{held_in}/{held_n} ({held_in / held_n:.0%})" if held_n else "-"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20, help="compile+run rounds per setting")
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help="comma-separated: " + ", ".join(SETTINGS) + ", P:R (busy loops through compile:run), or pairs")
    ap.add_argument("--wait", type=float, default=5.0, help="PIPEC_PROFILE_WAIT_S for the compiles")
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--steps", type=int, default=8, help="steps per run (the first is left out)")
    ap.add_argument("--load-limit", type=float, default=600.0, help="seconds a busy loop runs at most")
    ap.add_argument("--work", help="folder for the plans and reports (default: a temporary one)")
    ap.add_argument("--out", help="write every round's figures here (JSON)")
    args = ap.parse_args(argv)
    settings = [x for s in args.settings.split(",") if s for x in (PAIRS if s == "pairs" else (s,))]
    unknown = set(settings) - set(SETTINGS) - set(PAIRS)
    if unknown:
        ap.error(f"unknown setting {sorted(unknown)[0]!r}; expected {', '.join(SETTINGS)}")
    work = Path(args.work or tempfile.mkdtemp(prefix="pipec-coverage-"))
    print(f"# {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the start; {args.rounds} rounds per "
          f"setting, {args.steps} steps each; work in {work}", flush=True)
    rounds = []
    for i in range(args.rounds):
        for setting in settings:  # the settings interleaved, so a busy hour of the machine touches every one
            r = one_round(work / f"{setting.replace(':', '-')}-{i}", setting, schedule=args.schedule,
                          steps=args.steps, load_limit=args.load_limit, wait=args.wait)
            rounds.append(r)
            band = r["interval"]
            print(f"{setting:8s} round {i + 1}: predicted {r['predicted']:.4f} s"
                  + (f" [{band[0]:.4f}, {band[1]:.4f}]" if band else " (no interval)")
                  + (f" (widened to {r['runs']} runs)" if r["runs"] else "")
                  + f", median {r['median']:.4f} s, steps inside {r['inside']}/{r['counted']}"
                  + (", warned" if r["warned"] else "") + f"; compile {r['compile_s']:.1f} s, "
                  f"load average {r['load_avg']:.2f}", flush=True)
    header = ["setting", "rounds", "steps inside", "medians inside", "point err/step", "point err/round",
              "width", "warned", "right", "widened", "inside, widened"]
    rows = [row for s in settings if (row := summary(rounds, s)) is not None]
    widths = [max(len(h), *(len(r[k]) for r in rows)) for k, h in enumerate(header)]
    print()
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    print(f"# stated coverage 90%; load average {os.getloadavg()[0]:.2f} at the end")
    if args.out:
        Path(args.out).write_text(json.dumps(rounds, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
