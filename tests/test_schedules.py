"""Schedule families: invariants over sweeps, unit-cost bubbles, rules, golden orders.

Unit costs are DESIGN's (F=1, B=2, I=W=1, communication free), run by the
list-scheduling estimator of pipec.schedules.timing.
"""

from __future__ import annotations

import re
import subprocess
import sys
from fractions import Fraction

import pytest

from pipec.schedules import (
    SCHEDULES,
    Action,
    ComputeOrder,
    Kind,
    ScheduleError,
    build_order,
    check_rules,
    get_schedule,
    loop_placement,
    v_placement,
    validate_order,
)
from pipec.schedules.timing import estimate, peak_in_flight

RANKS = range(1, 9)
CHUNKS = range(1, 4)


def sweep():
    for P in RANKS:
        for M in range(1, 4 * P + 1):
            for v in CHUNKS:
                yield P, M, v


def unit_bubble(order: ComputeOrder) -> Fraction:
    e = estimate(order)
    return Fraction(round(e.step_time * len(e.busy) - sum(e.busy)), round(e.step_time * len(e.busy)))


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_sweep_orders_are_valid(name):
    """Every config the rules allow builds a valid, runnable order of the right shape;
    every config they refuse names the broken rule."""
    info = get_schedule(name)
    built = 0
    for P, M, v in sweep():
        try:
            check_rules(name, num_ranks=P, num_microbatches=M, num_chunks=v)
        except ScheduleError as error:
            assert error.rule in (f"{name}.chunks", f"{name}.microbatches"), error.rule
            assert (error.rule == f"{name}.chunks") == (not info.chunks_allowed(v))
            with pytest.raises(ScheduleError):
                build_order(name, num_ranks=P, num_microbatches=M, num_chunks=v)
            continue
        order = build_order(name, num_ranks=P, num_microbatches=M, num_chunks=v)
        built += 1
        validate_order(order)
        expected = (v_placement if info.placement == "v" else loop_placement)(P, v * P)
        assert order.placement == expected
        assert order.num_ranks == P and order.num_microbatches == M
        kinds = {a.kind for actions in order.ranks for a in actions}
        assert kinds == ({Kind.F, Kind.I, Kind.W} if info.split_backward else {Kind.F, Kind.B})
        for actions in order.ranks:
            assert len(actions) == v * M * (3 if info.split_backward else 2)
        estimate(order)  # runs to completion on the chain stage graph
    assert built > 0


def test_unknown_schedule_suggests_a_name():
    with pytest.raises(ScheduleError) as info:
        get_schedule("interleaved1f1b")
    assert info.value.rule == "schedule.name"
    assert "did you mean 'interleaved_1f1b'" in str(info.value)
    assert "gpipe, 1f1b, interleaved_1f1b, looped_bfs, zb_h1, zbv, interleaved_zb" in str(info.value)
    with pytest.raises(ScheduleError):
        build_order("zigzag", num_ranks=2, num_microbatches=2)
    with pytest.raises(ScheduleError, match="ScheduleDualPipeV .*which pipec does not have yet"):
        get_schedule("dualpipev")
    with pytest.raises(ScheduleError, match="torch's name for pipec's interleaved_zb"):
        get_schedule("ScheduleInterleavedZeroBubble")
    with pytest.raises(ScheduleError, match="torch's name for pipec's 1f1b; write: schedule 1f1b"):
        get_schedule("Schedule1F1B")


