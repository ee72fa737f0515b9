"""Tensor parallelism for one pipeline stage: which modules shard which dimension, and its graph rewritten.

:func:`plan_stage` is a dataflow analysis over a stage's traced graph (fx or torch.export): every tensor
value is *replicated* (R) or *sharded* (:class:`Shard`: dimension ``dim`` is ``segments`` equal blocks, each
cut into tp contiguous parts). A Linear-like op (``nn.Linear``, ``F.linear``/``aten.linear``, HF ``Conv1D``
or its ``aten.addmm``/``mm`` with the weight ``[in, out]``) on an R input starts a *colwise* candidate
(its output sharded on the last dim); the shard is followed through ops proven to act shard by shard (the
rules table :data:`_RULES`: elementwise ops whose other operands broadcast on the sharded dim, views and
reshapes (:func:`_map_view`), transposes, splits of a fused q|k|v into its segments, attention over sharded
heads, rotary slicing on other dims, GQA's expand + reshape) to a Linear-like op on an input sharded on its
in-features, which is *rowwise*: its output is a partial sum, all-reduced (Megatron's g) before its bias.
In ``auto`` a candidate whose shard reaches anything else (the stage's output, an op not proven) is
replicated, and the analysis runs again until it holds; sizes that do not divide by tp (heads, kv heads)
are refused, located. With ``patterns`` (glob over module paths -> style) every failure is refused.

:func:`shard_stage` rewrites a stage for one tp rank from its :class:`~pipec.compiler.ir.tensor_parallel.StageTP`
(the analysis is deterministic, so a plan's record is enough): the sizes in views, expands and splits of a
sharded value become local ints, sizes read off sharded tensors are folded to their full values, f/g are
:class:`~.tp_comm.TPComm` call_modules, rowwise biases follow the all-reduce, sharded parameters are sliced
(:func:`shard_param`; :func:`unshard` inverts it). Then it proves the rewrite: shapes are propagated again
on fake tensors and every node must have its full shape with the sharded dim divided by tp.

Sequence parallelism (Megatron's, Korthikanti et al. 2022; ``sequence_parallel``) is one more run of the same
analysis over the decided modules (:func:`_sp_run`): a rowwise output is a :class:`Shard` with ``seq`` set on
its sequence dim (the dim of the model input's dim-1 length; its g becomes a reduce-scatter), followed by the
same rules (norms, residual adds, dropout act position by position; attention, a cumsum or a reduction along
the positions are refused, located); a replicated operand of full length there is split to this rank's
positions (all-gather backward); a colwise module's input is all-gathered in place of f (reduce-scatter
backward; its colwise Linears gather it in one :class:`~.tp_comm.GatheredLinear` that saves only the part),
a replicated consumer's and the last stage's outputs gathered whole; other stage outputs leave as parts and
arrive so at the next stages (:func:`plan_stages`). A backward walk (:func:`_partial_params`) finds the
replicated parameters whose gradient is a sum over positions split across the ranks (norm weights, rowwise
biases): the runtime all-reduces them over the tp group before the optimizer step.
"""

from __future__ import annotations

import copy
import fnmatch
import operator
import traceback
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata

from pipec.model.stages import StageModule, clone_tree, resolve
from pipec.model.tensors import FrontendError
from pipec.tp.comm import TPComm, TPGroup, VocabLookup, set_group
from pipec.model.trace import (_STACK_FRAME, Traced, _frame_text, _node_frame, _user_frame, module_path,
                                           quiet_torch)
from pipec.compiler.ir.tensor_parallel import Collective, ShardedParam, StageTP, loss_collectives
from pipec.compiler.request import TP_STYLES

__all__ = ["Shard", "plan_stage", "plan_stages", "shard_stage", "shard_param", "unshard"]

KEY = "tensor_parallel"
_aten = torch.ops.aten


@dataclass(frozen=True, slots=True)
class Shard:
    """A sharded value: ``dim`` is ``segments`` equal blocks, each cut into tp parts (rank t holds part t of
    each); ``sources`` are the colwise candidates (node names) it comes from."""

    dim: int
    segments: int = 1
    sources: frozenset[str] = frozenset()
    seq: bool = False
    """Sequence parallelism's shard: ``dim`` is the sequence, cut into tp contiguous parts of positions (the
    region between a rowwise module and the next colwise one); ``sources`` are then the rowwise nodes."""


@dataclass(frozen=True, slots=True)
class _SP:
    """What the sequence-parallel run of the analysis is given: the sequence length, the stage inputs that
    arrive as sequence shards (placeholder name -> dim), whether the stage's outputs go to the loss (whole)."""

    length: int
    inputs: Mapping[str, int]
    last: bool


@dataclass(frozen=True, slots=True)
class _Lin:
    """A Linear-like (or embedding) node: its input, weight and bias attributes, the weight's out-features dim."""

    node: Node
    x: Node
    weight: str
    bias: str | None
    out_dim: int
    path: str
    kind: str
    """``linear`` (call_module or functional), ``conv1d`` (call_module), ``addmm``, ``mm``, ``embedding``."""


@dataclass(frozen=True, slots=True)
class _Failure:
    node: Node
    sources: frozenset[str]
    reason: str
    size: bool = False
    """A size that does not divide by tp (refused in auto too), not an op that cannot act shard by shard."""
    hint: str = ""
    count: int = 0
    """For a size failure: the size tp does not divide."""


# ----------------------------------------------------------------------------- reading the graph


def _op(node: Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        t = node.target
        if isinstance(t, torch._ops.OpOverload):
            return t.overloadpacket.__name__
        return getattr(t, "__name__", str(t))
    return node.op


def _shape(a: Any) -> tuple[int, ...] | None:
    tm = a.meta.get("tensor_meta") if isinstance(a, Node) else None
    return tuple(int(d) for d in tm.shape) if isinstance(tm, TensorMetadata) else None


def _nbytes(node: Node) -> int:
    tm = node.meta.get("tensor_meta")
    n = 1
    for d in tm.shape:
        n *= int(d)
    return n * torch.empty((), dtype=tm.dtype).element_size()


def _arg(node: Node, i: int, name: str, default: Any = None) -> Any:
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _value(a: Any) -> Any:
    return a.meta.get("pipec_value", a) if isinstance(a, Node) else a


def _flat(out: Node) -> list[Any]:
    """An output node's values in order."""
    return list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]


def _prod(xs: Sequence[int]) -> int:
    p = 1
    for x in xs:
        p *= x
    return p


