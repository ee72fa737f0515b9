"""Moving tensors between ranks: torch.distributed, or an in-process fake for tests.

The executor talks to a :class:`Transport` only: post a list of sends and
receives (one ``batch_isend_irecv`` when there are several), all-reduce a
tensor over a group, wait. :class:`TorchTransport` does it with
torch.distributed (gloo on CPU, NCCL on CUDA: posted on a communication stream
of its own, :class:`CommStream`); :class:`FakeWorld` runs every
rank as a thread of one process with first-in, first-out channels per pair of
ranks, as gloo and NCCL match messages, so the executor's logic is tested
fast without launching processes.

Tensor parallelism's collectives (:class:`TransportTP`, what a sharded stage's f and g call) go through
:meth:`Transport.tp` instead: issued on the compute stream, over the tp group's own process group (NCCL runs
them on that group's stream), never on the comm stream, so they do not queue behind a pipeline send whose
receiver has not posted or behind a dp all-reduce; the all-gather and reduce-scatter are the backend's own
(``all_gather_into_tensor`` / ``reduce_scatter_tensor``, :data:`~pipec.compiler.ir.tensor_parallel.NATIVE`)
where it has them, else an all-reduce of the zero-padded whole. The fake keeps a log of every call
(:class:`Call`: which collective, which stream, which dtype) for the tests, and with ``ordered`` completes a
rank's comm-stream work in the order posted, as one CUDA stream would.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
from pipec.errors import RunFailed
from pipec.tp.comm import IssuingGroup, dist_issue

__all__ = ["P2P", "Work", "Transport", "TorchTransport", "TransportTP", "CommStream", "FakeWorld", "FakeTransport",
           "TransportTimeout", "Call", "TP_KINDS"]

TP_KINDS = ("all_reduce", "all_gather", "reduce_scatter")
"""What :meth:`Transport.tp` runs: an in-place sum; every rank's tensor concatenated on dim 0; this rank's dim-0
part of the sum."""


@dataclass(frozen=True, slots=True)
class Call:
    """One collective or post as the fake transport ran it (its log, for the tests)."""

    rank: int
    call: str
    """The torch.distributed call it stands for: ``isend``, ``irecv``, ``all_reduce``, ``all_gather_into_tensor``,
    ``reduce_scatter_tensor``."""
    stream: str
    """``comm`` (the executor's comm stream: pipeline posts, dp and tie all-reduces) or ``compute`` (the tp
    collectives, issued on the compute stream over the tp group's own process group)."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    group: tuple[int, ...] = ()


class TransportTimeout(RunFailed):
    """A fake-transport wait ran past its timeout (a real one raises torch's own error)."""


@dataclass(frozen=True, slots=True)
class P2P:
    """One point-to-point post: send ``tensor`` to, or receive it from, global rank ``peer``."""

    send: bool
    tensor: torch.Tensor
    peer: int


class Work(Protocol):
    def wait(self) -> object: ...


class Transport(Protocol):
    rank: int
    buffered: bool
    """Posts never block and a receive may be posted any time before its use (gloo, the fake; not NCCL, whose
    posts complete in the order posted): the executor then posts a step's receives when the step starts."""

    def post(self, ops: Sequence[P2P]) -> list[Work]: ...

    def all_reduce(self, tensor: torch.Tensor, group: tuple[int, ...], *, average: bool = False) -> Work: ...

    native: frozenset[str]
    """The sequence-parallel collectives (``all_gather``, ``reduce_scatter``) the backend runs as one call."""

    def tp(self, kind: str, out: torch.Tensor, tensor: torch.Tensor, group: tuple[int, ...]) -> Work:
        """A tp collective (``kind`` in :data:`TP_KINDS`; ``all_reduce`` sums ``tensor`` in place, ``out`` is it)
        on the compute stream over ``group``'s own process group, asynchronous: its work's ``wait`` makes the
        caller's stream wait for it."""
        ...

    def barrier(self) -> None: ...


class _Done:
    def wait(self) -> None:
        return None


class CommStream:
    """CUDA: the stream communication is posted on, apart from the compute stream; CPU: nothing.

    Each post first makes the comm stream wait for an event recorded on the compute stream (after the compute
    that produced what goes out), then issues the NCCL call with the comm stream current; whoever consumes a
    result calls its work's ``wait``, which makes the consumer's (compute) stream wait for it on the device
    (the host does not block). No device-wide sync: compute goes on while messages move.
    """

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def posting(self) -> contextlib.AbstractContextManager:
        """The context a post is issued in (on CPU a null context)."""
        if self.stream is None:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        return torch.cuda.stream(self.stream)


class TorchTransport:
    """torch.distributed: ``groups`` maps a tuple of global ranks to its process group."""

    def __init__(self, groups: dict[tuple[int, ...], object], *, shard_mesh=None, tp_mesh=None,
                 device: torch.device | None = None) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank = dist.get_rank()
        if device is None:  # NCCL works on the rank's current CUDA device, gloo on the host
            nccl = dist.get_backend() == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.comm = CommStream(device)
        self.groups = groups
        self.shard_mesh = shard_mesh
        """The 1-D DeviceMesh of this rank's shard group when the plan shards (FSDP2 and ZeRO-1 work over it)."""
        self.tp_mesh = tp_mesh
        """The 1-D DeviceMesh of this rank's tp group at tp > 1 (None at tp 1): what the stages the
        tensor-parallel pass shards run their collectives on (DTensor ``parallelize_module`` takes it)."""
        self.world = dist.group.WORLD
        from pipec.compiler.ir.tensor_parallel import NATIVE

        self.backend = dist.get_backend()
        self.native = frozenset(NATIVE.get(self.backend, ()))
        # gloo has no coalescing: batch_isend_irecv would post the ops one by one anyway, after per-op checks
        # that cost more than the post itself; so post straight to the world group (its ranks are global ranks)
        self.direct = dist.get_backend() == "gloo"
        self.buffered = self.direct

    @property
    def tp_group(self):
        """The process group of this rank's tp group (None at tp 1)."""
        return None if self.tp_mesh is None else self.tp_mesh.get_group()

    def post(self, ops: Sequence[P2P]) -> list[Work]:
        if self.direct:
            world = self.world
            return [world.send([o.tensor], o.peer, 0) if o.send else world.recv([o.tensor], o.peer, 0) for o in ops]
        dist = self.dist
        with self.comm.posting():
            if len(ops) == 1:
                op = ops[0]
                fn = dist.isend if op.send else dist.irecv
                return [fn(op.tensor, op.peer)]
            return list(dist.batch_isend_irecv([dist.P2POp(dist.isend if o.send else dist.irecv, o.tensor, o.peer)
                                                for o in ops]))

    def all_reduce(self, tensor: torch.Tensor, group: tuple[int, ...], *, average: bool = False) -> Work:
        if len(group) == 1:
            return _Done()
        dist = self.dist
        op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
        if average and tensor.device.type == "cpu":
            # gloo's AVG: sum then divide, exactly as the reference averages
            work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.groups[group], async_op=True)
            return _Scaled(work, tensor, 1.0 / len(group))
        with self.comm.posting():
            return dist.all_reduce(tensor, op=op, group=self.groups[group], async_op=True)

    def tp(self, kind: str, out: torch.Tensor, tensor: torch.Tensor, group: tuple[int, ...]) -> Work:
        # issued with the compute stream current (no CommStream.posting): NCCL makes the tp group's own stream
        # wait for the compute so far and runs it there; the comm stream's sends and dp all-reduces are not in
        # its way
        return dist_issue(kind, out, tensor, self.groups[group])

    def barrier(self) -> None:
        self.dist.barrier()


