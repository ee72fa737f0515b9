"""The sharded ``REDUCE_SCATTER`` is posted, not waited for where it stands (runtime/sharding.py, runtime/executor.py).

- In-process, over the fake transport with a recording stand-in for the FSDP2
  driver: the ``RS<s>`` handler returns with its work unwaited; the work is
  waited once, inside ``OPT``, after the backwards that follow it on the rank
  (interleaved_1f1b: ``RS2`` comes before ``B0.2``, ``B0.3``); under HSDP the
  ``AR<s>:dp.replicate`` right after it waits for that stage's alone (it
  reduces the shards), and the wait is timed as waiting (``~AR``).
- Under torchrun with gloo (on 2 ranks, in a launch shared with other tests:
  tests/launches.py), FSDP2 itself (:class:`ParamShards`): the
  reduce-scatter's collective is posted and left unwaited by
  ``reduce_scatter``; after the handle's ``wait`` the gradient shards are the
  dp average of the accumulated microbatch gradients (float32, and bfloat16
  under the mixed-precision policy); when the shards already hold gradients
  (FSDP2 adds its output to them on the host) it is waited for at once and the
  sum is right.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import LAUNCHES, call_job, on_threads

from pipec.compiler.config import TrainingConfig
from pipec.compiler.driver import compile_spec
from pipec.runtime.stages import build_stages
from pipec.compiler.ir.program import Op
from pipec.dsl import load_spec
from pipec.runtime.executor import Executor
from pipec.runtime.training import make_data, make_loss, split_microbatches
from pipec.runtime.transport import FakeWorld


def mlp_plan(schedule: str, pp: int, dp: int, virtual: int, **keys):
    """A small MLP (no tied weights, so nothing but OPT waits for the reductions) with unit costs."""
    overrides = {"model": "pipec.examples.mlp:build", "model_args": {"layers": 4, "dim": 8}, "input": "x: float32[8, 8]",
                 "loss": "mse", "schedule": schedule, "pp": pp, "dp": dp, "virtual": virtual, "microbatches": 4,
                 "costs": "unit", "partition": "balanced(by=params)", **keys}
    return compile_spec(load_spec(None, overrides)).plan


class Recorded:
    """A posted collective's work that logs its waits."""

    def __init__(self, log: list, what: str) -> None:
        self.log, self.what, self.waits = log, what, 0

    def wait(self) -> None:
        self.waits += 1
        self.log.append(("wait", self.what))


class RecordingShards:
    """The FSDP2 driver's interface over plain modules: ``reduce_scatter`` hands back a :class:`Recorded` work."""

    def __init__(self, log: list) -> None:
        self.log = log
        self.posted: list[Recorded] = []

    def unshard(self, s: int):
        return None

    def reshard(self, s: int) -> None:
        pass

    def reduce_scatter(self, s: int) -> Recorded:
        work = Recorded(self.log, f"RS{s}")
        self.posted.append(work)
        return work


def run_recorded(plan) -> dict[tuple[int, int], tuple[list, RecordingShards, object]]:
    """Every rank on a thread: (its log of instructions run and waits, its stand-in driver, its step)."""
    P, D = plan.mesh.pp, plan.mesh.dp
    world = FakeWorld(P * D, timeout=60)
    config = TrainingConfig.from_spec(plan.spec)
    data, loss_fn = make_data(config, plan), make_loss(config.loss)
    keys = [(p, d) for p in range(P) for d in range(D)]
    modules = {(p, d): build_stages(plan, [s for s, r in enumerate(plan.placement) if r == p], seed=0)
               for p, d in keys}  # one after another: tracing is not thread-safe

    def rank(p: int, d: int) -> tuple[list, RecordingShards, object]:
        log: list = []
        shards = RecordingShards(log)
        ex = Executor(plan, pp_rank=p, dp_rank=d, transport=world.transport(plan.mesh.global_rank(p, d)),
                      modules=modules[(p, d)], loss_fn=loss_fn, sharding=shards,
                      optimizer_step=lambda: log.append(("step", None)),
                      fail_hook=lambda i, ins: log.append(("run", ins.text())))
        x, y = data(0, d, D)
        step = ex.run_step(split_microbatches(x, plan.num_microbatches, "x", ["x"]),
                           split_microbatches(y, plan.num_microbatches, "y"))
        return log, shards, step

    return on_threads(rank, keys)


