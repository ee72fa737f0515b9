"""The lean executor: buffers made once per plan, waits where they belong, no device-wide sync in a step.

- Every receive's buffers are made once per plan: steps after the first post
  into the same tensors, and every step's loss and gradients stay exact.
- A collective the optimizer step waits for (the grad norm's all-reduce) is
  timed as waiting, its own ``~OPT`` event, not as OPT's work.
- A step's state is its own: nothing one step leaves behind reaches the next.
- An instruction's error names the rank apart from what failed, so the
  report names the rank once, without reading it back out of the message.
- CUDA (run here on fakes: there is no GPU in CI): the clock resolves a step
  by waiting for its last event, never with a device-wide synchronize;
  communication is posted on its own stream after it waits for the compute
  stream, and on CPU that helper does nothing.
"""

from __future__ import annotations

import gc
import time
from types import SimpleNamespace

import pytest
import torch

from conftest import on_threads
from test_runtime import reference_step, tiny_gpt

from pipec.compiler.config import TrainingConfig
from pipec.compiler.driver import compile_plan
from pipec.runtime.stages import build_stages
from pipec.compiler.ir.program import Op
from pipec.runtime import clock as clock_mod
from pipec.runtime.clock import CudaClock
from pipec.errors import EXIT_RUN
from pipec.runtime.executor import Executor, RunError
from pipec.runtime.failures import RankFailed, RankReport
from pipec.runtime.trainer import Trainer
from pipec.runtime.training import make_data, make_loss, split_microbatches
from pipec.runtime.transport import CommStream, FakeWorld


class RecordingTransport:
    """A fake transport that remembers every receive buffer posted, per step, and each post call's ops;
    ``buffered``: whether it lets the executor post a step's receives early (the fake's own does)."""

    def __init__(self, inner, steps: list[list[torch.Tensor]], calls: list[list], *, buffered: bool) -> None:
        self.inner, self.steps, self.rank, self.shard_mesh = inner, steps, inner.rank, None
        self.calls, self.buffered = calls, buffered

    def post(self, ops):
        self.steps[-1].extend(op.tensor for op in ops if not op.send)
        self.calls[-1].append(list(ops))
        return self.inner.post(ops)

    def all_reduce(self, tensor, group, *, average=False):
        return self.inner.all_reduce(tensor, group, average=average)

    def barrier(self):
        self.steps.append([])
        self.calls.append([])
        self.inner.barrier()


def run_steps(plan, num_steps: int, *, emulate: float | None = None, executor_hook=None, buffered: bool = False):
    """Every rank on a thread over the fake transport, ``num_steps`` steps on the same executors; returns per rank
    the receive buffers posted per step, each step's post calls, the step results and, per step, the grads the
    optimizer step saw (then cleared, as an optimizer's ``zero_grad`` does)."""
    P, D = plan.mesh.pp, plan.mesh.dp
    world = FakeWorld(P * D, timeout=60)
    mods = {(p, d): {} if emulate is not None else
            build_stages(plan, [s for s, r in enumerate(plan.placement) if r == p], seed=0)
            for p in range(P) for d in range(D)}
    if emulate is None:
        config = TrainingConfig.from_spec(plan.spec)
        data, loss_fn = make_data(config, plan), make_loss(config.loss)

    def rank(p: int, d: int) -> SimpleNamespace:
        posted: list[list[torch.Tensor]] = []
        calls: list[list] = []
        grads: list[dict] = []

        def optimizer_step() -> None:
            grads.append({n: q.grad.clone() for m in mods[(p, d)].values() for n, q in m.canonical_params().items()})
            for m in mods[(p, d)].values():
                m.zero_grad(set_to_none=True)

        ex = Executor(plan, pp_rank=p, dp_rank=d, emulate=emulate, modules=mods[(p, d)],
                      transport=RecordingTransport(world.transport(plan.mesh.global_rank(p, d)), posted, calls,
                                                   buffered=buffered),
                      loss_fn=None if emulate is not None else loss_fn,
                      optimizer_step=optimizer_step if emulate is None else None)
        if executor_hook is not None:
            executor_hook(ex)
        results = []
        for step in range(num_steps):
            if emulate is None:
                x, y = data(step, d, D)
                results.append(ex.run_step(split_microbatches(x, plan.num_microbatches, "x", ["tokens"]),
                                           split_microbatches(y, plan.num_microbatches, "y")))
            else:
                results.append(ex.run_step(None, None))
        return SimpleNamespace(posted=posted, calls=calls, results=results, grads=grads)

    return on_threads(rank, [(p, d) for p in range(P) for d in range(D)])