@pytest.mark.parametrize(
    "name,kwargs,rule,text",
    [
        ("zbv", dict(num_chunks=3), "zbv.chunks", "zbv needs exactly 2 chunks per rank, got virtual 3; use virtual 2"),
        ("1f1b", dict(num_chunks=2), "1f1b.chunks", "use virtual 1, or schedule interleaved_1f1b virtual 2"),
        ("gpipe", dict(num_chunks=2), "gpipe.chunks", "schedule looped_bfs"),
        ("zb_h1", dict(num_chunks=2), "zb_h1.chunks", "use virtual 1"),
        ("interleaved_1f1b", dict(num_chunks=1), "interleaved_1f1b.chunks", "use virtual 2"),
        ("looped_bfs", dict(num_chunks=1), "looped_bfs.chunks", "use virtual 2"),
        ("interleaved_1f1b", dict(num_microbatches=9), "interleaved_1f1b.microbatches",
         "got microbatches 9 with pp 4; use microbatches 8 or 10"),
        ("1f1b", dict(num_ranks=0), "1f1b.ranks", "pp 1 or more"),
        ("gpipe", dict(num_microbatches=-3), "gpipe.microbatches", "got microbatches -3"),
        ("zbv", dict(num_microbatches=True), "zbv.microbatches", "whole number"),
        ("looped_bfs", dict(num_chunks=2.0), "looped_bfs.chunks", "whole number"),
    ],
)
def test_rule_errors_name_the_rule(name, kwargs, rule, text):
    args = dict(num_ranks=4, num_microbatches=8, num_chunks=None) | kwargs
    for call in (check_rules, build_order):
        with pytest.raises(ScheduleError) as info:
            call(name, **args)
        assert info.value.rule == rule
        assert text in str(info.value)
        assert "--" not in str(info.value)  # keys, never CLI flags: the language words those
        assert info.value.key == {"chunks": "virtual", "ranks": "pp"}.get(rule.split(".")[1], "microbatches")
        assert isinstance(info.value, ValueError)


def test_rule_errors_carry_their_settings_for_the_language_to_word():
    with pytest.raises(ScheduleError) as info:
        check_rules("interleaved_1f1b", num_ranks=4, num_microbatches=9)
    err = info.value
    assert (err.key, err.got, err.fix) == ("microbatches", (("microbatches", 9), ("pp", 4)),
                                           ((("microbatches", 8),), (("microbatches", 10),)))
    flags = {"pp": "--ranks", "microbatches": "--microbatches"}
    assert err.worded(flags.get).endswith("got --microbatches 9 with --ranks 4; use --microbatches 8 or 10")


def test_warnings_for_wasteful_settings():
    assert check_rules("1f1b", num_ranks=4, num_microbatches=8) == []
    (warning,) = check_rules("1f1b", num_ranks=4, num_microbatches=3)
    assert (warning.level, warning.key) == ("warning", "microbatches")
    assert "fewer microbatches (3) than ranks (4)" in str(warning) and str(warning).endswith("use microbatches >= 4")
    assert check_rules("gpipe", num_ranks=4, num_microbatches=2)
    assert check_rules("zbv", num_ranks=4, num_microbatches=4)
    assert check_rules("zbv", num_ranks=4, num_microbatches=7) == []
    assert check_rules("interleaved_1f1b", num_ranks=4, num_microbatches=4, num_chunks=3) == []


