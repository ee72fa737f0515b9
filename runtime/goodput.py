"""Goodput: how much of a run's wall time ended as preserved progress, and where the rest went.

Rank 0 of every attempt (torchrun restarts the job after a failure) keeps an
:class:`AttemptLog` and rewrites it after each step, atomically, under
``checkpoint_dir/attempts/run_<run id>/attempt_<n>.json``, so the record of an
attempt that dies says how far it got. The last attempt reads every record of
its run and :func:`summarize` splits the run's wall time (from the first
attempt's process start to now) into:

- ``productive``: stepping time whose result the final state keeps: the steps
  of the last attempt, and each earlier attempt's steps up to the checkpoint
  the next attempt resumed from;
- ``startup``: process start to the first step (imports, process groups,
  building stages, restoring a checkpoint), per attempt;
- ``restart``: from an attempt's last completed step to the next attempt's
  process start (the failed step, failure detection, torchrun's restart);
- ``recompute``: steps an attempt completed but a later attempt redid, because
  no checkpoint preserved them;
- ``checkpoint``: time steps were blocked by checkpoint saves;
- ``other``: the rest (the final report, shutdown).

``fraction`` = productive / wall. Without a ``checkpoint_dir`` only the current
attempt is known.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["AttemptLog", "summarize", "process_start_time"]


def process_start_time() -> float:
    """Wall-clock time this process started (Linux: its start in ticks since boot, from ``/proc``), else now."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])
        since_start = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - since_start
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


def _atomic_write_json(path: Path, data: Mapping[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)


class AttemptLog:
    """What this attempt did, kept by rank 0 (a no-op on other ranks)."""

    def __init__(self, checkpoint_dir: str | os.PathLike | None, *, attempt: int, run_id: str, write: bool,
                 process_start: float | None = None) -> None:
        self.write = write
        self.folder: Path | None = None
        if checkpoint_dir is not None:
            safe = re.sub(r"[^A-Za-z0-9_.-]", "_", run_id) or "none"
            self.folder = Path(checkpoint_dir) / "attempts" / f"run_{safe}"
        now = time.time()
        self.record: dict[str, Any] = {
            "attempt": attempt, "run_id": run_id,
            "process_start": process_start if process_start is not None else process_start_time(),
            "train_start": None, "resumed_from": 0, "step": 0, "last_step_end": None, "blocked_at_last_step": 0.0,
            "blocked_s": 0.0, "checkpoints": {}, "updated": now, "finished": False,
        }
        if self.write and self.folder is not None:
            if attempt == 0 and self.folder.exists():  # a reused run id: an earlier run's records
                shutil.rmtree(self.folder, ignore_errors=True)
            self.folder.mkdir(parents=True, exist_ok=True)
        self._save()

    @property
    def path(self) -> Path | None:
        return None if self.folder is None else self.folder / f"attempt_{self.record['attempt']}.json"

    def _save(self) -> None:
        self.record["updated"] = time.time()
        if self.write and self.folder is not None:
            _atomic_write_json(self.path, self.record)

    def started(self, resumed_from: int) -> None:
        """The first step of this attempt begins now; the state is that after ``resumed_from`` steps."""
        self.record.update(train_start=time.time(), resumed_from=resumed_from, step=resumed_from)
        self._save()

    def step_done(self, steps_done: int) -> None:
        self.record.update(step=steps_done, last_step_end=time.time(),
                           blocked_at_last_step=self.record["blocked_s"])
        self._save()

    def checkpoint_requested(self, steps_done: int) -> None:
        """A checkpoint of the state after ``steps_done`` steps is being taken (call before it blocks)."""
        self.record["checkpoints"][str(steps_done)] = [time.time(), self.record["blocked_s"]]

    def blocked(self, seconds: float) -> None:
        self.record["blocked_s"] += seconds
        self._save()

    def finished(self) -> None:
        self.record["finished"] = True
        self._save()

    def records(self) -> list[dict[str, Any]]:
        """Every attempt of this run so far (earlier ones from their files), in attempt order."""
        out: dict[int, dict[str, Any]] = {}
        if self.folder is not None and self.folder.is_dir():
            for p in self.folder.glob("attempt_*.json"):
                try:
                    with open(p, encoding="utf-8") as f:
                        r = json.load(f)
                    out[int(r["attempt"])] = r
                except (OSError, ValueError, KeyError, TypeError):
                    continue  # a record cut short: that attempt is counted as lost time
        out[self.record["attempt"]] = dict(self.record)
        return [out[a] for a in sorted(out) if a <= self.record["attempt"]]

    def summary(self, **extra: Any) -> dict[str, Any]:
        return summarize(self.records(), time.time(), **extra)


def summarize(records: Sequence[Mapping[str, Any]], now: float, **extra: Any) -> dict[str, Any]:
    """report.json's ``goodput`` from the attempt records of one run (see the module doc)."""
    assert records, "at least the current attempt"
    wall = now - records[0]["process_start"]
    need = records[-1]["step"]  # the final state holds this many steps; walk back to who computed them
    productive = recompute = startup = restart = blocked = 0.0
    steps_recomputed = 0
    attempts = []
    for i in range(len(records) - 1, -1, -1):
        r = records[i]
        train_start = r.get("train_start")
        end = r.get("updated", r["process_start"])
        startup += (train_start if train_start is not None else end) - r["process_start"]
        blocked += r.get("blocked_s", 0.0)
        k, j = r.get("resumed_from", 0), r.get("step", 0)
        compute = keep = 0.0
        kept_steps = 0
        if train_start is not None and r.get("last_step_end") is not None:
            compute = r["last_step_end"] - train_start - r.get("blocked_at_last_step", 0.0)
            upto = min(need, j)
            if upto > k:
                if upto == j:
                    keep, kept_steps = compute, j - k
                elif str(upto) in r.get("checkpoints", {}):
                    t, b = r["checkpoints"][str(upto)]
                    keep, kept_steps = t - train_start - b, upto - k
        productive += keep
        recompute += compute - keep
        steps_recomputed += max(0, j - k - kept_steps)
        need = min(need, k)
        if i + 1 < len(records):
            restart += records[i + 1]["process_start"] - end
        attempts.append({"attempt": r["attempt"], "resumed_from": k, "steps_done": j,
                         "startup_s": (train_start if train_start is not None else end) - r["process_start"],
                         "compute_s": compute, "checkpoint_blocked_s": r.get("blocked_s", 0.0),
                         "finished": bool(r.get("finished"))})
    lost = {"startup": startup, "restart": restart, "recompute": recompute, "checkpoint": blocked}
    lost["other"] = wall - productive - sum(lost.values())
    out: dict[str, Any] = {
        "fraction": productive / wall if wall > 0 else 0.0,
        "wall_s": wall,
        "productive_s": productive,
        "lost_s": lost,
        "restarts": records[-1]["attempt"],
        "steps_recomputed": steps_recomputed,
        "attempts": attempts[::-1],
    }
    missing = sorted(set(range(records[-1]["attempt"])) - {r["attempt"] for r in records})
    if missing:  # no checkpoint_dir to keep records in: their time is not in wall_s
        out["attempts_unrecorded"] = missing
    out.update(extra)
    return out
