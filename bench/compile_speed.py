"""Compile speed: the whole `pipec compile` command beside torch's own import, generation and lowering.

Part ``model`` (issue #21's goals): the example GPT (examples/gpt_1f1b.pipe, 4 ranks, costs profile), each
compile a fresh process, as a ratio to ``python -c 'import torch, torch.fx'`` timed in the same round (so
the machine's speed and load cancel, as far as they do); per round, in this order:

- torch: the import, 3 times (the median);
- cold: ``pipec compile`` with an empty profile cache (its own ``XDG_CACHE_HOME``): the stages timed
  alone and in a crowd of 4, the links probed (goal: at most 6x torch's import);
- warm: the same command again on that cache: nothing timed (goal: at most 2x);
- another schedule: ``--schedule gpipe`` on that cache (every timing still applies: nothing timed);
- another pp: ``--ranks 2 --partition "split before blocks.4"`` (new stages timed alone; the crowd of
  its shape and ranks here is new too: 2 ranks, not 4);
- model mistake, data mistake: the file with a factory argument the factory rejects (``dimm=256``), and with
  a token file that does not exist, each on an empty cache: the time to the located error, exit 2 (goal: at
  most 2x: every check runs before any timing);
- tune, 4 devices: ``pipec tune examples/gpt_1f1b.pipe --devices 4`` with the file's own costs (profile) on
  an empty cache (goal: at most 20x). ``--no-extra`` leaves these three out.

Each line gives the medians over ``--rounds`` and the load average. The cold compile's profile record
says how many rounds and repeats it took.

Part ``schedule``: for interleaved_1f1b at P=32, v=2, M=256 (~100K instructions) and at P=64,
v=2, M=1024 (~780K), alternating runs of:

- pipec: the whole command in a fresh process (start-up, generation, lowering,
  both proofs, simulation, writing plan.json), wall time;
- torch: `ScheduleInterleaved1F1B(stages, M)` in this process, whose
  constructor builds `pipeline_order` and lowers it with
  `_PipelineScheduleRuntime._prepare_schedule_with_comms` (duck-typed stages,
  no process group), wall time.

Goals: pipec no slower than torch at P=32; pipec's P=64 time within 10x of its
P=32 time (linear in instructions: the instruction ratio is ~8x).

    .venv/bin/python bench/compile_speed.py [--part model|schedule|both] [--rounds N] [--no-extra] [--repeats N]
                                            [--skip-64]
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


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT = os.path.join(REPO, "examples", "gpt_1f1b.pipe")
MODEL_CASES = (("cold", ()), ("warm", ()), ("another schedule", ("--schedule", "gpipe")),
               ("another pp", ("--ranks", "2", "--partition", "split before blocks.4")))
MODEL_GOALS = {"cold": 6.0, "warm": 2.0, "model mistake": 2.0, "data mistake": 2.0, "tune, 4 devices": 20.0}
MISTAKES = (("model mistake", ("dim=256", "dimm=256")),            # an argument the factory rejects
            ("data mistake", ("partition ", 'data tokens("missing.bin", dtype=uint16)\npartition ')))
"""Each a copy of examples/gpt_1f1b.pipe with one edit (old, new), compiled on an empty cache: exit 2 expected."""


def _timed(cmd: list[str], env: dict | None = None, *, rc: int = 0) -> float:
    t = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if done.returncode != rc:
        raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}, not {rc}:\n{done.stderr}")
    return time.perf_counter() - t


def _extra_cases(pipec: str, env: dict, xdg: str) -> dict[str, float]:
    """The mistakes' time to their error, and ``pipec tune`` for 4 devices with the file's own (default)
    costs, each on an empty cache of its own."""
    with open(GPT, encoding="utf-8") as f:
        text = f.read()
    out = {}
    for name, (old, new) in MISTAKES:
        bad = os.path.join(xdg, name.replace(" ", "_") + ".pipe")
        with open(bad, "w", encoding="utf-8") as f:
            f.write(text.replace(old, new, 1))
        fresh = {**env, "XDG_CACHE_HOME": os.path.join(xdg, name.replace(" ", "_"))}
        out[name] = _timed([pipec, "compile", bad, "-o", os.path.join(xdg, "bad.json")], fresh, rc=2)
    fresh = {**env, "XDG_CACHE_HOME": os.path.join(xdg, "tune")}
    out["tune, 4 devices"] = _timed([pipec, "tune", GPT, "--devices", "4", "-o", os.path.join(xdg, "tuned.json")],
                                    fresh)
    return out


def model_part(rounds: int, extra: bool) -> None:
    pipec = os.path.join(os.path.dirname(sys.executable), "pipec")
    names = [name for name, _ in MODEL_CASES] + [name for name, _ in MISTAKES] + ["tune, 4 devices"]
    got: dict[str, list[float]] = {"torch": [], **{name: [] for name in names}}
    ratios: dict[str, list[float]] = {name: [] for name in names}
    loads, records = [], []
    for r in range(rounds):
        with tempfile.TemporaryDirectory(prefix="pipec-bench-cache-") as xdg:
            env = {**os.environ, "XDG_CACHE_HOME": xdg}
            loads.append(os.getloadavg()[0])
            torch_s = statistics.median(_timed([sys.executable, "-c", "import torch, torch.fx"]) for _ in range(3))
            got["torch"].append(torch_s)
            for name, flags in MODEL_CASES:
                out = os.path.join(xdg, f"{name.replace(' ', '_')}.json")
                t = _timed([pipec, "compile", GPT, *flags, "-o", out], env)
                got[name].append(t)
                ratios[name].append(t / torch_s)
                if name == "cold":
                    with open(out, encoding="utf-8") as f:
                        records.append(json.load(f)["model"]["profile"])
            if extra:
                for name, t in _extra_cases(pipec, env, xdg).items():
                    got[name].append(t)
                    ratios[name].append(t / torch_s)
            loads.append(os.getloadavg()[0])
        print(f"  round {r + 1}/{rounds}: torch {torch_s:.2f} s; "
              + "; ".join(f"{name} {got[name][-1]:.1f} s ({ratios[name][-1]:.1f}x)" for name in names if got[name])
              + f"; load {loads[-2]:.2f} -> {loads[-1]:.2f}", flush=True)
    print(f"example GPT (examples/gpt_1f1b.pipe, costs profile), {rounds} round(s), medians; load average "
          f"{min(loads):.2f}-{max(loads):.2f} on {os.cpu_count()} cores")
    print(f"  torch import (python -c 'import torch, torch.fx'): {statistics.median(got['torch']):.2f} s")
    for name in (n for n in names if got[n]):
        ratio = statistics.median(ratios[name])
        goal = MODEL_GOALS.get(name)
        verdict = f" (goal: at most {goal:g}x -> {'met' if ratio <= goal else 'NOT met'})" if goal else ""
        print(f"  {name:<17} {statistics.median(got[name]):6.1f} s  = {ratio:5.1f}x torch's import{verdict}")
    for rec in records:
        print(f"  cold profile: rounds alone {[st['rounds'] for st in rec['stages']]}, crowd repeats "
              f"{rec.get('crowd_repeats')}, slowdown fwd {rec['slowdown']['fwd']:.2f} "
              f"bwd {rec['slowdown']['bwd']:.2f}, "
              f"host load {rec.get('host_load')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("model", "schedule", "both"), default="both")
    ap.add_argument("--rounds", type=int, default=3, help="model part: rounds (torch import, then each compile)")
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs per config at P=32 (P=64: 1)")
    ap.add_argument("--skip-64", action="store_true", help="only the P=32 config")
    ap.add_argument("--no-extra", action="store_true",
                    help="model part: leave out the mistakes' time to error and pipec tune for 4 devices")
    args = ap.parse_args()
    if args.part in ("model", "both"):
        model_part(args.rounds, not args.no_extra)
    if args.part in ("schedule", "both"):
        schedule_part(args.repeats, args.skip_64)


def schedule_part(repeats: int, skip_64: bool) -> None:
    configs = [(32, 2, 256, repeats)] + ([] if skip_64 else [(64, 2, 1024, 1)])
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