# ----------------------------------------------------------------------------- buffers once per plan


def _lean_cases():
    """Each schedule once in the quick run (the two ways of posting split between them); the rest under --slow."""
    quick = {("1f1b", False), ("zb_h1", True), ("interleaved_1f1b", False)}
    for case in [("1f1b", 1, 2, 1), ("zb_h1", 1, 2, 2), ("interleaved_1f1b", 2, 2, 1)]:
        for buffered, name in ((False, "posted in place"), (True, "posted early")):
            marks = () if (case[0], buffered) in quick else pytest.mark.slow
            yield pytest.param(*case, buffered, marks=marks, id=f"{'-'.join(map(str, case))}-{name}")


@pytest.mark.parametrize("schedule, virtual, pp, dp, buffered", list(_lean_cases()))
def test_receive_buffers_are_made_once_and_every_step_stays_exact(schedule, virtual, pp, dp, buffered):
    """Steps after the first allocate no receive buffer (they post into the first step's tensors), and the second
    step's loss and every gradient still equal one unpartitioned step on its batch (a reused leaf keeps no grad),
    whether the receives go out where the plan puts them or all at the step's start."""
    plan = tiny_gpt(schedule, virtual, pp, dp)
    ranks = run_steps(plan, 3, buffered=buffered)
    for r in ranks.values():
        first, *later = r.posted
        assert first and len({id(t) for t in first}) == len(first)  # one buffer per (edge, microbatch, tensor)
        for step in later:
            assert [id(t) for t in step] == [id(t) for t in first]
    ref_loss, ref_grads = reference_step(plan, step=1)
    losses = [r.results[1].loss for r in ranks.values() if r.results[1].loss is not None]
    assert sum(losses) / dp == pytest.approx(ref_loss, rel=1e-5)
    for r in ranks.values():
        for name, g in r.grads[1].items():
            ref = ref_grads[name]
            assert (g - ref).abs().max().item() <= 1e-4 * (ref.abs().max().item() + 1e-12), (schedule, name)


@pytest.mark.parametrize("buffered", [False, True])
def test_a_buffered_transport_gets_every_receive_of_a_step_when_the_step_starts(buffered):
    """Over a transport whose posts never block (gloo, the fake), a step's first post is every receive of the
    rank's program, in program order, and every later post only sends; otherwise (NCCL) each receive goes out
    where the plan puts it."""
    plan = tiny_gpt("1f1b", 1, 2, 1)
    ranks = run_steps(plan, 2, buffered=buffered)
    for (p, d), r in ranks.items():
        program = plan.program.ranks[p]
        receives = [(i.op, i.microbatch) for i in program if i.op in (Op.RECV_ACT, Op.RECV_GRAD)]
        first, *rest = r.calls[1]
        if buffered:
            assert all(not op.send for op in first) and len(first) == len(receives) > 0
            assert all(op.send for ops in rest for op in ops)
        else:
            assert sum(not op.send for ops in r.calls[1] for op in ops) == len(receives)
            assert sum(any(not op.send for op in ops) for ops in r.calls[1]) > 1  # receives spread over the step


