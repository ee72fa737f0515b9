"""The executor: one rank's program, instruction by instruction, through a dispatch table.

Each opcode has one handler (``handlers``), chosen once at construction; an
opcode without one fails when the executor is built. The program is prepared
into *units* once: a compute or collective instruction, or a group of comm
posts that go out together (one ``batch``), each with what its handler needs
resolved (peers as global ranks, signatures, groups, parameters), so the
per-instruction path only calls handlers.

Receives go out early where the transport allows it (``Transport.buffered``:
gloo and the in-process fake, not NCCL, and not under ``emulate``, whose
probe measures the plan's own posts): every receive of a step is posted, in
program order, when the step starts, into its buffer made once per plan, so a
message moves as soon as its sender posts it, and the instruction that uses it
finds it there instead of paying the handshake then. The order of posts
between any two ranks, which the verifier proves matches, is the program's
still; a receive instruction is then nothing to do, and a batch only sends.

Stage boundaries are cut: a stage's float inputs are leaves that require grad,
so every stage runs its own backward and hands the input grads on (over the
wire, or directly to a local producer stage). Every compute instruction and
every wait is timed (a monotonic clock; CUDA events on GPU), which is what the
bubble accounting reads.

Sharded data parallelism (runtime/sharding.py) adds three handlers:
``UNSHARD`` posts a stage's all-gather, and the stage's next compute waits for
it (as a receive is waited for); ``RESHARD`` frees the gathered parameters;
``REDUCE_SCATTER`` posts the reduction of the step's gradients to this rank's
shards, waited for in ``OPT`` (as an all-reduce is), or first by an
``ALLREDUCE`` over ``dp.replicate`` or a tie all-reduce, which work on the
gradient shards.

``emulate`` (seconds per cost unit) puts other entries in the tables: every
compute op sleeps for its predicted cost and every message is a one-element
placeholder, so a schedule-only plan runs and the accounting can be checked
against the prediction; comm, collectives and the optimizer step run as usual
(an ``UNSHARD`` or ``REDUCE_SCATTER`` is a one-element all-reduce over its group).

A step's state (buffers received, outputs and grads kept for their users,
posted all-gathers, pending reductions, the timed spans and waits) is one
:class:`StepState`, made fresh by :meth:`Executor.run_step`, so nothing a
step leaves behind reaches the next. Why one module of ~830 lines: every
handler reads and writes that state, and the tables that choose them are
built together in one constructor; split apart, the handlers would reach it
through every call.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence

import torch

from pipec.compiler.ir.program import DP_GROUPS, SHARD_OPS, Instruction, Op, message_edge
from pipec.compiler.ir.plan import UNIT_COST, Plan, TensorSpec, local_specs
from pipec.compiler.ir.timeline import Event
from pipec.errors import EXIT_RUN, PipecError
from pipec.runtime.clock import CudaClock, HostClock
from pipec.model.deferred import WeightGradStash, defer_weight_grads
from pipec.runtime.failures import RunError
from pipec.runtime.saved import SavedBytes
from pipec.runtime.sharding import local, local_grad
from pipec.runtime.transport import P2P, Transport
from pipec.schedules.order import gc_paused

if TYPE_CHECKING:
    from pipec.tp.rng import TPStream

__all__ = ["RunError", "PlanMismatch", "RankStep", "StepState", "Executor", "rng_snapshot", "replaying"]


Snapshot = tuple[torch.Tensor, "torch.Tensor | None", tuple[tuple["TPStream", dict[str, torch.Tensor]], ...]]
"""What :func:`rng_snapshot` keeps: the CPU generator's state, the device's (None on the CPU), and each tp
stream's with the stream."""


def rng_snapshot(device: torch.device, streams: Iterable["TPStream"] = ()) -> Snapshot:
    """The generators a stage's forward draws from on ``device``: the CPU's, and the device's own where it has one
    (CUDA: dropout draws there), as ``torch.utils.checkpoint`` keeps them for its replay; and ``streams``, the
    stage's tp stream (pipec/tp/rng.py: its random ops on shards draw there)."""
    tp = tuple((st, st.state()) for st in streams)
    if device.type == "cpu":
        return torch.get_rng_state(), None, tp
    module = torch.get_device_module(device.type)
    return torch.get_rng_state(), module.get_rng_state(device), tp


@contextlib.contextmanager
def replaying(device: torch.device, snap: Snapshot) -> Iterator[None]:
    """Within the block the generators of :func:`rng_snapshot` are as ``snap`` took them (a recomputed forward
    draws the masks its first run drew), and afterwards as they were before it: the rest of the step's draws are
    the ones a run without recompute makes."""
    cpu, dev, tp = snap
    devices = [] if dev is None else [device.index if device.index is not None else
                                      torch.get_device_module(device.type).current_device()]
    now = [(st, st.state()) for st, _ in tp]
    with torch.random.fork_rng(devices=devices, device_type=device.type if dev is not None else "cuda"):
        torch.set_rng_state(cpu)
        if dev is not None:
            torch.get_device_module(device.type).set_rng_state(dev, device)
        for st, state in tp:
            st.set_state(state)
        try:
            yield
        finally:
            for st, state in now:
                st.set_state(state)

class PlanMismatch(PipecError):
    """The model does not produce what the plan says: the plan was compiled for another model or input."""


_DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}

