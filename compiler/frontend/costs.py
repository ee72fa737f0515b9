"""Stage costs (seconds per microbatch) and the per-node weights the balancer uses.

Sources, most trusted first (DESIGN, *Cost model*):

- ``profile``: each stage runs here on real tensors of the plan's microbatch
  shape, the way the run will run it: in as many processes at once as the run
  has ranks on this machine, each with the thread count each rank will run
  with (:class:`Profiling`; on a machine with fewer cores than ranks a stage
  costs what it costs while the others compute); forward, input backward
  (``autograd.grad`` w.r.t. the stage inputs) and full backward are timed, a
  few repetitions after a warm-up, and the least kept; weight backward =
  full - input backward.
- ``flops``: forward FLOPs from ``torch.utils.flop_counter`` at a device peak.
  Backward: a node that uses parameters (a linear layer) costs its forward
  FLOPs once for the input gradient and once for the weight gradient; any other
  node (attention's matmuls) twice its forward FLOPs, all input gradient.
- ``unit``: F=1, B=2, I=W=1.

A stage fed only by model inputs (stage 0) sends no gradient, so its input
backward is 0 and its weight backward is the whole backward (torch's rule for
the zero-bubble split; the runtime runs that stage's whole backward at ``BWD_W``).

With recompute on for a stage, the forward is run again before the backward:
input backward (and so the full backward) gains one forward, and the saved
activations shrink to the stage's inputs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence, TypeVar

import torch
from torch import nn
from torch.fx import Interpreter, Node

from pipec.compiler.frontend.partition import Cuts, Split
from pipec.compiler.ir.plan import UNIT_COST, Cost
from pipec.compiler.frontend.load import instantiate
from pipec.compiler.frontend.tensors import FrontendError, example_inputs, to_dtype
from pipec.compiler.frontend.trace import Traced, trace_model

__all__ = [
    "COST_SOURCES",
    "StageCost",
    "node_weights",
    "stage_flops",
    "stage_activation_bytes",
    "stage_costs",
    "with_recompute",
    "time_nodes",
    "Profiling",
    "profiling",
    "MAX_PROFILE_RANKS",
]

COST_SOURCES = ("unit", "flops", "profile")

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True, kw_only=True)
class StageCost:
    """What the cost pass knows of one stage (per microbatch)."""

    cost: Cost
    activation_bytes: int
    """Saved for backward (with recompute: the stage's inputs)."""
    full_activation_bytes: int
    """Saved for backward without recompute: what a recomputed stage holds during its backward."""
    flops: tuple[int, int, int]
    """Forward, input-backward and weight-backward FLOPs."""
    profile: Mapping[str, Any] | None = None
    """``costs profile``: how the stages were timed (:meth:`Profiling.record`, the same for every stage)."""


def _param_nodes(traced: Traced) -> set[Node]:
    """Compute nodes that use a parameter (the weight-gradient side of the backward)."""
    params = {id(p) for p in traced.param_of.values()}
    out = set()
    for node in traced.gm.graph.nodes:
        if node.op == "call_module":
            if any(True for _ in traced.gm.get_submodule(str(node.target)).parameters()):
                out.add(node)
        elif node.op == "get_attr":
            obj: Any = traced.gm
            for part in str(node.target).split("."):
                obj = getattr(obj, part)
            if id(obj) in params:
                out.update(node.users)
    return out


def _node_flops(traced: Traced, nodes: Sequence[Node], with_params: set[Node] | None = None) -> tuple[int, int, int]:
    with_params = _param_nodes(traced) if with_params is None else with_params
    fwd = bwd_i = bwd_w = 0
    for n in nodes:
        f = int(n.meta.get("pipec_flops", 0))
        fwd += f
        if n in with_params:
            bwd_i += f
            bwd_w += f
        else:
            bwd_i += 2 * f
    return fwd, bwd_i, bwd_w


def _stage_nodes(split: Split, s: int) -> list[Node]:
    by_name = {n.name: n for n in split.traced.gm.graph.nodes}
    return [by_name[name] for name in split.parts[s].nodes]


def stage_flops(split: Split, s: int, with_params: set[Node] | None = None) -> tuple[int, int, int]:
    """Forward, input-backward and weight-backward FLOPs of stage ``s`` per microbatch (``with_params``:
    :func:`_param_nodes` of the split's trace, when the caller has it for every stage)."""
    return _node_flops(split.traced, _stage_nodes(split, s), with_params)


def stage_activation_bytes(split: Split, s: int) -> int:
    """Bytes autograd saves in stage ``s`` per microbatch, plus the outputs it keeps for its backward."""
    saved: dict[int, int] = {}
    for n in _stage_nodes(split, s):
        for key, nbytes in n.meta.get("pipec_saved", ()):
            saved[key] = nbytes
    by_name = {n.name: n for n in split.graph_module.graph.nodes}
    for sig in split.parts[s].outputs:
        key, nbytes = by_name[sig.name].meta.get("pipec_storage", (("out", sig.name), sig.num_bytes))
        saved[key] = nbytes
    return sum(saved.values())


def with_recompute(cost: Cost) -> Cost:
    """The stage's forward runs again before its backward (in the input half, or the weight half
    of a stage whose input half does nothing)."""
    if cost.bwd_i == 0:
        return replace(cost, bwd=cost.bwd + cost.fwd, bwd_w=cost.bwd_w + cost.fwd)
    return replace(cost, bwd=cost.bwd + cost.fwd, bwd_i=cost.bwd_i + cost.fwd)


def _no_input_grad(cost: Cost) -> Cost:
    """A stage fed only by model inputs sends no gradient: its ``BWD_I`` does nothing and its ``BWD_W`` is its whole
    backward, unsplit (the runtime runs it so), to the bit as the cost-only cut prices it."""
    return replace(cost, bwd_i=0.0, bwd_w=cost.bwd)


# ----------------------------------------------------------------------------- balancer weights


def node_weights(traced: Traced, cuts: Cuts, by: str, *, times: Mapping[str, float] | None = None,
                 bytes_per_param: int = 16) -> list[float]:
    """One weight per node of ``cuts.nodes`` for ``balanced(by=...)``.

    ``params``: parameters first used by the node; ``flops``: forward FLOPs;
    ``time``: measured forward seconds (``times``, from :func:`time_nodes`);
    ``memory``: ``bytes_per_param`` x first-used parameters plus the bytes
    the node saves for backward.
    """
    if by == "flops":
        return [float(n.meta.get("pipec_flops", 0)) for n in cuts.nodes]
    if by == "time":
        assert times is not None
        return [times.get(n.name, 0.0) for n in cuts.nodes]
    first_use = _first_use_params(traced, cuts)
    if by == "params":
        return [float(first_use.get(n, 0)) for n in cuts.nodes]
    if by == "memory":
        return [
            float(bytes_per_param * first_use.get(n, 0) + sum(b for _, b in n.meta.get("pipec_saved", ())))
            for n in cuts.nodes
        ]
    raise FrontendError(f"balanced(by=...) must be one of params, flops, time, memory, got {by!r}", key="partition")


def _first_use_params(traced: Traced, cuts: Cuts) -> dict[Node, int]:
    canon_by_id = {id(p): c for c, p in traced.param_of.items()}
    seen: set[str] = set()
    out: dict[Node, int] = {}
    for n in cuts.nodes:
        found: list[nn.Parameter] = []
        if n.op == "call_module":
            found.extend(traced.gm.get_submodule(str(n.target)).parameters())
        for a in n.all_input_nodes:
            if a.op == "get_attr":
                obj: Any = traced.gm
                for part in str(a.target).split("."):
                    obj = getattr(obj, part)
                if isinstance(obj, nn.Parameter):
                    found.append(obj)
        for p in found:
            c = canon_by_id.get(id(p))
            if c is not None and c not in seen:
                seen.add(c)
                out[n] = out.get(n, 0) + p.numel()
    return out


# ----------------------------------------------------------------------------- measuring


class _NodeTimer(Interpreter):
    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.times: dict[str, float] = {}

    def run_node(self, n: Node) -> Any:
        t0 = time.perf_counter()
        out = super().run_node(n)
        self.times[n.name] = time.perf_counter() - t0
        return out


def _threads(num: int) -> Callable[[], None]:
    old = torch.get_num_threads()
    torch.set_num_threads(max(1, num))
    return lambda: torch.set_num_threads(old)


def time_nodes(traced: Traced, target: str, kwargs: Mapping[str, Any], *, threads: int = 1, reps: int = 3,
               search_path: Sequence[str] = ()) -> dict[str, float]:
    """Median forward seconds of every node, on a real CPU copy of the model (it must fit in memory)."""
    model, _ = instantiate(target, kwargs, mode="cpu", seed=0, search_path=search_path)
    example = example_inputs(traced.inputs, device="cpu")
    real = trace_model(model, traced.inputs, example, mode=traced.path)
    if real.fingerprint != traced.fingerprint:
        raise FrontendError("balanced(by=time): the model traces differently on CPU than on meta; balance by flops "
                            "instead", key="partition")
    restore = _threads(threads)
    try:
        runs: dict[str, list[float]] = {}
        args = [example[n.target] for n in real.gm.graph.nodes if n.op == "placeholder"]
        for rep in range(reps + 1):
            timer = _NodeTimer(real.gm)
            timer.run(*args)
            if rep:
                for k, v in timer.times.items():
                    runs.setdefault(k, []).append(v)
    finally:
        restore()
    return {k: statistics.median(v) for k, v in runs.items()}


def _random_inputs(sigs: Sequence[Any], sources: Sequence[int]) -> list[torch.Tensor]:
    out = []
    for sig, src in zip(sigs, sources):
        dt = to_dtype(sig.dtype)
        if dt.is_floating_point and src >= 0:
            out.append(torch.randn(sig.shape, dtype=dt).requires_grad_())
        elif dt.is_floating_point:
            out.append(torch.randn(sig.shape, dtype=dt))
        else:
            out.append(torch.zeros(sig.shape, dtype=dt))
    return out


_Sample = tuple[float, float, float, float, float]
"""One timed repetition of a stage: forward, input backward, full backward, optimizer step, weight backward
(seconds; the two halves of the split backward as the run's zero-bubble stages do them)."""


def _stage_runner(mod: nn.Module, sigs: Sequence[Any], sources: Sequence[int],
                  autocast: str | None) -> Callable[[], _Sample]:
    """One repetition of the stage as a rank runs it, each part timed: its forward, its full backward into
    ``.grad`` (accumulating, as over microbatches) and one AdamW step (the default optimizer, once per
    training step); then its backward split as a zero-bubble schedule runs it (compiler/frontend/deferred.py):
    the forward again with the linear layers' weight grads deferred (untimed: it costs the plain forward's
    time and a few percent, and the difference of two samples taken in a crowd is noise), the input half
    (``BWD_I``: every grad but those) and the weight half (``BWD_W``).
    A stage fed by token inputs is timed split too (the runtime does not split it: its cost is the full backward)."""
    from pipec.compiler.frontend.deferred import WeightGradStash, defer_weight_grads

    inputs = _random_inputs(sigs, sources)
    float_inputs = [x for x in inputs if x.requires_grad]
    params = [p for p in mod.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-9) if params else None

    def context():
        return torch.autocast("cpu", dtype=to_dtype(autocast)) if autocast else torch.autocast("cpu", enabled=False)

    def once() -> _Sample:
        t0 = time.perf_counter()
        with context():
            outs = [o for o in mod(*inputs) if o.requires_grad]
        t1 = time.perf_counter()
        grads = [torch.randn_like(o) for o in outs]
        t3 = time.perf_counter()
        if outs:
            torch.autograd.backward(outs, grads, inputs=float_inputs + params)
        t4 = time.perf_counter()
        optim = 0.0
        if opt is not None:
            opt.step()
            optim = time.perf_counter() - t4
        bwd_i = bwd_w = 0.0
        if outs:
            stash = WeightGradStash()
            with context(), defer_weight_grads(stash):
                split = [o for o in mod(*inputs) if o.requires_grad]
            t6 = time.perf_counter()
            torch.autograd.backward(split, grads)
            t7 = time.perf_counter()
            stash.run()
            bwd_w = time.perf_counter() - t7
            bwd_i = t7 - t6
        return t1 - t0, bwd_i, t4 - t3, optim, bwd_w

    return once


# ----------------------------------------------------------------------------- as many ranks as the run


MAX_PROFILE_RANKS = 16
"""The most processes ``costs profile`` times at once (a run here starts at most 16 ranks)."""

CONCURRENT_MIN_TIME_S = 0.1
"""The least time each process spends timing a stage when several time at once (:attr:`Profiling.min_time_s`)."""

CROWD_REPEATS = 5
"""Times the processes time the stages at once (:attr:`Profiling.crowd_repeats`); the slowdown is the median
of the repeats'. Five compiles in a row on a quiet 2-core machine, 4 processes, one repeat each: forward
slowdowns 2.84, 2.69, 2.40, 3.68, 2.18 (one window the whole host ran slow in: every process at 3.7x)."""

SYNC_TIMEOUT_S = 600.0
"""How long a profiling process waits for the others to start before giving up."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Profiling:
    """How ``costs profile`` times the stages: the way the run will run them (plan.json ``model["profile"]``).

    Each stage is timed alone first (this process, ``threads`` intra-op threads, ``reps`` rounds after a
    warm-up, the stages in turn, the least of each: :meth:`alone`): that gives the stages' costs relative to
    each other with little noise. With more than one rank here, ``num_ranks``
    processes (the run's ranks on this machine, :data:`MAX_PROFILE_RANKS` at
    most) then time the stages all at once, as the run's ranks compute at once, each with ``threads``
    threads: the stages are dealt out round them (:meth:`share`), they start together, each keeps timing
    until it has ``reps`` samples of each of its stages taking ``min_time_s`` in all (so the samples span the
    scheduler's time slices: with more ranks than cores a short op either runs whole or waits a slice), and
    one that is done keeps running its last stage untimed until every process is, so no sample is taken on
    a machine emptier than the run's. The slowdown of each part (forward, input backward, backward,
    optimizer step) is the time all the concurrent samples took over what the same samples took alone, and
    every stage's cost is its cost alone times it: one factor per part, since which process the scheduler
    favours over a short window is luck the run does not repeat. The processes do that ``crowd_repeats``
    times and the slowdown is the median of the repeats' (a window in which the whole host ran slow is one
    repeat, not the price of every stage); the processes are forked and build their stages once for all the
    repeats. The slowdown is measured for every cut, from the same stages as their times alone, so the noise of
    one is corrected by the other (their product, the cost, repeats within 5% where each factor moved by up to
    30%). Measured once per process instead (on its first cut) and applied to every cut, one unlucky crowd
    priced every cut of a search: the example GPT's 20-layout grid here, predicted four times each way against
    the same measured steps, ranked at Spearman 0.69-0.90 with a slowdown per cut, -0.13-0.85 with one."""

    num_ranks: int = 1
    """Processes timing the stages at once (this one and ``num_ranks - 1`` forked from it)."""
    threads: int = 1
    """Intra-op threads of each (``torch.set_num_threads``), as each rank runs."""
    reps: int = 3
    """Timed repetitions of each stage, after a warm-up (alone; and by the process timing it at once)."""
    min_time_s: float = CONCURRENT_MIN_TIME_S
    """The least time each process spends timing one stage at once with the others."""
    crowd_repeats: int = CROWD_REPEATS
    """Times the processes time their stages at once; the slowdown is the median of the repeats'."""

    def share(self, rank: int, num_stages: int) -> list[int]:
        """The stages process ``rank`` times at once with the others: ``rank``, ``rank + num_ranks``, ...;
        with fewer stages than processes, stage ``rank mod num_stages``."""
        if num_stages >= self.num_ranks:
            return list(range(rank, num_stages, self.num_ranks))
        return [rank % num_stages]

    def samples(self, once: Callable[[], _Sample], min_time_s: float = 0.0) -> list[_Sample]:
        """``reps`` samples of ``once`` after a warm-up, and more until they took ``min_time_s``."""
        once()
        out, t0 = [], time.perf_counter()
        while len(out) < self.reps or time.perf_counter() - t0 < min_time_s:
            out.append(once())
        return out

    def alone(self, runners: Mapping[int, Callable[[], _Sample]]) -> dict[int, _Sample]:
        """Every stage timed alone, in turn: a warm-up of each, then ``reps`` rounds of one sample of each, the least
        per part (:func:`_least_sample`), at the host's speed when this process first profiled.

        In turn, a window in which the host runs slow costs every stage a sample rather than one stage all of its
        own (timed one stage after another, one cut of the example GPT had its first stage at 9.6 ms and the other
        three at 16-19; 12 ms each in the next compile). And a window lasts seconds: a virtual machine's host runs
        every stage 20-30% slower for a while (its neighbours, its clock), so the cuts ``pipec tune`` compares,
        each profiled at another moment, would be ranked by the moment. Each round also times a fixed reference
        (:func:`_reference`); a sample is scaled by the reference's median time in this process's first profile
        (:data:`_HOST_BASELINE`) over its time in the sample's round, so every cut is priced at one host speed (the
        crowd's samples too, by the reference timed just before each repeat). One cut compiled four times in a
        row: predicted steps 581-617 ms (563-740 before)."""
        reference = _reference(self.threads)
        for once in runners.values():
            once()
        got: dict[int, list[_Sample]] = {s: [] for s in runners}
        speed: list[float] = []
        for _ in range(self.reps):
            speed.append(reference())
            for s, once in runners.items():
                got[s].append(once())
        _HOST_BASELINE.setdefault(self.threads, statistics.median(speed))
        return {s: _least_sample([_steady(x, r, self.threads) for x, r in zip(xs, speed)]) for s, xs in got.items()}

    def record(self, slowdown: Sequence[float] | None) -> dict[str, Any]:
        """plan.json's ``model["profile"]``: this, and the slowdown measured (forward, input backward,
        backward, optimizer)."""
        out: dict[str, Any] = {"concurrent_ranks": self.num_ranks, "threads_per_rank": self.threads,
                               "reps": self.reps, "cpu_count": os.cpu_count(), "cores": usable_cores()}
        if slowdown is not None:
            out["min_time_s"] = self.min_time_s
            out["crowd_repeats"] = self.crowd_repeats
            out["slowdown"] = dict(zip(_PARTS, (round(x, 4) for x in slowdown)))
        return out


