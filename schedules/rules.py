"""What a named schedule family allows, as data, and the one check that applies it.

A :class:`ScheduleInfo` states a family's rules: its range of chunks per
rank (with the words its error needs), an optional extra rule on the
microbatch count (:class:`MultipleOf`: interleaved 1F1B's "what torch
accepts"), and the count below which it wastes its ranks
(:class:`FewMicrobatches`). :meth:`ScheduleInfo.check` is the only code that
applies them, in this order:

1. counts: ranks, microbatches and chunks are whole numbers >= 1
   (:func:`~pipec.schedules.order.check_counts`; rule ``<schedule>.ranks`` ...);
2. chunks per rank in ``min_chunks..max_chunks`` (rule ``<schedule>.chunks``, key ``virtual``);
3. the microbatch rule, if any (rule ``<schedule>.microbatches``, key ``microbatches``);
4. fewer microbatches than the family fills its pipeline with: a
   :class:`~pipec.schedules.order.ScheduleWarning` (same rule and key).

The reference page's schedule table is written from the same data
(:attr:`ScheduleInfo.microbatches_doc`), so the page and the checks agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pipec.schedules.order import ComputeOrder, ScheduleError, ScheduleWarning, Setting, check_counts

__all__ = ["SAME", "MultipleOf", "FewMicrobatches", "ScheduleInfo"]

SAME = object()
"""In :attr:`ScheduleInfo.chunks_instead`: the chunks per rank the user asked for."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MultipleOf:
    """The microbatch count must be a multiple of ``of(P, M)``."""

    of: Callable[[int, int], int]
    """``of(num_ranks, num_microbatches)``: what M must be a multiple of."""
    message: str
    """What must hold: ``str.format`` text with ``{name}`` (the family) and ``{of}``."""
    doc: str
    """The rule in the reference page's words (``pp`` for the ranks)."""

    def fits(self, num_ranks: int, num_microbatches: int) -> bool:
        return num_microbatches % self.of(num_ranks, num_microbatches) == 0

    def nearest(self, num_ranks: int, num_microbatches: int) -> tuple[tuple[Setting, ...], ...]:
        """The closest counts below and above ``num_microbatches`` (up to twice it) that fit, as fixes."""
        below = range(num_microbatches - 1, 0, -1)
        above = range(num_microbatches + 1, 2 * num_microbatches + 1)
        found = (next((m for m in side if self.fits(num_ranks, m)), None) for side in (below, above))
        return tuple((("microbatches", m),) for m in found if m is not None)


@dataclass(frozen=True, slots=True, kw_only=True)
class FewMicrobatches:
    """Legal but wasteful: fewer than ``per_rank * P + offset`` microbatches (the count that fills the pipeline)."""

    message: str
    """``str.format`` text with ``{name}``, ``{M}``, ``{P}``, ``{least}`` (the count that fills it),
    and the fill-and-drain slots of a one-chunk pipeline: ``{idle}`` = P - 1 of ``{slots}`` = M + P - 1."""
    per_rank: int = 1
    offset: int = 0

    def least(self, num_ranks: int) -> int:
        """The fewest microbatches that do not warn."""
        return self.per_rank * num_ranks + self.offset

    @property
    def doc(self) -> str:
        """The threshold in the reference page's words: ``pp``, ``2 pp - 1``."""
        text = "pp" if self.per_rank == 1 else f"{self.per_rank} pp"
        return text + (f" + {self.offset}" if self.offset > 0 else f" - {-self.offset}" if self.offset < 0 else "")


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleInfo:
    """One named schedule family: what it is, how to build it, and its rules as data."""

    name: str
    """Registry name: the ``schedule`` key's value."""
    build: Callable[..., ComputeOrder]
    """``build(num_ranks=, num_microbatches=, num_chunks=)`` for counts that :meth:`check` accepted."""
    reference: str
    """One line: what the order equals (a torch class, or a paper)."""
    few_microbatches: FewMicrobatches
    """When the count of microbatches is legal but wasteful (a warning)."""
    placement: str = "loop"
    """Stage-to-rank placement: ``"loop"`` (s mod P) or ``"v"``."""
    split_backward: bool = False
    """Whether the backward is split into ``I`` and ``W``."""
    min_chunks: int = 1
    """Fewest chunks per rank the family takes; also its default (``virtual`` unset)."""
    max_chunks: int | None = 1
    """Most chunks per rank the family takes (None: no upper limit)."""
    chunks_note: str = ""
    """Words added, in parentheses, to the chunk rule's message."""
    chunks_instead: tuple[Setting, ...] = ()
    """The chunk error's second fix, another family (:data:`SAME`: the chunks asked for);
    the first is the nearest allowed ``virtual``."""
    microbatches: MultipleOf | None = None
    """A rule on the microbatch count beyond ``>= 1``."""

    @property
    def default_chunks(self) -> int:
        """Chunks per rank when ``--virtual`` is not given."""
        return self.min_chunks

    def chunks_allowed(self, num_chunks: int) -> bool:
        """Whether ``num_chunks`` per rank is within the family's range."""
        return num_chunks >= self.min_chunks and (self.max_chunks is None or num_chunks <= self.max_chunks)

    @property
    def microbatches_doc(self) -> str:
        """The microbatch rule and its warning in the reference page's words."""
        rule = self.microbatches.doc if self.microbatches else "M >= 1"
        return f"{rule} (M < {self.few_microbatches.doc} warns)"

    def _chunks_message(self) -> str:
        lo, hi = self.min_chunks, self.max_chunks
        amount = (f"exactly {lo} chunk{'s' * (lo != 1)}" if lo == hi
                  else f"at least {lo} chunks" if hi is None else f"{lo} to {hi} chunks")
        note = f" ({self.chunks_note})" if self.chunks_note else ""
        return f"{self.name} {'runs' if hi == 1 else 'needs'} {amount} per rank{note}"

    def check(self, *, num_ranks: int, num_microbatches: int, num_chunks: int) -> list[ScheduleWarning]:
        """Apply the family's rules (see the module docstring): raise :class:`ScheduleError` on a broken one,
        return the warnings (each with its fix) for legal but wasteful settings."""
        name, P, M, v = self.name, num_ranks, num_microbatches, num_chunks
        check_counts(name, num_ranks=P, num_microbatches=M, num_chunks=v)
        if not self.chunks_allowed(v):
            nearest = max(self.min_chunks, v if self.max_chunks is None else min(v, self.max_chunks))
            instead = tuple((k, v if value is SAME else value) for k, value in self.chunks_instead)
            raise ScheduleError(self._chunks_message(), got=(("virtual", v),),
                                fix=((("virtual", nearest),),) + ((instead,) if instead else ()),
                                rule=f"{name}.chunks", key="virtual")
        rule = self.microbatches
        if rule is not None and not rule.fits(P, M):
            raise ScheduleError(rule.message.format(name=name, of=rule.of(P, M)),
                                got=(("microbatches", M), ("pp", P)), fix=rule.nearest(P, M),
                                rule=f"{name}.microbatches", key="microbatches")
        few = self.few_microbatches
        least = few.least(P)
        if M >= least:
            return []
        text = few.message.format(name=name, M=M, P=P, least=least, idle=P - 1, slots=M + P - 1)
        return [ScheduleWarning("warning", text, key="microbatches", fix=((("microbatches", f">= {least}"),),),
                                rule=f"{name}.microbatches")]
