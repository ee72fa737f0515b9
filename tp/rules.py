"""Tensor parallelism's rules, as data: what the dataflow analysis recognises and how each op acts on a shard.

A value of a stage's graph is *replicated* (None) or sharded (:class:`Shard`). The analysis
(:mod:`.analysis`) starts a shard at a Linear-like op (a row of :data:`MODULE_LINEARS` or :data:`OP_LINEARS`:
``nn.Linear`` and its subclasses, HF ``Conv1D`` with its ``[in, out]`` weight, ``F.linear``/``aten.linear``,
the ``aten.addmm``/``mm`` a Conv1D exports to, embeddings) and follows it through the ops of :data:`RULES`
(elementwise ops whose other operands broadcast on the sharded dim, views and reshapes (:func:`map_view`),
transposes, splits of a fused q|k|v into its segments, attention over sharded heads, rotary slicing on other
dims, GQA's expand + reshape or repeat_interleave) and the modules of :data:`MODULE_RULES` (activations, dropout, norms). An op
named nowhere here is not proven to act shard by shard. A new family (a Linear-like module, an op, a module
that acts position by position) is one row here.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import nn
from torch.fx import Node
from torch.fx.passes.shape_prop import TensorMetadata

from pipec.model.trace import STACK_FRAME, Traced, frame_text, module_path, node_frame, user_frame

if TYPE_CHECKING:
    from pipec.tp.analysis import Analysis

__all__ = ["KEY", "Shard", "Lin", "ModuleLinear", "OpLinear", "MODULE_LINEARS", "OP_LINEARS", "linear_like",
           "map_view", "RULES", "MODULE_RULES", "module_rule", "UNARY", "VIEWS", "SIZED_VIEWS", "SPLITS", "SHAPE_OF"]

KEY = "tensor_parallel"
"""The schedule-file key tensor parallelism's refusals name."""


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
class Lin:
    """A Linear-like (or embedding) node: its input, weight and bias attributes, the weight's out-features dim."""

    node: Node
    x: Node
    weight: str
    bias: str | None
    out_dim: int
    path: str
    kind: str
    """``linear`` (call_module or functional), ``conv1d`` (call_module), ``addmm``, ``mm``, ``embedding``."""


# ----------------------------------------------------------------------------- reading the graph


def op_name(node: Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        t = node.target
        if isinstance(t, torch._ops.OpOverload):
            return t.overloadpacket.__name__
        return getattr(t, "__name__", str(t))
    return node.op


def tensor_shape(a: Any) -> tuple[int, ...] | None:
    tm = a.meta.get("tensor_meta") if isinstance(a, Node) else None
    return tuple(int(d) for d in tm.shape) if isinstance(tm, TensorMetadata) else None


def nbytes(node: Node) -> int:
    tm = node.meta.get("tensor_meta")
    n = 1
    for d in tm.shape:
        n *= int(d)
    return n * torch.empty((), dtype=tm.dtype).element_size()


def dtype_name(node: Node) -> str:
    """The traced value's dtype as plan.json writes it (``float32``, ``bfloat16``, ...)."""
    return str(node.meta["tensor_meta"].dtype).removeprefix("torch.")


def arg(node: Node, i: int, name: str, default: Any = None) -> Any:
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def value_of(a: Any) -> Any:
    return a.meta.get("pipec_value", a) if isinstance(a, Node) else a


def output_values(out: Node) -> list[Any]:
    """An output node's values in order."""
    return list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]


def prod(xs: Sequence[int]) -> int:
    p = 1
    for x in xs:
        p *= x
    return p


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def locate(node: Node, traced: Traced | None) -> str:
    """``node 'x' at file:line (in fn: code)``: where the user's code made ``node``, for a refusal."""
    stack = node.meta.get("stack_trace")
    frame = None
    if stack:
        frame = user_frame([traceback.FrameSummary(m["file"], int(m["line"]), m["name"], line=m["code"].strip())
                            for m in STACK_FRAME.finditer(stack)])
    elif traced is not None:
        frame = node_frame(traced, node.name)
    return f"node {node.name!r}" + frame_text(frame)