_PARTS = ("fwd", "bwd_i", "bwd", "optim")

_HOST_BASELINE: dict[int, float] = {}
"""By threads per rank: the reference's median time in this process's first profile (:meth:`Profiling.alone`)."""


def _steady(sample: _Sample, reference_s: float, threads: int) -> _Sample:
    """A sample taken while the reference took ``reference_s``, at the host's speed of :data:`_HOST_BASELINE`."""
    f = _HOST_BASELINE[threads] / reference_s
    return tuple(x * f for x in sample)  # type: ignore[return-value]


def _reference(threads: int) -> Callable[[], float]:
    """A fixed piece of work like a transformer block's MLP (two linear layers and a GELU on a 256 x 256 input,
    about 0.27 GFLOP): the seconds of the faster of two runs, to tell how fast the host runs now."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 256, generator=gen)
    w1, w2 = torch.randn(1024, 256, generator=gen) * 0.05, torch.randn(256, 1024, generator=gen) * 0.05

    def once() -> float:
        best = float("inf")
        with torch.no_grad():
            for _ in range(2):
                t0 = time.perf_counter()
                torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(x, w1)), w2)
                best = min(best, time.perf_counter() - t0)
        return best

    once()
    return once


def profiling(*, local_ranks: int, threads: int, reps: int) -> Profiling:
    """How a run of ``local_ranks`` ranks on this machine is profiled (more than one process needs fork)."""
    n = max(1, min(local_ranks, MAX_PROFILE_RANKS))
    if "fork" not in mp.get_all_start_methods():
        n = 1
    return Profiling(num_ranks=n, threads=max(1, threads), reps=max(1, reps))


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the platform tells it; else the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _median_slowdown(repeats: Sequence[Sequence[float]]) -> tuple[float, ...]:
    """Per part, the median of the repeats' slowdowns."""
    return tuple(statistics.median(r[k] for r in repeats) for k in range(len(repeats[0])))


