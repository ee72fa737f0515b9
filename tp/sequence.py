"""Sequence parallelism (Megatron's, Korthikanti et al. 2022; key ``sequence_parallel``).

It is one more run of the dataflow analysis (:mod:`.analysis`) over the modules tensor parallelism decided
(:func:`sp_run`): a rowwise output is a :class:`~.rules.Shard` with ``seq`` set on its sequence dim (the dim of
the model input's dim-1 length, :func:`sequence_length`; its g becomes a reduce-scatter), followed by the same
rules (norms, residual adds, dropout act position by position; attention, a cumsum or a reduction along the
positions are refused, located); a replicated operand of full length there is split to this rank's positions
(all-gather backward); a colwise module's input is all-gathered in place of f (reduce-scatter backward; its
colwise Linears gather it in one :class:`~pipec.tp.comm.GatheredLinear` that saves only the part,
:func:`fused_group`), a replicated consumer's and the last stage's outputs gathered whole; other stage outputs
leave as parts and arrive so at the next stages. A backward walk (:func:`partial_params`) finds the replicated
parameters whose gradient is a sum over positions split across the ranks (norm weights, rowwise biases): the
runtime all-reduces them over the tp group before the optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from torch import nn
from torch.fx import GraphModule, Node
from torch.fx.passes.shape_prop import TensorMetadata

from pipec.model.stages import resolve
from pipec.model.tensors import FrontendError
from pipec.model.trace import Traced
from pipec.tp.rules import SHAPE_OF, Lin, Shard, arg, locate, op_name, output_values, tensor_shape

if TYPE_CHECKING:
    from pipec.tp.analysis import Analysis

__all__ = ["SP_KEY", "SP", "io_names", "sequence_length", "sp_run", "fused", "fused_group", "partial_params"]

SP_KEY = "sequence_parallel"


@dataclass(frozen=True, slots=True)
class SP:
    """What the sequence-parallel run of the analysis is given: the sequence length, the stage inputs that
    arrive as sequence shards (placeholder name -> dim), whether the stage's outputs go to the loss (whole)."""

    length: int
    inputs: Mapping[str, int]
    last: bool


def io_names(gm: GraphModule) -> tuple[dict[str, str], list[str]]:
    """Placeholder node name -> the stage input's name, and the output names in order (a StageModule's own,
    else the graph's node names)."""
    holders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = getattr(gm, "input_names", None) or holders
    out = next(n for n in gm.graph.nodes if n.op == "output")
    flat = output_values(out)
    outputs = getattr(gm, "output_names", None) or [getattr(a, "name", str(a)) for a in flat]
    return dict(zip(holders, inputs)), list(outputs)


def sequence_length(stage: GraphModule, traced: Traced | None) -> int:
    """The model input's dim 1 (tokens ``[B, T]``): the traced model's first input of two dims or more, else the
    stage's first such input."""
    shapes = [tuple(t.shape) for t in traced.inputs] if traced is not None and traced.inputs else \
        [tensor_shape(n) or () for n in stage.graph.nodes if n.op == "placeholder"]
    shape = next((sh for sh in shapes if len(sh) >= 2), None)
    if shape is None:
        raise FrontendError("sequence parallelism needs a model input with a sequence dim (dim 1 of tokens [B, T]), "
                            f"got inputs of shapes {[list(sh) for sh in shapes]}", key=SP_KEY,
                            hints=("sequence_parallel off",))
    return int(shape[1])


def sp_run(an: Analysis, sp: SP, where: str, traced: Traced | None) -> Analysis:
    """The analysis once more with sequence parallelism, over ``an``'s decided modules; refuses, located, where
    the sequence shard cannot be followed."""
    if sp.length % an.tp:
        raise FrontendError(f"sequence parallelism (tp {an.tp}){where}: the sequence length {sp.length} is not "
                            f"divisible by tp {an.tp}", key=SP_KEY,
                            hints=(f"use a sequence length divisible by {an.tp}, or sequence_parallel off",))
    run = an.again(sp)
    for f in run.failures:
        raise FrontendError(f"sequence parallelism (tp {an.tp}){where} cannot follow the sequence shard at "
                            f"{locate(f.node, traced)}: {f.reason}", key=SP_KEY, hints=("sequence_parallel off",))
    assert (run.active, run.rowwise, run.vocab_on) == (an.active, an.rowwise, an.vocab_on), \
        "sequence parallelism changed the sharding"
    return run


def _floating(n: Node) -> bool:
    tm = n.meta.get("tensor_meta")
    return isinstance(tm, TensorMetadata) and tm.dtype.is_floating_point


