"""The executor: one rank's program, instruction by instruction, through a dispatch table.

Each opcode has one handler (``HANDLERS``); an unknown opcode fails loudly.
Stage boundaries are cut: a stage's float inputs are leaves that require grad,
so every stage runs its own backward and hands the input grads on (over the
wire, or directly to a local producer stage). Every compute instruction and
every wait is timed (a monotonic clock; CUDA events on GPU would slot in
here), which is what the bubble accounting reads.

``emulate`` (seconds per cost unit) replaces every compute with a sleep of its
predicted cost and sends one-element tensors, so a schedule-only plan runs
and the accounting can be checked against the prediction.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from pipec.compiler.ir import Instruction, Op, message_edge
from pipec.compiler.plan import Plan, Signature
from pipec.compiler.simulate import chain_edges, group_members
from pipec.compiler.timeline import Event
from pipec.runtime.deferred import WeightGradStash, defer_weight_grads
from pipec.runtime.transport import P2P, Transport
from pipec.errors import RunFailed

__all__ = ["RunError", "RankStep", "Executor"]


class RunError(RunFailed):
    """A failure during execution, named by global rank, (pp, dp) and instruction."""


_DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}


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


class Executor:
    """Runs one pp rank's program for one dp replica."""

    def __init__(
        self,
        plan: Plan,
        *,
        pp_rank: int,
        dp_rank: int,
        transport: Transport,
        modules: Mapping[int, torch.nn.Module] | None = None,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
        emulate: float | None = None,
        device: torch.device | str = "cpu",
        autocast_dtype: torch.dtype | None = None,
        optimizer_step: Callable[[], None] | None = None,
        grad_clip: Callable[[], None] | None = None,
        fail_hook: Callable[[int, Instruction], None] | None = None,
    ) -> None:
        self.plan = plan
        self.pp_rank = pp_rank
        self.dp_rank = dp_rank
        self.D = plan.mesh.dp
        self.global_rank = pp_rank * self.D + dp_rank
        self.transport = transport
        self.modules = dict(modules or {})
        self.loss_fn = loss_fn
        self.emulate = emulate
        self.device = torch.device(device)
        self.autocast_dtype = autocast_dtype
        self.optimizer_step = optimizer_step
        self.fail_hook = fail_hook
        self.instructions = plan.program.ranks[pp_rank]
        self.M = plan.num_microbatches
        edges = plan.edges or chain_edges(plan.num_stages)
        self.edge_tensors: dict[tuple[int, int], tuple[Signature, ...]] = {}
        self.producers: dict[int, list[int]] = {}
        self.consumers: dict[int, list[int]] = {}
        for e in edges:
            sigs = e.tensors or (Signature("x", (1,), "float32"),)
            self.edge_tensors[(e.src_stage, e.dst_stage)] = sigs
            self.producers.setdefault(e.dst_stage, []).append(e.src_stage)
            self.consumers.setdefault(e.src_stage, []).append(e.dst_stage)
        self.split = {ins.stage for ins in self.instructions if ins.op is Op.BWD_I}
        self.recompute = set(plan.spec.get("recompute") or ())
        """Stages that save only their inputs and run their forward again in the backward."""
        if emulate is None:
            missing = [s for s, r in enumerate(plan.placement) if r == pp_rank and s not in self.modules]
            assert not missing, f"no module for stages {missing}"
        self.clock = CudaClock(self.device) if self.device.type == "cuda" else HostClock()
        self.handlers: dict[Op, Callable[[Instruction], None]] = {
            Op.FWD: self.forward,
            Op.BWD: self.backward,
            Op.BWD_I: self.backward,
            Op.BWD_W: self.backward_weight,
            Op.ALLREDUCE: self.allreduce,
            Op.OPTIM_STEP: self.optim_step,
        }

    # ------------------------------------------------------------------ helpers

    def autocast(self):
        if self.autocast_dtype is None:
            return _null()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def peer_global(self, pp: int) -> int:
        return pp * self.D + self.dp_rank

    def now(self):
        """A timestamp token: seconds on the host clock, or a recorded CUDA event (resolved at the step's end)."""
        return self.clock.mark()

    def where(self, index: int, ins: Instruction) -> str:
        return (f"global rank {self.global_rank} (pp {self.pp_rank}, dp {self.dp_rank}), "
                f"instruction {index} ({ins.text()})")

    def wait(self, works: Sequence) -> None:
        t = self.clock.mark()
        for w in works:
            w.wait()
        self.waits.append((t, self.clock.mark()))

    def grad_sigs(self, edge: tuple[int, int]) -> list[Signature]:
        return [s for s in self.edge_tensors[edge] if torch_dtype(s.dtype).is_floating_point]

    # ------------------------------------------------------------------ the step

    def run_step(self, inputs: Sequence[Mapping[str, torch.Tensor]] | None, targets: Sequence[Any] | None) -> RankStep:
        """Run this rank's program once; ``inputs``/``targets`` are per microbatch."""
        self.mb_inputs = inputs
        self.mb_targets = targets
        self.outputs: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.saved: dict[tuple[int, int], tuple] = {}
        self.input_grads: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.grad_uses: dict[tuple[int, int], int] = {}
        self.recvs: dict[tuple, tuple[list[torch.Tensor], list]] = {}
        self.sends: list[tuple[list, list[torch.Tensor]]] = []
        self.reductions: list[tuple] = []
        self.stashes: dict[tuple[int, int], WeightGradStash] = {}
        self.losses: list[torch.Tensor] = []
        self.step = RankStep(self.global_rank)
        self.transport.barrier()
        self.clock.start()
        self.spans: list[tuple[Instruction, object, object, bool]] = []  # (instruction, start, end, is compute)
        self.waits: list[tuple[object, object]] = []
        self.optimizer_spans: list[tuple[object, object]] = []
        instrs = self.instructions
        i = 0
        n = len(instrs)
        while i < n:
            ins = instrs[i]
            if self.fail_hook is not None:
                self.fail_hook(i, ins)
            self.index = i
            try:
                if ins.op in (Op.SEND_ACT, Op.RECV_ACT, Op.SEND_GRAD, Op.RECV_GRAD):
                    j = i + 1
                    if ins.batch is not None:
                        while j < n and instrs[j].batch == ins.batch:
                            j += 1
                    self.post(instrs[i:j])
                    i = j
                    continue
                handler = self.handlers.get(ins.op)
                if handler is None:
                    raise RunError(f"{self.where(i, ins)}: no handler for opcode {ins.op}")
                handler(ins)
            except RunError:
                raise
            except Exception as e:  # name the rank and instruction, keep the cause
                raise RunError(f"{self.where(i, ins)}: {type(e).__name__}: {e}") from e
            i += 1
        self.finish_accounting(self.now())
        if self.losses:
            self.step.loss = float(sum(self.losses))
        return self.step

    # ------------------------------------------------------------------ communication

    def post(self, instrs: Sequence[Instruction]) -> None:
        ops: list[P2P] = []
        pending: list[tuple[tuple, list[torch.Tensor], int]] = []
        keep: list[torch.Tensor] = []
        for ins in instrs:
            peer = self.peer_global(ins.peer)
            s, m = ins.stage, ins.microbatch
            if ins.op is Op.SEND_ACT:
                sigs = self.edge_tensors[(s, ins.to_stage)]
                tensors = [self.outputs[(s, m)][sig.name] for sig in sigs] if self.emulate is None else [
                    torch.zeros(1) for _ in sigs]
                self.check(sigs, tensors, ins)
                tensors = [t.detach().contiguous() for t in tensors]
            elif ins.op is Op.SEND_GRAD:
                sigs = self.grad_sigs((ins.to_stage, s))
                tensors = self.take_input_grads(s, m, sigs) if self.emulate is None else [
                    torch.zeros(1) for _ in sigs]
                self.check(sigs, tensors, ins)
                tensors = [t.detach().contiguous() for t in tensors]
            else:
                is_act, src, dst = message_edge(ins)
                sigs = self.edge_tensors[(src, dst)] if is_act else self.grad_sigs((src, dst))
                tensors = [self.empty(sig) for sig in sigs]
                pending.append((("A" if is_act else "G", src, dst, m), tensors, len(ops)))
            for t in tensors:
                ops.append(P2P(ins.op in (Op.SEND_ACT, Op.SEND_GRAD), t, peer))
            if ins.op in (Op.SEND_ACT, Op.SEND_GRAD):
                keep.extend(tensors)
        works = self.transport.post(ops) if ops else []
        for key, tensors, first in pending:
            self.recvs[key] = (tensors, works[first:first + len(tensors)])
        if keep:  # a send's buffer lives until it completes; each work is waited once (gloo hangs on a second wait)
            self.sends.append(([w for w, op in zip(works, ops) if op.send], keep))

    def empty(self, sig: Signature) -> torch.Tensor:
        if self.emulate is not None:
            return torch.empty(1)
        return torch.empty(sig.shape, dtype=torch_dtype(sig.dtype), device=self.device)

    def check(self, sigs: Sequence[Signature], tensors: Sequence[torch.Tensor], ins: Instruction) -> None:
        """Every tensor matches the plan's signature before it goes out (gloo aborts the receiver otherwise)."""
        if self.emulate is not None:
            return
        for sig, t in zip(sigs, tensors):
            if tuple(t.shape) != sig.shape or t.dtype != torch_dtype(sig.dtype):
                raise RunError(
                    f"{self.where(self.index, ins)}: tensor {sig.name!r} is {str(t.dtype)[6:]}{list(t.shape)} but "
                    f"the plan's signature is {sig.dtype}{list(sig.shape)}; recompile the plan for this model and "
                    "input shape")

    def take_input_grads(self, s: int, m: int, sigs: Sequence[Signature]) -> list[torch.Tensor]:
        """The grads w.r.t. stage s's inputs of one producer edge; freed once every producer has its part."""
        grads = self.input_grads[(s, m)]
        out = [grads[sig.name] for sig in sigs]
        self.grad_uses[(s, m)] -= 1
        if self.grad_uses[(s, m)] == 0:
            del self.input_grads[(s, m)], self.grad_uses[(s, m)]
        return out

    def received(self, key: tuple) -> list[torch.Tensor]:
        tensors, works = self.recvs.pop(key)
        self.wait(works)
        return tensors

    # ------------------------------------------------------------------ compute

    def record(self, ins: Instruction, start, compute: bool = True) -> None:
        self.spans.append((ins, start, self.now(), compute))  # its text is made after the step, off the clock

    def finish_accounting(self, end) -> None:
        """Turn the step's timestamp tokens into seconds: events, compute time, comm wait, step time."""
        at = self.clock.resolve
        step = self.step
        for ins, t0, t1, compute in self.spans:
            a, b = at(t0), at(t1)
            step.events.append(Event(self.global_rank, ins.text(), a, b))
            if compute:
                step.compute += b - a
        # the optimizer step inside OPT is compute; the rest of OPT (send drains, reductions) is comm wait
        step.compute += sum(at(b) - at(a) for a, b in self.optimizer_spans)
        step.comm_wait = sum(at(b) - at(a) for a, b in self.waits)
        step.step_time = at(end)

    def forward(self, ins: Instruction) -> None:
        s, m = ins.stage, ins.microbatch
        remote = {p: self.received(("A", p, s, m)) for p in self.producers.get(s, ()) if self.plan.placement[p] != self.pp_rank}
        start = self.now()
        if self.emulate is not None:
            time.sleep(self.plan.stages[s].cost.fwd * self.emulate if self.plan.stages else self.emulate)
            self.outputs[(s, m)] = {}
            return self.record(ins, start)
        stage = self.plan.stages[s]
        values: dict[str, torch.Tensor] = {}
        for p in self.producers.get(s, ()):
            sigs = self.edge_tensors[(p, s)]
            if p in remote:
                for sig, t in zip(sigs, remote[p]):
                    values[sig.name] = t
            else:
                for sig in sigs:
                    values[sig.name] = self.outputs[(p, m)][sig.name].detach()
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
                args.append(self.mb_inputs[m][sig.name])
        if s in self.recompute:  # keep only the inputs (and the RNG state); the backward replays the forward
            rng = torch.get_rng_state()
            with torch.no_grad():
                loss, named = self.stage_forward(s, m, args)
            self.saved[(s, m)] = (grad_inputs, None, None, (args, rng))
        else:
            loss, named = self.stage_forward(s, m, args)
            self.saved[(s, m)] = (grad_inputs, loss, named, None)
        if loss is not None:
            self.losses.append(loss.detach())
        else:
            self.outputs[(s, m)] = named
        self.record(ins, start)

    def stage_forward(self, s: int, m: int, args: list) -> tuple[torch.Tensor | None, dict | None]:
        """Run stage s on microbatch m: (the loss, for the last stage) or (None, its outputs by name).

        A stage whose backward is split records its linear weight-grad work in a
        stash that ``BWD_W`` runs later.
        """
        with self.autocast():
            if s in self.split:
                stash = self.stashes[(s, m)] = WeightGradStash()
                with defer_weight_grads(stash):
                    out = self.modules[s](*args)
            else:
                out = self.modules[s](*args)
        outs = out if isinstance(out, tuple) else (out,)
        if not self.consumers.get(s):  # the last stage: the loss, mean over microbatches
            return self.loss_fn(outs[0] if len(outs) == 1 else outs, self.mb_targets[m]) / self.M, None
        return None, {sig.name: t for sig, t in zip(self.plan.stages[s].outputs, outs)}

    def backward(self, ins: Instruction) -> None:
        s, m = ins.stage, ins.microbatch
        remote = {c: self.received(("G", s, c, m)) for c in self.consumers.get(s, ()) if self.plan.placement[c] != self.pp_rank}
        start = self.now()
        if self.emulate is not None:
            cost = self.plan.stages[s].cost if self.plan.stages else None
            units = (cost.bwd if ins.op is Op.BWD else cost.bwd_i) if cost else (2 if ins.op is Op.BWD else 1)
            time.sleep(units * self.emulate)
            return self.record(ins, start)
        grad_inputs, loss, named, replay = self.saved.pop((s, m))
        if replay is not None:  # recompute: run the forward again, now building the graph
            args, rng = replay
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(rng)
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
            self.input_grads[(s, m)] = {
                name: (t.grad if t.grad is not None else torch.zeros_like(t)) for name, t in grad_inputs.items()}
            self.grad_uses[(s, m)] = len(self.producers[s])
        self.outputs.pop((s, m), None)
        if ins.op is Op.BWD and (s, m) in self.stashes:  # a split forward with an unsplit backward
            self.stashes.pop((s, m)).run()
        self.record(ins, start)

    def backward_weight(self, ins: Instruction) -> None:
        start = self.now()
        if self.emulate is not None:
            cost = self.plan.stages[ins.stage].cost.bwd_w if self.plan.stages else 1
            time.sleep(cost * self.emulate)
        else:
            self.stashes.pop((ins.stage, ins.microbatch)).run()
        self.record(ins, start)

    # ------------------------------------------------------------------ collectives

    def allreduce(self, ins: Instruction) -> None:
        start = self.now()
        if ins.group == "dp":
            group = tuple(self.pp_rank * self.D + d for d in range(self.D))
            params = [] if self.emulate is not None else list(self.modules[ins.stage].parameters())
            average = True
        else:
            members = group_members(ins.group, self.pp_rank, self.plan.mesh.pp, self.plan.ties, self.plan.placement)
            group = tuple(self.peer_global(p) for p in members)
            self.finish_reductions()  # the dp average of each copy must be in before the copies are summed
            params = [] if self.emulate is not None else self.tied_params(ins.group[4:])
            average = False
        if not params:
            buf = torch.zeros(1)
            work = self.transport.all_reduce(buf, group, average=average)
            self.reductions.append((work, buf, []))
        elif ins.group == "dp":
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
            work = self.transport.all_reduce(flat, group, average=average)
            self.reductions.append((work, flat, params))
        else:  # sum the local copies, reduce once, and give every copy the total
            flat = sum((p.grad if p.grad is not None else torch.zeros_like(p)) for p in params).reshape(-1).clone()
            work = self.transport.all_reduce(flat, group, average=average)
            self.reductions.append((work, flat, params, "shared"))
        self.record(ins, start, compute=False)

    def tied_params(self, name: str) -> list[torch.nn.Parameter]:
        """Every local copy of a tied weight (a rank may hold several stages of one tie)."""
        tie = next(t for t in self.plan.ties if t.name == name)
        out = []
        for s, pname in zip(tie.stages, tie.params):
            if self.plan.placement[s] == self.pp_rank:
                out.append(dict(self.modules[s].named_parameters())[pname])  # the stage's own name for its copy
        return out

    def finish_reductions(self) -> None:
        for work, flat, params, *shared in self.reductions:
            self.wait([work])
            offset = 0
            for p in params:
                n = p.numel()
                g = flat.view_as(p) if shared else flat[offset:offset + n].view_as(p)
                offset += n
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
        self.reductions.clear()

    def sum_local_ties(self) -> None:
        """A tie group held entirely by this rank needs no collective: its copies' grads are summed here."""
        for tie in self.plan.ties:
            ranks = {self.plan.placement[s] for s in tie.stages}
            if ranks == {self.pp_rank} and len(tie.stages) > 1:
                params = self.tied_params(tie.name)
                total = sum(p.grad if p.grad is not None else torch.zeros_like(p) for p in params)
                for p in params:
                    p.grad = total.clone()

    def optim_step(self, ins: Instruction) -> None:
        start = self.now()
        self.wait([w for works, _ in self.sends for w in works])
        self.sends.clear()
        self.finish_reductions()
        if self.emulate is None:
            self.sum_local_ties()
        leftover = [k for k in self.recvs]
        if leftover:
            raise RunError(f"{self.where(self.index, ins)}: receives posted but never used: {leftover[:3]}")
        stepped = self.now()
        if self.optimizer_step is not None:
            self.optimizer_step()
        self.record(ins, start, compute=False)
        self.optimizer_spans.append((stepped, self.now()))


class HostClock:
    """Timestamps on the host's monotonic clock, in seconds from the step's start."""

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def mark(self) -> float:
        return time.perf_counter() - self.t0

    def resolve(self, token: float) -> float:
        return token


class CudaClock:
    """Timestamps as CUDA events on the current stream: GPU time, resolved after one synchronize.

    A compute instruction's span is what the GPU spent on it, and a wait's span
    (events recorded before and after ``work.wait()``, which makes the stream
    wait for the collective) is the time the stream stalled on communication.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self) -> None:
        self.t0 = self.mark()
        self.synced = False

    def mark(self):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def resolve(self, token) -> float:
        if not self.synced:
            torch.cuda.synchronize(self.device)
            self.synced = True
        return self.t0.elapsed_time(token) / 1e3


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
