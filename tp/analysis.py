"""Tensor parallelism for one pipeline stage: which modules shard which dimension, found by a dataflow analysis.

:func:`plan_stage` runs over a stage's traced graph (fx or torch.export): every tensor value is *replicated*
(None) or *sharded* (:class:`~.rules.Shard`: dimension ``dim`` is ``segments`` equal blocks, each cut into tp
contiguous parts). A Linear-like op (:data:`~.rules.MODULE_LINEARS`, :data:`~.rules.OP_LINEARS`) on a
replicated input starts a *colwise* candidate (its output sharded on the last dim); the shard is followed
through the ops the rules prove to act shard by shard (:data:`~.rules.RULES`, :data:`~.rules.MODULE_RULES`)
to a Linear-like op on an input sharded on its in-features, which is *rowwise*: its output is a partial sum,
all-reduced (Megatron's g) before its bias. In ``auto`` a candidate whose shard reaches anything else (the
stage's output, an op not proven) is replicated, and the analysis runs again until it holds; sizes that do
not divide by tp (heads, kv heads) are refused, located. With ``patterns`` (glob over module paths -> style)
every failure is refused. With sequence parallelism the decided analysis runs once more (:mod:`.sequence`);
:mod:`.record` turns it into the stage's :class:`~pipec.compiler.ir.tensor_parallel.StageTP`, and
:func:`plan_stages` checks the parameters tied across stages (:func:`~.record.check_tied`).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch.fx import GraphModule, Node

from pipec.compiler.ir.tensor_parallel import STYLES, ShardedParam, StageTP
from pipec.model.stages import resolve
from pipec.model.tensors import FrontendError
from pipec.model.trace import Traced
from pipec.tp.partial import grad_outputs
from pipec.tp.record import canonical_of, check_tied, record, tied_uses
from pipec.tp.rules import (KEY, RULES, SHAPE_OF, SIZED_VIEWS, SPLITS, UNARY, VIEWS, Lin, Shard, arg, linear_like,
                            locate, map_view, module_rule, norm_dim, op_name, output_values, tensor_shape)
from pipec.tp.sequence import SP, io_names, sequence_length, sp_run

__all__ = ["Analysis", "analyse", "refusal", "plan_stage", "plan_stages", "replicated_warnings"]


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


class Analysis:
    """One pass of the dataflow analysis with a fixed set of colwise candidates (see the module doc)."""

    def __init__(self, gm: GraphModule, tp: int, lins: Mapping[Node, Lin], colwise: set[str],
                 segments: Mapping[str, int], sp: SP | None = None, *, vocab: set[str] = frozenset(),
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
        self.stopped: dict[str, _Failure] = {}
        """Auto's fixpoint (:func:`analyse`): each candidate it replicated -> the failure that stopped it."""

    def run(self) -> "Analysis":
        for n in self.gm.graph.nodes:
            self.state[n] = self._rule(n)
        return self

    def of(self, a: Any) -> Any:
        return self.state.get(a) if isinstance(a, Node) else None

    def fail(self, n: Node, shards: Sequence[Shard], reason: str, *, size: bool = False, hint: str = "",
             count: int = 0) -> None:
        self.failures.append(_Failure(n, frozenset().union(*(s.sources for s in shards)), reason, size, hint, count))
        return None

    def again(self, sp: SP) -> "Analysis":
        """This analysis run once more over its decided modules, with sequence parallelism ``sp``."""
        return Analysis(self.gm, self.tp, self.lins, self.colwise, self.segments, sp, vocab=self.vocab,
                        loss_parallel=self.loss_parallel).run()

    def style(self, n: Node) -> str:
        """The style this analysis gives Linear-like node ``n``."""
        return ("colwise" if n.name in self.active else "rowwise" if n.name in self.rowwise else
                "vocab" if n.name in self.vocab_on else "replicated")

    def param_uses(self, canonical: Mapping[str, str]) -> dict[str, dict[ShardedParam | None, list[Node]]]:
        """Canonical parameter -> how each use shards it (None: replicated) -> the nodes using it so."""
        uses: dict[str, dict[ShardedParam | None, list[Node]]] = {}

        def use(target: str, sp: ShardedParam | None, n: Node) -> None:
            name = canonical.get(target, target)
            how = None if sp is None else ShardedParam(name=name, dim=sp.dim, segments=sp.segments)
            uses.setdefault(name, {}).setdefault(how, []).append(n)

        for n, lin in self.lins.items():
            segs = self.segments.get(n.name, 1)
            if n.name in self.active:
                use(lin.weight, ShardedParam(name="", dim=lin.out_dim, segments=segs), n)
                if lin.bias:
                    use(lin.bias, ShardedParam(name="", dim=0, segments=segs), n)
            elif n.name in self.rowwise:
                use(lin.weight, ShardedParam(name="", dim=1 - lin.out_dim, segments=self.rowwise[n.name]), n)
                if lin.bias:
                    use(lin.bias, None, n)
            elif n.name in self.vocab_on:
                use(lin.weight, ShardedParam(name="", dim=0), n)
            else:
                use(lin.weight, None, n)
                if lin.bias:
                    use(lin.bias, None, n)
        for n in self.gm.graph.nodes:
            if n.op == "get_attr" and any(u not in self.lins for u in n.users):
                use(str(n.target), None, n)
            elif n.op == "call_module" and n not in self.lins:
                for pname, _ in self.gm.get_submodule(str(n.target)).named_parameters(prefix=str(n.target)):
                    use(pname, None, n)
        return uses

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
        op = op_name(n)
        if op == "getitem":
            base = self.of(n.args[0])
            if isinstance(base, tuple):
                return base[n.args[1]]
        if not ins:
            return tuple(None for _ in n.meta["tensor_meta"]) if op in SPLITS and isinstance(
                n.meta.get("tensor_meta"), (tuple, list)) else None
        shards = [s for _, s in ins]
        if n.op == "call_module":
            return module_rule(self, n, ins)
        if op in SHAPE_OF:
            return None  # the shape's full value is folded in by the rewrite
        rule = RULES.get(op)
        if rule is None:
            return self.fail(n, shards, f"{op} is not known to act shard by shard on {ins[0][0].name!r}, which is sharded")
        return rule(self, n, ins)

    def _seq_outputs(self, n: Node, ins: list[tuple[Node, Shard]]) -> None:
        """Sequence-sharded stage outputs: all-gathered whole for the loss (the last stage), else sent as parts."""
        flat = output_values(n)
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
        flat = output_values(n)
        (a, s), shape = ins[0], tensor_shape(ins[0][0])
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
            return self.fail(n, [Shard(0, 1, frozenset({n.name}), seq=True)], f"its output {list(tensor_shape(n))} "
                             f"has no dimension of the sequence length {self.sp.length}")
        return Shard(found[0], found[1], frozenset({n.name}), seq=True)

    def seq_dim(self, n: Node) -> tuple[int, int] | None:
        """The sequence dim of a rowwise output and its segments: the dim of the sequence length (dim 1 where
        several are), or a 2-D ``[B T, features]`` (a Linear run on the flattened batch: HF's Conv1D), whose
        dim 0 is B blocks of the T positions."""
        shape = tensor_shape(n)
        dims = [i for i, d in enumerate(shape[:-1]) if d == self.sp.length]
        if dims:
            return (1 if 1 in dims else dims[0], 1) if 1 in dims or len(dims) == 1 else None
        if len(shape) == 2 and shape[0] % self.sp.length == 0:
            return 0, shape[0] // self.sp.length
        return None

    def _linear(self, n: Node, lin: Lin) -> Any:
        s, out, xs = self.of(lin.x), tensor_shape(n), tensor_shape(lin.x)
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


