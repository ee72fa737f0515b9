"""Policy-defined schedules: presets and explicit forms equal the named ones; bad policies fail clearly."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipec.schedules import SCHEDULES, Kind, ScheduleError, build_order, validate_order
from pipec.schedules.policy import PRESETS, Policy, policy_order
from pipec.schedules.timing import estimate, peak_in_flight


def named_configs(name):
    info = SCHEDULES[name]
    for P in range(1, 9):
        for M in range(1, 4 * P + 1):
            for v in range(1, 4):
                if not info.chunks_allowed(v):
                    continue
                try:
                    yield P, M, v, build_order(name, num_ranks=P, num_microbatches=M, num_chunks=v)
                except ScheduleError:
                    continue


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_equals_named_schedule(name):
    count = 0
    for P, M, v, reference in named_configs(name):
        assert policy_order(PRESETS[name], num_ranks=P, num_microbatches=M, num_chunks=v) == reference, (P, M, v)
        count += 1
    assert count > 100


def torch_interleaved_warmup(P, M, v):
    """The expression of issue 3, as the language binds it: a function of the rank."""
    return lambda rank: min((v - 1) * (M // max(1, M // P)) + 2 * (P - 1 - rank), v * M)


EXPLICIT = {
    "gpipe": lambda P, M, v: Policy(warmup=lambda rank: v * M),
    "1f1b": lambda P, M, v: Policy(warmup=lambda rank: min(P - rank, M), priority="backward"),
    "interleaved_1f1b": lambda P, M, v: Policy(warmup=torch_interleaved_warmup(P, M, v), priority="forward"),
    "looped_bfs": lambda P, M, v: Policy(
        warmup=lambda rank: v * M, chunk_order="breadth_first", backward_microbatches="descending"
    ),
}


@pytest.mark.parametrize("name", list(EXPLICIT))
def test_explicit_warmup_forms_equal_named_schedule(name):
    for P, M, v, reference in named_configs(name):
        policy = EXPLICIT[name](P, M, v)
        assert policy_order(policy, num_ranks=P, num_microbatches=M, num_chunks=v) == reference, (P, M, v)


def test_1f1b_as_forward_priority_with_one_less_warmup():
    """Megatron's form: P-r-1 warm-up forwards, then forward-first pairs, is the same order."""
    for P, M, v, reference in named_configs("1f1b"):
        policy = Policy(warmup=lambda rank: min(P - rank - 1, M), priority="forward")
        assert policy_order(policy, num_ranks=P, num_microbatches=M, num_chunks=v) == reference


def test_defaults_do_not_depend_on_priority():
    for P, M, v in [(4, 8, 1), (4, 8, 2), (3, 7, 3), (5, 3, 2)]:
        a = policy_order(Policy(priority="backward"), num_ranks=P, num_microbatches=M, num_chunks=v)
        b = policy_order(Policy(priority="forward"), num_ranks=P, num_microbatches=M, num_chunks=v)
        assert a == b


def test_weight_grad_placements():
    P, M = 4, 8
    base = Policy(split_backward=True)
    immediate = policy_order(base, num_ranks=P, num_microbatches=M, num_chunks=1)
    for actions in immediate.ranks:
        for i, a in enumerate(actions):
            if a.kind is Kind.I:
                assert actions[i + 1] == type(a)(Kind.W, a.stage, a.microbatch)
    end = policy_order(replace(base, weight_grad="end"), num_ranks=P, num_microbatches=M, num_chunks=1)
    for actions in end.ranks:
        kinds = [a.kind for a in actions]
        assert kinds[-M:] == [Kind.W] * M and Kind.W not in kinds[:-M]
        assert [a.microbatch for a in actions if a.kind is Kind.W] == list(range(M))
    assert peak_in_flight(end) == (M,) * P
    # split with W right after I is 1F1B with B cut in two: same peaks, a smaller unit-cost bubble
    ofob = build_order("1f1b", num_ranks=P, num_microbatches=M)
    assert peak_in_flight(immediate) == peak_in_flight(ofob)
    assert estimate(immediate).bubble_fraction < estimate(ofob).bubble_fraction


@pytest.mark.parametrize("P", range(1, 9))
def test_bubbles_with_the_per_rank_bound(P):
    """weight_grad bubbles with the default bound keeps 1F1B's min(P-r, M) on every rank;
    then 2(P-1) idle per rank is the best there is (see zero_bubble's docstring)."""
    policy = Policy(split_backward=True, weight_grad="bubbles")
    for M in range(1, 4 * P + 1):
        order = policy_order(policy, num_ranks=P, num_microbatches=M, num_chunks=1)
        validate_order(order)
        assert peak_in_flight(order) == tuple(min(P - r, M) for r in range(P))
        if M >= P:
            assert estimate(order).step_time == 3 * M + 2 * P - 2
    # "max" is the named zb_h1; a callable bound works too
    for M in (P, 2 * P):
        paper = policy_order(replace(policy, max_in_flight=lambda rank: P), num_ranks=P, num_microbatches=M, num_chunks=1)
        assert paper == build_order("zb_h1", num_ranks=P, num_microbatches=M)


