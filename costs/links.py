"""Measured links for ``costs profile``: a short job of two local ranks, on the backend the run will use.

``pipec compile`` runs ``pipec.runtime.linkprobe`` as two processes on this
machine (gloo on CPU, NCCL when two or more GPUs are here), started here with
torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``): on gloo each forked from the compiling process, which has
torch imported, and running the module by name as ``python -m`` does; on NCCL
(CUDA must not be forked) a fresh interpreter each. The compiler's modules
import nothing of the runtime; the probe times the real executor. It measures point-to-point at the plan's edge
sizes, the all-reduce at the sizes of the stages' parameters and tied weights
and the all-gather (for a sharded plan's shard groups), and the executor's host time per
instruction kind; the plan then carries them as its ``links`` (each marked
measured) and its ``overhead``. Explicit ``links`` in the schedule file win
(the caller does not probe). A probe that fails, or runs past
:data:`PROBE_TIMEOUT_S` (its ranks are stopped), leaves the default links and
says why.

What the probe measured is kept in the profile cache (:mod:`pipec.costs.cache`, kind ``links``) per host,
backend, torch's and pipec's version: a later compile here reuses it (its ``measured`` says when, and
``"reused": true``) unless ``--reprofile``. One probe serves every layout: it always measures the all-gather
too, which only a sharded plan keeps (``pipec tune``'s sharded and unsharded candidates once started a probe
each).

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
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

import pipec
from pipec.compiler import progress
from pipec.costs import cache
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

PROBE_METHOD = 7
"""What the probe measures; cache entries of another method are misses."""


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


PROBE_MODULE = "pipec.runtime.linkprobe"


def _probe(plan: Plan, backend: str) -> dict | str:
    """The probe job's file (parsed), or why there is none (a port taken between choosing and binding it: once
    more on another)."""
    with tempfile.TemporaryDirectory(prefix="pipec-links-") as tmp:
        out = os.path.join(tmp, "links.json")
        argv = ["--backend", backend, "--sizes", ",".join(map(str, _sizes(plan))), "-o", out, "--sharded"]
        for attempt in range(2):
            why = _run_ranks(PROBE_MODULE, argv, out, tmp, fork=backend == "gloo" and _can_fork())
            if why is None:
                with open(out, encoding="utf-8") as f:
                    return json.load(f)
            if attempt or "address already in use" not in why.lower():
                return why
        return why


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _can_fork() -> bool:
    return "fork" in mp.get_all_start_methods()


class _Forked:
    """A rank forked from this process, with the part of ``subprocess.Popen`` :func:`_run_ranks` uses."""

    def __init__(self, proc) -> None:
        self.proc = proc

    @property
    def returncode(self) -> int | None:
        return self.proc.exitcode

    def poll(self) -> int | None:
        return self.proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired("probe rank", timeout or 0.0)
        return self.proc.exitcode

    def terminate(self) -> None:
        self.proc.terminate()

    def kill(self) -> None:
        self.proc.kill()


def _forked_rank(module: str, argv: list[str], env: dict[str, str], log: str) -> None:
    """A probe rank in a process forked from the compiler's: its output to ``log`` (errors) and nowhere (the
    rest), one intra-op thread, torchrun's environment, then ``module`` run as ``python -m`` runs it. The
    compiler's own objects are frozen out of the collector (a collection walking them would stall the executor's
    timed steps)."""
    import gc
    import runpy
    import warnings

    import torch

    gc.freeze()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
    os.environ.update(env)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _run_ranks(module: str, argv: list[str], out: str, tmp: str, *, fork: bool = False) -> str | None:
    """Run ``python -m MODULE ARGV`` as the probe's :data:`PROBE_RANKS` ranks on this machine (their errors logged
    in ``tmp``); None when rank 0 wrote ``out``, else why not. ``fork``: each rank forked from this process, which
    has torch imported (1.2 s for the whole probe on machine A, where two fresh interpreters took 4.0 s, most of it
    importing torch); else a fresh interpreter each (NCCL: CUDA must not be forked; or where there is no fork)."""
    port = _free_port()
    env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": str(PROBE_RANKS), "LOCAL_WORLD_SIZE": str(PROBE_RANKS), "GROUP_RANK": "0"}
    logs = [os.path.join(tmp, f"rank{r}.err") for r in range(PROBE_RANKS)]
    ranks: list = []
    try:
        for r in range(PROBE_RANKS):
            rank_env = {**env, "RANK": str(r), "LOCAL_RANK": str(r)}
            if fork:
                proc = mp.get_context("fork").Process(target=_forked_rank, args=(module, argv, rank_env, logs[r]),
                                                      daemon=True)
                proc.start()
                ranks.append(_Forked(proc))
                continue
            with open(logs[r], "w", encoding="utf-8") as err:
                ranks.append(subprocess.Popen([sys.executable, "-m", module, *argv], stdout=subprocess.DEVNULL,
                                              stderr=err, env={**os.environ, **rank_env}))
        deadline = time.monotonic() + PROBE_TIMEOUT_S
        for job in ranks:
            try:
                job.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _stop(ranks)
                return f"the probe job took more than {PROBE_TIMEOUT_S:g} s"
            if job.returncode != 0:  # the other rank may wait for it: it is stopped
                _stop(ranks)
                break
    except BaseException:
        _stop(ranks)
        raise
    if ranks[0].returncode == 0 and os.path.exists(out):
        return None
    failed = next((r for r, job in enumerate(ranks) if job.returncode not in (0, None, -15)), 0)
    try:
        with open(logs[failed], encoding="utf-8", errors="replace") as f:
            lines = [line.strip() for line in f.read().splitlines() if line.strip()]
    except OSError:
        lines = []
    return "the probe job failed: " + (lines[-1] if lines else "no output")


def _stop(ranks: list) -> None:
    """End the probe's ranks: SIGTERM to each still running, SIGKILL to any not ended after :data:`STOP_S`."""
    for job in ranks:
        if job.poll() is None:
            job.terminate()
    deadline = time.monotonic() + STOP_S
    for job in ranks:
        try:
            job.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait()


