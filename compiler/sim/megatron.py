"""Megatron's tensor-parallel layout of a transformer stage, derived from its parameter shapes (no trace).

For plans priced from FLOPs before any sharded trace exists (``pipec tune`` searching tp), this stands in
for the sharding pass (:mod:`pipec.tp.analysis`): :func:`megatron_tp` reads a stage's
parameters in order and finds Megatron's pairs (Shoeybi et al. 2019) by shape alone:

- a linear ``A`` of weight ``(o1, i1)`` followed (next 2-D weight) by a linear ``B`` of weight ``(o2, i2)`` that
  returns to the width it started from (``o2 == i1``) and reads what ``A`` made (``i2 == o1``: the MLP's fc and
  proj; ``3 i2 == o1``: attention's fused qkv, whose heads feed proj): ``A`` colwise (weight and bias on dim 0,
  in 3 segments for a fused qkv), ``B`` rowwise (weight on dim 1, bias replicated). Per microbatch of ``T``
  tokens: one all-reduce of ``B``'s output in the forward and one of ``A``'s input grad in the backward, each
  ``T x i1 x`` the activation dtype's bytes (Megatron's ``b s h``: 2 forward and 2 backward per block);
- with ``vocab`` (as ``tensor_parallel auto`` shards them under the built-in cross_entropy), a 2-D weight
  ``(V, h)`` left over with ``V > h`` and no bias (an embedding or an LM head, tied or not): rows on dim 0. A
  lookup (the stage reads integer inputs; style ``vocab``) all-reduces its ``T x h`` output in the forward
  (sequence parallel: reduce-scatters it, all-gathers the gradient); a head (the stage's output ends in ``V``;
  ``colwise``, the stage ``loss_parallel``) computes the loss on the logits' parts: the max all-gathered and two
  float32 all-reduces of ``T`` values in the forward (sum of exponentials, target logit), the input grad's
  ``T x h`` all-reduced in the backward (sequence parallel: the input all-gathered, its grad reduce-scattered);
- everything else (norms, position embeddings, biases of rowwise linears) replicated.

The sharded share of the forward (``sharded_flops``) is the pairs' and heads' matmul FLOPs (``2 T o i`` per
weight, plus attention's ``4 T s h`` of scores and values for a qkv pair) over the stage's traced forward FLOPs
(at most 1). A stage with nothing to shard gets None (its tp ranks would replicate it). Dimensions that tp does
not divide are not sharded.

torch-free.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from pipec.compiler.ir.plan import Stage
from pipec.compiler.ir.tensor_parallel import Collective, ShardedParam, StageTP, loss_collectives

__all__ = ["megatron_tp", "with_megatron_tp"]

_INTS = frozenset(("int64", "int32", "int16", "int8", "uint8"))


def megatron_tp(stage: Stage, *, tp: int, num_tokens: int, seq: int, elem_bytes: int,
                forward_flops: float | None = None, sequence_parallel: bool = False,
                vocab: bool = False) -> StageTP | None:
    """The stage's Megatron layout at ``tp`` (see the module doc); ``num_tokens`` per microbatch (``b s``),
    ``seq`` the sequence length, ``elem_bytes`` the activations' bytes per element, ``forward_flops`` the stage's
    traced forward FLOPs per microbatch (None: the sharded share is taken as all of it). ``sequence_parallel``:
    each pair's all-reduce becomes an all-gather before ``A`` and a reduce-scatter after ``B`` (Korthikanti et
    al.), in both directions: the same bytes, twice the latencies."""
    if tp <= 1 or not stage.param_shapes:
        return None
    names, shapes = stage.params, stage.param_shapes
    by_module: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in zip(names, shapes):
        module, _, leaf = name.rpartition(".")
        by_module.setdefault(module, {})[leaf] = shape
    weights = [(m, p["weight"]) for m, p in by_module.items() if len(p.get("weight", ())) == 2]
    params: list[ShardedParam] = []
    modules: list[tuple[str, str]] = []
    collectives: list[Collective] = []
    flops = 0.0
    used: set[str] = set()
    T = num_tokens
    k = 0
    while k + 1 < len(weights):
        (ma, (o1, i1)), (mb, (o2, i2)) = weights[k], weights[k + 1]
        segments = 1 if i2 == o1 else 3 if 3 * i2 == o1 else 0
        if segments and o2 == i1 and i2 % tp == 0 and (o1 // segments) % tp == 0:
            params.append(ShardedParam(name=f"{ma}.weight", dim=0, segments=segments))
            if "bias" in by_module[ma]:
                params.append(ShardedParam(name=f"{ma}.bias", dim=0, segments=segments))
            params.append(ShardedParam(name=f"{mb}.weight", dim=1))
            modules += [(ma, "colwise"), (mb, "rowwise")]
            payload = T * i1 * elem_bytes
            if sequence_parallel:
                collectives += [Collective(kind=kind, phase=phase, num_bytes=payload, node=m)
                                for phase in ("forward", "backward")
                                for kind, m in (("all_gather", ma), ("reduce_scatter", mb))]
            else:
                collectives += [Collective(kind="all_reduce", phase="forward", num_bytes=payload, node=mb),
                                Collective(kind="all_reduce", phase="backward", num_bytes=payload, node=ma)]
            flops += 2.0 * T * (o1 * i1 + o2 * i2) + (4.0 * T * seq * i2 if segments == 3 else 0.0)
            used.update((ma, mb))
            k += 2
            continue
        k += 1
    lookup = any(t.dtype in _INTS for t in stage.inputs)
    out_dims = {t.shape[-1] for t in stage.outputs if t.shape}
    loss_parallel = False
    for m, (v, h) in weights if vocab else ():
        if m in used or v <= h or v % tp or "bias" in by_module[m]:
            continue
        head = v in out_dims and not loss_parallel
        if not (lookup or head):
            continue
        params.append(ShardedParam(name=f"{m}.weight", dim=0))
        modules.append((m, "colwise" if head else "vocab"))
        payload = T * h * elem_bytes
        if not head:
            collectives += [Collective(kind=kind, phase=phase, num_bytes=payload, node=m, of="vocab")
                            for kind, phase in ((("reduce_scatter", "forward"), ("all_gather", "backward"))
                                                if sequence_parallel else (("all_reduce", "forward"),))]
            continue
        loss_parallel = True
        collectives += [Collective(kind=kind, phase=phase, num_bytes=payload, node=m)
                        for kind, phase in ((("all_gather", "forward"), ("reduce_scatter", "backward"))
                                            if sequence_parallel else (("all_reduce", "backward"),))]
        collectives += loss_collectives(T, tp)
        flops += 2.0 * T * v * h
    if not params:
        return None
    share = 1.0 if not forward_flops else min(1.0, flops / forward_flops)
    return StageTP(tp=tp, modules=tuple(modules), params=tuple(params), collectives=tuple(collectives),
                   sharded_flops=share, loss_parallel=loss_parallel)


def with_megatron_tp(stages: Sequence[Stage], *, tp: int, num_tokens: int, seq: int, elem_bytes: int,
                     flops: Sequence[tuple[int, int, int]] = (), sequence_parallel: bool = False,
                     vocab: bool = False) -> tuple[Stage, ...]:
    """The stages, each with its :func:`megatron_tp` (``flops``: per stage the traced forward / input-backward /
    weight-backward FLOPs, as :attr:`~pipec.compiler.ir.graph.StageGraph.flops` holds them)."""
    out = []
    for s, st in enumerate(stages):
        fwd = flops[s][0] if s < len(flops) else None
        out.append(replace(st, tp=megatron_tp(st, tp=tp, num_tokens=num_tokens, seq=seq, elem_bytes=elem_bytes,
                                              forward_flops=fwd, sequence_parallel=sequence_parallel,
                                              vocab=vocab)))
    return tuple(out)
