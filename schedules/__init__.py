"""Schedule families: pure functions of integers returning per-rank compute orders.

The registry below is what the compiler and the schedule-file language use:
:func:`get_schedule` looks a family up by name, :func:`check_rules` applies
its rules (the "microbatches allowed" and "chunks v" columns of DESIGN's
schedule table, data on its :class:`ScheduleInfo` applied by one check in
:mod:`pipec.schedules.rules`) and :func:`build_order` builds its :class:`ComputeOrder`.

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
import re

from pipec.schedules import gpipe, interleaved, one_f_one_b, zero_bubble
from pipec.schedules.order import (
    Action, ComputeOrder, Kind, ScheduleError, ScheduleWarning, loop_placement, v_placement, validate_order,
)
from pipec.schedules.rules import SAME, FewMicrobatches, MultipleOf, ScheduleInfo

__all__ = [
    "Kind", "Action", "ComputeOrder", "ScheduleError", "ScheduleWarning", "validate_order", "loop_placement",
    "v_placement", "ScheduleInfo", "SCHEDULES", "get_schedule", "schedule_elsewhere", "build_order", "check_rules",
]

_FEWER = "{name} with fewer microbatches ({M}) than ranks ({P})"
"""How most families' warning begins."""

def _torch_rounds(torch_class: str) -> MultipleOf:
    """torch's rule for its interleaved schedules: M a multiple of its rounds, max(1, M // P)."""
    return MultipleOf(of=interleaved.num_rounds, doc="M a multiple of max(1, M // pp), torch's rule",
                      message="{name} needs the microbatches to be a multiple of its rounds, max(1, M // P) = {of} "
                              f"(torch's {torch_class} rule)")


SCHEDULES: dict[str, ScheduleInfo] = {
    info.name: info
    for info in (
        ScheduleInfo(
            name="gpipe", build=gpipe.gpipe,
            reference="torch ScheduleGPipe._step_microbatches (the runtime loop); Huang et al. 2019",
            chunks_note="looped_bfs is its order over several chunks", chunks_instead=(("schedule", "looped_bfs"),),
            few_microbatches=FewMicrobatches(message=_FEWER + ": every rank idles at least {idle} of {slots} slots"),
        ),
        ScheduleInfo(
            name="1f1b", build=one_f_one_b.one_f_one_b,
            reference="torch Schedule1F1B._step_microbatches (the runtime loop; its pipeline_order is wrong)",
            chunks_instead=(("schedule", "interleaved_1f1b"), ("virtual", SAME)),
            few_microbatches=FewMicrobatches(
                message=_FEWER + " never reaches its steady state (torch's Schedule1F1B refuses it)"),
        ),
        ScheduleInfo(
            name="interleaved_1f1b", build=interleaved.interleaved_1f1b, min_chunks=2, max_chunks=None,
            reference="torch ScheduleInterleaved1F1B.pipeline_order; Narayanan et al. SC 2021 §2.2.2",
            chunks_instead=(("schedule", "1f1b"),),
            microbatches=_torch_rounds("ScheduleInterleaved1F1B"),
            few_microbatches=FewMicrobatches(message=_FEWER + " never reaches its steady state"),
        ),
        ScheduleInfo(
            name="looped_bfs", build=interleaved.looped_bfs, min_chunks=2, max_chunks=None,
            reference="torch ScheduleLoopedBFS.pipeline_order; Lamy-Poirier, MLSys 2023",
            chunks_instead=(("schedule", "gpipe"),),
            few_microbatches=FewMicrobatches(message=_FEWER + " leaves every rank idle between its chunks"),
        ),
        ScheduleInfo(
            name="zb_h1", build=zero_bubble.zb_h1, split_backward=True,
            reference="ZB-H1 of Qi et al., Zero Bubble Pipeline Parallelism, ICLR 2024 §3.1",
            chunks_note="zbv is the two-chunk zero-bubble schedule",
            chunks_instead=(("schedule", "zbv"), ("virtual", 2)),
            few_microbatches=FewMicrobatches(message=_FEWER + " has little steady state to fill"),
        ),
        ScheduleInfo(
            name="zbv", build=zero_bubble.zbv, split_backward=True, placement="v", min_chunks=2, max_chunks=2,
            reference="torch ScheduleZBVZeroBubble.pipeline_order; ZB-V of Qi et al., ICLR 2024 §6",
            few_microbatches=FewMicrobatches(
                per_rank=2, offset=-1, message="{name} fills its pipeline with 2P - 1 = {least} microbatches; "
                "with {M} its warm-up and cool-down are not overlapped"),
        ),
        ScheduleInfo(
            name="interleaved_zb", build=zero_bubble.interleaved_zb, split_backward=True, min_chunks=2,
            max_chunks=None,
            reference="torch ScheduleInterleavedZeroBubble.pipeline_order; ZB1P of Qi et al., ICLR 2024",
            chunks_note="zb_h1 is the one-chunk zero-bubble schedule",
            chunks_instead=(("schedule", "zb_h1"),),
            microbatches=_torch_rounds("ScheduleInterleavedZeroBubble"),
            few_microbatches=FewMicrobatches(message=_FEWER + " never reaches its steady state"),
        ),
    )
}
"""Every named schedule family, by name, with its rules (:mod:`pipec.schedules.rules`)."""


