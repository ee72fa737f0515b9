"""Predicted memory per pp rank: parameter state plus saved activations in flight.

Per stage a rank holds: ``bytes_per_param`` for every parameter copy (default
16: mixed-precision Adam's bf16 weight and gradient, fp32 master weight and
two moments; a tied weight counts on every stage holding a copy), and the
stage's saved activations per microbatch times the most microbatches it has
in flight at once (the simulator's count). A rank's total sums its stages;
when its stages peak at different moments this is an upper bound. The
prediction is before any sharding (ZeRO/FSDP divide the state across dp).

No torch here: this runs on plans too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Sequence

from pipec.compiler.graph import StageGraph, human_bytes
from pipec.compiler.plan import Plan, Stage

__all__ = ["BYTES_PER_PARAM", "StageMemory", "RankMemory", "MemoryBudgetError", "predict_memory", "check_memory", "format_memory"]

BYTES_PER_PARAM = 16
"""Mixed-precision Adam: 2 (bf16 weight) + 2 (bf16 grad) + 4 (fp32 master) + 8 (fp32 moments)."""


class MemoryBudgetError(ValueError):
    """A rank's predicted memory exceeds ``device_memory``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StageMemory:
    stage: int
    num_params: int
    state_bytes: int
    """Parameters, gradients and optimizer state."""
    activation_bytes: int
    """Saved for backward per microbatch."""
    in_flight: int
    """Most microbatches whose activations the stage holds at once."""

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes * self.in_flight


@dataclass(frozen=True, slots=True, kw_only=True)
class RankMemory:
    rank: int
    stages: tuple[StageMemory, ...]

    @property
    def num_params(self) -> int:
        return sum(s.num_params for s in self.stages)

    @property
    def state_bytes(self) -> int:
        return sum(s.state_bytes for s in self.stages)

    @property
    def activation_bytes(self) -> int:
        """Activations at the peak: per-microbatch bytes x in flight, summed over stages."""
        return sum(s.activation_bytes * s.in_flight for s in self.stages)

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes


def _stages(source: Plan | StageGraph, placement: Sequence[int] | None) -> tuple[tuple[Stage, ...], int]:
    stages = tuple(source.stages)
    if not stages:
        raise ValueError("memory prediction needs a plan compiled from a model (this one has no stage sizes)")
    if placement is not None:
        if len(placement) != len(stages):
            raise ValueError(f"placement needs one pp rank per stage ({len(stages)}), got {len(placement)}")
        ranks = [int(r) for r in placement]
    else:
        ranks = [st.rank for st in stages]
        if any(r < 0 for r in ranks):
            raise ValueError("the stage graph is not placed yet; pass placement= (one pp rank per stage)")
    num_ranks = source.mesh.pp if isinstance(source, Plan) else max(ranks) + 1
    for st in stages:
        if st.num_params is None or st.activation_bytes is None:
            raise ValueError(f"stage {st.stage} has no parameter count or activation size (a schedule-only plan?)")
    return tuple(st if st.rank == r else dataclasses.replace(st, rank=r) for st, r in zip(stages, ranks)), num_ranks


def predict_memory(
    source: Plan | StageGraph,
    peak_in_flight: Mapping[int, Mapping[int, int]] | None = None,
    *,
    placement: Sequence[int] | None = None,
    bytes_per_param: int = BYTES_PER_PARAM,
) -> tuple[RankMemory, ...]:
    """Predicted bytes per pp rank, one :class:`RankMemory` per rank in order.

    ``peak_in_flight[rank][stage]`` is the most microbatches of ``stage``
    whose activations ``rank`` holds at once (from the simulator); missing
    entries count 0, so ``None`` gives the state alone. ``placement`` is
    needed for an unplaced StageGraph.
    """
    stages, num_ranks = _stages(source, placement)
    peak = peak_in_flight or {}
    per_rank: dict[int, list[StageMemory]] = {r: [] for r in range(num_ranks)}
    for st in stages:
        in_flight = int(peak.get(st.rank, {}).get(st.stage, 0))
        assert st.num_params is not None and st.activation_bytes is not None
        per_rank.setdefault(st.rank, []).append(StageMemory(
            stage=st.stage, num_params=st.num_params, state_bytes=bytes_per_param * st.num_params,
            activation_bytes=st.activation_bytes, in_flight=in_flight,
        ))
    return tuple(RankMemory(rank=r, stages=tuple(per_rank[r])) for r in sorted(per_rank))


def check_memory(report: Sequence[RankMemory], device_memory: float, *, bytes_per_param: int = BYTES_PER_PARAM) -> None:
    """Raise :class:`MemoryBudgetError` naming the first rank whose prediction exceeds ``device_memory`` bytes."""
    for rm in report:
        if rm.total_bytes <= device_memory:
            continue
        worst = max(rm.stages, key=lambda s: s.activation_bytes * s.in_flight, default=None)
        acts = (
            f"activations {human_bytes(rm.activation_bytes)}"
            + (f" (stage {worst.stage}: {worst.in_flight} microbatches in flight x {human_bytes(worst.activation_bytes)})" if worst and worst.in_flight else "")
        )
        raise MemoryBudgetError(
            f"pp rank {rm.rank} needs {human_bytes(rm.total_bytes)} but device_memory is {human_bytes(device_memory)}: "
            f"parameters, gradients and optimizer state {human_bytes(rm.state_bytes)} "
            f"({rm.num_params:,} parameters x {bytes_per_param} bytes) + {acts}; "
            "use more pp ranks or stages, recompute, a schedule with fewer microbatches in flight, or a larger device_memory"
        )


def format_memory(report: Sequence[RankMemory]) -> str:
    """A plain-text table: one line per rank and stage."""
    lines = [f"{'rank':>4} {'stage':>5} {'params':>14} {'state':>11} {'act/mb':>11} {'in flight':>9} {'total':>11}"]
    for rm in report:
        for s in rm.stages:
            lines.append(
                f"{rm.rank:>4} {s.stage:>5} {s.num_params:>14,} {human_bytes(s.state_bytes):>11} "
                f"{human_bytes(s.activation_bytes):>11} {s.in_flight:>9} {human_bytes(s.total_bytes):>11}"
            )
        lines.append(f"{rm.rank:>4} {'all':>5} {rm.num_params:>14,} {human_bytes(rm.state_bytes):>11} {'':>11} {'':>9} {human_bytes(rm.total_bytes):>11}")
    return "\n".join(lines)
