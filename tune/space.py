"""``pipec tune``'s space: the candidates it searches, and each one's compile request.

The space walks the source note's decision tree (:func:`candidates`): every tensor-parallel degree ``tp`` that
divides ``devices_per_node`` (tp inside a node, over its fast links; tp 1 only when the nodes are not said),
every layout ``pp x dp`` of the devices left (N / tp; and, with ``dp >= 2``, every shard mode and shard size),
every named schedule with its chunks per rank, every microbatch count that divides one replica's share of the fixed global batch, the
partition balanced by FLOPs (also by time and memory under ``costs profile``), and recompute of none
(the search, :mod:`.search`, adds the least that fits). The policy presets equal the named schedules,
so they are no extra candidates. ``--keep`` pins any of :data:`TUNED_KEYS` to the file's value.

A candidate becomes the file's request with its keys (:func:`candidate_request`): what ``pipec
compile`` would be given had the file said so. torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from pipec.compiler.ir.plan import SHARD_MODES, Mesh
from pipec.compiler.request import CompileRequest, Partition
from pipec.errors import PipecError
from pipec.schedules import SCHEDULES, ScheduleError, check_rules

__all__ = ["TUNED_KEYS", "INTERLEAVED_CHUNKS", "TuneError", "TuneRequest", "Candidate", "candidates", "tp_options",
           "candidate_request", "start_candidate", "total_batch", "memory_budget", "divisors"]

TUNED_KEYS = ("pp", "dp", "tp", "shard", "shard_size", "schedule", "virtual", "microbatches", "partition", "recompute")
"""The keys the search sets; ``--keep`` pins any of them to the file's value."""

INTERLEAVED_CHUNKS = (2, 4)
"""Chunks per rank tried for ``interleaved_1f1b``, ``looped_bfs`` and ``interleaved_zb`` (zbv takes 2, the rest 1)."""

_CHUNKS = {"gpipe": (1,), "1f1b": (1,), "zb_h1": (1,), "zbv": (2,), "interleaved_1f1b": INTERLEAVED_CHUNKS,
           "looped_bfs": INTERLEAVED_CHUNKS, "interleaved_zb": INTERLEAVED_CHUNKS}
"""The schedules tune searches, with their chunks."""