_TORCH_CLASSES = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved1f1b": "interleaved_1f1b",
                  "loopedbfs": "looped_bfs", "zbvzerobubble": "zbv", "interleavedzerobubble": "interleaved_zb"}
"""torch.distributed.pipelining's class names (lowercase, no ``Schedule``, no punctuation) -> pipec's family."""
_NOT_YET = {
    "dualpipev": ("torch's ScheduleDualPipeV (DeepSeek-V3's DualPipe as a V of 2 chunks per rank, forward and "
                  "backward overlapped)", "zbv"),
    "dualpipe": ("DeepSeek-V3's bidirectional DualPipe", "zbv"),
}
"""Schedules other libraries ship that pipec does not have yet -> (what it is, the nearest pipec has)."""


def schedule_elsewhere(name: str) -> tuple[str, str] | None:
    """(message, hint) for a schedule name another library uses (torch's class names, DualPipe): pipec's
    name for it, or that pipec does not have it yet; None for any other name."""
    plain = re.sub(r"[^a-z0-9]", "", str(name).lower())
    key = plain.removeprefix("schedule")
    if key != plain and key in _TORCH_CLASSES:  # a class name (Schedule1F1B); a misspelling gets a did-you-mean
        ours = _TORCH_CLASSES[key]
        return f"unknown schedule '{name}'; it is torch's name for pipec's {ours}", f"write: schedule {ours}"
    if key in _NOT_YET and name not in SCHEDULES:
        what, near = _NOT_YET[key]
        return (f"schedule '{name}' is {what}, which pipec does not have yet",
                f"the nearest pipec has: {near}; pipec's schedules are: {', '.join(SCHEDULES)}")
    return None


def get_schedule(name: str) -> ScheduleInfo:
    """The family called ``name``; an unknown name raises with a did-you-mean (or, for another library's
    name, pipec's name for it or that pipec does not have it yet)."""
    info = SCHEDULES.get(name) if isinstance(name, str) else None
    if info is not None:
        return info
    elsewhere = schedule_elsewhere(name)
    if elsewhere is not None:
        raise ScheduleError(f"{elsewhere[0]}; {elsewhere[1]}", rule="schedule.name", key="schedule")
    names = ", ".join(SCHEDULES)
    close = difflib.get_close_matches(str(name), list(SCHEDULES), n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise ScheduleError(
        f"unknown schedule {name!r}; {hint}the schedules are: {names}", rule="schedule.name", key="schedule"
    )


def check_rules(
    name: str, *, num_ranks: int, num_microbatches: int, num_chunks: int | None = None
) -> list[ScheduleWarning]:
    """Apply the family's rules (:meth:`ScheduleInfo.check`); raise :class:`ScheduleError` on a broken one.

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