def _least_sample(samples: Sequence[_Sample]) -> _Sample:
    """Per part, the least of a stage's repetitions alone: on a machine others share, their work only adds to a
    repetition's time, so the least is the one they disturbed least (the cuts a search compares, each timed at
    another moment, are then compared on their own work)."""
    return tuple(min(x[k] for x in samples) for k in range(len(samples[0])))  # type: ignore[return-value]


def _slowdown(alone: Mapping[int, _Sample], at_once: Sequence[Mapping[int, Sequence[_Sample]]]) -> tuple[float, ...]:
    """Per part: what every concurrent sample took over what the same samples took alone. A part none of the
    samples has (the input backward of a cut whose stages take only tokens, the optimizer of stages with no
    parameters) takes the backward's slowdown (the forward's without one; 1 without either): it prices nothing
    of the cut, but the record and the processor sharing have every part."""
    out: list[float | None] = []
    for k in range(4):
        slow = sum(x[k] for one in at_once for samples in one.values() for x in samples)
        base = sum(alone[s][k] * len(samples) for one in at_once for s, samples in one.items())
        out.append(slow / base if base > 0 else None)
    fwd, _, bwd, _ = out
    fallback = bwd if bwd is not None else fwd if fwd is not None else 1.0
    return tuple(fallback if x is None else x for x in out)


