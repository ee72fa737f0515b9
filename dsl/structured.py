"""Structured value kinds: model arguments, inputs and targets, partition, placement,
recompute, optimizer, learning-rate schedule, links, policy, order and data.

See :mod:`pipec.dsl.kinds` for the kind protocol (``convert``, ``show``,
``raw_flag``) and the scalar kinds these are built from.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from pipec.compiler.config import LR_SCHEDULES, OPTIMIZER_SETTINGS, TOKEN_DTYPES, TokenData
from pipec.compiler.ir.plan import Link
from pipec.compiler.limits import MAX_DIM, MAX_STAGES, MAX_STEPS
from pipec.compiler.request import BALANCE_BY
from pipec.compiler.request import TP_STYLES
from pipec.dsl import ast
from pipec.dsl.errors import did_you_mean
from pipec.dsl.expr import ExprError, compile_int
from pipec.dsl.kinds import (
    BANDWIDTH,
    DURATION,
    Choice,
    Ctx,
    Int,
    Kind,
    Real,
    Target,
    got,
    literal,
    number_of,
    settings_of,
    unknown_setting,
)
from pipec.dsl.values import (
    Links,
    LRSchedule,
    Optimizer,
    Partition,
    PolicySpec,
    TensorSpec,
    literal_text,
)

__all__ = [
    "Kwargs", "Tensors", "PartitionKind", "PlacementKind", "RecomputeKind", "OptimizerKind",
    "LRScheduleKind", "LinksKind", "PolicyKind", "OrderKind", "OrderDraft", "DataKind", "DTYPES", "OPTIMIZERS",
    "POLICY_NAMES", "POLICY_SETTINGS", "PARTITION_MEASURES", "DEFAULT_LINK", "LINK_AXES", "TensorParallelKind",
    "TP_STYLES",
]


@dataclass(frozen=True, slots=True)
class Kwargs(Kind):
    """Keyword arguments of literals: ``(layers=8, dim=256)``."""

    doc = "keyword arguments such as (layers=8, dim=256)"

    def convert(self, node: ast.Node, ctx: Ctx) -> Mapping[str, Any]:
        if not isinstance(node, ast.Group):
            raise self._wrong(node, ctx)
        out = {kw.name.name: literal(kw.value, ctx, "a model argument") for kw in settings_of(node, ctx, ctx.key)}
        return MappingProxyType(out)

    def show(self, value: Any) -> str:
        return "(" + ", ".join(f"{k}={literal_text(v)}" for k, v in value.items()) + ")"


DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")


@dataclass(frozen=True, slots=True)
class Tensors(Kind):
    """Typed tensors ``NAME: DTYPE[DIMS], ...`` (``one``: exactly one)."""

    example: str = "tokens: int64[16, 128]"
    one: bool = False

    @property
    def doc(self) -> str:
        return f"{'a typed tensor' if self.one else 'one or more typed tensors'} such as {self.example}"

    def convert(self, node: ast.Node, ctx: Ctx) -> tuple[TensorSpec, ...]:
        items = node.items if isinstance(node, ast.Seq) else (node,)
        if self.one and len(items) > 1:
            raise ctx.error(items[1], f"{ctx.key} takes one tensor, got {len(items)}", f"for example {ctx.key} "
                            f"{self.example}")
        out, names = [], set()
        for item in items:
            if not isinstance(item, ast.Typed):
                raise ctx.error(item, f"{ctx.key} needs NAME: DTYPE[DIMS], got {ast.describe(item)}",
                                f"for example {ctx.key} {self.example}")
            if isinstance(item.name, ast.String):
                raise ctx.error(item.name, f"a tensor of {ctx.key} is named bare, not quoted",
                                f"write it without quotes: {item.name.value}: ...")
            t = item.type
            if not isinstance(t, ast.Subscript):
                raise ctx.error(t, f"a tensor of {ctx.key} is typed DTYPE[DIMS], such as int64[16, 128]")
            if t.name.name not in DTYPES:
                raise ctx.error(t.name, f"unknown dtype '{t.name.name}'",
                                did_you_mean(t.name.name, DTYPES) or "dtypes: " + ", ".join(DTYPES))
            if not t.items:
                raise ctx.error(t, f"a tensor of {ctx.key} needs at least one dimension (the batch)")
            dims = []
            for d in t.items:
                v = number_of(d, ctx)
                if not isinstance(v, int) or not 1 <= v <= MAX_DIM:
                    raise ctx.error(d, f"a dimension must be a whole number in 1..{MAX_DIM}, got {got(d)}")
                dims.append(v)
            if item.name.name in names:
                raise ctx.error(item.name, f"{ctx.key} '{item.name.name}' is given twice")
            names.add(item.name.name)
            out.append(TensorSpec(item.name.name, t.name.name, tuple(dims)))
        return tuple(out)

    def show(self, value: Any) -> str:
        return "none" if value is None else ", ".join(t.text() for t in value)


PARTITION_MEASURES = BALANCE_BY
"""The measures of ``balanced(by=...)``: the compiler's (:data:`pipec.compiler.request.BALANCE_BY`)."""