# Each family's rules are data (pipec.schedules.rules); these are the messages they must word, to the letter:
# the chunk error at pp 4, microbatches 8 (virtual 3, or 1 where the family needs more), then the warning at
# pp 4, microbatches 2.
GOLDEN_RULES = {
    "gpipe": (3, "gpipe runs exactly 1 chunk per rank (looped_bfs is its order over several chunks), got virtual 3; "
              "use virtual 1, or schedule looped_bfs",
              "gpipe with fewer microbatches (2) than ranks (4): every rank idles at least 3 of 5 slots; "
              "use microbatches >= 4"),
    "1f1b": (3, "1f1b runs exactly 1 chunk per rank, got virtual 3; use virtual 1, or schedule interleaved_1f1b "
             "virtual 3",
             "1f1b with fewer microbatches (2) than ranks (4) never reaches its steady state (torch's Schedule1F1B "
             "refuses it); use microbatches >= 4"),
    "interleaved_1f1b": (1, "interleaved_1f1b needs at least 2 chunks per rank, got virtual 1; use virtual 2, or "
                         "schedule 1f1b",
                         "interleaved_1f1b with fewer microbatches (2) than ranks (4) never reaches its steady state; "
                         "use microbatches >= 4"),
    "looped_bfs": (1, "looped_bfs needs at least 2 chunks per rank, got virtual 1; use virtual 2, or schedule gpipe",
                   "looped_bfs with fewer microbatches (2) than ranks (4) leaves every rank idle between its chunks; "
                   "use microbatches >= 4"),
    "zb_h1": (3, "zb_h1 runs exactly 1 chunk per rank (zbv is the two-chunk zero-bubble schedule), got virtual 3; "
              "use virtual 1, or schedule zbv virtual 2",
              "zb_h1 with fewer microbatches (2) than ranks (4) has little steady state to fill; "
              "use microbatches >= 4"),
    "zbv": (1, "zbv needs exactly 2 chunks per rank, got virtual 1; use virtual 2",
            "zbv fills its pipeline with 2P - 1 = 7 microbatches; with 2 its warm-up and cool-down are not overlapped; "
            "use microbatches >= 7"),
    "interleaved_zb": (1, "interleaved_zb needs at least 2 chunks per rank (zb_h1 is the one-chunk zero-bubble "
                       "schedule), got virtual 1; use virtual 2, or schedule zb_h1",
                       "interleaved_zb with fewer microbatches (2) than ranks (4) never reaches its steady state; "
                       "use microbatches >= 4"),
}


def test_golden_rule_messages():
    assert set(GOLDEN_RULES) == set(SCHEDULES)
    for name, (v, chunks, warning) in GOLDEN_RULES.items():
        with pytest.raises(ScheduleError) as info:
            check_rules(name, num_ranks=4, num_microbatches=8, num_chunks=v)
        assert (str(info.value), info.value.rule, info.value.key) == (chunks, f"{name}.chunks", "virtual")
        assert info.value.got == (("virtual", v),)
        (w,) = check_rules(name, num_ranks=4, num_microbatches=2)
        assert (str(w), w.rule, w.key, w.level) == (warning, f"{name}.microbatches", "microbatches", "warning")
    with pytest.raises(ScheduleError) as info:
        check_rules("interleaved_1f1b", num_ranks=3, num_microbatches=7, num_chunks=2)
    assert str(info.value) == (
        "interleaved_1f1b needs the microbatches to be a multiple of its rounds, max(1, M // P) = 2 (torch's "
        "ScheduleInterleaved1F1B rule), got microbatches 7 with pp 3; use microbatches 6 or 8")


def _doc_value(expr: str, P: int, M: int) -> int:
    """A rule as the reference page words it (``2 pp - 1``, ``max(1, M // pp)``), at these counts."""
    return eval(re.sub(r"(\d) pp", r"\1 * pp", expr), {"max": max}, {"pp": P, "M": M})


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_documented_rules_are_the_checked_ones(name):
    """The reference page's microbatch column (written from the same data) says what the check does."""
    doc = SCHEDULES[name].microbatches_doc
    match = re.fullmatch(r"(?:M >= 1|M a multiple of (.+), torch's rule) \(M < (.+) warns\)", doc)
    assert match, doc
    multiple, threshold = match.groups()
    v = SCHEDULES[name].default_chunks
    for P in range(1, 6):
        for M in range(1, 11):
            try:
                warnings = check_rules(name, num_ranks=P, num_microbatches=M, num_chunks=v)
            except ScheduleError as error:
                assert multiple is not None and M % _doc_value(multiple, P, M), (P, M, error)
                continue
            assert multiple is None or M % _doc_value(multiple, P, M) == 0, (P, M)
            assert bool(warnings) == (M < _doc_value(threshold, P, M)), (P, M)


