"""The memory model: what each pp rank holds, and the ``device_memory`` refusal.

Per rank and stage, the state the runtime holds (:func:`breakdown`):

- **parameters, gradients, optimizer state**, as the runtime holds them: the
  parameters are float32 whatever ``dtype`` says (``dtype bfloat16`` runs the
  stages under autocast, or under FSDP2's mixed-precision policy, over float32
  masters), their gradients float32, and the optimizer's state float32:
  AdamW and Adam 8 bytes per parameter (two moments), SGD 4 with momentum and
  0 without (:func:`bytes_per_param`). Float32 AdamW is so 4 + 4 + 8 = 16
  bytes per parameter: the source note's mixed-precision Adam count (2 + 2 +
  12) comes to the same 16. A tied weight counts on every stage holding a copy.
- divided by tensor parallelism first: a parameter the stage's
  :class:`~pipec.compiler.ir.tensor_parallel.StageTP` shards (a :class:`ShardedParam`, matched by name against
  ``Stage.params`` / ``param_shapes``) is held as its tp rank's part, its dim ``dim`` / tp
  (:func:`local_shapes`), its gradient and optimizer state with it; a replicated one whole, on every tp rank;
- then divided as the mesh's ``shard`` divides them among a shard group of ``n``
  ranks: ``optimizer`` the optimizer state, ``grads`` and ``full`` all three.
  A shard is padded as FSDP2 pads it (dim 0 of each parameter rounded up to a
  multiple of ``n``, as DTensor's ``Shard(0)`` chunks it; ZeRO-1 is modelled
  with the same layout): FSDP2 over a tp stage shards the local (tp) tensors, so the two compose, tp first;
- **unsharded**: under ``grads`` and ``full``, the parameters gathered by an
  ``UNSHARD`` until its ``RESHARD`` and the stage's unsharded gradients from
  its first backward to its ``REDUCE_SCATTER`` (FSDP2 accumulates them
  unsharded while gradient sync is off), both in the compute dtype (2 bytes
  under ``dtype bfloat16``, FSDP2's ``param_dtype``), at the program point
  where the most are held at once (:func:`transient_bytes`);
- **collective buffers**, the flat float32 buffers the executor hands a
  collective it posts and keeps until the collective is waited for: a dp
  all-reduce's (``AR<s>:dp``: the stage's gradients, concatenated; HSDP's
  ``AR<s>:dp.replicate``: its gradient shards) and a tie all-reduce's (the
  tied weight's gradient, summed over the rank's copies), held until ``OPT``
  or a later tie all-reduce (which waits for the reductions in flight); a
  ``REDUCE_SCATTER``'s input (the stage's unsharded gradients, flattened and
  padded, FSDP2's float32 ``reduce_dtype``), from the RS, where FSDP2 copies
  the unsharded gradients in and frees them, until the reduce-scatter is
  waited for: in ``OPT``, or first by its stage's ``AR<s>:dp.replicate`` or by
  any tie all-reduce. They count at the same program points as the
  unsharded parameters and gradients.

Saved activations under tp (:func:`tp_activation_bytes`): Megatron's count (Korthikanti et al. 2022, the
per-layer formula the source note points to) for a transformer block of sequence s, microbatch b, width h and
a heads, 16-bit: ``s b h (34 + 5 a s / h)`` bytes unsharded, ``s b h (10 + 24 / t + 5 a s / (h t))`` at tp t
(:func:`megatron_block_activation_bytes`): the attention's and the MLP's inner activations divide by t, the
``10 s b h`` of the two norms' inputs, the inputs of the qkv and fc linears and the two dropout masks do not
(with sequence parallelism they do too: ``34 / t``). A stage's activations are split the same way: its
replicated part is taken as Megatron's 10 s b h per block, 2.5 x the bytes of the block's two forward
all-reduces (each ``s b h`` elements), so ``2.5 x`` its forward all-reduce bytes (at most all of them), and the
rest divides by tp. This reproduces Megatron's per-block figure for a stage of blocks whose saved bytes are
Megatron's; for another layout it assumes each forward all-reduce closes a sharded region whose replicated
inputs are 2.5 x its payload. A vocab-parallel lookup's all-reduce and the loss's (``Collective.of``) add
nothing: what the embedding's sum feeds is the first block's, in that block's count.

:func:`state_bytes` is the first item per rank (plan.json's per-rank
``state_bytes``); the simulator adds the second and third and each rank's saved
activations at its peak (per stage, bytes per microbatch times the
microbatches it holds at that moment) into the predicted Timeline's
``peak_memory_bytes``, an upper bound (each part at its own peak);
:func:`check_memory` refuses a plan whose peak on some rank exceeds
``device_memory``.

No torch (nor networkx) here: the driver runs it on every compile.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping

from pipec.compiler.ir.program import Op
from pipec.compiler.ir.plan import Mesh, Plan, Stage
from pipec.compiler.ir.tensor_parallel import in_effect
from pipec.errors import PipecError

__all__ = ["BYTES_PER_PARAM", "COMPUTE_BYTES", "MemoryBudgetError", "RankMemory", "bytes_per_param", "padded_params",
           "local_shapes", "local_params", "local_param_bytes", "tp_activation_bytes",
           "megatron_block_activation_bytes", "REPLICATED_PER_ALL_REDUCE", "tie_bytes", "stage_state", "breakdown",
           "state_bytes", "transient_bytes", "check_memory"]

BYTES_PER_PARAM = 16
"""Float32 AdamW, unsharded: 4 (weight) + 4 (grad) + 8 (two moments); the note's mixed-precision count
(2 + 2 + 12) is the same 16."""

_OPTIMIZER_STATE = {"adamw": 8, "adam": 8}
"""Optimizer state bytes per parameter (float32); SGD: 4 with momentum, else 0."""

COMPUTE_BYTES = {"bfloat16": 2, "float16": 2}
"""Bytes per element of a gathered parameter or an unsharded gradient under FSDP2's mixed precision."""