@dataclass(frozen=True, slots=True)
class PartitionKind(Kind):
    doc = "auto, markers, balanced(by=params|flops|time|memory), or split before MODULE, ..."

    def convert(self, node: ast.Node, ctx: Ctx) -> Partition:
        if isinstance(node, ast.Phrase) and node.head == "split before":
            paths = []
            for item in node.items:
                if isinstance(item, ast.Path):
                    paths.append(item.text)
                elif isinstance(item, ast.Word):
                    paths.append(item.name)
                else:
                    raise ctx.error(item, f"a split point is a module path such as layers.4, got {got(item)}")
                if paths[-1] in paths[:-1]:
                    raise ctx.error(item, f"split point '{paths[-1]}' is given twice")
            return Partition("split", None, tuple(paths))
        if isinstance(node, ast.Word) and node.name in ("auto", "markers"):
            return Partition(node.name)
        if isinstance(node, ast.Word) and node.name == "balanced":
            return Partition("balanced", "flops")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Word) and node.func.name == "balanced":
            by = "flops"
            for kw in settings_of(node, ctx, "balanced"):
                if kw.name.name != "by":
                    raise unknown_setting(kw, ctx, "balanced", ["by"])
                by = Choice(PARTITION_MEASURES).convert(kw.value, Ctx("by", ctx.source))
            return Partition("balanced", by)
        if isinstance(node, (ast.Word, ast.Call)) and not isinstance(getattr(node, "func", None), ast.String):
            name = node.name if isinstance(node, ast.Word) else node.func.name
            raise ctx.error(node, f"unknown partition '{name}'",
                            did_you_mean(name, ["auto", "markers", "balanced", "split"]) or "write balanced(by=flops) or "
                            "split before layers.4")
        raise self._wrong(node, ctx)

    def show(self, value: Any) -> str:
        return value.text()


@dataclass(frozen=True, slots=True)
class PlacementKind(Kind):
    doc = "loop, v, or the rank of each stage (0, 1, 1, 0)"

    def convert(self, node: ast.Node, ctx: Ctx) -> str | tuple[int, ...]:
        if isinstance(node, ast.Word) and node.name in ("loop", "v"):
            return node.name
        if isinstance(node, ast.Word):
            raise ctx.error(node, f"unknown placement '{node.name}'",
                            did_you_mean(node.name, ["loop", "v"]) or "placement is loop, v, or a list of ranks")
        items = node.items if isinstance(node, (ast.Seq, ast.List)) else (node,)
        ranks = []
        for item in items:
            v = number_of(item, ctx)
            if not isinstance(v, int) or v < 0:
                raise ctx.error(item, f"a placement entry is a pp rank (a whole number >= 0), got {got(item)}")
            ranks.append(v)
        if len(ranks) > MAX_STAGES:
            raise ctx.error(node, f"placement lists {len(ranks)} stages, beyond pipec's limit of {MAX_STAGES}")
        return tuple(ranks)

    def show(self, value: Any) -> str:
        return value if isinstance(value, str) else ", ".join(map(str, value))