class TuneError(PipecError):
    """The search cannot run as asked, or nothing in its space fits."""


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass(frozen=True, slots=True, kw_only=True)
class TuneRequest:
    """What to search: the file's request (its layout and schedule the starting candidate) on
    ``num_devices`` devices."""

    base: CompileRequest
    num_devices: int
    global_batch: int | None = None
    """Sequences per optimizer step over all replicas; None: the file's ``input`` batch x its ``dp``."""
    keep: frozenset[str] = frozenset()
    """Keys of :data:`TUNED_KEYS` pinned to the file's value."""
    device_memory: int | None = None
    """Bytes per device; None: the file's ``device_memory`` (None there too: no budget)."""
    peak_flops: float | None = None
    """FLOP/s per device; None: the file's ``peak_flops``."""
    devices_per_node: int | None = None
    """Devices per node (``--devices-per-node``); None: the file's ``devices_per_node``. With the file's
    ``intra`` / ``inter`` links each candidate's hops are priced by where its ranks sit."""
    num_top: int = 10
    """Candidates in the table (and kept exactly: pruning never drops one of them)."""
    progress: Callable[[int, int], None] | None = field(default=None, compare=False)
    """Called with (candidates done, candidates in all) while searching."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """One point of the space."""

    pp: int
    dp: int
    tp: int = 1
    """Tensor-parallel ranks per (pp, dp) coordinate (innermost: a tp group is one node's consecutive ranks)."""
    shard: str = "none"
    shard_size: int | None = None
    schedule: str
    num_chunks: int
    num_microbatches: int
    partition_by: str | None
    """``balanced(by=...)``; None: the file's own partition (``--keep partition``)."""
    recompute: frozenset[int] = frozenset()

    @property
    def num_stages(self) -> int:
        return self.pp * self.num_chunks

    @property
    def layout(self) -> str:
        shard = "" if self.shard == "none" else f" {self.shard}" + (
            f"/{self.shard_size}" if self.shard_size else "")
        tp = f"x{self.tp}" if self.tp > 1 else ""
        return f"{self.pp}x{self.dp}{tp}{shard}"

    @property
    def recompute_text(self) -> str:
        k = len(self.recompute)
        if not k:
            return "none"
        if k == self.num_stages:
            return "all"
        return f"stages {', '.join(map(str, sorted(self.recompute)))}" if self.recompute != frozenset(range(k)) \
            else ("stage 0" if k == 1 else f"stages 0..{k - 1}")

    def sort_key(self) -> tuple:
        """A total order of the space (ties in predicted time and memory are broken by it)."""
        return (self.pp, self.dp, self.tp, SHARD_MODES.index(self.shard), self.shard_size or 0, list(SCHEDULES).index(
            self.schedule), self.num_chunks, self.num_microbatches, self.partition_by or "", len(self.recompute),
            tuple(sorted(self.recompute)))


def total_batch(treq: TuneRequest) -> int:
    """Sequences per optimizer step over all replicas (``--global-batch``, else the file's batch x its dp)."""
    base = treq.base
    if base.model is None or not base.model.inputs:
        raise TuneError("pipec tune needs a model and its input (keys model and input): it searches by "
                        "simulating the model's stages", key="model")
    b = base.model.inputs[0].shape[0]
    batch = treq.global_batch if treq.global_batch is not None else b * base.dp
    if batch < 1:
        raise TuneError(f"the global batch must be at least 1, got {batch}")
    return batch


def _shard_options(dp: int) -> list[tuple[str, int | None]]:
    if dp < 2:
        return [("none", None)]
    sizes = [None, *(n for n in divisors(dp) if 2 <= n < dp)]
    return [("none", None), *((mode, n) for mode in SHARD_MODES[1:] for n in sizes)]


def candidates(treq: TuneRequest) -> list[Candidate]:
    """Every candidate of the space (see the module docstring), in :meth:`Candidate.sort_key` order;
    the kept keys at the file's values. A schedule's rules are applied here (counts it refuses are
    not candidates)."""
    base, keep, N = treq.base, treq.keep, treq.num_devices
    bad = sorted(keep - set(TUNED_KEYS))
    if bad:
        raise TuneError(f"--keep names {', '.join(bad)}, which tune does not set; keys it sets: "
                        f"{', '.join(TUNED_KEYS)}")
    if "schedule" in keep and base.schedule not in SCHEDULES:
        raise TuneError(f"--keep schedule needs a named schedule, the file has {base.schedule}",
                        key="schedule", hints=(f"name one of {', '.join(SCHEDULES)}",))
    batch = total_batch(treq)
    costs = base.model.costs
    bys = (None,) if "partition" in keep else ("flops", "time", "memory") if costs == "profile" else ("flops",)
    out = []
    for tp, pp in ((tp, pp) for tp in tp_options(treq) for pp in divisors(N // tp)):
        dp = N // tp // pp
        if ("pp" in keep and pp != base.pp) or ("dp" in keep and dp != base.dp) or batch % dp:
            continue
        for shard, size in _shard_options(dp):
            mesh = base.mesh
            if ("shard" in keep and shard != mesh.shard) or ("shard_size" in keep and size != mesh.shard_size):
                continue
            for name in SCHEDULES:
                if "schedule" in keep and name != base.schedule:
                    continue
                for v in _CHUNKS.get(name, ()):
                    if "virtual" in keep and v != base.num_chunks:
                        continue
                    for M in divisors(batch // dp):
                        if ("microbatches" in keep and M != base.num_microbatches) or not _legal(name, pp, M, v):
                            continue
                        recompute = base.training.recompute if "recompute" in keep else ()
                        out += [Candidate(pp=pp, dp=dp, tp=tp, shard=shard, shard_size=size, schedule=name,
                                          num_chunks=v, num_microbatches=M, partition_by=by,
                                          recompute=frozenset(recompute))
                                for by in bys]
    return sorted(out, key=Candidate.sort_key)


def tp_options(treq: TuneRequest) -> list[int]:
    """The tensor-parallel degrees searched: the divisors of ``devices_per_node`` that divide the devices (a tp
    group inside one node), tp 1 alone when the nodes are not said; ``--keep tp``: the file's."""
    if "tp" in treq.keep:
        return [treq.base.mesh.tp]
    nodes = treq.devices_per_node if treq.devices_per_node is not None else treq.base.mesh.devices_per_node
    if nodes is None:
        return [1]
    return [t for t in divisors(nodes) if treq.num_devices % t == 0]


def _legal(name: str, pp: int, M: int, v: int) -> bool:
    try:
        check_rules(name, num_ranks=pp, num_microbatches=M, num_chunks=v)
    except ScheduleError:
        return False
    return True


def start_candidate(treq: TuneRequest) -> Candidate | None:
    """The file's own settings as a candidate (its partition as a balance when it is one)."""
    b = treq.base
    if b.schedule not in SCHEDULES or b.mesh.world_size != treq.num_devices:
        return None
    part = b.model.partition
    by = None if "partition" in treq.keep else (part.by if part.method == "balanced" else "flops")
    return Candidate(pp=b.pp, dp=b.dp, tp=b.mesh.tp, shard=b.mesh.shard, shard_size=b.mesh.shard_size,
                     schedule=b.schedule,
                     num_chunks=b.num_chunks, num_microbatches=b.num_microbatches, partition_by=by,
                     recompute=frozenset(b.training.recompute))


def candidate_request(treq: TuneRequest, c: Candidate, *, global_batch: int | None = None) -> CompileRequest:
    """The compile request of a candidate: the file's request with the candidate's keys, the global batch
    split over its replicas (plan.json's ``spec`` is written from the request, so it says so)."""
    base = treq.base
    batch = (global_batch or total_batch(treq)) // c.dp
    m = base.model
    inputs = tuple(replace(t, shape=(batch, *t.shape[1:])) for t in m.inputs)
    targets = tuple(replace(t, shape=(batch, *t.shape[1:])) for t in m.targets)
    partition = m.partition if c.partition_by is None else Partition("balanced", c.partition_by)
    model = replace(m, inputs=inputs, targets=targets, partition=partition)
    training = base.training
    peak = treq.peak_flops if treq.peak_flops is not None else training.peak_flops
    training = replace(training, recompute=tuple(sorted(c.recompute)), peak_flops=peak)
    nodes = treq.devices_per_node if treq.devices_per_node is not None else base.mesh.devices_per_node
    mesh = Mesh(pp=c.pp, dp=c.dp, shard=c.shard, shard_size=c.shard_size, devices_per_node=nodes, tp=c.tp,
                sequence_parallel=base.mesh.sequence_parallel)
    return replace(base, schedule=c.schedule, policy=None, order=None, mesh=mesh, num_chunks=c.num_chunks,
                   placement=None, num_microbatches=c.num_microbatches, model=model, device_memory=memory_budget(treq),
                   training=training)


def memory_budget(treq: TuneRequest) -> int | None:
    """Bytes per device the candidates must fit (``--device-memory``, else the file's); None: no budget."""
    return treq.device_memory if treq.device_memory is not None else treq.base.device_memory