class TransportTP(IssuingGroup):
    """A stage's tp group as the :class:`~pipec.tp.comm.TPGroup` its f and g call, over a
    :class:`Transport` (torch.distributed's tp process group, or the fake's threads): ``ranks`` are the group's
    global ranks in tp order, ``tp_rank`` this rank's place in it. Every collective goes through
    :meth:`Transport.tp` (the compute stream, the tp group's own process group); the layouts and the padded
    fallback are :class:`~pipec.tp.comm.IssuingGroup`'s."""

    def __init__(self, transport: "Transport", ranks: tuple[int, ...], tp_rank: int) -> None:
        super().__init__(len(ranks), tp_rank, frozenset(getattr(transport, "native", ())))
        self.transport, self.ranks, self.tp_rank = transport, ranks, tp_rank

    def issue(self, kind: str, out: torch.Tensor, tensor: torch.Tensor) -> Work:
        return self.transport.tp(kind, out, tensor, self.ranks)


class _Scaled:
    def __init__(self, work: Work, tensor: torch.Tensor, scale: float) -> None:
        self.work, self.tensor, self.scale = work, tensor, scale

    def wait(self) -> None:
        self.work.wait()
        self.tensor.mul_(self.scale)


# ----------------------------------------------------------------------------- in-process fake