@dataclass(frozen=True, slots=True)
class RecomputeKind(Kind):
    doc = "none, all, or stages N, ..."

    def convert(self, node: ast.Node, ctx: Ctx) -> str | tuple[int, ...]:
        if isinstance(node, ast.Word) and node.name in ("none", "all"):
            return () if node.name == "none" else "all"
        if isinstance(node, ast.Phrase) and node.head == "stages":
            stages = []
            for item in node.items:
                v = number_of(item, ctx)
                if not isinstance(v, int) or v < 0:
                    raise ctx.error(item, f"a stage is a whole number >= 0, got {got(item)}")
                if v in stages:
                    raise ctx.error(item, f"stage {v} is listed twice")
                stages.append(v)
            return tuple(sorted(stages))
        if isinstance(node, ast.Word):
            raise ctx.error(node, f"unknown recompute '{node.name}'",
                            did_you_mean(node.name, ["none", "all", "stages"]) or "write none, all, or stages 0, 1")
        raise self._wrong(node, ctx, "write none, all, or stages 0, 1")

    def show(self, value: Any) -> str:
        if value == "all":
            return "all"
        return "stages " + ", ".join(map(str, value)) if value else "none"


def _betas(node: ast.Node, ctx: Ctx) -> tuple[float, float]:
    value = literal(node, ctx)
    if not (isinstance(value, tuple) and len(value) == 2
            and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in value)):
        raise ctx.error(node, "betas must be two numbers in [0, 1), such as (0.9, 0.999)")
    return (float(value[0]), float(value[1]))


def _onoff(node: ast.Node, ctx: Ctx) -> bool:
    if isinstance(node, ast.Word) and node.name in ("on", "off", "true", "false"):
        return node.name in ("on", "true")
    raise ctx.error(node, f"{ctx.key} is on or off, got {got(node)}")


_NONNEG = Real(0.0)
_UNIT_INTERVAL = Real(0.0, hi=1.0)
_POS = Real(0.0, lo_open=True)

_SETTING_KINDS = {"betas": _betas, "eps": _POS.convert, "weight_decay": _NONNEG.convert,
                  "momentum": _UNIT_INTERVAL.convert, "dampening": _UNIT_INTERVAL.convert, "nesterov": _onoff}

# name -> setting -> (default, converter); the defaults are the training config's
OPTIMIZERS: dict[str, dict[str, tuple[Any, Any]]] = {
    name: {k: (default, _SETTING_KINDS[k]) for k, default in settings.items()}
    for name, settings in OPTIMIZER_SETTINGS.items()
}


@dataclass(frozen=True, slots=True)
class OptimizerKind(Kind):
    doc = "adamw, adam or sgd, with settings such as adamw(betas=(0.9, 0.95), weight_decay=0.1)"

    def convert(self, node: ast.Node, ctx: Ctx) -> Optimizer:
        name_node = node.func if isinstance(node, ast.Call) else node
        if not isinstance(name_node, ast.Word):
            raise self._wrong(node, ctx)
        if name_node.name not in OPTIMIZERS:
            raise ctx.error(name_node, f"unknown optimizer '{name_node.name}'",
                            did_you_mean(name_node.name, OPTIMIZERS) or "optimizers: " + ", ".join(OPTIMIZERS))
        table = OPTIMIZERS[name_node.name]
        values = {k: default for k, (default, _) in table.items()}
        for kw in settings_of(node, ctx, name_node.name) if isinstance(node, ast.Call) else ():
            if kw.name.name == "lr":
                raise ctx.error(kw.name, "the learning rate is its own key", "set it with: lr 3e-4")
            if kw.name.name not in table:
                raise unknown_setting(kw, ctx, name_node.name, table)
            values[kw.name.name] = table[kw.name.name][1](kw.value, Ctx(kw.name.name, ctx.source))
        if values.get("nesterov") and not values.get("momentum"):
            raise ctx.error(node, "sgd with nesterov=on needs momentum > 0")
        return Optimizer(name_node.name, tuple(values.items()))

    def show(self, value: Any) -> str:
        inner = ", ".join(f"{k}={literal_text(v)}" for k, v in value.settings)
        return f"{value.name}({inner})" if inner else value.name