@pytest.mark.parametrize("P", RANKS)
def test_gpipe_and_1f1b_bubble_and_peak(P):
    for M in range(1, 4 * P + 1):
        formula = Fraction(P - 1, M + P - 1)
        gp = build_order("gpipe", num_ranks=P, num_microbatches=M)
        assert unit_bubble(gp) == formula
        assert peak_in_flight(gp) == (M,) * P
        ofob = build_order("1f1b", num_ranks=P, num_microbatches=M)
        assert unit_bubble(ofob) == formula  # the table claims M >= P; it holds below too
        assert peak_in_flight(ofob) == tuple(min(P - r, M) for r in range(P))


@pytest.mark.parametrize("P", RANKS)
def test_interleaved_bubble_when_p_divides_m(P):
    for M in range(P, 4 * P + 1, P):
        for v in (2, 3):
            order = build_order("interleaved_1f1b", num_ranks=P, num_microbatches=M, num_chunks=v)
            assert unit_bubble(order) == Fraction(P - 1, v * M + P - 1), (P, M, v)


@pytest.mark.parametrize("P", RANKS)
def test_zb_h1_a_third_of_1f1b_bubble_at_the_same_peak(P):
    """ZB-H1 (Qi et al. §3.1): idle per rank (P-1)(T_F + T_B - T_W) = P-1 against 1F1B's
    3(P-1); no rank holds more microbatches (F to W) than 1F1B's peak min(P, M)."""
    for M in range(P, 4 * P + 1):
        zb = build_order("zb_h1", num_ranks=P, num_microbatches=M)
        ofob = build_order("1f1b", num_ranks=P, num_microbatches=M)
        ez, eo = estimate(zb), estimate(ofob)
        assert ez.step_time == 3 * M + P - 1
        assert ez.step_time - 3 * M == (eo.step_time - 3 * M) / 3
        assert ez.bubble_fraction <= eo.bubble_fraction
        if P > 1:
            assert ez.bubble_fraction < eo.bubble_fraction
        assert max(ez.peak_in_flight) == max(eo.peak_in_flight) == min(P, M)
        # the W really move: the last rank runs input grads back to back after its warm-up
        last = [a.kind for a in zb.ranks[P - 1]]
        assert last[: 2 * min(P, M)] == [Kind.F, Kind.I] * min(P, M)


def test_zb_h1_below_p_stays_bounded():
    for P in RANKS:
        for M in range(1, P):
            zb = build_order("zb_h1", num_ranks=P, num_microbatches=M)
            assert max(peak_in_flight(zb)) <= M
            assert estimate(zb).bubble_fraction <= estimate(build_order("1f1b", num_ranks=P, num_microbatches=M)).bubble_fraction


def test_zbv_bubble_matches_design_and_falls_with_m():
    assert unit_bubble(build_order("zbv", num_ranks=4, num_microbatches=8)) == Fraction(1, 17)  # 0.0588
    for P in range(2, 9):
        bubbles = [estimate(build_order("zbv", num_ranks=P, num_microbatches=M)).bubble_fraction for M in range(1, 4 * P + 1)]
        assert all(a > b for a, b in zip(bubbles, bubbles[1:])), P
        # ZB-V holds what 1F1B holds on rank 0: 2P chunk-microbatches of half the size
        assert max(peak_in_flight(build_order("zbv", num_ranks=P, num_microbatches=4 * P))) == 2 * P