# ----------------------------------------------------------------------------- deciding


def _segment_choices(node: Node, tp: int) -> list[int]:
    """How many equal blocks a colwise candidate's output may be, the likeliest first: 3 for a fused q|k|v
    split into q, k, v (or viewed as ``[..., 3, features]`` and selected from, as nn.MultiheadAttention does), else 1."""
    cur, features = node, tensor_shape(node)[-1]
    while len(cur.users) == 1 and op_name(next(iter(cur.users))) in VIEWS | UNARY:
        nxt = next(iter(cur.users))
        if tensor_shape(nxt) is None or tensor_shape(nxt)[-1] != features:
            break
        cur = nxt
    choices = []
    nd = len(tensor_shape(cur))
    for u in cur.users:
        if op_name(u) in ("split", "split_with_sizes", "chunk") and isinstance(u.meta.get("tensor_meta"), (tuple, list)):
            if norm_dim(int(arg(u, 2, "dim", 0)), nd) == nd - 1:
                sizes = {int(tm.shape[-1]) for tm in u.meta["tensor_meta"]}
                if len(sizes) == 1:
                    choices.append(len(u.meta["tensor_meta"]))
        elif op_name(u) in SIZED_VIEWS and tensor_shape(u) is not None:
            mapped = map_view(tensor_shape(cur), nd - 1, 1, tensor_shape(u))
            if mapped is not None and 1 < (k := tensor_shape(u)[mapped[0]]) < features:
                choices.append(k)
    choices = [k for k in dict.fromkeys([*choices[:1], 1, *choices[1:]]) if features % (k * tp) == 0 or k == 1]
    return choices