@dataclass(frozen=True, slots=True)
class LRScheduleKind(Kind):
    doc = "constant, cosine or linear, with warmup=STEPS and (decays) min_lr=LR"

    def convert(self, node: ast.Node, ctx: Ctx) -> LRSchedule:
        name_node = node.func if isinstance(node, ast.Call) else node
        names = LR_SCHEDULES
        if not isinstance(name_node, ast.Word):
            raise self._wrong(node, ctx)
        if name_node.name not in names:
            raise ctx.error(name_node, f"unknown lr_schedule '{name_node.name}'",
                            did_you_mean(name_node.name, names) or "lr_schedule is constant, cosine or linear")
        warmup, min_lr = 0, 0.0
        known = ["warmup"] + (["min_lr"] if name_node.name != "constant" else [])
        for kw in settings_of(node, ctx, name_node.name) if isinstance(node, ast.Call) else ():
            if kw.name.name == "warmup":
                warmup = Int(0, MAX_STEPS).convert(kw.value, Ctx("warmup", ctx.source))
            elif kw.name.name == "min_lr" and "min_lr" in known:
                min_lr = _NONNEG.convert(kw.value, Ctx("min_lr", ctx.source))
            else:
                raise unknown_setting(kw, ctx, name_node.name, known)
        return LRSchedule(name_node.name, warmup, min_lr)

    def show(self, value: Any) -> str:
        if value.name == "constant" and not value.warmup:
            return "constant"
        args = [f"warmup={value.warmup}"] if value.warmup else []
        if value.name != "constant" and value.min_lr:
            args.append(f"min_lr={value.min_lr!r}")
        return f"{value.name}({', '.join(args)})" if args else value.name


DEFAULT_LINK = Link(latency_s=1e-5, bandwidth_Bps=25e9)


LINK_AXES = ("pp", "dp", "tp", "intra", "inter")
"""Axes of the ``links`` key: the mesh's two, then the two sides of a node boundary."""


@dataclass(frozen=True, slots=True)
class LinksKind(Kind):
    doc = "pp(latency=TIME, bandwidth=RATE), dp(...), tp(...), intra(...), inter(...)"

    def convert(self, node: ast.Node, ctx: Ctx) -> Links:
        items = node.items if isinstance(node, ast.Seq) else (node,)
        axes: dict[str, Link | None] = {"pp": DEFAULT_LINK, "dp": DEFAULT_LINK, "tp": None, "intra": None,
                                        "inter": None}
        seen: set[str] = set()
        for item in items:
            if not (isinstance(item, ast.Call) and isinstance(item.func, ast.Word)):
                raise ctx.error(item, f"links are given per mesh axis: pp(latency=10us, bandwidth=25GB/s), got "
                                f"{ast.describe(item)}")
            axis = item.func.name
            if axis not in axes:
                raise ctx.error(item.func, f"unknown link axis '{axis}'",
                                did_you_mean(axis, axes) or f"axes: {', '.join(LINK_AXES)}")
            if axis in seen:
                raise ctx.error(item.func, f"links for {axis} are given twice")
            seen.add(axis)
            start = axes[axis] or DEFAULT_LINK
            latency, bandwidth = start.latency_s, start.bandwidth_Bps
            for kw in settings_of(item, ctx, axis):
                if kw.name.name == "latency":
                    latency = DURATION.convert(kw.value, Ctx("latency", ctx.source))
                elif kw.name.name == "bandwidth":
                    bandwidth = BANDWIDTH.convert(kw.value, Ctx("bandwidth", ctx.source))
                else:
                    raise unknown_setting(kw, ctx, f"{axis} link", ["latency", "bandwidth"])
            axes[axis] = Link(latency_s=latency, bandwidth_Bps=bandwidth)
        return Links(**axes)

    def show(self, value: Any) -> str:
        return value.text()


_GLOB_SEGMENT = re.compile(r"(?:[A-Za-z0-9_*?]|\[!?[A-Za-z0-9_-]+\])+")
"""One dotted segment of a module-path glob: names, ``*`` and ``?``, and ``[...]`` classes."""


