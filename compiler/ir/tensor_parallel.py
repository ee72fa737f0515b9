"""What tensor parallelism does to one stage, as plan.json records it (pure: no torch).

The sharding pass (:mod:`pipec.tp.analysis`) decides, per stage, which modules
shard which dimension across the stage's ``tp`` ranks (Megatron's column / row pairs); the result is a
:class:`StageTP`, stored in plan.json under ``stages[s].tp`` and read by

- the runtime, which slices each :class:`ShardedParam` for its tp rank and runs the stage's graph
  rewritten to local sizes with the :class:`Collective`\\ s inserted;
- the cost model and the simulator, which divide the stage's sharded FLOPs by tp and price each
  collective on the ``tp`` link;
- the memory pass, which divides the sharded parameters (and their grads and optimizer state) by tp;
- ``pipec show``, which prints what was chosen.

A parameter not named in :attr:`StageTP.params` is replicated on every tp rank of the stage.

With sequence parallelism (:attr:`StageTP.sequence_parallel`) the activations between a rowwise module and the
next colwise one are cut on the sequence dimension across the tp ranks: the colwise input's all-reduce
backward becomes an all-gather forward / reduce-scatter backward, the rowwise output's all-reduce a
reduce-scatter forward / all-gather backward; a stage's outputs in :attr:`StageTP.seq_outputs` travel to the
next stage as each tp rank's part.

A replicated parameter used on a shard (:attr:`StageTP.partial_params`: a per-head norm's weight broadcast over
the split heads; with sequence parallelism the norm weights and rowwise biases used on the sequence parts) gets
a partial gradient on each tp rank, summed over the tp group once per step before the optimizer.

Vocabulary parallelism (Megatron-LM's): an embedding of token ids (style ``vocab``) holds its rows split across
the tp ranks and all-reduces its masked lookups (reduce-scatters them with sequence parallelism); an LM head
that is colwise at the last stage leaves its logits split on the vocabulary (:attr:`StageTP.loss_parallel`),
and the built-in ``cross_entropy`` is computed on the parts (three all-reduces of one value per token: the
max, the sum of exponentials, the target's logit), so no rank ever holds the whole logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["STYLES", "COLLECTIVE_KINDS", "NATIVE", "LOSS_PARALLEL_VALUES", "loss_collectives", "PHASES", "ShardedParam", "Collective",
           "StageTP", "in_effect"]

STYLES = ("colwise", "rowwise", "vocab", "replicated")
"""How a module is split: ``colwise`` (its output features), ``rowwise`` (its input features; the output is
all-reduced), ``vocab`` (an embedding's rows; the masked lookups are all-reduced), ``replicated``."""

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter")

NATIVE = {
    "nccl": {"all_gather": 1.0, "reduce_scatter": 1.0},
    "gloo": {"all_gather": 1.0, "reduce_scatter": 2.0},
}
"""Per torch.distributed backend, the sequence-parallel collectives it runs as one call
(``all_gather_into_tensor``, ``reduce_scatter_tensor``: what the runtime's tp groups call there) and the bytes
each rank moves in them, in multiples of ``(n - 1) / n x bytes`` of the whole tensor (the simulator's ring
factor): NCCL's are rings; gloo's reduce-scatter is an all-reduce and its part (torch's ProcessGroupGloo
``_reduce_scatter_base``), its all-gather a ring. A kind a backend lacks is run as an all-reduce of the
zero-padded whole (factor 2)."""

LOSS_PARALLEL_VALUES = 3
"""Float32 values per token a loss-parallel head exchanges in the forward: the max (all-gathered), the sum of
exponentials and the target's logit (all-reduced)."""


def loss_collectives(tokens: int, tp: int) -> tuple["Collective", ...]:
    """The forward collectives of the loss on the logits' parts, for ``tokens`` per microbatch: the max of each
    rank's part gathered, the sum of exponentials and the target's logit summed (float32 each)."""
    return (Collective(kind="all_gather", phase="forward", num_bytes=tokens * 4 * tp, node="loss", of="loss"),
            *(Collective(kind="all_reduce", phase="forward", num_bytes=tokens * 4, node="loss", of="loss")
              for _ in range(LOSS_PARALLEL_VALUES - 1)))
PHASES = ("forward", "backward")


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardedParam:
    """One parameter split across the tp ranks of its stage.

    The full tensor's dimension ``dim`` is ``segments`` equal blocks (3 for a fused q|k|v weight, 1 otherwise);
    each block is cut into tp equal contiguous parts, and tp rank t holds part t of every block, concatenated
    in block order."""

    name: str
    """Canonical parameter name."""
    dim: int
    segments: int = 1

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dim": self.dim, "segments": self.segments}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ShardedParam":
        return cls(name=str(d["name"]), dim=int(d["dim"]), segments=int(d.get("segments", 1)))


@dataclass(frozen=True, slots=True, kw_only=True)
class Collective:
    """One collective over the stage's tp group, per microbatch."""

    kind: str
    """One of :data:`COLLECTIVE_KINDS`."""
    phase: str
    """``forward`` or ``backward`` (the input-gradient part of the backward)."""
    num_bytes: int
    """The full (unsharded) tensor's bytes, in :attr:`dtype`: an all-reduce's payload."""
    node: str
    """The traced node it belongs to (for messages and ``pipec show``)."""
    of: str = ""
    """What it serves beyond Megatron's column / row pairs: ``vocab`` (a vocab-parallel lookup's partial sums),
    ``loss`` (the loss on the logits' parts); ``""`` for the pairs' f, g and their sequence-parallel forms."""
    dtype: str = "float32"
    """The payload's dtype as traced (under ``dtype bfloat16`` the trace runs under autocast: a Linear's output is
    bfloat16, a norm's float32). What a run moves can differ: the simulator prices that
    (:func:`~pipec.compiler.sim.tensor_parallel.wire_bytes`)."""

    def to_json(self) -> dict[str, Any]:
        out = {"kind": self.kind, "phase": self.phase, "bytes": self.num_bytes, "node": self.node}
        out |= {"of": self.of} if self.of else {}
        return out | ({"dtype": self.dtype} if self.dtype != "float32" else {})

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Collective":
        return cls(kind=str(d["kind"]), phase=str(d["phase"]), num_bytes=int(d["bytes"]), node=str(d["node"]),
                   of=str(d.get("of", "")), dtype=str(d.get("dtype", "float32")))


@dataclass(frozen=True, slots=True, kw_only=True)
class StageTP:
    """What tensor parallelism does to one stage (see the module doc). The degree is the plan's ``mesh.tp``, not
    the record's: what needs it takes it (:meth:`compute_share`, :func:`in_effect`)."""

    modules: tuple[tuple[str, str], ...] = ()
    """(module path, style) for every module the pass decided on, in graph order; style in :data:`STYLES`."""
    params: tuple[ShardedParam, ...] = ()
    collectives: tuple[Collective, ...] = ()
    sharded_flops: float = 0.0
    """The share (0..1) of the stage's forward FLOPs that runs on shards (divided by tp)."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (see the module doc); the three fields below are empty without it."""
    seq_len: int = 0
    """The sequence length the pass followed (the model input's dim 1, one microbatch)."""
    seq_inputs: tuple[tuple[str, int], ...] = ()
    """(stage input name, its sequence dim) for every input that arrives as this tp rank's part."""
    seq_outputs: tuple[tuple[str, int], ...] = ()
    """(stage output name, its sequence dim) for every output sent as this tp rank's part (never the last
    stage's: the loss sees whole outputs)."""
    partial_params: tuple[str, ...] = ()
    """Canonical names of the replicated parameters whose gradients are partial sums on each tp rank (with or
    without sequence parallelism)."""
    loss_parallel: bool = False
    """The last stage's output is its logits split on the last (class) dim across the tp ranks; the loss
    (``cross_entropy``) is computed vocab-parallel (see the module doc)."""
    costs_local: bool = False
    """The stage's cost is one tp rank's own: ``costs profile`` timed the sharded stage (its compute share and
    its optimizer's share of the parameters are in the timing; its collectives are not). Else the cost is the
    unsharded stage's, scaled by :meth:`compute_share`."""

    def sharded(self, name: str) -> ShardedParam | None:
        """The sharding of canonical parameter ``name``, or None where it is replicated."""
        return next((p for p in self.params if p.name == name), None)

    def compute_share(self, tp: int) -> float:
        """The share of the stage's compute each of its ``tp`` ranks does: the sharded part / tp plus the rest."""
        return self.sharded_flops / tp + (1.0 - self.sharded_flops)

    def collective_bytes(self, phase: str) -> int:
        return sum(c.num_bytes for c in self.collectives if c.phase == phase)

    def seq_dim(self, output: str) -> int | None:
        """The sequence dim of stage output ``output`` where it is sent as each tp rank's part, else None."""
        return next((d for name, d in self.seq_outputs if name == output), None)

    def to_json(self) -> dict[str, Any]:
        out = {"modules": [{"module": m, "style": s} for m, s in self.modules],
               "params": [p.to_json() for p in self.params],
               "collectives": [c.to_json() for c in self.collectives], "sharded_flops": self.sharded_flops}
        if self.sequence_parallel:  # written only when on: older records read as off
            out["sequence_parallel"] = {
                "seq_len": self.seq_len, "inputs": [{"name": n, "dim": d} for n, d in self.seq_inputs],
                "outputs": [{"name": n, "dim": d} for n, d in self.seq_outputs]}
        if self.partial_params:
            out["partial_params"] = list(self.partial_params)
        if self.loss_parallel:  # likewise
            out["loss_parallel"] = True
        if self.costs_local:
            out["costs_local"] = True
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "StageTP":
        """The record :meth:`to_json` writes; a ``tp`` field (records before the degree lived on the mesh alone)
        is ignored, and ``partial_params`` under ``sequence_parallel`` (records before it was found without) read."""
        sp = d.get("sequence_parallel") or {}
        return cls(modules=tuple((str(m["module"]), str(m["style"])) for m in d.get("modules", ())),
                   params=tuple(ShardedParam.from_json(p) for p in d.get("params", ())),
                   collectives=tuple(Collective.from_json(c) for c in d.get("collectives", ())),
                   sharded_flops=float(d.get("sharded_flops", 0.0)), sequence_parallel=bool(sp),
                   seq_len=int(sp.get("seq_len", 0)),
                   seq_inputs=tuple((str(x["name"]), int(x["dim"])) for x in sp.get("inputs", ())),
                   seq_outputs=tuple((str(x["name"]), int(x["dim"])) for x in sp.get("outputs", ())),
                   partial_params=tuple(str(n) for n in d.get("partial_params", sp.get("partial_params", ()))),
                   loss_parallel=bool(d.get("loss_parallel", False)), costs_local=bool(d.get("costs_local", False)))


def in_effect(record: StageTP | None, tp: int) -> StageTP | None:
    """A stage's record where tensor parallelism changes anything (a record, and ``tp`` >= 2 ranks), else None:
    the one test the memory model, the cost model and the simulator make."""
    return record if record is not None and tp > 1 else None
