"""Tensor parallelism's collectives as a run issues them, on the fake transport: the example GPT at pp 2 x tp 2
(sequence parallelism on and off, ``dtype`` float32 and bfloat16) through the executor on threads. Each tp op is
the backend's own all-gather / reduce-scatter where it has them (the padded all-reduce where not), goes on the
compute stream over the tp group (never the comm stream of the pipeline's sends and receives), moves the autocast
dtype (the loss's per-token values float32), and is what the simulator prices: per rank, the kinds, ring factors
and bytes of what ran equal those of the record's collectives priced for the plan. The vocab-parallel loss
reads nothing back to the host on a device."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pipec.compiler.ir.tensor_parallel import NATIVE
from pipec.compiler.sim.tensor_parallel import ALL_REDUCE_FACTOR, collective_price
from pipec.runtime.transport import TP_KINDS, Call, FakeWorld

CALL_KIND = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
             "reduce_scatter_tensor": "reduce_scatter"}
"""The torch.distributed call the fake logs -> the record's collective kind."""


def _plan(sp: bool, dtype: str):
    from test_sequence_parallel import tiny_gpt_sp

    return tiny_gpt_sp("1f1b", sp=sp, dtype=dtype)


def _run(plan):
    """One step of every rank of ``plan`` on the fake transport, under the plan's autocast; the world (its log) and
    the ranks' (pp, dp, tp) keys."""
    from conftest import on_threads
    from test_tp_mesh import fake_tp_world

    from pipec.runtime.executor import Executor
    from pipec.runtime.training import autocast_dtype, split_microbatches

    world, data, _, keys, transports, modules, losses = fake_tp_world(plan)
    mesh = plan.mesh

    def rank(p: int, d: int, t: int):
        ex = Executor(plan, pp_rank=p, dp_rank=d, tp_rank=t, transport=transports[(p, d, t)],
                      modules=modules[(p, d, t)], loss_fn=losses[(p, d, t)],
                      autocast_dtype=autocast_dtype(plan.spec.get("dtype", "float32")))
        x, y = data(0, d, mesh.dp)
        return ex.run_step(split_microbatches(x, plan.num_microbatches, "x", ["tokens"]),
                           split_microbatches(y, plan.num_microbatches, "y"))

    on_threads(rank, keys)
    return world, keys


def _moved(call: Call, size: int) -> int:
    """The whole tensor's bytes of a logged tp call (an all-gather is given this rank's part)."""
    n = 1
    for d in call.shape:
        n *= d
    return n * call.dtype.itemsize * (size if call.call == "all_gather_into_tensor" else 1)


def _ran(world, rank: int, backend: str, size: int) -> Counter:
    """(ring factor, whole bytes) of every tp collective global rank ``rank`` issued, as ``backend`` runs it."""
    return Counter((ALL_REDUCE_FACTOR if c.call == "all_reduce" else NATIVE[backend][CALL_KIND[c.call]], _moved(c, size))
                   for c in world.log if c.rank == rank and c.stream == "compute")


def _priced(plan, pp_rank: int, backend: str) -> Counter:
    """(ring factor, bytes) of the record's collectives on pp rank ``pp_rank`` as the simulator prices them, once
    per microbatch."""
    dtype = plan.spec.get("dtype", "float32")
    return Counter({key: n * plan.num_microbatches for key, n in Counter(
        collective_price(c, backend, dtype) for s, r in enumerate(plan.placement) if r == pp_rank
        for c in plan.stages[s].tp.collectives).items()})


@pytest.fixture(scope="module", params=[(False, "float32"), (False, "bfloat16"), (True, "float32"),
                                        (True, "bfloat16")], ids=["sp-off-f32", "sp-off-bf16", "sp-on-f32",
                                                                  "sp-on-bf16"])
def run(request):
    sp, dtype = request.param
    plan = _plan(sp, dtype)
    world, keys = _run(plan)
    return plan, world, keys


def test_tp_collectives_go_on_the_compute_stream_over_the_tp_group(run):
    plan, world, _ = run
    mesh = plan.mesh
    tp_calls = [c for c in world.log if c.stream == "compute"]
    assert tp_calls and {c.call for c in tp_calls} <= set(CALL_KIND)
    for c in tp_calls:
        assert c.group == mesh.tp_group(c.rank), c
    # the comm stream holds the pipeline's posts and the tied weights' all-reduce (wte and the head, across the
    # pp ranks), each between ranks of one tp rank: no tp collective queues behind them
    comm = [c for c in world.log if c.stream == "comm"]
    assert {c.call for c in comm} == {"isend", "irecv", "all_reduce"}
    for c in comm:
        assert len({mesh.tp_rank(g) for g in (c.rank, *c.group)}) == 1, c


def test_each_tp_op_is_the_backends_own_collective(run):
    """Without sequence parallelism every pair's f and g is an all-reduce (the loss gathers each rank's max);
    with it the pairs' collectives are all-gathers and reduce-scatters, their own calls on NCCL and gloo."""
    plan, world, _ = run
    kinds = Counter(c.call for c in world.log if c.stream == "compute")
    if plan.mesh.sequence_parallel:
        assert kinds["all_gather_into_tensor"] > 0 and kinds["reduce_scatter_tensor"] > 0
        pairs = [c for st in plan.stages for c in st.tp.collectives if not c.of]
        assert {c.kind for c in pairs} == {"all_gather", "reduce_scatter"}   # no pair all-reduces
    else:
        assert kinds["reduce_scatter_tensor"] == 0
        # the loss's max, gathered once per microbatch on each rank of the last stage
        assert kinds["all_gather_into_tensor"] == plan.num_microbatches * plan.mesh.tp