# ----------------------------------------------------------------------------- the Linear-likes


@dataclass(frozen=True, slots=True)
class ModuleLinear:
    """A module family that runs as a Linear-like op (a call_module): its weight is ``<path>.weight``, its bias
    ``<path>.bias`` where ``has_bias`` and the module has one."""

    kind: str
    """:attr:`Lin.kind`."""
    matches: Callable[[nn.Module], bool]
    """Whether a module is one."""
    out_dim: int
    """The weight's out-features dim; its in-features are the other."""
    has_bias: bool = True


@dataclass(frozen=True, slots=True)
class OpLinear:
    """An op family that runs as a Linear-like op (a call_function) when its weight (and, with ``needs_bias``,
    its bias) is a parameter read by get_attr."""

    kind: str
    """:attr:`Lin.kind`."""
    op: str
    """The op's name (:func:`op_name`): a function's, or an aten overload packet's."""
    operands: Callable[[Node, bool], tuple[Any, Any, Any] | None]
    """The node's (input, weight, bias) arguments (given whether it is an aten op), or None where it is not one."""
    out_dim: int
    """The weight's out-features dim; its in-features are the other."""
    aten_only: bool = False
    needs_bias: bool = False


def _is_conv1d(mod: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2): a Linear with its weight ``[in, out]``, known by its class name (pipec
    does not depend on transformers)."""
    return type(mod).__name__ == "Conv1D" and getattr(mod, "weight", None) is not None and mod.weight.dim() == 2


MODULE_LINEARS: tuple[ModuleLinear, ...] = (
    ModuleLinear("linear", lambda mod: isinstance(mod, nn.Linear), out_dim=0),  # a subclass counts as a Linear
    ModuleLinear("conv1d", _is_conv1d, out_dim=1),
    ModuleLinear("embedding", lambda mod: isinstance(mod, nn.Embedding), out_dim=0, has_bias=False),
)
"""The module families, the first that matches wins."""

OP_LINEARS: tuple[OpLinear, ...] = (
    OpLinear("linear", "linear", lambda n, aten: (n.args[0], arg(n, 1, "weight"), arg(n, 2, "bias")), out_dim=0),
    OpLinear("addmm", "addmm", lambda n, aten: None if n.kwargs else (n.args[1], n.args[2], n.args[0]), out_dim=1,
             aten_only=True, needs_bias=True),  # addmm(bias, x, w): a Conv1D exported
    OpLinear("mm", "mm", lambda n, aten: (n.args[0], n.args[1], None), out_dim=1, aten_only=True),
    OpLinear("embedding", "embedding",  # aten.embedding(weight, ids), F.embedding(ids, weight)
             lambda n, aten: (n.args[1], n.args[0], None) if aten else (n.args[0], n.args[1], None), out_dim=0),
)
"""The op families, by op name."""


def _attr(a: Any) -> str | None:
    return str(a.target) if isinstance(a, Node) and a.op == "get_attr" else None


def _weight_path(node: Node, w: str) -> str:
    """The weight's module (``in_proj`` for an ``in_proj_weight``), or the module the op ran in where the
    weight belongs elsewhere (a tied weight: GPT-2's token embedding reads ``lm_head.weight``)."""
    owner, _, name = w.rpartition(".")
    own = owner if name == "weight" else f"{owner}.{name.removesuffix('_weight')}" if owner else name
    ran = module_path(node)
    return own if not ran or owner == ran or owner.startswith(ran + ".") else ran


def linear_like(node: Node, root: nn.Module) -> Lin | None:
    """``node`` as a Linear-like op of :data:`MODULE_LINEARS` or :data:`OP_LINEARS`, or None."""
    if node.op == "call_module":
        t = str(node.target)
        mod = root.get_submodule(t)
        family = next((f for f in MODULE_LINEARS if f.matches(mod)), None)
        if family is None:
            return None
        bias = f"{t}.bias" if family.has_bias and getattr(mod, "bias", None) is not None else None
        return Lin(node, node.args[0], f"{t}.weight", bias, family.out_dim, t, family.kind)
    if node.op != "call_function":
        return None
    aten, op = isinstance(node.target, torch._ops.OpOverload), op_name(node)
    family = next((f for f in OP_LINEARS if f.op == op and (aten or not f.aten_only)), None)
    operands = family.operands(node, aten) if family is not None else None
    if operands is None:
        return None
    x, w, b = operands
    weight, bias = _attr(w), _attr(b)
    if weight is None or (family.needs_bias and bias is None):
        return None
    return Lin(node, x, weight, bias, family.out_dim, _weight_path(node, weight), family.kind)


def map_view(shape: Sequence[int], dim: int, segments: int, out: Sequence[int]) -> tuple[int, int, int] | None:
    """Where a reshape from ``shape`` to ``out`` takes a value sharded on ``dim`` (``segments`` blocks):
    ``(out dim, its segments, the size each segment has there)``, or None where the shard's elements do not
    land on one dimension. The flat index is ``outer * inner + r`` with the tp parts cut in ``r``; the output
    dim ``j`` must split the same way: ``prod(out[:j]) * segments' == outer`` and ``m * prod(out[j+1:]) ==
    inner`` with ``out[j] == segments' * m``; the shard is then valid when tp divides ``m``."""
    if shape[dim] % segments:
        return None
    outer, inner = prod(shape[:dim]) * segments, shape[dim] // segments * prod(shape[dim + 1:])
    for j in range(len(out)):
        p, q = prod(out[:j]), prod(out[j + 1:])
        if not p or not q or outer % p or inner % q:
            continue
        s, m = outer // p, inner // q
        if out[j] == s * m and m > 1:
            return j, s, m
    return None


# ----------------------------------------------------------------------------- the op rules


UNARY = {"to", "type", "type_as", "float", "half", "bfloat16", "contiguous", "clone", "detach", "alias", "dropout",
         "_to_copy", "lift_fresh_copy", "native_dropout", "feature_dropout"}
_ELEMENTWISE = {"add", "sub", "mul", "div", "truediv", "pow", "neg", "gelu", "silu", "relu", "tanh", "sigmoid", "exp",
                "log", "rsqrt", "sqrt", "erf", "abs", "clamp", "masked_fill", "where", "eq", "ne", "lt", "le", "gt", "ge",
                "iadd", "imul", "rsub", "reciprocal", "square", "softplus", "leaky_relu", "elu", "mish", "hardtanh",
                "__and__", "__or__", "logical_not", "bitwise_not", "cos", "sin", "floordiv", "mod"}
VIEWS = {"view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze"}
SIZED_VIEWS = {"view", "reshape", "_unsafe_view", "unflatten"}
SPLITS = {"split", "split_with_sizes", "chunk", "unbind", "tensor_split"}
SHAPE_OF = {"getattr", "size", "dim", "sym_size", "numel", "_assert_tensor_metadata", "sym_numel"}
"""Ops that read a shape: no rule (the rewrite folds in the full value)."""
_DIM_OPS = {"softmax", "log_softmax", "_softmax", "_log_softmax", "cumsum", "cumprod"}
_REDUCTIONS = {"mean", "sum", "amax", "amin", "var", "std", "logsumexp", "norm"}


def _elementwise(an: Analysis, n: Node, ins: list[tuple[Node, Shard]]) -> Any:
    out = tensor_shape(n)
    shards = [s for _, s in ins]
    if out is None:
        return an.fail(n, shards, f"{op_name(n)} makes no tensor of a sharded one")
    dims = {len(out) - len(tensor_shape(a)) + s.dim for a, s in ins}
    segs = {s.segments for s in shards}
    if len(dims) != 1 or len(segs) != 1:
        return an.fail(n, shards, "its operands are sharded on different dimensions")
    d = dims.pop()
    for a in n.all_input_nodes:
        sh = tensor_shape(a)
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


def _unary(an: Analysis, n: Node, ins: list[tuple[Node, Shard]]) -> Any:
    s = an.of(n.args[0])
    if not isinstance(s, Shard) or len(ins) > 1:
        return _elementwise(an, n, ins)
    return s


def _view(an: Analysis, n: Node, ins: list[tuple[Node, Shard]]) -> Any:
    x, s = ins[0]
    if x is not n.args[0]:
        return an.fail(n, [s], "a sharded tensor gives the shape of a view")
    shape, out = tensor_shape(x), tensor_shape(n)
    mapped = map_view(shape, s.dim, s.segments, out)
    if mapped is None:
        return an.fail(n, [s], f"the view {list(shape)} -> {list(out)} mixes the sharded dimension {s.dim} with others")
    j, segs, m = mapped
    if m % an.tp:
        an.fail(n, [s], f"the view {list(shape)} -> {list(out)} cuts the sharded features into {out[j]} parts "
                        f"(attention heads, where it splits heads), and {m} is not divisible by tp {an.tp}",
                size=True, hint=f"use a tp that divides {m}", count=m)
    return replace(s, dim=j, segments=segs)


def _transpose(an: Analysis, n: Node, ins: list[tuple[Node, Shard]]) -> Any:
    s, nd = ins[0][1], len(tensor_shape(n.args[0]))
    if op_name(n) in ("t", "numpy_T"):
        perm = [1, 0] if nd == 2 else [0]
    elif op_name(n) == "permute":
        dims = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (list, tuple)) else n.args[1:]
        perm = [norm_dim(int(d), nd) for d in dims]
    else:
        a, b = norm_dim(int(n.args[1]), nd), norm_dim(int(n.args[2]), nd)
        perm = list(range(nd))
        perm[a], perm[b] = b, a
    return replace(s, dim=perm.index(s.dim))