GOLDEN = {
    ("gpipe", 2, 3, 1): """\
0: F0.0 F0.1 F0.2 B0.0 B0.1 B0.2
1: F1.0 F1.1 F1.2 B1.0 B1.1 B1.2""",
    ("1f1b", 3, 4, 1): """\
0: F0.0 F0.1 F0.2 B0.0 F0.3 B0.1 B0.2 B0.3
1: F1.0 F1.1 B1.0 F1.2 B1.1 F1.3 B1.2 B1.3
2: F2.0 B2.0 F2.1 B2.1 F2.2 B2.2 F2.3 B2.3""",
    ("1f1b", 3, 2, 1): """\
0: F0.0 F0.1 B0.0 B0.1
1: F1.0 F1.1 B1.0 B1.1
2: F2.0 B2.0 F2.1 B2.1""",
    ("interleaved_1f1b", 2, 4, 2): """\
0: F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 B0.2 B0.3
1: F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2 B1.0 F1.3 B1.1 F3.2 B3.2 F3.3 B3.3 B1.2 B1.3""",
    ("looped_bfs", 2, 2, 2): """\
0: F0.0 F0.1 F2.0 F2.1 B2.1 B2.0 B0.1 B0.0
1: F1.0 F1.1 F3.0 F3.1 B3.1 B3.0 B1.1 B1.0""",
    ("zb_h1", 3, 4, 1): """\
0: F0.0 F0.1 F0.2 I0.0 W0.0 F0.3 I0.1 W0.1 I0.2 W0.2 I0.3 W0.3
1: F1.0 F1.1 I1.0 F1.2 I1.1 W1.0 F1.3 I1.2 W1.1 I1.3 W1.2 W1.3
2: F2.0 I2.0 F2.1 I2.1 F2.2 I2.2 W2.0 F2.3 I2.3 W2.1 W2.2 W2.3""",
    ("zbv", 2, 3, 2): """\
0: F0.0 F0.1 F0.2 F3.0 I3.0 W3.0 F3.1 I3.1 W3.1 I0.0 W0.0 F3.2 I3.2 W3.2 I0.1 W0.1 I0.2 W0.2
1: F1.0 F2.0 F1.1 F2.1 I2.0 W2.0 F1.2 I1.0 W1.0 F2.2 I2.1 W2.1 I1.1 I2.2 I1.2 W1.1 W2.2 W1.2""",
}


@pytest.mark.parametrize("key", list(GOLDEN))
def test_golden_text(key):
    name, P, M, v = key
    assert build_order(name, num_ranks=P, num_microbatches=M, num_chunks=v).text() == GOLDEN[key]


def test_estimator_by_hand():
    """1f1b, P=2, M=2: rank 1 F1.0 [1,2] B1.0 [2,4] F1.1 [4,5] B1.1 [5,7];
    rank 0 F0.0 [0,1] F0.1 [1,2] B0.0 [4,6] B0.1 [7,9]."""
    e = estimate(build_order("1f1b", num_ranks=2, num_microbatches=2))
    assert e.starts == ((0, 1, 4, 7), (1, 2, 4, 5))
    assert e.step_time == 9 and e.busy == (6, 6)
    assert e.bubble_fraction == pytest.approx(1 / 3)
    assert e.rank_bubble(0) == pytest.approx(1 / 3)


def test_estimator_reports_a_deadlock():
    P, M = 2, 1
    bad = ComputeOrder(
        num_ranks=P,
        num_microbatches=M,
        placement=(0, 1),
        ranks=((Action(Kind.B, 0, 0), Action(Kind.F, 0, 0)), (Action(Kind.F, 1, 0), Action(Kind.B, 1, 0))),
    )
    with pytest.raises(ScheduleError) as info:
        estimate(bad)
    assert info.value.rule == "order.deadlock"
    assert "rank 0: action 0 (B0.0)" in str(info.value)
    assert "rank 1: action 0 (F1.0) waits for F of stage 0 microbatch 0 on rank 0" in str(info.value)


def test_an_action_is_a_frozen_record():
    a = Action(Kind.I, 3, 7)
    assert (a.kind, a.stage, a.microbatch) == (Kind.I, 3, 7) and str(a) == "I3.7"
    with pytest.raises(AttributeError):
        a.stage = 2


def test_import_is_light():
    code = (
        "import sys, pipec.schedules, pipec.schedules.policy, pipec.schedules.timing; "
        "heavy = [m for m in ('torch', 'networkx', 'numpy') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-P", "-c", code], check=True)
