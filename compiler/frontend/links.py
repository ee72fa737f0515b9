"""Measured links for ``costs profile``: a short job of two local ranks, on the backend the run will use.

``pipec compile`` starts ``pipec.runtime.linkprobe`` under torchrun (two
processes, gloo on CPU, NCCL when two or more GPUs are here) as a separate
job: the compiler imports nothing of the runtime, the probe times the real
executor. It measures point-to-point at the plan's edge sizes, the all-reduce
at the sizes of the stages' parameters and tied weights (and the all-gather
for a sharded plan), and the executor's host time per instruction kind; the
plan then carries them as its ``links`` (each marked measured) and its
``overhead``. Explicit ``links`` in the schedule file win (the caller does not
probe). A probe that fails, or runs past :data:`PROBE_TIMEOUT_S` (its ranks are
stopped), leaves the default links and says why.

Who owns what: this module owns what the plan needs (the sizes, read off its
edges, stages and ties; the job's command line; its file read with the plan's
own schema reader; the cache; the scaling under load); runtime/linkprobe.py owns
the measuring, which must time the runtime's own transport and executor. A link
has two ends, so the probe is two processes however the code is split: the seam
is the job's command line and its file, and the probe's use of the compiler (a
small plan compiled to time the executor on) is the allowed direction.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace

from pipec.compiler.ir.plan import Overhead, Plan
from pipec.compiler.ir.plan_json import read_overhead, read_links
from pipec.compiler.ir.schema import Reader, SchemaError

__all__ = ["measure_links", "PROBE_RANKS", "PROBE_TIMEOUT_S"]

PROBE_RANKS = 2
PROBE_TIMEOUT_S = 120.0
STOP_S = 30.0
"""Seconds a probe job past its time is given to stop its ranks after SIGTERM (torchrun's own grace period)."""
MAX_SIZES = 4
"""Message sizes measured at most (the smallest and largest of the plan's, and some between)."""

ANCHOR_BYTES = 1 << 22
"""Always measured too: a size large enough that the fit's bandwidth is not noise when the plan's messages are small."""

_MEASURED: dict[tuple[str, bool], dict] = {}
"""What this process measured, by (backend, sharded): a second compile here (``pipec tune``'s candidates, a
test session) reuses it instead of starting the job again."""


def _sizes(plan: Plan) -> list[int]:
    sizes = {e.num_bytes for e in plan.edges if e.num_bytes}
    sizes |= {st.param_bytes for st in plan.stages if st.param_bytes and plan.mesh.dp > 1}
    sizes |= {t.num_bytes for t in plan.ties if t.num_bytes}
    got = sorted(sizes)
    if len(got) > MAX_SIZES:
        step = (len(got) - 1) / (MAX_SIZES - 1)
        got = [got[round(i * step)] for i in range(MAX_SIZES)]
    return sorted({*got, ANCHOR_BYTES})


def _backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= PROBE_RANKS else "gloo"


def _probe(plan: Plan, backend: str) -> dict | str:
    """The probe job's file (parsed), or why there is none."""
    with tempfile.TemporaryDirectory(prefix="pipec-links-") as tmp:
        out = os.path.join(tmp, "links.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={PROBE_RANKS}",
               "-m", "pipec.runtime.linkprobe", "--backend", backend,
               "--sizes", ",".join(map(str, _sizes(plan))), "-o", out]
        if plan.mesh.sharded:
            cmd.append("--sharded")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            _, err = job.communicate(timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _stop(job)
            return f"the probe job took more than {PROBE_TIMEOUT_S:g} s"
        if job.returncode != 0 or not os.path.exists(out):
            return "the probe job failed: " + (err.strip().splitlines() or ["no output"])[-1]
        with open(out, encoding="utf-8") as f:
            return json.load(f)


def _stop(job: subprocess.Popen) -> None:
    """End the probe job, its ranks with it: torchrun stops its ranks on SIGTERM (each in a session of its own,
    they would outlive a torchrun killed outright), and is killed if it has not ended after :data:`STOP_S`."""
    job.terminate()
    try:
        job.communicate(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        job.kill()
        job.wait()                      # not its pipes: a rank that outlived it may hold them open


def measure_links(plan: Plan) -> tuple[Plan, list[str]]:
    """The plan with measured ``links`` and ``overhead``, and notes (why nothing was measured, if so)."""
    key = (_backend(), plan.mesh.sharded)
    obj = _MEASURED.get(key) or _probe(plan, key[0])
    if isinstance(obj, str):
        return plan, [f"links not measured ({obj}); the default links are used (give links in the schedule file)"]
    _MEASURED[key] = obj
    try:
        rd = Reader(obj, "linkprobe")
        links = {**plan.links, **read_links(rd)}
        overhead: Overhead | None = read_overhead(rd)
    except SchemaError as e:
        return plan, [f"links not measured: the probe wrote an unreadable file ({e})"]
    links, overhead, slow = _under_load(plan, links, overhead)
    pp = links["pp"]
    note = (f"links measured on {pp.measured.backend if pp.measured else '?'}: pp {pp.latency_s * 1e6:.0f} us + "
            f"{pp.bandwidth_Bps / 1e9:.2f} GB/s; executor overhead measured per instruction kind"
            + (f"; both {slow:.2f}x slower, as the profile's ranks computing at once" if slow > 1 else ""))
    return replace(plan, links=links, overhead=overhead), [note]


def _under_load(plan: Plan, links: dict, overhead: Overhead | None) -> tuple[dict, Overhead | None, float]:
    """On gloo every byte a message or collective moves is copied (and a reduction summed) by the ranks' CPUs,
    and the executor's overhead is CPU time too; the probe timed them with its two ranks alone, but the run's
    ranks share this machine's cores while they compute, as ``costs profile`` measured (``model["profile"]
    ["slowdown"]``: how much slower the stages ran with as many processes as the run's ranks here). So each
    measured gloo link's latency and time per byte, and the overhead, are scaled by the same slowdown (the
    mean of the forward's and the backward's); the factor is returned (1: nothing scaled)."""
    slowdown = ((plan.model or {}).get("profile") or {}).get("slowdown") or {}
    factor = (slowdown.get("fwd", 1.0) + slowdown.get("bwd", 1.0)) / 2
    if factor <= 1:
        return links, overhead, 1.0
    scaled = {axis: replace(link, latency_s=link.latency_s * factor, bandwidth_Bps=link.bandwidth_Bps / factor)
              if link.measured and link.measured.backend == "gloo" else link for axis, link in links.items()}
    if overhead is not None and overhead.measured and overhead.measured.backend == "gloo":
        overhead = replace(overhead, seconds={op: t * factor for op, t in overhead.seconds.items()})
    return scaled, overhead, factor