def _norm(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _linear_like(node: Node, root: nn.Module) -> _Lin | None:
    def attr(a: Any) -> str | None:
        return str(a.target) if isinstance(a, Node) and a.op == "get_attr" else None

    if node.op == "call_module":
        t = str(node.target)
        mod = root.get_submodule(t)
        if isinstance(mod, nn.Linear):
            return _Lin(node, node.args[0], f"{t}.weight", f"{t}.bias" if mod.bias is not None else None, 0, t, "linear")
        if type(mod).__name__ == "Conv1D" and getattr(mod, "weight", None) is not None and mod.weight.dim() == 2:
            return _Lin(node, node.args[0], f"{t}.weight", f"{t}.bias" if getattr(mod, "bias", None) is not None else None,
                        1, t, "conv1d")
        if isinstance(mod, nn.Embedding):
            return _Lin(node, node.args[0], f"{t}.weight", None, 0, t, "embedding")
        return None
    if node.op != "call_function":
        return None
    op, aten = _op(node), isinstance(node.target, torch._ops.OpOverload)
    def path(w: str) -> str:
        """The weight's module (``in_proj`` for an ``in_proj_weight``), or the module the op ran in where the
        weight belongs elsewhere (a tied weight: GPT-2's token embedding reads ``lm_head.weight``)."""
        owner, _, name = w.rpartition(".")
        own = owner if name == "weight" else f"{owner}.{name.removesuffix('_weight')}" if owner else name
        ran = module_path(node)
        return own if not ran or owner == ran or owner.startswith(ran + ".") else ran

    if op == "linear" and (w := attr(_arg(node, 1, "weight"))):
        return _Lin(node, node.args[0], w, attr(_arg(node, 2, "bias")), 0, path(w), "linear")
    if op == "addmm" and aten and (w := attr(node.args[2])) and (b := attr(node.args[0])) and not node.kwargs:
        return _Lin(node, node.args[1], w, b, 1, path(w), "addmm")
    if op == "mm" and aten and (w := attr(node.args[1])):
        return _Lin(node, node.args[0], w, None, 1, path(w), "mm")
    if op == "embedding":
        w, ids = (node.args[0], node.args[1]) if aten else (node.args[1], node.args[0])
        if attr(w):
            return _Lin(node, ids, str(w.target), None, 0, path(str(w.target)), "embedding")
    return None


def _map_view(shape: Sequence[int], dim: int, segments: int, out: Sequence[int]) -> tuple[int, int, int] | None:
    """Where a reshape from ``shape`` to ``out`` takes a value sharded on ``dim`` (``segments`` blocks):
    ``(out dim, its segments, the size each segment has there)``, or None where the shard's elements do not
    land on one dimension. The flat index is ``outer * inner + r`` with the tp parts cut in ``r``; the output
    dim ``j`` must split the same way: ``prod(out[:j]) * segments' == outer`` and ``m * prod(out[j+1:]) ==
    inner`` with ``out[j] == segments' * m``; the shard is then valid when tp divides ``m``."""
    if shape[dim] % segments:
        return None
    outer, inner = _prod(shape[:dim]) * segments, shape[dim] // segments * _prod(shape[dim + 1:])
    for j in range(len(out)):
        p, q = _prod(out[:j]), _prod(out[j + 1:])
        if not p or not q or outer % p or inner % q:
            continue
        s, m = outer // p, inner // q
        if out[j] == s * m and m > 1:
            return j, s, m
    return None


# ----------------------------------------------------------------------------- the rules


_UNARY = {"to", "type", "type_as", "float", "half", "bfloat16", "contiguous", "clone", "detach", "alias", "dropout",
          "_to_copy", "lift_fresh_copy", "native_dropout", "feature_dropout"}
_ELEMENTWISE = {"add", "sub", "mul", "div", "truediv", "pow", "neg", "gelu", "silu", "relu", "tanh", "sigmoid", "exp",
                "log", "rsqrt", "sqrt", "erf", "abs", "clamp", "masked_fill", "where", "eq", "ne", "lt", "le", "gt", "ge",
                "iadd", "imul", "rsub", "reciprocal", "square", "softplus", "leaky_relu", "elu", "mish", "hardtanh",
                "__and__", "__or__", "logical_not", "bitwise_not", "cos", "sin", "floordiv", "mod"}
_VIEWS = {"view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze"}
_SIZED_VIEWS = {"view", "reshape", "_unsafe_view", "unflatten"}
_SPLITS = {"split", "split_with_sizes", "chunk", "unbind", "tensor_split"}
_SHAPE_OF = {"getattr", "size", "dim", "sym_size", "numel", "_assert_tensor_metadata", "sym_numel"}
_DIM_OPS = {"softmax", "log_softmax", "_softmax", "_log_softmax", "cumsum", "cumprod"}
_REDUCTIONS = {"mean", "sum", "amax", "amin", "var", "std", "logsumexp", "norm"}
_ELEMENTWISE_MODULES = (nn.Dropout, nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Identity)


class _Analysis:
    """One pass of the dataflow analysis with a fixed set of colwise candidates (see the module doc)."""

    def __init__(self, gm: GraphModule, tp: int, lins: Mapping[Node, _Lin], colwise: set[str],
                 segments: Mapping[str, int], sp: _SP | None = None, *, vocab: set[str] = frozenset(),
                 loss_parallel: bool = False) -> None:
        self.gm, self.tp, self.lins, self.colwise, self.segments, self.sp = gm, tp, lins, colwise, segments, sp
        self.vocab, self.loss_parallel = vocab, loss_parallel
        """Embedding candidates for vocab parallelism; whether the stage's output may leave split on its class
        dim (the last stage, the built-in cross_entropy)."""
        self.vocab_on: set[str] = set()
        """Vocab-parallel embeddings (rows split, lookups summed)."""
        self.loss_out = False
        """The stage's output leaves split on its class dim (loss parallel)."""
        self.gathers: dict[Node, set[str]] = {}
        """Sequence parallelism: a sequence-sharded node -> how it is all-gathered: ``gather`` (for colwise
        modules: reduce-scatter backward), ``gather_whole`` (for a replicated consumer: the gradient's part)."""
        self.splits: dict[tuple[Node, Node], tuple[int, int]] = {}
        """(replicated operand, its sequence-sharded consumer) -> the operand's dim cut to this rank's part, and
        that dim's segments."""
        self.seq_outputs: dict[int, int] = {}
        """Output position -> its sequence dim, for the outputs sent as parts (not the last stage)."""
        self.state: dict[Node, Any] = {}
        self.failures: list[_Failure] = []
        self.rowwise: dict[str, int] = {}
        """Rowwise node -> the segments of its in-features."""
        self.active: set[str] = set()
        """Colwise candidates whose output is sharded."""

    def run(self) -> "_Analysis":
        for n in self.gm.graph.nodes:
            self.state[n] = self._rule(n)
        return self

    def of(self, a: Any) -> Any:
        return self.state.get(a) if isinstance(a, Node) else None

    def fail(self, n: Node, shards: Sequence[Shard], reason: str, *, size: bool = False, hint: str = "",
             count: int = 0) -> None:
        self.failures.append(_Failure(n, frozenset().union(*(s.sources for s in shards)), reason, size, hint, count))
        return None

    def _rule(self, n: Node) -> Any:
        if n.op == "placeholder" and self.sp is not None and n.name in self.sp.inputs:
            return Shard(self.sp.inputs[n.name], 1, frozenset(), seq=True)
        if n.op in ("placeholder", "get_attr"):
            return None
        ins = [(a, self.state[a]) for a in n.all_input_nodes if isinstance(self.state.get(a), Shard)]
        if len({s.seq for _, s in ins}) > 1:
            return self.fail(n, [s for _, s in ins], "it mixes a sequence shard with a tensor-parallel shard")
        if n.op == "output" and ins and ins[0][1].seq:
            return self._seq_outputs(n, ins)
        if n.op == "output":
            if ins and not self._loss_output(n, ins):
                self.fail(ins[0][0], [s for _, s in ins], f"{ins[0][0].name!r} leaves the stage sharded (a stage's "
                                                          "outputs are replicated)")
            return None
        if n in self.lins:
            return self._linear(n, self.lins[n])
        op = _op(n)
        if op == "getitem":
            base = self.of(n.args[0])
            if isinstance(base, tuple):
                return base[n.args[1]]
        if not ins:
            return tuple(None for _ in n.meta["tensor_meta"]) if op in _SPLITS and isinstance(
                n.meta.get("tensor_meta"), (tuple, list)) else None
        shards = [s for _, s in ins]
        if n.op == "call_module":
            return self._module(n, ins)
        if op in _SHAPE_OF:
            return None  # the shape's full value is folded in by the rewrite
        rule = _RULES.get(op)
        if rule is None:
            return self.fail(n, shards, f"{op} is not known to act shard by shard on {ins[0][0].name!r}, which is sharded")
        return rule(self, n, ins)

    def _seq_outputs(self, n: Node, ins: list[tuple[Node, Shard]]) -> None:
        """Sequence-sharded stage outputs: all-gathered whole for the loss (the last stage), else sent as parts."""
        flat = _flat(n)
        for a, s in ins:
            if s.segments != 1 and not self.sp.last:
                return self.fail(a, [s], f"{a.name!r} leaves the stage with its sequence dim flattened into another")
            if self.sp.last:
                self.gathers.setdefault(a, set()).add("gather_whole")
            else:
                for i, b in enumerate(flat):
                    if b is a:
                        self.seq_outputs[i] = s.dim
        return None

    def _loss_output(self, n: Node, ins: list[tuple[Node, Shard]]) -> bool:
        """Loss parallelism: the stage's one output split on its last dim (the classes) by a colwise head."""
        flat = _flat(n)
        (a, s), shape = ins[0], _shape(ins[0][0])
        if not self.loss_parallel or len(flat) != 1 or len(ins) != 1 or flat[0] is not a or shape is None:
            return False
        self.loss_out = len(shape) >= 2 and s.dim == len(shape) - 1 and s.segments == 1
        return self.loss_out

    def _summed(self, n: Node) -> Any:
        """A partial sum's output (a rowwise module's, a vocab-parallel lookup's): replicated once all-reduced,
        or with sequence parallelism the sequence shard its reduce-scatter leaves."""
        if self.sp is None:
            return None
        found = self.seq_dim(n)
        if found is None:
            return self.fail(n, [Shard(0, 1, frozenset({n.name}), seq=True)],
                             f"its output {list(_shape(n))} has no dimension of the sequence length {self.sp.length}")
        return Shard(found[0], found[1], frozenset({n.name}), seq=True)

    def seq_dim(self, n: Node) -> tuple[int, int] | None:
        """The sequence dim of a rowwise output and its segments: the dim of the sequence length (dim 1 where
        several are), or a 2-D ``[B T, features]`` (a Linear run on the flattened batch: HF's Conv1D), whose
        dim 0 is B blocks of the T positions."""
        shape = _shape(n)
        dims = [i for i, d in enumerate(shape[:-1]) if d == self.sp.length]
        if dims:
            return (1 if 1 in dims else dims[0], 1) if 1 in dims or len(dims) == 1 else None
        if len(shape) == 2 and shape[0] % self.sp.length == 0:
            return 0, shape[0] // self.sp.length
        return None

    def _linear(self, n: Node, lin: _Lin) -> Any:
        s, out, xs = self.of(lin.x), _shape(n), _shape(lin.x)
        if isinstance(s, Shard) and s.seq:  # the sequence gathered whole first
            colwise = n.name in self.colwise and lin.kind != "embedding"
            self.gathers.setdefault(lin.x, set()).add("gather" if colwise else "gather_whole")
            s = None
        if lin.kind == "embedding" and s is None and n.name in self.vocab:
            rows = resolve(self.gm, lin.weight).shape[0]
            if rows % self.tp:
                self.fail(n, [Shard(0, 1, frozenset({n.name}))], f"{lin.path} has {rows} rows (its vocabulary), not "
                          f"divisible by tp {self.tp}", size=True)
            self.vocab_on.add(n.name)
            return self._summed(n)
        if s is None:
            if n.name not in self.colwise or lin.kind == "embedding":
                return None
            segs = self.segments.get(n.name, 1)
            if out[-1] % (self.tp * segs):
                what = f"{segs} segments of {out[-1] // segs}" if segs > 1 else f"{out[-1]}"
                self.fail(n, [Shard(0, 1, frozenset({n.name}))], f"{lin.path} has {what} output features, not "
                          f"divisible by tp {self.tp}", size=True)
            self.active.add(n.name)
            return Shard(len(out) - 1, segs, frozenset({n.name}))
        if lin.kind != "embedding" and s.dim == len(xs) - 1:
            self.rowwise[n.name] = s.segments
            return self._summed(n)
        return replace(s, dim=len(out) - len(xs) + s.dim)

    def _module(self, n: Node, ins: list[tuple[Node, Shard]]) -> Any:
        mod = self.gm.get_submodule(str(n.target))
        shards = [s for _, s in ins]
        if isinstance(mod, _ELEMENTWISE_MODULES):
            return _elementwise(self, n, ins)
        shape = getattr(mod, "normalized_shape", None)
        if shape is not None and not isinstance(mod, nn.GroupNorm) and ins[0][0] is n.args[0]:
            return _normalize(self, n, ins, len(tuple(shape) if not isinstance(shape, int) else (shape,)))
        return self.fail(n, shards, f"module {n.target} ({type(mod).__name__}) is not known to act shard by shard")


def _elementwise(an: _Analysis, n: Node, ins: list[tuple[Node, Shard]]) -> Any:
    out = _shape(n)
    shards = [s for _, s in ins]
    if out is None:
        return an.fail(n, shards, f"{_op(n)} makes no tensor of a sharded one")
    dims = {len(out) - len(_shape(a)) + s.dim for a, s in ins}
    segs = {s.segments for s in shards}
    if len(dims) != 1 or len(segs) != 1:
        return an.fail(n, shards, "its operands are sharded on different dimensions")
    d = dims.pop()
    for a in n.all_input_nodes:
        sh = _shape(a)
        if sh is None or an.of(a) is not None:
            continue
        k = d - (len(out) - len(sh))
        if 0 <= k < len(sh) and sh[k] != 1:
            if shards[0].seq:  # cut to this rank's positions (all-gather backward)
                an.splits[(a, n)] = (k, shards[0].segments)
                continue
            return an.fail(n, shards, f"operand {a.name!r} is replicated with the full size {sh[k]} on the sharded "
                                      "dimension (it does not broadcast there)")
    return replace(shards[0], dim=d, segments=segs.pop(), sources=frozenset().union(*(s.sources for s in shards)))


def _unary(an: _Analysis, n: Node, ins: list[tuple[Node, Shard]]) -> Any:
    s = an.of(n.args[0])
    if not isinstance(s, Shard) or len(ins) > 1:
        return _elementwise(an, n, ins)
    return s


def _view(an: _Analysis, n: Node, ins: list[tuple[Node, Shard]]) -> Any:
    x, s = ins[0]
    if x is not n.args[0]:
        return an.fail(n, [s], "a sharded tensor gives the shape of a view")
    shape, out = _shape(x), _shape(n)
    mapped = _map_view(shape, s.dim, s.segments, out)
    if mapped is None:
        return an.fail(n, [s], f"the view {list(shape)} -> {list(out)} mixes the sharded dimension {s.dim} with others")
    j, segs, m = mapped
    if m % an.tp:
        an.fail(n, [s], f"the view {list(shape)} -> {list(out)} cuts the sharded features into {out[j]} parts "
                        f"(attention heads, where it splits heads), and {m} is not divisible by tp {an.tp}",
                size=True, hint=f"use a tp that divides {m}", count=m)
    return replace(s, dim=j, segments=segs)


def _transpose(an: _Analysis, n: Node, ins: list[tuple[Node, Shard]]) -> Any:
    s, nd = ins[0][1], len(_shape(n.args[0]))
    if _op(n) in ("t", "numpy_T"):
        perm = [1, 0] if nd == 2 else [0]
    elif _op(n) == "permute":
        dims = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (list, tuple)) else n.args[1:]
        perm = [_norm(int(d), nd) for d in dims]
    else:
        a, b = _norm(int(n.args[1]), nd), _norm(int(n.args[2]), nd)
        perm = list(range(nd))
        perm[a], perm[b] = b, a
    return replace(s, dim=perm.index(s.dim))