class _Channel:
    """Messages from one rank to another, matched to receives in posting order."""

    def __init__(self) -> None:
        self.messages: deque[torch.Tensor] = deque()
        self.pending: deque["_FakeRecv"] = deque()


class _FakeRecv:
    def __init__(self, world: "FakeWorld", channel: _Channel, buffer: torch.Tensor, src: int, dst: int) -> None:
        self.world, self.channel, self.buffer, self.src, self.dst = world, channel, buffer, src, dst
        self.filled = False
        self.prior: Work | None = None

    def wait(self) -> None:
        if self.prior is not None:  # ordered: the comm stream's earlier work first
            self.prior.wait()
        world = self.world
        with world.cond:
            ok = world.cond.wait_for(lambda: self._fill_until_me(), timeout=world.timeout)
            if not ok:
                raise TransportTimeout(f"rank {self.dst}: receive from rank {self.src} timed out after {world.timeout} s")

    def _fill_until_me(self) -> bool:
        ch = self.channel
        while not self.filled and ch.messages and ch.pending:
            recv = ch.pending.popleft()
            msg = ch.messages.popleft()
            if msg.numel() != recv.buffer.numel() or msg.dtype != recv.buffer.dtype:
                raise RuntimeError(f"rank {recv.dst}: message from rank {recv.src} is {msg.dtype}{list(msg.shape)}, "
                                   f"the receive buffer {recv.buffer.dtype}{list(recv.buffer.shape)}")
            recv.buffer.copy_(msg.view(recv.buffer.shape))
            recv.filled = True
        return self.filled


class FakeWorld:
    """Shared state of an in-process 'world' of ranks running as threads.

    ``native``: the sequence-parallel collectives its backend has (NCCL's and gloo's by default; ``()``: a
    backend without them, where :class:`TransportTP` all-reduces the padded whole). ``ordered``: a rank's
    comm-stream work (receives, all-reduces) completes in the order posted, as on one CUDA stream; the tp
    collectives, on the compute stream, are not in that queue. :attr:`log` holds every :class:`Call`."""

    def __init__(self, world_size: int, timeout: float = 30.0, *, native: Sequence[str] = ("all_gather", "reduce_scatter"),
                 ordered: bool = False) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self.native = frozenset(native)
        self.ordered = ordered
        self.log: list[Call] = []
        self.cond = threading.Condition()
        self.channels: dict[tuple[int, int], _Channel] = {}
        self.collectives: dict[tuple, list] = {}
        self.calls: dict[tuple[int, tuple[int, ...]], int] = {}
        self.barrier_ = threading.Barrier(world_size, timeout=timeout)

    def channel(self, src: int, dst: int) -> _Channel:
        ch = self.channels.get((src, dst))
        if ch is None:
            ch = self.channels[(src, dst)] = _Channel()
        return ch

    def transport(self, rank: int) -> "FakeTransport":
        return FakeTransport(self, rank)