def test_no_cyclic_collection_runs_inside_a_step():
    """The collector is off for every instruction of a step (a collection there stalls the rank and its peers)
    and back on after it, as it was."""
    plan = tiny_gpt("gpipe", 1, 1, 1)  # one rank: the collector is the process's, and ranks on threads share it
    seen: list[bool] = []

    def hook(ex):
        ex.units = [(i, (lambda arg, h=h: (seen.append(gc.isenabled()), h(arg))), arg) for i, h, arg in ex.units]

    assert gc.isenabled()
    run_steps(plan, 2, executor_hook=hook)
    assert seen and not any(seen)
    assert gc.isenabled()


def test_emulated_posts_move_the_same_placeholders_every_step():
    ranks = run_steps(compile_plan(num_ranks=2, num_microbatches=4, schedule="1f1b").plan, 2, emulate=0.0)
    for r in ranks.values():
        assert [id(t) for t in r.posted[0]] == [id(t) for t in r.posted[1]]


# ----------------------------------------------------------------------------- waits


class SlowWork:
    """A collective whose peer arrives ``seconds`` late."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def wait(self) -> None:
        time.sleep(self.seconds)


def test_a_collective_inside_the_optimizer_step_is_timed_as_waiting():
    plan = compile_plan(num_ranks=2, num_microbatches=4, schedule="1f1b").plan
    late = 0.05

    def hook(ex: Executor) -> None:
        def optimizer_step() -> None:
            ex.wait_in_optimizer_step([SlowWork(late)])

        ex.optimizer_step = optimizer_step

    for r in run_steps(plan, 1, emulate=0.0, executor_hook=hook).values():
        step = r.results[0]
        waits = [e for e in step.events if e.op is Op.OPTIM_STEP and e.wait]
        work = [e for e in step.events if e.op is Op.OPTIM_STEP and not e.wait]
        assert max(e.end - e.start for e in waits) >= late
        assert sum(e.end - e.start for e in work) < late  # OPT's work is what surrounds the wait
        for w in waits:
            assert all(e.end <= w.start + 1e-9 or e.start >= w.end - 1e-9 for e in work)
        assert step.comm_wait >= late and step.compute < late


def test_grad_clipping_waits_for_its_norm_through_the_executor_and_scales_on_the_device():
    """The trainer's clipping: its all-reduce is waited for by the executor (timed as waiting), and the scale is
    the global norm's, without reading the norm on the host."""
    torch.manual_seed(0)
    plan = compile_plan(num_ranks=2, num_microbatches=4, schedule="1f1b").plan
    module = torch.nn.Linear(4, 4)
    for p in module.parameters():
        p.grad = torch.randn_like(p) * 10
    mine = sum(p.grad.double().pow(2).sum() for p in module.parameters())
    waited = []

    class Peer:  # the other pp rank holds grads of the same norm
        def __init__(self, t):
            self.t = t

        def wait(self):
            self.t.mul_(2)

    trainer = SimpleNamespace(
        plan=plan, own=[0], modules={0: module}, sharding=None, dp_rank=0, tp_rank=0,
        device=torch.device("cpu"),
        transport=SimpleNamespace(all_reduce=lambda t, group: Peer(t)),
        executor=SimpleNamespace(wait_in_optimizer_step=lambda works: [waited.append(w) or w.wait() for w in works]))
    host_reads = []
    real_float = torch.Tensor.__float__
    torch.Tensor.__float__ = lambda t: host_reads.append(t) or real_float(t)
    try:
        Trainer.clip_grads(trainer, 1.0)
    finally:
        torch.Tensor.__float__ = real_float
    assert len(waited) == 1 and not host_reads
    clipped = sum(p.grad.double().pow(2).sum() for p in module.parameters())
    assert (2 * clipped).sqrt().item() == pytest.approx(1.0, rel=1e-5)
    assert clipped.item() == pytest.approx(mine.item() / (2 * mine.item()), rel=1e-5)


# ----------------------------------------------------------------------------- per step, per rank


