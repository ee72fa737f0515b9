"""The typed values of structured keys, as a :class:`~pipec.dsl.Spec` holds them.

Plain keys resolve to ints, floats, strings, bools, None or tuples; the keys
below resolve to these small frozen dataclasses, each with ``text()`` (the
schedule-file syntax that writes it). ``input`` and ``targets`` resolve to
the compiler's :class:`~pipec.compiler.request.TensorSpec`, ``partition`` to its
:class:`~pipec.compiler.request.Partition`, ``optimizer`` and
``lr_schedule`` to the training config's own types (:mod:`pipec.compiler.config`,
which the runtime reads too; their kinds, :mod:`pipec.dsl.structured`, write
their text). plan.json's ``spec`` is written from the compile request, not
from these (:meth:`~pipec.compiler.request.CompileRequest.spec_json`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from pipec.compiler.config import LRSchedule, Optimizer  # the training config owns them
from pipec.compiler.ir.plan import Link
from pipec.compiler.request import Partition, TensorSpec  # the compiler's: one type from the language to the front end
from pipec.dsl.expr import ExprError, IntExpr
from pipec.schedules.order import Action

__all__ = [
    "TensorSpec",
    "Partition",
    "Optimizer",
    "LRSchedule",
    "Links",
    "PolicySpec",
    "OrderSpec",
    "PerRank",
    "literal_text",
]


def literal_text(value: Any) -> str:
    """Schedule-file text of a literal (model arguments, optimizer settings)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, tuple):
        return "(" + ", ".join(literal_text(v) for v in value) + ")"
    return repr(value) if isinstance(value, float) else str(value)


def _seconds_text(s: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)):
        if s >= scale or unit == "ns":
            return f"{s / scale:g}{unit}"
    raise AssertionError


def _rate_text(bps: float) -> str:
    for unit, scale in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3), ("B/s", 1.0)):
        if bps >= scale or unit == "B/s":
            return f"{bps / scale:g}{unit}"
    raise AssertionError


@dataclass(frozen=True, slots=True)
class Links:
    """Link costs per mesh axis (``pp``: activations and grads between stages;
    ``dp``: the gradient all-reduce; ``tp``, when given: the collectives inside a tp group), each the
    compiler's :class:`~pipec.compiler.ir.plan.Link`; and,
    optionally, per side of a node boundary (``intra``: within a node, ``inter``: across nodes), which
    with ``devices_per_node`` price each hop and collective by where its ranks sit."""

    pp: Link
    dp: Link
    intra: Link | None = None
    inter: Link | None = None
    tp: Link | None = None
    """The tp groups' collectives (absent: the cost model's fallback for them)."""

    def text(self) -> str:
        return ", ".join(
            f"{axis}(latency={_seconds_text(link.latency_s)}, bandwidth={_rate_text(link.bandwidth_Bps)})"
            for axis, link in self.as_dict().items()
        )

    def as_dict(self) -> dict[str, Link]:
        """Every axis given, in order: pp, dp, then tp, intra and inter when set."""
        sides = {axis: link for axis, link in (("tp", self.tp), ("intra", self.intra), ("inter", self.inter))
                 if link is not None}
        return {"pp": self.pp, "dp": self.dp, **sides}


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """A schedule declared by policy (see :class:`pipec.schedules.policy.Policy`).

    ``preset`` names the policy it starts from (None: the defaults); ``settings``
    are the fields the file sets, ``warmup``/``max_in_flight`` compiled to
    expressions of the rank (or the words ``all``/``max``).
    """

    preset: str | None
    settings: tuple[tuple[str, Any], ...]

    def get(self, name: str, default: Any = None) -> Any:
        return dict(self.settings).get(name, default)

    def policy(self, *, placement: str, num_ranks: int, num_microbatches: int, num_chunks: int):
        """The :class:`~pipec.schedules.policy.Policy` for these counts: each
        expression evaluated on every rank (an :class:`~pipec.dsl.expr.ExprError`
        says which rank it failed on)."""
        from dataclasses import replace

        from pipec.schedules.policy import PRESETS, Policy

        env = {"ranks": num_ranks, "microbatches": num_microbatches, "chunks": num_chunks,
               "stages": num_ranks * num_chunks}
        base = PRESETS[self.preset] if self.preset else Policy()
        fields: dict[str, Any] = {}
        for name, value in self.settings:
            fields[name] = PerRank.of(value, env) if isinstance(value, IntExpr) else value
        return replace(base, placement=placement, **fields)

    def text(self) -> str:
        inner = ", ".join(f"{k}={_setting_text(v)}" for k, v in self.settings)
        if self.preset:
            return f"{self.preset}({inner})" if inner else self.preset
        return f"({inner})"


def _setting_text(value: Any) -> str:
    if isinstance(value, IntExpr):
        return value.text
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


@dataclass(frozen=True, slots=True)
class PerRank:
    """A policy setting's value on each pp rank: its expression, evaluated
    once per rank; called with a rank, as the policy calls its settings."""

    text: str
    values: tuple[int, ...]

    @classmethod
    def of(cls, expr: IntExpr, env: Mapping[str, int]) -> "PerRank":
        values = []
        for rank in range(env["ranks"]):
            try:
                values.append(expr({**env, "rank": rank}))
            except ExprError as err:
                raise ExprError(err.span, f"{err.message} (on rank {rank})", *err.hints) from None
        return cls(expr.text, tuple(values))

    def __call__(self, rank: int) -> int:
        return self.values[rank]


@dataclass(frozen=True, slots=True)
class OrderSpec:
    """A schedule given as an explicit per-rank order: inline (``order`` block)
    or a torch.distributed.pipelining compute-only CSV file (``path``). It holds
    each rank's actions as written; the compiler's driver checks and builds the
    order. ``where`` keeps each action's place in its source, for locating the
    driver's complaints."""

    form: str
    """``"inline"`` or ``"csv"``."""
    path: str | None
    ranks: tuple[tuple[Action, ...], ...] = field(compare=False)
    where: Any = field(default=None, compare=False, repr=False)
    """The :class:`~pipec.dsl.order.Expanded` the actions came from."""

    def text(self) -> str:
        if self.form == "csv":
            return '"' + (self.path or "") + '"'
        return "\n".join(f"  rank {r}: " + " ".join(map(str, acts)) for r, acts in enumerate(self.ranks))