class MemoryBudgetError(PipecError):
    """A rank's predicted peak memory exceeds ``device_memory``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankMemory:
    """What one pp rank holds (bytes): the state at rest, split, and the transient peak."""

    rank: int
    params: int
    grads: int
    optimizer: int
    unsharded: int = 0
    """Parameters and gradients gathered or not yet scattered, at the program point holding the most transient
    bytes (this and :attr:`buffers`)."""
    buffers: int = 0
    """Collective buffers in flight (all-reduces' flat buffers, reduce-scatters' inputs) at that point."""
    num_params: int = 0
    """Parameter copies held (unsharded count; of a tp stage, its tp rank's part: :func:`local_params`)."""

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def transient(self) -> int:
        """What the rank holds on top of its state at its transient peak."""
        return self.unsharded + self.buffers


def bytes_per_param(spec: Mapping) -> tuple[int, int, int]:
    """(param, grad, optimizer-state) bytes per parameter for the plan's optimizer (float32 throughout)."""
    opt = spec.get("optimizer") or {}
    name = opt.get("name", "adamw") if isinstance(opt, Mapping) else "adamw"
    if name in _OPTIMIZER_STATE:
        return 4, 4, _OPTIMIZER_STATE[name]
    return 4, 4, 4 if float(opt.get("momentum", 0.0) or 0.0) > 0 else 0


def padded_params(stage: Stage, num_shards: int, tp: int) -> int:
    """The stage's parameters one of its ``tp`` ranks holds (:func:`local_params`; all of them without tp) as
    sharded over ``num_shards`` ranks hold them all together: each (local) parameter's dim 0 rounded up to a
    multiple of ``num_shards`` (without shapes: the count rounded up)."""
    n = num_shards
    if n <= 1:
        return local_params(stage, tp)
    if not stage.param_shapes:
        return -(-local_params(stage, tp) // n) * n
    if in_effect(stage.tp, tp) is None:
        return _padded_shapes(stage.param_shapes, n)
    local = _local(stage, tp)
    if n not in local.padded:
        local.padded[n] = _padded_shapes(local.shapes, n)
    return local.padded[n]


def local_shapes(stage: Stage, tp: int) -> tuple[tuple[int, ...], ...]:
    """The shape of each of the stage's parameters on one of its ``tp`` ranks: a sharded one's dim ``dim``
    divided by tp (each of its ``segments`` blocks cut in tp parts: the dim over tp in all), a replicated one
    whole; ``param_shapes`` itself without tp."""
    if in_effect(stage.tp, tp) is None or not stage.param_shapes:
        return stage.param_shapes
    return _local(stage, tp).shapes


def local_params(stage: Stage, tp: int) -> int:
    """Parameters one of the stage's ``tp`` ranks holds: the replicated ones and its part of each sharded one
    (``num_params`` without tp, or where the shapes are unknown: then nothing is taken as sharded)."""
    if in_effect(stage.tp, tp) is None or not stage.param_shapes:
        return stage.num_params or 0
    return _local(stage, tp).count


@dataclass(slots=True)
class _Local:
    """A tp stage's local shapes, their count, and their padded counts per shard size (:func:`_local`)."""

    stage: Stage
    shapes: tuple[tuple[int, ...], ...]
    count: int
    padded: dict[int, int]


_LOCALS: dict[tuple[int, int], _Local] = {}
"""(id(stage), tp) -> :class:`_Local`, holding the stage (so its id is not reused while cached): hashing a
stage's names, shapes and StageTP on every call cost ``pipec tune`` more than the rest of its memory model."""


def _local(stage: Stage, tp: int) -> _Local:
    got = _LOCALS.get((id(stage), tp))
    if got is not None and got.stage is stage:
        return got
    stp = stage.tp
    sharded = {p.name: p for p in stp.params}
    shapes = []
    for name, shape in zip(stage.params, stage.param_shapes):
        p = sharded.get(name)
        if p is None or not shape:
            shapes.append(shape)
            continue
        dim = p.dim % len(shape)
        shapes.append(tuple(-(-d // tp) if i == dim else d for i, d in enumerate(shape)))
    count = _count(shapes) + (stage.num_params or 0) - _count(stage.param_shapes)
    if len(_LOCALS) >= 16384:
        _LOCALS.clear()
    got = _LOCALS[(id(stage), tp)] = _Local(stage=stage, shapes=tuple(shapes), count=count, padded={})
    return got


def _count(shapes) -> int:
    total = 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def local_param_bytes(stage: Stage, tp: int) -> int:
    """``param_bytes`` of what one of the stage's ``tp`` ranks holds (the dp all-reduce's payload): the sharded
    parameters' bytes over tp, the replicated ones' whole."""
    full = stage.param_bytes or 0
    if in_effect(stage.tp, tp) is None or not stage.num_params:
        return full
    return round(full * local_params(stage, tp) / stage.num_params)


REPLICATED_PER_ALL_REDUCE = 2.5
"""A tp stage's saved bytes that stay whole on every tp rank, per byte of its pairs' forward all-reduces:
Megatron's ``10 s b h`` per block against its two all-reduces of ``2 s b h`` bytes (16-bit). A vocab-parallel
lookup's all-reduce and the loss's add none: what the embedding's sum feeds (the first block's norm and
residual) is in that block's count."""


def tp_activation_bytes(stage: Stage, tp: int, *, sequence_parallel: bool = False) -> int | None:
    """The stage's saved bytes per microbatch on one of its ``tp`` ranks (see the module doc):
    ``activation_bytes`` without tp; with it the replicated part (:data:`REPLICATED_PER_ALL_REDUCE` x the forward
    all-reduces' bytes, at most all) whole and the rest over tp; with sequence parallelism all of it over tp."""
    a = stage.activation_bytes
    stp = in_effect(stage.tp, tp)
    if a is None or stp is None:
        return a
    if sequence_parallel:
        return -(-a // tp)
    payload = sum(c.num_bytes for c in stp.collectives if c.phase == "forward" and c.kind == "all_reduce" and not c.of)
    replicated = min(a, round(REPLICATED_PER_ALL_REDUCE * payload))
    return replicated + -(-(a - replicated) // tp)


def megatron_block_activation_bytes(*, seq: int, batch: int, hidden: int, heads: int, tp: int = 1,
                                    sequence_parallel: bool = False) -> float:
    """Megatron's saved bytes of one transformer block (16-bit, Korthikanti et al. 2022): ``s b h (10 + 24 / t +
    5 a s / (h t))``, or ``s b h (34 / t + 5 a s / (h t))`` with sequence parallelism; ``tp 1``: ``s b h (34 + 5 a
    s / h)``."""
    sbh, t = seq * batch * hidden, tp
    replicated = 0 if sequence_parallel else 10
    return sbh * (replicated + (34 - replicated) / t + 5 * heads * seq / (hidden * t))


@lru_cache(maxsize=4096)
def _padded_shapes(shapes: tuple[tuple[int, ...], ...], n: int) -> int:
    """:func:`padded_params` of parameters of these shapes, cached (a plan's memory and its shard costs ask
    for every stage's, and ``pipec tune`` prices the same stages on many meshes)."""
    total = 0
    for shape in shapes:
        rows = shape[0] if shape else 1
        rest = 1
        for d in shape[1:]:
            rest *= d
        total += -(-rows // n) * n * rest
    return total


def stage_state(st: Stage, plan: Plan) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes one rank holds of a stage of ``plan``."""
    return _stage_state(st, plan.mesh, bytes_per_param(plan.spec))


def _stage_state(st: Stage, mesh: Mesh, per: tuple[int, int, int]) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes one rank holds of a stage, as the mesh shards them (:class:`~pipec.
    compiler.ir.plan.ShardMode`)."""
    n = mesh.num_shards
    return mesh.shard_mode.state(per, local_params(st, mesh.tp), padded_params(st, n, mesh.tp) // n)


def transient_bytes(plan: Plan) -> list[tuple[int, int]]:
    """Per pp rank: (unsharded, buffers) at the point of its program where it holds the most of both: gathered
    parameters and unsharded gradients (when the mesh shards parameters), and collective buffers in flight."""
    out = [(0, 0)] * plan.mesh.pp
    if not plan.stages:
        return out
    mesh = plan.mesh
    n = mesh.num_shards if mesh.sharded else 1
    elem = COMPUTE_BYTES.get(str(plan.spec.get("dtype", "float32")), 4)
    grad = bytes_per_param(plan.spec)[1]  # float32
    padded = {st.stage: padded_params(st, n, mesh.tp) for st in plan.stages}
    full = {s: v * elem for s, v in padded.items()}  # gathered in the compute dtype
    held_by = {  # (opcode, group kind) -> stage -> the flat buffer's bytes
        "RS": {s: v * grad for s, v in padded.items()},
        "dp": {st.stage: local_params(st, mesh.tp) * grad for st in plan.stages},
        "dp.replicate": {s: v // n * grad for s, v in padded.items()},
    }
    ties = {f"tie.{t.name}": -(-tie_bytes(plan, t) // (n if mesh.params_sharded else 1)) for t in plan.ties}
    for r, instrs in enumerate(plan.program.ranks):
        out[r] = _transient(instrs, mesh.params_sharded, full, held_by, ties)
    return out


_WATCHED = {  # params_sharded -> the opcodes that change what a rank holds (the rest leave it as is)
    False: frozenset((Op.ALLREDUCE, Op.OPTIM_STEP)),
    True: frozenset((Op.UNSHARD, Op.RESHARD, Op.BWD, Op.BWD_I, Op.BWD_W, Op.REDUCE_SCATTER, Op.ALLREDUCE,
                     Op.OPTIM_STEP)),
}


def _transient(instrs, params_sharded: bool, full: Mapping[int, int], held_by: Mapping[str, Mapping[int, int]],
               ties: Mapping[str, int]) -> tuple[int, int]:
    """(unsharded, buffers) of one rank's program at its most held (see :func:`transient_bytes`); of
    points holding the same sum, the first. Only the opcodes of :data:`_WATCHED` change what is held, so
    only they are looked at."""
    params: set[int] = set()
    grads: set[int] = set()
    scatters: dict[int, int] = {}  # stage -> its posted reduce-scatter's input bytes
    reductions: list[int] = []  # the posted all-reduces' flat buffers
    unsharded = buffers = 0
    best, best_sum = (0, 0), 0
    watched = _WATCHED[params_sharded]
    for ins in instrs:
        op = ins.op
        if op not in watched:
            continue
        s = ins.stage
        if op is Op.UNSHARD:
            if s in params:
                continue
            params.add(s)
            unsharded += full[s]
        elif op is Op.RESHARD:
            if s not in params:
                continue
            params.discard(s)
            unsharded -= full[s]
        elif op is Op.REDUCE_SCATTER:
            if s not in grads:
                continue
            scatters[s] = held_by["RS"][s]  # the unsharded grads copied in (both held here), then freed
            buffers += scatters[s]
            if unsharded + buffers > best_sum:
                best, best_sum = (unsharded, buffers), unsharded + buffers
            grads.discard(s)
            unsharded -= full[s]
        elif op is Op.ALLREDUCE:
            if ins.group in ties:  # waits for every reduction in flight (their buffers go), then posts its own
                buffers -= sum(scatters.values()) + sum(reductions)
                scatters.clear()
                reductions.clear()
                reductions.append(ties[ins.group])
            else:  # HSDP's replicate all-reduce waits for its stage's reduce-scatter first
                buffers -= scatters.pop(s, 0)
                reductions.append(held_by[ins.group][s])
            buffers += reductions[-1]
        elif op is Op.OPTIM_STEP:  # waits for everything posted: the buffers go before the optimizer step
            buffers = 0
            scatters.clear()
            reductions.clear()
        else:  # a backward: the stage's unsharded gradients from its first
            if s in grads:
                continue
            grads.add(s)
            unsharded += full[s]
        if unsharded + buffers > best_sum:
            best, best_sum = (unsharded, buffers), unsharded + buffers
    return best


def tie_bytes(plan: Plan, tie) -> int:
    """A tied weight's bytes on one tp rank: over tp where the first stage holding it shards it."""
    full = tie.num_bytes or 0
    st = plan.stages[tie.stages[0]] if plan.stages and tie.stages else None
    stp = in_effect(st.tp, plan.mesh.tp) if st is not None else None
    if stp is None:
        return full
    name = tie.params[0] if tie.params else tie.name
    return -(-full // plan.mesh.tp) if stp.sharded(name) is not None else full


def breakdown(plan: Plan) -> list[RankMemory] | None:
    """Per pp rank: params, grads, optimizer state and the unsharded peak; None if the stages' parameter
    counts are unknown (a schedule-only plan)."""
    if not plan.stages or any(st.num_params is None for st in plan.stages):
        return None
    per = bytes_per_param(plan.spec)
    sums = [[0, 0, 0, 0] for _ in range(plan.mesh.pp)]
    for st in plan.stages:
        row = sums[st.rank]
        for k, v in enumerate(_stage_state(st, plan.mesh, per)):
            row[k] += v
        row[3] += local_params(st, plan.mesh.tp)
    transient = transient_bytes(plan)
    return [RankMemory(rank=r, params=p, grads=g, optimizer=o, unsharded=transient[r][0], buffers=transient[r][1],
                       num_params=n) for r, (p, g, o, n) in enumerate(sums)]


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointMemory:
    """What one pp rank holds (bytes; its tp rank 0, the writer, where tp > 1) while a checkpoint is saved or
    loaded, as ``runtime/checkpoint.py`` does it: the local shards of what is not tensor-parallel (gradients are
    not saved), and each tensor-parallel parameter and its optimizer moments whole, on every tp rank
    (``_tp_whole``: gathered whole to save, allocated whole to load into)."""

    rank: int
    save_device: int
    """On the device during a save: the state at rest at the step boundary (no activations in flight), plus the
    tensor-parallel tensors whole and the largest one's gathered pieces."""
    save_staging: int
    """The asynchronous save's staging copy of what the rank writes, params and optimizer state (host memory)."""
    load_device: int
    """On the device during a load: the local params and optimizer state, and the tensor-parallel ones' wholes."""
    tp_whole: int = 0
    """Of the above, the tensor-parallel tensors made whole (0 at tp 1)."""


def _tp_whole_numel(plan: Plan, rank: int) -> tuple[int, int]:
    """The elements of the tensor-parallel parameters pp rank ``rank`` holds, whole, beyond its own parts, and the
    largest one's whole count (0, 0 at tp 1 or without shapes)."""
    tp = plan.mesh.tp
    extra = largest = 0
    for st in plan.stages:
        split = in_effect(st.tp, tp)
        if st.rank != rank or split is None or not st.param_shapes:
            continue
        sharded = {sp.name for sp in split.params}
        for name, shape in zip(st.params, st.param_shapes):
            if name in sharded:
                whole = math.prod(shape)
                extra += whole - whole // tp
                largest = max(largest, whole)
    return extra, largest


def checkpoint_memory(plan: Plan) -> list[CheckpointMemory] | None:
    """Per pp rank: predicted memory at checkpoint save and load (:class:`CheckpointMemory`); None if unknown."""
    rows = breakdown(plan)
    if rows is None:
        return None
    param_b, _, optim_b = bytes_per_param(plan.spec)
    out = []
    for m in rows:
        extra, largest = _tp_whole_numel(plan, m.rank)
        whole = extra * (param_b + optim_b)
        out.append(CheckpointMemory(rank=m.rank, save_device=m.state + whole + largest * param_b,
                                    save_staging=m.params + m.optimizer + whole,
                                    load_device=m.params + m.optimizer + whole, tp_whole=whole))
    return out


def state_bytes(plan: Plan) -> list[int] | None:
    """Per pp rank: params, grads and optimizer state at rest, as sharded; None if unknown."""
    rows = breakdown(plan)
    return None if rows is None else [m.state for m in rows]


def check_memory(plan: Plan, device_memory: int) -> None:
    """Raise :class:`MemoryBudgetError` (key ``device_memory``) naming the first pp rank whose predicted
    peak exceeds ``device_memory`` bytes, with what makes it up and the fixes. A plan whose prediction has
    no memory (schedule-only) passes."""
    for rt in plan.prediction.per_rank if plan.prediction else ():
        if rt.peak_memory_bytes is None or rt.peak_memory_bytes <= device_memory:
            continue
        rows = breakdown(plan)  # only to say what makes the peak up
        assert rows is not None, "a predicted peak needs the stages' parameter counts"
        m = rows[rt.rank]
        mesh = plan.mesh
        how = (f"({m.num_params:,} parameters x {sum(bytes_per_param(plan.spec))} bytes)" if not mesh.sharded else
               f"({m.num_params:,} parameters, shard {mesh.shard} over {mesh.num_shards} ranks)")
        fixes = "use more pp ranks, recompute, a schedule with fewer microbatches in flight, "
        if not mesh.params_sharded:
            fixes += "shard grads or full (with dp >= 2), "
        raise MemoryBudgetError(
            f"pp rank {rt.rank} needs {format_memory(rt.peak_memory_bytes)} at its peak but device_memory is "
            f"{format_memory(device_memory)}: parameters, gradients and optimizer state {format_memory(m.state)} {how}"
            + (f" + unsharded parameters and gradients {format_memory(m.unsharded)}" if m.unsharded else "")
            + (f" + collective buffers {format_memory(m.buffers)}" if m.buffers else "")
            + f" + activations {format_memory(rt.peak_memory_bytes - m.state - m.transient)} ({rt.peak_activations} "
            f"stage-microbatches in flight at the peak); {fixes}or a larger device_memory", key="device_memory")


def format_memory(n: float) -> str:
    """A memory figure for a message: ``1.25 GiB``; below 0.01 GiB in MiB (``3.50 MiB``), below 1 MiB in KiB
    (``12.00 KiB``), so a small figure never reads ``0.00 GiB``."""
    if abs(n) >= 0.01 * 2**30:
        return f"{n / 2**30:.2f} GiB"
    if abs(n) >= 2**20:
        return f"{n / 2**20:.2f} MiB"
    return f"{n / 2**10:.2f} KiB"