def _key(backend: str) -> dict:
    """What decides the probe's figures: the host, the backend, the versions."""
    import torch

    return {"host": socket.gethostname(), "backend": backend, "torch": torch.__version__,
            "pipec": pipec.__version__, "method": PROBE_METHOD}


def _readable(obj: dict) -> tuple[dict, Overhead | None]:
    rd = Reader(obj, "linkprobe")
    return read_links(rd), read_overhead(rd)


def _check(obj) -> None:
    try:
        _readable(obj)
    except SchemaError as e:
        raise ValueError(str(e)) from None


def measure_links(plan: Plan) -> tuple[Plan, list[str]]:
    """The plan with measured ``links`` and ``overhead`` (the profile cache's, else probed now), and notes (why
    nothing was measured, if so)."""
    backend = _backend()
    key = _key(backend)
    entry = cache.lookup("links", key, _check)
    notes = cache.take_notes()
    if entry is None:
        progress.report(f"measuring the links: {PROBE_RANKS} ranks on {backend}")
        try:
            obj = _probe(plan, backend)
        finally:
            progress.done()
        if isinstance(obj, str):
            return plan, notes + [f"links not measured ({obj}); the default links are used (give links in the "
                                  "schedule file)"]
        try:
            _readable(obj)
        except SchemaError as e:
            return plan, notes + [f"links not measured: the probe wrote an unreadable file ({e})"]
        entry = cache.store("links", key, obj)
        notes += cache.take_notes()
    obj = dict(entry.value)
    drop = {"shard"} if not plan.mesh.sharded else set()  # the all-gather prices only shard groups,
    if plan.mesh.tp == 1:                                    # the all-reduce between computes only tp groups
        drop.add("tp")
    obj["links"] = {axis: link for axis, link in obj["links"].items() if axis not in drop}
    probed, overhead = _readable(obj)
    if entry.reused:
        probed = {axis: replace(link, measured=replace(link.measured, reused=True)) if link.measured else link
                  for axis, link in probed.items()}
        if overhead is not None and overhead.measured is not None:
            overhead = replace(overhead, measured=replace(overhead.measured, reused=True))
    links, overhead, slow = _under_load(plan, {**plan.links, **probed}, overhead)
    pp = links["pp"]
    note = (f"links measured on {pp.measured.backend if pp.measured else '?'}"
            + (f" ({pp.measured.at}, kept in the profile cache)" if entry.reused and pp.measured else "")
            + f": pp {pp.latency_s * 1e6:.0f} us + {pp.bandwidth_Bps / 1e9:.2f} GB/s; executor overhead measured "
            "per instruction kind" + (f"; both {slow:.2f}x slower, as the profile's ranks computing at once"
                                      if slow > 1 else ""))
    return replace(plan, links=links, overhead=overhead), notes + [note]


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