def _expand(an: Analysis, n: Node, ins: list[tuple[Node, Shard]]) -> Any:
    s, shape, out = ins[0][1], tensor_shape(n.args[0]), tensor_shape(n)
    d = s.dim + len(out) - len(shape)
    if shape[s.dim] != out[d]:
        return an.fail(n, [s], "it expands the sharded dimension")
    return replace(s, dim=d)


def _repeat_interleave(an: Analysis, n: Node, ins: list[tuple[Node, Shard]]) -> Any:
    """``x.repeat_interleave(r, dim)`` (grouped-query attention's kv heads, each repeated for its q heads): every
    entry of ``dim`` repeated ``r`` times in place, so each block of the sharded dim keeps its tp parts in order
    (rank t's kv heads give exactly its q heads); ``r`` an int, the local tensor takes the same ``r``."""
    x, s = ins[0]
    reps, dim = arg(n, 1, "repeats"), arg(n, 2, "dim")
    if x is not n.args[0] or not isinstance(value_of(reps), int) or dim is None or arg(n, 3, "output_size") is not None:
        return an.fail(n, [s], "it repeats a sharded tensor by a tensor of counts, flattened, or to a given size")
    return s


def _split(an: Analysis, n: Node, ins: list[tuple[Node, Shard]]) -> Any:
    s, shape = ins[0][1], tensor_shape(n.args[0])
    pieces = [tuple(int(d) for d in tm.shape) for tm in n.meta["tensor_meta"]]
    dim = norm_dim(int(arg(n, 1 if op_name(n) == "unbind" else 2, "dim", 0)), len(shape))
    if op_name(n) == "unbind":
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
    start, stop, step = value_of(start), value_of(stop), value_of(step)
    return start in (None, 0) and step in (None, 1) and (stop is None or (isinstance(stop, int) and stop >= size))