def _cost(sample: Sequence[float]) -> Cost:
    fwd, bwd_i, bwd, optim, bwd_w = sample
    if not bwd_i and not bwd_w:  # nothing to split (no output needing a grad)
        bwd_w = bwd
    return Cost(fwd=fwd, bwd=bwd, bwd_i=bwd_i, bwd_w=bwd_w, optim=optim)


class _Together:
    """The profiling processes' start line and finish: every sample is taken while all of them run."""

    def __init__(self, ctx: Any, num: int) -> None:
        self.num = num
        self.barrier = ctx.Barrier(num, timeout=SYNC_TIMEOUT_S) if num > 1 else None
        self.done = ctx.Value("i", 0) if num > 1 else None
        self.rounds = 0

    def start(self) -> None:
        if self.barrier is not None:
            self.barrier.wait()

    def finish(self, load: Callable[[], Any]) -> None:
        """This process is done with this round: keep ``load`` running until every process is."""
        if self.done is None:
            return
        self.rounds += 1  # this process's own count (each has its copy): rounds done by all = done / num
        with self.done.get_lock():
            self.done.value += 1
        # broken: one failed (it says why)
        while self.done.value < self.num * self.rounds and not self.barrier.broken:
            load()

    def abort(self) -> None:
        if self.barrier is not None:
            self.barrier.abort()


