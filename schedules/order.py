"""Compute orders: what each pp rank computes, and in which order.

A :class:`ComputeOrder` is the output of every schedule family and the input of
the compiler's lowering pass. It holds compute actions only (no
communication); the lowering adds sends, receives and collectives. Everything
here is pure Python over integers, so a schedule can be generated, checked and
golden-tested without torch.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, NamedTuple, Sequence

from pipec.errors import Diagnostic, PipecError

__all__ = [
    "Kind",
    "Action",
    "ComputeOrder",
    "ScheduleError",
    "ScheduleWarning",
    "Setting",
    "Worded",
    "word",
    "loop_placement",
    "v_placement",
    "validate_order",
    "check_counts",
    "gc_paused",
]


Setting = tuple[str, Any]
"""A key and a value, ``("virtual", 2)``: worded ``virtual 2`` in a file, ``--virtual 2`` on the command line."""


def word(message: str, got: Sequence[Setting] = (), fix: Sequence[Sequence[Setting]] = (),
         name: Callable[[str], str] = str) -> str:
    """``message``, then ``, got K V with K V``, then ``; use K V, or K V`` (a fix's alternatives).

    ``name`` words a key: its own name (the default) or the flag it came from;
    alternatives that set one key the same way share it (``use microbatches 8 or 10``).
    """
    text = message
    if got:
        text += ", got " + " with ".join(f"{name(k)} {v}" for k, v in got)
    if fix:
        keys = {alt[0][0] for alt in fix if len(alt) == 1}
        if len(keys) == 1 and all(len(alt) == 1 for alt in fix):
            text += f"; use {name(fix[0][0][0])} " + " or ".join(str(alt[0][1]) for alt in fix)
        else:
            text += "; use " + ", or ".join(" ".join(f"{name(k)} {v}" for k, v in alt) for alt in fix)
    return text


class Worded:
    """A complaint about settings: ``message`` (what must hold), ``got`` (the
    settings at fault) and ``fix`` (alternatives, each a few settings), worded
    by :func:`word`; the language words them with the names its user wrote."""

    __slots__ = ()
    message: str
    got: tuple[Setting, ...]
    fix: tuple[tuple[Setting, ...], ...]

    def worded(self, name: Callable[[str], str] = str) -> str:
        return word(self.message, self.got, self.fix, name)


class ScheduleError(Worded, PipecError):
    """A schedule's rule is broken by the requested configuration.

    ``rule`` names the rule (for example ``"zbv.chunks"``), so tools and tests
    can tell errors apart without matching on message text; ``key`` is the
    schedule-file key at fault (``virtual``), ``got`` and ``fix`` the settings
    found and the ones that would do (see :func:`word`); for an order, ``rank``
    and ``index`` name the action at fault (``index`` None: the whole rank).
    ``str()`` words the settings by their keys, never by CLI flags.
    """

    def __init__(self, message: str, *, rule: str = "", key: str | None = None, got: Sequence[Setting] = (),
                 fix: Sequence[Sequence[Setting]] = (), rank: int | None = None, index: int | None = None,
                 hints: Sequence[str] = ()) -> None:
        self.message = message
        self.rule = rule
        self.got = tuple(got)
        self.fix = tuple(tuple(alt) for alt in fix)
        self.rank = rank
        super().__init__(word(message, self.got, self.fix), key=key, index=index, hints=tuple(hints))


@dataclass(frozen=True, slots=True)
class ScheduleWarning(Worded, Diagnostic):
    """A legal but wasteful setting (1f1b with fewer microbatches than ranks),
    worded like a :class:`ScheduleError`; a :class:`~pipec.errors.Diagnostic`
    about ``key``."""

    got: tuple[Setting, ...] = ()
    fix: tuple[tuple[Setting, ...], ...] = ()
    rule: str = ""

    def __str__(self) -> str:
        return self.worded()


class Kind(str, Enum):
    """The four compute kinds. Their values are the text-form letters."""

    F = "F"
    """Forward of one stage on one microbatch (the last stage also computes the loss)."""
    B = "B"
    """Full backward: input grads and weight grads together."""
    I = "I"  # noqa: E741 (the letter is the contract)
    """Input-grad half of a split backward (zero-bubble schedules)."""
    W = "W"
    """Weight-grad half of a split backward; comes after the matching ``I``."""


class Action(NamedTuple):
    """One compute action: ``kind`` of ``stage`` on ``microbatch``.

    A typed immutable record like the frozen dataclasses elsewhere, but a
    ``NamedTuple``: generators build up to ~10^6 of them (interleaved_1f1b at
    P=64, v=2, M=1024 builds 262,144), and a tuple is several times cheaper
    to build than a frozen dataclass.
    """

    kind: Kind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind.value}{self.stage}.{self.microbatch}"


@dataclass(frozen=True, slots=True, kw_only=True)
class ComputeOrder:
    """Per pp rank, the compute actions it runs, in order.

    ``placement[s]`` is the pp rank that owns stage ``s``; ``ranks[r]`` is the
    ordered tuple of actions of pp rank ``r``.
    """

    num_ranks: int
    num_microbatches: int
    placement: tuple[int, ...]
    ranks: tuple[tuple[Action, ...], ...]

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    def stages_of(self, rank: int) -> list[int]:
        """The stages pp rank ``rank`` owns, in model order."""
        return [s for s, r in enumerate(self.placement) if r == rank]

    def text(self) -> str:
        """One line per rank, e.g. ``0: F0.0 F0.1 B0.0 ...``."""
        return "\n".join(
            f"{r}: " + " ".join(str(a) for a in actions) for r, actions in enumerate(self.ranks)
        )


def loop_placement(num_ranks: int, num_stages: int) -> tuple[int, ...]:
    """Stage ``s`` on pp rank ``s mod P`` (torch's ``"loop"`` style)."""
    return tuple(s % num_ranks for s in range(num_stages))


def v_placement(num_ranks: int, num_stages: int) -> tuple[int, ...]:
    """The V shape: stages ``0..P-1`` go up the ranks, ``P..2P-1`` come back down."""
    if num_stages != 2 * num_ranks:
        raise ScheduleError(
            f"the v placement needs exactly 2 stages per rank ({2 * num_ranks} stages "
            f"for {num_ranks} ranks)", got=(("stages", num_stages),),
            rule="placement.v", key="placement",
        )
    return tuple(s if s < num_ranks else 2 * num_ranks - 1 - s for s in range(num_stages))


def validate_order(order: ComputeOrder) -> None:
    """Check the invariants every compute order must hold.

    - ``placement`` maps every stage to a rank in ``0..P-1`` and
      ``len(ranks) == P``;
    - every action's stage is owned by the rank that runs it;
    - every (stage, microbatch) has exactly one ``F`` and exactly one backward:
      one ``B``, or one ``I`` followed later by one ``W``;
    - on its rank, the ``F`` comes before the backward.

    Cross-stage data dependencies depend on the stage graph and are proved by
    the compiler's verifier. Raises :class:`ScheduleError` naming the rank and
    action.
    """
    num_ranks, num_mb = order.num_ranks, order.num_microbatches
    num_stages = order.num_stages
    if len(order.ranks) != num_ranks:
        raise ScheduleError(
            f"order has {len(order.ranks)} rank lists for {num_ranks} ranks", rule="order.ranks", key="order"
        )
    for s, r in enumerate(order.placement):
        if not 0 <= r < num_ranks:
            raise ScheduleError(
                f"stage {s} is placed on rank {r}, outside 0..{num_ranks - 1}",
                rule="order.placement", key="placement",
            )
    # state per (stage, mb): 0 nothing, 1 forward done, 2 input-grad done, 3 complete
    state = [[0] * num_mb for _ in range(num_stages)]
    for rank, actions in enumerate(order.ranks):
        for index, action in enumerate(actions):
            s, m = action.stage, action.microbatch
            problem = None  # (message, rule); the location is formatted only for an error
            if not (0 <= s < num_stages and 0 <= m < num_mb):
                problem = (f"stage must be in 0..{num_stages - 1} and microbatch in 0..{num_mb - 1}", "order.range")
            elif order.placement[s] != rank:
                problem = (f"stage {s} is placed on rank {order.placement[s]}, not {rank}", "order.placement")
            else:
                current = state[s][m]
                kind = action.kind
                if kind is Kind.F:
                    if current != 0:
                        problem = ("second forward", "order.duplicate")
                    state[s][m] = 1
                elif kind is Kind.B or kind is Kind.I:
                    if current == 0:
                        problem = ("backward before its forward", "order.deps")
                    elif current != 1:
                        problem = ("second backward", "order.duplicate")
                    state[s][m] = 3 if kind is Kind.B else 2
                else:  # W
                    if current != 2:
                        problem = (f"weight-grad W needs its input-grad I{s}.{m} earlier on the same rank", "order.deps")
                    state[s][m] = 3
            if problem is not None:
                raise ScheduleError(f"rank {rank}, action {index} ({action}): {problem[0]}", rule=problem[1],
                                    key="order", rank=rank, index=index)
    for s in range(num_stages):
        for m in range(num_mb):
            if state[s][m] != 3:
                missing = {0: "F, backward", 1: "backward", 2: f"W{s}.{m}"}[state[s][m]]
                raise ScheduleError(
                    f"rank {order.placement[s]}: stage {s} microbatch {m} is missing {missing}",
                    rule="order.missing", key="order", rank=order.placement[s],
                )


def check_counts(schedule: str, *, num_ranks: int, num_microbatches: int, num_chunks: int) -> None:
    """Refuse counts no schedule can take: each must be an integer >= 1.

    Raises :class:`ScheduleError` with rule ``<schedule>.ranks``,
    ``<schedule>.microbatches`` or ``<schedule>.chunks`` (keys ``pp``,
    ``microbatches``, ``virtual``).
    """
    for what, key, value in (
        ("ranks", "pp", num_ranks),
        ("microbatches", "microbatches", num_microbatches),
        ("chunks", "virtual", num_chunks),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(
                f"{schedule} needs a whole number of {what} >= 1", got=((key, repr(value)),),
                fix=(((key, "1 or more"),),), rule=f"{schedule}.{what}", key=key,
            )


class gc_paused:
    """Context manager: pause the cyclic garbage collector while building an order.

    A generator allocates hundreds of thousands of acyclic objects; each
    allocation burst would trigger collections that scan every object built
    so far. Restores the collector's previous state on exit.
    """

    __slots__ = ("_was_enabled",)

    def __enter__(self) -> None:
        self._was_enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self._was_enabled:
            gc.enable()