def _index(an: Analysis, n: Node, ins: list[tuple[Node, Shard]]) -> Any:
    x, s = n.args[0], an.of(n.args[0])
    if not isinstance(s, Shard):
        return an.fail(n, [sh for _, sh in ins], "a sharded tensor indexes another")
    idx = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
    shape = tensor_shape(x)
    if any(isinstance(e, Node) and tensor_shape(e) is not None for e in idx):
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


def _slice(an: Analysis, n: Node, ins: list[tuple[Node, Shard]]) -> Any:
    s, shape = ins[0][1], tensor_shape(n.args[0])
    if op_name(n) == "select":
        dim = norm_dim(int(n.args[1]), len(shape))
        if dim == s.dim:
            return an.fail(n, [s], "it selects from the sharded dimension")
        return replace(s, dim=s.dim - (dim < s.dim))
    dim = norm_dim(int(arg(n, 1, "dim", 0)), len(shape))
    if dim == s.dim and not _full_slice(arg(n, 2, "start"), arg(n, 3, "end"), arg(n, 4, "step", 1), shape[dim]):
        return an.fail(n, [s], "it slices the sharded dimension")
    return s


def _cat(an: Analysis, n: Node, ins: list[tuple[Node, Shard]]) -> Any:
    parts = list(n.args[0])
    states = [an.of(p) for p in parts]
    shards = [s for _, s in ins]
    if any(not isinstance(st, Shard) for st in states) or len({(st.dim, st.segments) for st in states}) != 1:
        return an.fail(n, shards, "it concatenates sharded with replicated (or differently sharded) tensors")
    dim = norm_dim(int(arg(n, 1, "dim", 0)), len(tensor_shape(n)))
    if dim == states[0].dim:
        return an.fail(n, shards, "it concatenates along the sharded dimension")
    return replace(states[0], sources=frozenset().union(*(s.sources for s in shards)))


