"""Sequence parallelism (Megatron's, Korthikanti et al. 2022; key ``sequence_parallel``).

It is one more run of the dataflow analysis (:mod:`.analysis`) over the modules tensor parallelism decided
(:func:`sp_run`): a rowwise output is a :class:`~.rules.Shard` with ``seq`` set on its sequence dim (the dim of
the model input's dim-1 length, :func:`sequence_length`; its g becomes a reduce-scatter), followed by the same
rules (norms, residual adds, dropout act position by position; attention, a cumsum or a reduction along the
positions are refused, located); a replicated operand of full length there is split to this rank's positions
(all-gather backward); a colwise module's input is all-gathered in place of f (reduce-scatter backward; its
colwise Linears gather it in one :class:`~pipec.tp.comm.GatheredLinear` that saves only the part,
:func:`fused_group`), a replicated consumer's and the last stage's outputs gathered whole; other stage outputs
leave as parts and arrive so at the next stages. The replicated parameters used on the sequence shards (norm
weights, rowwise biases) get the sum over this rank's positions only: :mod:`.partial` finds them, as it finds
those broadcast over heads without sequence parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from torch.fx import GraphModule, Node

from pipec.model.tensors import FrontendError
from pipec.model.trace import Traced
from pipec.tp.rules import Lin, arg, locate, output_values, tensor_shape

if TYPE_CHECKING:
    from pipec.tp.analysis import Analysis

__all__ = ["SP_KEY", "SP", "io_names", "sequence_length", "sp_run", "fused", "fused_group"]

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