def test_tp_collectives_move_the_autocast_dtype_and_the_loss_float32(run):
    plan, world, _ = run
    wire = {"float32": torch.float32, "bfloat16": torch.bfloat16}[plan.spec["dtype"]]
    last = {plan.mesh.global_rank(plan.placement[-1], 0, t) for t in range(plan.mesh.tp)}
    loss = plan.num_microbatches * 3                      # per last-stage rank: the max, the sum, the target's logit
    tokens = plan.stages[-1].tp.collectives[-1].num_bytes // 4    # the loss's values: one float32 per token
    dtypes = Counter((c.rank in last and c.shape in ((tokens,), (tokens, 1)), c.dtype)
                     for c in world.log if c.stream == "compute")
    assert dtypes[(True, torch.float32)] == loss * len(last)
    assert set(dtypes) - {(True, torch.float32)} == {(False, wire)}
    if wire == torch.bfloat16:
        # traced under autocast, the norms' outputs (and the gradients f sums into them) are float32: the run
        # casts them, so the record's dtype is not what moves
        assert {c.dtype for st in plan.stages for c in st.tp.collectives if not c.of} == {"float32", "bfloat16"}


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_what_ran_is_what_the_simulator_prices(run, backend):
    """Per rank and step, the (ring factor, bytes) of the tp collectives issued equal the record's priced for the
    plan's backend and dtype, microbatch by microbatch (gloo's reduce-scatter at twice NCCL's)."""
    plan, world, keys = run
    mesh = plan.mesh
    for p, d, t in keys:
        assert _ran(world, mesh.global_rank(p, d, t), backend, mesh.tp) == _priced(plan, p, backend), (p, d, t)


class _Lacking(FakeWorld):
    """A fake world whose backend has no all-gather or reduce-scatter of its own."""

    def __init__(self, world_size: int, timeout: float = 30.0, **kw) -> None:
        super().__init__(world_size, timeout, native=(), **kw)


def test_a_backend_without_them_all_reduces_the_padded_whole_as_priced(monkeypatch):
    """A backend lacking all-gather and reduce-scatter: every tp op is an all-reduce of the whole tensor, priced
    at an all-reduce's factor (``mpi`` has no entry in NATIVE)."""
    import pipec.runtime.transport as transport

    monkeypatch.setattr(transport, "FakeWorld", _Lacking)
    plan = _plan(True, "bfloat16")
    world, keys = _run(plan)
    assert {c.call for c in world.log if c.stream == "compute"} == {"all_reduce"}
    mesh = plan.mesh
    assert "mpi" not in NATIVE
    for p, d, t in keys:
        ran = Counter((ALL_REDUCE_FACTOR, _moved(c, mesh.tp)) for c in world.log
                      if c.rank == mesh.global_rank(p, d, t) and c.stream == "compute")
        assert ran == _priced(plan, p, "mpi"), (p, d, t)
        assert {f for f, _ in _priced(plan, p, "mpi")} == {ALL_REDUCE_FACTOR}


def test_the_fake_refuses_a_collective_its_backend_lacks():
    t = FakeWorld(2, native=()).transport(0)
    assert set(TP_KINDS) == set(CALL_KIND.values())
    with pytest.raises(AssertionError):
        t.tp("reduce_scatter", torch.zeros(2), torch.zeros(4), (0, 1))


# ----------------------------------------------------------------------------- the loss reads nothing back


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that copy a value to the host (``item``, ``bool``, ``tolist``): a device sync on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0
        self.asserts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        if func.overloadpacket is torch.ops.aten._assert_async:
            self.asserts += 1
        return func(*args, **(kwargs or {}))


def _loss_on(device: str, n: int = 6, rows: int = 4):
    """The vocab-parallel loss and its gradient on ``device``, over a thread group of one rank (the collectives
    are the same calls at any size); the host reads and device asserts it made."""
    from pipec.tp.comm import ThreadGroupTP, vocab_parallel_cross_entropy

    logits = torch.randn(n, rows, device=device, requires_grad=True)
    target = torch.randint(0, rows, (n,)).to(device)
    with _HostReads() as mode:
        loss = vocab_parallel_cross_entropy(logits, target, ThreadGroupTP(1).rank(0), rank=0, size=1)
        loss.backward()
    assert logits.grad is not None and logits.grad.shape == logits.shape
    return mode


def test_the_vocab_parallel_loss_reads_nothing_back_on_a_device(monkeypatch):
    """On a device (meta here: a host read of a meta tensor raises) every call after a process's first checks its
    targets on the device (an async assert) and reads nothing back, forward or backward; on CPU the check reads
    on the host (no device to sync)."""
    import pipec.tp.comm as comm

    monkeypatch.setattr(comm, "_TARGETS_CHECKED", True)
    on_device = _loss_on("meta")
    assert on_device.reads == 0 and on_device.asserts == 1
    on_cpu = _loss_on("cpu")
    assert on_cpu.reads == 1 and on_cpu.asserts == 0
    # a process's first call on a device checks on the host once (the located error), then never again
    monkeypatch.setattr(comm, "_TARGETS_CHECKED", False)
    with pytest.raises(RuntimeError, match="meta"):
        _loss_on("meta")
    assert comm._TARGETS_CHECKED