def _expand(an: _Analysis, n: Node, ins: list[tuple[Node, Shard]]) -> Any:
    s, shape, out = ins[0][1], _shape(n.args[0]), _shape(n)
    d = s.dim + len(out) - len(shape)
    if shape[s.dim] != out[d]:
        return an.fail(n, [s], "it expands the sharded dimension")
    return replace(s, dim=d)


def _split(an: _Analysis, n: Node, ins: list[tuple[Node, Shard]]) -> Any:
    s, shape = ins[0][1], _shape(n.args[0])
    pieces = [tuple(int(d) for d in tm.shape) for tm in n.meta["tensor_meta"]]
    dim = _norm(int(_arg(n, 1 if _op(n) == "unbind" else 2, "dim", 0)), len(shape))
    if _op(n) == "unbind":
        return an.fail(n, [s], "it unbinds a sharded tensor") if dim == s.dim else tuple(
            replace(s, dim=s.dim - (dim < s.dim)) for _ in pieces)
    if dim != s.dim:
        return tuple(replace(s, dim=s.dim) for _ in pieces)
    sizes = [p[dim] for p in pieces]
    if len(set(sizes)) != 1 or s.segments % len(pieces):
        an.fail(n, [s], f"it splits the sharded dimension into {sizes}, not into its {s.segments} equal segments")
        return tuple(None for _ in pieces)
    return tuple(replace(s, dim=dim, segments=s.segments // len(pieces)) for _ in pieces)


def _full_slice(start: Any, stop: Any, step: Any, size: int) -> bool:
    start, stop, step = _value(start), _value(stop), _value(step)
    return start in (None, 0) and step in (None, 1) and (stop is None or (isinstance(stop, int) and stop >= size))


def _index(an: _Analysis, n: Node, ins: list[tuple[Node, Shard]]) -> Any:
    x, s = n.args[0], an.of(n.args[0])
    if not isinstance(s, Shard):
        return an.fail(n, [sh for _, sh in ins], "a sharded tensor indexes another")
    idx = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
    shape = _shape(x)
    if any(isinstance(e, Node) and _shape(e) is not None for e in idx):
        return an.fail(n, [s], "it indexes a sharded tensor with a tensor")
    used = sum(1 for e in idx if e is not None and e is not Ellipsis)
    i = o = 0
    for e in idx:
        if e is Ellipsis:
            k = len(shape) - used
            if i <= s.dim < i + k:
                return replace(s, dim=o + s.dim - i)
            i, o = i + k, o + k
        elif e is None:
            o += 1
        elif isinstance(e, slice):
            if i == s.dim:
                if not _full_slice(e.start, e.stop, e.step, shape[i]):
                    return an.fail(n, [s], "it slices the sharded dimension")
                return replace(s, dim=o)
            i, o = i + 1, o + 1
        else:
            if i == s.dim:
                return an.fail(n, [s], "it indexes into the sharded dimension")
            i += 1
    return replace(s, dim=o + s.dim - i)


def _slice(an: _Analysis, n: Node, ins: list[tuple[Node, Shard]]) -> Any:
    s, shape = ins[0][1], _shape(n.args[0])
    if _op(n) == "select":
        dim = _norm(int(n.args[1]), len(shape))
        if dim == s.dim:
            return an.fail(n, [s], "it selects from the sharded dimension")
        return replace(s, dim=s.dim - (dim < s.dim))
    dim = _norm(int(_arg(n, 1, "dim", 0)), len(shape))
    if dim == s.dim and not _full_slice(_arg(n, 2, "start"), _arg(n, 3, "end"), _arg(n, 4, "step", 1), shape[dim]):
        return an.fail(n, [s], "it slices the sharded dimension")
    return s


def _cat(an: _Analysis, n: Node, ins: list[tuple[Node, Shard]]) -> Any:
    parts = list(n.args[0])
    states = [an.of(p) for p in parts]
    shards = [s for _, s in ins]
    if any(not isinstance(st, Shard) for st in states) or len({(st.dim, st.segments) for st in states}) != 1:
        return an.fail(n, shards, "it concatenates sharded with replicated (or differently sharded) tensors")
    dim = _norm(int(_arg(n, 1, "dim", 0)), len(_shape(n)))
    if dim == states[0].dim:
        return an.fail(n, shards, "it concatenates along the sharded dimension")
    return replace(states[0], sources=frozenset().union(*(s.sources for s in shards)))


def _attention(an: _Analysis, n: Node, ins: list[tuple[Node, Shard]]) -> Any:
    q, k, v = n.args[:3]
    states = [an.of(t) for t in (q, k, v)]
    shards = [s for _, s in ins]
    nd = len(_shape(q))
    if any(isinstance(st, Shard) and st.seq for st in states):
        return an.fail(n, shards, "attention mixes the positions of a sequence shard")
    if any(not isinstance(st, Shard) for st in states) or len({st.dim for st in states}) != 1 or states[0].dim >= nd - 2:
        return an.fail(n, shards, "attention needs q, k and v all sharded on their heads dimension")
    d = states[0].dim
    mask = _arg(n, 3, "attn_mask")
    if isinstance(mask, Node) and (ms := _shape(mask)) is not None:
        m_state, k_dim = an.of(mask), d - (nd - len(ms))
        if m_state is None and 0 <= k_dim < len(ms) and ms[k_dim] != 1:
            return an.fail(n, shards, "its mask is replicated with one entry per head (it does not broadcast on heads)")
        if isinstance(m_state, Shard) and m_state.dim != k_dim:
            return an.fail(n, shards, "its mask is sharded on another dimension than the heads")
    return Shard(d, 1, frozenset().union(*(s.sources for s in shards)))


def _matmul(an: _Analysis, n: Node, ins: list[tuple[Node, Shard]]) -> Any:
    x, y = n.args[:2]
    sx, sy, out = an.of(x), an.of(y), _shape(n)
    shards = [s for _, s in ins]
    nx, ny, no = len(_shape(x)), len(_shape(y)), len(out)
    dims = set()
    for s, nd, contract, free, other in ((sx, nx, nx - 1, nx - 2, sy), (sy, ny, ny - 2, ny - 1, sx)):
        if not isinstance(s, Shard):
            continue
        if nd < 2 or s.dim == contract:
            return an.fail(n, shards, "it contracts the sharded dimension (that would be a partial sum)")
        if s.dim == free:
            if other is not None:
                return an.fail(n, shards, "both operands are sharded, one on a free dimension")
            dims.add(no - 2 if s is sx else no - 1)
        else:
            dims.add(no - nd + s.dim)
    if len(dims) != 1:
        return an.fail(n, shards, "its operands are sharded on different dimensions")
    d = dims.pop()
    if d < no - 2:  # a batch dim: the other operand is sharded there too, or broadcasts
        for t, s in ((x, sx), (y, sy)):
            sh = _shape(t)
            k = d - (no - len(sh))
            if s is None and 0 <= k < len(sh) and sh[k] != 1:
                return an.fail(n, shards, f"operand {t.name!r} is replicated on the sharded batch dimension")
    return replace(shards[0], dim=d, sources=frozenset().union(*(s.sources for s in shards)))


def _along(an: _Analysis, n: Node, ins: list[tuple[Node, Shard]]) -> Any:
    s, shape = ins[0][1], _shape(n.args[0])
    if _norm(int(_arg(n, 1, "dim", -1)), len(shape)) == s.dim:
        return an.fail(n, [s], f"{_op(n)} runs along the sharded dimension")
    return s


def _reduce(an: _Analysis, n: Node, ins: list[tuple[Node, Shard]]) -> Any:
    s, shape = ins[0][1], _shape(n.args[0])
    dims = _arg(n, 1, "dim")
    if dims is None or isinstance(dims, Node):
        return an.fail(n, [s], f"{_op(n)} reduces over every dimension, the sharded one too")
    dims = {_norm(int(d), len(shape)) for d in (dims if isinstance(dims, (list, tuple)) else (dims,))}
    if s.dim in dims:
        return an.fail(n, [s], f"{_op(n)} reduces over the sharded dimension")
    keep = _arg(n, 2, "keepdim", False)
    return replace(s, dim=s.dim if keep else s.dim - sum(d < s.dim for d in dims))


def _normalize(an: _Analysis, n: Node, ins: list[tuple[Node, Shard]], num_dims: int | None = None) -> Any:
    s, shape = ins[0][1], _shape(n.args[0])
    if an.of(n.args[0]) is not s or len(ins) > 1:
        return an.fail(n, [x for _, x in ins], "its weight or bias is sharded")
    if num_dims is None:
        num_dims = len(_arg(n, 1, "normalized_shape"))
    if s.dim >= len(shape) - num_dims:
        return an.fail(n, [s], "it normalises over the sharded dimension")
    return s


_RULES: dict[str, Callable[[_Analysis, Node, list], Any]] = {
    **{op: _unary for op in _UNARY}, **{op: _elementwise for op in _ELEMENTWISE}, **{op: _view for op in _VIEWS},
    **{op: _split for op in _SPLITS}, **{op: _along for op in _DIM_OPS}, **{op: _reduce for op in _REDUCTIONS},
    "transpose": _transpose, "permute": _transpose, "t": _transpose, "expand": _expand, "getitem": _index,
    "slice": _slice, "select": _slice, "cat": _cat, "scaled_dot_product_attention": _attention,
    "matmul": _matmul, "bmm": _matmul, "mm": _matmul, "layer_norm": _normalize, "rms_norm": _normalize,
}
"""Op name -> its rule for sharded inputs: the output's state, or a failure (an op not named is not proven)."""


# ----------------------------------------------------------------------------- deciding


def _segment_choices(node: Node, tp: int) -> list[int]:
    """How many equal blocks a colwise candidate's output may be, the likeliest first: 3 for a fused q|k|v
    split into q, k, v (or viewed as ``[..., 3, features]`` and selected from, as nn.MultiheadAttention does), else 1."""
    cur, features = node, _shape(node)[-1]
    while len(cur.users) == 1 and _op(next(iter(cur.users))) in _VIEWS | _UNARY:
        nxt = next(iter(cur.users))
        if _shape(nxt) is None or _shape(nxt)[-1] != features:
            break
        cur = nxt
    choices = []
    nd = len(_shape(cur))
    for u in cur.users:
        if _op(u) in ("split", "split_with_sizes", "chunk") and isinstance(u.meta.get("tensor_meta"), (tuple, list)):
            if _norm(int(_arg(u, 2, "dim", 0)), nd) == nd - 1:
                sizes = {int(tm.shape[-1]) for tm in u.meta["tensor_meta"]}
                if len(sizes) == 1:
                    choices.append(len(u.meta["tensor_meta"]))
        elif _op(u) in _SIZED_VIEWS and _shape(u) is not None:
            mapped = _map_view(_shape(cur), nd - 1, 1, _shape(u))
            if mapped is not None and 1 < (k := _shape(u)[mapped[0]]) < features:
                choices.append(k)
    choices = [k for k in dict.fromkeys([*choices[:1], 1, *choices[1:]]) if features % (k * tp) == 0 or k == 1]
    return choices


def _canonical_of(gm: GraphModule, canonical: Mapping[str, str] | None) -> Mapping[str, str]:
    return canonical if canonical is not None else getattr(gm, "canonical", {})


def _param_uses(an: _Analysis, canonical: Mapping[str, str]) -> dict[str, dict[ShardedParam | None, list[Node]]]:
    """Canonical parameter -> how each use shards it (None: replicated) -> the nodes using it so."""
    uses: dict[str, dict[ShardedParam | None, list[Node]]] = {}

    def use(target: str, sp: ShardedParam | None, n: Node) -> None:
        name = canonical.get(target, target)
        uses.setdefault(name, {}).setdefault(None if sp is None else ShardedParam(name=name, dim=sp.dim,
                                                                                  segments=sp.segments), []).append(n)

    for n, lin in an.lins.items():
        segs = an.segments.get(n.name, 1)
        if n.name in an.active:
            use(lin.weight, ShardedParam(name="", dim=lin.out_dim, segments=segs), n)
            if lin.bias:
                use(lin.bias, ShardedParam(name="", dim=0, segments=segs), n)
        elif n.name in an.rowwise:
            use(lin.weight, ShardedParam(name="", dim=1 - lin.out_dim, segments=an.rowwise[n.name]), n)
            if lin.bias:
                use(lin.bias, None, n)
        elif n.name in an.vocab_on:
            use(lin.weight, ShardedParam(name="", dim=0), n)
        else:
            use(lin.weight, None, n)
            if lin.bias:
                use(lin.bias, None, n)
    for n in an.gm.graph.nodes:
        if n.op == "get_attr" and any(u not in an.lins for u in n.users):
            use(str(n.target), None, n)
        elif n.op == "call_module" and n not in an.lins:
            for pname, _ in an.gm.get_submodule(str(n.target)).named_parameters(prefix=str(n.target)):
                use(pname, None, n)
    return uses


def _check_params(an: _Analysis, canonical: Mapping[str, str]) -> None:
    for name, by in _param_uses(an, canonical).items():
        if len(by) > 1:
            nodes = [n for sp, ns in by.items() if sp is not None for n in ns]
            an.fail(nodes[0], [Shard(0, 1, frozenset(m.name for m in nodes if m.name in an.active | an.vocab_on)),
                               *(an.of(an.lins[m].x) for m in nodes if isinstance(an.of(an.lins[m].x), Shard))],
                    f"parameter {name} is used sharded here and replicated (or sharded otherwise) elsewhere (a tied weight)")


def _analyse(gm: GraphModule, tp: int, styles: Mapping[str, str] | None, canonical: Mapping[str, str],
             segments: Mapping[str, int] | None = None, *, loss_parallel: bool = False,
             replicate: frozenset[str] = frozenset()) -> tuple[_Analysis, Mapping[Node, _Lin]]:
    """The analysis run to its fixpoint: ``styles`` None is auto (candidates that fail are replicated); a
    candidate that fails first tries its other segment counts. ``segments`` (canonical weight -> segments, a
    plan's record) fixes them. ``loss_parallel``: the stage's output may leave split on its class dim (auto
    leaves a head whose classes tp does not divide replicated); ``replicate``: canonical weights kept whole
    (a weight tied to a stage that keeps it so)."""
    lins = {n: lin for n in gm.graph.nodes if (lin := _linear_like(n, gm)) is not None}
    choices = {n.name: ([segments.get(canonical.get(lin.weight, lin.weight), 1)] if segments is not None
                        else _segment_choices(n, tp)) for n, lin in lins.items() if lin.kind != "embedding"}
    pick = dict.fromkeys(choices, 0)
    kept = {n.name for n, lin in lins.items() if canonical.get(lin.weight, lin.weight) in replicate}
    if styles is not None:
        cands = {n.name for n, lin in lins.items() if styles.get(lin.path) == "colwise"}
        vocab = {n.name for n, lin in lins.items() if styles.get(lin.path) == "vocab"}
    else:
        classes = _class_dim(gm) if loss_parallel else None
        cands = {n.name for n in lins if n.name in choices and (classes is None or _shape(n)[-1] % tp == 0
                                                                 or _shape(n)[-1] != classes)}
        vocab = {n.name for n, lin in lins.items() if _vocab_candidate(gm, lin, tp)}
    off: set[str] = set(kept)
    while True:
        an = _Analysis(gm, tp, lins, cands - off, {c: choices[c][pick[c]] for c in choices}, vocab=vocab - off,
                       loss_parallel=loss_parallel).run()
        _check_params(an, canonical)
        bad = frozenset().union(*(f.sources for f in an.failures if not f.size)) - off
        retry = {b for b in bad if b in pick and pick[b] + 1 < len(choices[b])}
        for b in retry:
            pick[b] += 1
        if not bad or (styles is not None and not retry):
            return an, lins
        if styles is None:
            off |= bad - retry


def _class_dim(gm: GraphModule) -> int | None:
    """The last dim of the stage's one output (the classes the loss takes), or None."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    flat = _flat(out)
    shape = _shape(flat[0]) if len(flat) == 1 else None
    return shape[-1] if shape else None


def _vocab_candidate(gm: GraphModule, lin: _Lin, tp: int) -> bool:
    """An embedding auto makes vocab-parallel: of token ids the stage is given (a placeholder, through views),
    its rows divisible by tp, no max_norm (positions from an arange stay replicated: no all-reduce for them)."""
    if lin.kind != "embedding":
        return False
    x = lin.x
    while isinstance(x, Node) and x.op != "placeholder" and _op(x) in _VIEWS | _UNARY:
        x = x.args[0]
    if not isinstance(x, Node) or x.op != "placeholder":
        return False
    weight = resolve(gm, lin.weight)
    if weight.dim() != 2 or weight.shape[0] % tp:
        return False
    if lin.node.op == "call_module":
        return getattr(gm.get_submodule(lin.path), "max_norm", None) is None
    return isinstance(lin.node.target, torch._ops.OpOverload) or _arg(lin.node, 3, "max_norm") is None


# ----------------------------------------------------------------------------- sequence parallelism


SP_KEY = "sequence_parallel"


def _io_names(gm: GraphModule) -> tuple[dict[str, str], list[str]]:
    """Placeholder node name -> the stage input's name, and the output names in order (a StageModule's own,
    else the graph's node names)."""
    holders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = getattr(gm, "input_names", None) or holders
    out = next(n for n in gm.graph.nodes if n.op == "output")
    flat = _flat(out)
    outputs = getattr(gm, "output_names", None) or [getattr(a, "name", str(a)) for a in flat]
    return dict(zip(holders, inputs)), list(outputs)


def _sp_run(gm: GraphModule, an: _Analysis, sp: _SP, where: str, traced: Traced | None) -> _Analysis:
    """The analysis once more with sequence parallelism, over ``an``'s decided modules; refuses, located, where
    the sequence shard cannot be followed."""
    if sp.length % an.tp:
        raise FrontendError(f"sequence parallelism (tp {an.tp}){where}: the sequence length {sp.length} is not "
                            f"divisible by tp {an.tp}", key=SP_KEY,
                            hints=(f"use a sequence length divisible by {an.tp}, or sequence_parallel off",))
    run = _Analysis(gm, an.tp, an.lins, an.colwise, an.segments, sp, vocab=an.vocab,
                    loss_parallel=an.loss_parallel).run()
    for f in run.failures:
        raise FrontendError(f"sequence parallelism (tp {an.tp}){where} cannot follow the sequence shard at "
                            f"{_at(f.node, traced)}: {f.reason}", key=SP_KEY, hints=("sequence_parallel off",))
    assert (run.active, run.rowwise, run.vocab_on) == (an.active, an.rowwise, an.vocab_on), \
        "sequence parallelism changed the sharding"
    return run


def _floating(n: Node) -> bool:
    tm = n.meta.get("tensor_meta")
    return isinstance(tm, TensorMetadata) and tm.dtype.is_floating_point


def _seq_state(st: Any) -> bool:
    return isinstance(st, Shard) and st.seq


def _fused(an: _Analysis, lins: Mapping[Node, _Lin], n: Node) -> bool:
    """A colwise Linear on a sequence shard that gathers the sequence itself, with the other colwise Linears of
    its input (q, k, v apart; an MLP's gate and up) in one :class:`~.tp_comm.GatheredLinear`: one all-gather,
    only this rank's part saved (:func:`_fused_group`)."""
    lin = lins.get(n)
    return lin is not None and n in _fused_group(an, lins, lin.x)


def _fused_group(an: _Analysis, lins: Mapping[Node, _Lin], x: Node) -> tuple[Node, ...]:
    """The colwise Linears of sequence shard ``x``, in graph order, when they can run as one
    :class:`~.tp_comm.GatheredLinear`: every colwise consumer is a Linear (module or functional) whose weight
    and bias are the parameters themselves. Else none: they share one all-gather, which each saves whole."""
    if "gather" not in an.gathers.get(x, ()):
        return ()
    group = tuple(m for m, other in lins.items() if other.x is x and m.name in an.active)
    ok = all(lins[m].kind == "linear" and (m.op == "call_module" or _arg(m, 2, "bias") is None or lins[m].bias)
             for m in group)
    return group if ok else ()


def _sharded_state(st: Any) -> bool:
    return isinstance(st, Shard) or (isinstance(st, tuple) and any(isinstance(x, Shard) for x in st))


def _partial_params(an: _Analysis, canonical: Mapping[str, str], sharded: set[str], where: str,
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
        if _op(u) in _SHAPE_OF:
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
                                f"shards and replicated (at {_at(at, traced)}): its gradient would be partly a sum "
                                "over the tp ranks and partly whole", key=SP_KEY, hints=hint)
    return tuple(c for c, (k, _) in by_param.items() if k == "partial")


# ----------------------------------------------------------------------------- refusals, located


def _at(node: Node, traced: Traced | None) -> str:
    stack = node.meta.get("stack_trace")
    frame = None
    if stack:
        frame = _user_frame([traceback.FrameSummary(m["file"], int(m["line"]), m["name"], line=m["code"].strip())
                             for m in _STACK_FRAME.finditer(stack)])
    elif traced is not None:
        frame = _node_frame(traced, node.name)
    return f"node {node.name!r}" + _frame_text(frame)


def _refusal(tp: int, where: str, node: Node, reason: str, traced: Traced | None, hints: Sequence[str]) -> FrontendError:
    return FrontendError(f"tensor parallelism (tp {tp}){where} cannot shard {_at(node, traced)}: {reason}", key=KEY,
                         hints=tuple(h for h in hints if h))


def _size_refusal(an: _Analysis, f: _Failure, where: str, traced: Traced | None) -> FrontendError:
    """A size that does not divide; grouped-query attention with fewer kv heads than tp said as that."""
    src = next((n for n in an.lins if n.name in f.sources), None)
    if src is not None and f.count:
        x, m = an.lins[src].x, f.count
        siblings = [n for n, lin in an.lins.items() if lin.x is x and n is not src]
        if m < an.tp and any(_shape(n)[-1] > _shape(src)[-1] for n in siblings):
            return _refusal(an.tp, where, f.node, f"grouped-query attention has {m} kv heads, fewer than tp {an.tp}: each "
                            "rank needs whole kv heads", traced,
                            (f"use a tp that divides {m} (the kv heads), or replicate the attention with tensor_parallel "
                             "patterns",))
    return _refusal(an.tp, where, f.node, f.reason, traced, (f.hint,))


# ----------------------------------------------------------------------------- the plan


def _module_paths(gm: GraphModule) -> dict[str, str]:
    """Every module path the stage runs -> its class name."""
    out: dict[str, str] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            out[str(n.target)] = type(gm.get_submodule(str(n.target))).__name__
        for path, cls in (n.meta.get("nn_module_stack") or {}).values():
            out.setdefault(str(path), getattr(cls, "__name__", str(cls).rpartition(".")[2].strip("'>")))
        if n.op == "get_attr":
            out.setdefault(str(n.target).rpartition(".")[0], "?")
    return out


def _styles_of(gm: GraphModule, lins: Mapping[Node, _Lin], patterns: Mapping[str, str], where: str) -> tuple[dict[str, str], set[str]]:
    styles: dict[str, str] = {}
    matched: set[str] = set()
    paths = _module_paths(gm)
    for pattern, style in patterns.items():
        if style not in TP_STYLES:
            raise FrontendError(f"tensor_parallel pattern {pattern!r}: style must be one of {', '.join(TP_STYLES)}, got "
                                f"{style!r}", key=KEY)
        hit = [lin for lin in lins.values() if fnmatch.fnmatchcase(lin.path, pattern)]
        for lin in hit:
            styles.setdefault(lin.path, style)
            if (lin.kind == "embedding") != (style == "vocab") and style != "replicated":
                what = f"embedding {lin.path} {style}" if lin.kind == "embedding" else f"{lin.path} vocab"
                raise FrontendError(f"tensor_parallel pattern {pattern!r}{where} makes {what}; an embedding is vocab "
                                    "(its rows split) or replicated, a Linear colwise, rowwise or replicated", key=KEY,
                                    hints=(f"make {lin.path} {'vocab' if lin.kind == 'embedding' else 'colwise'}, or "
                                           "leave it out of the patterns",))
        if hit:
            matched.add(pattern)
            continue
        other = sorted(p for p in paths if fnmatch.fnmatchcase(p, pattern))
        if other:
            raise FrontendError(f"tensor_parallel pattern {pattern!r}{where} matches {other[0]} ({paths[other[0]]}), "
                                "which is not a Linear, Embedding or Conv1D", key=KEY,
                                hints=("name the Linear layers inside it (e.g. 'blocks.*.mlp.fc'), or use tensor_parallel auto",))
    return styles, matched


def _record(an: _Analysis, lins: Mapping[Node, _Lin], canonical: Mapping[str, str], *, where: str = "",
            traced: Traced | None = None) -> StageTP:
    modules: dict[str, str] = {}
    params: dict[str, ShardedParam] = {}
    collectives: list[Collective] = []
    copied: set[Node] = set()
    seq_on = an.sp is not None

    def pair(first: str, second: str, num_bytes: int, node: str) -> list[Collective]:
        return [Collective(kind=first, phase="forward", num_bytes=num_bytes, node=node),
                Collective(kind=second, phase="backward", num_bytes=num_bytes, node=node)]

    for n, lin in lins.items():
        modules.setdefault(lin.path, _style(an, n))
        if n.name in an.vocab_on:  # the lookups' partial sums: all-reduced, or reduce-scattered
            collectives += [replace(c, of="vocab") for c in (
                pair("reduce_scatter", "all_gather", _nbytes(n), n.name) if seq_on else
                [Collective(kind="all_reduce", phase="forward", num_bytes=_nbytes(n), node=n.name)])]
        if n.name in an.active and lin.x not in copied:
            copied.add(lin.x)
            if "gather" in an.gathers.get(lin.x, ()):
                collectives += pair("all_gather", "reduce_scatter", _nbytes(lin.x), lin.x.name)
                if _fused(an, lins, n):  # the sequence gathered again for the weight's gradient
                    collectives.append(Collective(kind="all_gather", phase="backward", num_bytes=_nbytes(lin.x),
                                                  node=lin.x.name))
            else:
                collectives.append(Collective(kind="all_reduce", phase="backward", num_bytes=_nbytes(lin.x),
                                              node=lin.x.name))
        if n.name in an.rowwise:
            if seq_on:
                collectives += pair("reduce_scatter", "all_gather", _nbytes(n), n.name)
            else:
                collectives.append(Collective(kind="all_reduce", phase="forward", num_bytes=_nbytes(n), node=n.name))
    for x, how in an.gathers.items():
        if "gather_whole" in how:  # before a replicated consumer: the backward keeps this rank's part
            collectives.append(Collective(kind="all_gather", phase="forward", num_bytes=_nbytes(x), node=x.name))
    for a in dict.fromkeys(a for a, _ in an.splits):  # a replicated value cut: all-gathered backward
        collectives.append(Collective(kind="all_gather", phase="backward", num_bytes=_nbytes(a), node=a.name))
    if an.loss_out:  # the loss on the logits' parts: the max (gathered), the sum of exponentials, the target's
        out = next(n for n in an.gm.graph.nodes if n.op == "output")
        tokens = _prod(_shape(out.all_input_nodes[0])[:-1])
        collectives += loss_collectives(tokens, an.tp)
    for name, by in _param_uses(an, canonical).items():
        sp = next(iter(by))
        if sp is not None:
            params[name] = sp
    total = sharded = 0.0
    counted = any("pipec_flops" in n.meta for n in an.gm.graph.nodes)
    for n in an.gm.graph.nodes:
        flops = float(n.meta.get("pipec_flops") or 0.0)
        if not counted and n in lins and lins[n].kind != "embedding":  # not annotated: 2 M N K of the matmuls
            flops = 2.0 * _prod(_shape(n)) * _shape(lins[n].x)[-1]
        total += flops
        touched = isinstance(an.state.get(n), Shard) or any(isinstance(an.state.get(a), Shard) for a in n.all_input_nodes)
        if touched or n.name in an.active:
            sharded += flops
    extra: dict[str, Any] = {}
    if seq_on:
        names, outputs = _io_names(an.gm)
        holders = {n.name: n for n in an.gm.graph.nodes if n.op == "placeholder"}
        extra = dict(sequence_parallel=True, seq_len=an.sp.length,
                     seq_inputs=tuple((names[h], d) for h, d in an.sp.inputs.items() if h in holders),
                     seq_outputs=tuple((outputs[i], d) for i, d in sorted(an.seq_outputs.items())),
                     partial_params=_partial_params(an, canonical, set(params), where, traced))
    return StageTP(tp=an.tp, modules=tuple(modules.items()), params=tuple(params.values()),
                   collectives=tuple(collectives), sharded_flops=sharded / total if total else 0.0,
                   loss_parallel=an.loss_out, **extra)


def _style(an: _Analysis, n: Node) -> str:
    return ("colwise" if n.name in an.active else "rowwise" if n.name in an.rowwise else
            "vocab" if n.name in an.vocab_on else "replicated")


def _check_annotated(stage: GraphModule) -> None:
    for n in stage.graph.nodes:
        if n.op in ("placeholder", "get_attr", "call_module") and "tensor_meta" not in n.meta:
            raise FrontendError(f"node {n.name!r} of the stage's graph has no shape; annotate the traced graph "
                                "(annotate.propagate) before it is split, so that the sharding pass can read shapes")


def plan_stage(stage: GraphModule, tp: int, *, patterns: Mapping[str, str] | None = None,
               canonical: Mapping[str, str] | None = None, traced: Traced | None = None, where: str = "",
               require_match: bool = True, sequence_parallel: bool = False, seq_len: int | None = None,
               seq_inputs: Mapping[str, int] | None = None, last: bool = True, loss_parallel: bool = False,
               replicate: frozenset[str] = frozenset()) -> StageTP:
    """Which modules of ``stage`` (a stage module, its graph annotated with shapes) shard what across ``tp`` ranks.

    ``patterns`` None is ``auto``; else glob over module paths -> ``colwise``/``rowwise``/``replicated`` (the
    first match wins) and anything that cannot be sharded so is refused. ``canonical``: local parameter name
    -> canonical (a :class:`StageModule`'s own by default); ``traced`` locates fx nodes in the user's code;
    ``where`` (e.g. ``" in stage 2"``) goes into messages. Raises a located :class:`FrontendError`.

    ``sequence_parallel``: the regions between a rowwise module and the next colwise one are cut on the
    sequence dim (length ``seq_len``; None: dim 1 of the stage's first input of two dims or more);
    ``seq_inputs`` (stage input name -> dim) arrive as parts; the outputs are gathered whole where ``last``
    (they go to the loss), else sent as parts (:attr:`StageTP.seq_outputs`).

    ``loss_parallel`` (the last stage, under the built-in cross_entropy): a colwise LM head may leave its logits
    split on the classes (:attr:`StageTP.loss_parallel`); ``replicate``: canonical weights auto keeps whole."""
    if tp < 1:
        raise FrontendError(f"tp must be at least 1, got {tp}", key="tp")
    canonical = _canonical_of(stage, canonical)
    if tp == 1:
        return StageTP(tp=1)
    _check_annotated(stage)
    styles = None
    if patterns is not None:
        lins = {n: lin for n in stage.graph.nodes if (lin := _linear_like(n, stage)) is not None}
        styles, matched = _styles_of(stage, lins, patterns, where)
        if require_match and (missing := [p for p in patterns if p not in matched]):
            raise FrontendError(f"tensor_parallel pattern {missing[0]!r} matches no module{where}", key=KEY,
                                hints=("patterns are globs over module paths such as 'blocks.*.attn.qkv'",))
    an, lins = _analyse(stage, tp, styles, canonical, loss_parallel=loss_parallel, replicate=replicate)
    if styles is not None:
        _explicit_failures(an, lins, styles, where, traced)
    for f in an.failures:
        raise _size_refusal(an, f, where, traced)
    if sequence_parallel:
        names = _io_names(stage)[0]
        given = dict(seq_inputs or {})
        sp = _SP(seq_len or _sequence_length(stage, None), {h: given[v] for h, v in names.items() if v in given}, last)
        an = _sp_run(stage, an, sp, where, traced)
    return _record(an, lins, canonical, where=where, traced=traced)


def _sequence_length(stage: GraphModule, traced: Traced | None) -> int:
    """The model input's dim 1 (tokens ``[B, T]``): the traced model's first input of two dims or more, else the
    stage's first such input."""
    shapes = [tuple(t.shape) for t in traced.inputs] if traced is not None and traced.inputs else \
        [_shape(n) or () for n in stage.graph.nodes if n.op == "placeholder"]
    shape = next((sh for sh in shapes if len(sh) >= 2), None)
    if shape is None:
        raise FrontendError("sequence parallelism needs a model input with a sequence dim (dim 1 of tokens [B, T]), "
                            f"got inputs of shapes {[list(sh) for sh in shapes]}", key=SP_KEY,
                            hints=("sequence_parallel off",))
    return int(shape[1])


def _explicit_failures(an: _Analysis, lins: Mapping[Node, _Lin], styles: Mapping[str, str], where: str,
                       traced: Traced | None) -> None:
    hint = "leave the module out of the patterns (replicated), or use tensor_parallel auto"
    for f in an.failures:
        if f.size:
            raise _size_refusal(an, f, where, traced)
        raise _refusal(an.tp, where, f.node, f.reason, traced, (hint,))
    for n, lin in lins.items():
        want, got = styles.get(lin.path, "replicated"), _style(an, n)
        if want != got:
            why = {"rowwise": "its input is sharded on its in-features (by a colwise module before it)",
                   "colwise": "its input is already sharded", "replicated": "its input is not sharded on its in-features",
                   "vocab": "its ids are sharded"}
            raise _refusal(an.tp, where, n, f"{lin.path} is {want} in the patterns, but {why[got]}", traced,
                           (f"make {lin.path} {got}" if got != "colwise" else hint,))


def plan_stages(stages: Sequence[GraphModule], tp: int, *, patterns: Mapping[str, str] | None = None,
                canonical: Mapping[str, str] | None = None, traced: Traced | None = None,
                sequence_parallel: bool = False, loss: str = "cross_entropy") -> list[StageTP]:
    """:func:`plan_stage` for every stage; a pattern matching no module of any stage is refused. A stage needs
    no values: ``GraphModule(split.traced.gm, split.stage_graph(s))`` (meta parameters) will do, with
    ``canonical=split.traced.canonical``. ``sequence_parallel``: the sequence length is the model input's dim 1
    (see :func:`_sequence_length`); a stage output sent as parts arrives as parts at every later stage.
    ``loss``: the plan's; under ``cross_entropy`` the last stage's head may be loss-parallel. In auto, a weight
    tied across stages that one of them keeps whole (a head that is not loss-parallel) is kept whole in all."""
    sp = sequence_parallel and tp > 1
    seq_len = _sequence_length(stages[0], traced) if sp else None
    replicate: frozenset[str] = frozenset()
    while True:
        plans = _plan_each(stages, tp, patterns, canonical, traced, sp, seq_len, loss == "cross_entropy", replicate)
        held = _tied_uses(stages, plans, canonical)
        split = {c for c, by in held.items() if len(set(by.values())) > 1} - replicate
        if patterns is not None or not split:
            break
        replicate |= split
    _check_tied(stages, plans, tp, canonical, held)
    if patterns is not None and tp > 1:
        paths = {m for p in plans for m, _ in p.modules}
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(m, pattern) for m in paths):
                raise FrontendError(f"tensor_parallel pattern {pattern!r} matches no module of any stage", key=KEY,
                                    hints=("patterns are globs over module paths such as 'blocks.*.attn.qkv'",))
    return plans


def _plan_each(stages: Sequence[GraphModule], tp: int, patterns: Mapping[str, str] | None,
               canonical: Mapping[str, str] | None, traced: Traced | None, sp: bool, seq_len: int | None,
               cross_entropy: bool, replicate: frozenset[str]) -> list[StageTP]:
    parts: dict[str, int] = {}
    plans = []
    for s, st in enumerate(stages):
        names = _io_names(st)[0].values()
        last = s == len(stages) - 1
        plans.append(plan_stage(st, tp, patterns=patterns, canonical=canonical, traced=traced, where=f" in stage {s}",
                                require_match=False, sequence_parallel=sp, seq_len=seq_len,
                                seq_inputs={n: parts[n] for n in names if n in parts}, last=last,
                                loss_parallel=last and cross_entropy, replicate=replicate))
        parts.update(plans[-1].seq_outputs)
    return plans


def _tied_uses(stages: Sequence[GraphModule], plans: Sequence[StageTP], canonical: Mapping[str, str] | None,
               of: Callable[[StageTP, str], Any] = StageTP.sharded) -> dict[str, dict[int, Any]]:
    """Canonical parameter -> stage -> ``of(plan, name)``: by default how that stage shards it (None: replicated)."""
    held: dict[str, dict[int, Any]] = {}
    for s, (st, plan) in enumerate(zip(stages, plans)):
        names = _canonical_of(st, canonical)
        for local, _ in st.named_parameters(remove_duplicate=False):
            held.setdefault(names.get(local, local), {})[s] = of(plan, names.get(local, local))
    return held


def _check_tied(stages: Sequence[GraphModule], plans: Sequence[StageTP], tp: int,
                canonical: Mapping[str, str] | None, held: Mapping[str, Mapping[int, ShardedParam | None]]) -> None:
    """A tied parameter's copies sharded alike, and (sequence parallelism) its gradient partial in all or none."""
    partial = _tied_uses(stages, plans, canonical, lambda plan, c: c in plan.partial_params)
    checks = (
        (partial, lambda p: "partial" if p else "whole", SP_KEY, "sequence_parallel off",
         lambda c, how: f"sequence parallelism (tp {tp}): tied parameter {c}'s gradient is a partial sum over the "
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


# ----------------------------------------------------------------------------- parameters


def shard_param(full: torch.Tensor, sp: ShardedParam, tp: int, rank: int) -> torch.Tensor:
    """Tp rank ``rank``'s part of ``full``: part ``rank`` of each of the ``sp.segments`` blocks of ``sp.dim``."""
    n = full.shape[sp.dim]
    if n % (sp.segments * tp):
        raise FrontendError(f"parameter {sp.name} has {n} entries on dim {sp.dim}, not {sp.segments} segments divisible "
                            f"by tp {tp}", key=KEY)
    return torch.cat([b.chunk(tp, dim=sp.dim)[rank] for b in full.chunk(sp.segments, dim=sp.dim)], dim=sp.dim).contiguous()


def unshard(shards: Sequence[torch.Tensor], sp: ShardedParam) -> torch.Tensor:
    """The full tensor from every tp rank's part, in rank order (inverse of :func:`shard_param`)."""
    pieces = [s.chunk(sp.segments, dim=sp.dim) for s in shards]
    return torch.cat([pieces[r][j] for j in range(sp.segments) for r in range(len(shards))], dim=sp.dim)


# ----------------------------------------------------------------------------- the rewrite


def _local(shape: Sequence[int], s: Any, tp: int) -> tuple[int, ...]:
    return tuple(d // tp if isinstance(s, Shard) and i == s.dim else d for i, d in enumerate(shape))


def _rewrite(an: _Analysis, lins: Mapping[Node, _Lin], graph: Graph, env: dict[Node, Node],
             comms: dict[str, tuple[str, int, int]], lookups: dict[str, tuple[int, int | None]]) -> dict[Node, Node]:
    """Rewrite the copy ``graph`` (``env``: original node -> copy) to local sizes; original node -> its result.
    ``comms`` gets the :class:`TPComm` modules the rewrite calls (target -> kind, dim, segments), ``lookups`` the
    :class:`~.tp_comm.VocabLookup` ones (target -> the whole table's rows, its padding_idx)."""
    tp, result = an.tp, dict(env)
    copies: dict[Node, Node] = {}
    made: dict[tuple[Node, str, int, int], Node] = {}

    def comm(kind: str, dim: int = 1, segments: int = 1) -> str:
        name = f"tp_{kind}" if kind in ("copy", "reduce") else f"tp_{kind}_{dim}" + (
            f"_{segments}" if segments > 1 else "")
        comms[name] = (kind, dim, segments)
        return name

    def after(x: Node, kind: str, dim: int = 1, segments: int = 1) -> Node:
        """One ``kind`` collective of original node ``x``'s result, shared by its users."""
        key = (x, kind, dim, segments)
        if key not in made:
            with graph.inserting_after(result[x]):
                made[key] = graph.call_module(comm(kind, dim, segments), (result[x],))
            made[key].meta = dict(x.meta)
        return made[key]

    for n in list(an.gm.graph.nodes):
        new, op = env[n], _op(n)
        x0 = n.args[0] if n.args else None
        s0 = an.of(x0)
        if op in _SHAPE_OF and isinstance(s0, Shard) and isinstance(n.meta.get("pipec_value"), (int, tuple)):
            value = n.meta["pipec_value"]  # a size read off a sharded tensor keeps its full value
            for u in list(new.users):
                u.args = torch.fx.node.map_arg(u.args, lambda a: value if a is new else a)
                u.kwargs = torch.fx.node.map_arg(u.kwargs, lambda a: value if a is new else a)
        elif op in _SIZED_VIEWS and isinstance(s0, Shard):
            local = list(_local(_shape(n), an.of(n), tp))
            if op == "unflatten":
                new.target, new.op = "reshape", "call_method"
            new.args = (new.args[0], *local) if new.op == "call_method" else (new.args[0], local)
            new.kwargs = {}
        elif op == "expand" and isinstance(s0, Shard):
            local = list(_local(_shape(n), an.of(n), tp))
            new.args = (new.args[0], *local) if new.op == "call_method" else (new.args[0], local)
        elif op in ("split", "split_with_sizes") and isinstance(s0, Shard) and isinstance(an.of(n)[0], Shard):
            dim = _norm(int(_arg(n, 2, "dim", 0)), len(_shape(x0)))
            if dim == s0.dim:
                sizes = _value(new.args[1])
                sizes = [int(v) // tp for v in sizes] if isinstance(sizes, (list, tuple)) else int(sizes) // tp
                new.args = (new.args[0], sizes, *new.args[2:])
        lin = lins.get(n)
        if lin is None:
            continue
        sx = an.of(lin.x)
        seq = isinstance(sx, Shard) and sx.seq
        if seq and n.name not in an.active:  # a replicated consumer of a sequence shard: gathered whole
            new.replace_input_with(result[lin.x], after(lin.x, "gather_whole", sx.dim, sx.segments))
        if lin.kind == "embedding":
            if n.name in an.vocab_on:
                result[n] = _lookup(an, graph, new, lin, result[lin.x], comm, lookups)
            continue
        if group := _fused_group(an, lins, lin.x):
            if n is group[0]:  # one GatheredLinear for the group, before its first; each member its output
                with graph.inserting_before(new):
                    params = [graph.get_attr(a) if a else None for m in group for a in (lins[m].weight, lins[m].bias)]
                    y = graph.call_module(comm("gather_linear", sx.dim, sx.segments), (result[lin.x], *params))
                    outs = [y] if len(group) == 1 else [graph.call_function(operator.getitem, (y, i))
                                                         for i in range(len(group))]
                for m, out in zip(group, outs):
                    out.meta = dict(env[m].meta)
                    env[m].replace_all_uses_with(out)
                    graph.erase_node(env[m])
                    result[m] = out
            continue
        if n.name in an.active:
            x = result[lin.x]
            if lin.x not in copies:  # f, or sequence parallelism's all-gather
                copies[lin.x] = after(lin.x, "gather", sx.dim, sx.segments) if seq else after(lin.x, "copy")
            new.replace_input_with(x, copies[lin.x])
            if lin.kind == "conv1d":
                result[n] = _functional(graph, new, lin, copies[lin.x], reduce=None)
        elif n.name in an.rowwise:  # g, or sequence parallelism's reduce-scatter
            out = an.of(n)
            reduce = comm("scatter", out.dim, out.segments) if isinstance(out, Shard) and out.seq else comm("reduce")
            result[n] = _functional(graph, new, lin, result[lin.x], reduce=reduce)
    for (a, u), (d, segs) in an.splits.items():  # replicated operands cut to this rank's positions
        result[u].replace_input_with(result[a], after(a, "split", d, segs))
    out_new = result[next(n for n in an.gm.graph.nodes if n.op == "output")]
    for x, how in an.gathers.items():  # the last stage's outputs, whole for the loss
        if "gather_whole" in how and any(u.op == "output" for u in x.users):
            out_new.replace_input_with(result[x], after(x, "gather_whole", an.of(x).dim, an.of(x).segments))
    return result


def _lookup(an: _Analysis, graph: Graph, new: Node, lin: _Lin, ids: Node, comm: Callable[..., str],
            lookups: dict[str, tuple[int, int | None]]) -> Node:
    """A vocab-parallel embedding ``new`` as this rank's masked lookup, then g (or a reduce-scatter)."""
    if new.op == "call_module":
        mod = resolve(an.gm, lin.path)
        pad = mod.padding_idx
    else:
        aten = isinstance(new.target, torch._ops.OpOverload)
        pad = _value(_arg(new, 2, "padding_idx", -1 if aten else None))
        pad = None if pad is None or (aten and pad == -1) else int(pad)
    name = f"tp_lookup_{len(lookups)}"
    lookups[name] = (int(resolve(an.gm, lin.weight).shape[0]), pad)
    out = an.of(lin.node)
    reduce = comm("scatter", out.dim, out.segments) if isinstance(out, Shard) and out.seq else comm("reduce")
    with graph.inserting_before(new):
        y = graph.call_module(reduce, (graph.call_module(name, (ids, graph.get_attr(lin.weight))),))
    y.meta = dict(new.meta)
    new.replace_all_uses_with(y)
    graph.erase_node(new)
    return y


def _functional(graph: Graph, new: Node, lin: _Lin, x: Node, *, reduce: str | None) -> Node:
    """``new`` (a Linear-like node) as matmul [-> g or reduce-scatter, the ``reduce`` TPComm target] [-> + bias];
    the node that now gives its value."""
    with graph.inserting_before(new):
        if lin.kind in ("linear", "conv1d") and new.op == "call_module":
            w = graph.get_attr(lin.weight)
            y = graph.call_function(F.linear if lin.kind == "linear" else torch.matmul, (x, w))
            bias = graph.get_attr(lin.bias) if lin.bias else None
            add: Any = operator.add
        elif lin.kind == "linear":
            y = graph.call_function(_aten.linear.default, (x, new.args[1]))
            bias, add = _arg(new, 2, "bias"), _aten.add.Tensor
        else:  # addmm(bias, x, w) or mm(x, w)
            y = graph.call_function(_aten.mm.default, (x, new.args[2] if lin.kind == "addmm" else new.args[1]))
            bias, add = (new.args[0] if lin.kind == "addmm" else None), _aten.add.Tensor
        if reduce:
            y = graph.call_module(reduce, (y,))
        if bias is not None:
            y = graph.call_function(add, (y, bias))
    y.meta = dict(new.meta)
    new.replace_all_uses_with(y)
    graph.erase_node(new)
    return y


def shard_stage(stage: GraphModule, plan: StageTP, rank: int, *, group: TPGroup | None = None,
                canonical: Mapping[str, str] | None = None, traced: Traced | None = None, where: str = "",
                check: bool = True) -> GraphModule:
    """Tp rank ``rank``'s copy of ``stage`` (unmodified) as ``plan`` shards it: local sizes, f/g inserted (with
    ``group``; None runs one rank's shapes alone), sharded parameters sliced. A :class:`StageModule` gives a
    StageModule. ``check`` proves the rewrite on fake tensors (see the module doc)."""
    canonical = _canonical_of(stage, canonical)
    if plan.tp == 1:
        return stage
    an, lins = _analyse(stage, plan.tp, dict(plan.modules), canonical, {sp.name: sp.segments for sp in plan.params},
                        loss_parallel=plan.loss_parallel)
    if plan.sequence_parallel and not an.failures:
        given = dict(plan.seq_inputs)
        sp = _SP(plan.seq_len, {h: given[v] for h, v in _io_names(stage)[0].items() if v in given},
                 last=not plan.seq_outputs)
        an = _sp_run(stage, an, sp, where, traced)
    rec = None if an.failures else _record(an, lins, canonical, where=where, traced=traced)
    if rec is None or (rec.params, rec.seq_outputs, rec.partial_params, rec.loss_parallel) != (
            plan.params, plan.seq_outputs, plan.partial_params, plan.loss_parallel):
        raise FrontendError(f"the plan's tensor-parallel sharding{where} does not hold for this stage's graph; "
                            "re-compile the plan", key=KEY)
    graph = Graph()
    graph._codegen = copy.deepcopy(stage.graph._codegen)
    env: dict[Node, Node] = {}
    graph.output(graph.graph_copy(stage.graph, env))
    out_old = next(n for n in stage.graph.nodes if n.op == "output")
    env[out_old] = next(n for n in graph.nodes if n.op == "output")
    comms: dict[str, tuple[str, int, int]] = {}
    lookups: dict[str, tuple[int, int | None]] = {}
    result = _rewrite(an, lins, graph, env, comms, lookups)
    sharded = {sp.name: sp for sp in plan.params}
    fresh: dict[str, nn.Parameter] = {}

    def local(p: nn.Parameter, name: str) -> nn.Parameter:
        canon = canonical.get(name, name)
        if canon not in fresh:  # a replicated one shares the data, not the gradient
            data = shard_param(p.detach(), sharded[canon], plan.tp, rank).clone() if canon in sharded else p.detach()
            fresh[canon] = nn.Parameter(data, requires_grad=p.requires_grad)
        return fresh[canon]

    memo: dict[int, nn.Module] = {}
    attrs: dict[str, Any] = {name: TPComm(kind, dim, size=plan.tp, rank=rank, segments=segs)
                             for name, (kind, dim, segs) in comms.items()}
    attrs.update((name, VocabLookup(rows // plan.tp, rank=rank, padding_idx=pad)) for name, (rows, pad) in lookups.items())
    for n in graph.nodes:
        if n.op not in ("call_module", "get_attr") or n.target in attrs:
            continue
        obj = resolve(stage, str(n.target))
        if isinstance(obj, nn.Module):
            obj = clone_tree(obj, memo)
            for mod_name, mod in obj.named_modules(prefix=str(n.target), remove_duplicate=False):
                for key, p in list(mod._parameters.items()):
                    if p is not None:
                        mod._parameters[key] = local(p, f"{mod_name}.{key}")
        elif isinstance(obj, nn.Parameter):
            obj = local(obj, str(n.target))
        attrs[str(n.target)] = obj
    if isinstance(stage, StageModule):
        gm: GraphModule = StageModule(attrs, graph, stage=stage.stage, input_names=stage.input_names,
                                      output_names=stage.output_names, canonical=stage.canonical,
                                      param_order=stage.param_order)
    else:
        gm = GraphModule(attrs, graph, type(stage).__name__)
    gm.graph.eliminate_dead_code()  # the sizes folded in
    gm.graph.lint()
    gm.recompile()
    if check:
        _prove(an, gm, result, where, traced)
    set_group(gm, group)
    return gm


class _Prop(ShapeProp):
    current: Node | None = None

    def run_node(self, n: Node) -> Any:
        self.current = n
        return super().run_node(n)


def _prove(an: _Analysis, gm: GraphModule, result: Mapping[Node, Node], where: str, traced: Traced | None) -> None:
    """Every original node's value in the rewritten graph has its full shape with the sharded dim / tp."""
    device = next((t.device for t in (*gm.parameters(), *gm.buffers())), torch.device("cpu"))
    inputs = []
    origin = {v: k for k, v in result.items()}
    for n in gm.graph.nodes:
        if n.op == "placeholder":  # a sequence shard arrives as this rank's part
            tm = n.meta["tensor_meta"]
            shape = _local(tuple(int(d) for d in tm.shape), an.state.get(origin.get(n, n)), an.tp)
            inputs.append(torch.zeros(shape, dtype=tm.dtype, device=device))
    prop = _Prop(gm, fake_mode=FakeTensorMode(allow_non_fake_inputs=True))
    prop.extra_traceback = False
    try:
        with quiet_torch():
            prop.propagate(*inputs)
    except Exception as e:  # noqa: BLE001 - a local shape the rewrite got wrong, said where
        node = origin.get(prop.current, prop.current)
        raise _refusal(an.tp, where, node, f"the sharded graph fails here: {type(e).__name__}: "
                       f"{str(e).splitlines()[0] if str(e) else ''}", traced, ()) from None
    live = set(gm.graph.nodes)
    for old, new in result.items():
        full, got = old.meta.get("tensor_meta"), new.meta.get("tensor_meta")
        if new not in live or full is None or got is None:
            continue
        st = an.state.get(old)
        pairs = zip(full, got, st if isinstance(st, tuple) else [None] * len(full)) if isinstance(full, (list, tuple)) \
            else [(full, got, st)]
        for f, g, s in pairs:
            if not isinstance(f, TensorMetadata) or not isinstance(g, TensorMetadata):
                continue
            want = _local(tuple(int(d) for d in f.shape), s, an.tp)
            if tuple(int(d) for d in g.shape) != want:
                raise _refusal(an.tp, where, old, f"the sharded graph gives shape {list(g.shape)} here, not the local "
                               f"{list(want)} (full {list(f.shape)})", traced, ("report this model to pipec",))