def test_each_step_starts_from_a_state_of_its_own():
    """Whatever a step's handlers leave in their state (here a stray receive), the next step starts without it."""
    plan = compile_plan(num_ranks=1, num_microbatches=2, schedule="gpipe").plan
    ex = Executor(plan, pp_rank=0, dp_rank=0, transport=FakeWorld(1).transport(0), emulate=0.0)
    first = ex.run_step(None, None)
    ex.state.recvs[("A", 0, 1, 0)] = ([], [])  # OPT refuses a receive posted but never used
    assert ex.state.spans and ex.run_step(None, None) is not first
    assert not ex.state.recvs and len(ex.state.result.events) == len(first.events)


def test_an_instructions_error_names_its_rank_once_in_the_report():
    plan = compile_plan(num_ranks=1, num_microbatches=2, schedule="gpipe").plan

    def boom(index, ins):
        if index == 1:
            raise RuntimeError("boom")

    ex = Executor(plan, pp_rank=0, dp_rank=0, transport=FakeWorld(1).transport(0), emulate=0.0, fail_hook=boom)
    with pytest.raises(RunError) as e:
        ex.run_step(None, None)
    where, text = plan.mesh.where(0), plan.program.ranks[0][1].text()
    assert str(e.value) == f"{where}, instruction 1 ({text}): RuntimeError: boom"
    assert (e.value.rank, e.value.where) == (0, where)
    report = RankReport.of(RankFailed(where, e.value), rank=0, where=where)
    assert report.line() == f"{where}: instruction 1 ({text}): RuntimeError: boom" and report.exit_code == EXIT_RUN
    other = RankReport.of(RankFailed(plan.mesh.where(1), e.value), rank=1, where=plan.mesh.where(1))
    assert other.message == str(e.value)  # another rank's error keeps its rank in the message


# ----------------------------------------------------------------------------- CUDA, on fakes


class FakeEvent:
    """A CUDA event on a host clock: what the clock needs of one."""

    synced: list["FakeEvent"] = []

    def __init__(self, enable_timing: bool = False) -> None:
        self.t = None

    def record(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        FakeEvent.synced.append(self)

    def elapsed_time(self, other: "FakeEvent") -> float:
        return (other.t - self.t) * 1e3


def test_a_step_on_the_cuda_clock_never_synchronizes_the_device(monkeypatch):
    def device_wide(*_):
        raise AssertionError("torch.cuda.synchronize inside a step")

    monkeypatch.setattr(torch.cuda, "synchronize", device_wide)
    monkeypatch.setattr(clock_mod.torch.cuda, "Event", FakeEvent)
    FakeEvent.synced = []
    clocks = []

    def hook(ex: Executor) -> None:
        ex.clock = CudaClock(torch.device("cuda", 0))
        clocks.append(ex.clock)

    plan = compile_plan(num_ranks=2, num_microbatches=4, schedule="1f1b").plan
    ranks = run_steps(plan, 2, emulate=0.0, executor_hook=hook)
    assert len(FakeEvent.synced) == 2 * len(ranks)  # per step and rank: its last event, once
    assert {id(e) for e in FakeEvent.synced} >= {id(c.last) for c in clocks}
    for r in ranks.values():
        for step in r.results:
            assert step.step_time > 0 and step.events and all(e.end >= e.start >= 0 for e in step.events)


def test_the_comm_stream_is_nothing_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: pytest.fail("a CUDA stream made on CPU"))
    comm = CommStream(torch.device("cpu"))
    assert comm.stream is None
    with comm.posting():
        pass


def test_on_cuda_a_post_waits_for_the_compute_stream_then_goes_on_the_comm_stream(monkeypatch):
    calls = []

    class FakeStream:
        def __init__(self, device=None):
            self.device = device

        def wait_stream(self, other):
            calls.append(("comm waits for", other))

    class Current:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            calls.append(("posting on", self.stream))

        def __exit__(self, *exc):
            calls.append(("back on", "compute"))

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "compute")
    monkeypatch.setattr(torch.cuda, "stream", Current)
    comm = CommStream(torch.device("cuda", 0))
    with comm.posting():
        calls.append(("post", None))
    assert calls == [("comm waits for", "compute"), ("posting on", comm.stream), ("post", None), ("back on", "compute")]
