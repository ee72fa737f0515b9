"""How ``costs profile`` times a stage: alone, and in a crowd of as many processes as the run has ranks here.

Each stage runs on real tensors of the microbatch's shape, with the threads each rank runs with, as a
rank runs it (:func:`_stage_runner`: forward, full backward, optimizer step, and the backward split the
way a zero-bubble stage runs it). Three measurements price a cut (docs/design.md, *How costs profile
times the stages*):

1. *Alone* (:meth:`Profiling.alone`): the stages in turn, round after round after a warm-up, the least of
   each part kept. Rounds stop at the fewest (at least ``reps``, at most ``max_reps``) for which every
   stage's median is known to :data:`SPREAD_TARGET` (:func:`median_ci`).
2. *In a crowd* (:func:`crowd`, more than one rank on this machine): as many processes as the run has
   ranks here time the stages at once; each part's slowdown is what the crowd's samples took over what
   the same samples took alone, the median over repeats that stop, as the rounds do, when that median is
   known to :data:`SPREAD_TARGET` (at least :data:`MIN_CROWD_REPEATS`, at most ``crowd_repeats``).
3. *At one host speed*: every round and repeat times a fixed reference kernel (:func:`_reference`), and
   every sample is scaled to one reference time of the host (:func:`_steady`).

:mod:`.timings` decides what to time (what the profile cache lacks) and keeps what was timed.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, TypeVar

import torch
from torch import nn

from pipec.compiler import progress
from pipec.model.tensors import FrontendError, to_dtype
from pipec.compiler.ir.plan import Cost

__all__ = ["Profiling", "Crowd", "profiling", "crowd", "median_ci", "level_spread", "crowd_spread", "usable_cores",
           "MAX_PROFILE_RANKS", "CROWD_REPEATS", "MIN_CROWD_REPEATS", "MAX_REPS", "SPREAD_TARGET", "PROFILE_METHOD"]

_T = TypeVar("_T")

PROFILE_METHOD = 3
"""What a timing measures; entries of another method are misses (raise it when :func:`_stage_runner` or how the
samples are reduced changes)."""

MAX_PROFILE_RANKS = 16
"""The most processes ``costs profile`` times at once (a run here starts at most 16 ranks)."""

CONCURRENT_MIN_TIME_S = 0.1
"""The least time each process spends timing a stage in each repeat of the crowd (:attr:`Profiling.min_time_s`)."""

SPREAD_TARGET = 0.05
"""Rounds alone and repeats of the crowd stop once the median is known to this: the half-width of its 90%
confidence interval (:func:`median_ci`) over the median."""

MAX_REPS = 5
"""The most rounds alone (:attr:`Profiling.max_reps`)."""

MIN_CROWD_REPEATS = 3
"""The fewest repeats of the crowd: a median of three outlasts one window in which the whole host ran slow."""

CROWD_REPEATS = 5
"""The most repeats of the crowd (:attr:`Profiling.crowd_repeats`). Five compiles in a row on a quiet 2-core
machine, 4 processes, one repeat each: forward slowdowns 2.84, 2.69, 2.40, 3.68, 2.18."""

SYNC_TIMEOUT_S = 600.0
"""How long a profiling process waits for the others to start before giving up."""

_T90 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812)
"""Student's t, two-sided 90%, for 1..10 degrees of freedom (more: 1.645 at the limit, 1.8 used)."""


def median_ci(xs: Sequence[float]) -> float:
    """The half-width of the 90% confidence interval of the median of ``xs`` over the median (inf for fewer than
    two): t x 1.2533 x s / sqrt(n), the median's standard error for a normal sample (1.2533 = sqrt(pi / 2))."""
    n = len(xs)
    med = statistics.median(xs) if xs else 0.0
    if n < 2 or med <= 0:
        return math.inf
    t = _T90[n - 2] if n - 2 < len(_T90) else 1.8
    return t * 1.2533 * statistics.stdev(xs) / math.sqrt(n) / med


def _rel_spread(xs: Sequence[float]) -> float:
    """How ``xs`` scatter: their standard deviation over their median, estimated robustly (1.4826 x the median
    absolute deviation over the median: the same figure for normal samples, while one sample that waited out a
    scheduler's time slice, ten times the others, moves it little); 0 for fewer than two."""
    med = statistics.median(xs) if xs else 0.0
    if len(xs) < 2 or med <= 0:
        return 0.0
    return 1.4826 * statistics.median(abs(x - med) for x in xs) / med