@dataclass(frozen=True, slots=True)
class TensorParallelKind(Kind):
    """``auto``, or ``"glob": style, ...``: which modules split how across a stage's tp ranks."""

    doc = 'auto, or "module.glob": colwise|rowwise|vocab|replicated, ...'

    def convert(self, node: ast.Node, ctx: Ctx) -> str | tuple[tuple[str, str], ...]:
        if isinstance(node, ast.Word) and node.name == "auto":
            return "auto"
        items = node.items if isinstance(node, ast.Seq) else (node,)
        out: list[tuple[str, str]] = []
        seen: dict[str, ast.Node] = {}
        for item in items:
            if not isinstance(item, ast.Typed):
                raise ctx.error(item, f"tensor_parallel needs auto, or \"MODULE_GLOB\": STYLE pairs, got {got(item)}",
                                'for example tensor_parallel "blocks.*.attn.qkv": colwise, '
                                '"blocks.*.attn.proj": rowwise')
            pattern = item.name.value if isinstance(item.name, ast.String) else item.name.name
            _check_glob(pattern, item.name, ctx)
            style = item.type
            if not isinstance(style, ast.Word) or style.name not in TP_STYLES:
                text = style.name if isinstance(style, ast.Word) else None
                raise ctx.error(style, f"unknown tensor_parallel style {got(style)} for \"{pattern}\"",
                                (did_you_mean(text, TP_STYLES) if text else "") or "styles: " + ", ".join(TP_STYLES))
            if pattern in seen:
                first = seen[pattern].span
                raise ctx.error(item.name, f"module pattern \"{pattern}\" is given twice",
                                f"it is first given at line {first.line}, column {first.col}; keep one")
            seen[pattern] = item.name
            out.append((pattern, style.name))
        return tuple(out)

    def show(self, value: Any) -> str:
        if isinstance(value, str):
            return value
        return ", ".join(f'"{pattern}": {style}' for pattern, style in value)


def _check_glob(pattern: str, node: ast.Node, ctx: Ctx) -> None:
    """A module-path glob is dotted segments of names, ``*``, ``?`` and ``[...]`` classes (``blocks.*.attn``)."""
    if not pattern:
        raise ctx.error(node, "a tensor_parallel module pattern is empty",
                        'name modules by path, such as "blocks.*.mlp.fc"')
    for segment in pattern.split("."):
        if not segment:
            raise ctx.error(node, f"module pattern \"{pattern}\" has an empty segment (a leading, trailing or "
                            "double dot)",
                            "module paths are names joined by single dots, such as blocks.0.attn")
        if not _GLOB_SEGMENT.fullmatch(segment):
            raise ctx.error(node, f"module pattern \"{pattern}\": segment '{segment}' is not a name or a glob",
                            "a segment holds letters, digits, _, the wildcards * and ?, and [...] classes")


POLICY_NAMES = {"rank": "rank", "ranks": "ranks", "P": "ranks", "chunks": "chunks", "V": "chunks",
                "microbatches": "microbatches", "M": "microbatches", "stages": "stages", "S": "stages"}
"""Names a policy expression may use, with their aliases."""

_POLICY_CHOICES = {
    "priority": ("backward", "forward"),
    "weight_grad": ("immediate", "bubbles", "end"),
    "chunk_order": ("depth_first", "breadth_first"),
    "backward_microbatches": ("ascending", "descending"),
}
POLICY_SETTINGS = ("warmup", "priority", "split_backward", "weight_grad", "chunk_order",
                   "backward_microbatches", "max_in_flight")


@dataclass(frozen=True, slots=True)
class PolicyKind(Kind):
    presets: tuple[str, ...] = ()
    doc = "(setting=value, ...), or a preset name, optionally with settings: 1f1b(warmup=...)"

    def convert(self, node: ast.Node, ctx: Ctx) -> PolicySpec:
        preset = None
        if isinstance(node, (ast.Word, ast.Call)):
            name_node = node.func if isinstance(node, ast.Call) else node
            if not isinstance(name_node, ast.Word):
                raise self._wrong(node, ctx)
            if name_node.name not in self.presets:
                raise ctx.error(name_node, f"unknown policy preset '{name_node.name}'",
                                did_you_mean(name_node.name, self.presets) or "presets: " + ", ".join(self.presets))
            preset = name_node.name
        elif not isinstance(node, ast.Group):
            raise self._wrong(node, ctx, "for example policy (warmup=P - 1 - rank, priority=backward)")
        settings = []
        for kw in settings_of(node, ctx, "policy") if not isinstance(node, ast.Word) else ():
            name, value = kw.name.name, kw.value
            sub = Ctx(name, ctx.source)
            if name in _POLICY_CHOICES:
                settings.append((name, Choice(_POLICY_CHOICES[name]).convert(value, sub)))
            elif name == "split_backward":
                settings.append((name, _onoff(value, sub)))
            elif name in ("warmup", "max_in_flight"):
                word = "all" if name == "warmup" else "max"
                if isinstance(value, ast.Word) and value.name == word:
                    settings.append((name, word))
                    continue
                try:
                    settings.append((name, compile_int(value, POLICY_NAMES)))
                except ExprError as err:
                    raise ctx.source.error(err.span, err.message, *err.hints) from None
            elif name == "placement":
                raise ctx.error(kw.name, "a policy's placement is the placement key", "write: placement v")
            else:
                raise unknown_setting(kw, ctx, "policy", POLICY_SETTINGS)
        return PolicySpec(preset, tuple(settings))

    def show(self, value: Any) -> str:
        return value.text()