def _at_once(num: int, work: Callable[[int, _Together], _T]) -> list[_T]:
    """``work(rank, together)`` in ``num`` processes at once (this one, rank 0, and ``num - 1`` forked), every
    result by rank. A process that fails breaks the others' start; this one then raises its message."""
    if num == 1:
        return [work(0, _Together(None, 1))]
    ctx = mp.get_context("fork")
    together, queue = _Together(ctx, num), ctx.SimpleQueue()

    def child(rank: int) -> None:
        try:
            queue.put((rank, work(rank, together), None))
        except BaseException as err:  # noqa: BLE001 - reported to the parent, which raises it
            together.abort()
            queue.put((rank, None, f"{type(err).__name__}: {err}"))

    sys.stdout.flush()
    sys.stderr.flush()
    procs = [ctx.Process(target=child, args=(rank,), daemon=True) for rank in range(1, num)]
    for p in procs:
        p.start()
    try:
        mine = work(0, together)
    except threading.BrokenBarrierError:
        mine = None
    except BaseException:
        together.abort()
        for p in procs:
            p.kill()
        raise
    got = sorted((queue.get() for _ in procs), key=lambda g: g[0])
    for p in procs:
        p.join()
    failed = [err for _, _, err in got if err]
    if mine is None or failed:
        raise FrontendError(f"costs profile: a profiling process failed ({failed[0] if failed else 'no message'}); "
                            "use costs flops, or profile with one rank (pp 1, dp 1)", key="costs")
    return [mine, *(r for _, r, _ in got)]