def _check_params(an: Analysis, canonical: Mapping[str, str]) -> None:
    for name, by in an.param_uses(canonical).items():
        if len(by) > 1:
            nodes = [n for sp, ns in by.items() if sp is not None for n in ns]
            an.fail(nodes[0], [Shard(0, 1, frozenset(m.name for m in nodes if m.name in an.active | an.vocab_on)),
                               *(an.of(an.lins[m].x) for m in nodes if isinstance(an.of(an.lins[m].x), Shard))],
                    f"parameter {name} is used sharded here and replicated (or sharded otherwise) elsewhere (a tied weight)")


def analyse(gm: GraphModule, tp: int, styles: Mapping[str, str] | None, canonical: Mapping[str, str],
            segments: Mapping[str, int] | None = None, *, loss_parallel: bool = False,
            replicate: frozenset[str] = frozenset()) -> tuple[Analysis, Mapping[Node, Lin]]:
    """The analysis run to its fixpoint: ``styles`` None is auto (candidates that fail are replicated); a
    candidate that fails first tries its other segment counts. ``segments`` (canonical weight -> segments, a
    plan's record) fixes them. ``loss_parallel``: the stage's output may leave split on its class dim (auto
    leaves a head whose classes tp does not divide replicated); ``replicate``: canonical weights kept whole
    (a weight tied to a stage that keeps it so)."""
    lins = {n: lin for n in gm.graph.nodes if (lin := linear_like(n, gm)) is not None}
    choices = {n.name: ([segments.get(canonical.get(lin.weight, lin.weight), 1)] if segments is not None
                        else _segment_choices(n, tp)) for n, lin in lins.items() if lin.kind != "embedding"}
    pick = dict.fromkeys(choices, 0)
    kept = {n.name for n, lin in lins.items() if canonical.get(lin.weight, lin.weight) in replicate}
    if styles is not None:
        cands = {n.name for n, lin in lins.items() if styles.get(lin.path) == "colwise"}
        vocab = {n.name for n, lin in lins.items() if styles.get(lin.path) == "vocab"}
    else:
        classes = _class_dim(gm) if loss_parallel else None
        cands = {n.name for n in lins if n.name in choices and (classes is None or tensor_shape(n)[-1] % tp == 0
                                                                 or tensor_shape(n)[-1] != classes)}
        vocab = {n.name for n, lin in lins.items() if _vocab_candidate(gm, lin, tp)}
    off: set[str] = set(kept)
    stopped: dict[str, _Failure] = {}
    while True:
        an = Analysis(gm, tp, lins, cands - off, {c: choices[c][pick[c]] for c in choices}, vocab=vocab - off,
                      loss_parallel=loss_parallel).run()
        _check_params(an, canonical)
        bad = frozenset().union(*(f.sources for f in an.failures if not f.size)) - off
        retry = {b for b in bad if b in pick and pick[b] + 1 < len(choices[b])}
        for b in retry:
            pick[b] += 1
        if not bad or (styles is not None and not retry):
            an.stopped = stopped
            return an, lins
        if styles is None:
            for b in bad - retry:
                stopped[b] = next(f for f in an.failures if not f.size and b in f.sources)
            off |= bad - retry