_SENDS = frozenset({Op.SEND_ACT, Op.SEND_GRAD})
_COMM = _SENDS | {Op.RECV_ACT, Op.RECV_GRAD}
_COST_FIELD = {Op.FWD: "fwd", Op.BWD: "bwd", Op.BWD_I: "bwd_i", Op.BWD_W: "bwd_w"}
"""Compute ops and the field of a stage's cost each one takes (what ``emulate`` sleeps)."""


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


@dataclass
class RankStep:
    """What one rank measured in one step (times in seconds from the step's start)."""

    global_rank: int
    step_time: float = 0.0
    compute: float = 0.0
    comm_wait: float = 0.0
    loss: float | None = None
    events: list[Event] = field(default_factory=list)
    peak_memory_bytes: int | None = None
    state_bytes: dict[str, int] | None = None
    """Bytes of parameters, grads and optimizer state held after the optimizer step (runtime/sharding.py)."""
    resident_bytes: int | None = None
    """On CPU, the process's peak resident size (``ru_maxrss``): all its memory, not the tensors a plan counts."""
    peak_activation_bytes: int | None = None
    """The saved activations this rank held at its peak (runtime/saved.py), measured in the executor's first
    step; None in the others and without modules (``emulate``)."""


@dataclass(slots=True, kw_only=True)
class StepState:
    """What one step's handlers read and write, made fresh by :meth:`Executor.run_step` (so nothing one step leaves
    behind reaches the next). Times are the clock's tokens, resolved into seconds after the step."""

    inputs: Sequence[Mapping[str, torch.Tensor]] | None
    """Per microbatch: the model's inputs by name (None under ``emulate``)."""
    targets: Sequence[Any] | None
    """Per microbatch: what the last stage's loss compares with."""
    result: RankStep
    """What the step measured (:meth:`Executor.finish_accounting` fills it in)."""
    outputs: dict[tuple[int, int], dict[str, torch.Tensor]] = field(default_factory=dict)
    """(stage, microbatch) -> its forward's outputs by name, kept for its sends and local consumers."""
    saved: dict[tuple[int, int], tuple] = field(default_factory=dict)
    """(stage, microbatch) -> what its backward needs: (float inputs, loss, outputs, a recompute's replay)."""
    input_grads: dict[tuple[int, int], dict[str, torch.Tensor]] = field(default_factory=dict)
    """(stage, microbatch) -> the grads w.r.t. its inputs by name, until every producer has taken its part."""
    grad_uses: dict[tuple[int, int], int] = field(default_factory=dict)
    """(stage, microbatch) -> how many producers are still to take their part of :attr:`input_grads`."""
    recvs: dict[tuple, tuple[list[torch.Tensor], list]] = field(default_factory=dict)
    """A posted receive's key -> (its buffers, its works), until the instruction that uses it."""
    sends: list[tuple[list, list[torch.Tensor]]] = field(default_factory=list)
    """Posted sends: (their works, the tensors they move), alive until ``OPT`` waits for them."""
    reductions: list[tuple] = field(default_factory=list)
    """Posted all-reduces: (work, flat buffer, parameters, is a tie), finished in ``OPT`` or by a tie all-reduce."""
    stashes: dict[tuple[int, int], WeightGradStash] = field(default_factory=dict)
    """(stage, microbatch) of a split backward -> the weight-grad work its ``BWD_W`` runs."""
    unshards: dict[int, Any] = field(default_factory=dict)
    """Stage -> its posted all-gather (``UNSHARD``), waited for by the stage's next compute."""
    scatters: dict[int, Any] = field(default_factory=dict)
    """Stage -> its posted reduce-scatter (``REDUCE_SCATTER``), waited for in ``OPT`` or by a reduction of the
    stage's gradient shards."""
    losses: list[torch.Tensor] = field(default_factory=list)
    """The last stage's loss per microbatch (summed into :attr:`RankStep.loss`)."""
    spans: list[tuple[Instruction, object, object, bool]] = field(default_factory=list)
    """(instruction, start, end, is compute): the timed work of each instruction."""
    waits: list[tuple[object, object]] = field(default_factory=list)
    """(start, end) of every wait: the step's comm wait."""
    wait_spans: list[tuple[Instruction, object, object]] = field(default_factory=list)
    """(instruction, start, end): a wait that opened an instruction (for its posts, reductions or peers)."""
    opt: tuple[Instruction, object] | None = None
    """Inside ``OPT``: the instruction and when its work (since its last wait) started."""


class Message(NamedTuple):
    """One comm post, resolved when the executor is built."""

    ins: Instruction
    send: bool
    peer: int
    """The global rank at the other end."""
    sigs: tuple[TensorSpec, ...]
    """What travels: the edge's tensors (grads: its floating-point ones)."""
    key: tuple
    """Sends: the (stage, microbatch) whose outputs or input grads go out; receives: the buffer's key."""
    buffers: tuple[torch.Tensor, ...]
    """Made once per plan: a receive's buffers, one per signature (reused every step: each (edge, microbatch) has
    its own, so no use of one step's value outlives it); ``emulate``: the one-element placeholders any post moves;
    a real send's: none (it moves the producer's tensors)."""
    ops: tuple[P2P, ...]
    """The posts of :attr:`buffers`, made with them (a real send's are made as it goes out)."""