# ----------------------------------------------------------------------------- one stage, as a rank runs it


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
    training step); then its backward split as a zero-bubble schedule runs it (model/deferred.py):
    the forward again with the linear layers' weight grads deferred (untimed: it costs the plain forward's
    time and a few percent, and the difference of two samples taken in a crowd is noise), the input half
    (``BWD_I``: every grad but those) and the weight half (``BWD_W``).
    A stage fed by token inputs is timed split too (the runtime does not split it: its cost is the full backward).
    ``once.unsplit`` is a repetition without the split (the crowd's: :func:`crowd`)."""
    from pipec.model.deferred import WeightGradStash, defer_weight_grads

    inputs = _random_inputs(sigs, sources)
    float_inputs = [x for x in inputs if x.requires_grad]
    params = [p for p in mod.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-9) if params else None

    def context():
        return torch.autocast("cpu", dtype=to_dtype(autocast)) if autocast else torch.autocast("cpu", enabled=False)

    def once(split: bool = True) -> _Sample:
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
        if outs and split:
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

    once.unsplit = lambda: once(split=False)  # type: ignore[attr-defined]
    return once


def _total(sample: Sequence[float]) -> float:
    """What the stop rule and the spread look at: forward plus full backward."""
    return sample[0] + sample[2]


# ----------------------------------------------------------------------------- how


@dataclass(frozen=True, slots=True, kw_only=True)
class Profiling:
    """How ``costs profile`` times the stages: the way the run will run them (plan.json ``model["profile"]``).

    Alone, the stages are timed in turn (this process, ``threads`` intra-op threads) for at least ``reps`` and at
    most ``max_reps`` rounds after a warm-up, until every stage's median is known to ``spread_target``; the least
    of each part is kept: that gives the stages' costs relative to each other with little noise (on a machine
    others share, their work only adds to a repetition's time). With more than one rank here, ``num_ranks``
    processes (the run's ranks on this machine, :data:`MAX_PROFILE_RANKS` at most) then time the stages all at
    once, as the run's ranks compute at once, each with ``threads`` threads: the stages are dealt out round them
    (:meth:`share`), they start together, each keeps timing until it has samples of each of its stages
    taking ``min_time_s`` in all (so the samples span the scheduler's time slices: with more ranks than cores a
    short op either runs whole or waits a slice), and one that is done keeps running its last stage untimed until
    every process is, so no sample is taken on a machine emptier than the run's. The slowdown of each part
    (forward, input backward, backward, optimizer step) is the time all the concurrent samples took over what the
    same samples took alone: one factor per part, since which process the scheduler favours over a short window
    is luck the run does not repeat. The processes repeat that (one fork, stages built once) until the median of
    the repeats' slowdowns is known to ``spread_target``, at least :data:`MIN_CROWD_REPEATS` and at most
    ``crowd_repeats`` times: a window in which the whole host ran slow is one repeat, not the price of every
    stage. The slowdown is kept per microbatch shape and shared by every cut of it (:mod:`.timings`; ``pipec
    tune`` cuts one shape dozens of times): it is how K processes share C cores on that work, measured to a stated
    spread and at one host speed."""

    num_ranks: int = 1
    """Processes timing the stages at once (this one and ``num_ranks - 1`` forked from it)."""
    threads: int = 1
    """Intra-op threads of each (``torch.set_num_threads``), as each rank runs."""
    reps: int = 3
    """The fewest timed rounds of each stage alone, after a warm-up."""
    max_reps: int = MAX_REPS
    """The most rounds alone."""
    min_time_s: float = CONCURRENT_MIN_TIME_S
    """The least time each process spends timing one stage in each repeat of the crowd."""
    crowd_repeats: int = CROWD_REPEATS
    """The most repeats of the crowd; the slowdown is the median of the repeats'."""
    spread_target: float = SPREAD_TARGET
    """Rounds and repeats stop once their median is known to this (:func:`median_ci`)."""

    def share(self, rank: int, num_stages: int) -> list[int]:
        """The stages process ``rank`` times at once with the others: ``rank``, ``rank + num_ranks``, ...;
        with fewer stages than processes, stage ``rank mod num_stages``."""
        if num_stages >= self.num_ranks:
            return list(range(rank, num_stages, self.num_ranks))
        return [rank % num_stages]

    def samples(self, once: Callable[[], _Sample], min_time_s: float = 0.0, *, warm: bool = False,
                reps: int | None = None) -> list[_Sample]:
        """``reps`` samples of ``once`` (None: :attr:`reps`; after a warm-up unless ``warm``), and more until they took
        ``min_time_s``."""
        if not warm:
            once()
        least = self.reps if reps is None else reps
        out, t0 = [], time.perf_counter()
        while len(out) < least or time.perf_counter() - t0 < min_time_s:
            out.append(once())
        return out

    def alone(self, runners: Mapping[int, Callable[[], _Sample]], *,
              baseline: float | None = None) -> tuple[dict[int, list[_Sample]], list[float]]:
        """Every stage timed alone, in turn: a warm-up of each, then rounds of one sample of each, each round after
        the reference (:func:`_reference`), until every stage's median is known to ``spread_target`` (at least
        ``reps`` rounds, at most ``max_reps``). The samples of each stage at the host speed ``baseline`` (None:
        the median of these rounds' references), and the references' times.

        In turn, a window in which the host runs slow costs every stage a sample rather than one stage all of its
        own (timed one stage after another, one cut of the example GPT had its first stage at 9.6 ms and the other
        three at 16-19; 12 ms each in the next compile). And a window lasts seconds: a virtual machine's host runs
        every stage 20-30% slower for a while (its neighbours, its clock), so each sample is scaled by the host's
        reference time (``baseline``) over the reference's time in the sample's round (:func:`_steady`)."""
        reference = _reference(self.threads)
        order = list(runners)
        for i, s in enumerate(order):
            progress.report(f"profiling stage {i + 1}/{len(order)} alone (warm-up)")
            runners[s]()
        got: dict[int, list[_Sample]] = {s: [] for s in runners}
        speed: list[float] = []
        for r in range(max(self.reps, self.max_reps)):
            speed.append(reference())
            for i, s in enumerate(order):
                progress.report(f"profiling stage {i + 1}/{len(order)} alone (round {r + 1})")
                got[s].append(runners[s]())
            if r + 1 >= self.reps and all(
                    median_ci([_total(x) / ref for x, ref in zip(xs, speed)]) <= self.spread_target
                    for xs in got.values()):
                break
        base = baseline if baseline is not None else statistics.median(speed)
        return {s: [_steady(x, r, base) for x, r in zip(xs, speed)] for s, xs in got.items()}, speed


def _steady(sample: Sequence[float], reference_s: float, baseline_s: float) -> _Sample:
    """A sample taken while the reference took ``reference_s``, at the host speed where it takes ``baseline_s``."""
    f = baseline_s / reference_s
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
    return Profiling(num_ranks=n, threads=max(1, threads), reps=max(1, reps), max_reps=max(MAX_REPS, reps))


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the platform tells it; else the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _least_sample(samples: Sequence[_Sample]) -> _Sample:
    """Per part, the least of a stage's repetitions alone: on a machine others share, their work only adds to a
    repetition's time, so the least is the one they disturbed least (the cuts a search compares, each timed at
    another moment, are then compared on their own work)."""
    return tuple(min(x[k] for x in samples) for k in range(len(samples[0])))  # type: ignore[return-value]


def _sums(alone: Mapping[int, Sequence[float]], mine: Mapping[int, Sequence[_Sample]]) -> list[float]:
    """One process's share of a repeat: per part (forward, input backward, backward, optimizer) what its samples
    took in the crowd, then what the same samples took alone."""
    slow = [sum(x[k] for xs in mine.values() for x in xs) for k in range(4)]
    base = [sum(alone[s][k] * len(xs) for s, xs in mine.items()) for k in range(4)]
    return slow + base


def _ratio(sums: Sequence[Sequence[float]]) -> tuple[float, ...]:
    """Per part: what every concurrent sample took over what the same samples took alone (processes' :func:`_sums`
    added). A part none of the samples has (the input backward of a cut whose stages take only tokens, the optimizer
    of stages with no parameters) takes the backward's slowdown (the forward's without one; 1 without either): it
    prices nothing of the cut, but the record and the processor sharing have every part. So does the input backward
    of a crowd that ran no split backward (:func:`crowd`)."""
    out: list[float | None] = []
    for k in range(4):
        slow, base = sum(s[k] for s in sums), sum(s[4 + k] for s in sums)
        out.append(slow / base if base > 0 and slow > 0 else None)
    fwd, _, bwd, _ = out
    fallback = bwd if bwd is not None else fwd if fwd is not None else 1.0
    return tuple(fallback if x is None else x for x in out)


def _slowdown(alone: Mapping[int, Sequence[float]],
              at_once: Sequence[Mapping[int, Sequence[_Sample]]]) -> tuple[float, ...]:
    """Per part: what every concurrent sample of one repeat took over what the same samples took alone."""
    return _ratio([_sums(alone, mine) for mine in at_once])


def _median_slowdown(repeats: Sequence[Sequence[float]]) -> tuple[float, ...]:
    """Per part, the median of the repeats' slowdowns."""
    return tuple(statistics.median(r[k] for r in repeats) for k in range(len(repeats[0])))


def _known(repeats: Sequence[Sequence[float]], target: float) -> bool:
    """Whether the median slowdown of the forward and the backward is known to ``target``."""
    return all(median_ci([r[k] for r in repeats]) <= target for k in (0, 2))


def level_spread(stage: Mapping[str, Any]) -> float:
    """How far a stage's level, timed alone, may sit from its true one (a ``stage`` cache entry's value: the
    ``spread`` of its rounds and how many): the relative standard error of their median, 1.2533 x spread /
    sqrt(rounds) (:func:`median_ci` without its t)."""
    return 1.2533 * float(stage["spread"]) / math.sqrt(max(1, int(stage["rounds"])))


def crowd_spread(repeats: Sequence[Sequence[float]]) -> float:
    """How far the slowdown a run's ranks meet may sit from the crowd's median (a ``crowd`` entry's ``repeats``):
    the relative standard deviation s of the repeats' slowdowns of the forward and the backward (their mean, per
    repeat) over their median, widened to a next repeat's distance from the median of n, s x sqrt(1 + pi / (2n))
    (the median's own standard error is 1.2533 s / sqrt(n)); 0 for fewer than two repeats."""
    levels = [(r[0] + r[2]) / 2 for r in repeats]
    med = statistics.median(levels) if levels else 0.0
    if len(levels) < 2 or med <= 0:
        return 0.0
    return statistics.stdev(levels) / med * math.sqrt(1 + math.pi / (2 * len(levels)))


def _cost(sample: Sequence[float], spread: float | None = None, *, stage: Mapping[str, Any] | None = None,
          crowd: Mapping[str, Any] | None = None) -> Cost:
    """A stage's cost from its parts (:data:`_Sample`); ``stage`` and ``crowd``, the cache entries' values it
    was priced from, give its :attr:`~pipec.schedules.timing.Cost.level_spread` and ``crowd_spread``."""
    fwd, bwd_i, bwd, optim, bwd_w = sample
    if not bwd_i and not bwd_w:  # nothing to split (no output needing a grad)
        bwd_w = bwd
    return Cost(fwd=fwd, bwd=bwd, bwd_i=bwd_i, bwd_w=bwd_w, optim=optim, spread=spread,
                level_spread=None if stage is None else level_spread(stage),
                crowd_spread=None if crowd is None else crowd_spread(crowd["repeats"]))


# ----------------------------------------------------------------------------- at once


class _Together:
    """The profiling processes' start line and finish: every sample is taken while all of them run; and a board
    each process writes its share of a repeat on (:func:`_sums`), so that every one reads the same repeats and
    stops after the same one."""

    def __init__(self, ctx: Any, num: int, repeats: int = 0) -> None:
        self.num = num
        self.barrier = ctx.Barrier(num, timeout=SYNC_TIMEOUT_S) if num > 1 else None
        self.done = ctx.Value("i", 0) if num > 1 else None
        self.board = ctx.Array("d", num * max(1, repeats) * 8, lock=False) if num > 1 else [0.0] * max(1, repeats) * 8
        self.speed = ctx.Array("d", max(1, repeats), lock=False) if num > 1 else [0.0] * max(1, repeats)
        self.rounds = 0

    def start(self) -> None:
        if self.barrier is not None:
            self.barrier.wait()

    def post(self, rank: int, repeat: int, sums: Sequence[float]) -> None:
        """This process's share of ``repeat`` (written before :meth:`finish`, so every process has once it returns)."""
        at = (repeat * self.num + rank) * 8
        self.board[at:at + 8] = list(sums)

    def read(self, repeat: int) -> list[list[float]]:
        return [list(self.board[(repeat * self.num + r) * 8:(repeat * self.num + r + 1) * 8]) for r in range(self.num)]

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


def _at_once(num: int, work: Callable[[int, _Together], _T], repeats: int = 0) -> list[_T]:
    """``work(rank, together)`` in ``num`` processes at once (this one, rank 0, and ``num - 1`` forked), every
    result by rank. A process that fails breaks the others' start; this one then raises its message."""
    if num == 1:
        return [work(0, _Together(None, 1, repeats))]
    ctx = mp.get_context("fork")
    together, queue = _Together(ctx, num, repeats), ctx.SimpleQueue()

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


def _threads(num: int) -> Callable[[], None]:
    old = torch.get_num_threads()
    torch.set_num_threads(max(1, num))
    return lambda: torch.set_num_threads(old)


@dataclass(frozen=True, slots=True)
class Crowd:
    repeats: tuple[tuple[float, ...], ...]
    """Each repeat's slowdown per part (forward, input backward, backward, optimizer)."""
    spread: float
    """How the crowd's samples scatter: each over its stage's median, their :func:`_rel_spread`."""
    speed: tuple[float, ...]
    """The reference's time before each repeat."""


def crowd(profile: Profiling, runners: Mapping[int, Callable[[], _Sample]], alone: Mapping[int, Sequence[float]],
           num_stages: int, baseline: float) -> Crowd:
    """``profile.num_ranks`` processes timing the stages at once (``runners``: every stage's, built and warmed
    before the fork), repeated until the median slowdown is known (:func:`_known`).

    Before each repeat process 0 times the reference while the others wait between two barriers (idle: their
    stages built, the last repeat's load finished; a reference timed while one still ran its load read the crowd
    at 0.94x). Each process writes its share of a repeat on the board before its finish, so once the finish
    returns every process reads the same slowdowns and makes the same choice to stop or go on.

    The crowd runs each stage's forward, full backward and optimizer step, not the backward split again (half of a
    repetition's work): the input half is priced at the full backward's slowdown, as the weight half always was.
    Measured apart, in 5 crowds of the example GPT's layers (microbatches of 1 to 16 sequences, 5 repeats each,
    4 processes on 2 cores), the input half's slowdown over the full backward's was 0.94, 1.19, 0.96, 0.99 and 1.06:
    the repeats' own scatter, no side to it."""
    cap = max(MIN_CROWD_REPEATS, profile.crowd_repeats)

    def work(rank: int, together: _Together) -> tuple[list[dict[int, list[_Sample]]], list[tuple[float, ...]],
                                                      list[float]]:
        torch.set_num_threads(profile.threads)
        mine = {s: getattr(runners[s], "unsplit", runners[s]) for s in profile.share(rank, num_stages)}
        reference = _reference(profile.threads) if rank == 0 else None
        out: list[dict[int, list[_Sample]]] = []
        repeats: list[tuple[float, ...]] = []
        for r in range(cap):
            together.start()  # every process is idle
            if reference is not None:
                together.speed[r] = reference()
                progress.report(f"profiling {profile.num_ranks} processes at once (repeat {r + 1}, at most {cap})")
            together.start()  # time them together
            # from one sample up, as long as min_time_s: a repeat is one reading of the slowdown and the stop rule
            # asks for repeats, so three samples of a long stage in each (most of a cold compile's crowd) bought little
            got = {s: profile.samples(once, profile.min_time_s, warm=r > 0, reps=1) for s, once in mine.items()}
            together.post(rank, r, _sums(alone, got))
            together.finish(mine[max(mine)])
            out.append(got)
            f = baseline / together.speed[r]  # the repeat at the host speed of the samples alone
            repeats.append(_ratio([[x * f for x in row[:4]] + row[4:] for row in together.read(r)]))
            if r + 1 >= MIN_CROWD_REPEATS and _known(repeats, profile.spread_target):
                break
        return out, repeats, list(together.speed[:len(out)])

    by_rank = _at_once(profile.num_ranks, work, repeats=cap)
    _, repeats, speed = by_rank[0]
    totals: dict[int, list[float]] = {}
    for out, _, _ in by_rank:
        for r, got in enumerate(out):
            for s, xs in got.items():
                totals.setdefault(s, []).extend(_total(x) * baseline / speed[r] for x in xs)
    devs = [t / med for ts in totals.values() if (med := statistics.median(ts)) > 0 for t in ts]
    return Crowd(tuple(repeats), _rel_spread(devs), tuple(speed))