@dataclass(frozen=True, slots=True)
class OrderDraft:
    """An ``order`` value before the mesh is known: the block, or a CSV path."""

    block: ast.OrderBlock | None
    path: str | None
    node: ast.Node
    base_dir: str


@dataclass(frozen=True, slots=True)
class OrderKind(Kind):
    doc = 'an order block (rank 0: F0.0 ...), or a torch compute-only CSV file "order.csv"'

    def convert(self, node: ast.Node, ctx: Ctx) -> OrderDraft:
        if isinstance(node, ast.OrderBlock):
            return OrderDraft(node, None, node, ctx.base_dir)
        if isinstance(node, ast.String):
            if not node.value:
                raise ctx.error(node, "order needs a CSV file name")
            return OrderDraft(None, node.value, node, ctx.base_dir)
        raise self._wrong(node, ctx, 'write rank clauses (order rank 0: F0.0 B0.0) or a file: order "x.csv"')

    def show(self, value: Any) -> str:
        return "none" if value is None else value.text()

    def raw_flag(self, text: str) -> bool:
        return not text.lstrip().startswith(("rank", '"'))



_DATA_BUILTINS = ("synthetic",)


@dataclass(frozen=True, slots=True)
class DataKind(Kind):
    """``synthetic``, ``tokens("train.bin", dtype=uint16)`` (a token file, relative to the schedule file's
    folder; a flag's to the current folder), or a ``"pkg.module:fn"`` data function."""

    doc = 'synthetic, tokens("train.bin", dtype=uint16), or a "pkg.module:function" string'

    def convert(self, node: ast.Node, ctx: Ctx) -> str | TokenData:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Word) and node.func.name == "tokens":
            return self._tokens(node, ctx)
        if isinstance(node, ast.Word) and node.name not in _DATA_BUILTINS:
            raise ctx.error(node, f"unknown data '{node.name}'", did_you_mean(node.name, (*_DATA_BUILTINS, "tokens"))
                            or 'data is synthetic, tokens("train.bin", dtype=uint16), or "pkg.module:fn"')
        return Target(_DATA_BUILTINS).convert(node, ctx)

    def _tokens(self, node: ast.Call, ctx: Ctx) -> TokenData:
        if len(node.args) != 1 or not isinstance(node.args[0], ast.String) or not node.args[0].value:
            raise ctx.error(node, "tokens takes the file's path as a string", 'write tokens("train.bin", dtype=uint16)')
        dtype = "uint16"
        for kw in settings_of(ast.Call(node.func, (), node.kwargs, node.span), ctx, "tokens"):
            if kw.name.name != "dtype":
                raise unknown_setting(kw, ctx, "tokens", ["dtype"])
            dtype = Choice(TOKEN_DTYPES).convert(kw.value, Ctx("dtype", ctx.source))
        path = os.path.abspath(os.path.join(ctx.base_dir, os.path.expanduser(node.args[0].value)))
        return TokenData(path=path, dtype=dtype)

    def show(self, value: Any) -> str:
        return value.text() if isinstance(value, TokenData) else Target(_DATA_BUILTINS).show(value)

    def raw_flag(self, text: str) -> bool:
        return not text.lstrip().startswith("tokens") and Target(_DATA_BUILTINS).raw_flag(text)