def stage_costs(
    split: Split,
    source: str,
    *,
    recompute: frozenset[int] = frozenset(),
    peak_flops: float | None = None,
    profile: Profiling = Profiling(),
    autocast: str | None = None,
    target: str = "",
    kwargs: Mapping[str, Any] | None = None,
    search_path: Sequence[str] = (),
) -> tuple[StageCost, ...]:
    """Costs and activation bytes of every stage of ``split`` from ``source`` (``unit``/``flops``/``profile``,
    the last timed as ``profile`` says)."""
    if source not in COST_SOURCES:
        raise FrontendError(f"costs must be one of {', '.join(COST_SOURCES)}, got {source!r}", key="costs")
    num = split.num_stages
    record = None
    with_params = _param_nodes(split.traced)  # once for all stages: it walks the whole graph
    flops = [stage_flops(split, s, with_params) for s in range(num)]
    if source == "unit":
        base = [UNIT_COST] * num
    elif source == "flops":
        if not peak_flops or peak_flops <= 0:
            raise FrontendError(
                "costs flops converts FLOPs to seconds at a device peak, but peak_flops is not set; "
                "set peak_flops (e.g. peak_flops 989e12 for an H100 in bf16) or use costs profile", key="costs",
            )
        base = [Cost(fwd=f / peak_flops, bwd=(i + w) / peak_flops, bwd_i=i / peak_flops, bwd_w=w / peak_flops) for f, i, w in flops]
    else:
        base, slowdown = _profile(split, profile, autocast=autocast, target=target, kwargs=kwargs or {},
                                  search_path=search_path)
        record = profile.record(slowdown)
    out = []
    for s in range(num):
        if source != "unit" and all(src < 0 for src in split.parts[s].sources):
            base[s] = _no_input_grad(base[s])
        full = stage_activation_bytes(split, s)
        if s in recompute:
            cost, act = with_recompute(base[s]), sum(x.num_bytes for x in split.parts[s].inputs)
        else:
            cost, act = base[s], full
        out.append(StageCost(cost=cost, activation_bytes=act, full_activation_bytes=full, flops=flops[s],
                             profile=record))
    return tuple(out)


