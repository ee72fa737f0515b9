"""Partial gradients: the replicated values whose gradient is, on each tp rank, only that rank's share of a sum.

A replicated operand of an op computed on a shard gets, on each tp rank, the gradient of that rank's part
only: a per-head norm's weight (Qwen3's ``q_norm`` / ``k_norm``) broadcast over heads split across the ranks
gets the sum over this rank's heads; under sequence parallelism a norm's weight or a rowwise bias used on a
sequence shard gets the sum over this rank's positions. :func:`partial_params` finds them by a backward walk
over the decided analysis (with or without sequence parallelism); the runtime all-reduces their gradients over
the tp group once per step, before ``--check``, the clip and the optimizer (Megatron's ``finalize_model_grads``
does the same for its q/k layernorm). That all-reduce is not among the record's collectives, which are per
microbatch and priced beside each compute: it is once per step and of a norm's weights (a few KiB). A partial gradient that would flow anywhere else (into a stage input whose gradient goes back to
an earlier stage, or into the sharded region through a g) is refused, located, as is a parameter used both so
and whole (its gradient would be partly a sum over the ranks and partly whole).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping

from torch import nn
from torch.fx import GraphModule, Node
from torch.fx.passes.shape_prop import TensorMetadata

from pipec.model.stages import resolve
from pipec.model.tensors import FrontendError
from pipec.model.trace import Traced
from pipec.tp.rules import KEY, SHAPE_OF, Shard, locate, op_name, output_values

if TYPE_CHECKING:
    from pipec.tp.analysis import Analysis

__all__ = ["partial_params", "grad_outputs"]


def _floating(n: Node) -> bool:
    tm = n.meta.get("tensor_meta")
    return isinstance(tm, TensorMetadata) and tm.dtype.is_floating_point


def _sharded_state(st: Any) -> bool:
    return isinstance(st, Shard) or (isinstance(st, tuple) and any(isinstance(x, Shard) for x in st))


def _owns_params(gm: GraphModule, n: Node) -> bool:
    if n.op == "get_attr":
        return isinstance(resolve(gm, str(n.target)), nn.Parameter)
    return n.op == "call_module" and any(True for _ in gm.get_submodule(str(n.target)).parameters())


def _carrying(gm: GraphModule, grad_inputs: Iterable[str] | None) -> set[Node]:
    """The nodes whose gradient goes somewhere: to a parameter, or to a stage input in ``grad_inputs`` (stage
    input names; None: every floating one)."""
    names = dict(zip((n.name for n in gm.graph.nodes if n.op == "placeholder"),
                     getattr(gm, "input_names", None) or [n.name for n in gm.graph.nodes if n.op == "placeholder"]))
    wanted = None if grad_inputs is None else set(grad_inputs)
    out: set[Node] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            if _floating(n) and (wanted is None or names[n.name] in wanted):
                out.add(n)
        elif _owns_params(gm, n) or (op_name(n) not in SHAPE_OF and any(a in out for a in n.all_input_nodes)):
            tm = n.meta.get("tensor_meta")
            if not (isinstance(tm, TensorMetadata) and not tm.dtype.is_floating_point):
                out.add(n)
    return out


def grad_outputs(gm: GraphModule, grad_inputs: Iterable[str] | None) -> set[str]:
    """The stage's output names whose gradient goes somewhere (see :func:`_carrying`): the next stages' inputs
    whose gradients the walk must keep whole."""
    carrying = _carrying(gm, grad_inputs)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    names = getattr(gm, "output_names", None) or [getattr(a, "name", str(a)) for a in output_values(out)]
    return {name for name, a in zip(names, output_values(out)) if isinstance(a, Node) and a in carrying}


def partial_params(an: Analysis, canonical: Mapping[str, str], sharded: set[str], where: str,
                   traced: Traced | None, grad_inputs: Iterable[str] | None = None) -> tuple[str, ...]:
    """The replicated parameters whose gradient is a partial sum on each tp rank, in graph order: a backward
    walk of how each replicated value's gradient arrives: ``full`` (every rank the whole sum: through the loss,
    an f, a split's all-gather, a replicated consumer of a full one) or ``partial`` (a consumer computed on a
    shard: this rank's heads, or its positions under sequence parallelism). ``grad_inputs``: the stage inputs
    whose gradient goes back to an earlier stage (None: every floating one). Refused, located: a parameter whose
    gradient is both, and a partial gradient that reaches such a stage input or the sharded region."""
    kinds: dict[Node, str] = {}
    by_param: dict[str, tuple[str, Node]] = {}
    carrying = _carrying(an.gm, grad_inputs)
    key, hint = (("sequence_parallel", "sequence_parallel off") if an.sp is not None else
                 (KEY, "replicate the module that broadcasts it with tensor_parallel patterns"))
    what = f"sequence parallelism (tp {an.tp}){where}" if an.sp is not None else f"tensor parallelism (tp {an.tp}){where}"

    def add(a: Node, k: str | None) -> None:
        if k is not None and a in carrying:
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
        ku = "partial" if _sharded_state(st) else kinds.get(u)
        lin = an.lins.get(u)
        if ku in ("partial", "mixed") and not _sharded_state(st) and (
                u.name in an.rowwise or u.name in an.vocab_on or
                any(_sharded_state(an.state.get(a)) for a in u.all_input_nodes)):
            raise FrontendError(f"{what}: the gradient of {locate(u, traced)} would be a partial sum on each tp rank "
                                "(a consumer computed on a shard broadcasts it) and flow back into the sharded "
                                "region", key=key, hints=(hint,))
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
    for n, k in kinds.items():
        if n.op == "placeholder" and k != "full":
            used = next(iter(n.users))
            raise FrontendError(f"{what}: the gradient of stage input {n.name!r} (used at {locate(used, traced)}) would "
                                "be a partial sum on each tp rank, and it goes back to an earlier stage", key=key,
                                hints=(hint, "or cut the partition elsewhere"))
    for c, (k, at) in by_param.items():
        if k == "mixed":
            on = "the sequence shards" if an.sp is not None else "shards"
            raise FrontendError(f"{what}: parameter {c} is used on {on} and replicated (at {locate(at, traced)}): "
                                "its gradient would be partly a sum over the tp ranks and partly whole", key=key,
                                hints=(hint,))
    return tuple(reversed([c for c, (k, _) in by_param.items() if k == "partial"]))

