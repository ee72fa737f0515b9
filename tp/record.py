"""The record: what tensor parallelism does to a stage, as the stage's :class:`StageTP` in plan.json.

:func:`record` reads a decided analysis (:mod:`.analysis`) into the stage's
:class:`~pipec.compiler.ir.tensor_parallel.StageTP`: which modules shard what, the collectives and their
bytes, the sharded share of the FLOPs. The tie checks (:func:`tied_uses`, :func:`check_tied`): a parameter
tied across stages must be sharded alike in each, and its gradient partial (:mod:`.partial`) in all or none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from torch.fx import GraphModule, Node

from pipec.compiler.ir.tensor_parallel import Collective, ShardedParam, StageTP, loss_collectives
from pipec.model.tensors import FrontendError
from pipec.model.trace import Traced
from pipec.tp.rules import KEY, Lin, Shard, dtype_name, nbytes, prod, tensor_shape
from pipec.tp.partial import partial_params
from pipec.tp.sequence import fused, io_names

if TYPE_CHECKING:
    from pipec.tp.analysis import Analysis

__all__ = ["canonical_of", "record", "tied_uses", "check_tied"]


def canonical_of(gm: GraphModule, canonical: Mapping[str, str] | None) -> Mapping[str, str]:
    """Local parameter name -> canonical: ``canonical``, else the stage's own (a StageModule's)."""
    return canonical if canonical is not None else getattr(gm, "canonical", {})


def record(an: Analysis, lins: Mapping[Node, Lin], canonical: Mapping[str, str], *, where: str = "",
           traced: Traced | None = None, grad_inputs: Iterable[str] | None = None) -> StageTP:
    """The :class:`StageTP` of a decided analysis: each module's style, the sharded parameters, the collectives
    (with their bytes, per phase), the share of the FLOPs that is sharded, the replicated parameters whose
    gradients are partial (:mod:`.partial`; ``grad_inputs``: the stage inputs whose gradient goes back to an
    earlier stage, None: every floating one), and with sequence parallelism what arrives and leaves as parts."""
    modules: dict[str, str] = {}
    params: dict[str, ShardedParam] = {}
    collectives: list[Collective] = []
    copied: set[Node] = set()
    seq_on = an.sp is not None

    def one(kind: str, phase: str, x: Node, of: str = "") -> Collective:
        return Collective(kind=kind, phase=phase, num_bytes=nbytes(x), node=x.name, of=of, dtype=dtype_name(x))

    def pair(first: str, second: str, x: Node, of: str = "") -> list[Collective]:
        return [one(first, "forward", x, of), one(second, "backward", x, of)]

    for n, lin in lins.items():
        modules.setdefault(lin.path, an.style(n))
        if n.name in an.vocab_on:  # the lookups' partial sums: all-reduced, or reduce-scattered
            collectives += (pair("reduce_scatter", "all_gather", n, "vocab") if seq_on else
                            [one("all_reduce", "forward", n, "vocab")])
        if n.name in an.active and lin.x not in copied:
            copied.add(lin.x)
            if "gather" in an.gathers.get(lin.x, ()):
                collectives += pair("all_gather", "reduce_scatter", lin.x)
                if fused(an, lins, n):  # the sequence gathered again for the weight's gradient
                    collectives.append(one("all_gather", "backward", lin.x))
            else:
                collectives.append(one("all_reduce", "backward", lin.x))
        if n.name in an.rowwise:
            collectives += pair("reduce_scatter", "all_gather", n) if seq_on else [one("all_reduce", "forward", n)]
    for x, how in an.gathers.items():
        if "gather_whole" in how:  # before a replicated consumer: the backward keeps this rank's part
            collectives.append(one("all_gather", "forward", x))
    for a in dict.fromkeys(a for a, _ in an.splits):  # a replicated value cut: all-gathered backward
        collectives.append(one("all_gather", "backward", a))
    if an.loss_out:  # the loss on the logits' parts: the max (gathered), the sum of exponentials, the target's
        out = next(n for n in an.gm.graph.nodes if n.op == "output")
        tokens = prod(tensor_shape(out.all_input_nodes[0])[:-1])
        collectives += loss_collectives(tokens, an.tp)
    for name, by in an.param_uses(canonical).items():
        sp = next(iter(by))
        if sp is not None:
            params[name] = sp
    total = sharded = 0.0
    counted = any("pipec_flops" in n.meta for n in an.gm.graph.nodes)
    for n in an.gm.graph.nodes:
        flops = float(n.meta.get("pipec_flops") or 0.0)
        if not counted and n in lins and lins[n].kind != "embedding":  # not annotated: 2 M N K of the matmuls
            flops = 2.0 * prod(tensor_shape(n)) * tensor_shape(lins[n].x)[-1]
        total += flops
        touched = isinstance(an.state.get(n), Shard) or any(isinstance(an.state.get(a), Shard) for a in n.all_input_nodes)
        if touched or n.name in an.active:
            sharded += flops
    extra: dict[str, Any] = {}
    if seq_on:
        names, outputs = io_names(an.gm)
        holders = {n.name: n for n in an.gm.graph.nodes if n.op == "placeholder"}
        extra = dict(sequence_parallel=True, seq_len=an.sp.length,
                     seq_inputs=tuple((names[h], d) for h, d in an.sp.inputs.items() if h in holders),
                     seq_outputs=tuple((outputs[i], d) for i, d in sorted(an.seq_outputs.items())))
    return StageTP(modules=tuple(modules.items()), params=tuple(params.values()),
                   collectives=tuple(collectives), sharded_flops=sharded / total if total else 0.0,
                   loss_parallel=an.loss_out,
                   partial_params=partial_params(an, canonical, set(params), where, traced, grad_inputs), **extra)



def tied_uses(stages: Sequence[GraphModule], plans: Sequence[StageTP], canonical: Mapping[str, str] | None,
              of: Callable[[StageTP, str], Any] = StageTP.sharded) -> dict[str, dict[int, Any]]:
    """Canonical parameter -> stage -> ``of(plan, name)``: by default how that stage shards it (None: replicated)."""
    held: dict[str, dict[int, Any]] = {}
    for s, (st, plan) in enumerate(zip(stages, plans)):
        names = canonical_of(st, canonical)
        for local, _ in st.named_parameters(remove_duplicate=False):
            held.setdefault(names.get(local, local), {})[s] = of(plan, names.get(local, local))
    return held


def check_tied(stages: Sequence[GraphModule], plans: Sequence[StageTP], tp: int,
               canonical: Mapping[str, str] | None, held: Mapping[str, Mapping[int, ShardedParam | None]]) -> None:
    """A tied parameter's copies sharded alike, and its gradient partial in all or none."""
    partial = tied_uses(stages, plans, canonical, lambda plan, c: c in plan.partial_params)
    checks = (
        (partial, lambda p: "partial" if p else "whole", KEY, "replicate the modules that use it with tensor_parallel "
         "patterns, or cut the partition so that one stage holds them",
         lambda c, how: f"tensor parallelism (tp {tp}): tied parameter {c}'s gradient is a partial sum over the "
                        f"tp ranks in some stages and whole in others ({how})"),
        (held, lambda sp: "replicated" if sp is None else f"dim {sp.dim}", KEY,
         "make the tied modules' styles agree in the patterns, or leave them replicated",
         lambda c, how: f"tensor parallelism (tp {tp}): tied parameter {c} is sharded differently in the stages that "
                        f"hold it ({how}); its copies must be sharded alike"))
    for uses, said, key, hint, message in checks:
        for c, by in uses.items():
            if len(set(by.values())) > 1:
                how = ", ".join(f"stage {s}: {said(v)}" for s, v in by.items())
                raise FrontendError(message(c, how), key=key, hints=(hint,))