def _profile(split: Split, profile: Profiling, *, autocast: str | None, target: str, kwargs: Mapping[str, Any],
             search_path: Sequence[str]) -> tuple[list[Cost], tuple[float, ...] | None]:
    """Every stage's cost (its cost alone times the slowdown of the ranks computing at once), and that slowdown
    (None with one rank)."""
    from pipec.compiler.frontend.stages import materialize  # costs -> stages -> partition; imported late to keep layers clear

    _, buffers = instantiate(target, kwargs, mode="skeleton", search_path=search_path)
    gen = torch.Generator().manual_seed(0)
    values = {c: (torch.randn(p.shape, generator=gen) * 0.02).to(p.dtype) for c, p in split.traced.param_of.items()}

    def runners(stages: Sequence[int]) -> dict[int, Callable[[], _Sample]]:
        return {s: _stage_runner(materialize(split, s, {c: values[c] for c in split.parts[s].params}, buffers, "cpu"),
                                 split.parts[s].inputs, split.parts[s].sources, autocast) for s in stages}

    def at_once(rank: int, together: _Together) -> list[tuple[float, dict[int, list[_Sample]]]]:
        """This process's samples of its stages per repeat of the crowd, each with the reference's time just before
        it (process 0 times it alone: the others have built their stages, or finished the last repeat's load, and
        wait at the start; a reference timed while one still ran its load read the crowd at 0.94x)."""
        torch.set_num_threads(profile.threads)
        mine = runners(profile.share(rank, split.num_stages))
        reference = _reference(profile.threads) if rank == 0 else None
        out = []
        for _ in range(max(1, profile.crowd_repeats)):
            together.start()  # every process is idle
            speed = reference() if reference else 0.0
            together.start()  # time them together
            out.append((speed, {s: profile.samples(once, profile.min_time_s) for s, once in mine.items()}))
            together.finish(mine[max(mine)])
        return out

    def repeat(by_rank: list, r: int) -> list[dict[int, list[_Sample]]]:
        """The crowd's samples of repeat r, at the host's speed of the alone samples."""
        speed = by_rank[0][r][0]
        return [{s: [_steady(x, speed, profile.threads) for x in xs] for s, xs in mine[r][1].items()}
                for mine in by_rank]

    restore = _threads(profile.threads)
    try:
        alone = profile.alone(runners(range(split.num_stages)))
        slowdown = None
        if profile.num_ranks > 1:
            by_rank = _at_once(profile.num_ranks, at_once)
            slowdown = _median_slowdown([_slowdown(alone, repeat(by_rank, r)) for r in range(len(by_rank[0]))])
    finally:
        restore()
    factor = (*slowdown, slowdown[2]) if slowdown else (1.0,) * 5  # the weight half is a backward's
    return [_cost([x * f for x, f in zip(alone[s], factor)]) for s in range(split.num_stages)], slowdown