class _FakeCollective:
    """One rank's part in a collective: ``kind`` ``all_reduce`` (into ``tensor``, averaged with ``average``),
    ``all_gather`` or ``reduce_scatter`` (into ``tensor``, this rank's place ``index`` in the group)."""

    def __init__(self, world: FakeWorld, key: tuple, tensor: torch.Tensor, average: bool, size: int,
                 kind: str = "all_reduce", index: int = 0) -> None:
        self.world, self.key, self.tensor, self.average, self.size = world, key, tensor, average, size
        self.kind, self.index = kind, index
        self.prior: Work | None = None

    def wait(self) -> None:
        if self.prior is not None:  # ordered: the comm stream's earlier work first
            self.prior.wait()
        world = self.world
        with world.cond:
            ok = world.cond.wait_for(lambda: len(world.collectives[self.key][0]) == self.size, timeout=world.timeout)
            if not ok:
                raise TransportTimeout(f"collective {self.key} timed out after {world.timeout} s")
            parts = world.collectives[self.key][0]
            total = world.collectives[self.key][1]
            if total is None:  # in rank order of the group: every rank gets the same bits
                if self.kind == "all_gather":
                    total = torch.cat([t.reshape(-1) for _, t in sorted(parts, key=lambda p: p[0])])
                else:
                    total = torch.stack([t for _, t in sorted(parts, key=lambda p: p[0])]).sum(0)
                world.collectives[self.key][1] = total
        if self.kind == "all_gather":
            self.tensor.view(-1).copy_(total)
        elif self.kind == "reduce_scatter":
            self.tensor.copy_(total.unflatten(0, (self.size, -1))[self.index])
        else:
            self.tensor.copy_(total / self.size if self.average else total)


class FakeTransport:
    shard_mesh = None  # no DeviceMesh in-process: sharded plans run here only under emulate
    tp_mesh = tp_group = None  # likewise: a tp group's collectives go through tp() over its ranks
    buffered = True

    def __init__(self, world: FakeWorld, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.native = world.native
        self._last: Work | None = None
        """The last work posted on the comm stream (``ordered``: the next one completes after it)."""

    def _queued(self, work):
        if self.world.ordered:
            work.prior, self._last = self._last, work
        return work

    def _note(self, call: str, stream: str, tensor: torch.Tensor, group: tuple[int, ...] = ()) -> None:
        self.world.log.append(Call(self.rank, call, stream, tensor.dtype, tuple(tensor.shape), group))

    def post(self, ops: Sequence[P2P]) -> list[Work]:
        world = self.world
        works: list[Work] = []
        with world.cond:
            for op in ops:
                self._note("isend" if op.send else "irecv", "comm", op.tensor, (op.peer,))
                if op.send:
                    world.channel(self.rank, op.peer).messages.append(op.tensor.detach().clone())
                    works.append(_Done())
                else:
                    ch = world.channel(op.peer, self.rank)
                    recv = self._queued(_FakeRecv(world, ch, op.tensor, op.peer, self.rank))
                    ch.pending.append(recv)
                    works.append(recv)
            world.cond.notify_all()
        return works

    def _join(self, tensor: torch.Tensor, group: tuple[int, ...]) -> tuple:
        world = self.world
        with world.cond:
            n = world.calls.get((self.rank, group), 0)
            world.calls[(self.rank, group)] = n + 1
            key = (group, n)
            slot = world.collectives.setdefault(key, [[], None])
            slot[0].append((group.index(self.rank), tensor.detach().clone()))
            world.cond.notify_all()
        return key

    def all_reduce(self, tensor: torch.Tensor, group: tuple[int, ...], *, average: bool = False) -> Work:
        if len(group) == 1:
            return _Done()
        self._note("all_reduce", "comm", tensor, group)
        key = self._join(tensor, group)
        return self._queued(_FakeCollective(self.world, key, tensor, average, len(group)))

    def tp(self, kind: str, out: torch.Tensor, tensor: torch.Tensor, group: tuple[int, ...]) -> Work:
        assert kind in TP_KINDS and (kind == "all_reduce" or kind in self.native), (kind, self.native)
        call = {"all_reduce": "all_reduce", "all_gather": "all_gather_into_tensor",
                "reduce_scatter": "reduce_scatter_tensor"}[kind]
        self._note(call, "compute", tensor, group)
        n = len(group)
        if kind == "all_gather":
            assert out.numel() == n * tensor.numel() and out.dtype == tensor.dtype, (out.shape, tensor.shape)
        elif kind == "reduce_scatter":
            assert tensor.shape[0] == n * out.shape[0] and out.shape[1:] == tensor.shape[1:], (out.shape, tensor.shape)
        key = self._join(tensor, group)  # on the compute stream: not queued behind the comm stream's work
        return _FakeCollective(self.world, key, out, False, n, kind, group.index(self.rank))

    def barrier(self) -> None:
        self.world.barrier_.wait()