def _attention(an: Analysis, n: Node, ins: list[tuple[Node, Shard]]) -> Any:
    q, k, v = n.args[:3]
    states = [an.of(t) for t in (q, k, v)]
    shards = [s for _, s in ins]
    nd = len(tensor_shape(q))
    if any(isinstance(st, Shard) and st.seq for st in states):
        return an.fail(n, shards, "attention mixes the positions of a sequence shard")
    if any(not isinstance(st, Shard) for st in states) or len({st.dim for st in states}) != 1 or states[0].dim >= nd - 2:
        return an.fail(n, shards, "attention needs q, k and v all sharded on their heads dimension")
    d = states[0].dim
    mask = arg(n, 3, "attn_mask")
    if isinstance(mask, Node) and (ms := tensor_shape(mask)) is not None:
        m_state, k_dim = an.of(mask), d - (nd - len(ms))
        if m_state is None and 0 <= k_dim < len(ms) and ms[k_dim] != 1:
            return an.fail(n, shards, "its mask is replicated with one entry per head (it does not broadcast on heads)")
        if isinstance(m_state, Shard) and m_state.dim != k_dim:
            return an.fail(n, shards, "its mask is sharded on another dimension than the heads")
    return Shard(d, 1, frozenset().union(*(s.sources for s in shards)))


def _matmul(an: Analysis, n: Node, ins: list[tuple[Node, Shard]]) -> Any:
    x, y = n.args[:2]
    sx, sy, out = an.of(x), an.of(y), tensor_shape(n)
    shards = [s for _, s in ins]
    nx, ny, no = len(tensor_shape(x)), len(tensor_shape(y)), len(out)
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
            sh = tensor_shape(t)
            k = d - (no - len(sh))
            if s is None and 0 <= k < len(sh) and sh[k] != 1:
                return an.fail(n, shards, f"operand {t.name!r} is replicated on the sharded batch dimension")
    return replace(shards[0], dim=d, sources=frozenset().union(*(s.sources for s in shards)))


def _along(an: Analysis, n: Node, ins: list[tuple[Node, Shard]]) -> Any:
    s, shape = ins[0][1], tensor_shape(n.args[0])
    if norm_dim(int(arg(n, 1, "dim", -1)), len(shape)) == s.dim:
        return an.fail(n, [s], f"{op_name(n)} runs along the sharded dimension")
    return s