def test_multi_chunk_policies_beyond_the_named_ones():
    """Zero-bubble split on the interleaved order, and the V placement: valid, runnable, and
    the split with W in the bubbles beats the unsplit interleaved order."""
    P, M = 4, 8
    interleaved = build_order("interleaved_1f1b", num_ranks=P, num_microbatches=M)
    zb = policy_order(
        replace(PRESETS["interleaved_1f1b"], split_backward=True, weight_grad="bubbles"),
        num_ranks=P, num_microbatches=M, num_chunks=2,
    )
    validate_order(zb)
    assert peak_in_flight(zb) == peak_in_flight(interleaved)
    assert estimate(zb).bubble_fraction < estimate(interleaved).bubble_fraction
    for policy in (Policy(placement="v"), Policy(placement="v", split_backward=True, weight_grad="bubbles")):
        order = policy_order(policy, num_ranks=P, num_microbatches=M, num_chunks=2)
        validate_order(order)
        assert order.placement == (0, 1, 2, 3, 3, 2, 1, 0)
        estimate(order)


@pytest.mark.parametrize(
    "policy,counts,rule,text",
    [
        (Policy(warmup=lambda r: -1), (4, 8, 1), "policy.warmup", "must be in 0..8"),
        (Policy(warmup=lambda r: 9), (4, 8, 1), "policy.warmup", "cap it with min(..., chunks*M)"),
        (Policy(warmup=lambda r: 2.5), (4, 8, 1), "policy.warmup", "whole number, got 2.5"),
        (Policy(warmup=lambda r: True), (4, 8, 1), "policy.warmup", "whole number"),
        (Policy(warmup=lambda r: 0), (2, 2, 2), "policy.warmup", "the warm-up must be at least 3 on every rank"),
        (Policy(warmup=lambda r: (3, 4)[r]), (2, 2, 2), "policy.deadlock",
         "rank 1: action 3 (F3.1) waits for F of stage 2 microbatch 1 on rank 0"),
        (Policy(placement="v"), (4, 8, 3), "policy.chunks", "needs exactly 2 chunks per rank (or placement 'loop'), got virtual 3"),
        (Policy(), (0, 8, 1), "policy.ranks", "got pp 0; use pp 1 or more"),
        (Policy(split_backward=True, weight_grad="bubbles", max_in_flight=lambda r: 2), (4, 8, 1),
         "policy.max_in_flight", "on rank 0 must be a whole number >= 4"),
    ],
)
def test_policies_that_cannot_run_say_why(policy, counts, rule, text):
    P, M, v = counts
    with pytest.raises(ScheduleError) as info:
        policy_order(policy, num_ranks=P, num_microbatches=M, num_chunks=v)
    assert info.value.rule == rule
    assert text in str(info.value)


@pytest.mark.parametrize(
    "fields,rule,text",
    [
        (dict(priority="backwards"), "policy.priority", "did you mean 'backward'?"),
        (dict(weight_grad="bubble", split_backward=True), "policy.weight_grad", "did you mean 'bubbles'?"),
        (dict(chunk_order="depth-first"), "policy.chunk_order", "did you mean 'depth_first'?"),
        (dict(placement="zigzag"), "policy.placement", "must be one of 'loop', 'v'"),
        (dict(weight_grad="end"), "policy.weight_grad", "split_backward is off"),
        (dict(max_in_flight="max"), "policy.max_in_flight", "bounds weight_grad 'bubbles' only"),
        (dict(split_backward=True, weight_grad="bubbles", max_in_flight="min"), "policy.max_in_flight", "'max'"),
        (dict(warmup="some"), "policy.warmup", "'all'"),
        (dict(split_backward=1), "policy.split_backward", "true or false"),
    ],
)
def test_bad_policy_fields(fields, rule, text):
    with pytest.raises(ScheduleError) as info:
        Policy(**fields)
    assert info.value.rule == rule
    assert text in str(info.value)


policies = st.builds(
    Policy,
    warmup=st.one_of(
        st.none(),
        st.just("all"),
        st.lists(st.integers(-1, 40), min_size=8, max_size=8).map(lambda ws: (lambda r: ws[r])),
    ),
    priority=st.sampled_from(["backward", "forward"]),
    chunk_order=st.sampled_from(["depth_first", "breadth_first"]),
    placement=st.sampled_from(["loop", "v"]),
    backward_microbatches=st.sampled_from(["ascending", "descending"]),
).flatmap(
    lambda p: st.sampled_from(
        [p, replace(p, split_backward=True), replace(p, split_backward=True, weight_grad="end"),
         replace(p, split_backward=True, weight_grad="bubbles"),
         replace(p, split_backward=True, weight_grad="bubbles", max_in_flight="max")]
    )
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=policies, P=st.integers(1, 6), M=st.integers(1, 12), v=st.integers(1, 3))
def test_random_policies_build_a_runnable_order_or_say_why(policy, P, M, v):
    try:
        order = policy_order(policy, num_ranks=P, num_microbatches=M, num_chunks=v)
    except ScheduleError as error:
        assert error.rule.startswith("policy.")
        assert str(error)
        return
    validate_order(order)
    estimate(order)  # completes: no two ranks wait on each other


@pytest.mark.parametrize("P", range(1, 9))
def test_default_policies_always_run(P):
    """Policies left at their defaults (any priority, chunk order, split) never fail on the loop placement."""
    for M in range(1, 4 * P + 1):
        for v in (1, 2, 3):
            for policy in (Policy(), Policy(chunk_order="breadth_first"), Policy(backward_microbatches="descending"),
                           Policy(split_backward=True, weight_grad="bubbles")):
                validate_order(policy_order(policy, num_ranks=P, num_microbatches=M, num_chunks=v))
