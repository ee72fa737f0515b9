"""Schedule families: pure functions of integers returning per-rank compute orders.

The registry below is what the compiler and the schedule-file language use:
:func:`get_schedule` looks a family up by name, :func:`check_rules` applies
its rules (the "microbatches allowed" and "chunks v" columns of DESIGN's
schedule table) and :func:`build_order` builds its :class:`ComputeOrder`.

A broken rule raises :class:`ScheduleError` whose ``rule`` is
``"<schedule>.<what>"`` (``ranks``, ``microbatches`` or ``chunks``) and whose
``key`` is the schedule-file key at fault (``pp``, ``microbatches``,
``virtual``), with the settings it got and the ones that would do as data
(the language words them as the user wrote them); an unknown name raises one
with rule ``"schedule.name"``. Legal but wasteful settings come back from
:func:`check_rules` as :class:`ScheduleWarning` values. The compiler's
driver is the one place that applies the rules before it builds an order.

Importing this package is cheap: pure Python, no torch, no networkx.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Callable

from pipec.schedules import gpipe, interleaved, one_f_one_b, zero_bubble
from pipec.schedules.order import (
    Action,
    ComputeOrder,
    Kind,
    ScheduleError,
    ScheduleWarning,
    loop_placement,
    v_placement,
    validate_order,
)

__all__ = [
    "Kind",
    "Action",
    "ComputeOrder",
    "ScheduleError",
    "ScheduleWarning",
    "validate_order",
    "loop_placement",
    "v_placement",
    "ScheduleInfo",
    "SCHEDULES",
    "get_schedule",
    "build_order",
    "check_rules",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleInfo:
    """One named schedule family: what it is and how to build it."""

    name: str
    """Registry name: the ``schedule`` key's value."""
    placement: str
    """Stage-to-rank placement: ``"loop"`` (s mod P) or ``"v"``."""
    default_chunks: int
    """Chunks per rank when ``--virtual`` is not given."""
    split_backward: bool
    """Whether the backward is split into ``I`` and ``W``."""
    reference: str
    """One line: what the order equals (a torch class, or a paper)."""
    min_chunks: int
    """Fewest chunks per rank the family takes."""
    max_chunks: int | None
    """Most chunks per rank the family takes (None: no upper limit)."""
    build: Callable[..., ComputeOrder]
    """``build(num_ranks=, num_microbatches=, num_chunks=)`` for counts that ``check`` accepted."""
    check: Callable[..., list[ScheduleWarning]]
    """``check(num_ranks=, num_microbatches=, num_chunks=)``: raises on a broken rule, returns warnings."""

    def chunks_allowed(self, num_chunks: int) -> bool:
        """Whether ``num_chunks`` per rank is within the family's range."""
        return num_chunks >= self.min_chunks and (self.max_chunks is None or num_chunks <= self.max_chunks)


SCHEDULES: dict[str, ScheduleInfo] = {
    info.name: info
    for info in (
        ScheduleInfo(
            name="gpipe",
            placement="loop",
            default_chunks=1,
            split_backward=False,
            reference="torch ScheduleGPipe._step_microbatches (the runtime loop); Huang et al. 2019",
            min_chunks=1,
            max_chunks=1,
            build=gpipe.gpipe,
            check=gpipe.check_gpipe,
        ),
        ScheduleInfo(
            name="1f1b",
            placement="loop",
            default_chunks=1,
            split_backward=False,
            reference="torch Schedule1F1B._step_microbatches (the runtime loop; its pipeline_order is wrong)",
            min_chunks=1,
            max_chunks=1,
            build=one_f_one_b.one_f_one_b,
            check=one_f_one_b.check_one_f_one_b,
        ),
        ScheduleInfo(
            name="interleaved_1f1b",
            placement="loop",
            default_chunks=2,
            split_backward=False,
            reference="torch ScheduleInterleaved1F1B.pipeline_order; Narayanan et al. SC 2021 §2.2.2",
            min_chunks=2,
            max_chunks=None,
            build=interleaved.interleaved_1f1b,
            check=interleaved.check_interleaved_1f1b,
        ),
        ScheduleInfo(
            name="looped_bfs",
            placement="loop",
            default_chunks=2,
            split_backward=False,
            reference="torch ScheduleLoopedBFS.pipeline_order; Lamy-Poirier, MLSys 2023",
            min_chunks=2,
            max_chunks=None,
            build=interleaved.looped_bfs,
            check=interleaved.check_looped_bfs,
        ),
        ScheduleInfo(
            name="zb_h1",
            placement="loop",
            default_chunks=1,
            split_backward=True,
            reference="ZB-H1 of Qi et al., Zero Bubble Pipeline Parallelism, ICLR 2024 §3.1",
            min_chunks=1,
            max_chunks=1,
            build=zero_bubble.zb_h1,
            check=zero_bubble.check_zb_h1,
        ),
        ScheduleInfo(
            name="zbv",
            placement="v",
            default_chunks=2,
            split_backward=True,
            reference="torch ScheduleZBVZeroBubble.pipeline_order; ZB-V of Qi et al., ICLR 2024 §6",
            min_chunks=2,
            max_chunks=2,
            build=zero_bubble.zbv,
            check=zero_bubble.check_zbv,
        ),
    )
}
"""Every named schedule family, by name."""


def get_schedule(name: str) -> ScheduleInfo:
    """The family called ``name``; an unknown name raises with a did-you-mean."""
    info = SCHEDULES.get(name) if isinstance(name, str) else None
    if info is not None:
        return info
    names = ", ".join(SCHEDULES)
    close = difflib.get_close_matches(str(name), list(SCHEDULES), n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise ScheduleError(
        f"unknown schedule {name!r}; {hint}the schedules are: {names}", rule="schedule.name", key="schedule"
    )


def check_rules(
    name: str, *, num_ranks: int, num_microbatches: int, num_chunks: int | None = None
) -> list[ScheduleWarning]:
    """Apply the family's rules; raise :class:`ScheduleError` on a broken one.

    ``num_chunks=None`` means the family's default. Returns warnings (each
    with its fix) for legal but wasteful settings.
    """
    info = get_schedule(name)
    chunks = info.default_chunks if num_chunks is None else num_chunks
    return info.check(num_ranks=num_ranks, num_microbatches=num_microbatches, num_chunks=chunks)


def build_order(
    name: str, *, num_ranks: int, num_microbatches: int, num_chunks: int | None = None
) -> ComputeOrder:
    """Build the family's compute order (its rules are checked first; their warnings are dropped)."""
    info = get_schedule(name)
    chunks = info.default_chunks if num_chunks is None else num_chunks
    info.check(num_ranks=num_ranks, num_microbatches=num_microbatches, num_chunks=chunks)
    return info.build(num_ranks=num_ranks, num_microbatches=num_microbatches, num_chunks=chunks)