def _class_dim(gm: GraphModule) -> int | None:
    """The last dim of the stage's one output (the classes the loss takes), or None."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    flat = output_values(out)
    shape = tensor_shape(flat[0]) if len(flat) == 1 else None
    return shape[-1] if shape else None


def _vocab_candidate(gm: GraphModule, lin: Lin, tp: int) -> bool:
    """An embedding auto makes vocab-parallel: of token ids the stage is given (a placeholder, through views),
    its rows divisible by tp, no max_norm (positions from an arange stay replicated: no all-reduce for them)."""
    if lin.kind != "embedding":
        return False
    x = lin.x
    while isinstance(x, Node) and x.op != "placeholder" and op_name(x) in VIEWS | UNARY:
        x = x.args[0]
    if not isinstance(x, Node) or x.op != "placeholder":
        return False
    weight = resolve(gm, lin.weight)
    if weight.dim() != 2 or weight.shape[0] % tp:
        return False
    if lin.node.op == "call_module":
        return getattr(gm.get_submodule(lin.path), "max_norm", None) is None
    return isinstance(lin.node.target, torch._ops.OpOverload) or arg(lin.node, 3, "max_norm") is None


# ----------------------------------------------------------------------------- refusals, located


def refusal(tp: int, where: str, node: Node, reason: str, traced: Traced | None, hints: Sequence[str]) -> FrontendError:
    return FrontendError(f"tensor parallelism (tp {tp}){where} cannot shard {locate(node, traced)}: {reason}", key=KEY,
                         hints=tuple(h for h in hints if h))


def _size_refusal(an: Analysis, f: _Failure, where: str, traced: Traced | None) -> FrontendError:
    """A size that does not divide; grouped-query attention with fewer kv heads than tp said as that."""
    src = next((n for n in an.lins if n.name in f.sources), None)
    if src is not None and f.count:
        x, m = an.lins[src].x, f.count
        siblings = [n for n, lin in an.lins.items() if lin.x is x and n is not src]
        if m < an.tp and any(tensor_shape(n)[-1] > tensor_shape(src)[-1] for n in siblings):
            return refusal(an.tp, where, f.node, f"grouped-query attention has {m} kv heads, fewer than tp {an.tp}: each "
                           "rank needs whole kv heads", traced,
                           (f"use a tp that divides {m} (the kv heads), or replicate the attention with tensor_parallel "
                            "patterns",))
    return refusal(an.tp, where, f.node, f.reason, traced, (f.hint,))


# ----------------------------------------------------------------------------- what auto leaves replicated


_RESIDUAL = {"add", "sub", "iadd", "output"}


def _feeds_residual(n: Node, f: _Failure) -> bool:
    """Whether candidate ``n``'s shard stopped straight after it (through views and casts), at a residual add
    or the stage's output: a Linear that is only ever a pair's second half (an attention's output projection,
    an MLP's down projection, an LM head), replicated because nothing before it is split. Its pair's first
    half says why."""
    cur = n
    while len(cur.users) == 1 and op_name(nxt := next(iter(cur.users))) in VIEWS | UNARY:
        cur = nxt
    return f.node in cur.users and op_name(f.node) in _RESIDUAL or f.node is cur and op_name(cur) in _RESIDUAL


def replicated_warnings(an: Analysis, tp: int, where: str, traced: Traced | None) -> list[str]:
    """One line per group of Linear-likes that auto replicated (:attr:`Analysis.stopped`) and that no other
    style took (a candidate turned down as colwise can still be rowwise), grouped by the op and source line
    that stopped them: their module paths (each layer's index a ``*``), the node, where, and why. Embeddings
    and the Linears that only feed a residual (:func:`_feeds_residual`) are not said."""
    groups: dict[tuple[str, str], tuple[_Failure, list[str]]] = {}
    for n in an.lins:
        f = an.stopped.get(n.name)
        if f is None or an.lins[n].kind == "embedding" or an.style(n) != "replicated" or _feeds_residual(n, f):
            continue
        key = (locate(f.node, traced).partition(" at ")[2] or f.node.name, op_name(f.node))
        groups.setdefault(key, (f, []))[1].append(an.lins[n].path)
    out = []
    for f, paths in groups.values():
        shown = list(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", p) for p in paths))
        count = f" ({len(paths)} modules)" if len(paths) > len(shown) else ""
        out.append(f"tensor_parallel auto (tp {tp}){where} leaves {', '.join(shown)}{count} replicated: stopped at "
                   f"{locate(f.node, traced)}: {f.reason}")
    return out


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


def _styles_of(gm: GraphModule, lins: Mapping[Node, Lin], patterns: Mapping[str, str], where: str) -> tuple[dict[str, str], set[str]]:
    styles: dict[str, str] = {}
    matched: set[str] = set()
    paths = _module_paths(gm)
    for pattern, style in patterns.items():
        if style not in STYLES:
            raise FrontendError(f"tensor_parallel pattern {pattern!r}: style must be one of {', '.join(STYLES)}, got "
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


def _check_annotated(stage: GraphModule) -> None:
    for n in stage.graph.nodes:
        if n.op in ("placeholder", "get_attr", "call_module") and "tensor_meta" not in n.meta:
            raise FrontendError(f"node {n.name!r} of the stage's graph has no shape; annotate the traced graph "
                                "(annotate.propagate) before it is split, so that the sharding pass can read shapes")


def plan_stage(stage: GraphModule, tp: int, *, patterns: Mapping[str, str] | None = None,
               canonical: Mapping[str, str] | None = None, traced: Traced | None = None, where: str = "",
               require_match: bool = True, sequence_parallel: bool = False, seq_len: int | None = None,
               seq_inputs: Mapping[str, int] | None = None, last: bool = True, loss_parallel: bool = False,
               replicate: frozenset[str] = frozenset(), grad_inputs: Iterable[str] | None = None,
               warnings: list[str] | None = None) -> StageTP:
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
    split on the classes (:attr:`StageTP.loss_parallel`); ``replicate``: canonical weights auto keeps whole;
    ``grad_inputs``: the stage inputs whose gradient goes back to an earlier stage (None: every floating one),
    which a partial gradient (:attr:`StageTP.partial_params`) must not reach. ``warnings`` (auto) gets one line
    per group of Linear-likes auto leaves replicated, naming them, the node that stopped them and its source
    line (:func:`replicated_warnings`)."""
    if tp < 1:
        raise FrontendError(f"tp must be at least 1, got {tp}", key="tp")
    canonical = canonical_of(stage, canonical)
    if tp == 1:
        return StageTP()
    _check_annotated(stage)
    styles = None
    if patterns is not None:
        lins = {n: lin for n in stage.graph.nodes if (lin := linear_like(n, stage)) is not None}
        styles, matched = _styles_of(stage, lins, patterns, where)
        if require_match and (missing := [p for p in patterns if p not in matched]):
            raise FrontendError(f"tensor_parallel pattern {missing[0]!r} matches no module{where}", key=KEY,
                                hints=("patterns are globs over module paths such as 'blocks.*.attn.qkv'",))
    an, lins = analyse(stage, tp, styles, canonical, loss_parallel=loss_parallel, replicate=replicate)
    if styles is not None:
        _explicit_failures(an, lins, styles, where, traced)
    for f in an.failures:
        raise _size_refusal(an, f, where, traced)
    if warnings is not None and styles is None:
        warnings += replicated_warnings(an, tp, where, traced)
    if sequence_parallel:
        names = io_names(stage)[0]
        given = dict(seq_inputs or {})
        sp = SP(seq_len or sequence_length(stage, None), {h: given[v] for h, v in names.items() if v in given}, last)
        an = sp_run(an, sp, where, traced)
    return record(an, lins, canonical, where=where, traced=traced, grad_inputs=grad_inputs)


def _explicit_failures(an: Analysis, lins: Mapping[Node, Lin], styles: Mapping[str, str], where: str,
                       traced: Traced | None) -> None:
    hint = "leave the module out of the patterns (replicated), or use tensor_parallel auto"
    for f in an.failures:
        if f.size:
            raise _size_refusal(an, f, where, traced)
        raise refusal(an.tp, where, f.node, f.reason, traced, (hint,))
    for n, lin in lins.items():
        want, got = styles.get(lin.path, "replicated"), an.style(n)
        if want != got:
            why = {"rowwise": "its input is sharded on its in-features (by a colwise module before it)",
                   "colwise": "its input is already sharded", "replicated": "its input is not sharded on its in-features",
                   "vocab": "its ids are sharded"}
            raise refusal(an.tp, where, n, f"{lin.path} is {want} in the patterns, but {why[got]}", traced,
                          (f"make {lin.path} {got}" if got != "colwise" else hint,))


def plan_stages(stages: Sequence[GraphModule], tp: int, *, patterns: Mapping[str, str] | None = None,
                canonical: Mapping[str, str] | None = None, traced: Traced | None = None,
                sequence_parallel: bool = False, loss: str = "cross_entropy",
                warnings: list[str] | None = None) -> list[StageTP]:
    """:func:`plan_stage` for every stage; a pattern matching no module of any stage is refused. A stage needs
    no values: ``GraphModule(split.traced.gm, split.stage_graph(s))`` (meta parameters) will do, with
    ``canonical=split.traced.canonical``. ``sequence_parallel``: the sequence length is the model input's dim 1
    (see :func:`sequence_length`); a stage output sent as parts arrives as parts at every later stage.
    ``loss``: the plan's; under ``cross_entropy`` the last stage's head may be loss-parallel. In auto, a weight
    tied across stages that one of them keeps whole (a head that is not loss-parallel) is kept whole in all.
    ``warnings``: what auto leaves replicated in the stages as planned (see :func:`plan_stage`)."""
    sp = sequence_parallel and tp > 1
    seq_len = sequence_length(stages[0], traced) if sp else None
    replicate: frozenset[str] = frozenset()
    while True:
        said: list[str] | None = [] if warnings is not None else None   # a search asks for none: locating is dear
        plans = _plan_each(stages, tp, patterns, canonical, traced, sp, seq_len, loss == "cross_entropy", replicate,
                           said)
        held = tied_uses(stages, plans, canonical)
        split = {c for c, by in held.items() if len(set(by.values())) > 1} - replicate
        if patterns is not None or not split:
            break
        replicate |= split
    check_tied(stages, plans, tp, canonical, held)
    if warnings is not None and said:
        warnings += said
    if patterns is not None and tp > 1:
        paths = {m for p in plans for m, _ in p.modules}
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(m, pattern) for m in paths):
                raise FrontendError(f"tensor_parallel pattern {pattern!r} matches no module of any stage", key=KEY,
                                    hints=("patterns are globs over module paths such as 'blocks.*.attn.qkv'",))
    return plans


def _plan_each(stages: Sequence[GraphModule], tp: int, patterns: Mapping[str, str] | None,
               canonical: Mapping[str, str] | None, traced: Traced | None, sp: bool, seq_len: int | None,
               cross_entropy: bool, replicate: frozenset[str], warnings: list[str] | None) -> list[StageTP]:
    parts: dict[str, int] = {}
    carried: set[str] = set()  # the stage outputs whose gradient goes somewhere (the model's inputs get none)
    plans = []
    for s, st in enumerate(stages):
        names = io_names(st)[0].values()
        last = s == len(stages) - 1
        grads = {n for n in names if n in carried}
        plans.append(plan_stage(st, tp, patterns=patterns, canonical=canonical, traced=traced, where=f" in stage {s}",
                                require_match=False, sequence_parallel=sp, seq_len=seq_len,
                                seq_inputs={n: parts[n] for n in names if n in parts}, last=last,
                                loss_parallel=last and cross_entropy, replicate=replicate, grad_inputs=grads,
                                warnings=warnings))
        parts.update(plans[-1].seq_outputs)
        carried |= grad_outputs(st, grads)
    return plans