def _seq_state(st: Any) -> bool:
    return isinstance(st, Shard) and st.seq


def fused(an: Analysis, lins: Mapping[Node, Lin], n: Node) -> bool:
    """A colwise Linear on a sequence shard that gathers the sequence itself, with the other colwise Linears of
    its input (q, k, v apart; an MLP's gate and up) in one :class:`~pipec.tp.comm.GatheredLinear`: one all-gather,
    only this rank's part saved (:func:`fused_group`)."""
    lin = lins.get(n)
    return lin is not None and n in fused_group(an, lins, lin.x)


def fused_group(an: Analysis, lins: Mapping[Node, Lin], x: Node) -> tuple[Node, ...]:
    """The colwise Linears of sequence shard ``x``, in graph order, when they can run as one
    :class:`~pipec.tp.comm.GatheredLinear`: every colwise consumer is a Linear (module or functional) whose weight
    and bias are the parameters themselves. Else none: they share one all-gather, which each saves whole."""
    if "gather" not in an.gathers.get(x, ()):
        return ()
    group = tuple(m for m, other in lins.items() if other.x is x and m.name in an.active)
    ok = all(lins[m].kind == "linear" and (m.op == "call_module" or arg(m, 2, "bias") is None or lins[m].bias)
             for m in group)
    return group if ok else ()


def _sharded_state(st: Any) -> bool:
    return isinstance(st, Shard) or (isinstance(st, tuple) and any(isinstance(x, Shard) for x in st))


def partial_params(an: Analysis, canonical: Mapping[str, str], sharded: set[str], where: str,
                   traced: Traced | None) -> tuple[str, ...]:
    """The replicated parameters whose gradient is a partial sum on each tp rank: a backward walk of how each
    replicated value's gradient arrives: ``full`` (every rank the whole sum: through the loss, an f, a split's
    all-gather, a replicated consumer of a full one) or ``partial`` (a consumer computed on this rank's
    positions: a sequence shard). A parameter whose gradient is both is refused, located. A replicated operand
    of a tensor-parallel shard (rotary cos / sin) is left as tensor parallelism leaves it."""
    kinds: dict[Node, str] = {}
    by_param: dict[str, tuple[str, Node]] = {}

    def add(a: Node, k: str | None) -> None:
        if k is not None:
            kinds[a] = k if kinds.get(a, k) == k else "mixed"

    def param(name: str, k: str | None, at: Node) -> None:
        c = canonical.get(name, name)
        if k is None or c in sharded:
            return
        prev = by_param.get(c)
        by_param[c] = (k if prev is None or prev[0] == k else "mixed", at if prev is None else prev[1])

    for u in reversed(list(an.gm.graph.nodes)):
        if u.op == "output":
            for a in u.all_input_nodes:
                if not _sharded_state(an.state.get(a)):
                    add(a, "full")
            continue
        st = an.state.get(u)
        ku = "partial" if _seq_state(st) else None if _sharded_state(st) else kinds.get(u)
        lin = an.lins.get(u)
        if u.op == "call_module":
            for pname, _ in an.gm.get_submodule(str(u.target)).named_parameters(prefix=str(u.target)):
                param(pname, ku, u)
        if u.op == "get_attr" and isinstance(resolve(an.gm, str(u.target)), nn.Parameter):
            param(str(u.target), kinds.get(u), u)
        if op_name(u) in SHAPE_OF:
            continue
        for a in u.all_input_nodes:
            if _sharded_state(an.state.get(a)) or not _floating(a):
                continue  # a shard's gradient is its own; an int, a mask or a size has none
            if (a, u) in an.splits or (lin is not None and a is lin.x and u.name in an.active):
                add(a, "full")  # a split's all-gather, an f's all-reduce
            else:
                add(a, ku)
    hint = ("sequence_parallel off",)
    for n, k in kinds.items():
        if n.op == "placeholder" and k != "full" and n.meta["tensor_meta"].dtype.is_floating_point:
            raise FrontendError(f"sequence parallelism (tp {an.tp}){where}: the gradient of stage input {n.name!r} "
                                "would be a partial sum on each tp rank", key=SP_KEY, hints=hint)
    for c, (k, at) in by_param.items():
        if k == "mixed":
            raise FrontendError(f"sequence parallelism (tp {an.tp}){where}: parameter {c} is used on the sequence "
                                f"shards and replicated (at {locate(at, traced)}): its gradient would be partly a sum "
                                "over the tp ranks and partly whole", key=SP_KEY, hints=hint)
    return tuple(c for c, (k, _) in by_param.items() if k == "partial")