def _reduce(an: Analysis, n: Node, ins: list[tuple[Node, Shard]]) -> Any:
    s, shape = ins[0][1], tensor_shape(n.args[0])
    dims = arg(n, 1, "dim")
    if dims is None or isinstance(dims, Node):
        return an.fail(n, [s], f"{op_name(n)} reduces over every dimension, the sharded one too")
    dims = {norm_dim(int(d), len(shape)) for d in (dims if isinstance(dims, (list, tuple)) else (dims,))}
    if s.dim in dims:
        return an.fail(n, [s], f"{op_name(n)} reduces over the sharded dimension")
    keep = arg(n, 2, "keepdim", False)
    return replace(s, dim=s.dim if keep else s.dim - sum(d < s.dim for d in dims))


def _normalize(an: Analysis, n: Node, ins: list[tuple[Node, Shard]], num_dims: int | None = None) -> Any:
    s, shape = ins[0][1], tensor_shape(n.args[0])
    if an.of(n.args[0]) is not s or len(ins) > 1:
        return an.fail(n, [x for _, x in ins], "its weight or bias is sharded")
    if num_dims is None:
        num_dims = len(arg(n, 1, "normalized_shape"))
    if s.dim >= len(shape) - num_dims:
        return an.fail(n, [s], "it normalises over the sharded dimension")
    return s


RULES: dict[str, Callable[[Analysis, Node, list], Any]] = {
    **{op: _unary for op in UNARY}, **{op: _elementwise for op in _ELEMENTWISE}, **{op: _view for op in VIEWS},
    **{op: _split for op in SPLITS}, **{op: _along for op in _DIM_OPS}, **{op: _reduce for op in _REDUCTIONS},
    "transpose": _transpose, "permute": _transpose, "t": _transpose, "expand": _expand, "getitem": _index,
    "repeat_interleave": _repeat_interleave,
    "slice": _slice, "select": _slice, "cat": _cat, "scaled_dot_product_attention": _attention,
    "matmul": _matmul, "bmm": _matmul, "mm": _matmul, "layer_norm": _normalize, "rms_norm": _normalize,
}
"""Op name -> its rule for sharded inputs: the output's state, or a failure (an op not named is not proven)."""


# ----------------------------------------------------------------------------- the module rules


_ELEMENTWISE_MODULES = (nn.Dropout, nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Identity)


def _is_norm(mod: nn.Module) -> bool:
    """A norm over its trailing dims (LayerNorm, RMSNorm and their look-alikes; GroupNorm mixes channels)."""
    return getattr(mod, "normalized_shape", None) is not None and not isinstance(mod, nn.GroupNorm)


def _norm_module(an: Analysis, n: Node, ins: list[tuple[Node, Shard]], mod: nn.Module) -> Any:
    if ins[0][0] is not n.args[0]:
        return _unknown_module(an, n, ins, mod)
    shape = mod.normalized_shape
    return _normalize(an, n, ins, len(tuple(shape) if not isinstance(shape, int) else (shape,)))


def _unknown_module(an: Analysis, n: Node, ins: list[tuple[Node, Shard]], mod: nn.Module) -> Any:
    return an.fail(n, [s for _, s in ins],
                   f"module {n.target} ({type(mod).__name__}) is not known to act shard by shard")


MODULE_RULES: tuple[tuple[Callable[[nn.Module], bool], Callable[[Analysis, Node, list, nn.Module], Any]], ...] = (
    (lambda mod: isinstance(mod, _ELEMENTWISE_MODULES), lambda an, n, ins, mod: _elementwise(an, n, ins)),
    (_is_norm, _norm_module),
)
"""(whether a module is one, its rule) for a call_module with sharded inputs, the first that matches wins; a
module none matches (and no Linear-like) is not proven."""


def module_rule(an: Analysis, n: Node, ins: list[tuple[Node, Shard]]) -> Any:
    """The state of call_module ``n``'s output, its inputs ``ins`` sharded: by the first of :data:`MODULE_RULES`."""
    mod = an.gm.get_submodule(str(n.target))
    rule = next((rule for matches, rule in MODULE_RULES if matches(mod)), _unknown_module)
    return rule(an, n, ins, mod)