class Reduction(NamedTuple):
    """One ``ALLREDUCE``, resolved when the executor is built."""

    ins: Instruction
    group: tuple[int, ...]
    """Global ranks."""
    params: tuple[torch.nn.Parameter, ...]
    """The local parameters reduced (none under ``emulate``, or for a stage without any: a placeholder goes)."""
    tie: bool
    """A tie group: the local copies' grads are summed and every copy gets the total (dp: averaged, in place)."""


class ShardJob(NamedTuple):
    """One ``UNSHARD``, ``RESHARD`` or ``REDUCE_SCATTER``, resolved when the executor is built."""

    ins: Instruction
    stage: int
    group: tuple[int, ...]
    """Global ranks of the shard group (what ``emulate``'s placeholder all-reduce goes over)."""


class Compute(NamedTuple):
    """A compute instruction, resolved when the executor is built."""

    ins: Instruction
    remote: tuple[tuple[int, tuple], ...]
    """The receives it uses: (the stage at the edge's other end, the receive's key), one per remote edge."""


class Sleep(NamedTuple):
    """An emulated compute instruction: the receives it uses, then its predicted cost."""

    ins: Instruction
    receives: tuple[tuple, ...]
    seconds: float


class Executor:
    """Runs one pp rank's program for one dp replica, as one of its tp ranks (``tp_rank``; 0 at tp 1): every
    message goes to the peer pp rank's rank of the same dp and tp rank."""

    def __init__(
        self,
        plan: Plan,
        *,
        pp_rank: int,
        dp_rank: int,
        tp_rank: int = 0,
        transport: Transport,
        modules: Mapping[int, torch.nn.Module] | None = None,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
        emulate: float | None = None,
        device: torch.device | str = "cpu",
        autocast_dtype: torch.dtype | None = None,
        optimizer_step: Callable[[], None] | None = None,
        fail_hook: Callable[[int, Instruction], None] | None = None,
        sharding=None,
    ) -> None:
        self.plan = plan
        self.mesh = plan.mesh
        self.pp_rank = pp_rank
        self.dp_rank = dp_rank
        self.tp_rank = tp_rank
        self.global_rank = plan.mesh.global_rank(pp_rank, dp_rank, tp_rank)
        self.transport = transport
        self.modules = dict(modules or {})
        self.streams: dict[int, tuple[TPStream, ...]] = dict.fromkeys(self.modules, ())
        """Each stage's tp stream (pipec/tp/rng.py: where its random ops on shards draw), which a recompute's
        replay sets as well."""
        if plan.mesh.tp > 1:
            from pipec.tp.rng import stream_of

            self.streams = {s: tuple(st for st in (stream_of(m),) if st is not None) for s, m in self.modules.items()}
        self.loss_fn = loss_fn
        self.emulate = emulate
        self.device = torch.device(device)
        self.autocast_dtype = autocast_dtype
        self.optimizer_step = optimizer_step
        self.sharding = sharding
        """The stages' FSDP2 driver (runtime/sharding.py ``ParamShards``) when the plan shards parameters."""
        self.instructions = plan.program.ranks[pp_rank]
        self.M = plan.num_microbatches
        self.edge_tensors: dict[tuple[int, int], tuple[TensorSpec, ...]] = {}
        self.producers: dict[int, list[int]] = {}
        self.consumers: dict[int, list[int]] = {}
        for e in plan.edges:
            self.edge_tensors[(e.src_stage, e.dst_stage)] = local_specs(plan, e.src_stage, e.tensors) or (
                TensorSpec("x", "float32", (1,)),)
            self.producers.setdefault(e.dst_stage, []).append(e.src_stage)
            self.consumers.setdefault(e.src_stage, []).append(e.dst_stage)
        here = plan.placement
        self.remote_producers = {s: [p for p in ps if here[p] != pp_rank] for s, ps in self.producers.items()}
        self.remote_consumers = {s: [c for c in cs if here[c] != pp_rank] for s, cs in self.consumers.items()}
        self.split = {ins.stage for ins in self.instructions if ins.op is Op.BWD_I and self.producers.get(ins.stage)}
        """Stages whose backward is split: input grads at ``BWD_I``, the linear layers' weight grads at ``BWD_W``. A
        stage fed only by the model's inputs sends no gradient: its ``BWD_I`` does nothing and its ``BWD_W`` is its
        whole backward, as the plan prices it (torch's rule for the zero-bubble split)."""
        self.recompute = set(plan.spec.get("recompute") or ())
        """Stages that save only their inputs and run their forward again in the backward."""
        self.clock = CudaClock(self.device) if self.device.type == "cuda" else HostClock()
        compute: dict[Op, Callable[[Any], None]] = {
            Op.FWD: self.forward, Op.BWD: self.backward, Op.BWD_I: self.backward_input,
            Op.BWD_W: self.backward_weight}
        payload: dict[Op, Callable[[Message], Sequence[torch.Tensor]]]
        if emulate is None:
            missing = [s for s, r in enumerate(here) if r == pp_rank and s not in self.modules]
            assert not missing, f"no module for stages {missing}"
            payload = {Op.SEND_ACT: self.activations_out, Op.SEND_GRAD: self.input_grads_out,
                       Op.RECV_ACT: self.buffers, Op.RECV_GRAD: self.buffers}
            prepare = dict.fromkeys(compute, self.compute_job)
            shard = {} if sharding is None else {
                Op.UNSHARD: self.unshard, Op.RESHARD: self.reshard, Op.REDUCE_SCATTER: self.reduce_scatter}
        else:
            compute = dict.fromkeys(compute, self.emulated)
            payload = dict.fromkeys(_COMM, self.placeholders)
            prepare = dict.fromkeys(compute, self.sleep)
            shard = {Op.UNSHARD: self.unshard_placeholder, Op.RESHARD: self.reshard,
                     Op.REDUCE_SCATTER: self.reduce_scatter_placeholder}
        self.handlers: dict[Op, Callable[[Any], None]] = {
            **compute, **dict.fromkeys(_COMM, self.post), Op.ALLREDUCE: self.allreduce, Op.OPTIM_STEP: self.optim_step,
            **shard}
        """One handler per opcode; each takes what :attr:`prepare` made of its instruction."""
        self.payload = payload
        """What each comm op moves: real tensors checked against the plan's signatures, or placeholders."""
        self.prepare: dict[Op, Callable[[Sequence[Instruction]], Any]] = {
            **prepare, **dict.fromkeys(_COMM, self.messages), Op.ALLREDUCE: self.reduction,
            **dict.fromkeys(SHARD_OPS, self.shard_job)}
        """Opcodes whose handler takes a value resolved once (the rest take the instruction itself)."""
        self.early = emulate is None and getattr(transport, "buffered", False)
        """Post every receive of a step when the step starts (see the module doc)."""
        self.early_receives: list[Message] = []
        """What :attr:`early` posts at a step's start, in program order."""
        self.local_ties = [self.tied_params(t.name) for t in plan.ties
                           if emulate is None and plan.tie_ranks(t.name) == (pp_rank,) and len(t.stages) > 1]
        """Tie groups held entirely by this rank: their copies' grads are summed here, without a collective."""
        self.units = self.build_units(fail_hook)
        self.state: StepState | None = None
        """The step running (or the last one run): made fresh by :meth:`run_step`."""
        self.saved: SavedBytes | None = None
        """The first step's count of the saved activations (runtime/saved.py); None in every later step."""
        self.steps_run = 0

    # ------------------------------------------------------------------ preparing the program

    def build_units(self, fail_hook: Callable[[int, Instruction], None] | None) -> list[tuple[int, Callable, Any]]:
        """The program as (index of its first instruction, handler, argument): comm posts of one batch together."""
        instrs = self.instructions
        units = []
        i, n = 0, len(instrs)
        while i < n:
            ins = instrs[i]
            j = i + 1
            if ins.op in _COMM and ins.batch is not None:
                while j < n and instrs[j].batch == ins.batch:
                    j += 1
            handler = self.handlers.get(ins.op)
            if handler is None and ins.op in SHARD_OPS:
                raise self.failed(i, f"the plan shards parameters (shard {self.mesh.shard}), but this executor has no "
                                  "FSDP2 driver; run it under torchrun (pipec run)")
            if handler is None:
                raise self.failed(i, f"no handler for opcode {ins.op}")
            prepare = self.prepare.get(ins.op)
            arg = ins if prepare is None else prepare(instrs[i:j])
            if self.early and ins.op in _COMM:  # the receives go out at the step's start; the sends stay here
                self.early_receives.extend(m for m in arg if not m.send)
                arg = tuple(m for m in arg if m.send)
                if not arg:
                    handler = _posted
            if fail_hook is not None:
                handler = _hooked(fail_hook, i, ins, handler)
            units.append((i, handler, arg))
            i = j
        return units

    def messages(self, instrs: Sequence[Instruction]) -> tuple[Message, ...]:
        out = []
        for ins in instrs:
            s, m = ins.stage, ins.microbatch
            peer = self.mesh.global_rank(ins.peer, self.dp_rank, self.tp_rank)
            if ins.op is Op.SEND_ACT:
                send, sigs, key = True, self.edge_tensors[(s, ins.to_stage)], (s, m)
            elif ins.op is Op.SEND_GRAD:
                send, sigs, key = True, self.grad_sigs((ins.to_stage, s)), (s, m)
            else:
                is_act, src, dst = message_edge(ins)
                sigs = self.edge_tensors[(src, dst)] if is_act else self.grad_sigs((src, dst))
                send, key = False, ("A" if is_act else "G", src, dst, m)
            buffers = self.message_buffers(send, sigs)
            out.append(Message(ins, send, peer, sigs, key, buffers, tuple(P2P(send, t, peer) for t in buffers)))
        return tuple(out)

    def message_buffers(self, send: bool, sigs: Sequence[TensorSpec]) -> tuple[torch.Tensor, ...]:
        """What a post moves that the executor owns, allocated here, once per plan (see :class:`Message`)."""
        if self.emulate is not None:
            return tuple(torch.zeros(1, device=self.device) for _ in sigs)
        if send:
            return ()
        return tuple(torch.empty(sig.shape, dtype=torch_dtype(sig.dtype), device=self.device) for sig in sigs)

    def reduction(self, instrs: Sequence[Instruction]) -> Reduction:
        (ins,) = instrs
        if ins.group in DP_GROUPS:  # dp; dp.replicate under HSDP (on the gradient shards)
            group = self.mesh.group_ranks(ins.group, self.global_rank)
            params = () if self.emulate is not None else tuple(self.modules[ins.stage].parameters())
            return Reduction(ins, group, params, tie=False)
        name = ins.group[4:]
        group = tuple(self.mesh.global_rank(p, self.dp_rank, self.tp_rank) for p in self.plan.tie_ranks(name))
        return Reduction(ins, group, () if self.emulate is not None else tuple(self.tied_params(name)), tie=True)

    def shard_job(self, instrs: Sequence[Instruction]) -> ShardJob:
        (ins,) = instrs
        return ShardJob(ins, ins.stage, self.mesh.group_ranks(ins.group, self.global_rank))

    def compute_job(self, instrs: Sequence[Instruction]) -> Compute:
        """A compute's receives: a forward's activations; the grads for the part of a backward that uses them (a
        split stage's ``BWD_I``, else the part that runs the whole backward)."""
        (ins,) = instrs
        grads = ins.op is Op.BWD or (ins.op is Op.BWD_I) == (ins.stage in self.split)
        return Compute(ins, self.remote(ins, ins.op is Op.FWD, ins.op is not Op.FWD and grads))

    def sleep(self, instrs: Sequence[Instruction]) -> Sleep:
        """``emulate``: a forward waits for its activations, a backward (``BWD_W`` aside) for its grads."""
        (ins,) = instrs
        remote = self.remote(ins, ins.op is Op.FWD, ins.op not in (Op.FWD, Op.BWD_W))
        cost = self.plan.stages[ins.stage].cost if self.plan.stages else UNIT_COST
        return Sleep(ins, tuple(key for _, key in remote), getattr(cost, _COST_FIELD[ins.op]) * self.emulate)

    def remote(self, ins: Instruction, acts: bool, grads: bool) -> tuple[tuple[int, tuple], ...]:
        """(the other end's stage, the receive's key) of what compute ``ins`` receives: its activations from remote
        producers (``acts``), or its grads from remote consumers (``grads``)."""
        s, m = ins.stage, ins.microbatch
        if acts:
            return tuple((p, ("A", p, s, m)) for p in self.remote_producers.get(s, ()))
        if grads:
            return tuple((c, ("G", s, c, m)) for c in self.remote_consumers.get(s, ()))
        return ()

    # ------------------------------------------------------------------ helpers

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def now(self):
        """A timestamp token: seconds on the host clock, or a recorded CUDA event (resolved at the step's end)."""
        return self.clock.mark()

    def failed(self, index: int, detail: str) -> RunError:
        """An error of instruction ``index``, named by this rank (kept apart, as data) and the instruction."""
        return RunError(f"instruction {index} ({self.instructions[index].text()}): {detail}", rank=self.global_rank,
                        where=self.mesh.where(self.global_rank))

    def located(self, index: int, err: Exception) -> RunError:
        """``err`` raised by instruction ``index``, named by rank and instruction; a pipec error keeps its exit code."""
        out = self.failed(index, str(err) if isinstance(err, PipecError) else f"{type(err).__name__}: {err}")
        out.exit_code = err.exit_code if isinstance(err, PipecError) else EXIT_RUN
        return out

    def wait(self, works: Sequence) -> None:
        t = self.clock.mark()
        for w in works:
            w.wait()
        self.state.waits.append((t, self.clock.mark()))

    def grad_sigs(self, edge: tuple[int, int]) -> tuple[TensorSpec, ...]:
        return tuple(s for s in self.edge_tensors[edge] if torch_dtype(s.dtype).is_floating_point)

    # ------------------------------------------------------------------ the step

    def run_step(self, inputs: Sequence[Mapping[str, torch.Tensor]] | None, targets: Sequence[Any] | None) -> RankStep:
        """Run this rank's program once; ``inputs``/``targets`` are per microbatch."""
        st = self.state = StepState(inputs=inputs, targets=targets, result=RankStep(self.global_rank))
        if self.steps_run == 0 and self.modules and self.emulate is None:  # the sizes are the same in every step
            self.saved = SavedBytes((local(p) for mod in self.modules.values() for p in mod.parameters()),
                                    (t for mb in inputs or () for t in mb.values() if isinstance(t, torch.Tensor)))
        self.transport.barrier()
        self.clock.start()
        index = 0
        try:
            # no cyclic collection inside a step: one stalls this rank and every rank that waits for it (it runs
            # at the first allocation after the step, where no peer waits on this rank's messages)
            with gc_paused():
                if self.early_receives:
                    self.post(self.early_receives)
                for index, handler, arg in self.units:
                    handler(arg)
        except Exception as e:  # name the rank and instruction, keep the cause
            raise self.located(index, e) from e
        self.finish_accounting(self.now())
        if st.losses:
            st.result.loss = float(sum(st.losses))
        if self.saved is not None:
            st.result.peak_activation_bytes, self.saved = self.saved.peak, None
        self.steps_run += 1
        return st.result

    # ------------------------------------------------------------------ communication

    def post(self, batch: Sequence[Message]) -> None:
        """Post a group of sends and receives together; receives are waited for by the instruction that uses them."""
        ops: list[P2P] = []
        pending: list[tuple[tuple, list[torch.Tensor], int]] = []
        keep: list[torch.Tensor] = []
        payload = self.payload
        for msg in batch:
            tensors = payload[msg.ins.op](msg)
            if msg.send:
                keep.extend(tensors)
                ops.extend(msg.ops or [P2P(True, t, msg.peer) for t in tensors])
            else:
                pending.append((msg.key, tensors, len(ops)))
                ops.extend(msg.ops)
        works = self.transport.post(ops) if ops else []
        st = self.state
        for key, tensors, first in pending:
            st.recvs[key] = (tensors, works[first:first + len(tensors)])
        if keep:  # a send's buffer lives until it completes; each work is waited once (gloo hangs on a second wait)
            st.sends.append(([w for w, op in zip(works, ops) if op.send], keep))

    def activations_out(self, msg: Message) -> list[torch.Tensor]:
        outputs = self.state.outputs[msg.key]
        return self.checked(msg, [outputs[sig.name] for sig in msg.sigs])

    def input_grads_out(self, msg: Message) -> list[torch.Tensor]:
        return self.checked(msg, self.take_input_grads(*msg.key, msg.sigs))

    @staticmethod
    def buffers(msg: Message) -> tuple[torch.Tensor, ...]:
        """A receive's own buffers (made once per plan), taken back from last step's use: a float input was made a
        leaf that requires grad and holds the grad its backward left (the next backward would add to it)."""
        for t in msg.buffers:
            if t.requires_grad:
                t.requires_grad_(False)
                t.grad = None
        return msg.buffers

    @staticmethod
    def placeholders(msg: Message) -> tuple[torch.Tensor, ...]:
        """``emulate``: one element per tensor, sent or received (made once, when the executor is built)."""
        return msg.buffers

    @staticmethod
    def checked(msg: Message, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Every tensor matches the plan's signature before it goes out (gloo aborts the receiver otherwise)."""
        for sig, t in zip(msg.sigs, tensors):
            if tuple(t.shape) != sig.shape or t.dtype != torch_dtype(sig.dtype):
                raise PlanMismatch(
                    f"tensor {sig.name!r} is {str(t.dtype)[6:]}{list(t.shape)} but the plan's signature is "
                    f"{sig.dtype}{list(sig.shape)}; recompile the plan for this model and input shape")
        return [t.detach().contiguous() for t in tensors]

    def take_input_grads(self, s: int, m: int, sigs: Sequence[TensorSpec]) -> list[torch.Tensor]:
        """The grads w.r.t. stage s's inputs of one producer edge; freed once every producer has its part."""
        st = self.state
        grads = st.input_grads[(s, m)]
        out = [grads[sig.name] for sig in sigs]
        st.grad_uses[(s, m)] -= 1
        if st.grad_uses[(s, m)] == 0:
            del st.input_grads[(s, m)], st.grad_uses[(s, m)]
        return out

    def received(self, key: tuple) -> list[torch.Tensor]:
        tensors, works = self.state.recvs.pop(key)
        self.wait(works)
        return tensors

    def gathered(self, s: int) -> None:
        """Wait for stage ``s``'s posted all-gather, if any (its parameters are usable after)."""
        work = self.state.unshards.pop(s, None)
        if work is not None:
            self.wait([work])

    def wait_inputs(self, job: Compute) -> tuple[dict[int, list[torch.Tensor]], Any]:
        """Wait for what compute ``job`` uses: its receives (by the stage at the other end) and, when its stage's
        all-gather is posted, that (the stage's parameters); returns the receives and when the work starts."""
        remote = {other: self.received(key) for other, key in job.remote}
        if self.state.unshards:
            self.gathered(job.ins.stage)
        return remote, self.now()

    # ------------------------------------------------------------------ compute

    def record(self, ins: Instruction, start, compute: bool = True) -> None:
        self.state.spans.append((ins, start, self.now(), compute))  # its event is made after the step, off the clock

    def waited(self, ins: Instruction, start):
        """Close the wait that opened instruction ``ins`` (for its posts, reductions or peers): it becomes its own
        event, a wait (:attr:`Event.wait`), so a view draws it as waiting; returns when the work starts."""
        end = self.now()
        self.state.wait_spans.append((ins, start, end))
        return end

    def finish_accounting(self, end) -> None:
        """Turn the step's timestamp tokens into seconds: events, compute time, comm wait, step time."""
        at = self.clock.resolve
        st = self.state
        step = st.result
        rank = self.global_rank
        for ins, t0, t1, compute in st.spans:
            a, b = at(t0), at(t1)
            step.events.append(Event(rank, ins, a, b))
            if compute:
                step.compute += b - a
        for ins, t0, t1 in st.wait_spans:  # already counted in comm wait (each is made of waits)
            a, b = at(t0), at(t1)
            if b > a:
                step.events.append(Event(rank, ins, a, b, True))
        step.comm_wait = sum(at(b) - at(a) for a, b in st.waits)
        step.step_time = at(end)

    def emulated(self, job: Sleep) -> None:
        """``emulate``: any compute op waits for the receives it uses, then sleeps for its predicted cost."""
        for key in job.receives:
            self.received(key)
        if self.state.unshards:
            self.gathered(job.ins.stage)
        start = self.now()
        if job.seconds > 0:  # zero compute (emulate=0: the host overhead alone) does not even yield
            time.sleep(job.seconds)
        self.record(job.ins, start)

    def forward(self, job: Compute) -> None:
        remote, start = self.wait_inputs(job)
        ins, st = job.ins, self.state
        s, m = ins.stage, ins.microbatch
        stage = self.plan.stages[s]
        values: dict[str, torch.Tensor] = {}
        for p in self.producers.get(s, ()):
            sigs = self.edge_tensors[(p, s)]
            if p in remote:
                for sig, t in zip(sigs, remote[p]):
                    values[sig.name] = t
            else:
                for sig in sigs:
                    values[sig.name] = st.outputs[(p, m)][sig.name].detach()
        grad_inputs = {}
        for name, t in values.items():
            if t.is_floating_point():
                t.requires_grad_(True)
                grad_inputs[name] = t
        args = []
        for sig in stage.inputs:
            if sig.name in values:
                args.append(values[sig.name])
            else:
                args.append(st.inputs[m][sig.name])
        if s in self.recompute:  # keep only the inputs (and the RNG states); the backward replays the forward
            rng = rng_snapshot(self.device, self.streams[s])
            with torch.no_grad():
                loss, named = self.stage_forward(s, m, args, count=True)
            st.saved[(s, m)] = (grad_inputs, None, None, (args, rng))
        else:
            loss, named = self.stage_forward(s, m, args, count=True)
            st.saved[(s, m)] = (grad_inputs, loss, named, None)
        if loss is not None:
            st.losses.append(loss.detach())
        else:
            st.outputs[(s, m)] = named
        self.record(ins, start)

    def stage_forward(self, s: int, m: int, args: list, count: bool = False) -> tuple[torch.Tensor | None, dict | None]:
        """Run stage s on microbatch m: (the loss, for the last stage) or (None, its outputs by name).

        A stage whose backward is split records its linear weight-grad work in a
        stash that ``BWD_W`` runs later. ``count``: the microbatch's forward (not a recompute's replay), whose
        saved activations the first step counts (:attr:`saved`).
        """
        counting = count and self.saved is not None
        with self.autocast(), self.saved.forward(s, m) if counting else contextlib.nullcontext():
            if s in self.split:
                stash = self.state.stashes[(s, m)] = WeightGradStash()
                with defer_weight_grads(stash):
                    out = self.modules[s](*args)
            else:
                out = self.modules[s](*args)
        outs = out if isinstance(out, tuple) else (out,)
        if counting:  # held: what it saved, its outputs, and a recomputed stage's inputs (kept for the replay)
            self.saved.hold(s, m, (*outs, *(args if s in self.recompute else ())))
        if not self.consumers.get(s):  # the last stage: the loss, mean over microbatches
            return self.loss_fn(outs[0] if len(outs) == 1 else outs, self.state.targets[m]) / self.M, None
        return None, {sig.name: t for sig, t in zip(self.plan.stages[s].outputs, outs)}

    def backward(self, job: Compute) -> None:
        remote, start = self.wait_inputs(job)
        ins, st = job.ins, self.state
        s, m = ins.stage, ins.microbatch
        grad_inputs, loss, named, replay = st.saved.pop((s, m))
        if replay is not None:  # recompute: run the forward again, now building the graph
            args, rng = replay
            with replaying(self.device, rng):
                loss, named = self.stage_forward(s, m, args)
        if loss is not None:
            tensors, grads = [loss], None
        else:
            total: dict[str, torch.Tensor] = {}
            for c in self.consumers.get(s, ()):
                sigs = self.grad_sigs((s, c))
                got = remote[c] if c in remote else self.take_input_grads(c, m, sigs)
                for sig, g in zip(sigs, got):
                    total[sig.name] = g if sig.name not in total else total[sig.name] + g
            tensors, grads = [], []
            for name, g in total.items():
                t = named[name]
                if t.requires_grad:
                    tensors.append(t)
                    grads.append(g.to(t.dtype))
        if tensors:
            torch.autograd.backward(tensors, grads)
        if self.producers.get(s):  # kept until every producer has taken its part
            st.input_grads[(s, m)] = {
                name: (t.grad if t.grad is not None else torch.zeros_like(t)) for name, t in grad_inputs.items()}
            st.grad_uses[(s, m)] = len(self.producers[s])
        st.outputs.pop((s, m), None)
        if ins.op is Op.BWD and (s, m) in st.stashes:  # a split forward with an unsplit backward
            st.stashes.pop((s, m)).run()
        if self.saved is not None and ins.op is not Op.BWD_I:  # its last backward part: what it held is free
            self.saved.release(s, m)
        self.record(ins, start)

    def backward_input(self, job: Compute) -> None:
        if job.ins.stage in self.split:
            self.backward(job)
        else:  # no input gradient to send: the whole backward waits for BWD_W
            self.record(job.ins, self.now())

    def backward_weight(self, job: Compute) -> None:
        ins = job.ins
        if ins.stage not in self.split:
            self.backward(job)
            return
        _, start = self.wait_inputs(job)  # nothing received: the stage's all-gather, if posted
        self.state.stashes.pop((ins.stage, ins.microbatch)).run()
        if self.saved is not None:
            self.saved.release(ins.stage, ins.microbatch)
        self.record(ins, start)

    # ------------------------------------------------------------------ collectives

    def allreduce(self, job: Reduction) -> None:
        """Post the all-reduce (one flat buffer, asynchronous) and go on; ``OPT`` waits for it."""
        start = self.now()
        params = job.params
        st = self.state
        if job.tie and (st.reductions or st.scatters):  # each copy's dp reduction is in before they are summed
            self.finish_scatters()
            self.finish_reductions()
            start = self.waited(job.ins, start)
        elif job.ins.stage in st.scatters:  # HSDP's replicate all-reduce of the stage's shards: once they are in
            self.finish_scatters(job.ins.stage)
            start = self.waited(job.ins, start)
        grads = [local_grad(p) for p in params]  # a sharded parameter's: its shard
        if not grads:
            flat = torch.zeros(1, device=self.device)
        elif job.tie:  # sum the local copies, reduce once, and give every copy the total
            flat = sum(grads).reshape(-1).clone()
        else:
            flat = torch.cat([g.reshape(-1) for g in grads])
        work = self.transport.all_reduce(flat, job.group, average=not job.tie)
        st.reductions.append((work, flat, params, job.tie))
        self.record(job.ins, start, compute=False)

    def tied_params(self, name: str) -> list[torch.nn.Parameter]:
        """Every local copy of a tied weight (a rank may hold several stages of one tie)."""
        tie = self.plan.tie(name)
        out = []
        for s, pname in zip(tie.stages, tie.params):
            if self.plan.placement[s] == self.pp_rank:
                out.append(dict(self.modules[s].named_parameters())[pname])  # the stage's own name for its copy
        return out

    def finish_reductions(self) -> None:
        reductions = self.state.reductions
        for work, flat, params, shared in reductions:
            self.wait([work])
            offset = 0
            for p in params:
                g = local_grad(p)
                n = g.numel()
                g.copy_(flat.view_as(g) if shared else flat[offset:offset + n].view_as(g))
                offset += n
        reductions.clear()

    def sum_local_ties(self) -> None:
        """A tie group held entirely by this rank needs no collective: its copies' grads are summed here."""
        for params in self.local_ties:
            grads = [local_grad(p) for p in params]
            total = sum(grads)
            for g in grads:
                g.copy_(total)

    # ------------------------------------------------------------------ sharded data parallelism

    def unshard(self, job: ShardJob) -> None:
        """Post the stage's all-gather; its next compute waits for it."""
        start = self.now()
        work = self.sharding.unshard(job.stage)
        if work is not None:
            self.state.unshards[job.stage] = work
        self.record(job.ins, start, compute=False)

    def reshard(self, job: ShardJob) -> None:
        """Free the stage's gathered parameters (``emulate``: nothing to free)."""
        start = self.now()
        if self.sharding is not None:
            self.sharding.reshard(job.stage)
        self.record(job.ins, start, compute=False)

    def reduce_scatter(self, job: ShardJob) -> None:
        """Post the reduction of the stage's step gradients to this rank's shards and go on, as ``ALLREDUCE`` does:
        ``OPT`` (or a reduction of those shards) waits for it, so it overlaps the backward work still to come."""
        if self.state.unshards:
            self.gathered(job.stage)
        start = self.now()
        work = self.sharding.reduce_scatter(job.stage)
        if work is not None:
            self.state.scatters[job.stage] = work
        self.record(job.ins, start, compute=False)

    def finish_scatters(self, stage: int | None = None) -> None:
        """Wait for the posted reduce-scatters (only stage ``stage``'s if given): their gradient shards are in."""
        scatters = self.state.scatters
        if stage is not None:
            self.wait([scatters.pop(stage)])
            return
        self.wait(list(scatters.values()))
        scatters.clear()

    def unshard_placeholder(self, job: ShardJob) -> None:
        """``emulate``: a one-element all-reduce over the shard group stands for the all-gather."""
        start = self.now()
        self.state.unshards[job.stage] = self.transport.all_reduce(torch.zeros(1, device=self.device), job.group)
        self.record(job.ins, start, compute=False)

    def reduce_scatter_placeholder(self, job: ShardJob) -> None:
        """``emulate``: a one-element all-reduce over the shard group stands for the reduce-scatter (posted)."""
        start = self.now()
        self.state.scatters[job.stage] = self.transport.all_reduce(torch.zeros(1, device=self.device), job.group)
        self.record(job.ins, start, compute=False)

    def optim_step(self, ins: Instruction) -> None:
        start = self.now()
        st = self.state
        if st.sends:
            self.wait([w for works, _ in st.sends for w in works])
            st.sends.clear()
        if st.scatters:
            self.finish_scatters()
        if st.reductions:
            self.finish_reductions()
        st.opt = (ins, self.waited(ins, start))
        self.sum_local_ties()
        if st.recvs or st.unshards:  # the verifier proves this cannot happen
            raise RunError(f"receives or all-gathers posted but never used: {(list(st.recvs) + list(st.unshards))[:3]}")
        if self.optimizer_step is not None:
            self.optimizer_step()
        ins, start = st.opt
        st.opt = None
        self.record(ins, start)

    def wait_in_optimizer_step(self, works: Sequence) -> None:
        """Wait, inside ``OPT``'s optimizer step, for a collective it posted (the grad norm's all-reduce over the
        pp ranks, or a shard group's): the wait is comm wait and its own ``~OPT`` event, and OPT's work is the
        spans around it, so the views draw a rank that only waits for a peer as waiting."""
        st = self.state
        assert st is not None and st.opt is not None, "a wait inside the optimizer step outside OPT"
        ins, start = st.opt
        t = self.now()
        st.spans.append((ins, start, t, True))
        for w in works:
            w.wait()
        end = self.now()
        st.waits.append((t, end))
        st.wait_spans.append((ins, t, end))
        st.opt = (ins, end)


def _posted(receives: Sequence[Message]) -> None:
    """A unit of receives only, posted when the step started (``Executor.early``): nothing is left to do."""


def _hooked(hook: Callable[[int, Instruction], None], index: int, ins: Instruction,
            handler: Callable[[Any], None]) -> Callable[[Any], None]:
    """``handler`` with ``hook(index, ins)`` called first (fault injection: only when a hook is given)."""
    def run(arg: Any) -> None:
        hook(index, ins)
        handler(arg)

    return run