def test_the_reduce_scatter_is_waited_in_opt_after_the_backwards_that_follow_it():
    plan = mlp_plan("interleaved_1f1b", 2, 2, 2, shard="grads")
    for (p, d), (log, shards, step) in run_recorded(plan).items():
        ran = [text for kind, text in log if kind == "run"]
        scatters = [text for text in ran if text.startswith("RS")]
        assert len(scatters) == 2 and len(shards.posted) == 2, ran
        first = ran.index(scatters[0])
        later = [t for t in ran[first + 1:] if t[0] == "B"]
        assert later, f"rank {p}: no backward after {scatters[0]} ({' '.join(ran)})"
        opt = log.index(("run", "OPT"))
        for rs in scatters:
            at = log.index(("run", rs))
            assert log[at + 1][0] == "run", f"{rs} waited in its own handler"  # the next instruction ran first
            assert [w for w in log if w == ("wait", rs.split(":")[0])] == [("wait", rs.split(":")[0])]
            assert opt < log.index(("wait", rs.split(":")[0])) < log.index(("step", None))
        assert all(w.waits == 1 for w in shards.posted)
        waited = {e.op for e in step.events if e.wait}
        assert Op.OPTIM_STEP in waited and Op.REDUCE_SCATTER not in waited


def test_hsdp_replicate_allreduce_waits_only_for_its_own_stage():
    plan = mlp_plan("interleaved_1f1b", 2, 4, 2, shard="grads", shard_size=2)
    assert any(ins.op is Op.ALLREDUCE and ins.group == "dp.replicate" for ins in plan.program.ranks[0])
    for (p, d), (log, shards, step) in run_recorded(plan).items():
        waits = [i for i, (kind, _) in enumerate(log) if kind == "wait"]
        assert len(waits) == len(shards.posted) == 2, log
        for i in waits:  # each right where its stage's replicate all-reduce starts, none left for OPT
            s = log[i][1][2:]
            assert log[i - 1] == ("run", f"AR{s}:dp.replicate"), log[i - 3:i + 1]
            assert log.index(("run", f"RS{s}:dp.shard")) == i - 2
        assert all(w.waits == 1 for w in shards.posted)
        assert any(e.wait and e.op is Op.ALLREDUCE and e.group == "dp.replicate" for e in step.events)


# ----------------------------------------------------------------------------- FSDP2 under torchrun


fsdp2_runs = LAUNCHES.runs("fsdp2_runs", world=2,
                          make=lambda folder: {"fsdp2": call_job("test_shard_async:fsdp2_reduce_scatter")})


@pytest.mark.timeout(900)
def test_fsdp2_reduce_scatter_is_posted_and_right_after_its_wait(fsdp2_runs):
    assert fsdp2_runs["fsdp2"]["returned"] == ["rank 0: posted ok", "rank 1: posted ok"]


def fsdp2_reduce_scatter() -> str:
    """Each rank (tests/runtime_worker.py, 2 ranks): FSDP2 on a small model over the 2 ranks (the rank's own
    batch), two accumulated backwards, then ``reduce_scatter``; checked against an unsharded copy's grads
    averaged over both ranks' batches. What it says when every check held."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pipec.runtime import sharding
    from pipec.runtime.sharding import ParamShards, full

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    posted: list = []
    post = sharding._reduce_scatter

    class Tracked:
        def __init__(self, work) -> None:
            self.work, self.waited = work, False

        def wait(self):
            assert not self.waited, "a collective waited twice"
            self.waited = True
            return self.work.wait()

    def tracked(*args, **kwargs):
        posted.append(Tracked(post(*args, **kwargs)))
        return posted[-1]

    sharding._reduce_scatter = tracked  # this process's own module (the worker's), not the test run's

    def batches(r: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(10 + r)
        return [torch.randn(4, 7, generator=g) for _ in range(2)]

    def backwards(model, xs) -> None:
        for x in xs:
            model(x).pow(2).mean().backward()

    for dtype, tol in (("float32", 1e-6), ("bfloat16", 5e-2)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.GELU(), torch.nn.Linear(5, 3))  # odd: padded
        ref = copy.deepcopy(model)
        shards = ParamShards({0: model}, mesh, dtype=dtype)
        for r in (0, 1):  # the reference: both ranks' batches, the average of their grads
            backwards(ref, batches(r))
        want = [p.grad / 2 for p in ref.parameters()]

        def step() -> tuple[object, bool]:
            """As the plan runs a stage: UNSHARD, its backwards, REDUCE_SCATTER, RESHARD (OPT waits later)."""
            shards.unshard(0).wait()
            backwards(model, batches(rank))
            before = len(posted)
            handle = shards.reduce_scatter(0)
            assert len(posted) == before + 1, dtype  # one collective for the stage
            shards.reshard(0)
            return handle, posted[-1].waited

        handle, waited = step()
        assert handle is not None and not waited, dtype  # posted, left in flight past RESHARD
        handle.wait()
        assert posted[-1].waited, dtype
        for p, w in zip(model.parameters(), want):  # the shards, gathered
            torch.testing.assert_close(full(p.grad), w, atol=tol, rtol=tol)

        handle, waited = step()  # the shards hold grads already: FSDP2 adds to them on the host, so waited at once
        assert handle is None and waited, dtype
        for p, w in zip(model.parameters(), want):
            torch.testing.assert_close(full(p.grad), 2 * w, atol=2 * tol, rtol=tol)
    sharding._reduce_scatter = post
    return f"rank {rank}: posted ok"
